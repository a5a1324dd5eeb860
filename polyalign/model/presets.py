"""Named architectures: the demo's tiny model and the public checkpoints the method was run on.

Real presets describe shapes only (for planning, benchmarks and abstract evaluation); weights always
come from the user's Hugging Face checkpoint through `load_hf_checkpoint`.
"""

from __future__ import annotations

from typing import Any

from polyalign.model.config import ModelConfig, ModelConfigError, RopeScaling, family_defaults

_QWEN25 = dict(vocab_size=151936, num_kv_heads=2, head_dim=128, rms_norm_eps=1e-6, tie_embeddings=True,
               max_position_embeddings=32768, bos_token_id=151643, eos_token_id=151645)
_LLAMA32 = dict(vocab_size=128256, num_kv_heads=8, rope_theta=500000.0, rms_norm_eps=1e-5, tie_embeddings=True,
                max_position_embeddings=131072, bos_token_id=128000, eos_token_id=(128001, 128008, 128009),
                rope_scaling=RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                         original_max_position_embeddings=8192))

PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    # The demo's model: Llama structure, 4 layers, width 256 (about 7M parameters with 8k vocabulary).
    "tiny": ("llama", dict(vocab_size=8000, hidden_size=256, intermediate_size=688, num_layers=4, num_heads=8,
                           num_kv_heads=4, head_dim=32, rms_norm_eps=1e-5, max_position_embeddings=2048)),
    "qwen2.5-0.5b": ("qwen2", dict(_QWEN25, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
                                   head_dim=64)),
    "qwen2.5-1.5b": ("qwen2", dict(_QWEN25, hidden_size=1536, intermediate_size=8960, num_layers=28,
                                   num_heads=12)),
    "qwen2.5-3b": ("qwen2", dict(_QWEN25, hidden_size=2048, intermediate_size=11008, num_layers=36, num_heads=16)),
    "llama3.2-1b": ("llama", dict(_LLAMA32, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                                  head_dim=64)),
    "llama3.2-3b": ("llama", dict(_LLAMA32, hidden_size=3072, intermediate_size=8192, num_layers=28, num_heads=24,
                                  head_dim=128)),
    "gemma2-2b": ("gemma2", dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_layers=26,
                                 num_heads=8, num_kv_heads=4, head_dim=256, query_pre_attn_scalar=256,
                                 sliding_window=4096, max_position_embeddings=8192, bos_token_id=2,
                                 eos_token_id=1, pad_token_id=0)),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """The named architecture; keywords override fields (dtype, scan_layers, remat, vocab_size, ...)."""
    if name not in PRESETS:
        raise ModelConfigError(f"unknown model preset {name!r} (known: {', '.join(PRESETS)})")
    family, sizes = PRESETS[name]
    return family_defaults(family, **{**sizes, **overrides})
