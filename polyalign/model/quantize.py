"""A frozen kernel stored in 4-bit NormalFloat (NF4, as QLoRA) or int8, dequantised when used.

Both split a [din, dout] kernel into blocks of BLOCK consecutive input rows per output column and keep
each block's absolute maximum (bfloat16) beside its codes; an input size that is not a multiple of
BLOCK is padded with zero rows, which dequantisation drops. NF4 codes index the 16 quantiles of a
standard normal scaled to [-1, 1] (QLoRA's table; weights are roughly normal, so each level is used
about equally) and are packed two to a byte; int8 codes are round(127 w / absmax). Bits per weight:
NF4 4 + 16/64 = 4.25, int8 8 + 16/64 = 8.25 (QLoRA's double quantisation of the block maxima, 4.127
bits, is not done).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 64

# QLoRA's NF4 levels (Dettmers et al. 2023, appendix E; bitsandbytes' table).
NF4_LEVELS = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0], np.float32)


def bits_per_weight(kind: str) -> float:
    return {"nf4": 4, "int8": 8}[kind] + 16 / BLOCK


def _padded(din: int) -> int:
    return -(-din // BLOCK) * BLOCK


def code_shape(kind: str, din: int, dout: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Shapes of the codes and of the block maxima of a [din, dout] kernel."""
    padded = _padded(din)
    return ((padded // 2 if kind == "nf4" else padded), dout), (padded // BLOCK, dout)


def quantize(kernel: jax.Array, kind: str) -> tuple[jax.Array, jax.Array]:
    """(codes, block maxima) of a [..., din, dout] kernel (leading axes: stacked layers)."""
    *lead, din, dout = kernel.shape
    padded = _padded(din)
    if padded != din:
        kernel = jnp.pad(kernel, [(0, 0)] * len(lead) + [(0, padded - din), (0, 0)])
    din = padded
    blocks = kernel.astype(jnp.float32).reshape(*lead, din // BLOCK, BLOCK, dout)
    scale = jnp.abs(blocks).max(axis=-2, keepdims=True).astype(jnp.bfloat16)
    safe = jnp.where(scale == 0, 1.0, scale.astype(jnp.float32))
    normalised = blocks / safe
    if kind == "int8":
        codes = jnp.clip(jnp.round(normalised * 127), -127, 127).astype(jnp.int8).reshape(*lead, din, dout)
    else:
        nearest = jnp.abs(normalised[..., None] - jnp.asarray(NF4_LEVELS)).argmin(-1).astype(jnp.uint8)
        pairs = nearest.reshape(*lead, din // 2, 2, dout)
        codes = pairs[..., 0, :] | (pairs[..., 1, :] << 4)
    return codes, scale[..., 0, :]


def dequantize(codes: jax.Array, scale: jax.Array, kind: str, dtype, din: int | None = None) -> jax.Array:
    """The [..., din, dout] kernel in `dtype` from its codes and block maxima (`din`: the kernel's own
    input size when it was padded to whole blocks)."""
    if kind == "int8":
        values = codes.astype(jnp.float32) / 127
    else:
        low, high = codes & 0xF, codes >> 4
        indices = jnp.stack([low, high], axis=-2)  # [..., din/2, 2, dout]
        values = jnp.asarray(NF4_LEVELS)[indices.astype(jnp.int32)]
    *lead, blocks_in, dout = scale.shape
    blocks = values.reshape(*lead, blocks_in, BLOCK, dout) * scale.astype(jnp.float32)[..., None, :]
    return blocks.reshape(*lead, blocks_in * BLOCK, dout)[..., :din, :].astype(dtype)
