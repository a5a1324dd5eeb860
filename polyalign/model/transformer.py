"""A decoder-only transformer in Flax NNX covering the Llama 3, Qwen2, Qwen3, Gemma 2 and Gemma 3 families.

Parameter names follow the Hugging Face modules (embed_tokens, layers.self_attn.q_proj, ...), so the
checkpoint mapping is one-to-one. The layers are stored stacked, with a leading layer axis, whether
the forward pass scans over them or unrolls them: one parameter layout for checkpoints and sharding.
Every parameter and large activation carries logical axis names (polyalign.mesh.parallel).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from polyalign.mesh import parallel as P
from polyalign.model import splash
from polyalign.model.architecture import ModelConfig
from polyalign.model.log_probs import chunked_token_log_probs, token_log_probs
from polyalign.model.lora_layer import LoraLinear

_INIT_STD = 0.02
_REMAT_POLICIES = {
    "full": None,  # save nothing, recompute the whole layer in the backward pass
    "dots": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


# --- pieces -------------------------------------------------------------------------------------

def rope_inverse_frequencies(cfg: ModelConfig, local: bool = False) -> np.ndarray:
    """Inverse frequencies of the rotary embedding, scaled when configured. `local`: those of a
    sliding-window layer, which has its own unscaled base in Gemma 3."""
    local = local and cfg.rope_local_theta is not None
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    inv_freq = 1.0 / (theta ** (np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim))
    s = None if local else cfg.rope_scaling
    if s is None:
        return inv_freq.astype(np.float32)
    if s.rope_type == "linear":
        return (inv_freq / s.factor).astype(np.float32)
    # Llama 3: long wavelengths are slowed by `factor`, short ones kept, and the band between the two
    # thresholds interpolated smoothly.
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = ((s.original_max_position_embeddings / wavelen - s.low_freq_factor)
              / (s.high_freq_factor - s.low_freq_factor))
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotary embedding in the rotate-half layout of Hugging Face checkpoints: the two halves of
    head_dim form the rotated pairs. x: [B, T, H, D], positions: [B, T]."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, D/2]
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SegmentMask:
    """Causal attention within packed segments, kept as the segment ids [B, T]: a kernel that takes
    segment ids (splash) never builds the [T, T] mask; `dense()` gives it to the others."""

    ids: jax.Array

    def dense(self) -> jax.Array:
        length = self.ids.shape[1]
        causal = jnp.tril(jnp.ones((length, length), bool))[None, None]
        return causal & (self.ids[:, :, None] == self.ids[:, None, :])[:, None]


def attention_masks(length: int, segment_ids: jax.Array | None, attention_mask: jax.Array | None,
                    batch: int, sliding_window: int | None,
                    branch_ids: jax.Array | None = None,
                    positions: jax.Array | None = None) -> tuple[jax.Array | SegmentMask | None, jax.Array | None]:
    """Boolean masks [B, 1, T, T] (True = may attend) for full and sliding-window layers; (None, None)
    when attention is causal only; (SegmentMask, None) for packed segments and nothing else.

    Causal; with segment ids (packed sequences) a token sees only its own segment; with branch ids as
    well, a segment is a tree: branch 0 is a prefix every branch of the segment sees, and a token of
    branch b > 0 sees that prefix and its own branch only (several responses to one prompt, the
    prompt computed once). With an attention mask (1 = real token) padding keys are hidden. A
    sliding-window layer also hides keys `sliding_window` or more positions back, counted in
    `positions` when given (in a tree, a branch's distance to the prefix is not its distance in the row).
    """
    if segment_ids is None and attention_mask is None and not sliding_window:
        return None, None  # causal only: attention applies it without a [T, T] mask
    if segment_ids is not None and attention_mask is None and branch_ids is None and not sliding_window:
        return SegmentMask(segment_ids), None
    q = jnp.arange(length)[:, None]
    k = jnp.arange(length)[None, :]
    if segment_ids is not None:
        mask = SegmentMask(segment_ids).dense()
    else:
        mask = jnp.broadcast_to((k <= q)[None, None], (batch, 1, length, length))
    if branch_ids is not None:
        key_branch = branch_ids[:, None, :]
        mask = mask & ((key_branch == 0) | (key_branch == branch_ids[:, :, None]))[:, None]
    if attention_mask is not None:
        mask = mask & attention_mask.astype(bool)[:, None, None, :]
    if not sliding_window:
        return mask, None
    if positions is None:
        near = ((q - k) < sliding_window)[None, None]
    else:
        near = ((positions[:, :, None] - positions[:, None, :]) < sliding_window)[:, None]
    return mask, mask & near


def cudnn_head_limit(compute_capability: str | None) -> int:
    """The largest head cuDNN's fused attention takes in half precision: 256 from Hopper (compute
    capability 9.0) on, 128 before (jax's cudnn/fused_attention_stablehlo.py checks the same)."""
    if compute_capability is None:
        return 128
    major, _, minor = str(compute_capability).partition(".")
    return 256 if (int(major), int(minor or 0)) >= (9, 0) else 128


def default_attention_implementation(cfg: ModelConfig, backend: str | None = None,
                                     compute_capability: str | None = None) -> str | None:
    """What `attention_impl: null` runs in training and scoring (not in cached decoding, always XLA):
    cuDNN's fused kernel on GPU when the compute dtype and head size suit it (with any mask: packed
    segments, trees, windows, as a bias; heads up to cudnn_head_limit of the GPU's compute capability,
    read from the first device unless given), splash attention on TPU for heads of 128 (or multiples;
    with any mask), else XLA."""
    backend = backend or jax.default_backend()
    if backend in ("gpu", "cuda") and cfg.dtype in ("bfloat16", "float16") and cfg.attn_logit_softcap is None:
        if compute_capability is None and jax.default_backend() == "gpu":
            compute_capability = getattr(jax.devices()[0], "compute_capability", None)
        if cfg.head_dim % 8 == 0 and cfg.head_dim <= cudnn_head_limit(compute_capability):
            return "cudnn"
    # Mosaic lays the kernel's head dimension on the 128-lane axis; smaller heads stay on XLA until
    # measured on a TPU.
    if backend == "tpu" and cfg.head_dim % 128 == 0:
        return "splash"
    return None


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | SegmentMask | None, *, scale: float,
           softcap: float | None, implementation: str | None, causal: bool = True) -> jax.Array:
    """Grouped-query attention. q: [B, T, H, D]; k, v: [B, S, K, D] with H a multiple of K.

    `causal` (a sequence attending to itself, as in training and scoring): every mask attention_masks
    makes lies inside the causal triangle, so the kernels are told so (cuDNN then skips the tiles above
    the diagonal) and `mask` None means causal only, with no [T, S] mask at all. Not causal (queries
    against a KV cache): `mask` says everything. Splash attention (on TPU; interpreted elsewhere) takes
    packed segments as segment ids and any other mask (trees, windows, padding) as the row's own block
    mask; it falls back to XLA for lengths its blocks do not tile and for decoding against a cache."""
    if implementation == "splash":
        if q.shape[1] == k.shape[1] and splash.supports(q.shape[1]):
            return splash.splash_attention(q, k, v, scale=scale, softcap=softcap,
                                           segment_ids=mask.ids if isinstance(mask, SegmentMask) else None,
                                           mask=mask[:, 0] if isinstance(mask, jax.Array) else None,
                                           interpret=jax.default_backend() != "tpu")
        implementation = None
    if isinstance(mask, SegmentMask):
        mask = mask.dense()
    if softcap is None:
        if implementation == "cudnn" and mask is not None and q.shape[1] % 2:
            return _cudnn_at_even_length(q, k, v, mask, scale)
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, scale=scale,
                                            implementation=implementation)
    if mask is None:
        mask = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))[None, None]
    # Soft-capped scores (Gemma 2) need the softmax spelled out; XLA fuses it. Query head h uses
    # key/value head h // (H/K), as Hugging Face's repeat_kv does.
    b, t, h, d = q.shape
    groups = k.shape[2]
    scores = jnp.einsum("btgrd,bsgd->bgrts", q.reshape(b, t, groups, h // groups, d), k,
                        preferred_element_type=jnp.float32) * scale
    scores = jnp.tanh(scores / softcap) * softcap
    scores = jnp.where(mask[:, :, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bgrts,bsgd->btgrd", probs, v).reshape(b, t, h, d)


def _cudnn_at_even_length(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float) -> jax.Array:
    """Causal cuDNN attention with a mask over an odd length T: cuDNN's training kernel takes a mask (as a
    bias) only at even lengths, so one position is appended and cut off again. It comes last, so the
    causal triangle hides it from every real query; its own row sees everything (a row that sees
    nothing would be a NaN in the gradient)."""
    t = q.shape[1]
    q, k, v = (jnp.pad(x, ((0, 0), (0, 1), (0, 0), (0, 0))) for x in (q, k, v))
    mask = jnp.pad(mask, ((0, 0), (0, 0), (0, 1), (0, 1)), constant_values=True)
    out = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, scale=scale, implementation="cudnn")
    return out[:, :t]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVCache:
    """Keys and values of every layer ([layers, B, S, K, D] each), the slot where the next tokens go,
    and the layer being run (set by the layer loop)."""

    k: jax.Array
    v: jax.Array
    index: jax.Array  # int32 scalar
    layer: jax.Array | None = None

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, slots: int, dtype=None) -> KVCache:
        shape = (cfg.num_layers, batch, slots, cfg.num_kv_heads, cfg.head_dim)
        dtype = dtype or cfg.dtype
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((), jnp.int32))

    # The cache protocol of Attention and Transformer._layers (PagedKVCache follows it too): the layer
    # loop carries the whole cache, so each layer's write is an update in place, never a copy of the
    # cache; `at_layer` names the layer, `store_and_attend` stores its new keys and values and attends
    # the queries over the cache.
    def at_layer(self, layer: jax.Array) -> KVCache:
        return dataclasses.replace(self, layer=layer)

    def store_and_attend(self, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, scale: float,
                         softcap: float | None, implementation: str | None) -> tuple[KVCache, jax.Array]:
        start = (self.layer, 0, self.index, 0, 0)
        k_all = jax.lax.dynamic_update_slice(self.k, k[None].astype(self.k.dtype), start)
        v_all = jax.lax.dynamic_update_slice(self.v, v[None].astype(self.v.dtype), start)
        # XLA whatever the training kernel: no fused kernel's decoding against a cache is tested
        del implementation
        out = attend(q, k_all[self.layer], v_all[self.layer], mask, scale=scale, softcap=softcap,
                     implementation=None, causal=False)
        return dataclasses.replace(self, k=k_all, v=v_all), out


