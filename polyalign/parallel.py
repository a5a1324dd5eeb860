"""Logical axis names and the rules that map them onto mesh axes.

The model names every parameter axis and every large activation axis logically ("embed", "mlp",
"batch", ...). A rules table maps each name to a mesh axis (or to nothing, which replicates), so one
model definition runs unsharded on a laptop, over data/fsdp/tensor on a GPU node, or on a TPU pod.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from flax import nnx
from flax.core import spmd as flax_spmd
from jax.sharding import PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# Parameter axes.
LAYERS, VOCAB, EMBED, MLP, Q_HEADS, KV_HEADS, NORM = "layers", "vocab", "embed", "mlp", "q_heads", "kv_heads", "norm"
# Activation axes.
BATCH, LENGTH, ACT_EMBED, ACT_HEADS, ACT_KV_HEADS, HEAD_DIM, ACT_MLP, ACT_VOCAB = (
    "batch", "length", "act_embed", "act_heads", "act_kv_heads", "head_dim", "act_mlp", "act_vocab")

# FSDP shards the parameters' model dimension; tensor parallelism splits heads, MLP and vocabulary.
# The vocabulary axis of the embedding goes over fsdp too (sharding its d_model over fsdp, the batch
# axis, makes XLA rematerialise the embedding gradient).
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    (LAYERS, None),
    (VOCAB, ("tensor", "fsdp")),
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


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Pins an activation's sharding by logical names when a mesh is active; a no-op otherwise."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    spec = logical_spec(names)
    present = set(mesh.axis_names)

    def keep(entry):
        if entry is None:
            return None
        axes = tuple(a for a in (entry if isinstance(entry, tuple) else (entry,)) if a in present)
        return axes if len(axes) > 1 else (axes[0] if axes else None)

    return jax.lax.with_sharding_constraint(x, PartitionSpec(*(keep(e) for e in spec)))


def param(names: Sequence[str | None]) -> dict:
    """Metadata for an nnx parameter initialiser: its logical axis names."""
    return {"out_sharding": tuple(names)}


def unsharded():
    """Context for creating a model with no mesh: sharding annotations are kept but not applied."""
    return nnx.use_eager_sharding(False)
