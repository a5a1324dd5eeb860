"""The training-step benchmark runs on CPU at tiny sizes and reports what it promises."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO, TINY_MODEL


@pytest.mark.slow
def test_train_step_bench_on_cpu(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "bench" / "train_step.py"), "--preset", str(TINY_MODEL),
                             "--batch", "2", "--seq", "64", "--steps", "2", "--vocab-size", "512", "--no-peer",
                             "--peak-tflops", "1"],
                            capture_output=True, text=True, env={**os.environ, "OUT": str(tmp_path)}, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "polyalign (JAX)" in result.stdout and "tokens/s" in result.stdout
    report = json.loads((tmp_path / "train_step.json").read_text())
    plain = {r["method"]: r for r in report["rows"] if r["stack"] == "plain JAX"}
    rows = {r["method"]: r for r in report["rows"] if r["stack"] == "polyalign (JAX)"}
    assert set(rows) == set(plain) == {"sft", "hdpo"}
    assert "sft: polyalign step / plain JAX step = " in result.stdout
    for method, row in rows.items():
        # XLA's own memory analysis: at least the parameters, gradients and two AdamW moments (float32)
        assert row["xla_peak_gib"] * 2**30 >= 4 * 4 * report["parameters"] * 0.99
        assert row["xla_temp_gib"] > 0 and plain[method]["xla_peak_gib"] > 0
    assert rows["sft"]["tokens"] == 2 * 64 and rows["hdpo"]["tokens"] == 2 * 2 * 64
    for row in rows.values():
        assert row["step_s"] > 0 and row["tokens_per_s"] == pytest.approx(row["tokens"] / row["step_s"], rel=1e-2)
        assert 0 < row["mfu"] < 1
    assert rows["hdpo"]["reference_s"] > 0


def test_compile_only_reports_that_chunked_log_probs_drop_the_logits(tmp_path):
    """At a vocabulary much larger than the model, the [B, T, V] logits dominate the step's temporaries:
    blocks of 16 positions must cut XLA's peak estimate by most of their size."""
    def peak(chunk):
        out = tmp_path / str(chunk)
        out.mkdir()
        result = subprocess.run([sys.executable, str(REPO / "bench" / "train_step.py"), "--preset", "tiny", "--batch",
                                 "4", "--seq", "256", "--vocab-size", "32000", "--method", "sft", "--compile-only",
                                 "--no-plain", "--logprob-chunk", str(chunk)],
                                capture_output=True, text=True, env={**os.environ, "OUT": str(out)}, timeout=600)
        assert result.returncode == 0, result.stderr[-2000:]
        return json.loads((out / "train_step.json").read_text())["rows"][0]["xla_peak_gib"] * 2**30

    logits_bytes = 4 * 256 * 32000 * 4  # one float32 [B, T, V] buffer
    full, chunked = peak(0), peak(16)
    assert full - chunked > logits_bytes


def test_the_step_bench_counts_the_segments_each_layout_holds():
    """train_step.py's FLOPs are model/flops.py's over what the batch really holds: SFT rows as their
    real lengths, row pairs as both sides, packed rows segment by segment, tree-packed pairs as trees."""
    sys.path.insert(0, str(REPO / "bench"))
    from train_step import _packed_pair_batch, _packed_sft_batch, _pair_batch, _sft_batch, batch_segments

    rng = np.random.default_rng(0)
    assert batch_segments(_sft_batch(rng, 1, 2, 64, 100)) == [64, 64]
    assert batch_segments(_pair_batch(rng, 1, 3, 32, 100)) == [32] * 6
    assert batch_segments(_packed_sft_batch(rng, 2, 64, 100)) == [16] * 8  # 4 examples of 17 ids a row
    # a prompt of 64 / 8 = 8 tokens and two continuations of 3 x 64 / 16 = 12, as next-token inputs (19
    # a side): the first 7 computed once, the prompt's last one in each branch (its targets differ)
    assert batch_segments(_packed_pair_batch(rng, 1, 64, 100)) == [(7, [12, 12])] * 2