def cached_attention_masks(slots: int, index: jax.Array, length: int, kv_valid: jax.Array,
                           sliding_window: int | None) -> tuple[jax.Array, jax.Array | None]:
    """Masks [B, 1, t, S] for `length` new tokens written at slot `index`: a query sees the filled
    slots up to its own that hold real tokens (kv_valid [B, S]), and within the window if sliding."""
    q = index + jnp.arange(length)[:, None]
    k = jnp.arange(slots)[None, :]
    mask = (k <= q)[None, None] & kv_valid.astype(bool)[:, None, None, :]
    local = mask & ((q - k) < sliding_window)[None, None] if sliding_window else None
    return mask, local


class RMSNorm(nnx.Module):
    """RMSNorm computed in float32. Gemma scales by (1 + w) with w initialised at 0 (Gemma 3's
    per-head query and key norms too)."""

    def __init__(self, dim: int, eps: float, offset: float, param_dtype):
        init = jnp.zeros if offset else jnp.ones
        self.weight = nnx.Param(init((dim,), param_dtype), **P.param((P.NORM,)))
        self.eps, self.offset = eps, offset

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * (self.offset + self.weight[...].astype(jnp.float32))).astype(x.dtype)


def _linear(cfg: ModelConfig, rngs: nnx.Rngs, din: int, dout: int, names: tuple[str, str],
            bias: bool = False, target: str | None = None) -> nnx.Linear:
    """A projection; a LoraLinear when it carries adapters (`target`: q, k, v, o, gate, up, down in
    cfg.lora.targets) or the base is quantised (every layer projection, as QLoRA)."""
    lora = cfg.lora if cfg.lora is not None and target in cfg.lora.targets else None
    if target is not None and (lora is not None or cfg.quantize is not None):
        return LoraLinear(din, dout, lora=lora, quantize=cfg.quantize, names=names, use_bias=bias, dtype=cfg.dtype,
                          param_dtype=cfg.param_dtype, kernel_init=nnx.initializers.normal(_INIT_STD), rngs=rngs)
    return nnx.Linear(din, dout, use_bias=bias, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                      kernel_init=nnx.initializers.normal(_INIT_STD), kernel_metadata=P.param(names),
                      bias_metadata=P.param(names[1:]), rngs=rngs)


