"""The accelerator measurements in one command, for a machine lent for a few minutes.

For each shape, bench/train_step.py times polyalign's SFT and HDPO steps and the plain JAX step in one
process, then the PyTorch + transformers peer in a second process (with JAX on the CPU there: JAX
reserves most of a GPU's memory for the process that uses it), then the JAX peer, Tunix's DPO trainer
(bench/tunix_peer.py, in the environment Tunix needs: --tunix-python, default .venv-tunix; its loss
is checked against polyalign's first). One table follows, with each target marked met or missed.

    python -m venv --system-site-packages .venv-tunix && .venv-tunix/bin/pip install -q google-tunix==0.1.7
    python bench/accelerator.py                                   # one H200: Qwen2.5-1.5B and 0.5B
    python bench/accelerator.py --variant "qwen2.5-1.5b --remat none" --variant "qwen2.5-0.5b --remat none"
    python bench/accelerator.py --presets tiny --batch 2 --seq 64 --vocab-size 512 --peak-tflops 1   # CPU check

Every run has its own time limit, so one that hangs costs only its share. Writes $OUT/accelerator.json
(and each run's train_step.json under $OUT/<run>/) when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
# (preset, method) -> what the step must reach: MFU, and tokens/s as a multiple of the peer's.
# packed_vs_unpacked: the MFU of packed rows (SFT packing, tree-packed pairs) over the unpacked step's.
TARGETS = {
    ("qwen2.5-1.5b", "hdpo"): {"mfu": 0.60, "vs_peer": 1.4, "vs_tunix": 1.2, "packed_vs_unpacked": 0.9},
    ("qwen2.5-1.5b", "sft"): {"mfu": 0.60, "packed_vs_unpacked": 0.9},
    ("qwen2.5-0.5b", "hdpo"): {"vs_peer": 1.8},
    ("qwen2.5-0.5b", "sft"): {"mfu": 0.60},
}


TUNIX_ENV = BENCH.parent / ".venv-tunix" / "bin" / "python"
# --system-site-packages: on an accelerator machine Tunix then uses the jax build installed for it.
TUNIX_SETUP = ("python -m venv --system-site-packages .venv-tunix && .venv-tunix/bin/pip install "
               "google-tunix==0.1.7")


def run_train_step(name: str, arguments: list[str], out: Path, limit: float, env_extra: dict[str, str],
                   script: str = "train_step.py", python: str = sys.executable) -> dict:
    """One bench process (train_step.py, or tunix_peer.py under Tunix's interpreter); its rows, or why
    there are none."""
    directory = out / name
    directory.mkdir(parents=True, exist_ok=True)
    command = [python, str(BENCH / script), *arguments]
    started = time.perf_counter()
    env = {**os.environ, "OUT": str(directory), "PYTHONPATH": str(BENCH.parent), **env_extra}
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=limit, env=env)
    except subprocess.TimeoutExpired:
        return {"name": name, "command": command, "error": f"timed out after {limit:.0f} s", "rows": []}
    seconds = round(time.perf_counter() - started, 1)
    (directory / "log.txt").write_text(result.stdout + result.stderr)
    report = directory / script.replace(".py", ".json")
    if result.returncode != 0 or not report.is_file():
        return {"name": name, "command": command, "seconds": seconds, "rows": [],
                "error": f"exit {result.returncode}: {result.stderr.strip().splitlines()[-1:]}"}
    data = json.loads(report.read_text())
    return {"name": name, "command": command, "seconds": seconds, "device": data["device"],
            "rows": [{**row, "preset": data["preset"], "run": name} for row in data["rows"]]}


def verdicts(rows: list[dict], targets=TARGETS) -> list[dict]:
    """Each target against polyalign's fastest setting for that shape and method (the default run or a
    variant: choosing remat for the hardware is the user's call too): the value reached, whether it is
    met, and which setting reached it."""
    out = []
    for (preset, method), wanted in targets.items():
        ours = max((r for r in rows if r["preset"] == preset and r["method"] == method
                    and r["stack"] == "polyalign (JAX)" and r.get("tokens_per_s")),
                   key=lambda r: r["tokens_per_s"], default=None)
        peers = {"vs_peer": next((r for r in rows if r["preset"] == preset and r["method"] == method
                                  and r["stack"] == "PyTorch + transformers"), None),
                 "vs_tunix": next((r for r in rows if r["preset"] == preset and r["stack"] == "tunix"), None)}
        packed = max((r for r in rows if r["preset"] == preset and r["method"] == method
                      and r["stack"] == "polyalign (JAX) packed" and r.get("mfu")),
                     key=lambda r: r["mfu"], default=None)
        for kind, threshold in wanted.items():
            peer = peers.get(kind)
            if kind == "mfu":
                value = ours and ours.get("mfu")
            elif kind == "packed_vs_unpacked":
                value = ours and packed and ours.get("mfu") and round(packed["mfu"] / ours["mfu"], 3)
            else:
                value = ours and peer and peer.get("tokens_per_s") and \
                    round(ours["tokens_per_s"] / peer["tokens_per_s"], 3)
            out.append({"preset": preset, "method": method, "target": kind, "threshold": threshold,
                        "value": value or None, "met": None if not value else value >= threshold,
                        "setting": (ours.get("variant") or "default") if ours else None})
    return out


def label(preset: str) -> str:
    """A shape's name in run folders and the table: an architecture file by its name, not its path."""
    return Path(preset).stem if preset.endswith((".yaml", ".yml")) else preset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="qwen2.5-1.5b,qwen2.5-0.5b",
                        help="shapes, in the order to run them: preset names or architecture YAML files")
    parser.add_argument("--batch", type=int, default=4, help="sequences (SFT) or pairs (HDPO) per step")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--remat", default="full")
    parser.add_argument("--logprob-chunk", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--peak-tflops", type=float,
                        help="the device's peak for MFU (default: the device kind's datasheet bf16 peak, "
                             "polyalign/train/throughput.py: 989 for an H200 SXM)")
    parser.add_argument("--vocab-size", type=int, help="override the presets' vocabulary (CPU checks)")
    parser.add_argument("--variant", action="append", default=[],
                        help='an extra polyalign/plain run after the default ones: "PRESET --flag value ..."')
    parser.add_argument("--limit", type=float, default=240.0, help="seconds each process may take")
    parser.add_argument("--budget", type=float,
                        help="seconds for everything: a run gets what is left (none starts with under 30 s), so "
                             "the table is printed before an outer time limit cuts the command off")
    parser.add_argument("--no-peer", action="store_true", help="no PyTorch or Tunix runs")
    parser.add_argument("--tunix-python", default=str(TUNIX_ENV),
                        help=f"the interpreter with google-tunix (default .venv-tunix: {TUNIX_SETUP})")
    args = parser.parse_args()

    out = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="accelerator-"))
    peak = ["--peak-tflops", str(args.peak_tflops)] if args.peak_tflops else []
    common = ["--batch", str(args.batch), "--seq", str(args.seq), "--dtype", args.dtype, "--steps", str(args.steps),
              *peak]
    if args.vocab_size:
        common += ["--vocab-size", str(args.vocab_size)]
    policy = ["--remat", args.remat, "--logprob-chunk", str(args.logprob_chunk)]
    ours = [*policy, "--stacks", "polyalign,plain"]
    tunix = ["--batch", str(args.batch), "--seq", str(args.seq), "--dtype", args.dtype, "--steps",
             str(max(args.steps, 4)), *peak, "--check"]

    plan = []  # (name, train_step arguments, extra environment, variant)
    for preset in args.presets.split(","):
        plan.append((f"{label(preset)}-jax", ["--preset", preset, *common, *ours], {}, None))
        if not args.no_peer:
            plan.append((f"{label(preset)}-peer", ["--preset", preset, *common, "--stacks", "peer"],
                         {"JAX_PLATFORMS": "cpu"}, None))
            plan.append((f"{label(preset)}-tunix", ["--preset", preset, *tunix], {}, "tunix"))
        plan.append((f"{label(preset)}-packed",
                     ["--preset", preset, *common, *policy, "--stacks", "polyalign", "--packed"], {}, "--packed"))
    for k, variant in enumerate(args.variant):
        preset, *flags = variant.split()
        plan.append((f"variant{k}-{label(preset)}", ["--preset", preset, *common, *ours, *flags], {}, " ".join(flags)))

    started, runs = time.perf_counter(), []
    for name, arguments, env_extra, variant in plan:
        limit = args.limit
        if args.budget is not None:
            limit = min(limit, args.budget - (time.perf_counter() - started))
            if limit < 30:
                runs.append({"name": name, "error": "skipped: out of --budget", "rows": []})
                continue
        if variant == "tunix":
            if not Path(args.tunix_python).is_file():
                runs.append({"name": name, "rows": [], "error": f"skipped: no Tunix environment at "
                                                                f"{args.tunix_python} ({TUNIX_SETUP})"})
                print(f"{name}: {runs[-1]['error']}", flush=True)
                continue
            run = run_train_step(name, arguments, out, limit, env_extra, "tunix_peer.py", args.tunix_python)
            variant = None
        else:
            run = run_train_step(name, arguments, out, limit, env_extra)
        for row in run["rows"]:
            row["variant"] = variant
        runs.append(run)
        print(f"{name}: {run.get('error') or str(run['seconds']) + ' s'}", flush=True)
        # what is done so far survives a cut-off
        (out / "accelerator.json").write_text(json.dumps({"args": vars(args), "runs": runs}, indent=2))

    rows = [row for run in runs for row in run["rows"]]
    print(f"\n{'shape':14s} {'variant':24s} {'stack':24s} {'method':6s} {'step s':>8s} {'tokens/s':>10s} {'MFU':>5s} "
          f"{'peak GiB':>8s} {'XLA peak':>8s}")
    for r in rows:
        def cell(key, spec, r=r):
            return "-" if r.get(key) is None else format(r[key], spec)
        print(f"{label(r['preset']):14s} {r.get('variant') or '-':24s} {r['stack']:24s} {r['method']:6s} "
              f"{cell('step_s', '8.3f'):>8s} {cell('tokens_per_s', '10,.0f'):>10s} {cell('mfu', '.2f'):>5s} "
              f"{cell('peak_memory_gib', '.1f'):>8s} {cell('xla_peak_gib', '.2f'):>8s}")
    for run in runs:
        if run.get("error"):
            print(f"{run['name']}: {run['error']}")
    results = verdicts(rows)
    print()
    for v in results:
        state = {True: "met", False: "MISSED", None: "not measured"}[v["met"]]
        setting = f", {v['setting']}" if v["setting"] else ""
        print(f"target {v['preset']} {v['method']} {v['target']} >= {v['threshold']}: {v['value'] or '-'} "
              f"({state}{setting})")
    report = {"args": vars(args), "runs": runs, "verdicts": results}
    (out / "accelerator.json").write_text(json.dumps(report, indent=2))
    print(f"\nwritten: {out / 'accelerator.json'}")


if __name__ == "__main__":
    main()
