"""Where a model's parameters land: the most bytes any one device holds after creating a model and after
loading a Hugging Face checkpoint, unsharded (all on the default device) and with a mesh (each
parameter in its sharding from the start), with wall times and the process's peak resident memory.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/sharded_init.py --preset qwen2.5-0.5b
    python bench/sharded_init.py --preset tiny --fsdp 1                  # whatever devices there are

Prints a table and writes JSON to $OUT/sharded_init.json when OUT is set.
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import jax
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from result_file import write_result  # noqa: E402

from polyalign.mesh import parallel  # noqa: E402
from polyalign.model import create_model, load_hf_checkpoint, save_hf_checkpoint  # noqa: E402
from polyalign.model.presets import preset, preset_or_file  # noqa: E402


def most_on_one_device(model) -> int:
    """The largest number of parameter bytes any single device holds."""
    per_device = Counter()
    for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)):
        for shard in leaf.addressable_shards:
            per_device[shard.device] += shard.data.nbytes
    return max(per_device.values())


def timed(name: str, make) -> dict:
    started = time.perf_counter()
    model = make()
    jax.block_until_ready(jax.tree.leaves(nnx.state(model, nnx.Param)))
    seconds = time.perf_counter() - started
    row = {"how": name, "seconds": round(seconds, 2),
           "most_on_one_device_gib": round(most_on_one_device(model) / 2**30, 3)}
    del model
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen2.5-0.5b", type=preset_or_file,
                        help="a preset name or an architecture YAML file (default: %(default)s)")
    parser.add_argument("--fsdp", type=int, default=-1, help="fsdp axis of the mesh (-1: every device)")
    parser.add_argument("--tensor", type=int, default=1)
    args = parser.parse_args()

    cfg = preset(args.preset)
    mesh = parallel.make_mesh(parallel.ParallelConfig(1, args.fsdp, args.tensor))
    total = 4 * cfg.num_parameters()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = Path(scratch) / "ckpt"
        save_hf_checkpoint(create_model(cfg, seed=0), checkpoint)
        rows.append(timed("create, one device", lambda: create_model(cfg, seed=0)))
        rows.append(timed("create, mesh", lambda: create_model(cfg, seed=0, mesh=mesh)))
        rows.append(timed("load checkpoint, one device", lambda: load_hf_checkpoint(checkpoint)))
        rows.append(timed("load checkpoint, mesh", lambda: load_hf_checkpoint(checkpoint, mesh=mesh)))
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    print(f"{args.preset}: {cfg.num_parameters() / 1e6:,.1f}M parameters, {total / 2**30:.2f} GiB in float32; "
          f"mesh {dict(mesh.shape)} over {jax.device_count()} {jax.devices()[0].device_kind} devices")
    print(f"{'':30s} {'seconds':>8s} {'most on one device GiB':>23s}")
    for r in rows:
        print(f"{r['how']:30s} {r['seconds']:8.2f} {r['most_on_one_device_gib']:23.3f}")
    print(f"process peak resident memory: {peak_rss:.2f} GiB")
    write_result("sharded_init", {"preset": args.preset, "parameters": cfg.num_parameters(), "mesh": dict(mesh.shape),
                                  "devices": jax.device_count(), "rows": rows, "peak_rss_gib": round(peak_rss, 2)})


if __name__ == "__main__":
    main()
