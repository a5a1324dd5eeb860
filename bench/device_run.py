"""The first measurements on a fresh accelerator machine, in one call that returns within its budget.

    bash bench/device_run.sh                      # on the machine's own packages (carried wheels added), then this
    python bench/device_run.py --smoke-cpu        # the same stages on a CPU with the tests' tiny model

Every stage runs in a process of its own, most important first, under what is left of --budget (9
minutes by default): a stage that runs out of time is killed and the next one starts. Each writes
OUT/rows/NAME.json (status, seconds, its numbers) and OUT/logs/NAME.log the moment it ends, a killed
one with its partial log, so a session cut short keeps everything finished before; OUT/summary.md is
written after every stage. The stages:

1. backend: the versions measured with; one line and exit status 3 unless jax sees a GPU (a CPU with
   --smoke-cpu), so that an install that moved jax off CUDA stops here instead of timing every row on the
   CPU, or unless polyalign's trainer imports with what the machine has (it may have no package index).
2. smoke (about 90 s on an H200): the matmul rate in the compute dtype; cuDNN against XLA attention in
   value, gradient and time, causal, masked, masked and causal; which kernel each polyalign layout
   lowers to (rows, packed rows, row pairs, tree-packed pairs); three real steps of SFT and HDPO on a
   two-layer model of Qwen2.5-1.5B's shape.
3. the target rows (bench/train_step.py, one process each): HDPO 1.5B with its PyTorch peer, SFT 1.5B,
   tree-packed HDPO 1.5B, HDPO and SFT 0.5B with peers, packed SFT 1.5B, LoRA and QLoRA (NF4) HDPO at 7B
   (bench/lora_memory.py: memory and step seconds), then Tunix's DPO at 1.5B (bench/tunix_peer.py) where
   Tunix imports: carried as wheels (bash bench/device_wheels.sh --tunix) or in .venv-tunix.

XLA_PYTHON_CLIENT_MEM_FRACTION is set for every stage (0.92 unless already set): HDPO at 1.5B without
remat needs more than JAX's default 75%.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "tests" / "fixtures" / "tiny_model.yaml"
TUNIX_VENV = REPO / ".venv-tunix" / "bin" / "python"


def tunix_python() -> str | None:
    """The Python that runs Tunix: .venv-tunix's where it was made, else this one where Tunix imports here
    (its wheels carried onto the machine, bench/device_wheels.sh --tunix)."""
    import importlib.util

    if TUNIX_VENV.is_file():
        return str(TUNIX_VENV)
    return sys.executable if importlib.util.find_spec("tunix") is not None else None


def stages(smoke_cpu: bool, shape_file: Path) -> list[tuple[str, list[str], float]]:
    """(name, command, seconds it may take) in the order they run."""
    here = [sys.executable, str(Path(__file__).resolve())]
    step = [sys.executable, str(REPO / "bench" / "train_step.py")]
    # LoRA and QLoRA HDPO: XLA's memory of the step and its seconds (tokens: 2 x batch x seq a step)
    lora = [sys.executable, str(REPO / "bench" / "lora_memory.py"), "--variants", "lora r16", "qlora nf4 r16",
            "--time", "--steps", "3"]
    if smoke_cpu:
        tiny = ["--preset", str(TINY), "--dtype", "float32", "--seq", "64", "--batch", "2", "--steps", "3"]
        return [("backend", [*here, "--stage", "backend", "--smoke-cpu"], 60),
                ("matmul", [*here, "--stage", "matmul", "--smoke-cpu"], 60),
                ("attention", [*here, "--stage", "attention", "--smoke-cpu"], 90),
                ("kernels", [*here, "--stage", "kernels", "--smoke-cpu"], 90),
                ("steps-tiny", [*step, *tiny, "--no-peer"], 120),
                ("packed-tiny", [*step, *tiny, "--packed", "--stacks", "polyalign"], 120),
                ("lora-qlora-tiny", [*lora, "--presets", str(TINY), "--dtype", "float32", "--batch", "2", "--seq",
                                     "64"], 120),
                ("sampling", [*here, "--stage", "sampling", "--smoke-cpu"], 60),
                *([("tunix-tiny", [tunix, str(REPO / "bench" / "tunix_peer.py"), "--preset", "tiny", "--batch",
                                   "2", "--seq", "64", "--check"], 120)] if (tunix := tunix_python()) else [])]
    big = ["--dtype", "bfloat16", "--seq", "1024", "--steps", "5", "--remat", "none", "--logprob-chunk", "256"]
    rows = [("backend", [*here, "--stage", "backend"], 60),
            ("matmul", [*here, "--stage", "matmul"], 60),
            ("attention", [*here, "--stage", "attention"], 90),
            ("kernels", [*here, "--stage", "kernels"], 90),
            ("steps-2-layer-1.5b", [*step, "--preset", str(shape_file), *big, "--batch", "4", "--steps", "3",
                                    "--no-peer"], 150),
            ("hdpo-1.5b", [*step, "--preset", "qwen2.5-1.5b", "--method", "hdpo", *big, "--batch", "4"], 240),
            ("sft-1.5b", [*step, "--preset", "qwen2.5-1.5b", "--method", "sft", *big, "--batch", "8",
                          "--stacks", "polyalign,plain"], 180),
            ("hdpo-1.5b-packed", [*step, "--preset", "qwen2.5-1.5b", "--method", "hdpo", *big, "--batch", "4",
                                  "--packed", "--stacks", "polyalign"], 180),
            ("hdpo-0.5b", [*step, "--preset", "qwen2.5-0.5b", "--method", "hdpo", *big, "--batch", "8"], 180),
            ("sft-0.5b", [*step, "--preset", "qwen2.5-0.5b", "--method", "sft", *big, "--batch", "16"], 180),
            ("sft-1.5b-packed", [*step, "--preset", "qwen2.5-1.5b", "--method", "sft", *big, "--batch", "8",
                                 "--packed", "--stacks", "polyalign"], 180),
            ("lora-qlora-hdpo-7b", [*lora, "--presets", "qwen2.5-7b", "--batch", "4", "--seq", "1024"], 240),
            ("sampling", [*here, "--stage", "sampling"], 60)]
    if tunix := tunix_python():
        rows.append(("tunix-dpo-1.5b", [tunix, str(REPO / "bench" / "tunix_peer.py"), "--preset",
                                        "qwen2.5-1.5b", "--batch", "4", "--seq", "1024", "--dtype", "bfloat16"], 240))
    return rows


# --- the stages this file runs itself (each in its own process) -----------------------------------

# The versions a result is recorded with, and the modules the stages import from polyalign: the trainer,
# LoRA and the engine's sampling, none of them the data stack (grain, TFDS), which the machine may lack.
STACK = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "ml_dtypes", "torch", "transformers")
STAGE_MODULES = ("polyalign.train.sft", "polyalign.train.preference", "polyalign.model.lora",
                 "polyalign.generate.engine")


def _installed(distribution: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _missing_modules(modules) -> list[str]:
    """The top-level packages that importing `modules` finds missing, or of a version that lacks a name."""
    import importlib

    missing = set()
    for module in modules:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as error:
            missing.add((error.name or str(error)).split(".")[0])
        except ImportError as error:  # a package there, of a version without a name polyalign imports
            missing.add(f"{error.name or module} ({error})")
    return sorted(missing)


def stage_backend(smoke_cpu: bool) -> dict:
    """The machine, the versions every later number is measured with, and two checks that end the run in
    one line: jax must see a GPU (an install that replaced the machine's CUDA jax would time every row on
    the CPU), and polyalign's stages must import with what is installed (the machine may have no package
    index: a missing package is carried as a wheel, docs/gpu.md)."""
    import platform

    import jax

    device = jax.devices()[0]
    found = {"backend": jax.default_backend(), "devices": jax.device_count(), "device_kind": device.device_kind,
             "compute_capability": getattr(device, "compute_capability", None), "jax": jax.__version__,
             "python": platform.python_version(), "versions": {name: _installed(name) for name in STACK}}
    wanted = "cpu" if smoke_cpu else "gpu"
    if found["backend"] != wanted:
        print(f"device_run: jax {found['jax']} runs on {found['backend']} ({found['device_kind']}), not a {wanted}; "
              "did an install replace the machine's CUDA jax? (pip list | grep -i jax)", flush=True)
        sys.exit(3)
    missing = _missing_modules(STAGE_MODULES)
    if missing:
        print(f"device_run: polyalign's trainer needs {', '.join(missing)}, not installed on this machine; carry "
              "the wheels (bash bench/device_wheels.sh NAME==VERSION, then carry .whl: docs/gpu.md)", flush=True)
        sys.exit(3)
    return found


def stage_matmul(smoke_cpu: bool) -> dict:
    sys.path.insert(0, str(REPO / "bench"))
    from train_step import matmul_tflops

    dtype = "float32" if smoke_cpu else "bfloat16"
    return {"dtype": dtype, "tflops": round(matmul_tflops(dtype), 3)}


def _timed(fn, *args, repeats: int = 5) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    started = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - started) / repeats


def stage_attention(smoke_cpu: bool) -> dict:
    """cuDNN against XLA attention at one training shape: the output's and the query gradient's largest
    difference, and each one's time for value and gradient. On a CPU only XLA runs."""
    import jax
    import jax.numpy as jnp

    batch, length, heads, kv_heads, dim = (2, 128, 4, 2, 32) if smoke_cpu else (4, 1024, 12, 2, 128)
    dtype = jnp.float32 if smoke_cpu else jnp.bfloat16
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (batch, length, heads, dim), dtype)
    k, v = (jax.random.normal(key, (batch, length, kv_heads, dim), dtype) for key in keys[1:])
    segments = (jnp.arange(length) >= length // 3).astype(jnp.int32) + 1
    mask = (segments[:, None] == segments[None, :])[None, None] & jnp.tril(jnp.ones((length, length), bool))
    cases = {"causal": (None, True), "mask": (mask, False), "mask+causal": (mask, True)}
    implementations = ("xla",) if smoke_cpu else ("xla", "cudnn")
    out = {}
    for case, (case_mask, causal) in cases.items():
        results = {}
        for implementation in implementations:
            def loss(q, implementation=implementation):
                return jax.nn.dot_product_attention(q, k, v, mask=case_mask, is_causal=causal,
                                                    implementation=implementation).astype(jnp.float32).sum()

            value_and_grad = jax.jit(jax.value_and_grad(loss))
            try:
                value, grad = value_and_grad(q)
                results[implementation] = {"value": value, "grad": grad, "seconds": _timed(value_and_grad, q)}
            except Exception as err:  # cuDNN refuses shapes and masks with an exception: record it, go on
                results[implementation] = {"error": f"{type(err).__name__}: {str(err)[:200]}"}
        row = {f"{name}_ms": round(r["seconds"] * 1e3, 3) for name, r in results.items() if "seconds" in r}
        row.update({f"{name}_error": r["error"] for name, r in results.items() if "error" in r})
        if "seconds" in results.get("cudnn", {}) and "seconds" in results["xla"]:
            row["value_difference"] = float(abs(results["cudnn"]["value"] - results["xla"]["value"]))
            row["grad_max_difference"] = float(jnp.abs(results["cudnn"]["grad"].astype(jnp.float32)
                                                       - results["xla"]["grad"].astype(jnp.float32)).max())
        out[case] = row
    return {"shape": [batch, length, heads, kv_heads, dim], "dtype": str(jnp.dtype(dtype)), "cases": out}


def stage_kernels(smoke_cpu: bool) -> dict:
    """Which kernel each layout's attention lowers to with `attention_impl` left to polyalign: a cuDNN
    custom call in the compiled program, or XLA's own."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from polyalign.model import create_model
    from polyalign.model.presets import preset

    length = 64 if smoke_cpu else 512
    cfg = (preset(str(TINY), vocab_size=512) if smoke_cpu else
           preset("qwen2.5-1.5b", num_layers=2, dtype="bfloat16"))
    model = create_model(cfg)
    ids = jnp.ones((2, length), jnp.int32)
    position = np.arange(length)
    layouts = {"rows": {}, "padded rows": {"attention_mask": jnp.asarray(np.broadcast_to(position < length - 5,
                                                                                         (2, length)))},
               "packed rows": {"segment_ids": jnp.asarray(np.broadcast_to(1 + (position >= length // 2), (2, length)))},
               "tree-packed pairs": {"segment_ids": jnp.ones((2, length), jnp.int32), "branch_ids": jnp.asarray(
                   np.broadcast_to((position >= length // 4) + (position >= 5 * length // 8), (2, length)))}}
    found = {}
    for layout, masking in layouts.items():
        compiled = nnx.jit(lambda m, i, masking=masking: m.hidden_states(i, **masking)).lower(model, ids).compile()
        hlo = compiled.as_text()
        found[layout] = "cudnn" if "cudnn" in hlo.lower() else "xla"
    return {"attention_impl": cfg.attention_impl, "dtype": cfg.dtype, "length": length, "layouts": found,
            "backend": jax.default_backend()}


def stage_sampling(smoke_cpu: bool) -> dict:
    """The engine's per-step token choice (generate/engine.py sample_rows) at a serving batch over Qwen2.5's
    vocabulary, for greedy rows and for the sampling settings checkpoints ship (Qwen2.5-Instruct's
    temperature 0.7, top_p 0.8, top_k 20), beside the 1.5B model's output projection at the same batch:
    what sampling adds to a decoding step. The top-k/top-p cut bisects over the logits (64 passes)."""
    import jax
    import jax.numpy as jnp

    from polyalign.generate.engine import sample_rows

    rows, vocab, hidden = (16, 2048, 64) if smoke_cpu else (256, 151936, 1536)
    keys = jax.random.split(jax.random.key(0), rows + 2)
    logits = jax.random.normal(keys[0], (rows, vocab), jnp.float32) * 4
    row_keys = keys[2:]

    def settings(temperature, top_p, top_k, min_p=0.0):
        return (jnp.full((rows,), temperature, jnp.float32), jnp.full((rows,), top_p, jnp.float32),
                jnp.full((rows,), top_k, jnp.int32), jnp.full((rows,), min_p, jnp.float32))

    cases = {"greedy": settings(0.0, 1.0, 0), "temperature 0.7": settings(0.7, 1.0, 0),
             "top_p 0.95": settings(0.7, 0.95, 0), "top_k 20, top_p 0.8": settings(0.7, 0.8, 20),
             "min_p 0.05": settings(0.7, 1.0, 0, 0.05)}
    choose = jax.jit(sample_rows)
    found = {f"{case}_ms": round(_timed(choose, logits, row_keys, *values) * 1e3, 3) for case, values in cases.items()}
    dtype = jnp.float32 if smoke_cpu else jnp.bfloat16
    states = jax.random.normal(keys[1], (rows, hidden), dtype)
    head = jax.random.normal(keys[1], (hidden, vocab), dtype)
    found["output_projection_ms"] = round(_timed(jax.jit(jnp.matmul), states, head) * 1e3, 3)
    return {"rows": rows, "vocab": vocab, **found, "backend": jax.default_backend()}


STAGES = {"backend": stage_backend, "matmul": stage_matmul, "attention": stage_attention, "kernels": stage_kernels,
          "sampling": stage_sampling}


# --- the driver ---------------------------------------------------------------------------------------

def _result_of(out: Path, name: str, stdout_json: dict | None) -> dict | None:
    """What a stage left: its JSON line (this file's stages) or bench/train_step.py's OUT/train_step.json."""
    if stdout_json is not None:
        return stdout_json
    for path in sorted((out / "rows" / name).glob("*.json")):
        return json.loads(path.read_text())
    return None


def run_stage(out: Path, name: str, command: list[str], seconds: float, env: dict) -> dict:
    log = out / "logs" / f"{name}.log"
    started = time.perf_counter()
    with log.open("w") as handle:
        process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                                   env={**env, "OUT": str(out / "rows" / name)})
        try:
            status = "ok" if process.wait(timeout=seconds) == 0 else f"failed (exit {process.returncode})"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            status = f"timeout after {seconds:.0f} s"
    text = log.read_text(errors="replace")
    last = text.strip().splitlines()[-1] if text.strip() else ""
    try:
        stdout_json = json.loads(last) if name in STAGES and status == "ok" else None
    except json.JSONDecodeError:
        stdout_json = None
    row = {"name": name, "status": status, "seconds": round(time.perf_counter() - started, 1),
           "command": " ".join(command), "result": _result_of(out, name, stdout_json), "log": str(log)}
    if status != "ok":
        row["log_tail"] = text[-2000:]
    _write_whole(out / "rows" / f"{name}.json", json.dumps(row, indent=2, default=str) + "\n")
    return row


def _write_whole(path: Path, text: str) -> None:
    """Written beside and renamed: a kill at any moment leaves the old file or the new one, never half."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)


def _numbers(result: dict) -> str:
    """A stage's numbers in a cell: the step and LoRA benches' rows one by one, other stages' JSON."""
    rows = result.get("rows")
    if isinstance(rows, list) and all("stack" in r for r in rows):  # bench/train_step.py
        return "; ".join(f"{r['stack']} {r['method']}: {r.get('tokens_per_s')} tok/s, MFU {r.get('mfu')}"
                         for r in rows)
    if isinstance(rows, list):  # bench/lora_memory.py
        return "; ".join(f"{r.get('preset')} {r.get('variant')}: step {r.get('step_s')} s, XLA peak "
                         f"{r.get('xla_peak_gib')} GiB" for r in rows)
    return json.dumps(result, default=str)[:300]


def write_bundle(out: Path, folder: Path) -> None:
    """summary.md and one archive of everything under `out` (rows, logs, summary) in `folder`: two files,
    for a machine that hands back only a few files, each replaced whole."""
    import io
    import shutil
    import tarfile

    folder.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        archive.add(out, arcname="device_run", filter=lambda entry: None if "device_run.tar.gz" in entry.name
                    else entry)  # --bundle may name --out itself
    partial = folder / "device_run.tar.gz.partial"
    partial.write_bytes(buffer.getvalue())
    partial.replace(folder / "device_run.tar.gz")
    if (out / "summary.md").is_file():
        shutil.copyfile(out / "summary.md", folder / "summary.md.partial")
        (folder / "summary.md.partial").replace(folder / "summary.md")


def keep_bundle(out: Path, folder: Path) -> None:
    """write_bundle, a failure said in one line: the stages still to run matter more than the bundle."""
    try:
        write_bundle(out, folder)
    except OSError as error:
        print(f"device_run: could not write the bundle in {folder}: {error}", flush=True)


def summary(rows: list[dict]) -> str:
    lines = ["| stage | status | s | numbers |", "|---|---|---|---|"]
    for row in rows:
        try:
            numbers = _numbers(row.get("result") or {})
        except Exception as err:  # a row of a shape not foreseen: the table is written all the same
            numbers = f"({type(err).__name__} formatting this row: see rows/{row['name']}.json)"
        lines.append(f"| {row['name']} | {row['status']} | {row['seconds']} | {numbers} |")
    return "\n".join(lines) + "\n"


def shape_file(out: Path) -> Path:
    """Qwen2.5-1.5B's architecture file with two layers, which bench/train_step.py's --preset reads."""
    import yaml

    shape = yaml.safe_load((REPO / "configs" / "models" / "qwen2.5-1.5b.yaml").read_text())
    path = out / "qwen2.5-1.5b-2-layers.yaml"
    path.write_text(yaml.safe_dump({**shape, "num_layers": 2}))
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke-cpu", action="store_true",
                        help="the same stages on a CPU with the tests' tiny model (a few minutes)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or REPO / "runs" / "device"),
                        help="where rows, logs and summary.md go (default $OUT, else runs/device)")
    parser.add_argument("--bundle", type=Path, metavar="FOLDER",
                        help="also keep summary.md and device_run.tar.gz (all of --out) in FOLDER, rewritten "
                             "after every stage: two files, where a machine hands back only a few")
    parser.add_argument("--budget", type=float, default=540.0,
                        help="seconds for every stage together (default 540); none starts with under 20 s left")
    parser.add_argument("--stage", choices=sorted(STAGES), help=argparse.SUPPRESS)  # one stage, in its process
    args = parser.parse_args()
    if args.stage:
        print(json.dumps(STAGES[args.stage](args.smoke_cpu), default=str), flush=True)
        return 0

    out = args.out
    (out / "rows").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    env = {**os.environ, "XLA_PYTHON_CLIENT_MEM_FRACTION": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    if args.smoke_cpu:
        env["JAX_PLATFORMS"] = "cpu"
    deadline = time.monotonic() + args.budget
    rows = []
    for name, command, seconds in stages(args.smoke_cpu, shape_file(out)):
        left = deadline - time.monotonic()
        if left < 20:
            rows.append({"name": name, "status": "skipped (budget spent)", "seconds": 0, "result": None})
            continue
        row = run_stage(out, name, command, min(seconds, left), env)
        rows.append(row)
        print(f"device_run: {name}: {row['status']} ({row['seconds']} s)", flush=True)
        _write_whole(out / "summary.md", summary(rows))
        if args.bundle:
            keep_bundle(out, args.bundle)
        if name == "backend" and row["status"] != "ok":
            print(row.get("log_tail", "").strip().splitlines()[-1] if row.get("log_tail") else "backend check failed")
            return 3
    _write_whole(out / "summary.md", summary(rows))
    if args.bundle:
        keep_bundle(out, args.bundle)
    print(summary(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
