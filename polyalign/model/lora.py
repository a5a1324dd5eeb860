"""Low-rank adapters (LoRA): a frozen base model plus W x + (alpha / r) B A x on chosen projections.

The adapters are `nnx.LoRAParam`s on the projection modules themselves (`q_proj.lora_a`, ...; the
module is LoraLinear, polyalign/model/lora_layer.py), so they are created inside the layer stack's
`nnx.vmap` like every other parameter: one [layers, din, r] and one [layers, r, dout] array per target,
sharded by the projection's logical axes with the rank axis replicated, and scanned with the layers.
qwix, the JAX library for LoRA on Flax NNX, attaches its adapters by intercepting a traced call and
creating per-module parameters; that does not meet a layer stack built by `nnx.vmap` and run under
`lax.scan` (tried with qwix 0.1.8: both the scanned and the unrolled stack fail during its surgery),
hence this small module.

The trainer trains `nnx.LoRAParam`s only when the model has adapters (the base parameters travel
with the step as frozen inputs, with no gradient and no optimizer state). B starts at zero, so a fresh
adapter leaves the model's outputs exactly as they were, and the base with the adapters off (B = 0)
is the reference model of preference training without a second copy of the weights.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file

from polyalign.core.errors import CheckpointError
from polyalign.core.paths import as_path
from polyalign.mesh import parallel as P
from polyalign.model import quantize as quant
from polyalign.model.architecture import LORA_TARGETS, LoraConfig
from polyalign.model.transformer import Transformer, abstract_model


def has_adapters(model: nnx.Module) -> bool:
    """Whether `model` is a decoder with adapters (other models, such as the critic's head, have none)."""
    return getattr(getattr(model, "config", None), "lora", None) is not None


def add_adapters(model, lora: LoraConfig, seed: int = 0, mesh: jax.sharding.Mesh | None = None):
    """`model` (a Transformer, e.g. a loaded checkpoint) with fresh adapters on `lora.targets`; its own
    parameters are shared, not copied. The adapters are drawn in one compiled call that builds the whole
    adapted model and returns only them: XLA drops the base's initialisation, so a 7B base costs nothing
    to draw around. With a `mesh` they are placed in their shardings."""
    cfg = dataclasses.replace(model.config, lora=lora)
    graphdef, abstract_adapters, _ = nnx.split(abstract_model(cfg), nnx.LoRAParam, ...)
    shardings = P.param_shardings(abstract_adapters, mesh) if mesh is not None else None

    def draw():
        with P.unsharded():
            return nnx.state(Transformer(cfg, rngs=nnx.Rngs(seed)), nnx.LoRAParam)

    adapters = P.ordered(jax.jit(draw, out_shardings=shardings)())
    return nnx.merge(graphdef, adapters, nnx.state(model))


def base_model(model):
    """The frozen base of an adapted model, as a plain model sharing its arrays: the model with its
    adapters switched off (preference training's reference, with no second copy of the weights)."""
    if not has_adapters(model):
        return model
    _, _, base = nnx.split(model, nnx.LoRAParam, ...)
    return nnx.merge(_plain_graphdef(dataclasses.replace(model.config, lora=None)), base)


@functools.lru_cache(maxsize=8)
def _plain_graphdef(cfg):
    # Cached: the in-step reference asks for it in every trace of the step.
    return nnx.split(abstract_model(cfg))[0]


def _node(pure: dict, target: str) -> dict:
    """The stacked layer projection `target` (q, k, ..., down) in a pure-dict state (or sharding) tree."""
    block, projection = LORA_TARGETS[target].split(".")
    return pure["layers"][block][projection]


def _projections(pure: dict, targets=tuple(LORA_TARGETS)):
    """(target, node) for each of `targets` (default: every layer projection) in a pure-dict state."""
    for target in targets:
        yield target, _node(pure, target)


def _peft_name(layer: int, target: str, matrix: str) -> str:
    """PEFT's tensor name of adapter matrix `matrix` (lora_A, lora_B) of `target` in `layer`."""
    return f"base_model.model.model.layers.{layer}.{LORA_TARGETS[target]}.{matrix}.weight"


def _peft_module(target: str) -> str:
    """The transformers module name PEFT's target_modules uses for `target` (q_proj, ...)."""
    return LORA_TARGETS[target].split(".")[1]


def merge_adapters(model):
    """The plain model (no adapters, no quantised storage) whose projections hold W + (alpha / r) A B:
    the same function, with W in the base's dtype (a quantised base: the compute dtype)."""
    cfg = model.config
    if cfg.lora is None and cfg.quantize is None:
        return model
    plain = dataclasses.replace(cfg, lora=None, quantize=None,
                                param_dtype=cfg.dtype if cfg.quantize else cfg.param_dtype)
    graphdef, plain_state = nnx.split(abstract_model(plain))
    pure = nnx.to_pure_dict(nnx.state(model))
    shapes = cfg.projection_shapes()
    for target, node in _projections(pure):
        if "kernel_codes" in node:
            node["kernel"] = quant.dequantize(node.pop("kernel_codes"), node.pop("kernel_scale"), cfg.quantize,
                                              plain.param_dtype, shapes[target][0])
        if "lora_a" in node:
            a, b = node.pop("lora_a"), node.pop("lora_b")
            delta = jnp.einsum("lir,lro->lio", a.astype(jnp.float32), b.astype(jnp.float32)) * cfg.lora.scale
            node["kernel"] = (node["kernel"].astype(jnp.float32) + delta).astype(node["kernel"].dtype)
    nnx.replace_by_pure_dict(plain_state, pure)
    return nnx.merge(graphdef, plain_state)


def quantize_base(model, kind: str, mesh: jax.sharding.Mesh | None = None):
    """`model` (with or without adapters) with its layer projections stored as `kind` (nf4, int8),
    one projection at a time, each placed in its sharding over `mesh` when given. Adapters, norms,
    embeddings and the LM head are kept as they are."""
    cfg = dataclasses.replace(model.config, quantize=kind)
    graphdef, abstract = nnx.split(abstract_model(cfg))
    shardings = nnx.to_pure_dict(P.param_shardings(abstract, mesh)) if mesh is not None else None
    pure = nnx.to_pure_dict(nnx.state(model))
    for target, node in _projections(pure):
        out = None if shardings is None else (_node(shardings, target)["kernel_codes"],
                                              _node(shardings, target)["kernel_scale"])
        node["kernel_codes"], node["kernel_scale"] = P.ordered(jax.jit(quant.quantize, static_argnums=1,
                                                                       out_shardings=out)(node.pop("kernel"), kind))
    nnx.replace_by_pure_dict(abstract, pure)
    return nnx.merge(graphdef, abstract)


def peft_state_dict(cfg, adapters) -> dict[str, np.ndarray]:
    """The adapters (the model's nnx.LoRAParam state, on the host) under PEFT's names and layouts
    (lora_A.weight [r, din], lora_B.weight [dout, r]) for transformers' module tree, float32."""
    out = {}
    for target, node in _projections(nnx.to_pure_dict(adapters), cfg.lora.targets):
        for matrix, ours in (("lora_A", "lora_a"), ("lora_B", "lora_b")):
            stacked = np.asarray(jax.device_get(node[ours]), np.float32)
            for i in range(cfg.num_layers):
                out[_peft_name(i, target, matrix)] = np.ascontiguousarray(stacked[i].T)
    return out


def peft_config(cfg, base_model: str | None) -> dict:
    """adapter_config.json for PEFT's LoraConfig (no rsLoRA: scale alpha / r; dropout acts in training only)."""
    lora = cfg.lora
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(_peft_module(t) for t in lora.targets), "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None,
        "init_lora_weights": True, "inference_mode": True, "base_model_name_or_path": base_model,
    }


