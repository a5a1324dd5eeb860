"""Forward and backward throughput of the decoder on the local device.

    python bench/model_step.py                          # the tiny preset, batch 8 x seq 256, float32
    python bench/model_step.py --preset qwen2.5-0.5b --batch 4 --seq 1024 --dtype bfloat16 --remat dots

Prints compile time, step time and tokens/s for a cross-entropy forward+backward pass (no optimizer),
and writes JSON to $OUT/model_step.json when OUT is set.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from result_file import write_result

from polyalign.model import create_model
from polyalign.model.presets import preset, preset_or_file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", type=preset_or_file,
                        help="a preset name or an architecture YAML file (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="compute dtype")
    parser.add_argument("--remat", default="none", choices=("none", "full", "dots"))
    parser.add_argument("--no-scan", action="store_true", help="unroll the layers instead of scanning")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    cfg = preset(args.preset, dtype=args.dtype, remat=args.remat, scan_layers=not args.no_scan)
    model = create_model(cfg)
    graphdef, params = nnx.split(model, nnx.Param)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (args.batch, args.seq + 1)), jnp.int32)

    @jax.jit
    def step(params, tokens):
        def loss(p):
            logits = nnx.merge(graphdef, p)(tokens[:, :-1])
            logp = jax.nn.log_softmax(logits)
            return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

        return jax.value_and_grad(loss)(params)

    started = time.perf_counter()
    jax.block_until_ready(step(params, tokens))
    compile_s = time.perf_counter() - started
    times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        jax.block_until_ready(step(params, tokens))
        times.append(time.perf_counter() - started)
    step_s = statistics.median(times)
    result = {
        "preset": args.preset, "parameters": cfg.num_parameters(), "batch": args.batch, "seq": args.seq,
        "dtype": args.dtype, "remat": args.remat, "scan_layers": cfg.scan_layers,
        "device": jax.devices()[0].device_kind, "devices": jax.device_count(), "jax": jax.__version__,
        "compile_s": round(compile_s, 2), "step_s": round(step_s, 4), "step_s_min": round(min(times), 4),
        "tokens_per_s": round(args.batch * args.seq / step_s),
    }
    print(f"{'preset':14s} {'params':>10s} {'batch x seq':>12s} {'dtype':>9s} {'compile s':>10s} "
          f"{'step s':>8s} {'tokens/s':>10s}")
    print(f"{args.preset:14s} {result['parameters']:>10,d} {f'{args.batch} x {args.seq}':>12s} {args.dtype:>9s} "
          f"{compile_s:>10.2f} {step_s:>8.3f} {result['tokens_per_s']:>10,d}")
    write_result("model_step", result)


if __name__ == "__main__":
    main()
