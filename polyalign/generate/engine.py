"""A generation engine: continuous batching over a paged KV cache.

A fixed number of sequence slots decode together, one token each per step, in one compiled program of
fixed shapes. A slot whose sequence finishes (a stop token or its own token budget) gives its KV pages
back and takes the next waiting request at once; the new request's prompt is prefilled in chunks between
decoding steps of the others. A batch therefore lasts as long as its requests' own lengths, not as long
as its longest one: polyalign's buckets mix dialogue turns of a few dozen tokens with long answers.

Pages are reserved when a request is admitted (its prompt plus its token budget), so a running sequence
never waits for memory and nothing is ever preempted. The n samples of one request share the pages of
their prompt: the prompt is prefilled once up to its last full page, each sample prefills only the rest.

A request's tokens depend only on the weights, its prompt, its settings and its seed: sampling keys are
derived from (seed, sample index, token index), and every computation of a slot reads only that slot's
rows, so neither the other requests in flight nor the slot a request gets change what it samples.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from polyalign.core.errors import GenerationError
from polyalign.generate.sampling import (
    FINISH_LENGTH,
    FINISH_STOP,
    SamplingConfig,
    apply_penalties,
    min_p_mask,
    nucleus_mask,
)
from polyalign.mesh import parallel
from polyalign.model.lora import merge_adapters
from polyalign.model.paged_cache import NULL_PAGE, PagedKVCache


@dataclass(frozen=True)
class EngineConfig:
    """slots: sequences decoded together; page_size: token positions a page holds; max_sequence: the
    longest prompt plus token budget of one request; pages: the pool (default: every slot at
    max_sequence); prefill_chunk / prefill_rows: prompt tokens a prefill call runs per row, and rows per
    call; steps_per_sync: decoding steps run on the device between two visits of the scheduler."""

    slots: int = 16
    page_size: int = 16
    max_sequence: int = 1024
    pages: int | None = None
    prefill_chunk: int = 128
    prefill_rows: int = 4
    steps_per_sync: int = 8

    def __post_init__(self):
        for name in ("slots", "page_size", "max_sequence", "prefill_chunk", "prefill_rows", "steps_per_sync"):
            if getattr(self, name) < 1:
                raise GenerationError(f"engine {name} must be at least 1, got {getattr(self, name)}")
        if self.pages is not None and self.pages < 2:
            raise GenerationError(f"engine pages must be at least 2 (page 0 is never used), got {self.pages}")

    @property
    def pages_per_row(self) -> int:
        return -(-self.max_sequence // self.page_size)

    @property
    def pool_pages(self) -> int:
        return self.pages if self.pages is not None else self.slots * self.pages_per_row + 1


@dataclass(frozen=True)
class Request:
    """A prompt's token ids, how to sample it, its seed (`request_seed` derives one from an id), the
    number of samples, and optionally `stop_when(tokens)`: True ends a sample (finish reason "stop"),
    checked after each decoding call (stop strings, which no single token id expresses); and for a
    streamed answer `on_tokens(sample, tokens)`, told of a sample's tokens so far after each decoding call
    that made some, and `on_finish(sample, completion)`, told of each sample the moment it ends (the
    request's own result waits for all n). Both are called on the engine's thread: they must not block."""

    prompt: Sequence[int]
    sampling: SamplingConfig = SamplingConfig()
    seed: int = 0
    n: int = 1
    stop_when: Callable[[list[int]], bool] | None = None
    on_tokens: Callable[[int, list[int]], None] | None = None
    on_finish: Callable[[int, Completion], None] | None = None


@dataclass(frozen=True)
class Completion:
    """The new tokens (without the stop token) and why generation ended: "stop" or "length"."""

    tokens: list[int]
    finish_reason: str


def request_seed(key: str, seed: int = 0) -> int:
    """A request's own 32-bit seed from its id and a run seed: the same id draws the same tokens in any
    batch."""
    return int.from_bytes(hashlib.blake2b(f"{seed}\x00{key}".encode(), digest_size=4).digest(), "little")


# --- the compiled programs --------------------------------------------------------------------------

def sample_rows(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_p: jax.Array,
                top_k: jax.Array, min_p: jax.Array) -> jax.Array:
    """Next tokens [B] from float32 logits [B, V] with each row's own settings: greedy where the
    temperature is 0, else min-p (0 = none), then top-k (0 = none) and top-p (sampling.nucleus_mask) over
    what min-p kept, as vLLM orders them, then a categorical draw with the row's key. Skips the
    filtering when every row is greedy."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sampled(_):
        scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
        scaled = jnp.where(min_p_mask(scaled, min_p), scaled, -jnp.inf)
        keep = nucleus_mask(scaled, top_k, top_p)
        drawn = jax.vmap(jax.random.categorical)(keys, jnp.where(keep, scaled, -jnp.inf)).astype(jnp.int32)
        return jnp.where(temperature > 0, drawn, greedy)

    return jax.lax.cond(jnp.any(temperature > 0), sampled, lambda _: greedy, None)


def _replicated(tree, sharding):
    """`tree` laid out as `sharding` says (None: as the compiler likes, one device)."""
    return tree if sharding is None else jax.lax.with_sharding_constraint(tree, sharding)


@functools.partial(jax.jit, static_argnames=("graphdef", "pool_sharding"), donate_argnames=("pool",))
def _prefill(state, pool, page_table, ids, positions, store, *, graphdef, pool_sharding):
    """Writes the keys and values of prompt chunks ids [R, C] (store False: padding) into the pool."""
    model = nnx.merge(graphdef, state)
    cache = PagedKVCache.for_tokens(pool, page_table, positions, store)
    _, cache = model.decode_paged(ids, positions, cache, logits=False)
    return _replicated(cache.pool, pool_sharding)


@functools.partial(jax.jit, static_argnames=("sharding",), donate_argnames=("history",))
def _reset_history(history, rows, prompts, valid, *, sharding):
    """Clears the penalty history of slots `rows` [S] and marks their prompts' tokens (prompts [S, P] with
    valid [S, P]) as seen: a new request's repetition penalty covers its prompt."""
    counts, seen = history
    vocab = seen.shape[1]
    seen = seen & ~rows[:, None]
    columns = jnp.where(valid & rows[:, None], prompts, vocab)  # out of range: dropped
    seen = seen.at[jnp.arange(seen.shape[0])[:, None], columns].set(True, mode="drop")
    return _replicated((jnp.where(rows[:, None], 0, counts), seen), sharding)


@functools.partial(jax.jit, static_argnames=("graphdef", "steps", "stop_ids", "replicated", "pool_sharding",
                                             "history_sharding"), donate_argnames=("pool", "history"))
def _decode(state, pool, history, page_table, slots, refill, *, graphdef, steps: int, stop_ids: tuple[int, ...],
            replicated, pool_sharding, history_sharding):
    """Up to `steps` decoding steps of every live slot; with `refill` (requests are waiting) it returns
    as soon as a sequence finishes, so that its slot takes the next one. `slots` holds per-slot arrays
    [S]: token (the next input), position, count (tokens made so far), budget, seed, sample,
    temperature, top_p, top_k, min_p, the penalties, live; `history` the penalties' memory of each slot:
    how often its answer holds each token [S, V] and which tokens its prompt holds [S, V]. Returns the
    pool, the history, the updated slots and the tokens made [steps, S] with a mask of which are real."""
    model = nnx.merge(graphdef, state)
    stop = jnp.asarray(stop_ids, jnp.int32)
    base = jax.random.key(0)
    batch = slots["live"].shape[0]
    penalised = (slots["repetition"] != 1) | (slots["presence"] != 0) | (slots["frequency"] != 0)

    def step(carry):
        index, pool, (counts, seen), slots, tokens, made, _ = carry
        live = slots["live"]
        cache = PagedKVCache.for_tokens(pool, page_table, slots["position"][:, None], live[:, None])
        logits, cache = model.decode_paged(slots["token"][:, None], slots["position"][:, None], cache)
        logits = jax.lax.cond(jnp.any(live & penalised), lambda x: apply_penalties(
            x, seen, counts, slots["repetition"], slots["presence"], slots["frequency"]), lambda x: x, logits[:, 0])
        keys = jax.vmap(lambda s, j, c: jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(base, s), j), c))(
            slots["seed"], slots["sample"], slots["count"])
        new = sample_rows(logits, keys, slots["temperature"], slots["top_p"], slots["top_k"], slots["min_p"])
        counts = counts.at[jnp.arange(batch), new].add(live.astype(counts.dtype))
        count = slots["count"] + live
        finished = live & (jnp.isin(new, stop) | (count >= slots["budget"]))
        # a slot waiting for its prefill keeps its first input (the prompt's last token)
        slots = {**slots, "token": jnp.where(live, new, slots["token"]), "position": slots["position"] + live,
                 "count": count, "live": live & ~finished}
        return (index + 1, cache.pool, (counts, seen), slots, tokens.at[index].set(new), made.at[index].set(live),
                finished.any())

    def running(carry):
        index, _, _, slots, _, _, finished = carry
        return (index < steps) & slots["live"].any() & ~(refill & finished)

    carry = (jnp.int32(0), pool, history, slots, jnp.zeros((steps, batch), jnp.int32),
             jnp.zeros((steps, batch), bool), jnp.bool_(False))
    _, pool, history, slots, tokens, made, _ = jax.lax.while_loop(running, step, carry)
    # the pool and the history leave laid out as they came: the next call reuses this program and the buffers
    return (_replicated(pool, pool_sharding), _replicated(history, history_sharding),
            _replicated((slots, tokens, made), replicated))


