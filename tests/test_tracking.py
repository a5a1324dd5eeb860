"""What every logged training step carries besides the loss: tokens/s (per device too), MFU against a
known or configured peak, the trackers of train.report_to, and a profiler trace of train.profile_steps."""

import dataclasses
import json
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from polyalign.core.yaml_config import ConfigError
from polyalign.model.architecture import from_hf_config
from polyalign.model.flops import dense_step_flops, flops_per_token, matmul_parameters
from polyalign.model.presets import preset
from polyalign.train.metrics import read_metrics
from polyalign.train.throughput import Throughput, known_peak_tflops
from tests.cli_runs import sft_config


@pytest.mark.parametrize("kind, peak", [
    ("NVIDIA H200", 989.0), ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("TPU v4", 275.0), ("TPU v5 lite", 197.0), ("TPU v5", 459.0),
    ("TPU v5p", 459.0), ("TPU v6 lite", 918.0), ("cpu", None), ("NVIDIA GeForce RTX 4090", None),
    # NVL parts are not their SXM namesakes; a kind that merely contains a listed one is not it
    ("NVIDIA H200 NVL", 835.0), ("NVIDIA H100 NVL", 835.0), ("NVIDIA H200 Max-Q (made up)", None)])
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
    keys = 28 * 512 * 513 // 2  # causal: position i of the row sees i + 1 keys, in each of 28 layers
    n = matmul_parameters(cfg)
    assert flops_per_token(cfg, 512) == (6 * n * 512 + 3 * 4 * 16 * 128 * keys) / 512
    assert flops_per_token(cfg, 512, reference_forward=True) == (8 * n * 512 + 4 * 4 * 16 * 128 * keys) / 512
    # the PaLM count charges every query all 512 keys: 12 L H Q T per token
    assert dense_step_flops(cfg, 3, 512) == 3 * 512 * (6 * n + 12 * 28 * 16 * 128 * 512)


def test_flops_count_what_each_layout_and_method_runs():
    """Packed segments see only their own keys, a sliding window caps them, a frozen base under adapters
    has no weight gradient, and the adapters count as trained weights: by hand on small numbers."""
    from polyalign.model.architecture import LoraConfig
    from polyalign.model.flops import attended_keys, step_flops

    assert attended_keys([4]) == 1 + 2 + 3 + 4 and attended_keys([4, 2]) == 10 + 3
    assert attended_keys([5], window=2) == 1 + 2 + 2 + 2 + 2
    cfg = preset("qwen2.5-0.5b")
    n, hq = matmul_parameters(cfg), 14 * 64
    packed = step_flops(cfg, [300, 200, 12])
    assert packed == 6 * n * 512 + 3 * 4 * hq * 24 * (300 * 301 + 200 * 201 + 12 * 13) // 2
    assert packed < step_flops(cfg, [512])  # the same tokens as one sequence attend to more keys
    # a tree-packed pair (prompt 10, responses 4 and 6) sees what its two sequences see, prompt once
    assert step_flops(cfg, [(10, [4, 6])]) == 6 * n * 20 + 3 * 4 * hq * 24 * (
        attended_keys([14]) + attended_keys([16]) - attended_keys([10]))
    gemma = preset("gemma3-1b")  # five sliding layers of 512 in every six
    sliding = sum(gemma.sliding_layers)
    assert step_flops(gemma, [1000]) == (6 * matmul_parameters(gemma) * 1000 + 12 * 4 * 256 * (
        sliding * attended_keys([1000], 512) + (26 - sliding) * attended_keys([1000])))
    lora = dataclasses.replace(cfg, lora=LoraConfig(rank=8, targets=("q", "down")))
    assert lora.adapter_parameters() == 24 * 8 * ((896 + 896) + (4864 + 896))
    attention = 3 * 4 * hq * 24 * 64 * 65 // 2
    assert step_flops(lora, [64]) == (4 * n + 6 * lora.adapter_parameters()) * 64 + attention
    # the in-step reference is the base with the adapters off: a forward pass of the base
    assert step_flops(lora, [64], reference_forward=True) == (
        (6 * n + 6 * lora.adapter_parameters()) * 64 + attention * 4 // 3)


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
    ("train.profile_steps=[3, 2]",
     "override train.profile_steps=[3, 2]: expected [first, last] with 1 <= first <= last"),
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


@pytest.mark.parametrize("layout", ["rows", "packed", "trees", "lora", "reference", "lora_reference"])
def test_the_dense_flop_count_agrees_with_xla_cost_analysis(layout):
    """dense_step_flops (every position and every key of a row, as XLA's attention computes them) against
    XLA's own count of the compiled step, value and gradient: within 3%, the elementwise work XLA counts
    and the model does not (norms, softmax, rotary). Adapters: the frozen base gets no weight gradient
    (XLA also skips the first layer's input gradient, which the model counts). Reference: a frozen
    forward pass of the base in the step, as `reference: in_step` runs."""
    from flax import nnx

    from polyalign.model import create_model, family_defaults
    from polyalign.model.architecture import LoraConfig
    from polyalign.model.lora import base_model

    adapters = layout.startswith("lora")
    cfg = family_defaults("llama", vocab_size=1024, hidden_size=256, intermediate_size=704, num_layers=2,
                          num_heads=8, num_kv_heads=4, head_dim=32, scan_layers=False,
                          lora=LoraConfig(rank=8) if adapters else None)
    rows, length = 2, 128
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 1024, (rows, length + 1)), jnp.int32)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    position = np.arange(length)
    masking = {"rows": {},
               "packed": {"segment_ids": jnp.asarray(np.broadcast_to(1 + (position >= 50), (rows, length)))},
               "trees": {"segment_ids": jnp.ones((rows, length), jnp.int32),
                         "branch_ids": jnp.asarray(np.broadcast_to((position >= 40) + (position >= 90),
                                                                   (rows, length)))},
               }.get(layout, {})
    reference = layout.endswith("reference")
    model = create_model(cfg)
    graphdef, trained, rest = nnx.split(model, nnx.LoRAParam if adapters else nnx.Param, ...)

    def objective(trained, rest):
        policy = nnx.merge(graphdef, trained, rest)
        total = policy.token_log_probs(inputs, targets, **masking).sum()
        if reference:
            total += jax.lax.stop_gradient(base_model(policy).token_log_probs(inputs, targets).sum())
        return total

    analysis = jax.jit(jax.value_and_grad(objective)).lower(trained, rest).compile().cost_analysis()
    xla = (analysis[0] if isinstance(analysis, list) else analysis)["flops"]
    assert xla == pytest.approx(dense_step_flops(cfg, rows, length, reference_forward=reference), rel=0.03)