def _project(projection: nnx.Module, x: jax.Array, dropout_key: jax.Array | None, index: int) -> jax.Array:
    """A projection of x; an adapted one draws its adapter dropout from fold_in(dropout_key, index)."""
    if dropout_key is None or not isinstance(projection, LoraLinear):
        return projection(x)
    return projection(x, jax.random.fold_in(dropout_key, index))


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, h, kv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = _linear(cfg, rngs, d, h * hd, (P.EMBED, P.Q_HEADS), cfg.attention_bias, "q")
        self.k_proj = _linear(cfg, rngs, d, kv * hd, (P.EMBED, P.KV_HEADS), cfg.attention_bias, "k")
        self.v_proj = _linear(cfg, rngs, d, kv * hd, (P.EMBED, P.KV_HEADS), cfg.attention_bias, "v")
        self.o_proj = _linear(cfg, rngs, h * hd, d, (P.Q_HEADS, P.EMBED), target="o")
        if cfg.qk_norm:
            offset = 1.0 if cfg.is_gemma else 0.0
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, offset, cfg.param_dtype)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, offset, cfg.param_dtype)
        self.qk_norm = cfg.qk_norm
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, hd
        self.scale, self.softcap, self.implementation = cfg.attention_scale, cfg.attn_logit_softcap, cfg.attention_impl
        self.config = cfg

    def __call__(self, x: jax.Array, positions: jax.Array, mask: jax.Array, inv_freq: jax.Array,
                 cache: KVCache | None = None,
                 dropout_key: jax.Array | None = None) -> tuple[jax.Array, KVCache | None]:
        """With a cache, the new keys and values are written at `cache.index` and the queries attend
        over all cached slots (the mask says which)."""
        b, t, _ = x.shape
        q = _project(self.q_proj, x, dropout_key, 0).reshape(b, t, self.num_heads, self.head_dim)
        k = _project(self.k_proj, x, dropout_key, 1).reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        v = _project(self.v_proj, x, dropout_key, 2).reshape(b, t, self.num_kv_heads, self.head_dim)
        q = P.constrain(q, (P.BATCH, P.LENGTH, P.ACT_HEADS, P.HEAD_DIM))
        k = P.constrain(k, (P.BATCH, P.LENGTH, P.ACT_KV_HEADS, P.HEAD_DIM))
        v = P.constrain(v, (P.BATCH, P.LENGTH, P.ACT_KV_HEADS, P.HEAD_DIM))
        if cache is not None:
            cache, out = cache.store_and_attend(q, k, v, mask, scale=self.scale, softcap=self.softcap,
                                                implementation=self.implementation)
        else:
            out = attend(q, k, v, mask, scale=self.scale, softcap=self.softcap,
                         implementation=self.implementation or default_attention_implementation(self.config))
        return _project(self.o_proj, out.reshape(b, t, self.num_heads * self.head_dim), dropout_key, 3), cache