_PEFT_KEYS_WE_FOLLOW = {"fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "bias": "none"}


def load_adapter(model, path, mesh: jax.sharding.Mesh | None = None):
    """`model` (a plain Transformer: the base) with the PEFT LoRA adapter folder at `path`
    (adapter_config.json + adapter_model.safetensors, as PEFT saves for transformers' Llama, Qwen and
    Gemma models); anything PEFT would apply differently from W + (alpha / r) B A on whole projections
    is refused by name."""
    path = as_path(path)
    config_path = path / "adapter_config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{config_path}: not a readable PEFT adapter config ({err})") from None
    problems = [f"{key}: {config.get(key)!r} (polyalign applies {value!r})"
                for key, value in _PEFT_KEYS_WE_FOLLOW.items() if config.get(key, value) != value]
    problems += [f"{key} is set" for key in ("rank_pattern", "alpha_pattern", "layers_to_transform", "modules_to_save")
                 if config.get(key)]
    if config.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type {config.get('peft_type')!r} is not LORA")
    modules = [_peft_module(t) for t in LORA_TARGETS]
    targets = config.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else targets
    unknown = [m for m in targets if m not in modules]
    if unknown:
        problems.append(f"target_modules {unknown} are not projections polyalign adapts ({', '.join(modules)})")
    if problems:
        raise CheckpointError(f"{config_path}: " + "; ".join(problems))
    lora = LoraConfig(rank=int(config["r"]), alpha=float(config["lora_alpha"]),
                      dropout=float(config.get("lora_dropout") or 0.0),
                      targets=tuple(t for t in LORA_TARGETS if _peft_module(t) in targets))
    tensors = load_file(os.fspath(path / "adapter_model.safetensors"))
    graphdef, adapters, rest = nnx.split(add_adapters(model, lora, mesh=mesh), nnx.LoRAParam, ...)
    pure = nnx.to_pure_dict(adapters)
    for target, node in _projections(pure, lora.targets):
        for matrix, ours in (("lora_A", "lora_a"), ("lora_B", "lora_b")):
            names = [_peft_name(i, target, matrix) for i in range(model.config.num_layers)]
            missing = [n for n in names if n not in tensors]
            if missing:
                raise CheckpointError(f"{path / 'adapter_model.safetensors'}: missing {missing[0]}"
                                      + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
            stacked = np.stack([tensors[n].T for n in names]).astype(np.float32)
            if stacked.shape != node[ours].shape:
                raise CheckpointError(f"{path}: {LORA_TARGETS[target]}.{ours} has shape {stacked.shape[1:]} per "
                                      f"layer, the model expects {node[ours].shape[1:]}")
            node[ours] = jax.device_put(stacked, node[ours].sharding)
    nnx.replace_by_pure_dict(adapters, pure)
    return nnx.merge(graphdef, adapters, rest)
