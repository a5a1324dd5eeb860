"""`polyalign plan`: what a training config will cost per device before it is launched.

Estimates, not measurements: parameters, gradients and AdamW moments sharded over fsdp x tensor (and
replicated over data); activations per device for one micro-batch from the usual transformer count
(Korthikanti et al. 2022: about s b h (34 + 5 a s / h) bytes per layer in 16-bit, scaled to the compute
dtype) with remat saving only layer inputs; float32 logits and their gradient over the vocabulary
(one `logprob_chunk` block of positions at a time when set). With `model.lora` only the adapters have
gradients and AdamW moments, and the frozen base is counted in the compute dtype (its projections at
4.25 or 8.25 bits a weight with `model.quantize`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from polyalign.core.yaml_config import ConfigError
from polyalign.inputs.built import built_manifest
from polyalign.mesh.parallel import mesh_shape
from polyalign.model.architecture import ModelConfig, compute_dtype, from_hf_config
from polyalign.model.hf import read_hf_config
from polyalign.model.presets import preset
from polyalign.model.quantize import bits_per_weight
from polyalign.train.config import PreferenceConfig, SftConfig
from polyalign.train.methods import load_config

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Plan:
    model: ModelConfig
    parameters: int
    mesh: tuple[int, int, int]
    sequences_per_step: int
    sequence_length: int
    micro_batches: int
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    logits_bytes: float
    dtype_note: str = ""  # how `model.dtype: auto` was read, said beside the compute dtype

    @property
    def tokens_per_step(self) -> int:
        return self.sequences_per_step * self.sequence_length

    @property
    def total_bytes(self) -> float:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes + self.logits_bytes


def estimate(model: ModelConfig, mesh: tuple[int, int, int], global_batch: int, micro_batches: int,
             sequence_length: int, sequences_per_example: int = 1) -> Plan:
    data, fsdp, tensor = mesh
    n = model.num_parameters()
    shards = fsdp * tensor
    # With adapters only they have gradients and AdamW moments (float32); the frozen base is stored in
    # param_dtype, its projections in bits_per_weight when quantised.
    trainable = model.adapter_parameters() if model.lora is not None else n
    base_bytes = n * BYTES[model.param_dtype]
    if model.quantize is not None:
        projections = model.projection_parameters()
        base_bytes += projections * (bits_per_weight(model.quantize) / 8 - BYTES[model.param_dtype])
    param_bytes = (base_bytes + (trainable * 4 if model.lora is not None else 0)) / shards
    grad_bytes = trainable * 4 / shards
    optimizer_bytes = 2 * trainable * 4 / shards
    per_device = max(1, global_batch // micro_batches // (data * fsdp)) * sequences_per_example
    s, h, a = sequence_length, model.hidden_size, model.num_heads
    scale = BYTES[model.dtype] / 2
    per_layer = s * per_device * h * (34 + 5 * a * s / h) * scale / tensor
    if model.remat == "none":
        activation_bytes = model.num_layers * per_layer
    else:  # layer inputs kept, one layer recomputed at a time
        activation_bytes = model.num_layers * s * per_device * h * BYTES[model.dtype] + per_layer
    # float32 logits and their gradient; with logprob_chunk one block of positions at a time
    positions = min(s, model.logprob_chunk) if model.logprob_chunk else s
    logits_bytes = 2 * per_device * positions * model.vocab_size * 4 / tensor
    return Plan(model, n, mesh, global_batch * sequences_per_example, sequence_length, micro_batches, param_bytes,
                grad_bytes, optimizer_bytes, activation_bytes, logits_bytes)


def plan_config(path: Path, overrides: list[str], devices: int, sequence_length: int | None = None,
                model_preset: str | None = None, backend: str = "gpu") -> Plan:
    """The plan of a training config; preference pairs (chosen + rejected) double the sequences. The
    model comes from `model_preset`, else the config's `init` checkpoint (its config.json), else its
    model.preset."""
    config = load_config(path, overrides)
    if not isinstance(config, (SftConfig, PreferenceConfig)):
        raise ConfigError(f"{path}: plan covers the methods that train a decoder (sft, hdpo, dpo, ipo), "
                          f"not {config.method!r}")
    lora = config.model.lora.to_model()
    # Adapted runs keep the frozen base in the compute dtype (polyalign/train/run.py: load_init); `auto`
    # as training would read it on `backend` (the devices planned for: a GPU unless they are this machine's).
    dtype = compute_dtype(config.model.dtype, backend=backend)
    policy = dict(dtype=dtype, remat=config.model.remat, logprob_chunk=config.model.logprob_chunk,
                  lora=lora, quantize=config.model.quantize, param_dtype=dtype if lora is not None else "float32")
    built = _build_options(config.data)
    # A model trained from a preset takes the build's tokenizer's vocabulary, as training does (sft.py).
    vocabulary = {"vocab_size": built["vocab_size"]} if built.get("vocab_size") else {}
    if model_preset:
        model = preset(model_preset, **vocabulary, **policy)
    elif config.init:
        model = from_hf_config(read_hf_config(config.init), str(Path(config.init) / "config.json"), **policy)
    elif isinstance(config, SftConfig):
        model = preset(config.model.preset, **vocabulary, **policy)
    else:
        raise ConfigError(f"{path}: set init= (a checkpoint) or pass --preset to plan a {config.method} config")
    length = sequence_length or config.data.max_length or built.get("max_length") or 512
    plan = estimate(model, mesh_shape(config.parallel, devices), config.train.global_batch,
                    config.train.micro_batches, length,
                    sequences_per_example=2 if isinstance(config, PreferenceConfig) else 1)
    note = f" (model.dtype auto on {backend})" if config.model.dtype == "auto" else ""
    return dataclasses.replace(plan, dtype_note=note)


def _build_options(data) -> dict:
    """What the run's build fixed: its max_length and its tokenizer's vocab_size ({} without a build)."""
    built = built_manifest(data.dir)
    if built is None:
        return {}
    return {"max_length": built["options"].get("max_length"), "vocab_size": built.get("vocab_size")}


def describe(plan: Plan, device_memory_gib: float | None = None) -> str:
    gib = 1024 ** 3
    m = plan.model
    if m.lora is None:
        trained = "full fine-tuning"
    else:
        trained = (f"LoRA r={m.lora.rank} on {','.join(m.lora.targets)}: {m.adapter_parameters() / 1e6:,.2f}M "
                   f"trainable ({100 * m.adapter_parameters() / plan.parameters:.2f}%)"
                   + (f", base {m.quantize} ({bits_per_weight(m.quantize):g} bits a projection weight)"
                      if m.quantize else ""))
    lines = [
        f"model: {m.family}, {plan.parameters / 1e6:,.1f}M parameters ({m.num_layers} layers, width "
        f"{m.hidden_size}, vocab {m.vocab_size}), parameters {m.param_dtype}, compute {m.dtype}{plan.dtype_note}, "
        f"remat {m.remat}",
        f"training: {trained}",
        f"mesh: data={plan.mesh[0]} fsdp={plan.mesh[1]} tensor={plan.mesh[2]} "
        f"({plan.mesh[0] * plan.mesh[1] * plan.mesh[2]} devices)",
        f"tokens per step: {plan.tokens_per_step:,} ({plan.sequences_per_step} sequences x {plan.sequence_length}), "
        f"{plan.micro_batches} micro-batch(es)",
        "per device:",
        f"  parameters       {plan.param_bytes / gib:8.2f} GiB" + ("  (frozen base + adapters)" if m.lora else ""),
        f"  gradients        {plan.grad_bytes / gib:8.2f} GiB",
        f"  AdamW moments    {plan.optimizer_bytes / gib:8.2f} GiB",
        f"  activations      {plan.activation_bytes / gib:8.2f} GiB",
        f"  logits           {plan.logits_bytes / gib:8.2f} GiB",
        f"  total            {plan.total_bytes / gib:8.2f} GiB",
    ]
    if device_memory_gib:
        verdict = "fits" if plan.total_bytes / gib < 0.9 * device_memory_gib else "does NOT fit"
        lines.append(f"  {verdict} in {device_memory_gib:g} GiB per device (90% budget)")
    return "\n".join(lines)