def test_input_pipeline_bench_reports_both_layouts(built_run, tmp_path):
    run, _ = built_run
    result = subprocess.run([sys.executable, str(REPO / "bench" / "input_pipeline.py"), "--run", str(run),
                             "--batch", "8", "--steps", "6"], capture_output=True, text=True,
                            env={**os.environ, "OUT": str(tmp_path)}, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((tmp_path / "input_pipeline.json").read_text())
    one_each, packed = report["rows"]
    assert (one_each["pack"], packed["pack"]) == (False, True)
    assert one_each["positions_per_s"] > 0 and packed["positions_per_s"] > 0
    # the same rows of 64 positions (the fixture's examples nearly fill one each): never more tokens
    # than positions, and packing never fewer tokens than one example per row
    for row in report["rows"]:
        assert 0 < row["real_tokens"] <= 6 * 8 * 64
    assert packed["real_tokens"] >= one_each["real_tokens"]
    assert "the pipeline delivers" in result.stdout


def test_accelerator_verdicts_by_hand():
    sys.path.insert(0, str(REPO / "bench"))
    from accelerator import verdicts

    def row(stack, method, tokens_per_s, mfu=None, variant=None):
        return {"preset": "qwen2.5-1.5b", "stack": stack, "method": method, "tokens_per_s": tokens_per_s, "mfu": mfu,
                **({"variant": variant} if variant else {})}

    rows = [row("polyalign (JAX)", "hdpo", 42_000.0, 0.62), row("PyTorch + transformers", "hdpo", 28_000.0, 0.41),
            row("polyalign (JAX)", "hdpo", 35_000.0, 0.52, variant="--remat dots"),  # slower: not the one judged
            row("polyalign (JAX)", "sft", 50_000.0, 0.55),
            row("polyalign (JAX)", "sft", 56_000.0, 0.61, "--remat none"),
            row("tunix", "dpo", 40_000.0, 0.55), row("polyalign (JAX) packed", "hdpo", 30_000.0, 0.58)]
    found = {(v["method"], v["target"]): v for v in verdicts(rows) if v["preset"] == "qwen2.5-1.5b"}
    assert (found["hdpo", "mfu"]["value"], found["hdpo", "mfu"]["met"],
            found["hdpo", "mfu"]["setting"]) == (0.62, True, "default")
    assert (found["hdpo", "vs_peer"]["value"], found["hdpo", "vs_peer"]["met"]) == (1.5, True)
    assert (found["hdpo", "vs_tunix"]["value"], found["hdpo", "vs_tunix"]["met"]) == (1.05, False)  # 42k / 40k
    assert (found["hdpo", "packed_vs_unpacked"]["value"], found["hdpo", "packed_vs_unpacked"]["met"]) == (0.935, True)
    assert found["sft", "packed_vs_unpacked"]["met"] is None  # no packed SFT row: not measured
    assert (found["sft", "mfu"]["value"], found["sft", "mfu"]["met"],
            found["sft", "mfu"]["setting"]) == (0.61, True, "--remat none")
    unmeasured = [v for v in verdicts(rows) if v["preset"] == "qwen2.5-0.5b"]
    assert unmeasured and all(v["met"] is None and v["value"] is None for v in unmeasured)


@pytest.mark.slow
def test_accelerator_script_runs_every_stack_in_its_process(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "bench" / "accelerator.py"), "--presets",
                             str(TINY_MODEL), "--batch", "2", "--seq", "64", "--vocab-size", "512", "--peak-tflops",
                             "1", "--steps", "1", "--variant", f"{TINY_MODEL} --remat dots", "--tunix-python",
                             str(tmp_path / "no-tunix")],
                            capture_output=True, text=True, env={**os.environ, "OUT": str(tmp_path)}, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((tmp_path / "accelerator.json").read_text())
    jax_run, peer_run, tunix_run, packed_run, variant_run = report["runs"]
    # an architecture file's runs are named after it and kept under OUT
    assert [run["name"] for run in report["runs"]] == [
        f"tiny_model-{kind}" for kind in ("jax", "peer", "tunix", "packed")] + ["variant0-tiny_model"]
    assert (tmp_path / "tiny_model-jax").is_dir() and not list(TINY_MODEL.parent.glob("tiny_model.yaml-*"))
    # Tunix runs in an environment of its own; without one the run says how to make it
    assert tunix_run["rows"] == [] and "skipped: no Tunix environment" in tunix_run["error"]
    assert "pip install google-tunix" in tunix_run["error"]
    assert {(r["stack"], r["method"]) for r in jax_run["rows"]} == {
        (stack, method) for stack in ("polyalign (JAX)", "plain JAX") for method in ("sft", "hdpo")}
    # the peer's process has JAX on the CPU; without torch it reports no rows, with it both methods
    assert {r["method"] for r in peer_run["rows"]} in (set(), {"sft", "hdpo"}) and "error" not in peer_run
    assert all(r["variant"] == "--remat dots" for r in variant_run["rows"]) and len(variant_run["rows"]) == 4
    # packed rows: polyalign's step only, on rows holding several examples or pair trees
    assert ({(r["stack"], r["method"]) for r in packed_run["rows"]}
            == {("polyalign (JAX) packed", m) for m in ("sft", "hdpo")})
    assert all(0 < r["tokens"] <= 2 * 64 and r["mfu"] > 0 for r in packed_run["rows"])
    assert len(report["verdicts"]) == 8 and "target qwen2.5-1.5b hdpo vs_peer >= 1.4" in result.stdout
    assert "target qwen2.5-1.5b hdpo vs_tunix >= 1.2: - (not measured" in result.stdout
    # a budget too small for any run: every run is skipped, and the report still comes out
    skipped = subprocess.run([sys.executable, str(REPO / "bench" / "accelerator.py"), "--presets", "tiny",
                              "--budget", "5"],
                             capture_output=True, text=True, env={**os.environ, "OUT": str(tmp_path)}, timeout=600)
    report = json.loads((tmp_path / "accelerator.json").read_text())
    assert skipped.returncode == 0 and [r["error"] for r in report["runs"]] == ["skipped: out of --budget"] * 4
    assert all(v["met"] is None for v in report["verdicts"])


