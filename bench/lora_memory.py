"""Memory of an HDPO step with full tuning, LoRA and QLoRA, from XLA's analysis of the compiled step
(no accelerator needed: the trainer is built on an abstract model and only compiles), beside
`polyalign plan`'s estimate; and, with --time, CPU seconds of the tiny model's step with the reference
precomputed (plus the pass that precomputes it) or computed in the step.

    python bench/lora_memory.py                                    # Qwen2.5-1.5B, 4 pairs x 1024
    python bench/lora_memory.py --presets qwen2.5-1.5b qwen2.5-7b
    python bench/lora_memory.py --presets tiny --batch 4 --seq 128 --time

XLA's peak is arguments + outputs - donated aliases + temporaries of the step (the frozen base is an
argument; reference log-probs precomputed are part of the batch). Prints a table; writes JSON to
$OUT/lora_memory.json when OUT is set.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from result_file import write_result  # noqa: E402

from bench.train_step import _pair_batch, _time, compiled_memory  # noqa: E402
from polyalign.mesh import parallel  # noqa: E402
from polyalign.model import abstract_model, create_model  # noqa: E402
from polyalign.model.architecture import LoraConfig  # noqa: E402
from polyalign.model.lora import add_adapters, quantize_base  # noqa: E402
from polyalign.model.presets import preset  # noqa: E402
from polyalign.train.config import LoraSection, ModelSection, PreferenceConfig  # noqa: E402
from polyalign.train.plan import estimate  # noqa: E402
from polyalign.train.preference import PreferenceObjective, reference_logps  # noqa: E402
from polyalign.train.trainer import LoopConfig, OptimizerConfig, Trainer  # noqa: E402

# name: (lora rank, quantize, reference)
VARIANTS = {
    "full": (0, None, "precomputed"),
    "lora r16": (16, None, "precomputed"),
    "lora r16, reference in step": (16, None, "in_step"),
    "qlora nf4 r16": (16, "nf4", "precomputed"),
    "qlora nf4 r16, reference in step": (16, "nf4", "in_step"),
    "qlora int8 r16": (16, "int8", "precomputed"),
}


def model_config(name: str, args, rank: int, quantize: str | None):
    lora = LoraConfig(rank=rank, alpha=2.0 * rank) if rank else None
    # Full tuning keeps float32 parameters; an adapted base is frozen in the compute dtype.
    return preset(name, dtype=args.dtype, remat=args.remat, logprob_chunk=args.logprob_chunk, lora=lora,
                  quantize=quantize, param_dtype="float32" if lora is None else args.dtype)


def concrete_adapted(cfg, seed=0):
    """A concrete model of `cfg`: random base, quantised and adapted as training would make it."""
    plain = dataclasses.replace(cfg, lora=None, quantize=None)
    model = create_model(plain, seed=seed)
    if cfg.quantize:
        model = quantize_base(model, cfg.quantize)
    return add_adapters(model, cfg.lora, seed=seed + 1) if cfg.lora else model


def objective(reference: str, rank: int):
    section = ModelSection(lora=LoraSection(rank=rank))
    return PreferenceObjective(PreferenceConfig(init="bench", reference=reference, model=section), 1)


def row(args, name: str, variant: str) -> dict:
    rank, quantize, reference = VARIANTS[variant]
    cfg = model_config(name, args, rank, quantize)
    batch = _pair_batch(np.random.default_rng(0), 1, args.batch, args.seq, cfg.vocab_size)
    model = concrete_adapted(cfg) if args.time else abstract_model(cfg)  # abstract: compiles only
    # Before the trainer exists: its steps donate (delete) the arrays it was given.
    reference_s = _reference_pass_seconds(model, args, cfg) if args.time and reference == "precomputed" else 0.0
    trainer = Trainer(model, objective(reference, rank), OptimizerConfig(lr=1e-5),
                      LoopConfig(steps=10, global_batch=args.batch), parallel.make_mesh())
    started = time.perf_counter()
    memory = compiled_memory(trainer.compiled_step(batch))
    plan = estimate(cfg, (1, 1, 1), args.batch, 1, args.seq, sequences_per_example=2)
    out = {"preset": name, "variant": variant, "trainable": cfg.adapter_parameters() if rank else cfg.num_parameters(),
           "compile_s": round(time.perf_counter() - started, 1), **memory,
           "plan_gib": round(plan.total_bytes / 2**30, 2)}
    if args.time:
        out["step_s"] = round(_time(lambda: trainer.step(batch)["loss"], args.steps)[1], 4)
        out["reference_pass_s"] = round(reference_s, 4)
    return out


def _reference_pass_seconds(model, args, cfg) -> float:
    """Seconds per batch of `args.batch` pairs of the pass that precomputes the reference log-probs."""
    from polyalign.model.lora import base_model

    rng = np.random.default_rng(1)
    examples = []
    for k in range(args.batch * args.steps):
        example = {"id": str(k), "bucket": 0, "weight": 1.0, "critic_chosen": 0.0, "critic_rejected": 0.0}
        for side in ("chosen", "rejected"):
            example[f"{side}_ids"] = rng.integers(0, cfg.vocab_size, args.seq + 1).astype(np.int32)
            example[f"{side}_mask"] = np.r_[np.zeros(args.seq // 4 + 1), np.ones(args.seq - args.seq // 4)].astype(bool)
        examples.append(example)
    reference_logps(base_model(model), examples[:args.batch], args.seq, 0, batch_size=args.batch, progress=False)
    started = time.perf_counter()
    reference_logps(base_model(model), examples, args.seq, 0, batch_size=args.batch, progress=False)
    return (time.perf_counter() - started) / args.steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["qwen2.5-1.5b"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--batch", type=int, default=4, help="pairs per step")
    parser.add_argument("--seq", type=int, default=1024, help="tokens per side")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--remat", default="full")
    parser.add_argument("--logprob-chunk", type=int, default=256)
    parser.add_argument("--time", action="store_true", help="also run the steps (small presets only)")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    rows = []
    print(f"HDPO step, {args.batch} pairs x {args.seq} tokens a side, {args.dtype}, remat {args.remat}, "
          f"logprob_chunk {args.logprob_chunk}; jax {jax.__version__} on {jax.devices()[0].device_kind}")
    header = f"{'preset':14} {'variant':34} {'trainable':>12} {'XLA peak GiB':>12} {'plan GiB':>9}"
    print(header + ("  step s  ref pass s" if args.time else ""))
    for name in args.presets:
        full_peak = None
        for variant in args.variants:
            r = row(args, name, variant)
            rows.append(r)
            full_peak = r["xla_peak_gib"] if variant == "full" else full_peak
            ratio = f" ({r['xla_peak_gib'] / full_peak:.2f} x full)" if full_peak and variant != "full" else ""
            line = f"{name:14} {variant:34} {r['trainable']:>12,} {r['xla_peak_gib']:>12.2f} {r['plan_gib']:>9.2f}"
            if args.time:
                line += f"  {r['step_s']:>6.3f}  {r['reference_pass_s']:>9.3f}"
            print(line + ratio, flush=True)
    write_result("lora_memory", {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
