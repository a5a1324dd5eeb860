"""Architecture of the decoder: one dataclass for the Llama, Qwen2, Qwen3 and Gemma 2 families, and its
translation to and from a Hugging Face config.json."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

from polyalign.errors import ModelConfigError

FAMILIES = ("llama", "qwen2", "qwen3", "gemma2")
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                    "gemma2": "Gemma2ForCausalLM"}
LAYER_TYPES = ("full_attention", "sliding_attention")
REMAT_POLICIES = ("none", "full", "dots")
ATTENTION_IMPLEMENTATIONS = (None, "xla", "cudnn", "splash")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.x frequency scaling (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10_000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2); o_proj never has one
    max_position_embeddings: int = 4096
    # Gemma 2 specifics; None/False for the other families.
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power instead of head_dim's
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # per layer, "full_attention" or "sliding_attention"
    # Token ids that the exported config.json names; the model itself does not use them.
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    # Execution policy, not architecture: never written to config.json.
    param_dtype: str = "float32"
    dtype: str = "float32"  # compute dtype of matmuls and activations
    scan_layers: bool = True
    remat: str = "none"
    # xla, cudnn (jax.nn.dot_product_attention), splash (Pallas TPU kernel) or None: polyalign picks
    # cudnn on GPU and splash on TPU where they apply, XLA elsewhere.
    attention_impl: str | None = None
    # > 0: training log-probs come from the hidden states in sequence blocks of this many positions,
    # never materialising [B, T, V] logits (polyalign/model/log_probs.py); 0 computes full logits.
    logprob_chunk: int = 0

    def __post_init__(self) -> None:
        problems = []
        if self.family not in FAMILIES:
            problems.append(f"family {self.family!r} is not one of {', '.join(FAMILIES)}")
        if self.num_heads % self.num_kv_heads:
            problems.append(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.remat not in REMAT_POLICIES:
            problems.append(f"remat {self.remat!r} is not one of {', '.join(REMAT_POLICIES)}")
        if self.attention_impl not in ATTENTION_IMPLEMENTATIONS:
            problems.append(f"attention_impl {self.attention_impl!r} is not one of xla, cudnn, splash or None")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            problems.append(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        if any(t not in LAYER_TYPES for t in self.layer_types):
            problems.append(f"layer_types must be drawn from {', '.join(LAYER_TYPES)}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            problems.append("sliding_attention layers need a sliding_window")
        if problems:
            raise ModelConfigError("; ".join(problems))

    @property
    def is_gemma(self) -> bool:
        return self.family == "gemma2"

    @property
    def qk_norm(self) -> bool:
        """Qwen3 normalises each head's queries and keys (RMSNorm over head_dim) before RoPE."""
        return self.family == "qwen3"

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        types = self.layer_types or ("full_attention",) * self.num_layers
        return tuple(t == "sliding_attention" for t in types)

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def num_parameters(self) -> int:
        d, h, kv, hd, f = self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim, self.intermediate_size
        attention = d * h * hd * 2 + d * kv * hd * 2 + (h * hd + 2 * kv * hd if self.attention_bias else 0)
        norms = d * (4 if self.is_gemma else 2) + (2 * hd if self.qk_norm else 0)
        per_layer = attention + 3 * d * f + norms
        head = 0 if self.tie_embeddings else d * self.vocab_size
        return self.num_layers * per_layer + self.vocab_size * d + d + head


def family_defaults(family: str, **sizes: Any) -> ModelConfig:
    """A config of the family's structure with the given sizes (tests, the demo's tiny model)."""
    if family == "gemma2":
        sizes.setdefault("tie_embeddings", True)
        sizes.setdefault("query_pre_attn_scalar", sizes.get("head_dim"))
        sizes.setdefault("attn_logit_softcap", 50.0)
        sizes.setdefault("final_logit_softcap", 30.0)
        sizes.setdefault("sliding_window", 4096)
        sizes.setdefault("layer_types", _alternating(sizes["num_layers"]))
    if family == "qwen2":
        sizes.setdefault("attention_bias", True)
    if family in ("qwen2", "qwen3"):
        sizes.setdefault("rope_theta", 1_000_000.0)
    return ModelConfig(family=family, **sizes)


def _alternating(num_layers: int) -> tuple[str, ...]:
    # Gemma 2: even layers slide, odd layers see the whole sequence.
    return tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers))


# --- Hugging Face config.json ------------------------------------------------------------------

