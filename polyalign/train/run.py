"""The run harness every training method goes through.

A method's `setup(config, mesh, progress)` reads its inputs and returns a Job: the model, the
objective, how to make batches, and what to do around the loop. The harness does the rest the same
way for every method: the mesh, the config written beside the outputs, metrics, the Trainer, Orbax
checkpoints and resumption, the method's closing work (export, scoring) and OUT/summary.json.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from polyalign.core.outputs import OutputLock, no_empty_folder_left, settings_record
from polyalign.core.paths import TRAINING_RECORD, as_path, is_uri, recorded_path, run_segments
from polyalign.core.wording import counted
from polyalign.core.yaml_config import ConfigError
from polyalign.inputs.pipeline import Layout
from polyalign.mesh import parallel
from polyalign.mesh.supervisor import lost_peer_line, resume_command, tell_parent
from polyalign.mesh.watchdog import Watchdog, resolve_timeout
from polyalign.model import load_hf_checkpoint
from polyalign.model.architecture import compute_dtype
from polyalign.model.lora import add_adapters, has_adapters, quantize_base
from polyalign.model.transformer import abstract_model
from polyalign.train import ownership
from polyalign.train.checkpoint import Checkpointer, committed_steps
from polyalign.train.config import LoopConfig, ModelSection
from polyalign.train.methods import method_spec
from polyalign.train.metrics import MetricsWriter, read_metrics
from polyalign.train.rounds import train_rounds
from polyalign.train.throughput import Throughput
from polyalign.train.trainer import Objective, Trainer, check_batch_division, make_optimizer, warmup_steps


@dataclass
class Job:
    """What a method hands the harness."""

    model: nnx.Module
    objective: Objective
    # Local batches for this process's slice of each global batch, for the resolved loop.
    batches: Callable[[Layout, LoopConfig], Iterator[dict]]
    # Training examples (rows) in one epoch, where the method knows it: `train.epochs` needs it.
    epoch_size: int | None = None
    evaluate: Callable[[Trainer], dict[str, Any]] | None = None  # validation metrics, every eval_every steps
    summarize: Callable[[dict], dict[str, Any]] | None = None  # a step's metric sums -> logged values
    checkpoint_meta: dict[str, Any] | None = None  # None: the method keeps no checkpoints
    # After a run that reached its last step (not after an interruption): export, scoring; what it
    # returns joins the summary. Its third argument: the invocations that trained the run, this one included
    # (run_segments', for the export's record).
    finish: Callable[[Trainer, Path, list[dict]], dict[str, Any] | None] | None = None
    summary: dict[str, Any] = field(default_factory=dict)  # facts known at setup (pairs, examples)
    # Model FLOPs per token a step runs (polyalign/model/flops.py), for MFU; None: not logged.
    flops_per_token: float | None = None
    # What the user should know before the steps start (pairs cut to data.max_length, a tokenizer transformers
    # reads otherwise), printed under the start line by process 0
    notes: list[str] = field(default_factory=list)


def steps_per_epoch(epoch_size: int, global_batch: int) -> int:
    return max(1, math.ceil(epoch_size / global_batch))


def resolve_loop(loop: LoopConfig, epoch_size: int | None, method: str) -> LoopConfig:
    """`train.epochs` turned into steps, and `train.eval_every: null` into once per epoch."""
    epoch_steps = None if epoch_size is None else steps_per_epoch(epoch_size, loop.global_batch)
    if loop.epochs is not None:
        if epoch_steps is None:
            raise ConfigError(f"train.epochs: {method} cannot tell its epoch size here (packed rows); set train.steps")
        if loop.steps != loop.epochs * epoch_steps:
            print(f"polyalign: train.epochs={loop.epochs} sets train.steps to {loop.epochs * epoch_steps} "
                  f"({epoch_size} examples / global_batch {loop.global_batch} an epoch); train.steps "
                  f"({loop.steps}) is not used", file=sys.stderr)
        loop = dataclasses.replace(loop, steps=loop.epochs * epoch_steps)
    if loop.eval_every is None and epoch_steps is not None:
        loop = dataclasses.replace(loop, eval_every=epoch_steps)
    if loop.stop_at is not None and loop.stop_at >= loop.steps:
        print(f"polyalign: train.stop_at={loop.stop_at} is at or past the last step (train.steps={loop.steps}); "
              f"the run trains to step {loop.steps} and ends as usual", file=sys.stderr)
    return loop


def model_policy(section: ModelSection) -> dict[str, Any]:
    """How the model executes (not what it computes): layer scan, remat, attention kernel, log-prob chunks."""
    return dict(scan_layers=section.scan_layers, remat=section.remat, attention_impl=section.attention_impl,
                logprob_chunk=section.logprob_chunk)


def load_init(config, mesh=None) -> nnx.Module:
    """The config's `init` checkpoint in its compute dtype and execution policy, placed over `mesh`;
    with `model.lora`, frozen in the compute dtype (or `model.quantize`d) and carrying fresh adapters."""
    # A frozen base needs no float32 master copy: it is stored as it computes.
    compute = compute_dtype(config.model.dtype)
    dtype = compute if config.model.lora.rank else "float32"
    model = load_hf_checkpoint(config.init, dtype=dtype, compute_dtype=compute, mesh=mesh,
                               **model_policy(config.model))
    return with_adapters(model, config, mesh)


def with_adapters(model: nnx.Module, config, mesh=None) -> nnx.Module:
    """`model` as the config trains it: with `model.quantize` its layer projections stored quantised,
    with `model.lora` fresh adapters (seeded by model.seed); else itself."""
    if config.model.quantize is not None:
        model = quantize_base(model, config.model.quantize, mesh)
    lora = config.model.lora.to_model()
    return model if lora is None else add_adapters(model, lora, seed=config.model.seed, mesh=mesh)


def save_config(out, config) -> None:
    out = as_path(out)
    out.mkdir(parents=True, exist_ok=True)
    if jax.process_index() == 0:
        (out / "config.json").write_text(json.dumps(dataclasses.asdict(config), indent=2, default=str) + "\n")


def with_compute_dtype(config):
    """The config with `model.dtype: auto` resolved for this backend (model/architecture.py
    compute_dtype), said once on accelerators; the run's config.json records what it trained in."""
    model = getattr(config, "model", None)
    if getattr(model, "dtype", None) != "auto":
        return config
    dtype = compute_dtype("auto")
    if jax.default_backend() != "cpu" and jax.process_index() == 0:
        print(f"polyalign: model.dtype auto: {dtype} on {jax.default_backend()} (model.dtype=float32 for full "
              "precision)", flush=True)
    return dataclasses.replace(config, model=dataclasses.replace(model, dtype=dtype))


