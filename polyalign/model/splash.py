"""Grouped-query attention with the splash attention kernel (Pallas, TPU): causal, within packed
segments, or under any mask of the row's own (trees, sliding windows, padding).

The kernel works on one sequence and one key/value head at a time, with the query heads that share it
(multi-query form); it is mapped over batch and key/value heads. Packed rows pass their segment ids,
which the kernel ands with the causal mask block by block (no [T, T] mask is ever made). Other masks
differ from row to row, so they cannot be the kernel's static mask: each row's mask is cut into the
kernel's blocks in the step (splash's dynamic mask), and blocks a mask hides entirely (one branch of a
tree against another) are skipped as for the causal mask. Under a mesh it runs inside shard_map, each
device on its own batch rows and key/value heads, since a Pallas call cannot be partitioned by the
compiler. `interpret=True` runs the same kernel on any backend (tests on CPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from polyalign.mesh import parallel as P

BLOCK_SIZES = (512, 256, 128)


def supports(length: int) -> bool:
    """Whether the kernel's blocks tile a sequence of this length."""
    return length % BLOCK_SIZES[-1] == 0


def _block_sizes(length: int):
    # heavy: Pallas TPU kernels, only when attention runs as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib

    block = next(b for b in BLOCK_SIZES if length % b == 0)
    return kernel_lib.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                                 block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block,
                                 block_kv_dq=block)


@functools.lru_cache(maxsize=16)
def _kernel(length: int, query_heads_per_kv: int, softcap: float | None, interpret: bool):
    # heavy: Pallas TPU kernels, only when attention runs as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib  # TPU only

    sizes = _block_sizes(length)
    mask = mask_lib.MultiHeadMask([mask_lib.CausalMask((length, length))] * query_heads_per_kv)
    # The kernel holds its block-mask tables as arrays; made inside a trace they would be tracers, and
    # this cache would leak them into the next one.
    with jax.ensure_compile_time_eval():
        return kernel_lib.make_splash_mqa_single_device(mask=mask, block_sizes=sizes, attn_logits_soft_cap=softcap,
                                                        interpret=interpret)


def _row_kernel(mask: jax.Array, softcap: float | None, interpret: bool):
    """A kernel for one row's own mask [T, T] (True = may attend), made in the trace.

    splash's `make_splash_mqa` would take the mask as a jax.Array too, but it turns the MaskInfo's
    `is_dynamic_mask` flag into an array, which inside a trace is a tracer the kernel then branches on;
    the kernel is built here from the same parts with the flag left a Python bool. The mask has one
    head: the kernel reads it for every query head (its `h = 0` rule for single-head tables), so the
    row's blocks are held once, not once per head."""
    # heavy: Pallas TPU kernels, only when attention runs as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as info_lib  # TPU only

    sizes = _block_sizes(mask.shape[0])
    heads_mask = mask[None]
    forward, _ = info_lib.process_dynamic_mask(heads_mask, (sizes.block_q, sizes.block_kv))
    query_grad, _ = info_lib.process_dynamic_mask(heads_mask, (sizes.block_q_dq, sizes.block_kv_dq))
    key_value_grad, _ = info_lib.process_dynamic_mask_dkv(heads_mask, (sizes.block_q_dkv, sizes.block_kv_dkv))
    return kernel_lib.SplashAttentionKernel(
        forward, query_grad, key_value_grad, block_sizes=sizes, is_mqa=True, save_residuals=False,
        mask_value=kernel_lib.DEFAULT_MASK_VALUE, attn_logits_soft_cap=softcap, residual_checkpoint_name=None,
        mask_function=None, interpret=interpret)


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float, softcap: float | None = None,
                     segment_ids: jax.Array | None = None, mask: jax.Array | None = None,
                     interpret: bool = False) -> jax.Array:
    """Causal attention, q [B, T, H, D] and k, v [B, T, K, D] -> [B, T, H, D]; with segment_ids [B, T]
    a token sees only the earlier tokens of its own segment; with mask [B, T, T] (True = may attend,
    causality included) exactly what the mask allows."""
    # heavy: Pallas TPU kernels, only when attention runs as splash
    from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel import SegmentIds

    if segment_ids is not None and mask is not None:
        raise ValueError("splash_attention takes segment_ids or a mask, not both (fold the segments into the mask)")
    batch, length, heads, dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads

    if mask is None:
        kernel = _kernel(length, group, softcap, interpret)
        if segment_ids is None:
            segment_ids = jnp.zeros((batch, length), jnp.int32)  # one segment: causal only

        def one_row(q, k, v, segments):  # [k, r, T, D], [k, T, D], [T]
            ids = SegmentIds(q=segments, kv=segments)
            return jax.vmap(lambda q, k, v: kernel(q, k, v, segment_ids=ids))(q, k, v)
        row_masks = segment_ids.astype(jnp.int32)
    else:
        def one_row(q, k, v, row_mask):  # [k, r, T, D], [k, T, D], [T, T]
            kernel = _row_kernel(row_mask, softcap, interpret)
            return jax.vmap(kernel)(q, k, v)
        # A query no key is open to (left padding) would end the kernel's softmax on 0 / 0; letting it
        # see itself keeps it finite, and only padding, which no real token reads, is such a query.
        row_masks = mask.astype(bool) | jnp.eye(length, dtype=bool)

    def local(q, k, v, row_masks):  # [b, k, r, T, D], [b, k, T, D], [b, T] or [b, T, T] -> [b, k, r, T, D]
        return jax.vmap(one_row)(q, k, v, row_masks)

    # The kernel does not scale the scores; scaling the queries first is the same product.
    grouped_q = (q * jnp.asarray(scale, q.dtype)).reshape(batch, length, kv_heads, group, dim).transpose(0, 2, 3, 1, 4)
    grouped_k, grouped_v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        spec = P.mesh_spec((P.BATCH, P.ACT_KV_HEADS), mesh)
        q_spec = jax.sharding.PartitionSpec(*spec, None, None, None)
        kv_spec = jax.sharding.PartitionSpec(*spec, None, None)
        row_spec = jax.sharding.PartitionSpec(spec[0], *[None] * (row_masks.ndim - 1))
        local = jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, row_spec),
                              out_specs=q_spec, check_vma=False)
    out = local(grouped_q, grouped_k, grouped_v, row_masks)
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, length, heads, dim)
