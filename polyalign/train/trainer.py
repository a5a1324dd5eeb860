"""One training loop for SFT, the critic and HDPO: a method is a loss plus its batch layout.

A method splits its objective into terms, each a sum over examples (the numerator) divided by a
normaliser that does not depend on the parameters (the denominator: a sum of weights or a count).
The step first computes every denominator over the whole global batch (all micro-batches, devices
and hosts), then accumulates the gradient of sum_k c_k num_k / den_k micro-batch by micro-batch. The
update is therefore the same whatever the micro-batch size, device count or host count.
"""

from __future__ import annotations

import dataclasses
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from polyalign.core.errors import TrainingError
from polyalign.core.progress import progress_bar
from polyalign.core.wording import counted
from polyalign.inputs.pipeline import iterate
from polyalign.mesh import parallel
from polyalign.model.lora import has_adapters
from polyalign.train.config import LoopConfig, OptimizerConfig
from polyalign.train.throughput import Throughput

if TYPE_CHECKING:  # the step needs neither Orbax/grain checkpoints nor metric writers
    from polyalign.train.checkpoint import Checkpointer
    from polyalign.train.metrics import MetricsWriter

Batch = dict[str, jax.Array]


class Objective(Protocol):
    """A training objective: sum over terms k of coefficients[k] * numerator_k / denominator_k."""

    coefficients: dict[str, float]

    def denominators(self, batch: Batch) -> dict[str, jax.Array]:
        """Per term, an array [micro_batches] of normalisers, from batch data only."""

    def numerators(self, model: nnx.Module, micro_batch: Batch,
                   key: jax.Array | None) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
        """Per term, the micro-batch's summed loss; and metric sums (added over micro-batches). `key` is
        a fresh random key for each micro-batch of each step (dropout); None when evaluating."""


def warmup_steps(config: OptimizerConfig, steps: int) -> int:
    """The steps of the linear warmup: warmup_ratio of the run, at least one when there is any."""
    return max(1, int(round(config.warmup_ratio * steps))) if config.warmup_ratio > 0 else 0


