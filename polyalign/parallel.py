"""Meshes, processes, and the logical axis names that map a model onto a mesh.

The model names every parameter axis and every large activation axis logically ("embed", "mlp",
"batch", ...). A rules table maps each name to a mesh axis (or to nothing, which replicates), so one
model definition runs unsharded on a laptop, over data/fsdp/tensor on a GPU node, or on a TPU pod.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from flax.core import spmd as flax_spmd
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from polyalign.errors import ParallelError
from polyalign.mesh_config import ParallelConfig

MESH_AXES = ("data", "fsdp", "tensor")

# Parameter axes. The embedding table has names of its own: sharding its model dimension over fsdp,
# which also splits the batch, makes XLA fully rematerialise the token gather.
LAYERS, VOCAB, EMBED, MLP, Q_HEADS, KV_HEADS, NORM = "layers", "vocab", "embed", "mlp", "q_heads", "kv_heads", "norm"
TABLE_VOCAB, TABLE_EMBED = "table_vocab", "table_embed"
# Activation axes.
BATCH, LENGTH, ACT_EMBED, ACT_HEADS, ACT_KV_HEADS, HEAD_DIM, ACT_MLP, ACT_VOCAB = (
    "batch", "length", "act_embed", "act_heads", "act_kv_heads", "head_dim", "act_mlp", "act_vocab")

# FSDP shards the parameters' model dimension; tensor parallelism splits heads, MLP and vocabulary.
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    (LAYERS, None),
    (VOCAB, "tensor"),
    (TABLE_VOCAB, "fsdp"),
    (TABLE_EMBED, "tensor"),
    (EMBED, "fsdp"),
    (MLP, "tensor"),
    (Q_HEADS, "tensor"),
    (KV_HEADS, "tensor"),
    (NORM, None),
    (BATCH, ("data", "fsdp")),
    (LENGTH, None),
    (ACT_EMBED, None),
    (ACT_HEADS, "tensor"),
    (ACT_KV_HEADS, "tensor"),
    (HEAD_DIM, None),
    (ACT_MLP, "tensor"),
    (ACT_VOCAB, "tensor"),
)


def logical_spec(names: Sequence[str | None], rules=None) -> PartitionSpec:
    """The PartitionSpec that `rules` (default: the active flax rules, else DEFAULT_RULES) give `names`."""
    rules = rules if rules is not None else (flax_spmd.get_logical_axis_rules() or DEFAULT_RULES)
    return PartitionSpec(*flax_spmd.from_sharding_rules(tuple(names), rules))


def mesh_spec(names: Sequence[str | None], mesh) -> PartitionSpec:
    """The PartitionSpec of logical `names` on `mesh`, keeping only the mesh axes it has."""
    present = set(mesh.axis_names)

    def keep(entry):
        if entry is None:
            return None
        axes = tuple(a for a in (entry if isinstance(entry, tuple) else (entry,)) if a in present)
        return axes if len(axes) > 1 else (axes[0] if axes else None)

    return PartitionSpec(*(keep(e) for e in logical_spec(names)))


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Pins an activation's sharding by logical names when a mesh is active; a no-op otherwise."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, mesh_spec(names, mesh))


def param(names: Sequence[str | None]) -> dict:
    """Metadata for an nnx parameter initialiser: its logical axis names."""
    return {"out_sharding": tuple(names)}


def unsharded():
    """Context for creating a model with no mesh: sharding annotations are kept but not applied."""
    return nnx.use_eager_sharding(False)


# --- mesh and processes -----------------------------------------------------------------------------


def mesh_shape(config: ParallelConfig, num_devices: int) -> tuple[int, int, int]:
    sizes = [config.data, config.fsdp, config.tensor]
    free = [i for i, s in enumerate(sizes) if s == -1]
    if len(free) > 1 or any(s == 0 or s < -1 for s in sizes):
        raise ParallelError(f"parallel sizes {sizes}: each must be positive, and at most one may be -1")
    fixed = int(np.prod([s for s in sizes if s != -1]))
    if free:
        if num_devices % fixed:
            raise ParallelError(f"{num_devices} devices do not divide into fsdp x tensor x data = {sizes}")
        sizes[free[0]] = num_devices // fixed
    if int(np.prod(sizes)) != num_devices:
        raise ParallelError(f"mesh data={sizes[0]} x fsdp={sizes[1]} x tensor={sizes[2]} needs "
                            f"{int(np.prod(sizes))} devices; there are {num_devices}")
    return tuple(sizes)


def make_mesh(config: ParallelConfig = ParallelConfig(), devices=None) -> Mesh:
    devices = devices if devices is not None else jax.devices()
    shape = mesh_shape(config, len(devices))
    # Auto axes: the compiler propagates shardings from the annotated parameters and batches.
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def batch_sharding(mesh: Mesh, leading: int = 1) -> NamedSharding:
    """Sharding of a batch array whose batch axis comes after `leading` - 1 unsharded axes."""
    return NamedSharding(mesh, PartitionSpec(*([None] * (leading - 1)), logical_spec((BATCH,))[0]))


def param_shardings(abstract_state, mesh: Mesh, rules=DEFAULT_RULES):
    """NamedShardings for an nnx State from its parameters' logical axis names."""
    with nnx.logical_axis_rules(rules):
        specs = nnx.get_partition_spec(abstract_state)
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs,
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def to_host(tree):
    """Every array of `tree` as a NumPy array, on every process, one array at a time. An array this
    process holds whole is copied off its devices shard by shard; one spread over processes is first
    replicated, so the devices hold one extra parameter at a time, never a second model."""
    def one(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return np.asarray(jax.device_get(x))
        replicated = NamedSharding(x.sharding.mesh, PartitionSpec())
        return np.asarray(jax.device_get(jax.jit(lambda a: a, out_shardings=replicated)(x)))

    return jax.tree.map(one, tree)


_distributed_started = False


def initialize_distributed() -> None:
    """Starts jax.distributed when this is one process of several.

    TPU VMs describe themselves (jax.distributed.initialize() with no arguments). Elsewhere (GPU
    clusters, CPU processes in tests) POLYALIGN_COORDINATOR=host:port, POLYALIGN_NUM_PROCESSES and
    POLYALIGN_PROCESS_ID say who is who. Call before anything touches a device; later calls do nothing.
    """
    global _distributed_started
    if _distributed_started:
        return
    _distributed_started = True
    coordinator = os.environ.get("POLYALIGN_COORDINATOR")
    if coordinator:
        try:
            num_processes = int(os.environ["POLYALIGN_NUM_PROCESSES"])
            process_id = int(os.environ["POLYALIGN_PROCESS_ID"])
        except (KeyError, ValueError):
            raise ParallelError("POLYALIGN_COORDINATOR is set, so POLYALIGN_NUM_PROCESSES and "
                                "POLYALIGN_PROCESS_ID must be integers too") from None
        if num_processes > 1:
            jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                       process_id=process_id, initialization_timeout=120)
    elif os.environ.get("TPU_WORKER_HOSTNAMES") or os.environ.get("CLOUD_TPU_TASK_ID"):
        jax.distributed.initialize()
