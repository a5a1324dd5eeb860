"""The projection of an adapted model (polyalign/model/lora.py): a frozen base kernel, stored as is or
quantised (polyalign/model/quantize.py), plus a low-rank adapter."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from polyalign.mesh import parallel as P
from polyalign.model import quantize as quant
from polyalign.model.architecture import LoraConfig


class LoraLinear(nnx.Module):
    """A projection of an adapted model: y = x W + b + (alpha / r) (x A) B.

    W is `kernel` [din, dout] as in nnx.Linear (the names Hugging Face loading fills), or with
    `quantize` its NF4/int8 codes and block maxima (`kernel_codes`, `kernel_scale`), dequantised to the
    compute dtype when used. `lora_a` [din, r] and `lora_b` [r, dout] are float32 whatever the base's
    dtype (they are what the optimizer updates); without `lora` the projection has none (a quantised
    projection that is not a target)."""

    def __init__(self, din: int, dout: int, *, lora: LoraConfig | None, quantize: str | None,
                 names: tuple[str, str], use_bias: bool, dtype, param_dtype, kernel_init, rngs: nnx.Rngs):
        self.dtype, self.quantize, self.din = dtype, quantize, din
        if quantize is None:
            self.kernel = nnx.Param(kernel_init(rngs.params(), (din, dout), param_dtype), **P.param(names))
        else:
            codes, scale = quant.code_shape(quantize, din, dout)
            code_dtype = jnp.uint8 if quantize == "nf4" else jnp.int8
            self.kernel_codes = nnx.Param(jnp.zeros(codes, code_dtype), **P.param(names))
            self.kernel_scale = nnx.Param(jnp.ones(scale, jnp.bfloat16), **P.param(names))
        self.bias = nnx.Param(jnp.zeros((dout,), param_dtype), **P.param(names[1:])) if use_bias else None
        self.lora_scale = None if lora is None else lora.scale
        self.lora_dropout = 0.0 if lora is None else lora.dropout
        if lora is not None:
            if lora.init == "kaiming":  # PEFT's default: kaiming_uniform(a=sqrt(5)) of A, bound 1/sqrt(din)
                bound = 1.0 / math.sqrt(din)
                a = jax.random.uniform(rngs.params(), (din, lora.rank), jnp.float32, -bound, bound)
            else:
                a = jax.random.normal(rngs.params(), (din, lora.rank), jnp.float32) / lora.rank
            self.lora_a = nnx.LoRAParam(a, **P.param((names[0], None)))
            self.lora_b = nnx.LoRAParam(jnp.zeros((lora.rank, dout), jnp.float32), **P.param((None, names[1])))

    def base_kernel(self) -> jax.Array:
        """W in the compute dtype (dequantised when stored quantised)."""
        if self.quantize is None:
            return self.kernel[...].astype(self.dtype)
        return quant.dequantize(self.kernel_codes[...], self.kernel_scale[...], self.quantize, self.dtype, self.din)

    def __call__(self, x: jax.Array, dropout_key: jax.Array | None = None) -> jax.Array:
        """`dropout_key` (training steps only) drops the adapters' input at rate `lora.dropout`."""
        x = x.astype(self.dtype)
        y = x @ self.base_kernel()
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        if self.lora_scale is None:
            return y
        if dropout_key is not None and self.lora_dropout > 0:
            keep = jax.random.bernoulli(dropout_key, 1.0 - self.lora_dropout, x.shape)
            x = jnp.where(keep, x / (1.0 - self.lora_dropout), 0).astype(x.dtype)
        update = (x @ self.lora_a[...].astype(x.dtype)) @ self.lora_b[...].astype(x.dtype)
        return y + update * jnp.asarray(self.lora_scale, x.dtype)