# --- the scheduler ----------------------------------------------------------------------------------

@dataclass
class _Prefill:
    """Prompt positions [start, end) of one slot still to be written; `after` must finish first."""

    slot: int
    tokens: np.ndarray
    start: int
    end: int
    after: _Prefill | None = None
    done_to: int = field(init=False)

    def __post_init__(self):
        self.done_to = self.start

    @property
    def finished(self) -> bool:
        return self.done_to >= self.end

    @property
    def ready(self) -> bool:
        return not self.finished and (self.after is None or self.after.finished)

    @property
    def cached(self) -> bool:
        """Every prompt position of its slot up to `end` is in the cache: its own and the shared ones
        before it (a sample whose own part is empty waits for the shared pages all the same)."""
        return self.finished and (self.after is None or self.after.finished)


_SLOT_FIELDS = {"token": np.int32, "position": np.int32, "count": np.int32, "budget": np.int32, "seed": np.uint32,
                "sample": np.int32, "temperature": np.float32, "top_p": np.float32, "top_k": np.int32,
                "min_p": np.float32, "repetition": np.float32, "presence": np.float32, "frequency": np.float32,
                "live": bool}


class Engine:
    """Generates for token-id requests with one model. Engines of one architecture and one EngineConfig
    share their compiled programs. `set_model` swaps the weights (a training loop's current
    parameters) without recompiling."""

    def __init__(self, model, stop_ids: Sequence[int], config: EngineConfig = EngineConfig(), mesh=None):
        """With a mesh: parameters sharded by their logical axes as in training, slots over data x fsdp, the
        pool's KV heads over tensor when they divide."""
        self.config, self.mesh = config, mesh
        self.stop_ids = tuple(sorted({int(i) for i in stop_ids}))
        slots = config.slots
        self._replicated = self._slot_sharding = self._pool_sharding = None
        if mesh is not None:
            shards = mesh.shape["data"] * mesh.shape["fsdp"]
            slots = -(-slots // shards) * shards
            self._replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            self._slot_sharding = parallel.batch_sharding(mesh)
        self.slots = slots
        self.set_model(model)
        cfg = self.model_config
        if mesh is not None:
            tensor = "tensor" if cfg.num_kv_heads % mesh.shape["tensor"] == 0 else None
            self._pool_sharding = jax.sharding.NamedSharding(
                mesh, jax.sharding.PartitionSpec(None, None, None, tensor, None))
        self._pool = self._history = None
        self.stats: dict = {}  # of the last `generate`: calls, steps, peak pages, pages left in use

    def set_model(self, model) -> None:
        """The weights to sample; adapters and quantised projections are merged once, here."""
        model = merge_adapters(model)
        self.model_config = model.config
        self._graphdef, state = nnx.split(model)
        if self.mesh is not None:
            with jax.set_mesh(self.mesh):
                state = jax.device_put(state, parallel.param_shardings(state, self.mesh))
        self._state = state

    def release(self) -> None:
        """Lets go of the weights and the page pool until the next `set_model`."""
        self._state = self._pool = self._history = None

    def _pool_arrays(self):
        if self._pool is None:
            sharding = None if self._pool_sharding is None else (self._pool_sharding,) * 2
            empty = functools.partial(PagedKVCache.empty_pool, self.model_config, self.config.pool_pages,
                                      self.config.page_size)
            self._pool = jax.jit(empty, out_shardings=sharding)()  # made in place, shard by shard
        pool, self._pool = self._pool, None  # donated to the next program
        return pool

    def _history_arrays(self):
        """The penalties' memory of each slot (answer token counts, prompt tokens seen), [slots, vocab]."""
        if self._history is None or self._history[0].shape[1] != self.model_config.vocab_size:
            shape = (self.slots, self.model_config.vocab_size)
            # laid out by the constraint `_decode` puts on its output, which names the layout in its own
            # words (P('data') for P(('data', 'fsdp')) when fsdp is 1): an input spelt otherwise would be
            # another program to compile for the second call
            self._history = jax.jit(lambda: _replicated((jnp.zeros(shape, jnp.int32), jnp.zeros(shape, bool)),
                                                        self._slot_sharding))()
        history, self._history = self._history, None  # donated to the next program
        return history

    def _put(self, array, sharding):
        return jnp.asarray(array) if sharding is None else jax.device_put(array, sharding)

    def _check(self, index: int, request: Request) -> None:
        length, budget = len(request.prompt), request.sampling.max_new_tokens
        where = f"request {index}"
        if length == 0:
            raise GenerationError(f"{where}: the prompt is empty")
        if length + budget > self.config.max_sequence:
            raise GenerationError(f"{where}: {length} prompt tokens + {budget} new tokens exceed the engine's "
                                  f"max_sequence of {self.config.max_sequence}; shorten the prompt, lower "
                                  "max_new_tokens or raise max_sequence")
        if request.n < 1 or request.n > self.slots:
            raise GenerationError(f"{where}: n = {request.n} samples; the engine runs 1 to {self.slots} at once")
        if self._pages_needed(request) > self.config.pool_pages - 1:
            raise GenerationError(f"{where}: needs {self._pages_needed(request)} pages; the pool has "
                                  f"{self.config.pool_pages - 1}")

    def _shared_pages(self, request: Request) -> int:
        """Full pages of the prompt (its last token aside) that the request's samples share."""
        return (len(request.prompt) - 1) // self.config.page_size if request.n > 1 else 0

    def _own_pages(self, request: Request) -> int:
        written = len(request.prompt) + request.sampling.max_new_tokens - 1  # the last token is never fed back
        return -(-written // self.config.page_size) - self._shared_pages(request)

    def _pages_needed(self, request: Request) -> int:
        return self._shared_pages(request) + request.n * self._own_pages(request)

    def generate(self, requests: Sequence[Request], progress: Callable[[int], None] | None = None,
                 each: Callable[[int, list[Completion]], None] | None = None) -> list[list[Completion]]:
        """The n completions of each request, in request order. `progress(k)` is told of k finished
        requests as they finish, and `each(i, completions)` of request i's the moment it finishes (what an
        interrupted run keeps)."""
        for index, request in enumerate(requests):
            self._check(index, request)
        run = _Run(self, requests, progress, each)
        with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            results = run.until_done()
        self.stats = run.stats()
        return results


class _Run:
    """One `Engine.generate` call: the waiting requests, the slots, the pages and the prefill queue."""

    def __init__(self, engine: Engine, requests: Sequence[Request], progress, each=None):
        self.engine, self.requests, self.progress, self.each = engine, list(requests), progress, each
        cfg = engine.config
        # Longest budget first: the long requests start early and the short ones fill the gaps, so the run
        # does not end with one long sequence decoding alone. Order never changes a request's tokens.
        self.waiting = deque(sorted(range(len(requests)), key=lambda i: -requests[i].sampling.max_new_tokens))
        self.free_slots = list(range(engine.slots))
        self.free_pages = list(range(cfg.pool_pages - 1, NULL_PAGE, -1))  # pop() hands out 1, 2, ...
        self.page_refs: dict[int, int] = {}
        self.table = np.full((engine.slots, cfg.pages_per_row), NULL_PAGE, np.int32)
        self.slots = {name: np.zeros(engine.slots, dtype) for name, dtype in _SLOT_FIELDS.items()}
        self.owner: dict[int, tuple[int, int]] = {}
        self.made: dict[int, list[int]] = {}
        self.prefills: deque[_Prefill] = deque()
        self.results: list[list[Completion | None]] = [[None] * r.n for r in requests]
        self.open_samples = [r.n for r in requests]
        self.counts = {"prefill_calls": 0, "decode_calls": 0, "slot_steps": 0, "live_slot_steps": 0}
        self.peak_pages = 0
        self.on_done: dict[int, Callable[[list[Completion]], None]] = {}
        self.new_histories: dict[int, np.ndarray] = {}  # slot -> prompt, for a penalised request's slot

    def cancel(self, index: int) -> None:
        """Drops a request (its client has gone): out of the queue, or out of its slots and pages."""
        if index in self.waiting:
            self.waiting.remove(index)
        for slot in [slot for slot, (owner, _) in self.owner.items() if owner == index]:
            del self.owner[slot], self.made[slot]
            self.slots["live"][slot] = False
            self.prefills = deque(job for job in self.prefills if job.slot != slot)
            self.new_histories.pop(slot, None)
            self._release(slot)
        self.on_done.pop(index, None)
        self.results[index] = self.requests[index] = None

    def add(self, request: Request, on_done: Callable[[list[Completion]], None]) -> int:
        """A request that arrived while the run goes on (served requests): it waits its turn behind
        those before it, and `on_done` gets its completions, which the run then forgets."""
        index = len(self.requests)
        self.requests.append(request)
        self.results.append([None] * request.n)
        self.open_samples.append(request.n)
        self.on_done[index] = on_done
        self.waiting.append(index)
        return index

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.owner)

    def stats(self) -> dict:
        """What the run did: program calls, slot-steps decoded and how many of them held a live
        sequence, the most pages in use at once and the pages still held (0 after every run)."""
        return {**self.counts, "peak_pages": self.peak_pages, "pages_in_use": len(self.page_refs),
                "pool_pages": self.engine.config.pool_pages - 1}

    # pages and slots
    def _take_pages(self, count: int) -> list[int]:
        pages = [self.free_pages.pop() for _ in range(count)]
        for page in pages:
            self.page_refs[page] = self.page_refs.get(page, 0) + 1
        self.peak_pages = max(self.peak_pages, len(self.page_refs))
        return pages

    def _admit(self) -> None:
        """Moves waiting requests into free slots, in order, while slots and pages last."""
        engine = self.engine
        while self.waiting:
            index = self.waiting[0]
            request = self.requests[index]
            if request.n > len(self.free_slots) or engine._pages_needed(request) > len(self.free_pages):
                return
            self.waiting.popleft()
            prompt = np.asarray(request.prompt, np.int32)
            shared = self._take_pages(engine._shared_pages(request))
            for page in shared:
                self.page_refs[page] += request.n - 1
            prefix = None
            shared_to = len(shared) * engine.config.page_size
            for sample in range(request.n):
                slot = self.free_slots.pop(0)
                pages = shared + self._take_pages(engine._own_pages(request))
                self.table[slot] = NULL_PAGE
                self.table[slot, :len(pages)] = pages
                self._start_slot(slot, index, sample, request, prompt)
                if sample == 0 and shared_to:
                    prefix = _Prefill(slot, prompt, 0, shared_to)
                    self.prefills.append(prefix)
                self.prefills.append(_Prefill(slot, prompt, shared_to, len(prompt) - 1, after=prefix))

    def _start_slot(self, slot: int, index: int, sample: int, request: Request, prompt: np.ndarray) -> None:
        s, sampling = self.slots, request.sampling
        s["token"][slot], s["position"][slot] = prompt[-1], len(prompt) - 1
        s["count"][slot], s["budget"][slot] = 0, sampling.max_new_tokens
        s["seed"][slot], s["sample"][slot] = request.seed, sample
        s["temperature"][slot], s["top_p"][slot] = sampling.temperature, sampling.top_p
        s["top_k"][slot], s["min_p"][slot] = sampling.top_k, sampling.min_p
        s["repetition"][slot], s["presence"][slot] = sampling.repetition_penalty, sampling.presence_penalty
        s["frequency"][slot] = sampling.frequency_penalty
        if sampling.penalised:  # other slots' histories are never read: neutral penalties change nothing
            self.new_histories[slot] = prompt
        s["live"][slot] = False  # until its prompt is in the cache
        self.owner[slot], self.made[slot] = (index, sample), []

    def _release(self, slot: int) -> None:
        for page in self.table[slot][self.table[slot] != NULL_PAGE].tolist():
            self.page_refs[page] -= 1
            if self.page_refs[page] == 0:
                del self.page_refs[page]
                self.free_pages.append(page)
        self.table[slot] = NULL_PAGE
        self.free_slots.append(slot)
        self.free_slots.sort()

    # prefill
    def _prefill_step(self) -> None:
        engine, cfg = self.engine, self.engine.config
        jobs = [job for job in self.prefills if job.ready][:cfg.prefill_rows]
        if jobs:
            rows, chunk = cfg.prefill_rows, cfg.prefill_chunk
            ids = np.zeros((rows, chunk), np.int32)
            positions = np.zeros((rows, chunk), np.int32)
            store = np.zeros((rows, chunk), bool)
            table = np.full((rows, cfg.pages_per_row), NULL_PAGE, np.int32)
            for row, job in enumerate(jobs):
                stop = min(job.done_to + chunk, job.end)
                n = stop - job.done_to
                ids[row, :n] = job.tokens[job.done_to:stop]
                positions[row, :n] = np.arange(job.done_to, stop)
                store[row, :n] = True
                table[row] = self.table[job.slot]
                job.done_to = stop
            table, ids, positions, store = (engine._put(x, engine._replicated) for x in (table, ids, positions, store))
            engine._pool = _prefill(engine._state, engine._pool_arrays(), table, ids, positions, store,
                                    graphdef=engine._graphdef, pool_sharding=engine._pool_sharding)
            self.counts["prefill_calls"] += 1
        # a zero-length prefill (a one-token prompt, a sample's tail starting at the last token) is finished
        # from the start, but its slot decodes only once the shared pages before it are written too
        for job in [j for j in self.prefills if j.cached]:
            self.prefills.remove(job)
            if not any(other.slot == job.slot for other in self.prefills):
                self.slots["live"][job.slot] = True

    # decoding
    def _history_with_resets(self):
        """The penalty history, with the slots of newly admitted penalised requests reset to their prompts."""
        engine = self.engine
        history = engine._history_arrays()
        if self.new_histories:
            # prompts padded to 64, 128, 256, ... tokens: a handful of compiled resets serve every length
            width = 64 * 2 ** max(0, int(np.ceil(np.log2(max(map(len, self.new_histories.values())) / 64))))
            rows = np.zeros(engine.slots, bool)
            prompts = np.zeros((engine.slots, width), np.int32)
            valid = np.zeros((engine.slots, width), bool)
            for slot, prompt in self.new_histories.items():
                rows[slot], prompts[slot, :len(prompt)], valid[slot, :len(prompt)] = True, prompt, True
            history = _reset_history(history, *(engine._put(x, engine._slot_sharding) for x in (rows, prompts, valid)),
                                     sharding=engine._slot_sharding)
            self.new_histories.clear()
        return history

    def _decode_step(self) -> None:
        engine = self.engine
        slots = {name: engine._put(values, engine._slot_sharding) for name, values in self.slots.items()}
        steps = engine.config.steps_per_sync
        engine._pool, engine._history, (after, tokens, made) = _decode(
            engine._state, engine._pool_arrays(), self._history_with_resets(),
            engine._put(self.table, engine._slot_sharding), slots,
            engine._put(np.bool_(bool(self.waiting)), engine._replicated), graphdef=engine._graphdef, steps=steps,
            stop_ids=engine.stop_ids, replicated=engine._replicated, pool_sharding=engine._pool_sharding,
            history_sharding=engine._slot_sharding)
        after, tokens, made = jax.device_get((after, tokens, made))
        self.counts["decode_calls"] += 1
        self.counts["slot_steps"] += int(made.any(axis=1).sum()) * made.shape[1]  # steps run x slots
        self.counts["live_slot_steps"] += int(made.sum())
        was_live = self.slots["live"].copy()
        for name in ("token", "position", "count", "live"):
            self.slots[name] = np.array(after[name], dtype=_SLOT_FIELDS[name])
        finished = 0
        for slot in np.flatnonzero(was_live).tolist():
            new = tokens[made[:, slot], slot].tolist()
            self.made[slot].extend(new)
            index, sample = self.owner[slot]
            request = self.requests[index]
            if new and request.on_tokens is not None:  # without a stop token that ended it, as _finish leaves it out
                so_far = self.made[slot]
                request.on_tokens(sample, so_far[:-1] if so_far[-1] in self.engine.stop_ids else list(so_far))
            stop_when = request.stop_when
            if self.slots["live"][slot] and stop_when is not None and stop_when(self.made[slot]):
                self.slots["live"][slot] = False
                finished += self._finish(slot, FINISH_STOP)
            elif not self.slots["live"][slot]:
                finished += self._finish(slot)
        if finished and self.progress is not None:
            self.progress(finished)

    def _finish(self, slot: int, reason: str | None = None) -> int:
        """Records a finished sample (`reason`: why, when the scheduler ended it); 1 when it was its
        request's last."""
        index, sample = self.owner.pop(slot)
        tokens = self.made.pop(slot)
        if reason is not None:
            completion = Completion(tokens, reason)
        elif tokens and tokens[-1] in self.engine.stop_ids:
            completion = Completion(tokens[:-1], FINISH_STOP)
        else:
            completion = Completion(tokens, FINISH_LENGTH)
        self.results[index][sample] = completion
        if self.requests[index].on_finish is not None:
            self.requests[index].on_finish(sample, completion)
        self._release(slot)
        self.open_samples[index] -= 1
        if self.open_samples[index]:
            return 0
        if self.each is not None:
            self.each(index, self.results[index])
        if index in self.on_done:
            self.on_done.pop(index)(self.results[index])
            self.results[index] = self.requests[index] = None
        return 1

    def step(self) -> None:
        """Admits what fits, runs one prefill call and one decoding call."""
        self._admit()
        if self.prefills:
            self._prefill_step()
        if self.slots["live"].any():
            self._decode_step()

    def until_done(self) -> list[list[Completion]]:
        while self.busy:
            self.step()
        return self.results


class EngineLoop:
    """Serves requests that arrive over time (`polyalign serve`): one thread runs the engine, and a
    request submitted while others decode joins them at the next step. At most `max_pending` requests
    wait or run at once; `submit` refuses more (QueueFull), so a flood of requests cannot grow memory
    without bound."""

    def __init__(self, engine: Engine, max_pending: int = 64):
        self.engine, self.max_pending = engine, max_pending
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name="polyalign-engine", daemon=True)
        self._thread.start()

    def submit(self, request: Request) -> concurrent.futures.Future:
        """A future of the request's completions. Raises GenerationError for a request the engine cannot
        hold, QueueFull when max_pending requests are already in."""
        self.engine._check(0, request)
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:  # put under the lock the engine's thread takes to fail what is left in the inbox
            if self._failure is not None or self._closed.is_set():
                raise GenerationError(f"the engine has stopped: {self._failure or 'closed'}")
            if self._pending >= self.max_pending:
                raise queue.Full(f"{self._pending} requests are already waiting or running")
            self._pending += 1
            self._inbox.put((request, future))
        return future

    def cancel(self, future: concurrent.futures.Future) -> None:
        """Drops a submitted request whose answer nobody waits for any more; its slots and pages go to
        the others at the next step."""
        self._inbox.put(("cancel", future))

    def close(self) -> None:
        self._closed.set()
        self._inbox.put(None)
        self._thread.join()

    def _done(self, future: concurrent.futures.Future, completions: list[Completion]) -> None:
        with self._lock:
            self._pending -= 1
        future.set_result(completions)

    def _serve(self) -> None:
        run = _Run(self.engine, [], None)
        indices: dict[concurrent.futures.Future, int] = {}
        try:
            with jax.set_mesh(self.engine.mesh) if self.engine.mesh is not None else contextlib.nullcontext():
                while not self._closed.is_set():
                    # wait for work when idle; otherwise take what arrived and step
                    arrivals = [self._inbox.get()] if not run.busy else []
                    while not self._inbox.empty():
                        arrivals.append(self._inbox.get())
                    for item in arrivals:
                        if item is None:
                            continue
                        if item[0] == "cancel":
                            if item[1] in indices and not item[1].done():
                                run.cancel(indices.pop(item[1]))
                                with self._lock:
                                    self._pending -= 1
                            item[1].cancel()
                            continue
                        request, future = item
                        indices[future] = run.add(request, functools.partial(self._done, future))
                    if run.busy:
                        run.step()
                    indices = {f: i for f, i in indices.items() if not f.done()}
            error: BaseException = GenerationError("the server is shutting down")
        except BaseException as failure:  # every waiting caller hears why, instead of waiting forever
            error = failure
            raise
        finally:
            with self._lock:  # no submit puts after this: those still in the inbox are failed with the rest
                self._failure = error
                waiting = []
                while not self._inbox.empty():
                    item = self._inbox.get()
                    if item is not None and item[0] != "cancel":
                        waiting.append(item[1])
            for future in [*indices, *waiting]:
                if not future.done():
                    future.set_exception(GenerationError(f"the engine stopped: {error}"))
