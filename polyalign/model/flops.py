"""Model FLOPs per token, for MFU: the training loop's logs and the benchmarks count the same way.

The PaLM paper's count (appendix B), which most published MFU figures use: a training token costs
6N + 12 L H Q T FLOPs, N the matmul parameters, L layers, H heads of size Q, T the row length (the
attention products, not halved for causality); a forward-only pass (a frozen reference computed in
the step) costs a third of that. Norms, the embedding lookup and elementwise work are not counted.
"""

from __future__ import annotations

from polyalign.model.architecture import ModelConfig


def matmul_parameters(cfg: ModelConfig) -> int:
    """Parameters that take part in a matmul per token: everything but the embedding lookup and the
    norms, plus the LM head (the tied embedding counts once, as the head)."""
    d = cfg.hidden_size
    per_layer_norms = d * (4 if cfg.is_gemma else 2) + (2 * cfg.head_dim if cfg.qk_norm else 0)
    norms = per_layer_norms * cfg.num_layers + d
    untied_embedding = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    return cfg.num_parameters() - norms - untied_embedding


def flops_per_token(cfg: ModelConfig, seq: int, reference_forward: bool = False) -> float:
    """Training FLOPs per token of a `seq`-long row; with `reference_forward`, a frozen copy's
    forward pass over the same token as well."""
    per_parameter_equivalent = matmul_parameters(cfg) + 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq
    return (6 + (2 if reference_forward else 0)) * per_parameter_equivalent