class MLP(nnx.Module):
    """Gated MLP: SwiGLU (Llama, Qwen) or GeGLU with tanh-approximated GELU (Gemma)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = _linear(cfg, rngs, d, f, (P.EMBED, P.MLP), target="gate")
        self.up_proj = _linear(cfg, rngs, d, f, (P.EMBED, P.MLP), target="up")
        self.down_proj = _linear(cfg, rngs, f, d, (P.MLP, P.EMBED), target="down")
        self.gelu = cfg.is_gemma

    def __call__(self, x: jax.Array, dropout_key: jax.Array | None = None) -> jax.Array:
        gate = _project(self.gate_proj, x, dropout_key, 4)
        gate = jax.nn.gelu(gate, approximate=True) if self.gelu else jax.nn.silu(gate)
        hidden = P.constrain(gate * _project(self.up_proj, x, dropout_key, 5), (P.BATCH, P.LENGTH, P.ACT_MLP))
        return _project(self.down_proj, hidden, dropout_key, 6)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        offset = 1.0 if cfg.is_gemma else 0.0

        def norm():
            return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset, cfg.param_dtype)

        self.self_attn = Attention(cfg, rngs)
        self.mlp = MLP(cfg, rngs)
        self.input_layernorm = norm()
        # Llama/Qwen: post_attention_layernorm is the pre-MLP norm. Gemma normalises the output of
        # both blocks as well, so it has four norms and this one follows attention.
        self.post_attention_layernorm = norm()
        self.sandwich = cfg.is_gemma
        if cfg.is_gemma:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()

    def __call__(self, h: jax.Array, positions: jax.Array, mask: jax.Array, inv_freq: jax.Array,
                 cache: KVCache | None = None,
                 dropout_key: jax.Array | None = None) -> tuple[jax.Array, KVCache | None]:
        attn, cache = self.self_attn(self.input_layernorm(h), positions, mask, inv_freq, cache, dropout_key)
        if self.sandwich:
            h = h + self.post_attention_layernorm(attn)
            h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h), dropout_key))
        else:
            h = h + attn
            h = h + self.mlp(self.post_attention_layernorm(h), dropout_key)
        return P.constrain(h, (P.BATCH, P.LENGTH, P.ACT_EMBED)), cache


def _stacked_layers(cfg: ModelConfig, rngs: nnx.Rngs) -> DecoderLayer:
    """cfg.num_layers layers whose parameters share one leading "layers" axis."""

    @nnx.split_rngs(splits=cfg.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=cfg.num_layers,
              transform_metadata={nnx.PARTITION_NAME: P.LAYERS})
    def create(rngs: nnx.Rngs) -> DecoderLayer:
        return DecoderLayer(cfg, rngs)

    return create(rngs)


class Transformer(nnx.Module):
    """Causal LM: `model(input_ids)` with int32 [B, T] gives float32 logits [B, T, V]."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        cfg = self.config = config
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                                      embedding_init=nnx.initializers.normal(_INIT_STD),
                                      embedding_metadata=P.param((P.TABLE_VOCAB, P.TABLE_EMBED)), rngs=rngs)
        self.layers = _stacked_layers(cfg, rngs)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, 1.0 if cfg.is_gemma else 0.0, cfg.param_dtype)
        self.lm_head = None if cfg.tie_embeddings else _linear(cfg, rngs, cfg.hidden_size, cfg.vocab_size,
                                                               (P.EMBED, P.VOCAB))

    def __call__(self, input_ids: jax.Array, *, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None, attention_mask: jax.Array | None = None,
                 branch_ids: jax.Array | None = None) -> jax.Array:
        hidden = self.hidden_states(input_ids, positions=positions, segment_ids=segment_ids,
                                    attention_mask=attention_mask, branch_ids=branch_ids)
        return self.logits(hidden)

    def hidden_states(self, input_ids: jax.Array, *, positions: jax.Array | None = None,
                      segment_ids: jax.Array | None = None, attention_mask: jax.Array | None = None,
                      branch_ids: jax.Array | None = None, dropout_key: jax.Array | None = None) -> jax.Array:
        """The final-norm hidden states [B, T, D] (the LM head's input). Masking as in attention_masks;
        `dropout_key` (training steps) draws the adapters' dropout, when they have one."""
        batch, length = input_ids.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
        masks = attention_masks(length, segment_ids, attention_mask, batch, self.config.sliding_window, branch_ids,
                                positions)
        hidden, _ = self._layers(input_ids, positions, masks, None, dropout_key)
        return hidden

    def decode(self, input_ids: jax.Array, positions: jax.Array, cache: KVCache,
               kv_valid: jax.Array) -> tuple[jax.Array, KVCache]:
        """Runs `input_ids` [B, t] at `positions` through the layers with a KV cache: writes their keys
        and values at slot cache.index (kv_valid [B, S] marks slots holding real tokens, these
        included) and returns float32 logits [B, t, V] and the cache advanced by t."""
        masks = cached_attention_masks(cache.k.shape[2], cache.index, input_ids.shape[1], kv_valid,
                                       self.config.sliding_window)
        hidden, cache = self._layers(input_ids, positions, masks, cache)
        return self.logits(hidden), KVCache(cache.k, cache.v, cache.index + input_ids.shape[1])

    def decode_paged(self, input_ids: jax.Array, positions: jax.Array, cache, *,
                     logits: bool = True) -> tuple[jax.Array | None, object]:
        """Runs `input_ids` [B, t] at `positions` [B, t] through the layers with a paged cache
        (polyalign.model.paged_cache.PagedKVCache, which says where each new token's keys and values
        go and which pages each row reads): float32 logits [B, t, V] (None without `logits`, as in a
        prefill that only fills the cache) and the cache holding the new keys and values."""
        masks = cache.attention_masks(positions, self.config.sliding_window)
        hidden, cache = self._layers(input_ids, positions, masks, cache)
        return (self.logits(hidden) if logits else None), cache

    def _layers(self, input_ids, positions, masks, cache, dropout_key: jax.Array | None = None):
        cfg = self.config
        full, local = masks
        h = self.embed_tokens(input_ids)
        if cfg.is_gemma:
            h = h * jnp.asarray(cfg.hidden_size ** 0.5, h.dtype)
        h = P.constrain(h, (P.BATCH, P.LENGTH, P.ACT_EMBED))
        # Per layer: Gemma 3's sliding layers rotate with another base than its global ones.
        inv_freqs = jnp.asarray(np.stack([rope_inverse_frequencies(cfg, local=s) for s in cfg.sliding_layers]))
        graphdef, layer_state = nnx.split(self.layers)
        sliding = jnp.asarray(cfg.sliding_layers)
        if dropout_key is not None and (cfg.lora is None or not cfg.lora.dropout):
            dropout_key = None  # nothing to drop: the step stays the one without a key
        layer_keys = None if dropout_key is None else jax.random.split(dropout_key, cfg.num_layers)

        def layer(carry, xs):
            h, cache = carry
            state, is_sliding, inv_freq, key, index = xs
            # (a paged cache's masks are pytrees: positions and a window)
            mask = full if local is None else jax.tree.map(lambda a, b: jnp.where(is_sliding, a, b), local, full)
            layer_cache = None if cache is None else cache.at_layer(index)
            h, cache = nnx.merge(graphdef, state)(h, positions, mask, inv_freq, layer_cache, key)
            return (h, cache), None

        if cfg.remat != "none":
            layer = jax.checkpoint(layer, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan_layers)
        xs = (layer_state, sliding, inv_freqs, layer_keys, jnp.arange(cfg.num_layers, dtype=jnp.int32))
        if cache is not None:
            cache = cache.at_layer(jnp.int32(0))  # the carry keeps one structure from layer to layer
        if cfg.scan_layers:
            (h, cache), _ = jax.lax.scan(layer, (h, cache), xs)
        else:
            for i in range(cfg.num_layers):
                (h, cache), _ = layer((h, cache), jax.tree.map(lambda a, i=i: a[i], xs))
        return self.norm(h), None if cache is None else cache.at_layer(None)

    def token_log_probs(self, input_ids: jax.Array, targets: jax.Array, *, positions: jax.Array | None = None,
                        segment_ids: jax.Array | None = None, branch_ids: jax.Array | None = None,
                        dropout_key: jax.Array | None = None) -> jax.Array:
        """float32 log p(targets) [B, T] for teacher-forced `input_ids` (padding on the right; packed rows
        with their positions, segment ids and, for shared prefixes, branch ids); in blocks of
        `config.logprob_chunk` positions when set, without full [B, T, V] logits."""
        hidden = self.hidden_states(input_ids, positions=positions, segment_ids=segment_ids, branch_ids=branch_ids,
                                    dropout_key=dropout_key)
        if not self.config.logprob_chunk:
            return token_log_probs(self.logits(hidden), targets)
        return chunked_token_log_probs(hidden, self.head_weight(), targets, self.config.logprob_chunk,
                                       self.config.final_logit_softcap)

    def head_weight(self) -> jax.Array:
        """The LM head as a [D, V] matrix in the compute dtype (the transposed embedding when tied)."""
        if self.lm_head is None:
            return self.embed_tokens.embedding[...].T.astype(self.config.dtype)
        return self.lm_head.kernel[...].astype(self.config.dtype)

    def logits(self, hidden: jax.Array) -> jax.Array:
        cfg = self.config
        out = self.embed_tokens.attend(hidden) if self.lm_head is None else self.lm_head(hidden)
        out = out.astype(jnp.float32)
        if cfg.final_logit_softcap is not None:
            out = jnp.tanh(out / cfg.final_logit_softcap) * cfg.final_logit_softcap
        return P.constrain(out, (P.BATCH, P.LENGTH, P.ACT_VOCAB))


def create_model(cfg: ModelConfig, seed: int = 0, mesh: jax.sharding.Mesh | None = None) -> Transformer:
    """A randomly initialised model: on the default device, or with a `mesh` initialised in place
    across it, each device computing only its shards of every parameter (the same values either way),
    so a model larger than one device never has to fit on one."""
    if mesh is None:
        with P.unsharded():
            return Transformer(cfg, rngs=nnx.Rngs(seed))
    graphdef, abstract_state = nnx.split(abstract_model(cfg))
    shardings = P.param_shardings(abstract_state, mesh)

    @functools.partial(jax.jit, out_shardings=shardings)
    def initialise():
        with P.unsharded():
            return nnx.state(Transformer(cfg, rngs=nnx.Rngs(seed)))

    return nnx.merge(graphdef, P.ordered(initialise()))


def abstract_model(cfg: ModelConfig) -> Transformer:
    """The model's structure with shapes and dtypes only; no memory is allocated. Under an active mesh
    (inside a jitted step too) its logical axis names map to mesh axes by the default rules."""
    with P.unsharded(), nnx.logical_axis_rules(P.DEFAULT_RULES):
        return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