# The config keys that name files or folders a run reads.
INPUT_PATH_KEYS = ("init", "pairs", "val_pairs", "references")


def with_recorded_paths(config):
    """The config with every input path as its record keeps it (core/paths.py recorded_path): config.json
    names the files read, and a run started again from another folder, or with `./run` for `run`, is the
    same run."""
    changes = {key: recorded_path(getattr(config, key)) for key in INPUT_PATH_KEYS if hasattr(config, key)}
    data = dataclasses.replace(config.data, dir=recorded_path(config.data.dir))
    return dataclasses.replace(config, data=data, **changes)


def input_paths(config) -> dict[str, str | None]:
    """The paths a run reads, by key (init, pairs, val_pairs, references, data.dir)."""
    return {**{key: getattr(config, key, None) for key in INPUT_PATH_KEYS}, "data.dir": config.data.dir}


def check_inputs_exist(inputs: dict[str, str | None], existing: str, relative: set[str] = frozenset()) -> None:
    """Every local input path the config names exists, checked before OUT is claimed: --overwrite removes
    the earlier run's checkpoints, which a mistyped path must not cost. A missing path the config gave
    relative (`relative`, by key) says where it was read from."""
    for key, path in inputs.items():
        if path and not is_uri(path) and not Path(path).exists():
            kept = "; nothing in --out was removed" if existing == "overwrite" else ""
            hint = (f" (a training config's relative paths are read from the folder the command runs in, "
                    f"{Path.cwd()}, not from the config file's)") if key in relative else ""
            raise ConfigError(f"{key}={path}: no such file or folder{kept}{hint}")


