"""Two layout choices of the preference step, each against the layout polyalign uses, on plain JAX
steps of the same model (full logits, the DPO loss, optax AdamW, donated state):

- chosen and rejected in one forward (stacked on the batch axis) against one forward per side;
- reference log-probs precomputed (they travel with the pairs) against a frozen reference model run
  inside every step.

    python bench/preference_step.py --preset tiny --batch 4 --seq 256           # CPU: time and memory
    python bench/preference_step.py --preset qwen2.5-0.5b --batch 4 --seq 1024 --dtype bfloat16 \\
        --remat full --compile-only                                              # XLA memory only

Prints a table and writes JSON to $OUT/preference_step.json when OUT is set.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from result_file import write_result  # noqa: E402
from train_step import _pair_batch, _time, compiled_memory  # noqa: E402

from polyalign.model import abstract_model, create_model  # noqa: E402
from polyalign.model.presets import preset, preset_or_file  # noqa: E402
from polyalign.train.losses import dpo_loss  # noqa: E402

LAYOUTS = {
    "one forward, reference precomputed": {"one_forward": True, "fused_reference": False},
    "two forwards, reference precomputed": {"one_forward": False, "fused_reference": False},
    "one forward, reference in the step": {"one_forward": True, "fused_reference": True},
}


def _side_logps(model, inputs, targets, mask):
    return (model.token_log_probs(inputs, targets) * mask).sum(-1)


def pair_logps(model, batch, one_forward: bool):
    """Summed response log-probs of both sides, in one forward pass or one per side."""
    if one_forward:
        logps = _side_logps(model, *(jnp.concatenate([batch[f"chosen_{k}"], batch[f"rejected_{k}"]])
                                     for k in ("inputs", "targets", "mask")))
        half = batch["chosen_inputs"].shape[0]
        return logps[:half], logps[half:]
    return tuple(_side_logps(model, batch[f"{side}_inputs"], batch[f"{side}_targets"], batch[f"{side}_mask"])
                 for side in ("chosen", "rejected"))


def measure(args, cfg, name: str, one_forward: bool, fused_reference: bool) -> dict:
    batch = jax.tree.map(lambda x: jnp.asarray(x[0]), _pair_batch(np.random.default_rng(0), 1, args.batch, args.seq,
                                                                  cfg.vocab_size))
    graphdef, params = nnx.split(abstract_model(cfg) if args.compile_only else create_model(cfg))
    # a frozen copy of the initial policy, as a reference run in every step would hold
    reference = params if args.compile_only else jax.tree.map(jnp.copy, params)
    tx = optax.adamw(1e-5)
    opt_state = jax.eval_shape(tx.init, params) if args.compile_only else tx.init(params)

    def loss_fn(params, reference, batch):
        chosen, rejected = pair_logps(nnx.merge(graphdef, params), batch, one_forward)
        if fused_reference:
            ref_chosen, ref_rejected = jax.lax.stop_gradient(pair_logps(nnx.merge(graphdef, reference), batch, True))
        else:
            ref_chosen, ref_rejected = batch["ref_chosen"], batch["ref_rejected"]
        return dpo_loss(chosen, rejected, ref_chosen, ref_rejected).mean()

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, reference, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, reference, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    ref_arg = reference if fused_reference else None
    compiled = step.lower(params, opt_state, ref_arg, batch).compile()
    row = {"layout": name, **compiled_memory(compiled), "step_s": None}
    if args.compile_only:
        return row
    carry = [params, opt_state]

    def run():
        carry[0], carry[1], loss = step(carry[0], carry[1], ref_arg, batch)
        return loss

    row["step_s"] = round(_time(run, args.steps)[1], 5)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", type=preset_or_file,
                        help="a preset name or an architecture YAML file (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=4, help="pairs per step")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--remat", choices=("none", "full", "dots"), default="none")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--vocab-size", type=int)
    parser.add_argument("--compile-only", action="store_true", help="XLA's memory analysis only")
    args = parser.parse_args()

    overrides = {"dtype": args.dtype, "remat": args.remat,
                 **({"vocab_size": args.vocab_size} if args.vocab_size else {})}
    cfg = preset(args.preset, **overrides)
    rows = [measure(args, cfg, name, **layout) for name, layout in LAYOUTS.items()]
    base = rows[0]
    print(f"{args.preset}: {args.batch} pairs x {args.seq}, {args.dtype}, remat {args.remat}; "
          f"{jax.devices()[0].device_kind}")
    print(f"{'layout':38s} {'step s':>8s} {'vs ours':>8s} {'XLA peak GiB':>13s} {'XLA temp GiB':>13s}")
    for r in rows:
        ratio = "-" if r["step_s"] is None else f"{r['step_s'] / base['step_s']:.3f}"
        step = "-" if r["step_s"] is None else f"{r['step_s']:.4f}"
        print(f"{r['layout']:38s} {step:>8s} {ratio:>8s} {r['xla_peak_gib']:13.3f} {r['xla_temp_gib']:13.3f}")
    write_result("preference_step", {"preset": args.preset, "batch": args.batch, "seq": args.seq, "dtype": args.dtype,
                                     "remat": args.remat, "device": jax.devices()[0].device_kind, "rows": rows})


if __name__ == "__main__":
    main()
