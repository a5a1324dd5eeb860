"""Fixed-size encodings of texts by a decoder: the final hidden states mean-pooled over each text's
tokens. The critic reads responses through them, and evaluation feeds them to MAUVE."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from polyalign.core.progress import progress_bar


def encode_responses(model, tokenizer, texts: list[str], max_tokens: int, batch_size: int,
                     progress: bool = True) -> np.ndarray:
    """Mean-pooled final hidden states [N, H] of each response alone (at most max_tokens tokens)."""
    graphdef, state = nnx.split(model)
    encoded = [tokenizer.encode(t)[:max_tokens] or [tokenizer.pad_id] for t in texts]
    order = np.argsort([len(e) for e in encoded])  # similar lengths share a padded batch
    out = np.zeros((len(texts), model.config.hidden_size), np.float32)
    # the critic encodes on every process alike: one bar says how far they are
    for start in progress_bar(range(0, len(order), batch_size), progress=progress and jax.process_index() == 0,
                              desc="encode", unit="batch"):
        rows = order[start:start + batch_size]
        length = padded_length(max(len(encoded[i]) for i in rows), max_tokens)
        ids = np.full((batch_size, length), tokenizer.pad_id, np.int32)
        mask = np.zeros((batch_size, length), np.float32)
        for j, i in enumerate(rows):
            ids[j, :len(encoded[i])] = encoded[i]
            mask[j, :len(encoded[i])] = 1.0
        out[rows] = np.asarray(_pooled(graphdef, state, ids, mask))[:len(rows)]
    return out


def padded_length(tokens: int, max_tokens: int) -> int:
    """The batch length for a longest text of `tokens` (of at most `max_tokens`): a power of two from 32, or
    max_tokens rounded up to 32 when that is shorter, so that a whole evaluation (every bucket, every model
    of one architecture) compiles a handful of programs. A causal decoder's hidden states at a text's
    positions do not depend on the padding after it."""
    return min(max(32, 1 << (max(tokens, 1) - 1).bit_length()), max(32, -(-max_tokens // 32) * 32))


# One program per architecture and batch shape for the whole process: the critic encodes its train and
# validation pairs, and evaluation's MAUVE featurizer every bucket's answers, through the same compile.
@functools.partial(jax.jit, static_argnums=0)
def _pooled(graphdef, state, ids, mask):
    hidden = nnx.merge(graphdef, state).hidden_states(ids).astype(jnp.float32)
    return (hidden * mask[..., None]).sum(1) / jnp.maximum(mask.sum(1, keepdims=True), 1.0)
