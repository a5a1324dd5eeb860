"""Architecture of the decoder: one dataclass for the Llama, Qwen2, Qwen3, Gemma 2 and Gemma 3 (text)
families, and its translation to and from a Hugging Face config.json."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

from polyalign.core.errors import ModelConfigError
from polyalign.core.paths import as_path

FAMILIES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3")
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                    "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
LAYER_TYPES = ("full_attention", "sliding_attention")
REMAT_POLICIES = ("none", "full", "dots")
ATTENTION_IMPLEMENTATIONS = (None, "xla", "cudnn", "splash")
# Compute dtypes of training, generation and evaluation; `auto` is resolved by compute_dtype.
COMPUTE_DTYPES = ("auto", "float32", "bfloat16", "float16")


def compute_dtype(name: str, backend: str | None = None) -> str:
    """`auto`: bfloat16 on GPU and TPU (the precision their matrix units run at full rate; parameters
    and optimizer state stay float32 in training), float32 on a CPU (exact, and faster there); any other
    name as it is. `backend` defaults to JAX's, so call this after jax.distributed is set up."""
    if name != "auto":
        return name
    if backend is None:
        import jax  # heavy: kept out of the module, which --help imports

        backend = jax.default_backend()
    return "float32" if backend == "cpu" else "bfloat16"
ROPE_TYPES = ("llama3", "linear")
QUANTIZE_KINDS = ("nf4", "int8")  # storage of a frozen base's projections (polyalign/model/quantize.py)


@dataclass(frozen=True)
class RopeScaling:
    """Frequency scaling of the rotary embedding: Llama 3.x (`rope_type: llama3`, all four numbers) or
    linear (every frequency divided by `factor`; Gemma 3's global layers)."""

    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    rope_type: str = "llama3"

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ModelConfigError(f"rope_scaling.rope_type {self.rope_type!r} is not one of {', '.join(ROPE_TYPES)}")
        if self.rope_type == "llama3" and None in (self.low_freq_factor, self.high_freq_factor,
                                                   self.original_max_position_embeddings):
            raise ModelConfigError("llama3 rope_scaling needs low_freq_factor, high_freq_factor and "
                                   "original_max_position_embeddings")


LORA_TARGETS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
                "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
LORA_INITS = ("kaiming", "gaussian")


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters on the layers' projections: W x + (alpha / rank) B A x, B zero at the start.
    `init` draws A as PEFT does: kaiming (uniform, bound 1/sqrt(fan_in)) or gaussian (std 1/rank);
    `dropout` drops the adapters' input x (not the base's) in training steps."""

    rank: int = 16
    alpha: float = 32.0
    targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
    init: str = "kaiming"
    dropout: float = 0.0  # on the adapters' input in training steps, as PEFT's lora_dropout

    def __post_init__(self) -> None:
        problems = []
        if self.rank < 1:
            problems.append(f"lora rank must be >= 1, got {self.rank}")
        if self.alpha <= 0:
            problems.append(f"lora alpha must be > 0, got {self.alpha}")
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown or not self.targets:
            problems.append(f"lora targets must be some of {', '.join(LORA_TARGETS)}, got {list(self.targets)}")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"lora dropout must be in [0, 1), got {self.dropout}")
        if self.init not in LORA_INITS:
            problems.append(f"lora init must be one of {', '.join(LORA_INITS)}, got {self.init!r}")
        if problems:
            raise ModelConfigError("; ".join(problems))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


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
    # Gemma 3: sliding-window layers rotate with this base and no scaling; None = rope_theta everywhere.
    rope_local_theta: float | None = None
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2); o_proj never has one
    max_position_embeddings: int = 4096
    # Gemma 2 and 3 specifics; None/False for the other families.
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
    # Low-rank adapters on the projections (polyalign/model/lora.py); training then updates only them.
    lora: LoraConfig | None = None
    # nf4 | int8: the layers' projections are stored quantised (polyalign/model/quantize.py), frozen.
    quantize: str | None = None

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
        if self.quantize is not None and self.quantize not in QUANTIZE_KINDS:
            problems.append(f"quantize {self.quantize!r} is not one of {', '.join(QUANTIZE_KINDS)} or None")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            problems.append("sliding_attention layers need a sliding_window")
        if problems:
            raise ModelConfigError("; ".join(problems))

    @property
    def is_gemma(self) -> bool:
        """Gemma's layout: (1 + w) norms around both blocks, GeGLU, embeddings scaled by sqrt(width)."""
        return self.family in ("gemma2", "gemma3")

    @property
    def qk_norm(self) -> bool:
        """Qwen3 and Gemma 3 normalise each head's queries and keys (RMSNorm over head_dim) before RoPE."""
        return self.family in ("qwen3", "gemma3")

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        types = self.layer_types or ("full_attention",) * self.num_layers
        return tuple(t == "sliding_attention" for t in types)

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """(din, dout) of each layer projection, by LoRA target name."""
        d, h, kv, hd, f = self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim, self.intermediate_size
        return {"q": (d, h * hd), "k": (d, kv * hd), "v": (d, kv * hd), "o": (h * hd, d), "gate": (d, f),
                "up": (d, f), "down": (f, d)}

    def projection_parameters(self) -> int:
        """Weights of all layers' projections (what `quantize` stores quantised), biases excluded."""
        return self.num_layers * sum(i * o for i, o in self.projection_shapes().values())

    def adapter_parameters(self) -> int:
        """Trainable parameters of the adapters: r (din + dout) per target projection and layer."""
        if self.lora is None:
            return 0
        shapes = self.projection_shapes()
        return self.num_layers * sum(self.lora.rank * sum(shapes[t]) for t in self.lora.targets)

    def num_parameters(self) -> int:
        d, h, kv, hd, f = self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim, self.intermediate_size
        attention = d * h * hd * 2 + d * kv * hd * 2 + (h * hd + 2 * kv * hd if self.attention_bias else 0)
        norms = d * (4 if self.is_gemma else 2) + (2 * hd if self.qk_norm else 0)
        per_layer = attention + 3 * d * f + norms
        head = 0 if self.tie_embeddings else d * self.vocab_size
        return self.num_layers * per_layer + self.vocab_size * d + d + head


