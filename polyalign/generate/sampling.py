"""The static-batch sampler: one batch of prompts decoded with a dense KV cache until all have stopped.

The engine (generate/engine.py) generates for every stage; this sampler stays as the reference it is
tested and measured against; `SamplingConfig` and the top-k/top-p filter `nucleus_mask` are shared by both.

Prompts are left-padded to a common length so that every row's next token goes to the same cache
slot; positions count real tokens only, so padding never shifts the rotary embedding. The prompt is
prefilled in one pass, then one jitted loop decodes until every row has stopped or the budget is spent.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from polyalign.core.errors import GenerationError
from polyalign.generate.settings import NEUTRAL
from polyalign.mesh import parallel
from polyalign.model.transformer import KVCache, Transformer

FINISH_STOP, FINISH_LENGTH = "stop", "length"


@dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    min_p: float = 0.0  # drop tokens less likely than min_p times the likeliest one (0 = no cut)
    # vLLM's (and transformers') repetition penalty over the prompt's and the answer's tokens: a logit
    # above 0 is divided by it, one below 0 multiplied; 1 = none
    repetition_penalty: float = 1.0
    # OpenAI's: subtracted from a token's logit once if the answer holds it / per time it does
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise GenerationError("max_new_tokens must be at least 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise GenerationError("temperature >= 0, 0 < top_p <= 1 and top_k >= 0 are required")
        if not 0 <= self.min_p <= 1 or not self.repetition_penalty > 0:
            raise GenerationError("0 <= min_p <= 1 and repetition_penalty > 0 are required")
        if not (-2 <= self.presence_penalty <= 2 and -2 <= self.frequency_penalty <= 2):
            raise GenerationError("presence_penalty and frequency_penalty must lie in [-2, 2], as OpenAI's")

    @property
    def penalised(self) -> bool:
        """Whether the tokens seen so far change the next token's logits."""
        return any(getattr(self, key) != NEUTRAL[key] for key in NEUTRAL if key != "min_p")


