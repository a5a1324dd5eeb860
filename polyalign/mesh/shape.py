"""The `parallel:` section of a training config: the mesh's axis sizes. Kept apart from
polyalign.mesh.parallel, which builds meshes with jax, so that reading a config (and `--help`) never
imports jax."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelConfig:
    """Mesh axis sizes; -1 takes the devices the other axes leave."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