def family_defaults(family: str, **sizes: Any) -> ModelConfig:
    """A config of the family's structure with the given sizes (tests, the demo's tiny model)."""
    if family in ("gemma2", "gemma3"):
        sizes.setdefault("tie_embeddings", True)
        sizes.setdefault("query_pre_attn_scalar", sizes.get("head_dim"))
        sizes.setdefault("sliding_window", 4096)
    if family == "gemma2":
        sizes.setdefault("attn_logit_softcap", 50.0)
        sizes.setdefault("final_logit_softcap", 30.0)
        sizes.setdefault("layer_types", _alternating(sizes["num_layers"]))
    if family == "gemma3":
        sizes.setdefault("layer_types", _every_sixth_global(sizes["num_layers"]))
        sizes.setdefault("rope_theta", 1_000_000.0)
        sizes.setdefault("rope_local_theta", 10_000.0)
    if family == "qwen2":
        sizes.setdefault("attention_bias", True)
    if family in ("qwen2", "qwen3"):
        sizes.setdefault("rope_theta", 1_000_000.0)
    return ModelConfig(family=family, **sizes)


def _alternating(num_layers: int) -> tuple[str, ...]:
    # Gemma 2: even layers slide, odd layers see the whole sequence.
    return tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers))


def _every_sixth_global(num_layers: int, pattern: int = 6) -> tuple[str, ...]:
    # Gemma 3: five sliding layers, then one that sees the whole sequence.
    return tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers))


# --- Hugging Face config.json ------------------------------------------------------------------

# model_type in config.json -> family; Gemma 3's multimodal checkpoints ("gemma3") hold a text model
# whose config is their text_config.
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3_text": "gemma3",
                "gemma3": "gemma3"}
_FAMILY_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
                       "gemma3": "gemma3_text"}


def position_limit(directory: str | os.PathLike) -> int | None:
    """The positions a checkpoint was made for (max_position_embeddings in its config.json); None where
    its folder has no config.json or the config says none."""
    config = as_path(directory) / "config.json"
    try:
        limit = json.loads(config.read_text()).get("max_position_embeddings") if config.is_file() else None
    except (json.JSONDecodeError, AttributeError):
        return None
    return int(limit) if isinstance(limit, int | float) else None