def test_preference_layouts_a_reference_in_the_step_holds_a_second_model(tmp_path):
    """XLA's memory analysis of the three preference-step layouts: running the reference inside the step
    adds the frozen copy of the parameters (float32) to the peak, and nothing else of note."""
    from polyalign.model.presets import preset

    result = subprocess.run([sys.executable, str(REPO / "bench" / "preference_step.py"), "--preset", "tiny",
                             "--batch", "2", "--seq", "64", "--vocab-size", "512", "--compile-only"],
                            capture_output=True, text=True, env={**os.environ, "OUT": str(tmp_path)}, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = {r["layout"]: r for r in json.loads((tmp_path / "preference_step.json").read_text())["rows"]}
    ours, fused = rows["one forward, reference precomputed"], rows["one forward, reference in the step"]
    parameter_bytes = 4 * preset("tiny", vocab_size=512).num_parameters()
    extra = (fused["xla_peak_gib"] - ours["xla_peak_gib"]) * 2**30
    assert parameter_bytes * 0.95 <= extra <= parameter_bytes * 1.3
    assert rows["two forwards, reference precomputed"]["xla_peak_gib"] > 0


def test_methods_bench_aggregates_over_seeds_by_hand(tmp_path):
    sys.path.insert(0, str(REPO / "bench"))
    import methods

    people = {"human": {"bng": 0.5, "hcr": 0.9, "f1": None}, "echo_question": {"bng": 0.9, "hcr": 0.4, "f1": 0.2}}
    per_seed = {0: {"sft": {"val_loss": 6.0, "val_worst_bucket": 7.0, "bng": 1.5, "bng_floor": 0.5, "bng_gap": 1.0,
                            "hcr": 0.08, "hcr_floor": 0.9, "f1": 0.02, "bng_by_bucket": {"a": 1.0, "b": 2.0},
                            "detectability": 0.9, "detectability_floor": 0.45, "detectability_by_bucket": {"a": 0.9},
                            "baselines": people},
                    "dpo": {"bng": 5.0, "hcr": None, "f1": 0.04, "bng_by_bucket": {"a": 4.0}}},
                1: {"sft": {"val_loss": 6.2, "val_worst_bucket": 7.4, "bng": 1.7, "bng_floor": 0.7, "bng_gap": 1.0,
                            "hcr": 0.06, "hcr_floor": 0.9, "f1": 0.02, "bng_by_bucket": {"a": 3.0},
                            "detectability": 0.7, "detectability_floor": 0.55,
                            "baselines": {"human": {"bng": 0.7, "hcr": 0.9, "f1": None},
                                          "echo_question": {"bng": 1.1, "hcr": 0.6, "f1": 0.2}}}}}
    summary = methods.aggregate(per_seed)
    assert summary["sft"]["seeds"] == 2 and summary["dpo"]["seeds"] == 1
    assert summary["sft"]["bng"] == {"mean": 1.6, "std": 0.1}
    assert summary["sft"]["val_loss"] == {"mean": 6.1, "std": 0.1}
    assert summary["sft"]["bng_by_bucket"] == {"a": 2.0, "b": 2.0}  # each bucket over the seeds that have it
    assert "hcr" not in summary["dpo"] and "val_loss" not in summary["dpo"]  # nothing measured, nothing claimed
    # people and the no-model answers: one row each, over the seeds
    assert summary["(human)"] == {"seeds": 2, "bng": {"mean": 0.6, "std": 0.1}, "hcr": {"mean": 0.9, "std": 0.0}}
    assert summary["(echo_question)"]["hcr"] == {"mean": 0.5, "std": 0.1}
    text = methods.table(summary)
    assert summary["sft"]["detectability"] == {"mean": 0.8, "std": 0.1}
    assert summary["sft"]["detectability_by_bucket"] == {"a": 0.9}  # seed 1 was evaluated before detectability
    assert "| dpo | 1 | 5.000 ± 0.000 | - | - | - | 0.040 ± 0.000 | - | - |" in text
    assert ("| sft | 2 | 1.600 ± 0.100 | 1.000 ± 0.000 | 0.070 ± 0.010 (0.90) | 0.800 ± 0.100 (0.50) | "
            "0.020 ± 0.000 |") in text
    methods.plot(summary, tmp_path / "methods.png")
    assert (tmp_path / "methods.png").stat().st_size > 5_000


def test_a_bench_preset_is_a_name_or_an_architecture_file(tmp_path):
    import argparse

    from polyalign.model.presets import preset_or_file

    assert preset_or_file("tiny") == "tiny" and preset_or_file(str(TINY_MODEL)) == str(TINY_MODEL)
    for wrong in ("tiny2", str(tmp_path / "missing.yaml"), str(REPO / "README.md")):
        with pytest.raises(argparse.ArgumentTypeError, match="unknown model preset .*tiny.*or a YAML file|no such"):
            preset_or_file(wrong)


def test_the_device_script_keeps_every_finished_stage_when_it_is_killed(tmp_path):
    """bench/device_run.py --smoke-cpu (the H200 script's stages on the CPU): killed while its third stage
    runs, the two before have their rows, logs and summary on disk, and in the two-file bundle (--bundle)
    that a machine handing back few files returns."""
    import signal
    import tarfile
    import time

    out, bundle = tmp_path / "device", tmp_path / "bundle"
    process = subprocess.Popen([sys.executable, str(REPO / "bench" / "device_run.py"), "--smoke-cpu", "--out",
                                str(out), "--bundle", str(bundle)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    summary = out / "summary.md"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not ((bundle / "summary.md").is_file()
                                               and "| matmul |" in (bundle / "summary.md").read_text()):
        time.sleep(0.1)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert sorted(path.name for path in bundle.iterdir() if not path.name.endswith(".partial")) == [
        "device_run.tar.gz", "summary.md"]
    with tarfile.open(bundle / "device_run.tar.gz") as archive:
        names = set(archive.getnames())
        bundled_matmul = json.loads(archive.extractfile("device_run/rows/matmul.json").read())
    assert {"device_run/summary.md", "device_run/logs/backend.log", "device_run/logs/matmul.log"} <= names
    assert bundled_matmul["status"] == "ok"
    backend, matmul = (json.loads((out / "rows" / f"{name}.json").read_text()) for name in ("backend", "matmul"))
    assert backend["status"] == "ok" and backend["result"]["backend"] == "cpu"
    assert matmul["status"] == "ok" and matmul["result"]["tflops"] > 0
    assert (out / "logs" / "matmul.log").is_file()
    assert "| matmul | ok |" in summary.read_text()


def test_the_device_scripts_measuring_stages_run_on_the_cpu(monkeypatch):
    """The device script's own stages (attention values and times, the kernel each layout lowers to, the
    engine's per-step sampling) in their --smoke-cpu form: an H200 run must not be the first to execute
    them. On the CPU every layout lowers to XLA's attention."""
    import importlib

    monkeypatch.syspath_prepend(str(REPO / "bench"))
    device_run = importlib.import_module("device_run")
    attention = device_run.stage_attention(True)
    assert set(attention["cases"]) == {"causal", "mask", "mask+causal"}
    assert all(case["xla_ms"] > 0 and not any(k.endswith("_error") for k in case)
               for case in attention["cases"].values())
    kernels = device_run.stage_kernels(True)
    assert kernels["layouts"] == dict.fromkeys(["rows", "padded rows", "packed rows", "tree-packed pairs"], "xla")
    sampling = device_run.stage_sampling(True)
    timed = {key for key in sampling if key.endswith("_ms")}
    assert timed == {"greedy_ms", "temperature 0.7_ms", "top_p 0.95_ms", "top_k 20, top_p 0.8_ms", "min_p 0.05_ms",
                     "output_projection_ms"} and all(sampling[key] > 0 for key in timed)
    # every stage's row goes into the summary table (the sampling row's "rows" is a count, not a list of rows)
    table = device_run.summary([{"name": name, "status": "ok", "seconds": 1.0, "result": result} for name, result in
                                (("attention", attention), ("kernels", kernels), ("sampling", sampling))])
    assert [line.split(" | ")[0] for line in table.splitlines()[2:]] == ["| attention", "| kernels", "| sampling"]
    assert '"greedy_ms"' in table.splitlines()[-1]


# A GPU machine image may hold the model stack alone (jax, flax, optax, orbax, torch, transformers), with
# no package index to add the rest: polyalign's data and report stack is absent there.
ABSENT_ON_DEVICE = ("grain", "tensorflow_datasets", "array_record", "tensorboardX", "datasketch", "adjustText",
                    "importlib_resources", "mauve", "apache_beam")


def test_the_device_scripts_steps_run_without_the_data_stack(tmp_path):
    """The trainer, LoRA and the engine import, and a step of each method runs, with the data stack's
    packages unimportable: the device script's stages run on a machine that has only the model stack."""
    probe = f"""
import importlib.abc, runpy, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] in {ABSENT_ON_DEVICE!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Absent())
sys.path.insert(0, {str(REPO / 'bench')!r})
import device_run, lora_memory
print("missing:", device_run._missing_modules(device_run.STAGE_MODULES), flush=True)
sys.argv = ["train_step.py", "--preset", {str(TINY_MODEL)!r}, "--dtype", "float32", "--seq", "32", "--batch", "2",
            "--steps", "1", "--stacks", "polyalign"]
runpy.run_path({str(REPO / 'bench' / 'train_step.py')!r}, run_name="__main__")
"""
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path,
                            env={**os.environ, "OUT": str(tmp_path), "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "missing: []" in result.stdout
    rows = json.loads((tmp_path / "train_step.json").read_text())["rows"]
    assert {(row["stack"], row["method"]) for row in rows} == {("polyalign (JAX)", "sft"), ("polyalign (JAX)", "hdpo")}
    assert all(row["tokens_per_s"] > 0 for row in rows)


def test_the_device_scripts_backend_stage_names_a_missing_package_in_one_line(tmp_path):
    """Where polyalign's stages would not import (a package the machine lacks), the backend stage stops the
    run with one line naming the package, before any row is timed."""
    probe = f"""
import importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] == "optax":
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Absent())
sys.path.insert(0, {str(REPO / 'bench')!r})
import device_run
device_run.stage_backend(True)
"""
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 3
    assert result.stdout.strip().splitlines() == [
        "device_run: polyalign's trainer needs optax, not installed on this machine; carry the wheels (bash "
        "bench/device_wheels.sh NAME==VERSION, then carry .whl: docs/gpu.md)"]
