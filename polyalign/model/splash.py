"""Causal grouped-query attention with the splash attention kernel (Pallas, TPU), optionally within
packed segments.

The kernel works on one sequence and one key/value head at a time, with the query heads that share it
(multi-query form); it is mapped over batch and key/value heads. Packed rows pass their segment ids,
which the kernel ands with the causal mask block by block (no [T, T] mask is ever made). Under a mesh
it runs inside shard_map, each device on its own batch rows and key/value heads, since a Pallas call
cannot be partitioned by the compiler. `interpret=True` runs the same kernel on any backend (tests on CPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from polyalign import parallel as P

BLOCK_SIZES = (512, 256, 128)


def supports(length: int) -> bool:
    """Whether the kernel's blocks tile a sequence of this length."""
    return length % BLOCK_SIZES[-1] == 0


@functools.lru_cache(maxsize=16)
def _kernel(length: int, query_heads_per_kv: int, softcap: float | None, interpret: bool):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib

    block = next(b for b in BLOCK_SIZES if length % b == 0)
    sizes = kernel_lib.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                                  block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    mask = mask_lib.MultiHeadMask([mask_lib.CausalMask((length, length))] * query_heads_per_kv)
    # The kernel holds its block-mask tables as arrays; made inside a trace they would be tracers, and
    # this cache would leak them into the next one.
    with jax.ensure_compile_time_eval():
        return kernel_lib.make_splash_mqa_single_device(mask=mask, block_sizes=sizes, attn_logits_soft_cap=softcap,
                                                        interpret=interpret)


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float, softcap: float | None = None,
                     segment_ids: jax.Array | None = None, interpret: bool = False) -> jax.Array:
    """Causal attention, q [B, T, H, D] and k, v [B, T, K, D] -> [B, T, H, D]; with segment_ids [B, T]
    a token sees only the earlier tokens of its own segment."""
    from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel import SegmentIds

    batch, length, heads, dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    kernel = _kernel(length, group, softcap, interpret)
    if segment_ids is None:
        segment_ids = jnp.zeros((batch, length), jnp.int32)  # one segment: causal only

    def one_row(q, k, v, segments):  # [k, r, T, D], [k, T, D], [T]
        ids = SegmentIds(q=segments, kv=segments)
        return jax.vmap(lambda q, k, v: kernel(q, k, v, segment_ids=ids))(q, k, v)

    def local(q, k, v, segments):  # [b, k, r, T, D], [b, k, T, D], [b, T] -> [b, k, r, T, D]
        return jax.vmap(one_row)(q, k, v, segments)

    # The kernel does not scale the scores; scaling the queries first is the same product.
    grouped_q = (q * jnp.asarray(scale, q.dtype)).reshape(batch, length, kv_heads, group, dim).transpose(0, 2, 3, 1, 4)
    grouped_k, grouped_v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        spec = P.mesh_spec((P.BATCH, P.ACT_KV_HEADS), mesh)
        q_spec = jax.sharding.PartitionSpec(*spec, None, None, None)
        kv_spec = jax.sharding.PartitionSpec(*spec, None, None)
        segment_spec = jax.sharding.PartitionSpec(spec[0], None)
        local = jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, segment_spec),
                              out_specs=q_spec, check_vma=False)
    out = local(grouped_q, grouped_k, grouped_v, segment_ids.astype(jnp.int32))
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, length, heads, dim)