def longer_than_positions(directory: str | os.PathLike, length: int, what: str, fix: str) -> str | None:
    """The refusal of sequences of `length` tokens (`what` names the setting) on a checkpoint made for fewer
    positions, saying `fix`; None when they fit. Positions past the ones a model was trained on run without
    error and read as noise to it, so every command checks before it loads the weights."""
    limit = position_limit(directory)
    if limit is None or length is None or length <= limit:
        return None
    return (f"{what} is longer than the model's {limit} positions (max_position_embeddings in "
            f"{as_path(directory) / 'config.json'}); {fix}")


def checkpoint_family(directory: str | os.PathLike) -> str | None:
    """The model family a checkpoint directory's config.json names; None where there is no config.json
    (a tokenizer folder) or its model_type is not one polyalign builds."""
    config = as_path(directory) / "config.json"
    if not config.is_file():
        return None
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (json.JSONDecodeError, AttributeError):
        return None
    return _MODEL_TYPES.get(model_type)


# What transformers' Gemma3TextConfig assumes for keys a multimodal checkpoint's text_config leaves out.
_GEMMA3_TEXT_DEFAULTS = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
                         "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
                         "head_dim": 256, "rms_norm_eps": 1e-6, "max_position_embeddings": 131_072,
                         "query_pre_attn_scalar": 256, "sliding_window": 4096, "tie_word_embeddings": True,
                         "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: the file itself, or a multimodal Gemma 3's text_config with
    transformers' defaults filled in (the file names only what differs from them)."""
    if hf.get("model_type") != "gemma3":
        return hf
    text = {**_GEMMA3_TEXT_DEFAULTS, **(hf.get("text_config") or {}), "model_type": "gemma3_text"}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if hf.get(key) is not None and key not in (hf.get("text_config") or {}):
            text[key] = hf[key]
    return text


def _rope_scaling(params: dict[str, Any], where: str) -> RopeScaling | None:
    if not isinstance(params, dict):
        raise ModelConfigError(f"{where}: rope_scaling: expected a mapping, got {params!r}")
    rope_type = params.get("rope_type") or params.get("type") or "default"
    needed = {"default": (), "linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    if rope_type not in needed:
        raise ModelConfigError(f"{where}: rope_type {rope_type!r} is not supported (default, linear and llama3 are)")
    for key in needed[rope_type]:
        if not _is_number(params.get(key)):
            raise ModelConfigError(f"{where}: rope_type {rope_type!r} needs a number for {key!r}, got "
                                   f"{params.get(key)!r}")
    if rope_type == "default":
        return None
    if rope_type == "linear":
        return RopeScaling(float(params["factor"]), rope_type="linear")
    return RopeScaling(float(params["factor"]), float(params["low_freq_factor"]),
                       float(params["high_freq_factor"]), int(params["original_max_position_embeddings"]))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# The config.json keys the decoder reads, by the type each must have (null: the family's default).
_COUNT_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window")
_NUMBER_KEYS = ("rms_norm_eps", "rope_theta", "rope_local_base_freq", "query_pre_attn_scalar",
                "attn_logit_softcapping", "final_logit_softcapping")
_FLAG_KEYS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window",
              "use_bidirectional_attention")
# What the MLP computes per family (gelu_new is transformers' other name for the tanh approximation).
_ACTIVATIONS = {"gemma": ("gelu_pytorch_tanh", "gelu_new"), "other": ("silu", "swish")}


def _check_supported(hf: dict[str, Any], family: str, where: str) -> None:
    """Every key the decoder reads has its type, and every setting it would compute differently from
    the checkpoint's own model (another activation, partial rotary, MLP biases) is refused in one line:
    a model that loads must be the model that was trained."""
    for key in _COUNT_KEYS:
        value = hf.get(key)
        if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            raise ModelConfigError(f"{where}: {key} must be a positive integer, got {value!r}")
    for key in _NUMBER_KEYS:
        if hf.get(key) is not None and not _is_number(hf[key]):
            raise ModelConfigError(f"{where}: {key} must be a number, got {hf[key]!r}")
    for key in _FLAG_KEYS:
        if hf.get(key) is not None and not isinstance(hf[key], bool):
            raise ModelConfigError(f"{where}: {key} must be true or false, got {hf[key]!r}")
    gemma = family in ("gemma2", "gemma3")
    key = "hidden_activation" if gemma and hf.get("hidden_activation") is not None else "hidden_act"
    allowed = _ACTIVATIONS["gemma" if gemma else "other"]
    if hf.get(key) is not None and hf[key] not in allowed:
        raise ModelConfigError(f"{where}: {key} {hf[key]!r} is not supported for {family} (polyalign's decoder "
                               f"computes {allowed[0]})")
    if float(hf.get("partial_rotary_factor") or 1.0) != 1.0:
        raise ModelConfigError(f"{where}: partial_rotary_factor {hf['partial_rotary_factor']} is not supported "
                               "(rotary embeddings on every head dimension only)")
    if hf.get("mlp_bias"):
        raise ModelConfigError(f"{where}: mlp_bias=true is not supported (MLP projections without biases only)")
    heads, kv_heads = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    if heads % kv_heads:
        raise ModelConfigError(f"{where}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads "
                               f"({kv_heads})")