_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2"}


def checkpoint_family(directory: str | os.PathLike) -> str | None:
    """The model family a checkpoint directory's config.json names; None where there is no config.json
    (a tokenizer folder) or its model_type is not one polyalign builds."""
    from polyalign.paths import as_path

    config = as_path(directory) / "config.json"
    if not config.is_file():
        return None
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (json.JSONDecodeError, AttributeError):
        return None
    return _MODEL_TYPES.get(model_type)


def from_hf_config(hf: dict[str, Any], where: str = "config.json", **policy: Any) -> ModelConfig:
    """Reads a transformers config.json (4.x or 5.x layout); `policy` sets dtype, scan_layers, ..."""
    model_type = hf.get("model_type")
    if model_type not in _MODEL_TYPES:
        archs = ", ".join(hf.get("architectures") or []) or "none given"
        raise ModelConfigError(f"{where}: unsupported model_type {model_type!r} (architectures: {archs}); "
                               f"polyalign loads {', '.join(_MODEL_TYPES)}")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in hf]
    if missing:
        raise ModelConfigError(f"{where}: missing keys {', '.join(missing)}")
    family = _MODEL_TYPES[model_type]
    heads = hf["num_attention_heads"]
    rope = dict(hf.get("rope_parameters") or {})
    legacy_scaling = hf.get("rope_scaling") or {}
    rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10_000.0))
    rope_type = rope.get("rope_type") or legacy_scaling.get("rope_type") or legacy_scaling.get("type") or "default"
    scaling_source = rope if rope.get("rope_type") == "llama3" else legacy_scaling
    if rope_type == "llama3":
        scaling = RopeScaling(float(scaling_source["factor"]), float(scaling_source["low_freq_factor"]),
                              float(scaling_source["high_freq_factor"]),
                              int(scaling_source["original_max_position_embeddings"]))
    elif rope_type == "default":
        scaling = None
    else:
        raise ModelConfigError(f"{where}: rope_type {rope_type!r} is not supported (default and llama3 are)")
    layers = hf["num_hidden_layers"]
    layer_types: tuple[str, ...] = ()
    sliding_window = None
    if family == "gemma2":
        layer_types = tuple(hf.get("layer_types") or _alternating(layers))
        sliding_window = hf.get("sliding_window", 4096)
    elif family in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
        raise ModelConfigError(f"{where}: {model_type} use_sliding_window=true is not supported")
    eos = hf.get("eos_token_id")
    return ModelConfig(
        family=family,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rope_theta=float(rope_theta),
        rope_scaling=scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", family == "gemma2")),
        attention_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        query_pre_attn_scalar=hf.get("query_pre_attn_scalar") if family == "gemma2" else None,
        attn_logit_softcap=hf.get("attn_logit_softcapping") if family == "gemma2" else None,
        final_logit_softcap=hf.get("final_logit_softcapping") if family == "gemma2" else None,
        sliding_window=sliding_window,
        layer_types=layer_types,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        pad_token_id=hf.get("pad_token_id"),
        **policy,
    )


def to_hf_config(cfg: ModelConfig, torch_dtype: str = "float32") -> dict[str, Any]:
    """The config.json transformers needs to load the checkpoint `save_hf_checkpoint` writes."""
    hf: dict[str, Any] = {
        "architectures": [HF_ARCHITECTURES[cfg.family]],
        "model_type": _MODEL_TYPES[cfg.family],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": "gelu_pytorch_tanh" if cfg.is_gemma else "silu",
        "rope_theta": cfg.rope_theta,
        "torch_dtype": torch_dtype,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple) else cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
    }
    if cfg.rope_scaling is not None:
        hf["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(cfg.rope_scaling)}
    if cfg.family in ("llama", "qwen3"):
        hf["attention_bias"] = cfg.attention_bias
    if cfg.family == "llama":
        hf["mlp_bias"] = False
    if cfg.family in ("qwen2", "qwen3"):
        hf["use_sliding_window"] = False
    if cfg.is_gemma:
        hf["hidden_activation"] = "gelu_pytorch_tanh"
        hf["query_pre_attn_scalar"] = cfg.query_pre_attn_scalar
        hf["attn_logit_softcapping"] = cfg.attn_logit_softcap
        hf["final_logit_softcapping"] = cfg.final_logit_softcap
        hf["sliding_window"] = cfg.sliding_window
        hf["layer_types"] = list(cfg.layer_types)
    return hf
