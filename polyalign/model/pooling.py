"""Fixed-size encodings of texts by a decoder: the final hidden states mean-pooled over each text's
tokens. The critic reads responses through them, and evaluation feeds them to MAUVE."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm


def encode_responses(model, tokenizer, texts: list[str], max_tokens: int, batch_size: int,
                     progress: bool = True) -> np.ndarray:
    """Mean-pooled final hidden states [N, H] of each response alone (at most max_tokens tokens)."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def pooled(state, ids, mask):
        hidden = nnx.merge(graphdef, state).hidden_states(ids).astype(jnp.float32)
        return (hidden * mask[..., None]).sum(1) / jnp.maximum(mask.sum(1, keepdims=True), 1.0)

    encoded = [tokenizer.encode(t)[:max_tokens] or [tokenizer.pad_id] for t in texts]
    order = np.argsort([len(e) for e in encoded])  # similar lengths share a padded batch
    out = np.zeros((len(texts), model.config.hidden_size), np.float32)
    for start in tqdm(range(0, len(order), batch_size), desc="encode", unit="batch", disable=not progress):
        rows = order[start:start + batch_size]
        length = max(32, -(-max(len(encoded[i]) for i in rows) // 32) * 32)
        ids = np.full((batch_size, length), tokenizer.pad_id, np.int32)
        mask = np.zeros((batch_size, length), np.float32)
        for j, i in enumerate(rows):
            ids[j, :len(encoded[i])] = encoded[i]
            mask[j, :len(encoded[i])] = 1.0
        out[rows] = np.asarray(pooled(state, ids, mask))[:len(rows)]
    return out