def _rope(hf: dict[str, Any], family: str, where: str) -> tuple[float, RopeScaling | None, float | None]:
    """(theta, scaling, local theta) from a 4.x (rope_theta + rope_scaling) or 5.x (rope_parameters,
    per layer type for Gemma 3) config."""
    rope = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    if family != "gemma3":
        source = rope if rope.get("rope_type", "default") != "default" else legacy
        return float(rope.get("rope_theta", hf.get("rope_theta", 10_000.0))), _rope_scaling(source, where), None
    full = rope.get("full_attention") or {"rope_theta": hf.get("rope_theta", 1_000_000.0), **legacy}
    local = rope.get("sliding_attention") or {"rope_theta": hf.get("rope_local_base_freq", 10_000.0)}
    if _rope_scaling(local, where) is not None:
        raise ModelConfigError(f"{where}: scaled RoPE on sliding-window layers is not supported")
    return float(full.get("rope_theta", 1_000_000.0)), _rope_scaling(full, where), float(local["rope_theta"])


def from_hf_config(hf: dict[str, Any], where: str = "config.json", **policy: Any) -> ModelConfig:
    """Reads a transformers config.json (4.x or 5.x layout); `policy` sets dtype, scan_layers, ..."""
    model_type = hf.get("model_type")
    if model_type not in _MODEL_TYPES:
        archs = ", ".join(hf.get("architectures") or []) or "none given"
        raise ModelConfigError(f"{where}: unsupported model_type {model_type!r} (architectures: {archs}); "
                               f"polyalign loads {', '.join(_MODEL_TYPES)}")
    hf = text_config(hf)
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in hf]
    if missing:
        raise ModelConfigError(f"{where}: missing keys {', '.join(missing)}")
    family = _MODEL_TYPES[model_type]
    _check_supported(hf, family, where)
    gemma = family in ("gemma2", "gemma3")
    heads = hf["num_attention_heads"]
    rope_theta, scaling, local_theta = _rope(hf, family, where)
    layers = hf["num_hidden_layers"]
    layer_types: tuple[str, ...] = ()
    sliding_window = None
    if family == "gemma2":
        layer_types = tuple(hf.get("layer_types") or _alternating(layers))
    elif family == "gemma3":
        if hf.get("use_bidirectional_attention"):
            raise ModelConfigError(f"{where}: use_bidirectional_attention=true (an encoder) is not a causal LM")
        layer_types = tuple(hf.get("layer_types") or _every_sixth_global(layers, hf.get("sliding_window_pattern", 6)))
    elif family in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
        raise ModelConfigError(f"{where}: {model_type} use_sliding_window=true is not supported")
    if gemma:
        sliding_window = hf.get("sliding_window", 4096)
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
        rope_theta=rope_theta,
        rope_scaling=scaling,
        rope_local_theta=local_theta,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
        attention_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        query_pre_attn_scalar=hf.get("query_pre_attn_scalar") if gemma else None,
        attn_logit_softcap=hf.get("attn_logit_softcapping") if gemma else None,
        final_logit_softcap=hf.get("final_logit_softcapping") if gemma else None,
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
        "model_type": _FAMILY_MODEL_TYPES[cfg.family],
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
        hf["rope_scaling"] = {k: v for k, v in dataclasses.asdict(cfg.rope_scaling).items() if v is not None}
    if cfg.family == "gemma3":
        # Both layouts: 5.x reads rope_parameters per layer type, 4.x rope_theta/rope_local_base_freq.
        full = {"rope_type": "default", "rope_theta": cfg.rope_theta, **hf.get("rope_scaling", {})}
        hf["rope_parameters"] = {"full_attention": full,
                                 "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_theta}}
        hf["rope_local_base_freq"] = cfg.rope_local_theta
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
