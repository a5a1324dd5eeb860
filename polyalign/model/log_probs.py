"""log p(target) per position straight from the final hidden states, one sequence chunk at a time.

The LM head's logits are the largest activation of a training step: [B, T, V] in float32 is 5 GiB for
8 x 1,024 tokens of Qwen2.5's 151,936-token vocabulary, and autodiff keeps them (or their softmax) for
the backward pass. Here the forward pass keeps only one [B, chunk, V] block at a time and saves the
per-position log-normaliser; the backward pass recomputes each block's logits once and turns them
into the hidden-state and head-weight gradients right away. The price is one extra head matmul
(forward) per step; the saving is every [B, T, V] buffer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def token_log_probs(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """log p(target) per position, in float32, from full logits [..., T, V] and targets [..., T]."""
    logits = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(logits, axis=-1)


def _blocks(x: jax.Array, chunk: int) -> jax.Array:
    """[B, T, ...] -> [T / chunk, B, chunk, ...], zero-padding T up to a multiple of chunk."""
    batch, length = x.shape[:2]
    blocks = -(-length // chunk)
    x = jnp.pad(x, [(0, 0), (0, blocks * chunk - length)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(batch, blocks, chunk, *x.shape[2:]), 1, 0)


def _unblocks(x: jax.Array, length: int) -> jax.Array:
    """Inverse of _blocks: [n, B, chunk, ...] -> [B, length, ...]."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :length]


def _head(h: jax.Array, weight: jax.Array, softcap: float | None) -> tuple[jax.Array, jax.Array | None]:
    """float32 logits of one block, and tanh(raw / cap) when soft-capped (for the backward pass)."""
    raw = jnp.einsum("bcd,dv->bcv", h, weight, preferred_element_type=jnp.float32)
    if softcap is None:
        return raw, None
    squashed = jnp.tanh(raw / softcap)
    return squashed * softcap, squashed


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def chunked_token_log_probs(hidden: jax.Array, weight: jax.Array, targets: jax.Array, chunk: int,
                            softcap: float | None = None) -> jax.Array:
    """log softmax(hidden @ weight)[target] per position, float32 [B, T], never holding more than one
    [B, chunk, V] block of logits. hidden [B, T, D], weight [D, V] (the LM head, transposed embedding
    when tied), targets int [B, T]; `softcap` applies Gemma 2's cap * tanh(logits / cap)."""
    return _forward(hidden, weight, targets, chunk, softcap)[0]


def _forward(hidden, weight, targets, chunk, softcap):
    def block(_, xs):
        h, t = xs
        logits, _ = _head(h, weight, softcap)
        normaliser = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0]
        return None, (picked - normaliser, normaliser)

    _, (log_probs, normalisers) = jax.lax.scan(block, None, (_blocks(hidden, chunk), _blocks(targets, chunk)))
    length = targets.shape[1]
    return _unblocks(log_probs, length), (hidden, weight, targets, _unblocks(normalisers, length))


def _backward(chunk, softcap, residuals, cotangent):
    hidden, weight, targets, normalisers = residuals

    def block(weight_grad, xs):
        h, t, normaliser, g = xs
        logits, squashed = _head(h, weight, softcap)
        # d log p(t) / d logits = onehot(t) - softmax(logits)
        logits_grad = -g[..., None] * jnp.exp(logits - normaliser[..., None])
        logits_grad = logits_grad + g[..., None] * jax.nn.one_hot(t, logits.shape[-1], dtype=logits_grad.dtype)
        if softcap is not None:
            logits_grad = logits_grad * (1.0 - squashed * squashed)
        logits_grad = logits_grad.astype(weight.dtype)
        hidden_grad = jnp.einsum("bcv,dv->bcd", logits_grad, weight, preferred_element_type=jnp.float32)
        weight_grad = weight_grad + jnp.einsum("bcd,bcv->dv", h, logits_grad, preferred_element_type=jnp.float32)
        return weight_grad, hidden_grad.astype(hidden.dtype)

    xs = (_blocks(hidden, chunk), _blocks(targets, chunk), _blocks(normalisers, chunk),
          _blocks(cotangent.astype(jnp.float32), chunk))
    weight_grad, hidden_grad = jax.lax.scan(block, jnp.zeros(weight.shape, jnp.float32), xs)
    return _unblocks(hidden_grad, hidden.shape[1]), weight_grad.astype(weight.dtype), None


chunked_token_log_probs.defvjp(_forward, _backward)


def example_nll(logits: jax.Array, targets: jax.Array, loss_mask: jax.Array) -> jax.Array:
    """Per-example mean NLL over its labelled tokens (METHOD section 4: l_i); 0 for an example with
    no labelled token. Returns [B]."""
    nll = -token_log_probs(logits, targets) * loss_mask
    return nll.sum(-1) / jnp.maximum(loss_mask.sum(-1), 1.0)
