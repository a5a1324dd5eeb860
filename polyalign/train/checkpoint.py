"""Orbax checkpoints of the training state and the data iterator: asynchronous, the last N kept,
restorable onto a different mesh."""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from polyalign.core.errors import CheckpointError
from polyalign.core.paths import as_path, committed_steps


def restore_data_state(folder, data_iterator) -> None:
    """Moves the data iterator to where checkpoint folder `folder` (its `data` item) left it. grain writes
    one `process_{i}-of-{n}.json` per process and reads back the file of the current process index and
    count, so a run checkpointed on 2 hosts could not resume on 1 (a host lost for good) or on 4. The
    state is global (pipeline.py: the number of steps taken, the same on every process), so any process
    count resumes from the writers' common state; files that disagree cannot be resumed elsewhere."""
    own = folder / f"process_{jax.process_index()}-of-{jax.process_count()}.json"
    files = [own] if own.exists() else sorted(folder.glob("process_*-of-*.json"))
    if not files:
        raise ValueError(f"{folder}: no data iterator state")
    states = {json.dumps(json.loads(f.read_text()), sort_keys=True) for f in files}
    if len(states) > 1:  # not damage: the checkpoint is whole, it only cannot move to another process count
        raise CheckpointError(f"{folder}: the {len(files)} processes that wrote it left their data iterators in "
                              f"different states, so it resumes only on {len(files)} processes")
    data_iterator.set_state(json.loads(states.pop()))
    if hasattr(data_iterator, "start_prefetch"):  # as grain's own restore does: reading ahead starts now
        data_iterator.start_prefetch()


UNFINISHED = "*.orbax-checkpoint-tmp*"  # Orbax writes a checkpoint here and renames it to its step when committed


class Checkpointer:
    def __init__(self, directory: str | os.PathLike, every: int, keep: int, meta: dict[str, Any] | None = None):
        self.directory = as_path(directory)
        self.meta = meta or {}
        self._remove_unfinished_writes()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, save_interval_steps=every,
                                               enable_async_checkpointing=True, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def _remove_unfinished_writes(self) -> None:
        """Removes the writes a stopped run left unfinished (killed while a checkpoint was being written),
        saying so: Orbax would otherwise warn of each in its own words when it writes that step again.
        Nothing writes here before the run starts, so every such folder is a dead run's."""
        if jax.process_index() != 0 or not self.directory.is_dir():
            return
        for partial in sorted(self.directory.glob(UNFINISHED)):
            shutil.rmtree(partial, ignore_errors=True)
            print(f"note: {partial}: an unfinished checkpoint write of a run that was stopped; removed (the "
                  "committed checkpoints stay)", file=sys.stderr)

    def save(self, step: int, state, data_iterator, force: bool = False) -> bool:
        """Starts writing checkpoint `step` (asynchronously). A write that fails, now or while the
        previous one finished in the background, stops training with CheckpointError."""
        if step in self.manager.all_steps():
            return False
        # grain comes with the data iterator saved here: the trainer imports without the data stack (the step
        # benchmarks run where only jax, flax, optax and orbax are installed)
        import grain

        try:
            saved = self.manager.save(step, force=force, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=grain.checkpoint.CheckpointSave(data_iterator),
                meta=ocp.args.JsonSave({"step": step, "process_count": jax.process_count(), **self.meta})))
            self.manager.check_for_errors()
        except Exception as error:  # a full disk, a lost mount, a permission: any failed write ends the run
            raise self._write_failed(step, error) from None
        return saved

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def committed_steps(self) -> list[int]:
        """Steps whose checkpoint is complete on disk (committed_steps)."""
        return committed_steps(self.directory)

    def restore_latest(self, template_state, shardings, data_iterator):
        """The latest state, placed with `shardings` (the current mesh's, whatever mesh saved it), and
        the data iterator moved to where it was; None when there is no checkpoint yet.

        A latest checkpoint that cannot be restored while the one before it can is damaged (a disk
        error, a copy cut short): it is renamed `<step>.unreadable` (never deleted) and training resumes
        from the previous one. When neither restores, the run itself has changed (another model shape,
        for one) and nothing is moved: that is an error for the user to decide on."""
        steps = sorted(self.manager.all_steps(), reverse=True)
        if not steps:
            return None
        abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                template_state, shardings)

        def restore(step):
            state = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract))).state
            restore_data_state(self.directory / str(step) / "data", data_iterator)
            return state

        try:
            return restore(steps[0])
        except CheckpointError:  # whole, but not for this run: no damage, nothing to set aside
            raise
        except Exception as error:  # what a damaged checkpoint raises depends on what is damaged
            latest_error = error
        problem = f"{type(latest_error).__name__}: {str(latest_error).splitlines()[0] if str(latest_error) else ''}"
        if len(steps) == 1:
            raise CheckpointError(f"{self.directory / str(steps[0])}: cannot be restored ({problem}); move it "
                                  "aside to start over, or restore the run's settings") from None
        try:
            state = restore(steps[1])
        except Exception:
            raise CheckpointError(f"{self.directory}: neither checkpoint {steps[0]} nor {steps[1]} can be restored "
                                  f"({problem}); has the model or mesh setting changed since they were written?"
                                  ) from None
        aside = self._set_aside(steps[0])
        print(f"checkpoint {steps[0]} cannot be restored ({problem}); moved to {aside}; resuming from "
              f"step {steps[1]}", file=sys.stderr)
        return state

    def _set_aside(self, step: int):
        target = self.directory / f"{step}.unreadable"
        if jax.process_index() == 0:
            n = 1
            while target.exists():
                n += 1
                target = self.directory / f"{step}.unreadable-{n}"
            (self.directory / str(step)).rename(target)
        multihost_utils.sync_global_devices("polyalign checkpoint set aside")
        self.manager.reload()
        return target

    def wait(self) -> None:
        """Until every started write has committed; CheckpointError if one failed."""
        try:
            self.manager.wait_until_finished()
            self.manager.check_for_errors()
        except Exception as error:
            raise self._write_failed(None, error) from None

    def _write_failed(self, step: int | None, error: Exception) -> CheckpointError:
        """The error to stop with, after removing the failed write's temporary folders (the committed
        checkpoints stay)."""
        removed = []
        if jax.process_index() == 0:
            for partial in self.directory.glob(UNFINISHED):
                shutil.rmtree(partial, ignore_errors=True)
                removed.append(partial.name)
        which = f"checkpoint {step}" if step is not None else "a checkpoint"
        message = str(error).splitlines()[0] if str(error) else ""
        return CheckpointError(
            f"{self.directory}: writing {which} failed ({type(error).__name__}: {message}); "
            f"{len(removed)} unfinished folder(s) removed, committed checkpoints kept. Fix the cause (free "
            "space?) and run the same command to resume from the last committed checkpoint")

    def close(self) -> None:
        self.manager.close()