def trained_files(config) -> dict[str, str | None]:
    """The files a run trains and validates on, by the key that names them (pairs as a preference method
    resolves them; an SFT run's build, by its manifest), and the init checkpoint it starts from: what
    OUT/inputs.json records (ownership.py). None for the critic, which trains from the start whenever it runs."""
    files: dict[str, str | None] = {}
    if config.method == "critic":  # trained from the start every time (no checkpoints): nothing to continue
        return files
    files["init"] = getattr(config, "init", None)
    if hasattr(config, "pair_file"):  # the preference methods
        for key in ("pairs", "val_pairs"):
            with contextlib.suppress(ConfigError):  # no pairs named: the method says so when it reads them
                files[key] = config.pair_file(key)
    elif config.data.dir:  # SFT: the tokenised build of RUN
        files["build"] = f"{str(config.data.dir).rstrip('/')}/build/manifest.json"
    return files


def check_finished(config, out, unused: tuple[str, ...] = ()) -> None:
    """Refuses a finished round of an on-policy run that `config` did not make (ownership.py)."""
    config = with_recorded_paths(with_compute_dtype(config))
    ownership.check_finished_round(as_path(out), dataclasses.asdict(config), input_paths(config), unused,
                                   contents=ownership.input_contents(trained_files(config)))


def train(config, out, progress: bool = True, existing: str = "continue") -> dict[str, Any]:
    """Runs (or resumes) the training run `config` describes into OUT; returns its summary. `existing`
    says what to do when OUT holds a run of another config (polyalign/train/ownership.py): continue
    only a run of the same config, resume with changed resumable keys, or overwrite."""
    parallel.initialize_distributed()
    relative = {key for key, path in input_paths(config).items() if path and not is_uri(path)
                and not os.path.isabs(path)}  # read from where the command runs: a missing one says so
    config = with_recorded_paths(with_compute_dtype(config))
    if getattr(config, "rounds", 1) > 1:
        return train_rounds(config, out, functools.partial(train, existing=existing), progress,
                            check=check_finished, overwrite=existing == "overwrite")

    local = not is_uri(out)
    out = as_path(out) if not local else Path(as_path(out))
    # a run refused before it wrote anything (a missing setting, a bad pairs file) leaves no empty OUT
    with no_empty_folder_left(out) if local else contextlib.nullcontext():
        if local:
            inputs = input_paths(config)
            check_inputs_exist(inputs, existing, relative)
        contents = ownership.input_contents(trained_files(config))
        if local:
            ownership.claim(out, dataclasses.asdict(config), inputs, existing,
                            remove=jax.process_index() == 0, contents=contents)
        with contextlib.ExitStack() as held:
            with parallel.refusal_shared("output lock"):  # process 0 holds the lock; a refusal stops every process
                if local and jax.process_index() == 0:
                    held.enter_context(OutputLock(out))
            return _train(config, out, progress, contents)


