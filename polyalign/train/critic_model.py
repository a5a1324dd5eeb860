"""The support-distance critic c(y, b) (METHOD section 6) as a model: its network, its scores on
encoded responses, support-distance targets, and a trained critic loaded with its frozen encoder to
score texts. Training it is polyalign/train/critic.py."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load

from polyalign.core.paths import as_path
from polyalign.features.references import support_distance
from polyalign.features.response import text_features
from polyalign.mesh import parallel
from polyalign.model import load_hf_checkpoint
from polyalign.model.hf import checkpoint_tokenizer
from polyalign.model.pooling import encode_responses

MARGIN = 0.1
BUCKET_DIM, HIDDEN = 64, 256


class Critic(nnx.Module):
    """c(y, b) = MLP([pooled hidden state of y; embedding of b]); bucket index num_buckets = unknown."""

    def __init__(self, hidden_size: int, num_buckets: int, dropout: float, rngs: nnx.Rngs):
        self.bucket_embedding = nnx.Embed(num_buckets + 1, BUCKET_DIM, rngs=rngs)
        self.layer1 = nnx.Linear(hidden_size + BUCKET_DIM, HIDDEN, rngs=rngs)
        self.layer2 = nnx.Linear(HIDDEN, HIDDEN, rngs=rngs)
        self.out = nnx.Linear(HIDDEN, 1, rngs=rngs)
        self.dropout = dropout

    def __call__(self, pooled: jax.Array, bucket: jax.Array, key: jax.Array | None = None) -> jax.Array:
        def drop(x, k):
            if key is None or self.dropout == 0:
                return x
            keep = jax.random.bernoulli(k, 1.0 - self.dropout, x.shape)
            return jnp.where(keep, x / (1.0 - self.dropout), 0.0)

        keys = jax.random.split(key) if key is not None else (None, None)
        x = jnp.concatenate([pooled, self.bucket_embedding(bucket)], axis=-1)
        x = drop(jax.nn.gelu(self.layer1(x), approximate=False), keys[0])
        x = drop(jax.nn.gelu(self.layer2(x), approximate=False), keys[1])
        return self.out(x)[..., 0]


def support_targets(texts: list[str], buckets: list[str], references: dict, skip_constant: bool = True,
                    counts: str = "per_token") -> np.ndarray:
    """d(y, b) for each response from its own text features; NaN where the bucket has no reference."""
    names = references["features"]
    targets = np.full(len(texts), np.nan, np.float32)
    for i, (text, bucket) in enumerate(zip(texts, buckets)):
        reference = references["buckets"].get(bucket)
        if reference is not None:
            targets[i] = support_distance(text_features(text), reference, names, skip_constant, counts)
    return targets


def set_scores(pairs: list[dict], human: np.ndarray, generated: np.ndarray) -> None:
    """The critic's scores of both sides onto each pair (critic_chosen, critic_rejected)."""
    for pair, c_h, c_m in zip(pairs, human, generated):
        pair["critic_chosen"], pair["critic_rejected"] = round(float(c_h), 6), round(float(c_m), 6)


@functools.partial(jax.jit, static_argnames="graphdef")
def _scores(state, pooled: jax.Array, bucket: jax.Array, *, graphdef) -> jax.Array:
    return nnx.merge(graphdef, state)(pooled, bucket)


def score(critic: Critic, pooled: np.ndarray, bucket: np.ndarray) -> np.ndarray:
    """c(y, b) for each row. One compiled program per critic shape and batch size, however often the
    critic is scored (every epoch of its training)."""
    graphdef, state = nnx.split(critic)
    return np.asarray(_scores(state, pooled, bucket, graphdef=graphdef))


class CriticScorer:
    """A trained critic with its frozen encoder, loaded from the folder `polyalign train critic` wrote."""

    def __init__(self, directory: Path):
        directory = as_path(directory)
        info = json.loads((directory / "critic.json").read_text())
        self.buckets = {b: i for i, b in enumerate(info["buckets"])}
        self.max_tokens = info["max_tokens"] if "max_tokens" in info else info["config"]["max_tokens"]
        self.tokenizer = checkpoint_tokenizer(info["encoder"])
        self.encoder = load_hf_checkpoint(info["encoder"])
        with parallel.unsharded():
            self.critic = Critic(info["hidden_size"], len(self.buckets), 0.0, nnx.Rngs(0))
        tensors = load((directory / "critic.safetensors").read_bytes())
        for path, var in nnx.to_flat_state(nnx.state(self.critic, nnx.Param)):
            var[...] = jnp.asarray(tensors[".".join(map(str, path))])

    def __call__(self, texts: list[str], buckets: list[str], progress: bool = False) -> np.ndarray:
        pooled = encode_responses(self.encoder, self.tokenizer, texts, self.max_tokens, 16, progress)
        unknown = len(self.buckets)
        return score(self.critic, pooled, np.array([self.buckets.get(b, unknown) for b in buckets], np.int32))
