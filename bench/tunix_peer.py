"""Tunix, the JAX peer: its DPO trainer on the same Qwen2 model and batch as polyalign's.

Both models come from one random polyalign model written as a Hugging Face checkpoint (Tunix reads
it with its own safetensors loader), the reference from a second one. `--check` first compares
Tunix's DPO loss on one batch with polyalign's (the same weights, prompts and responses; Tunix
left-pads prompts, polyalign right-pads whole sequences) and fails beyond float tolerance. Then
Tunix's DPOTrainer runs `--steps` steps (the reference forward inside each, as Tunix does) and the
steady-state step time gives tokens/s and MFU, counted as bench/train_step.py counts them.

Tunix pins its own transformers and datasets, so it runs in an environment of its own:

    python -m venv .venv-tunix && .venv-tunix/bin/pip install google-tunix==0.1.7
    PYTHONPATH=. .venv-tunix/bin/python bench/tunix_peer.py --preset tiny --batch 2 --seq 64 --check
    PYTHONPATH=. .venv-tunix/bin/python bench/tunix_peer.py --preset qwen2.5-1.5b --batch 4 --seq 1024 \\
        --dtype bfloat16

Writes $OUT/tunix_peer.json when OUT is set.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from result_file import write_result  # noqa: E402

from polyalign.model import create_model, family_defaults, save_hf_checkpoint  # noqa: E402
from polyalign.model.flops import step_flops  # noqa: E402
from polyalign.model.presets import preset  # noqa: E402
from polyalign.train.losses import dpo_loss  # noqa: E402
from polyalign.train.throughput import known_peak_tflops  # noqa: E402

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=16, tie_embeddings=True)


def model_config(args):
    if args.preset == "tiny":
        return family_defaults("qwen2", **TINY, dtype=args.dtype, param_dtype="float32")
    cfg = preset(args.preset, dtype=args.dtype)
    if cfg.family != "qwen2":
        sys.exit(f"{args.preset}: Tunix's peer model here is Qwen2; pick a qwen2.5 preset")
    return cfg


def tunix_model(checkpoint: Path, cfg):
    from tunix.models.qwen2 import model as qwen2
    from tunix.models.qwen2 import params

    dtype = jnp.dtype(cfg.dtype)
    config = qwen2.ModelConfig(num_layers=cfg.num_layers, vocab_size=cfg.vocab_size, embed_dim=cfg.hidden_size,
                               hidden_dim=cfg.intermediate_size, num_heads=cfg.num_heads, head_dim=cfg.head_dim,
                               num_kv_heads=cfg.num_kv_heads, rope_theta=int(cfg.rope_theta), norm_eps=cfg.rms_norm_eps,
                               use_tied_embedding=cfg.tie_embeddings, dtype=dtype, param_dtype=jnp.float32)
    auto = (jax.sharding.AxisType.Auto,) * 2  # Tunix's model shards by name, under an Auto mesh
    mesh = jax.make_mesh((1, len(jax.devices())), ("fsdp", "tp"), axis_types=auto)
    with jax.set_mesh(mesh):
        return params.create_model_from_safe_tensors(str(checkpoint), config, mesh), mesh


def random_pairs(rng, batch: int, prompt_len: int, response_len: int, vocab: int, uneven: bool):
    """Prompts (left-padded for Tunix) and responses (right-padded): of uneven lengths for the loss
    check, full length for timing (every position a real token, as bench/train_step.py's rows)."""
    def lengths(full):
        return rng.integers(full // 2, full + 1, batch) if uneven else np.full(batch, full)

    prompts = [rng.integers(3, vocab, n) for n in lengths(prompt_len)]
    chosen = [rng.integers(3, vocab, n) for n in lengths(response_len)]
    rejected = [rng.integers(3, vocab, n) for n in lengths(response_len)]
    return prompts, chosen, rejected


def tunix_input(prompts, chosen, rejected, prompt_len: int, response_len: int):
    from tunix.sft.dpo.dpo_trainer import TrainingInput

    def pad(rows, length, left):
        ids = np.zeros((len(rows), length), np.int32)
        mask = np.zeros((len(rows), length), np.int32)
        for i, row in enumerate(rows):
            span = slice(length - len(row), length) if left else slice(0, len(row))
            ids[i, span], mask[i, span] = row, 1
        return ids, mask

    p, pm = pad(prompts, prompt_len, left=True)
    c, cm = pad(chosen, response_len, left=False)
    r, rm = pad(rejected, response_len, left=False)
    return TrainingInput(prompt_ids=p, prompt_mask=pm, chosen_ids=c, chosen_mask=cm, rejected_ids=r, rejected_mask=rm)


def polyalign_logps(model, prompts, responses, length: int) -> np.ndarray:
    """Summed response log-probs, each sequence unpadded then right-padded to `length`."""
    ids = np.zeros((len(prompts), length + 1), np.int32)
    mask = np.zeros((len(prompts), length), np.float32)
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        row = np.concatenate([prompt, response])
        ids[i, :len(row)] = row
        mask[i, len(prompt) - 1:len(row) - 1] = 1.0  # positions whose next token is a response token
    logps = model.token_log_probs(jnp.asarray(ids[:, :-1]), jnp.asarray(ids[:, 1:]))
    return np.asarray((logps * mask).sum(-1))


def check_loss(policy, reference, tunix_policy, tunix_reference, pairs, args) -> dict:
    import optax
    from tunix.sft.dpo import dpo_trainer

    prompts, chosen, rejected = pairs
    length = args.prompt_len + args.response_len
    ours = dpo_loss(*(jnp.asarray(polyalign_logps(m, prompts, side, length))
                      for m, side in ((policy, chosen), (policy, rejected),
                                      (reference, chosen), (reference, rejected))),
                    args.beta, 0.0).mean()
    config = dpo_trainer.DPOTrainingConfig(eval_every_n_steps=10**9, max_steps=1, beta=args.beta)
    trainer = dpo_trainer.DPOTrainer(tunix_policy, tunix_reference, optax.sgd(0.0), config)
    example = trainer._prepare_inputs(tunix_input(*pairs, args.prompt_len, args.response_len))
    theirs, _ = dpo_trainer.dpo_loss_fn(tunix_policy, example, beta=args.beta)
    return {"polyalign_loss": float(ours), "tunix_loss": float(theirs), "difference": abs(float(ours) - float(theirs))}


def time_tunix(tunix_policy, tunix_reference, pairs, args, cfg) -> dict:
    import optax
    from tunix.sft.dpo import dpo_trainer

    batch = tunix_input(*pairs, args.prompt_len, args.response_len)
    config = dpo_trainer.DPOTrainingConfig(eval_every_n_steps=10**9, max_steps=args.steps, beta=args.beta,
                                           pbar_description=None)
    trainer = dpo_trainer.DPOTrainer(tunix_policy, tunix_reference, optax.adamw(1e-6), config)
    stamps = []

    def batches():
        for _ in range(args.steps):
            stamps.append(time.perf_counter())
            yield batch

    trainer.train(batches())
    jax.effects_barrier()
    stamps.append(time.perf_counter())
    steady = np.diff(stamps)[2:] if len(stamps) > 4 else np.diff(stamps)[1:]  # first steps compile
    step_s = float(np.median(steady))
    prompts, chosen, rejected = pairs  # both sides run the prompt
    tokens = sum(2 * len(p) + len(c) + len(r) for p, c, r in zip(prompts, chosen, rejected))
    # both sides as whole sequences with the reference's forward pass, as train_step.py counts polyalign's
    sequences = [len(p) + len(side) for side_of_pair in (chosen, rejected) for p, side in zip(prompts, side_of_pair)]
    flops = step_flops(cfg, sequences, reference_forward=True)
    peak = args.peak_tflops or known_peak_tflops(jax.devices()[0].device_kind)
    return {"stack": "tunix", "method": "dpo", "step_s": round(step_s, 4), "tokens_per_s": round(tokens / step_s, 1),
            "tflops_per_s": round(flops / step_s / 1e12, 3),
            "mfu": round(flops / step_s / (peak * 1e12), 3) if peak else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", help="tiny or a qwen2.5 preset (Tunix's Qwen2 model)")
    parser.add_argument("--batch", type=int, default=4, help="pairs per step")
    parser.add_argument("--seq", type=int, default=1024, help="tokens per side: prompt + response")
    parser.add_argument("--dtype", default="float32", help="compute dtype (bfloat16 on an accelerator)")
    parser.add_argument("--steps", type=int, default=6, help="timed Tunix steps (the first two compile)")
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--check", action="store_true", help="first compare the DPO loss with polyalign's")
    parser.add_argument("--peak-tflops", type=float,
                        help="per-device peak for MFU (default: the device kind's datasheet bf16 peak)")
    args = parser.parse_args()
    args.prompt_len, args.response_len = args.seq // 2, args.seq - args.seq // 2
    cfg = model_config(args)
    policy, reference = create_model(cfg, seed=0), create_model(cfg, seed=1)
    rng = np.random.default_rng(0)
    pairs = {uneven: random_pairs(rng, args.batch, args.prompt_len, args.response_len, cfg.vocab_size, uneven)
             for uneven in (True, False)}
    report = {"device": jax.devices()[0].device_kind, "preset": args.preset, "batch": args.batch, "seq": args.seq,
              "dtype": args.dtype}
    with tempfile.TemporaryDirectory() as tmp:
        for name, model in (("policy", policy), ("reference", reference)):
            save_hf_checkpoint(model, Path(tmp) / name, dtype="float32")
        (tunix_policy, mesh), (tunix_reference, _) = (tunix_model(Path(tmp) / name, cfg)
                                                       for name in ("policy", "reference"))
    with jax.set_mesh(mesh):
        measure(report, policy, reference, tunix_policy, tunix_reference, pairs, args, cfg)
    write_result("tunix_peer", report)


def measure(report, policy, reference, tunix_policy, tunix_reference, pairs, args, cfg) -> None:
    if args.check:
        report["check"] = check_loss(policy, reference, tunix_policy, tunix_reference, pairs[True], args)
        print(f"DPO loss on one batch: polyalign {report['check']['polyalign_loss']:.6f}, Tunix "
              f"{report['check']['tunix_loss']:.6f} (|difference| {report['check']['difference']:.1e})")
        tolerance = 1e-4 if args.dtype == "float32" else 2e-2
        if report["check"]["difference"] > tolerance:
            sys.exit(f"Tunix and polyalign disagree on the DPO loss by more than {tolerance}")
    if args.steps:
        report["rows"] = [time_tunix(tunix_policy, tunix_reference, pairs[False], args, cfg)]
        row = report["rows"][0]
        print(f"tunix dpo: {row['step_s']} s/step, {row['tokens_per_s']:,.0f} tokens/s"
              + (f", MFU {row['mfu']:.2f}" if row["mfu"] is not None else ""))


if __name__ == "__main__":
    main()
