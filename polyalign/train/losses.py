"""Losses as pure functions of arrays."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_log_probs(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """log p(target) per position, in float32. logits [..., T, V], targets [..., T]."""
    logits = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(logits, axis=-1)


def example_nll(logits: jax.Array, targets: jax.Array, loss_mask: jax.Array) -> jax.Array:
    """Per-example mean NLL over its labelled tokens (METHOD section 4: l_i); 0 for an example with
    no labelled token. Returns [B]."""
    nll = -token_log_probs(logits, targets) * loss_mask
    return nll.sum(-1) / jnp.maximum(loss_mask.sum(-1), 1.0)


def weighted_mean(values: jax.Array, weights: jax.Array) -> jax.Array:
    """sum_i w_i v_i / sum_i w_i, 0 when the weights sum to 0."""
    total = weights.sum()
    return jnp.where(total > 0, (weights * values).sum() / jnp.where(total > 0, total, 1.0), 0.0)