def make_optimizer(config: OptimizerConfig, steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with linear warmup then cosine decay; global-norm clipping; no decay on norms and biases.
    Step k (1-based; the optimiser's count is k - 1) takes the warmup's k-th rung, lr k / warmup: the first
    step learns (lr / warmup rather than optax's 0, which left a one-step run where it started), the
    warmup's last reaches lr and the run's last step the cosine's end, lr * min_lr_ratio."""
    warmup = warmup_steps(config, steps)
    base = optax.warmup_cosine_decay_schedule(0.0, config.lr, warmup, max(steps, warmup + 1),
                                              end_value=config.lr * config.min_lr_ratio)

    def schedule(count):
        return base(count + 1)

    def decayed(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: any(getattr(k, "key", None) in ("kernel", "embedding", "lora_a", "lora_b") for k in path),
            params)

    adamw = optax.adamw(schedule, b1=config.b1, b2=config.b2, eps=config.eps,
                        weight_decay=config.weight_decay, mask=decayed)
    tx = optax.chain(optax.clip_by_global_norm(config.clip), adamw) if config.clip else adamw
    return tx, schedule


def _tree_add(a, b):
    return jax.tree.map(jnp.add, a, b)


# An objective may carry state that changes from step to step (adaptive bucket weights): it offers
# initial_state() -> dict of arrays, bind(state) -> the objective using that state, and
# update_state(state, metric_sums) -> the state after a step. Objectives without these are stateless.

def _initial_state(objective) -> dict:
    return objective.initial_state() if hasattr(objective, "initial_state") else {}


def _bound(objective, state: dict):
    return objective.bind(state) if state else objective


def check_batch_division(loop, mesh: Mesh) -> None:
    """Refuses a global batch whose micro-batches do not divide over the mesh's batch shards and the
    processes; a run checks it before it writes anything into OUT, so the corrected command starts afresh."""
    micro = loop.global_batch // loop.micro_batches
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    if loop.global_batch % loop.micro_batches or micro % shards or micro % jax.process_count():
        processes = jax.process_count()
        raise TrainingError(f"global_batch {loop.global_batch} / micro_batches {loop.micro_batches} = {micro} "
                            f"sequences per micro-batch must divide over {counted(shards, 'batch shard')} (data x fsdp)"
                            + (f" and {processes} processes" if processes > 1 else ""))


class Trainer:
    """Owns the sharded state {params, opt_state, step, rng, nonfinite} and runs the loop.

    `params` are what is trained: every nnx.Param, or with adapters (polyalign/model/lora.py) the
    LoRA parameters only. The base parameters of an adapted model are `frozen`: inputs of every step,
    sharded like params, with no gradient, no optimizer state and no place in checkpoints."""

    def __init__(self, model: nnx.Module, objective: Objective, optimizer: OptimizerConfig, loop: LoopConfig,
                 mesh, *, metrics: MetricsWriter | None = None, throughput: Throughput | None = None,
                 profile_dir=None):
        """`throughput` turns each step's tokens and seconds into tokens/s, per device and MFU (default:
        no MFU); `profile_dir` receives the profiler trace of loop.profile_steps."""
        self.objective, self.loop, self.mesh = objective, loop, mesh
        self.throughput = throughput or Throughput(mesh.devices.size)
        self.profile_dir = profile_dir
        self.tx, self.schedule = make_optimizer(optimizer, loop.steps)

        trainable = nnx.LoRAParam if has_adapters(model) else nnx.Param
        self.graphdef, params, frozen, self.rest = nnx.split(model, trainable, nnx.Param, ...)
        self.param_shardings = parallel.param_shardings(params, mesh)
        frozen_shardings = parallel.param_shardings(frozen, mesh)
        replicated = NamedSharding(mesh, PartitionSpec())
        # A model from abstract_model() gives an abstract trainer: its step compiles (memory analysis,
        # cost) but never runs, and nothing is allocated.
        self.abstract = any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params))
        with jax.set_mesh(mesh):
            if self.abstract:
                params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params,
                                      self.param_shardings)
                self.frozen = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), frozen,
                                           frozen_shardings)
                init = jax.jit(self.tx.init).lower(params).compile()
                opt_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                         jax.eval_shape(self.tx.init, params), init.output_shardings)
            else:
                params = jax.device_put(params, self.param_shardings)
                self.frozen = jax.device_put(frozen, frozen_shardings)
                opt_state = parallel.ordered(jax.jit(self.tx.init)(params))

            def scalar(value):
                if self.abstract:
                    return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=replicated)
                return jax.device_put(value, replicated)

            self.state = {
                "params": params,
                "opt_state": opt_state,
                "step": scalar(jnp.zeros((), jnp.int32)),
                "rng": scalar(jax.random.key_data(jax.random.key(loop.seed))),
                "nonfinite": scalar(jnp.zeros((), jnp.int32)),
            }
            objective_state = _initial_state(objective)
            if objective_state:  # replicated, saved in checkpoints and restored with the rest
                self.state["objective"] = {k: scalar(jnp.asarray(v)) for k, v in objective_state.items()}
        self.state_shardings = jax.tree.map(lambda x: x.sharding, self.state)
        self.batch_sharding = parallel.batch_sharding(mesh, leading=2)
        self.metrics = metrics
        # Every program over the global batch goes through parallel.ordered_jit: on several CPU
        # processes each call returns once its result is ready, so no two are ever in flight.
        self._accumulate = parallel.ordered_jit(self._accumulate_impl)
        # A method's metric sums for one batch without gradients: validation uses them.
        self._metric_sums = parallel.ordered_jit(lambda params, frozen, batch, objective_state: _bound(
            self.objective, objective_state).numerators(self.model(params, frozen), jax.tree.map(lambda x: x[0], batch),
                                                        None)[1])
        self._step = parallel.ordered_jit(self._step_impl, out_shardings=(self.state_shardings, None),
                                          donate_argnums=0)
        self.watchdog = None  # a polyalign.mesh.watchdog.Watchdog told each phase of fit
        check_batch_division(loop, mesh)

    # --- the step ------------------------------------------------------------------------------

    def model(self, params=None, frozen=None) -> nnx.Module:
        """The model with `params` (default: the current ones) and the frozen base (default: the trainer's)."""
        params = self.state["params"] if params is None else params
        return nnx.merge(self.graphdef, params, self.frozen if frozen is None else frozen, self.rest)

    def _accumulate_impl(self, params, frozen, batch: Batch, key: jax.Array, objective_state: dict):
        """Gradient of the global objective and summed metrics over all micro-batches of `batch`;
        micro-batch i draws its randomness from fold_in(key, i)."""
        bound = _bound(self.objective, objective_state)
        denominators = bound.denominators(batch)
        coefficients = bound.coefficients
        micro_keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(jax.tree.leaves(batch)[0].shape[0]))

        def objective(params, micro_batch, dens, micro_key):
            numerators, sums = bound.numerators(self.model(params, frozen), micro_batch, micro_key)
            # A term with no weight in the whole batch is 0; a NaN denominator must stay NaN (the
            # non-finite guard then skips the step) rather than pass for "no weight".
            value = sum(coefficients[k] * jnp.where(dens[k] == 0, 0.0,
                                                    numerators[k] / jnp.where(dens[k] == 0, 1.0, dens[k]))
                        for k in numerators)
            return value, sums

        grad_fn = jax.value_and_grad(objective, has_aux=True)
        first = jax.tree.map(lambda x: x[0], (batch, denominators, micro_keys))
        if jax.tree.leaves(batch)[0].shape[0] == 1:
            # One micro-batch: no accumulator, which would hold a second parameter-sized gradient.
            (loss, sums), grads = grad_fn(params, *first)
            return grads, loss, sums
        sums_shape = jax.eval_shape(lambda: objective(params, *first)[1])
        zero = (jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.float32),
                jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sums_shape))

        def body(carry, xs):
            grads, loss, sums = carry
            (value, micro_sums), micro_grads = grad_fn(params, *xs)
            return (_tree_add(grads, micro_grads), loss + value, _tree_add(sums, micro_sums)), None

        (grads, loss, sums), _ = jax.lax.scan(body, zero, (batch, denominators, micro_keys))
        return grads, loss, sums

    def _step_impl(self, state, frozen, batch: Batch):
        # The state's key is advanced every step, so a resumed run draws what an unbroken one would.
        step_key, next_key = jax.random.split(jax.random.wrap_key_data(state["rng"]))
        objective_state = state.get("objective", {})
        grads, loss, sums = self._accumulate_impl(state["params"], frozen, batch, step_key, objective_state)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

        # A conditional, not a select between new and old: jnp.where would keep both copies of the
        # parameters and AdamW moments alive (1-3 GiB at 0.5B-1.5B); the conditional updates the
        # donated state in place and leaves it untouched after a non-finite step.
        def update(grads, params, opt_state):
            updates, opt_state = self.tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        params, opt_state = jax.lax.cond(finite, update, lambda grads, params, opt_state: (params, opt_state),
                                         grads, state["params"], state["opt_state"])
        new_state = {
            "params": params,
            "opt_state": opt_state,
            "step": state["step"] + 1,
            "rng": jax.random.key_data(next_key),
            "nonfinite": state["nonfinite"] + (~finite).astype(jnp.int32),
        }
        # The non-finite count rides with the metrics: the loop reads them a step late, when this state has
        # been donated to the next step.
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": self.schedule(state["step"]), "finite": finite,
                   "nonfinite_steps": new_state["nonfinite"], **sums}
        if objective_state:  # the state the step used, then the state after it (kept as is after a skip)
            updated = self.objective.update_state(objective_state, sums)
            new_state["objective"] = jax.tree.map(lambda new, old: jnp.where(finite, new, old), updated,
                                                  objective_state)
            metrics.update({f"objective/{k}": v for k, v in objective_state.items()})
        return new_state, metrics

    def global_batch(self, local: dict[str, np.ndarray]) -> Batch:
        """Per-process [micro_batches, per_process, ...] arrays -> global arrays sharded over the batch axis."""
        out = {}
        for key, value in local.items():
            shape = (value.shape[0], value.shape[1] * jax.process_count(), *value.shape[2:])
            out[key] = jax.make_array_from_process_local_data(self.batch_sharding, value, shape)
        return out

    def gradients(self, local_batch: dict[str, np.ndarray]):
        """The accumulated gradient and loss of one global batch, without an update (for tests)."""
        with jax.set_mesh(self.mesh):
            key = jax.random.split(jax.random.wrap_key_data(self.state["rng"]))[0]
            return self._accumulate(self.state["params"], self.frozen, self.global_batch(local_batch), key,
                                    self.state.get("objective", {}))

    def step(self, local_batch: dict[str, np.ndarray]) -> dict[str, Any]:
        return self._run_step(self._device_batch(local_batch))

    def _device_batch(self, local_batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        with jax.set_mesh(self.mesh):
            return self.global_batch(local_batch)

    def _run_step(self, batch: dict[str, jax.Array]) -> dict[str, Any]:
        """Dispatches one step on a batch already on the devices; returns its metrics without waiting."""
        if self.abstract:
            raise TrainingError("this trainer was made from an abstract model: it compiles steps, it cannot run them")
        with jax.set_mesh(self.mesh):
            self.state, metrics = self._step(self.state, self.frozen, batch)
        return metrics

    def compiled_step(self, local_batch: dict[str, np.ndarray]):
        """The step compiled for this batch's shapes, without running it (XLA's memory analysis, cost)."""
        with jax.set_mesh(self.mesh):
            return self._step.lower(self.state, self.frozen, self.global_batch(local_batch)).compile()

    def eval_batch_size(self, requested: int) -> int:
        """`requested` rounded down to whole batch shards (data x fsdp x processes), at least one each."""
        shards = self.mesh.shape["data"] * self.mesh.shape["fsdp"] * jax.process_count()
        return max(shards, requested // shards * shards)

    def metric_sums(self, dataset) -> dict[str, np.ndarray]:
        """The method's metric sums over every batch of a grain dataset of per-process batches
        ([1, per_process, ...] arrays), with the current parameters, on the host."""
        # Summed on the host, batch by batch: the same float32 additions as on the devices, with no
        # program of their own (every process runs exactly one program per batch).
        total = None
        with jax.set_mesh(self.mesh):
            for local in iterate(dataset):
                sums = jax.device_get(self._metric_sums(self.state["params"], self.frozen, self.global_batch(local),
                                                        self.state.get("objective", {})))
                total = sums if total is None else jax.tree.map(np.add, total, sums)
        return total

    @property
    def step_number(self) -> int:
        return int(self.state["step"])

    def first_evaluation(self) -> bool:
        """Whether the evaluation at this step is the run's first by its schedule (eval_every, else the last
        step). What a run logs once (fixed numbers of its validation data) goes with it: a resumed run's first
        evaluation in this process may be a later one, and metrics.jsonl keeps the first one's record."""
        return self.step_number <= (self.loop.eval_every or self.loop.steps)

    # --- the loop ------------------------------------------------------------------------------

    def fit(self, train_iterator, evaluate: Callable[[], dict[str, Any]] | None = None,
            summarize: Callable[[dict[str, np.ndarray]], dict[str, Any]] | None = None,
            checkpointer: Checkpointer | None = None, progress: bool = True) -> dict[str, Any]:
        """Trains to loop.steps (or loop.stop_at), resuming from the checkpointer's latest step."""
        loop = self.loop
        if checkpointer is not None:
            restored = checkpointer.restore_latest(self.state, self.state_shardings, train_iterator)
            if restored is not None:
                self.state = restored
                if jax.process_index() == 0:
                    print(f"resumed from step {self.step_number}")
        start = self.step_number
        if self.metrics is not None:
            self.metrics.resume_at(start)
        last = loop.steps if loop.stop_at is None else min(loop.steps, loop.stop_at)
        stop = _StopSignal()
        bar = progress_bar(total=last, initial=start, desc="train", unit="step",
                           progress=progress and jax.process_index() == 0)
        result: dict[str, Any] = {"start_step": start, "interrupted": False}
        profile = _Profile(loop.profile_steps, self.profile_dir)
        phase = self.watchdog.phase if self.watchdog is not None else (lambda what, kind=None: None)
        # The host never waits for the step it has just dispatched: step N's metrics are read once step
        # N + 1 is queued behind it, and the next batch is read and put on the devices while both run.
        # A step that is evaluated, checkpointed or last is read at once (evaluation and checkpoints see
        # its state, not the next one's), as is every step where a call waits for its program anyway
        # (several CPU processes: parallel.orders_programs). No batch is read ahead of a checkpoint step:
        # a checkpoint records the iterator where the steps it saves left it, and a stop between two
        # checkpoints puts the iterator back before it saves.
        ahead, before_ahead = None, None
        rewinds = hasattr(train_iterator, "set_state")  # grain's iterators; a plain one is never checkpointed
        in_step = parallel.orders_programs()
        read_until = time.perf_counter()  # when the host saw the last step read finish

        def finish(done: _Dispatched) -> None:
            """Reads step `done`'s metrics (waiting for it), logs, evaluates and checkpoints it."""
            nonlocal read_until
            host = jax.device_get(done.metrics)
            # From the later of its start and the previous step's end: the device's time for it alone
            # when steps queue back to back, input reading included when they do not.
            now = time.perf_counter()
            step_seconds, read_until = now - max(done.started, read_until), now
            step = done.step
            profile.after(step)
            if int(host["nonfinite_steps"]) > loop.max_nonfinite:
                raise TrainingError(f"step {step}: more than {loop.max_nonfinite} steps had a non-finite "
                                    "loss or gradient; stopping (lower the learning rate?)")
            record = {"step": step, "loss": float(host["loss"]), "lr": float(host["lr"]),
                      "grad_norm": float(host["grad_norm"]), "skipped": not bool(host["finite"])}
            if summarize is not None:
                record.update(summarize(host))
            # Real (unpadded) tokens the step ran per second.
            record["step_s"] = round(step_seconds, 4)
            tokens = float(host.get("processed_tokens", host.get("tokens", 0.0)))
            record.update(self.throughput(tokens, step_seconds))
            if done.evaluated:
                phase(f"evaluation after step {step}", "evaluation")
                evaluating = time.perf_counter()
                record.update(evaluate())
                record["eval_s"] = round(time.perf_counter() - evaluating, 4)
            if self.metrics is not None and (step % loop.log_every == 0 or step == last or done.evaluated):
                self.metrics.write(record)
            bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)  # drawn by the update, when due
            bar.update(1)
            result["last"] = record
            if done.checkpointed:
                phase(f"checkpoint {step}", "checkpoint")
                checkpointer.save(step, self.state, train_iterator, force=step == last)

        # Counted here: reading the state's own counter would wait for the step, and after a step that
        # failed (a peer gone mid-collective) the state it was given is donated and gone.
        step = start
        try:
            with stop, profile:
                waiting, stopping = None, False  # the step dispatched and not read yet
                while step < last:
                    # Asked before each step but the first (every process agrees): a stop ends the run
                    # after the step on the devices, dispatching nothing more.
                    if step > start:
                        phase(f"the stop agreement after step {step}")
                        if stop.requested(self.mesh):
                            stopping = True
                            break
                    phase(f"step {step + 1}", "step")
                    profile.before(step + 1)
                    started = time.perf_counter()
                    batch = ahead if ahead is not None else self._device_batch(next(train_iterator))
                    metrics = self._run_step(batch)
                    step += 1
                    checkpointed = checkpointer is not None and (step % loop.checkpoint_every == 0 or step == last)
                    # Validation at eval_every and at the last of train.steps, not where train.stop_at
                    # stops a run (a preemption does not validate either)
                    evaluated = evaluate is not None and ((loop.eval_every and step % loop.eval_every == 0)
                                                          or step == loop.steps)
                    dispatched = _Dispatched(step, metrics, started, evaluated, checkpointed)
                    ahead = None
                    if step < last and not checkpointed:
                        before_ahead = train_iterator.get_state() if rewinds else None
                        ahead = self._device_batch(next(train_iterator))
                    if waiting is not None:
                        finish(waiting)
                    waiting = dispatched
                    if in_step or evaluated or checkpointed or step == last:
                        finish(waiting)
                        waiting = None
                if stopping:
                    if waiting is not None:
                        finish(waiting)
                    result["interrupted"] = True
                    if ahead is not None and rewinds:  # unread: the resumed run reads it first
                        train_iterator.set_state(before_ahead)
                    if checkpointer is not None:
                        phase(f"checkpoint {step}", "checkpoint")
                        checkpointer.save(step, self.state, train_iterator, force=True)
                        result["checkpoint"] = str(checkpointer.directory / str(step))
        finally:
            bar.close()
            if checkpointer is not None:
                phase(f"writing checkpoints after step {step}")
                checkpointer.wait()
        result["end_step"] = self.step_number
        result["stopped_early"] = self.step_number < loop.steps
        return result


@dataclasses.dataclass(frozen=True)
class _Dispatched:
    """A step the loop has dispatched: its metrics (device arrays, not read yet), when the loop began it
    (reading its batch), and whether it is evaluated and checkpointed once read."""

    step: int
    metrics: dict[str, jax.Array]
    started: float
    evaluated: bool
    checkpointed: bool


class _Profile:
    """A JAX profiler trace from the start of step `first` to the end of step `last` (1-based), into
    `directory` (TensorBoard's profile plugin and Perfetto read it); nothing when `steps` is None."""

    def __init__(self, steps: list[int] | None, directory):
        self.first, self.last = steps if steps else (None, None)
        self.directory, self.active = directory, False

    def before(self, step: int) -> None:
        if step == self.first and self.directory is not None:
            jax.profiler.start_trace(str(self.directory))
            self.active = True

    def after(self, step: int) -> None:
        if self.active and step >= self.last:
            self._stop()

    def _stop(self) -> None:
        jax.effects_barrier()
        jax.profiler.stop_trace()
        self.active = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.active:  # stopped early inside the window: keep what was traced
            self._stop()


class _StopSignal:
    """SIGTERM / SIGINT / SIGHUP ask the loop to checkpoint and stop after the current step (SIGHUP: a
    terminal or ssh session that closes, which ended the run at once, losing the steps since the last
    checkpoint)."""

    def __init__(self):
        self._flag = False
        self._previous = {}

    def _handle(self, signum, frame):
        self._flag = True

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def __exit__(self, *exc):
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)

    def requested(self, mesh) -> bool:
        if jax.process_count() == 1:
            return self._flag
        # Every process must stop at the same step: agree on the flag.
        return bool(np.asarray(multihost_utils.process_allgather(np.array([self._flag]))).any())
