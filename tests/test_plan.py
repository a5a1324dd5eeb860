"""`polyalign plan`: memory and token estimates by hand."""

import json

import pytest

from polyalign.cli import main
from polyalign.model.presets import preset
from polyalign.train.plan import estimate
from tests.conftest import REPO


def test_estimate_by_hand():
    model = preset("tiny")  # 6,998,272 parameters, float32
    plan = estimate(model, (2, 2, 1), global_batch=16, micro_batches=2, sequence_length=256)
    n = 6_998_272
    assert plan.parameters == n
    assert plan.param_bytes == n * 4 / 2 and plan.grad_bytes == n * 4 / 2 and plan.optimizer_bytes == n * 8 / 2
    # 16 sequences / 2 micro-batches / (data 2 x fsdp 2) = 2 sequences per device.
    per_layer = 256 * 2 * 256 * (34 + 5 * 8 * 256 / 256) * (4 / 2)
    assert plan.activation_bytes == pytest.approx(4 * per_layer)
    assert plan.logits_bytes == 2 * 2 * 256 * 8000 * 4
    assert plan.tokens_per_step == 16 * 256
    pairs = estimate(model, (1, 1, 1), 8, 1, 128, sequences_per_example=2)
    assert pairs.tokens_per_step == 2 * 8 * 128


@pytest.mark.parametrize("quantize", [None, "nf4", "int8"])
def test_adapter_estimates_by_hand(quantize):
    """With adapters only they have gradients and AdamW moments; the base is counted in the compute
    dtype, its projections at 4.25 / 8.25 bits with quantize."""
    from polyalign.model.architecture import LoraConfig

    model = preset("qwen2.5-1.5b", dtype="bfloat16", param_dtype="bfloat16", lora=LoraConfig(rank=16, alpha=32.0),
                   quantize=quantize)
    d, f, layers, kv = 1536, 8960, 28, 256
    adapters = layers * 16 * ((d + d) + 2 * (d + kv) + (d + d) + 3 * (d + f))
    assert model.adapter_parameters() == adapters == 18_464_768
    projections = layers * (2 * d * d + 2 * d * kv + 3 * d * f)
    assert model.projection_parameters() == projections
    n = 1_543_714_304
    bits = {None: 16, "nf4": 4.25, "int8": 8.25}[quantize]
    base = (n - projections) * 2 + projections * bits / 8
    plan = estimate(model, (1, 2, 1), global_batch=8, micro_batches=1, sequence_length=512)
    assert plan.param_bytes == pytest.approx((base + adapters * 4) / 2)
    assert plan.grad_bytes == adapters * 4 / 2 and plan.optimizer_bytes == adapters * 8 / 2


def test_plan_takes_the_training_overrides(capsys):
    args = ["plan", "--config", str(REPO / "configs" / "hdpo_demo.yaml"), "--devices", "1", "--preset", "qwen2.5-1.5b",
            "--seq", "1024", "model.dtype=bfloat16", "model.remat=full", "model.logprob_chunk=256"]
    assert main(args) == 0
    full = capsys.readouterr().out
    assert main([*args, "model.lora.rank=16", "model.quantize=nf4"]) == 0
    adapted = capsys.readouterr().out
    assert "full fine-tuning" in full
    assert "LoRA r=16 on q,k,v,o,gate,up,down: 18.46M trainable (1.20%), base nf4 (4.25 bits" in adapted

    def total(out):
        return float(next(line for line in out.splitlines() if "total" in line).split()[1])

    assert total(adapted) < 0.3 * total(full)


def test_cli_plans_a_config(capsys):
    args = ["plan", "--config", str(REPO / "configs" / "hdpo_demo.yaml"), "--devices", "8", "--preset",
            "qwen2.5-1.5b", "--seq", "1024", "--device-memory", "16", "parallel.fsdp=8", "parallel.data=1"]
    assert main([*args, "model.dtype=float32"]) == 0
    out = capsys.readouterr().out
    assert "1,543.7M parameters" in out and "tokens per step: 16,384 (16 sequences x 1024)" in out
    assert "compute float32, remat" in out and "does NOT fit in 16 GiB" in out
    # model.dtype auto, planned for 8 devices named on the command line: as on GPUs, in bfloat16 (half
    # the activations: it fits); for this machine's own devices (a CPU), as training would run here
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "compute bfloat16 (model.dtype auto on gpu)" in out and "fits in 16 GiB" in out
    assert main(["plan", "--config", str(REPO / "configs" / "hdpo_demo.yaml"), "--preset", "qwen2.5-1.5b"]) == 0
    assert "compute float32 (model.dtype auto on cpu)" in capsys.readouterr().out


# configs/sizes/<name>.yaml: (devices, model preset, GiB per device, sequence length)
SIZED = {"sft_qwen2.5-1.5b_v5e-16": (16, "qwen2.5-1.5b", 16, 3072),
         "hdpo_qwen2.5-1.5b_8xh100": (8, "qwen2.5-1.5b", 80, 3072),
         "sft_llama3.2-3b_v5p-8": (4, "llama3.2-3b", 95, 3072),
         "hdpo_gemma2-2b_v5e-16": (16, "gemma2-2b", 16, 2048),
         "hdpo_qwen2.5-7b_lora_1xh200": (1, "qwen2.5-7b", 141, 2048),
         "hdpo_qwen2.5-7b_qlora_24gb": (1, "qwen2.5-7b", 24, 1024),
         "hdpo_qwen2.5-7b_v5p-16": (8, "qwen2.5-7b", 95, 2048)}


@pytest.mark.parametrize("name", sorted(SIZED))
def test_sized_configs_fit_their_hardware(name):
    from polyalign.train.plan import plan_config

    devices, model, gib, seq = SIZED[name]
    plan = plan_config(REPO / "configs" / "sizes" / f"{name}.yaml", [], devices, seq, model)
    assert plan.mesh[0] * plan.mesh[1] * plan.mesh[2] == devices
    assert plan.total_bytes < 0.9 * gib * 1024 ** 3
    assert plan.tokens_per_step >= 32 * seq  # the reference's effective batch: 64 sequences or 32 pairs


def test_a_preset_model_is_planned_with_the_builds_vocabulary_and_length(built_run, tmp_path, capsys):
    """SFT from a preset trains on the build's tokenizer (its vocabulary, not the preset's) at the build's
    max_length: the plan sizes that model. The build here is the demo's with a 6,000-piece tokenizer."""
    build = json.loads((built_run[0] / "build" / "manifest.json").read_text())
    build["vocab_size"] = 6000  # the quick demo's tokenizer; the tiny preset has 8,000
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "manifest.json").write_text(json.dumps(build))
    assert preset("tiny").vocab_size == 8000
    assert main(["plan", "--config", str(REPO / "configs" / "sft_demo.yaml"), "--devices", "1",
                 f"data.dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "vocab 6000)" in out and f"x {build['options']['max_length']})" in out
    assert f"{preset('tiny', vocab_size=6000).num_parameters() / 1e6:,.1f}M parameters" in out
