"""Runs the two-process SFT command of issue 29 N times and counts the runs whose losses equal one process's.

    python bench/two_process_stress.py RUN --runs 20 [--steps 6] [--timeout 400] [--work DIR]

RUN is a built demo run (`polyalign demo --out RUN --stages prepare,tokenizer,build`). Each run starts two
processes with two CPU devices each (jax.distributed over 127.0.0.1) on
`polyalign train sft --config configs/sft_demo.yaml data.dir=RUN train.steps=N parallel.data=4`, and compares
every step's loss and the final validation loss with one process of four devices (run once). A run that does
not finish within --timeout seconds counts as a hang; the last lines of both logs are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from polyalign.mesh.launch import free_port, start_variables, with_cpu_devices

REPO = Path(__file__).resolve().parents[1]


def _command(run: Path, out: Path, steps: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-P", "-m", "polyalign.cli", "train", "sft",
            "--config", str(REPO / "configs" / "sft_demo.yaml"), "--out", str(out), "--no-progress",
            f"data.dir={run}", f"train.steps={steps}", "parallel.data=4", *extra]


def _losses(out: Path) -> list[tuple[int, float, float | None]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["step"], r["loss"], r.get("val_loss")) for r in rows if "loss" in r]


def _start(command: list[str], devices: int, log: Path, env_extra: dict[str, str]) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": with_cpu_devices(os.environ.get("XLA_FLAGS"), devices),
           **env_extra}
    return subprocess.Popen(command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=REPO)


def one_run(run: Path, work: Path, steps: int, timeout: float, extra: list[str]) -> tuple[str, float]:
    out = work / "two"
    shutil.rmtree(out, ignore_errors=True)
    port = free_port()
    started = time.perf_counter()
    processes = [_start(_command(run, out, steps, extra), 2, work / f"worker-{i}.log",
                        start_variables(port, 2, i)) for i in range(2)]
    deadline = started + timeout
    codes = []
    for p in processes:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.perf_counter())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    for p in processes:
        if p.poll() is None:
            p.kill()
            p.wait()
    seconds = time.perf_counter() - started
    if any(c is None for c in codes):
        return "hang", seconds
    if any(codes):
        return f"exit {codes}", seconds
    return "ok", seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=400)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("extra", nargs="*", help="more key=value overrides for both runs")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="pa-stress-"))
    work.mkdir(parents=True, exist_ok=True)
    one = work / "one"
    if not (one / "summary.json").is_file():
        shutil.rmtree(one, ignore_errors=True)
        code = _start(_command(args.run, one, args.steps, args.extra), 4, work / "one.log", {}).wait()
        if code:
            print(f"the one-process run failed (exit {code}); see {work / 'one.log'}")
            return 1
    reference = _losses(one)
    good = 0
    for i in range(1, args.runs + 1):
        status, seconds = one_run(args.run, work, args.steps, args.timeout, args.extra)
        if status == "ok":
            two = _losses(work / "two")
            same = len(two) == len(reference) and all(
                a[0] == b[0] and abs(a[1] - b[1]) <= 1e-5 and (a[2] is None) == (b[2] is None)
                and (a[2] is None or abs(a[2] - b[2]) <= 1e-5) for a, b in zip(reference, two))
            status = "equal" if same else "different losses"
            good += same
        print(f"run {i}: {status} ({seconds:.0f} s)", flush=True)
        if status not in ("equal",):
            for w in range(2):
                tail = (work / f"worker-{w}.log").read_text(errors="replace").splitlines()[-8:]
                print(f"  worker {w}:", *tail, sep="\n    ")
    print(f"{good} of {args.runs} runs finished with losses equal to one process ({work})")
    return 0 if good == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
