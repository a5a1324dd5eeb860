"""What every logged training step carries besides the loss: tokens/s (per device too), MFU against a
known or configured peak, the trackers of train.report_to, and a profiler trace of train.profile_steps."""

import json
import sys
import types

import pytest

from polyalign.core.yaml_config import ConfigError
from polyalign.model.architecture import from_hf_config
from polyalign.model.flops import flops_per_token, matmul_parameters
from polyalign.model.presets import preset
from polyalign.train.metrics import read_metrics
from polyalign.train.throughput import Throughput, known_peak_tflops
from tests.cli_runs import sft_config


@pytest.mark.parametrize("kind, peak", [
    ("NVIDIA H200", 989.0), ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("TPU v4", 275.0), ("TPU v5 lite", 197.0), ("TPU v5", 459.0),
    ("TPU v5p", 459.0), ("TPU v6 lite", 918.0), ("cpu", None), ("NVIDIA GeForce RTX 4090", None)])
def test_peaks_are_read_from_the_device_kind(kind, peak):
    assert known_peak_tflops(kind) == peak


def test_throughput_and_mfu_by_hand():
    # 4,000 tokens in 2 s on 8 devices of 100 TFLOP/s at 1e9 FLOPs per token
    assert Throughput(8, 1e9, 100.0)(4000, 2.0) == {"tokens_per_s": 2000.0, "tokens_per_s_per_device": 250.0,
                                                    "mfu": 0.0025}  # 2e12 of 8e14 FLOP/s
    assert Throughput(2)(10, 2.0) == {"tokens_per_s": 5.0, "tokens_per_s_per_device": 2.5}  # no peak: no MFU


def test_flops_per_token_by_hand_with_qk_norms():
    cfg = preset("qwen3-0.6b")  # tied head; q/k norms are norms, not matmuls
    norms = 1024 * 2 * 28 + 1024 + 2 * 128 * 28
    assert matmul_parameters(cfg) == 596_049_920 - norms
    attention = 2 * 28 * 16 * 128 * 512  # 12 L H Q T / 6
    assert flops_per_token(cfg, 512) == 6 * (matmul_parameters(cfg) + attention)
    assert flops_per_token(cfg, 512, reference_forward=True) == 8 * (matmul_parameters(cfg) + attention)


def _fake_tracker(name, calls):
    """A stand-in for wandb or trackio that records what polyalign asks of it."""
    def init(**kwargs):
        calls.append(("init", kwargs))
        return module  # wandb returns a run with log/finish; trackio is used through the module

    module = types.ModuleType(name)
    module.init = init
    module.log = lambda scalars, step=None: calls.append(("log", step, dict(scalars)))
    module.finish = lambda: calls.append(("finish",))
    return module


@pytest.mark.slow
def test_logged_steps_carry_throughput_and_reach_every_tracker(built_run, tmp_path, monkeypatch):
    from polyalign.train.run import train

    run, manifest = built_run
    calls = {"wandb": [], "trackio": []}
    for name in calls:
        monkeypatch.setitem(sys.modules, name, _fake_tracker(name, calls[name]))
    config = sft_config(run, 4, "train.report_to=[tensorboard, wandb, trackio]", "train.tracker_project=demo",
                        "train.peak_tflops=0.001", "train.profile_steps=[2, 3]")
    out = tmp_path / "sft"
    train(config, out, progress=False)
    steps = [r for r in read_metrics(out) if "loss" in r]
    model = from_hf_config(json.loads((out / "model" / "config.json").read_text()))
    per_token = flops_per_token(model, manifest["options"]["max_length"])
    for record in steps:
        assert record["tokens_per_s"] > 0 and record["tokens_per_s_per_device"] == record["tokens_per_s"]  # 1 device
        assert record["mfu"] == pytest.approx(record["tokens_per_s"] * per_token / 1e9, rel=1e-3)
    for name, seen in calls.items():
        init = seen[0]
        assert init[0] == "init" and init[1]["project"] == "demo" and init[1]["config"]["method"] == "sft"
        logged = [c for c in seen if c[0] == "log"]
        assert [c[1] for c in logged] == [r["step"] for r in read_metrics(out)]
        assert logged[-1][2]["loss"] == pytest.approx(steps[-1]["loss"]) and "mfu" in logged[-1][2]
        assert seen[-1] == ("finish",)
    assert calls["wandb"][0][1]["resume"] == "allow" and calls["wandb"][0][1]["dir"] == str(out)
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert list((out / "profile").rglob("*.xplane.pb")), "no profiler trace for steps 2-3"


@pytest.mark.parametrize("override, fragment", [
    ("train.report_to=[mlflow]", "train.report_to must be one of tensorboard, wandb, trackio, got 'mlflow'"),
    ("train.profile_steps=[3, 2]", "train.profile_steps: expected [first, last] with 1 <= first <= last"),
    ("train.peak_tflops=0", "train.peak_tflops must be"),
])
def test_bad_tracking_settings_are_named(override, fragment, tmp_path):
    with pytest.raises(ConfigError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        sft_config(tmp_path, 1, override)


def test_a_tracker_without_its_extra_names_the_extra(tmp_path, monkeypatch):
    from polyalign.core.extras import MissingExtra
    from polyalign.train.metrics import MetricsWriter

    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(MissingExtra,
                       match=r"train.report_to: wandb needs the 'wandb' extra: pip install 'polyalign\[wandb\]'"):
        MetricsWriter(tmp_path, ("wandb",))