def _train(config, out, progress: bool, contents: dict[str, dict[str, str]]) -> dict[str, Any]:
    started = time.perf_counter()
    stop_at, done = config.train.stop_at, committed_steps(out / "checkpoints")
    if stop_at is not None and done and done[-1] > stop_at:  # said before the model loads, not after
        raise ConfigError(f"train.stop_at={stop_at}: the run in {out} is already at step {done[-1]}; give a later "
                          f"step (train.steps is {config.train.steps}), or leave stop_at out to train on to the end")
    mesh = parallel.make_mesh(config.parallel)
    job = method_spec(config.method).implementation().setup(config, mesh, progress)
    loop = resolve_loop(config.train, job.epoch_size, config.method)
    check_batch_division(loop, mesh)  # before config.json is written: the corrected command then starts afresh
    if shorter := ownership.shorter_than_trained(out, loop.steps):
        raise ConfigError(shorter)
    previous = saved_train_section(out)  # before it is replaced: a resumed run with other steps says so below
    save_config(out, config)
    if jax.process_index() == 0:
        ownership.record_contents(out, contents)
    metrics = MetricsWriter(out, loop.report_to, loop.tracker_project, dataclasses.asdict(config))
    throughput = Throughput.for_devices(mesh.devices.flat, job.flops_per_token, loop.peak_tflops)
    trainer = Trainer(job.model, job.objective, config.optimizer, loop, mesh, metrics=metrics, throughput=throughput,
                      profile_dir=out / "profile")
    layout = Layout(loop.global_batch, loop.micro_batches, jax.process_index(), jax.process_count())
    checkpointer = None
    if job.checkpoint_meta is not None:
        checkpointer = Checkpointer(out / "checkpoints", loop.checkpoint_every, loop.keep_checkpoints,
                                    meta=job.checkpoint_meta)
    resume_at = checkpointer.latest_step() if checkpointer is not None else None
    if checkpointer is not None:
        tell_parent(checkpoints=str(checkpointer.directory))
    if jax.process_index() == 0:
        print(start_line(config, loop, mesh, out, resume_at, trained_parameters(job.model)), flush=True)
        for note in [schedule_note(config, loop, previous, resume_at, out), *job.notes]:
            if note:
                print(note, file=sys.stderr if note.startswith("warning:") else sys.stdout, flush=True)
    evaluate = None if job.evaluate is None else (lambda: job.evaluate(trainer))
    watchdog = Watchdog(resolve_timeout(loop.hang_timeout, jax.process_count()), jax.process_index(),
                        jax.process_count())
    trainer.watchdog = watchdog
    parallel.peer_lost_report = lambda lost, cause: report_lost_peer(lost, cause, checkpointer)
    with watchdog, parallel.PeerMonitor(loop.peer_timeout):
        try:
            with peers_watched(checkpointer, out):
                result = trainer.fit(job.batches(layout, loop), evaluate, job.summarize, checkpointer,
                                     progress=progress)
        finally:
            watchdog.phase("closing checkpoints and metrics", "close")
            if checkpointer is not None:
                checkpointer.close()
            metrics.close()
        if "last" not in result:  # resumed at its last step: nothing trained this time
            result["last"] = logged_step(out, result["end_step"])
        earlier = reconciled_segments(run_segments(out), result["start_step"], previous)

        def segments(seconds: float) -> list[dict]:  # every invocation that trained the run, this one included
            if result["end_step"] == result["start_step"] and earlier:
                return earlier
            return [*earlier, {"start_step": result["start_step"], "end_step": result["end_step"], "steps": loop.steps,
                               "processes": jax.process_count(), "mesh": dict(mesh.shape), "seconds": seconds}]

        kept = kept_export(out, config, result) if not result["stopped_early"] else None
        if kept is not None:
            result.update(kept)
            if jax.process_index() == 0:
                print(f"{kept['model']}: already this run's export at step {result['end_step']}, kept as it is",
                      flush=True)
        elif not result["stopped_early"] and job.finish is not None:
            watchdog.phase(f"the closing work of {config.method} (export, scoring)", "finish")
            with peers_watched(checkpointer, out):
                result.update(job.finish(trainer, out, segments(round(time.perf_counter() - started, 1))) or {})
    result.update(out=str(out), method=config.method, **job.summary,
                  seconds=round(time.perf_counter() - started, 1), mesh=dict(mesh.shape))
    # every invocation that trained the run, kept across resumes (a changed train.steps reshapes the schedule
    # from where it resumed: the model card and evaluate's record say so, read from here)
    result["segments"] = segments(result["seconds"])
    # `seconds` is this invocation's; the run's whole time where every invocation recorded its own (one killed
    # outright recorded none)
    if all("seconds" in segment for segment in result["segments"]):
        result["total_seconds"] = round(sum(segment["seconds"] for segment in result["segments"]), 1)
    if jax.process_index() == 0:
        (out / "summary.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    return result


# What a finished run's export added to its summary, kept when the same command finds nothing to train
EXPORT_RESULTS = ("model", "adapter", "tokenizer_check", "tokenizer_warning")


def kept_export(out: Path, config, result: dict[str, Any]) -> dict[str, Any] | None:
    """The export's results from the last summary when this invocation trained nothing and OUT/model is
    already the export of this config at this step (its TRAINING_RECORD): the same command run again on a
    finished run rewrote a whole model folder (15 GB at 7B) to the same bytes, and its new modification times
    read as another checkpoint to the outputs made from it. Every process must agree (the export gathers
    parameters on all of them): one that does not keeps nothing."""
    keep = None
    if result["start_step"] == result["end_step"]:
        try:
            previous = json.loads((as_path(out) / "summary.json").read_text())
            record = json.loads((as_path(out) / "model" / TRAINING_RECORD).read_text())
        except (OSError, ValueError):  # a run exported before the record, or a model folder removed
            previous = record = None
        current = settings_record(dataclasses.asdict(config))
        if (isinstance(previous, dict) and isinstance(record, dict) and previous.get("end_step") == result["end_step"]
                and "model" in previous and record.get("config") == current):
            keep = {key: previous[key] for key in EXPORT_RESULTS if key in previous}
    agreed = keep is not None
    if jax.process_count() > 1:
        agreed = bool(np.asarray(multihost_utils.process_allgather(np.array([agreed]))).all())
    return keep if agreed else None


def saved_train_section(out: Path) -> dict[str, Any] | None:
    """The `train` section of the config OUT's run was started (or last resumed) with, if any."""
    try:
        return json.loads((out / "config.json").read_text()).get("train")
    except (OSError, ValueError, AttributeError):  # a new run, or a folder without a readable config
        return None


def schedule_note(config, loop: LoopConfig, previous: dict[str, Any] | None, resume_at: int | None,
                  out: Path) -> str | None:
    """A resumed run whose length changed (`train.steps`, `train.epochs` with --resume) follows the schedule
    of its new length from the step it resumes at: the learning rate can rise again (a longer cosine sits
    higher at that step). Said with both rates, the last one logged and the next one."""
    if not resume_at or previous is None or all(previous.get(k) == getattr(config.train, k) for k in ("steps",
                                                                                                         "epochs")):
        return None
    _, schedule = make_optimizer(config.optimizer, loop.steps)
    before = logged_step(out, resume_at).get("lr")
    was = f", where step {resume_at} took {before:.2e}" if isinstance(before, int | float) else ""
    return (f"note: the run's length changed on resume, so the learning-rate schedule is the one for {loop.steps} "
            f"steps from here: step {resume_at + 1} takes {float(schedule(resume_at)):.2e}{was}")


def trained_parameters(model) -> str:
    """What a step trains, where only part of the model learns: the adapters' rank and targets, the
    quantised base, and how many of the parameters are trained. Empty for full tuning."""
    if not has_adapters(model):
        return ""
    lora, kind = model.config.lora, model.config.quantize
    trained = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
    # counted on the unquantised shapes: a quantised kernel's codes are not its weights (NF4 packs two a byte)
    total = sum(x.size for x in jax.tree.leaves(nnx.state(
        abstract_model(dataclasses.replace(model.config, quantize=None)), nnx.Param)))
    base = f"the {kind.upper()}-quantised base" if kind else "the frozen base"
    return (f"LoRA rank {lora.rank} (alpha {lora.alpha:g}) on {', '.join(lora.targets)} over {base}: "
            f"{trained:,} parameters trained ({trained / total:.2%} of {total:,}); ")


def start_line(config, loop: LoopConfig, mesh, out: Path, resume_at: int | None = None, trained: str = "") -> str:
    """What a run is about to do, said before it starts: the steps and batch, the devices and their
    layout, the learning-rate schedule, what it trains (`trained`: trained_parameters), where it starts
    from (or resumes) and where it writes."""
    optimizer = config.optimizer
    warmup = warmup_steps(optimizer, loop.steps)
    warming = f", {counted(warmup, 'warmup step')}" if warmup else ""
    schedule = f"learning rate {optimizer.lr:.1e}{warming}, cosine to {optimizer.lr * optimizer.min_lr_ratio:.1e}"
    layout = ", ".join(f"{axis} {size}" for axis, size in mesh.shape.items())
    micro = f"{loop.micro_batches} micro-batch{'es' if loop.micro_batches > 1 else ''}"
    init = getattr(config, "init", None)
    start = f"from {init}" if init else f"from scratch (model.preset {config.model.preset})"
    if resume_at:
        start = f"resuming at step {resume_at} (OUT/checkpoints) of a run that started {start}"
    return (f"polyalign: training {config.method} for {counted(loop.steps, 'step')}, global batch "
            f"{loop.global_batch} in "
            f"{micro}, on {counted(mesh.devices.size, jax.default_backend() + ' device')} "
            f"({layout}), computing in {compute_dtype(config.model.dtype)}; {schedule}; {trained}{start} -> {out}")


def logged_step(out: Path, step: int) -> dict[str, Any]:
    """What the run logged at `step` (OUT/metrics.jsonl), for a rerun that had nothing left to train, such as
    one after an export that failed: the numbers it reports are the ones that step computed, never made up."""
    if not (out / "metrics.jsonl").is_file():
        return {}
    record: dict[str, Any] = {}
    for row in read_metrics(out):
        if row.get("step") == step:
            record.update(row)
    return record


def reconciled_segments(segments: list[dict], start_step: int, previous: dict[str, Any] | None) -> list[dict]:
    """`segments` (run_segments) with the invocations that trained the run to `start_step` but ended without
    writing a summary (killed outright: SIGKILL, a preempted host) as one segment of unknown time, with the
    train.steps of the config they left (`previous`, its train section): they trained the steps this one
    resumed from, and the record of how the model was trained lost them."""
    done = segments[-1].get("end_step", 0) if segments else 0
    if start_step <= done:
        return segments
    steps = (previous or {}).get("steps")
    return [*segments, {"start_step": done, "end_step": start_step, "steps": steps if isinstance(steps, int) else None,
                        "ended": "without a summary (stopped outright)"}]


def steps_phrase(result: dict[str, Any], trained: str) -> str:
    """`trained` (what a summary line says of the steps it ran), or, when a rerun found the run already at
    its last step (after an export that failed, say), that nothing was trained this time."""
    if result.get("start_step", 0) == result["end_step"] > 0:
        return f"already trained to step {result['end_step']} (nothing left to train)"
    return trained


def steps_run(result: dict[str, Any]) -> str:
    """"12 steps", or after a resume "to step 12 (4 steps this run)": a summary's time is this run's. A packed
    run says so: its steps take more examples than train.global_batch (metrics.jsonl logs how many)."""
    start, end = result.get("start_step", 0), result["end_step"]
    rows = " of packed rows" if result.get("packed") else ""
    return (counted(end, "step") + rows if not start
            else f"to step {end} ({counted(end - start, 'step')}{rows} this run)")


def _lost_peer_error(error: BaseException) -> bool:
    """Whether `error` is what a collective or the coordination service raises when a peer is gone."""
    text = f"{type(error).__name__}: {error}"
    return any(s in text for s in ("Gloo", "gloo", "Connection reset", "Connection refused", "heartbeat",
                                   "coordination service", "UNAVAILABLE", "DEADLINE_EXCEEDED"))


def report_lost_peer(lost: list[int] | None, cause: str, checkpointer) -> str:
    """The one line a process prints when a peer is gone: who, the last committed checkpoint, and the
    command that resumes."""
    steps = checkpointer.committed_steps() if checkpointer is not None else []
    return lost_peer_line(jax.process_index(), jax.process_count(), lost or [], cause, steps,
                          checkpointer.directory if checkpointer is not None else None, resume_command(sys.argv[1:]))


@contextlib.contextmanager
def peers_watched(checkpointer, out):
    """On several processes, an error a lost peer causes ends this one at once with report_lost_peer's
    line and exit status parallel.PEER_LOST_EXIT, instead of a traceback and the coordination service's abort."""
    try:
        yield
    except Exception as error:
        if jax.process_count() < 2 or not _lost_peer_error(error):
            raise
        # The peer monitor names the lost process once its beat has stopped for train.peer_timeout
        # seconds, and exits; should it not, the line says a peer is gone without naming it.
        time.sleep(parallel.PeerMonitor.waiting_time())
        parallel.report_peer_lost([], f"{type(error).__name__}: {str(error).strip()[:100]}")
