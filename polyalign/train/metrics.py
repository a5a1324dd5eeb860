"""Training logs: OUT/metrics.jsonl (one JSON object per logged step, always) and the trackers named by
`train.report_to`: TensorBoard event files (the default), Weights & Biases, trackio.

Trackers are optional extras, imported only when asked for; their own environment settings hold
(WANDB_MODE=offline, WANDB_DIR, TRACKIO_DIR, ...): polyalign never turns a tracker online. A resumed
run logs into the same tracker run (an id derived from OUT).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Any

import jax

from polyalign.core.extras import require
from polyalign.core.paths import as_path
from polyalign.core.wording import counted


class _TensorBoard:
    def __init__(self, out, project: str, config: dict[str, Any]):
        # opened when asked for, as the other trackers are: the trainer imports without tensorboardX (the step
        # benchmarks run where only jax, flax, optax and orbax are installed)
        from tensorboardX import SummaryWriter

        self._folder = str(as_path(out) / "tensorboard")
        self._summary_writer = SummaryWriter
        self._writer = SummaryWriter(self._folder)

    def resume_at(self, step: int) -> None:
        # TensorBoard drops what earlier event files hold from step + 1 on (the steps logged again)
        self._writer.close()
        self._writer = self._summary_writer(self._folder, purge_step=step + 1)

    def log(self, scalars: dict[str, float], step: int) -> None:
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def _run_id(out) -> str:
    return hashlib.sha256(str(as_path(out)).encode()).hexdigest()[:16]


class _Wandb:
    def __init__(self, out, project: str, config: dict[str, Any]):
        wandb = require("wandb", "wandb", "train.report_to: wandb")
        self._run = wandb.init(project=project, name=as_path(out).name, id=_run_id(out), resume="allow",
                               config=config, dir=str(as_path(out)))

    def log(self, scalars: dict[str, float], step: int) -> None:
        self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()


class _Trackio:
    def __init__(self, out, project: str, config: dict[str, Any]):
        self._trackio = require("trackio", "trackio", "train.report_to: trackio")
        self._trackio.init(project=project, name=f"{as_path(out).name}-{_run_id(out)[:6]}", config=config,
                           resume="allow")

    def log(self, scalars: dict[str, float], step: int) -> None:
        self._trackio.log(scalars, step=step)

    def close(self) -> None:
        self._trackio.finish()


_SINKS = {"tensorboard": _TensorBoard, "wandb": _Wandb, "trackio": _Trackio}


class MetricsWriter:
    """Writes on process 0 only; every other process gets a writer that does nothing. `report_to`
    names the trackers (polyalign.train.config.TRACKERS); `config` is the run's config, which they
    store beside the run."""

    def __init__(self, out: str | os.PathLike, report_to: list[str] | tuple[str, ...] = ("tensorboard",),
                 project: str = "polyalign", config: dict[str, Any] | None = None):
        self.enabled = jax.process_index() == 0
        self.path = as_path(out) / "metrics.jsonl"
        self._sinks = []
        if self.enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._sinks = [_SINKS[name](out, project, config or {}) for name in dict.fromkeys(report_to)]

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        if self._sinks:
            scalars = {key: value for key, value in _flatten(record).items()
                       if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)
                       and math.isfinite(value)}
            for sink in self._sinks:
                sink.log(scalars, record["step"])

    def resume_at(self, step: int) -> None:
        """The run goes on from checkpoint `step`: steps a run logged after it and never checkpointed (it
        was killed) are taken out of metrics.jsonl and TensorBoard, and said so, since this run logs them
        again; without this every such step would appear twice."""
        if not self.enabled or not self.path.exists():
            return
        kept, later, cut = [], [], 0
        for line in self.path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # the last line of a process killed while writing it
                cut += 1
                continue
            if record.get("step", 0) > step:
                later.append(record["step"])
            else:
                kept.append(line)
        if not later and not cut:
            return
        temporary = self.path.with_name(self.path.name + ".partial")
        temporary.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8")
        temporary.replace(self.path)
        steps = sorted(set(later))
        what = [f"steps {steps[0]}-{steps[-1]}" if len(steps) > 1 else f"step {steps[0]}"] if steps else []
        what += [counted(cut, 'cut line')] if cut else []
        since = f"after step {step}" if step else "before any checkpoint"
        print(f"note: {self.path} held {' and '.join(what)} logged {since} by a run that ended without "
              "checkpointing them; taken out, this run logs those steps again")
        for sink in self._sinks:
            if hasattr(sink, "resume_at"):
                sink.resume_at(step)

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()
        self._sinks = []


def _flatten(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, f"{name}/"))
        else:
            out[name] = value
    return out


def read_metrics(out: str | os.PathLike) -> list[dict[str, Any]]:
    path = as_path(out) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
