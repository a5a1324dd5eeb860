"""Model FLOPs of a training step, for MFU: the training loop's logs and the benchmarks count the same way.

The convention (stated, because published MFU figures differ on it):
- Matmuls: 2 FLOPs per multiply-add. A weight that is trained costs 6 per token (forward, the gradient
  of its input, the gradient of itself); a frozen one 4 (no weight gradient: the base under LoRA or
  QLoRA, whose adapters cost 6 each); a forward-only pass (a frozen reference computed in the step) 2.
  N counts the parameters that take part in a matmul per token: everything but the embedding lookup and
  the norms, plus the LM head (a tied embedding counts once, as the head).
- Attention: the keys each query actually sees. Position i of a causal sequence (or of a packed
  segment, or of a branch of a tree-packed pair, counting the prefix it sees) attends to i + 1 keys,
  at most `sliding_window` in a sliding-window layer; the score and value products cost 4 H Q FLOPs
  per key (H heads of size Q), three times that in training. So a row of T tokens counts T (T + 1) / 2
  keys per layer, about half of the PaLM paper's 12 L H Q T per token, which charges every query all T
  keys (what a kernel without causal skipping computes: `dense_step_flops`, which XLA's cost
  analysis of a step agrees with).
Norms, the embedding lookup, softmax and other elementwise work are not counted.
"""

from __future__ import annotations

from collections.abc import Sequence

from polyalign.model.architecture import ModelConfig


def matmul_parameters(cfg: ModelConfig) -> int:
    """Parameters of the base model that take part in a matmul per token (adapters not included)."""
    d = cfg.hidden_size
    per_layer_norms = d * (4 if cfg.is_gemma else 2) + (2 * cfg.head_dim if cfg.qk_norm else 0)
    norms = per_layer_norms * cfg.num_layers + d
    untied_embedding = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    return cfg.num_parameters() - norms - untied_embedding


Segment = int | tuple[int, Sequence[int]]  # a causal sequence's length, or a tree: (prefix, branch lengths)


def attended_keys(lengths: Sequence[int], window: int | None = None) -> int:
    """Keys seen by every query of causal sequences (segments) of these lengths: sum of i + 1 over each
    position i, at most `window` per query."""
    total = 0
    for n in lengths:
        if window is None or n <= window:
            total += n * (n + 1) // 2
        else:  # the first `window` positions see i + 1 keys, the rest `window` each
            total += window * (window + 1) // 2 + (n - window) * window
    return total


def segment_tokens(segments: Sequence[Segment]) -> int:
    """The tokens these segments hold (a tree's prefix once)."""
    return sum(s if isinstance(s, int) else s[0] + sum(s[1]) for s in segments)


def _keys(segment: Segment, window: int | None) -> int:
    """The keys a segment's queries see. A tree (tree-packed pair) computes its prefix once; a branch's
    position p, counted from the prefix's start, sees p + 1 keys (the prefix and its own branch), as the
    same position of the unpacked sequence does."""
    if isinstance(segment, int):
        return attended_keys([segment], window)
    prefix, branches = segment
    shared = attended_keys([prefix], window)
    return shared + sum(attended_keys([prefix + branch], window) - shared for branch in branches)


def _matmul_flops_per_token(cfg: ModelConfig, reference_forward: bool) -> int:
    base, adapters = matmul_parameters(cfg), cfg.adapter_parameters()
    weight_passes = 4 if cfg.lora is not None else 6  # a frozen base under adapters: no weight gradient
    return weight_passes * base + 6 * adapters + (2 * base if reference_forward else 0)


def _attention_flops_per_key(cfg: ModelConfig, reference_forward: bool) -> int:
    """Score and value products per key a query sees: 4 H Q forward, three times that in training, one
    more forward for the reference."""
    return (3 + (1 if reference_forward else 0)) * 4 * cfg.num_heads * cfg.head_dim


def step_flops(cfg: ModelConfig, segments: Sequence[Segment], *, reference_forward: bool = False) -> float:
    """Training FLOPs of a step over these causal segments (rows of one sequence, packed segments,
    trees); with `reference_forward`, a frozen copy of the base (adapters off) runs a forward pass over
    the same tokens in the step. Padding is not counted."""
    tokens = segment_tokens(segments)
    keys = sum(_keys(segment, cfg.sliding_window if sliding else None)
               for sliding in cfg.sliding_layers for segment in segments)
    return (_matmul_flops_per_token(cfg, reference_forward) * tokens
            + _attention_flops_per_key(cfg, reference_forward) * keys)


def dense_step_flops(cfg: ModelConfig, rows: int, row_length: int, *, reference_forward: bool = False) -> float:
    """What a step computes when every position of every row is run and every query meets all of its
    row's keys, as XLA's attention does (masks are applied to the scores, no work is skipped): padding
    and the keys a mask hides counted. The PaLM paper's count (12 L H Q T per token for attention) is
    this one; XLA's cost analysis of a step agrees with it up to the elementwise work."""
    keys = cfg.num_layers * rows * row_length * row_length
    return (_matmul_flops_per_token(cfg, reference_forward) * rows * row_length
            + _attention_flops_per_key(cfg, reference_forward) * keys)


def flops_per_token(cfg: ModelConfig, seq: int, reference_forward: bool = False) -> float:
    """step_flops per token of rows holding one `seq`-token sequence each (the training loop's estimate
    at the configured row length)."""
    return step_flops(cfg, [seq], reference_forward=reference_forward) / seq
