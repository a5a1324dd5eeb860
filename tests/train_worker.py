"""Runs one training computation in a fresh process, so that tests can vary the device count
(XLA_FLAGS must be set before JAX starts). Not a test module.

    python tests/train_worker.py grads RUN OUT.safetensors --devices 8 --data 2 --fsdp 2 --tensor 2 --micro 2
"""

import argparse
import os
import sys
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["grads", "generate"])
    parser.add_argument("run", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--data", type=int, default=-1)
    parser.add_argument("--fsdp", type=int, default=1)
    parser.add_argument("--tensor", type=int, default=1)
    parser.add_argument("--micro", type=int, default=1)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--lora-rank", type=int, default=0)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from polyalign.mesh.launch import with_cpu_devices  # before JAX starts: XLA reads the flags once

    os.environ["XLA_FLAGS"] = with_cpu_devices(os.environ.get("XLA_FLAGS"), args.devices)

    if args.mode == "generate":
        from tests.train_checks import sharded_generation_matches

        sharded_generation_matches(args.out, (args.data, args.fsdp, args.tensor))
        return
    from tests.train_checks import gradients_of_first_batch

    gradients_of_first_batch(args.run, args.out, micro_batches=args.micro, global_batch=args.global_batch,
                             parallel_sizes=(args.data, args.fsdp, args.tensor), lora_rank=args.lora_rank)


if __name__ == "__main__":
    main()