def _ordered_bits(x: jax.Array) -> jax.Array:
    """float32 -> uint32 in the same order (-inf lowest, +inf highest; -0.0 counted as 0.0)."""
    bits = jax.lax.bitcast_convert_type(x + 0.0, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _lowest_passing(passes: Callable[[jax.Array], jax.Array], rows: int) -> jax.Array:
    """Per row, the smallest uint32 t for which passes(t) [rows] holds, `passes` being monotone in t
    (False up to some t, then True) and True at the largest value: 32 bisection steps."""
    def halve(_, bounds):
        low, high = bounds
        middle = low + (high - low) // 2
        ok = passes(middle)
        return jnp.where(ok, low, middle + 1), jnp.where(ok, middle, high)

    bounds = (jnp.zeros((rows,), jnp.uint32), jnp.full((rows,), 0xFFFFFFFF, jnp.uint32))
    return jax.lax.fori_loop(0, 32, halve, bounds)[1]


def nucleus_mask(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Which tokens of float32 logits [B, V] a row may draw: the top_k [B] most likely (0 = no cut),
    then, renormalised over those, the most likely ones while the mass above them is below top_p [B]
    (nucleus). Equal logits are kept or cut together; the most likely token always stays.

    A token is kept when fewer than k tokens, and less than top_p of the mass, lie above it. Both
    counts only fall as a token's logit rises, so each rule keeps the tokens at or above a threshold,
    found by bisection over the logits' bit patterns: no sort of the vocabulary, which XLA runs on CPU
    at about 18 ms for 16 rows of 6,000 (over nine tenths of a tiny model's decoding step)."""
    rows, vocab = logits.shape
    bits = _ordered_bits(logits)

    def top_k_cut(_):
        k = jnp.where(top_k > 0, top_k, vocab)
        return bits >= _lowest_passing(lambda t: (bits > t[:, None]).sum(-1) < k, rows)[:, None]

    # the cut keeps every token of a row without one: skipped when no row has one (half the bisections)
    in_top_k = jax.lax.cond(jnp.any(top_k > 0), top_k_cut, lambda _: jnp.ones((rows, vocab), bool), None)
    probs = jax.nn.softmax(jnp.where(in_top_k, logits, -jnp.inf), axis=-1)
    above = _lowest_passing(lambda t: jnp.where(bits > t[:, None], probs, 0.0).sum(-1) < top_p, rows)
    return in_top_k & (bits >= above[:, None])


def min_p_mask(logits: jax.Array, min_p: jax.Array) -> jax.Array:
    """Which tokens of float32 logits [B, V] are at least min_p [B] times as likely as the row's likeliest
    (vLLM's rule, on the probabilities after temperature); min_p 0 keeps every token."""
    probs = jax.nn.softmax(logits, axis=-1)
    return probs >= min_p[:, None] * probs.max(axis=-1, keepdims=True)


def apply_penalties(logits: jax.Array, prompt_seen: jax.Array, counts: jax.Array, repetition: jax.Array,
                    presence: jax.Array, frequency: jax.Array) -> jax.Array:
    """Logits [B, V] after vLLM's penalties, in its order: the repetition penalty [B] on every token of the
    prompt (prompt_seen [B, V]) or the answer so far (counts [B, V], how often it holds each token), then
    OpenAI's frequency and presence penalties [B] on the answer's tokens. Neutral settings (1, 0, 0) leave
    a row's logits exactly as they were."""
    made = counts > 0
    factor = jnp.where(prompt_seen | made, repetition[:, None], 1.0)
    logits = jnp.where(logits > 0, logits / factor, logits * factor)
    return logits - frequency[:, None] * counts - presence[:, None] * made


def sample_logits(logits: jax.Array, rng: jax.Array, config: SamplingConfig) -> jax.Array:
    """Next tokens [B] from float32 logits [B, V]: greedy at temperature 0, else top-k / top-p
    (nucleus_mask) and a categorical draw."""
    if config.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / config.temperature
    if config.top_k or config.top_p < 1.0:
        rows = logits.shape[0]
        keep = nucleus_mask(logits, jnp.full((rows,), config.top_k, jnp.int32),
                            jnp.full((rows,), config.top_p, jnp.float32))
        logits = jnp.where(keep, logits, -jnp.inf)
    return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


def _left_pad(prompts: Sequence[np.ndarray], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.full((len(prompts), length), pad_id, np.int32)
    valid = np.zeros((len(prompts), length), bool)
    for row, prompt in enumerate(prompts):
        if len(prompt):
            ids[row, -len(prompt):] = prompt
            valid[row, -len(prompt):] = True
    return ids, valid


def _bucket(n: int, multiple: int = 32) -> int:
    """Pad lengths to multiples so that a few compiled shapes serve every batch."""
    return max(multiple, -(-n // multiple) * multiple)


@functools.partial(jax.jit, static_argnames=("graphdef", "model_config", "config", "pad_id", "stop_ids", "replicated"))
def _sample(state, ids, valid, rng, *, graphdef, model_config, config: SamplingConfig, pad_id: int,
            stop_ids: tuple[int, ...], replicated):
    """Prefill, then decode until every row has stopped or the budget is spent: (tokens, lengths, done).
    With `replicated` (a sharding) every process gets every row."""
    model = nnx.merge(graphdef, state)
    stop = jnp.asarray(stop_ids, jnp.int32)
    batch, prompt_len = ids.shape
    slots = prompt_len + config.max_new_tokens
    kv_valid = jnp.concatenate([valid, jnp.ones((batch, config.max_new_tokens), bool)], axis=1)
    positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0).astype(jnp.int32)
    cache = KVCache.empty(model_config, batch, slots)
    logits, cache = model.decode(ids, positions, cache, kv_valid)
    rng, first_rng = jax.random.split(rng)
    token = sample_logits(logits[:, -1], first_rng, config)
    next_position = positions[:, -1] + 1
    out = jnp.full((batch, config.max_new_tokens), pad_id, jnp.int32).at[:, 0].set(token)
    done = jnp.isin(token, stop)
    lengths = jnp.ones((batch,), jnp.int32)

    def cond(carry):
        step, _, _, done, *_ = carry
        return (step < config.max_new_tokens) & ~done.all()

    def body(carry):
        step, token, cache, done, out, lengths, position, rng = carry
        logits, cache = model.decode(token[:, None], position[:, None], cache, kv_valid)
        rng, step_rng = jax.random.split(rng)
        new = sample_logits(logits[:, 0], step_rng, config)
        new = jnp.where(done, pad_id, new)
        out = out.at[:, step].set(new)
        lengths = lengths + (~done).astype(jnp.int32)
        done = done | jnp.isin(new, stop)
        return step + 1, new, cache, done, out, lengths, position + 1, rng

    carry = (jnp.int32(1), token, cache, done, out, lengths, next_position, rng)
    _, _, _, done, out, lengths, _, _ = jax.lax.while_loop(cond, body, carry)
    result = out, lengths, done
    return result if replicated is None else jax.lax.with_sharding_constraint(result, replicated)


class Sampler:
    """Generates continuations for token-id prompts with one model. Samplers of one architecture and one
    SamplingConfig share their compiled programs (`_sample`), however many models are sampled in turn."""

    def __init__(self, model: Transformer, stop_ids: Sequence[int], pad_id: int, config: SamplingConfig,
                 mesh=None):
        """With a mesh, parameters are sharded by their logical axes and the batch over data x fsdp."""
        if config.penalised or config.min_p:
            raise GenerationError("the static-batch sampler has no penalties or min_p; the engine "
                                  "(generate/engine.py) has")
        self.config, self.pad_id, self.mesh = config, pad_id, mesh
        graphdef, self.state = nnx.split(model)
        self._static = {"graphdef": graphdef, "model_config": model.config, "config": config, "pad_id": pad_id,
                        "stop_ids": tuple(sorted({int(i) for i in stop_ids})), "replicated": None}
        self.batch_multiple = 1
        if mesh is not None:
            # every process reads every answer (a few ints per row), also when the batch spans hosts
            self._static["replicated"] = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            with jax.set_mesh(mesh):
                self.state = jax.device_put(self.state, parallel.param_shardings(self.state, mesh))
            self.batch_sharding = parallel.batch_sharding(mesh)
            self.batch_multiple = mesh.shape["data"] * mesh.shape["fsdp"]

    def _run(self, state, ids, valid, rng):
        return _sample(state, ids, valid, rng, **self._static)

    def generate(self, prompts: Sequence[np.ndarray], seed: int = 0) -> list[tuple[list[int], str]]:
        """For each prompt: the new tokens (without the stop token) and why generation ended."""
        length = _bucket(max(len(p) for p in prompts))
        rows = -(-len(prompts) // self.batch_multiple) * self.batch_multiple  # whole shards; extra rows are empty
        ids, valid = _left_pad(list(prompts) + [np.zeros(0, np.int32)] * (rows - len(prompts)), length, self.pad_id)
        if self.mesh is None:
            result = self._run(self.state, ids, valid, jax.random.key(seed))
        else:
            with jax.set_mesh(self.mesh):
                ids, valid = (jax.device_put(x, self.batch_sharding) for x in (ids, valid))
                result = self._run(self.state, ids, valid, jax.random.key(seed))
        out, lengths, done = jax.device_get(result)
        results = []
        for row in range(len(prompts)):
            tokens = out[row, :lengths[row]].tolist()
            if done[row]:
                results.append((tokens[:-1], FINISH_STOP))
            else:
                results.append((tokens, FINISH_LENGTH))
        return results
