"""Orbax checkpoints of the training state and the data iterator: asynchronous, the last N kept,
restorable onto a different mesh."""

from __future__ import annotations

import os
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp

from polyalign.paths import as_path


class Checkpointer:
    def __init__(self, directory: str | os.PathLike, every: int, keep: int, meta: dict[str, Any] | None = None):
        self.directory = as_path(directory)
        self.meta = meta or {}
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, save_interval_steps=every,
                                               enable_async_checkpointing=True, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, step: int, state, data_iterator, force: bool = False) -> bool:
        if step in self.manager.all_steps():
            return False
        return self.manager.save(step, force=force, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=grain.checkpoint.CheckpointSave(data_iterator),
            meta=ocp.args.JsonSave({"step": step, "process_count": jax.process_count(), **self.meta})))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def restore_latest(self, template_state, shardings, data_iterator):
        """The latest state, placed with `shardings` (the current mesh's, whatever mesh saved it), and
        the data iterator moved to where it was; None when there is no checkpoint yet."""
        step = self.manager.latest_step()
        if step is None:
            return None
        abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                template_state, shardings)
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract),
            data=grain.checkpoint.CheckpointRestore(data_iterator)))
        return restored.state

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()
