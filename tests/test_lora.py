"""LoRA: adapters on a frozen base. Exact at the start, gradients equal to the dense formula, only
adapters trained and saved, the reference as the base with adapters off, the training invariances,
and the PEFT and merged exports."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from polyalign.mesh import parallel
from polyalign.model import create_model, family_defaults, load_hf_checkpoint, save_hf_checkpoint
from polyalign.model.architecture import LORA_TARGETS, LoraConfig, ModelConfigError
from polyalign.model.lora import add_adapters, base_model, merge_adapters
from polyalign.train.config import LoopConfig, OptimizerConfig
from polyalign.train.methods import load_config
from polyalign.train.metrics import read_metrics
from polyalign.train.ownership import RUN_FILES
from polyalign.train.run import train as train_sft
from polyalign.train.sft import SftObjective
from polyalign.train.trainer import Trainer
from tests.conftest import REPO, TINY_MODEL, tiny_model_config
from tests.train_checks import adapted_model, first_batch, gradients_of_first_batch

WORKER = REPO / "tests" / "train_worker.py"
RANK, ALPHA = 4, 8.0


def _pure(state) -> dict:
    from flax import traverse_util

    return traverse_util.flatten_dict(nnx.to_pure_dict(state), sep=".")


@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
@pytest.mark.parametrize("scan", [True, False])
def test_fresh_adapters_leave_the_logits_exactly_as_they_were(family, scan):
    cfg = family_defaults(family, vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=8, scan_layers=scan)
    base = create_model(cfg, seed=1)
    adapted = add_adapters(base, LoraConfig(rank=RANK, alpha=ALPHA), seed=3)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 97, (2, 24)), jnp.int32)
    np.testing.assert_array_equal(np.asarray(adapted(ids)), np.asarray(base(ids)))
    shapes = {k: v.shape for k, v in _pure(nnx.state(adapted, nnx.LoRAParam)).items()}
    assert len(shapes) == 2 * len(LORA_TARGETS)
    assert shapes["layers.self_attn.q_proj.lora_a"] == (2, 32, RANK)
    assert shapes["layers.self_attn.k_proj.lora_b"] == (2, RANK, 16)  # 2 key/value heads of 8
    assert shapes["layers.mlp.down_proj.lora_a"] == (2, 64, RANK)
    adapters = _pure(nnx.state(adapted, nnx.LoRAParam))
    assert all(not v.any() for k, v in adapters.items() if k.endswith("lora_b"))  # B starts at zero
    bound = 1 / np.sqrt(32)  # PEFT's kaiming init of A: uniform within 1/sqrt(fan_in)
    a = np.asarray(adapters["layers.self_attn.q_proj.lora_a"])
    assert np.abs(a).max() <= bound and np.abs(a).max() > 0.9 * bound


def test_adapters_shard_with_their_projection_and_replicate_the_rank():
    cfg = dataclasses.replace(tiny_model_config(97), lora=LoraConfig(rank=RANK))
    from polyalign.model import abstract_model

    shardings = _pure(parallel.param_shardings(nnx.state(abstract_model(cfg)), parallel.make_mesh()))
    for name in ("self_attn.q_proj", "mlp.down_proj"):
        kernel = shardings[f"layers.{name}.kernel"].spec
        assert tuple(shardings[f"layers.{name}.lora_a"].spec) == (kernel[0], kernel[1], None)
        assert tuple(shardings[f"layers.{name}.lora_b"].spec) == (kernel[0], None, kernel[2])


def test_bad_adapter_settings_are_named():
    with pytest.raises(ModelConfigError, match="targets"):
        LoraConfig(targets=("q", "qkv"))
    with pytest.raises(ModelConfigError, match="rank"):
        LoraConfig(rank=0)
    from polyalign.core.yaml_config import ConfigError

    with pytest.raises(ConfigError, match=r"model.lora.targets.*got \['q', 'x'\]"):
        load_config(REPO / "configs" / "sft_demo.yaml", ["model.lora.rank=8", "model.lora.targets=[q, x]"])
    with pytest.raises(ConfigError, match="model.lora.init"):
        load_config(REPO / "configs" / "sft_demo.yaml", ["model.lora.rank=8", "model.lora.init=normal"])
    with pytest.raises(ConfigError, match="override model.quantize=nf4: a quantised base is frozen.*model.lora.rank"):
        load_config(REPO / "configs" / "sft_demo.yaml", ["model.quantize=nf4"])
    with pytest.raises(ConfigError, match="model.quantize must be one of null, nf4, int8"):
        load_config(REPO / "configs" / "sft_demo.yaml", ["model.lora.rank=8", "model.quantize=fp4"])
    with pytest.raises(ConfigError, match="model.lora.critic|critic trains its head"):
        load_config(REPO / "configs" / "critic_demo.yaml", ["model.lora.rank=8"])
    config = load_config(REPO / "configs" / "sft_demo.yaml", ["model.lora.rank=16"])
    assert config.model.lora.to_model() == LoraConfig(rank=16, alpha=32.0)
    assert load_config(REPO / "configs" / "sft_demo.yaml").model.lora.to_model() is None  # rank 0: full tuning


def _dense_sft_loss(base, adapters: dict, batch, scale: float):
    """Bucket-SFT's loss of the plain base model whose kernels are W + scale A B: LoRA's definition,
    with no LoRA code."""
    graphdef, state = nnx.split(base)
    pure = nnx.to_pure_dict(state)
    for target in LORA_TARGETS.values():
        block, projection = target.split(".")
        node = pure["layers"][block][projection]
        a, b = adapters[f"layers.{target}.lora_a"], adapters[f"layers.{target}.lora_b"]
        node["kernel"] = node["kernel"] + scale * jnp.einsum("lir,lro->lio", a, b)
    nnx.replace_by_pure_dict(state, pure)
    model = nnx.merge(graphdef, state)
    ids, targets, mask = (jnp.asarray(batch[k][0]) for k in ("input_ids", "targets", "loss_mask"))
    logp = jax.nn.log_softmax(model(ids), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
    per_example = (nll * mask).sum(-1) / jnp.maximum(mask.sum(-1), 1)
    weight = jnp.asarray(batch["weight"][0] * batch["valid"][0])
    return (weight * per_example).sum() / weight.sum()


def test_adapter_gradients_equal_the_dense_formula_and_nothing_else_is_trained(built_run):
    run, manifest = built_run
    batch, _ = first_batch(run, 8, 1)
    model = adapted_model(manifest["vocab_size"], RANK)
    trainer = Trainer(model, SftObjective(len(manifest["buckets"])), OptimizerConfig(warmup_ratio=0.0),
                      LoopConfig(steps=2, global_batch=8), parallel.make_mesh())
    grads, loss, _ = trainer.gradients(batch)
    grads = _pure(jax.device_get(grads))
    assert sorted(grads) == sorted(f"layers.{t}.lora_{x}" for t in LORA_TARGETS.values() for x in "ab")

    adapters = {k: jnp.array(v) for k, v in _pure(nnx.state(model, nnx.LoRAParam)).items()}  # copies: the step donates
    base = create_model(tiny_model_config(manifest["vocab_size"]), seed=0)
    want_loss, want = jax.value_and_grad(lambda a: _dense_sft_loss(base, a, batch, ALPHA / RANK))(adapters)
    assert float(loss) == pytest.approx(float(want_loss), abs=1e-5)
    for name, value in want.items():
        assert np.abs(value).max() > 1e-6, name  # every adapter has a gradient to compare
        np.testing.assert_allclose(grads[name], value, atol=2e-6, err_msg=name)

    # Optimizer state: AdamW's two moments of the adapters and step counts, no more.
    adapter_size = sum(v.size for v in adapters.values())
    moments = sum(x.size for x in jax.tree.leaves(trainer.state["opt_state"]) if x.ndim > 0)
    assert moments == 2 * adapter_size
    frozen_before = {k: np.asarray(v) for k, v in _pure(trainer.frozen).items()}
    trainer.step(batch)
    assert all(np.array_equal(np.asarray(v), frozen_before[k]) for k, v in _pure(trainer.frozen).items())
    after = _pure(jax.device_get(trainer.state["params"]))
    assert all(not np.array_equal(after[k], np.asarray(adapters[k])) for k in adapters)  # every adapter moved


def test_adapter_gradients_are_the_same_for_one_two_and_four_micro_batches(built_run, tmp_path):
    run, _ = built_run
    results = {m: gradients_of_first_batch(run, tmp_path / f"m{m}.safetensors", m, 8, lora_rank=RANK)
               for m in (1, 2, 4)}
    assert all(name.endswith(("lora_a", "lora_b")) for name in results[1] if name != "loss")
    for m in (2, 4):
        assert abs(float(results[m]["loss"][0]) - float(results[1]["loss"][0])) <= 1e-5
        for name, value in results[1].items():
            np.testing.assert_allclose(results[m][name], value, rtol=1e-5, atol=1e-6,
                                       err_msg=f"{m} micro-batches: {name}")


@pytest.mark.slow
def test_adapter_gradients_are_the_same_on_eight_devices(built_run, tmp_path):
    run, _ = built_run
    one = gradients_of_first_batch(run, tmp_path / "one.safetensors", 2, 16, lora_rank=RANK)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for sizes in (("8", "1", "1"), ("2", "2", "2")):
        out = tmp_path / f"eight-{'-'.join(sizes)}.safetensors"
        subprocess.run([sys.executable, str(WORKER), "grads", str(run), str(out), "--devices", "8", "--data", sizes[0],
                        "--fsdp", sizes[1], "--tensor", sizes[2], "--micro", "2", "--global-batch", "16",
                        "--lora-rank", str(RANK)], check=True, env=env, timeout=300)
        got = load_file(str(out))
        assert abs(float(got["loss"][0]) - float(one["loss"][0])) <= 1e-5
        for name, value in one.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6, err_msg=f"mesh {sizes}: {name}")


def test_the_reference_is_the_base_with_adapters_off(built_run):
    """base_model() of an adapted model (trained adapters, B non-zero) computes exactly what a separate
    copy of the base computes, holding the same arrays rather than a copy."""
    from polyalign.train.preference import reference_logps

    _, manifest = built_run
    vocab = manifest["vocab_size"]
    adapted = adapted_model(vocab, RANK)
    copy = create_model(tiny_model_config(vocab), seed=0)
    reference = base_model(adapted)
    assert not nnx.state(reference, nnx.LoRAParam)
    kernel = adapted.layers.self_attn.q_proj.kernel
    assert reference.layers.self_attn.q_proj.kernel[...] is kernel[...]  # shared, not copied
    rng = np.random.default_rng(3)
    examples = []
    for n, m in ((5, 7), (12, 3), (8, 8)):
        prompt = rng.integers(3, vocab, 9)
        example = {"id": f"p{n}", "bucket": 0, "weight": 1.0, "critic_chosen": 0.0, "critic_rejected": 0.0}
        for side, length in (("chosen", n), ("rejected", m)):
            example[f"{side}_ids"] = np.r_[prompt, rng.integers(3, vocab, length)].astype(np.int32)
            example[f"{side}_mask"] = np.r_[np.zeros(9), np.ones(length)].astype(bool)
        examples.append(example)
    ids = jnp.asarray(rng.integers(0, vocab, (2, 20)), jnp.int32)
    np.testing.assert_array_equal(np.asarray(reference(ids)), np.asarray(copy(ids)))
    assert np.abs(np.asarray(adapted(ids)) - np.asarray(copy(ids))).max() > 1e-3  # the adapters do change it
    with_copy = [dict(e) for e in examples]
    with_base = [dict(e) for e in examples]
    reference_logps(copy, with_copy, 32, 0, batch_size=2, progress=False)
    reference_logps(reference, with_base, 32, 0, batch_size=2, progress=False)
    assert [(e["ref_chosen"], e["ref_rejected"]) for e in with_base] == \
        [(e["ref_chosen"], e["ref_rejected"]) for e in with_copy]


def _config(run, steps, *extra):
    return load_config(REPO / "configs" / "sft_demo.yaml", [
        f"data.dir={run}", f"train.steps={steps}", "train.global_batch=8", "train.eval_every=4",
        "train.checkpoint_every=2", "data.eval_limit=32", "data.eval_batch=16", f"model.lora.rank={RANK}",
        f"model.lora.alpha={ALPHA}", "model.lora.dropout=0.1", "optimizer.lr=0.01", f"model.preset={TINY_MODEL}",
        *extra])


def test_a_lora_run_checkpoints_adapters_only_resumes_exactly_and_exports_both_ways(built_run, tmp_path):
    """With adapter dropout, whose masks come from the trainer's key stream, so that the resumed run
    must draw what the unbroken one drew."""
    run, manifest = built_run
    straight = train_sft(_config(run, 6), tmp_path / "straight", progress=False)
    train_sft(_config(run, 6, "train.stop_at=3"), tmp_path / "resumed", progress=False)
    resumed = train_sft(_config(run, 6), tmp_path / "resumed", progress=False)
    assert resumed["start_step"] == 3 and resumed["end_step"] == 6
    first, again = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    for a, b in zip(first[3:], [r for r in again if r["step"] > 3]):
        assert a["step"] == b["step"] and abs(a["loss"] - b["loss"]) <= 1e-6, (a, b)
    assert first[-1]["loss"] < first[0]["loss"]  # the adapters learn

    # The checkpoint holds the adapters and their optimizer state: a fraction of the model.
    full = train_sft(load_config(REPO / "configs" / "sft_demo.yaml", [
        f"data.dir={run}", "train.steps=2", "train.global_batch=8", "train.checkpoint_every=2",
        "data.eval_limit=32", "data.eval_batch=16", f"model.preset={TINY_MODEL}"]), tmp_path / "full", progress=False)
    assert full["end_step"] == 2

    def size(folder):
        return sum(f.stat().st_size for f in (folder / "checkpoints").rglob("*") if f.is_file())

    print(f"\ncheckpoint bytes: LoRA r={RANK} {size(tmp_path / 'straight')}, full {size(tmp_path / 'full')}")
    assert size(tmp_path / "straight") < 0.5 * size(tmp_path / "full")

    # Exports: PEFT's adapter folder and the merged model, which equal the adapted model.
    out = tmp_path / "straight"
    # everything a run writes is what --overwrite removes (a stale adapter stayed beside a new full model)
    for folder in (out, tmp_path / "full"):
        assert {path.name for path in folder.iterdir()} <= set(RUN_FILES), sorted(os.listdir(folder))
    assert straight["adapter"] == str(out / "adapter")
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == RANK and config["lora_alpha"] == ALPHA and config["peft_type"] == "LORA"
    # the adapter folder carries the model's tokenizer (AutoPeftModelForCausalLM reads it there, not the network)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / "adapter" / name).read_bytes() == (out / "model" / name).read_bytes(), name
    assert sorted(config["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                                "v_proj"]
    tensors = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    shape = json.loads((out / "model" / "config.json").read_text())
    width = shape["hidden_size"]
    assert len(tensors) == 2 * 7 * shape["num_hidden_layers"]  # (A, B) x targets x layers
    a = tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"]
    b = tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"]
    assert a.shape == (RANK, width) and b.shape == (width, RANK) and np.abs(b).max() > 0

    merged = load_hf_checkpoint(out / "model")
    assert merged.config.lora is None
    # PEFT's rule on transformers' layout, W [out, in] + (alpha / r) B A, from the untouched base: the
    # base is the from-scratch model of model.seed, frozen.
    save_hf_checkpoint(create_model(merged.config, seed=0, mesh=parallel.make_mesh()), tmp_path / "base")
    base_weights = load_file(str(tmp_path / "base" / "model.safetensors"))
    merged_weights = load_file(str(out / "model" / "model.safetensors"))
    name = "model.layers.1.self_attn.q_proj.weight"
    np.testing.assert_allclose(merged_weights[name], base_weights[name] + ALPHA / RANK * b @ a, atol=1e-6)
    assert np.array_equal(merged_weights["model.embed_tokens.weight"], base_weights["model.embed_tokens.weight"])


def test_merging_adapters_gives_the_adapted_model():
    model = adapted_model(97, RANK)
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 97, (2, 16)), jnp.int32)
    merged = merge_adapters(model)
    assert merged.config.lora is None and not nnx.state(merged, nnx.LoRAParam)
    np.testing.assert_allclose(np.asarray(merged(ids)), np.asarray(model(ids)), atol=2e-5)


@pytest.mark.slow
def test_hdpo_with_adapters_precomputed_and_in_step_references_train_alike(demo_run, demo_tokenizer, tmp_path):
    """HDPO on real pairs with adapters: the reference precomputed from the base with adapters off, or
    computed in every step from the same base, gives the same run; the first step sits at the
    reference (margin 0) and the run writes the adapter folder beside the merged model."""
    from polyalign.train.run import train as train_preference
    from tests.real_inputs import init_checkpoint_and_pair_files

    init_checkpoint_and_pair_files(demo_run, demo_tokenizer[0], tmp_path, train=16, val=4)
    runs = {}
    for reference in ("precomputed", "in_step"):
        config = load_config(REPO / "configs" / "hdpo_demo.yaml", [
            f"init={tmp_path / 'init'}", f"pairs={tmp_path / 'train.jsonl'}", f"val_pairs={tmp_path / 'val.jsonl'}",
            "max_length=128", "train.steps=3", "train.global_batch=4", "train.eval_every=3", "optimizer.lr=0.01",
            "train.checkpoint_every=3", "drift_prompts=0", f"model.lora.rank={RANK}", f"reference={reference}"])
        result = train_preference(config, tmp_path / reference, progress=False)
        assert (tmp_path / reference / "adapter" / "adapter_model.safetensors").is_file() and result["adapter"]
        assert {path.name for path in (tmp_path / reference).iterdir()} <= set(RUN_FILES)
        runs[reference] = [r for r in read_metrics(tmp_path / reference) if "loss" in r]
    first, second = runs["precomputed"], runs["in_step"]
    assert abs(first[0]["rewards/margin"]) < 1e-6 and abs(second[0]["rewards/margin"]) < 1e-6
    assert abs(first[-1]["rewards/margin"]) > 1e-4  # the adapters moved the policy off the reference
    for a, b in zip(first, second):
        for key in ("loss", "rewards/margin", "rewards/chosen", "val_rewards/margin"):
            if key in a:
                assert abs(a[key] - b[key]) <= 1e-5, (a["step"], key, a[key], b[key])


def test_an_in_step_reference_needs_adapters():
    from polyalign.core.yaml_config import ConfigError

    with pytest.raises(ConfigError, match="in_step.*model.lora.rank"):
        load_config(REPO / "configs" / "hdpo_demo.yaml", ["reference=in_step"])
    assert load_config(REPO / "configs" / "hdpo_demo.yaml", ["reference=in_step", "model.lora.rank=8"])


@pytest.mark.slow
def test_adapters_train_alike_on_two_processes_and_on_one(built_run, tmp_path):
    """LoRA SFT on two processes of two CPU devices (jax.distributed, gloo) equals one process with
    four devices step by step, and both export the same adapters."""
    from polyalign.mesh.launch import free_port, start_variables
    from tests.cli_runs import start_cli, train_args, wait_ok

    run, _ = built_run
    lora = ("parallel.data=2", "parallel.fsdp=2", f"model.lora.rank={RANK}", "optimizer.lr=0.01")
    wait_ok([start_cli(train_args(run, tmp_path / "one", *lora), {}, devices=4)])
    port = free_port()
    wait_ok([start_cli(train_args(run, tmp_path / "two", *lora), start_variables(port, 2, i), devices=2)
             for i in range(2)])
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert [r["step"] for r in two] == list(range(1, 7))
    for a, b in zip(one, two):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a["step"], a["loss"], b["loss"])
    adapters = [load_file(str(tmp_path / r / "adapter" / "adapter_model.safetensors")) for r in ("one", "two")]
    assert adapters[0].keys() == adapters[1].keys()
    # Adam divides each update by the gradient's own scale, so where a gradient is ~0 its last bits
    # (a different reduction order) move a weight by up to ~lr x 1e-3 a step: 6e-5 over these 6 steps.
    for name, array in adapters[0].items():
        np.testing.assert_allclose(adapters[1][name], array, atol=6e-5, err_msg=name)


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_quantised_kernels_by_hand(kind):
    """Blocks of 64 input rows per output column scaled by their absolute maximum: values on the
    grid come back exactly, others to the nearest level; the storage is 4.25 / 8.25 bits a weight."""
    from polyalign.model import quantize as quant

    rng = np.random.default_rng(0)
    levels = quant.NF4_LEVELS if kind == "nf4" else np.arange(-127, 128) / 127
    on_grid = rng.choice(levels, (128, 3)).astype(np.float32)
    on_grid[0] = 1.0  # each block's maximum is 1 x its scale
    on_grid[64] = -1.0
    scale = np.array([0.5, 0.25, 2.0], np.float32)  # exact in bfloat16
    kernel = jnp.asarray(on_grid * scale)
    codes, block_max = quant.quantize(kernel, kind)
    assert codes.shape == ((64, 3) if kind == "nf4" else (128, 3)) and block_max.shape == (2, 3)
    # (k / 127 rounds in float32: equal to the last bit)
    np.testing.assert_allclose(np.asarray(quant.dequantize(codes, block_max, kind, jnp.float32)), on_grid * scale,
                               rtol=2e-7, atol=0)
    bits = (codes.size * codes.dtype.itemsize + block_max.size * block_max.dtype.itemsize) * 8 / kernel.size
    assert bits == quant.bits_per_weight(kind) == (4.25 if kind == "nf4" else 8.25)

    # An input size that is not whole blocks (Llama-style 688-wide MLPs): zero rows pad the last block.
    uneven = jnp.asarray(on_grid[:100] * scale)
    codes, block_max = quant.quantize(uneven, kind)
    assert block_max.shape == (2, 3)
    np.testing.assert_allclose(np.asarray(quant.dequantize(codes, block_max, kind, jnp.float32, 100)),
                               on_grid[:100] * scale, rtol=2e-7, atol=0)

    off_grid = jnp.asarray(rng.normal(0, 0.02, (256, 8)), jnp.float32)
    codes, block_max = quant.quantize(off_grid, kind)
    got = np.asarray(quant.dequantize(codes, block_max, kind, jnp.float32))
    blocks = np.asarray(off_grid).reshape(4, 64, 8)
    absmax = np.asarray(jnp.asarray(np.abs(blocks).max(1), jnp.bfloat16).astype(jnp.float32))
    normalised = blocks / absmax[:, None]
    nearest = levels[np.abs(normalised[..., None] - levels).argmin(-1)]
    np.testing.assert_allclose(got, (nearest * absmax[:, None]).reshape(256, 8), atol=1e-7)


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_a_quantised_base_with_fresh_adapters_computes_its_dequantised_model(kind):
    """QLoRA at step 0: the model equals the plain model whose kernels are the dequantised ones, and
    stays close to the unquantised base (int8 much closer than NF4)."""
    cfg = family_defaults("qwen2", vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=16)
    from polyalign.model.lora import quantize_base

    base = create_model(cfg, seed=1)
    qlora = add_adapters(quantize_base(base, kind), LoraConfig(rank=RANK, alpha=ALPHA), seed=2)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 97, (2, 16)), jnp.int32)
    plain = merge_adapters(qlora)
    assert plain.config.quantize is None and plain.layers.mlp.up_proj.kernel[...].dtype == jnp.float32
    # equal up to the order XLA sums in once it fuses the dequantisation into the product
    np.testing.assert_allclose(np.asarray(qlora(ids)), np.asarray(plain(ids)), atol=1e-6)
    codes = qlora.layers.self_attn.q_proj.kernel_codes[...]
    assert codes.dtype == (jnp.uint8 if kind == "nf4" else jnp.int8)
    drift = float(jnp.abs(qlora(ids) - base(ids)).max()) / float(jnp.abs(base(ids)).max())
    assert 0 < drift < (0.2 if kind == "nf4" else 0.02), drift
    np.testing.assert_array_equal(np.asarray(base_model(qlora)(ids)), np.asarray(qlora(ids)))  # B = 0


@pytest.mark.slow
def test_qlora_trains_from_a_checkpoint_and_exports(built_run, demo_tokenizer, tmp_path):
    """`model.quantize=nf4 model.lora.rank=4` from an init checkpoint: the step trains the adapters on
    the NF4 base, and OUT/model holds the dequantised base plus the adapters."""
    run, manifest = built_run
    files = demo_tokenizer[0].path.parent
    tokenizer_files = {name: (files / name).read_bytes() for name in ("tokenizer.model", "tokenizer_config.json")}
    init = create_model(tiny_model_config(manifest["vocab_size"], hidden_size=64, head_dim=16), seed=0)
    save_hf_checkpoint(init, tmp_path / "init", extra_files=tokenizer_files)
    result = train_sft(_config(run, 4, f"init={tmp_path / 'init'}", "model.quantize=nf4", "train.eval_every=2"),
                       tmp_path / "out", progress=False)
    # Validation reads the same examples each time, so its fall is the adapters' doing, where training
    # losses of different batches differ by more than four steps move them.
    evals = [r["val_loss"] for r in read_metrics(tmp_path / "out") if "val_loss" in r]
    assert result["end_step"] == 4 and len(evals) == 2 and evals[1] < evals[0]
    merged = load_hf_checkpoint(tmp_path / "out" / "model")
    from polyalign.model import quantize as quant

    q = load_file(str(tmp_path / "init" / "model.safetensors"))["model.layers.0.mlp.gate_proj.weight"]
    dequantised = np.asarray(quant.dequantize(*quant.quantize(jnp.asarray(q.T), "nf4"), "nf4", jnp.float32)).T
    adapter = load_file(str(tmp_path / "out" / "adapter" / "adapter_model.safetensors"))
    a = adapter["base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight"]
    b = adapter["base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight"]
    got = load_file(str(tmp_path / "out" / "model" / "model.safetensors"))["model.layers.0.mlp.gate_proj.weight"]
    np.testing.assert_allclose(got, dequantised + ALPHA / RANK * b @ a, atol=1e-6)
    assert merged.config.quantize is None and merged.config.lora is None
    # both cards say the adapter learned against the NF4 base, which only OUT/model holds
    card = (tmp_path / "out" / "model" / "README.md").read_text()
    assert "| frozen base | quantised to nf4 in training (QLoRA); this folder's weights are that base, " \
        "dequantised, with the adapter merged: what was trained |" in card
    assert "| adapters | LoRA rank 4, alpha " in card and "merged into this folder's weights" in card
    adapter_card = (tmp_path / "out" / "adapter" / "README.md").read_text()
    assert "**The base was quantised to nf4 in training (QLoRA).**" in adapter_card
    assert "`../model` is what was trained" in adapter_card and "frozen base |" not in adapter_card


def test_an_adapter_peft_made_gives_peft_logits_and_our_export_reads_back(tmp_path):
    """tests/fixtures/peft/qwen2 was saved by PEFT (tools/make_fixtures.py --peft) on the qwen2 fixture,
    with its logits: the same names, layouts and alpha / r scale in polyalign give them; polyalign's own
    export of those adapters reads back to the same model."""
    from polyalign.core.errors import CheckpointError
    from polyalign.model.export import export_adapter
    from polyalign.model.lora import load_adapter
    from tests.conftest import FIXTURES

    expected = load_file(str(FIXTURES / "peft" / "qwen2" / "expected.safetensors"))
    base = load_hf_checkpoint(FIXTURES / "hf" / "qwen2")
    adapted = load_adapter(base, FIXTURES / "peft" / "qwen2")
    assert adapted.config.lora == LoraConfig(rank=4, alpha=8.0)
    real = expected["attention_mask"].astype(bool)
    got = np.asarray(adapted(expected["input_ids"], attention_mask=expected["attention_mask"]))
    assert np.abs(got - expected["logits"])[real].max() < 1e-4
    plain = np.asarray(base(expected["input_ids"], attention_mask=expected["attention_mask"]))
    assert np.abs(plain - expected["logits"])[real].max() > 1.0  # the adapter matters

    export_adapter(adapted, tmp_path / "adapter", base=str(FIXTURES / "hf" / "qwen2"))
    again = load_adapter(base, tmp_path / "adapter")
    np.testing.assert_array_equal(np.asarray(again(expected["input_ids"])), np.asarray(adapted(expected["input_ids"])))
    assert "rounded to" not in (tmp_path / "adapter" / "README.md").read_text()  # merged in float32: exact
    # merged weights exported in bfloat16 differ from base + adapter by that rounding: the README says so
    export_adapter(adapted, tmp_path / "bf16_adapter", base=str(FIXTURES / "hf" / "qwen2"), merged_dtype="bfloat16")
    assert ("`../model` holds the merged weights W + (alpha / r) A B rounded to bfloat16 (model.export_dtype)"
            in (tmp_path / "bf16_adapter" / "README.md").read_text())

    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(CheckpointError, match=r"adapter_config.json: use_dora: True"):
        load_adapter(base, tmp_path / "adapter")


def test_adapter_dropout_drops_the_adapters_input_only_and_only_with_a_key():
    from polyalign.model.lora_layer import LoraLinear

    lora = LoraConfig(rank=RANK, alpha=ALPHA, dropout=0.25)
    with parallel.unsharded():
        layer = LoraLinear(16, 8, lora=lora, quantize=None, names=("embed", "mlp"), use_bias=False,
                           dtype=jnp.float32, param_dtype=jnp.float32, kernel_init=nnx.initializers.normal(0.1),
                           rngs=nnx.Rngs(0))
    layer.lora_b[...] = jax.random.normal(jax.random.key(1), layer.lora_b[...].shape)
    x = jax.random.normal(jax.random.key(2), (3, 5, 16))
    key = jax.random.key(3)
    kernel, a, b = (np.asarray(v[...]) for v in (layer.kernel, layer.lora_a, layer.lora_b))
    keep = np.asarray(jax.random.bernoulli(key, 0.75, x.shape))
    dropped = np.where(keep, np.asarray(x) / 0.75, 0.0)
    want = np.asarray(x) @ kernel + ALPHA / RANK * (dropped @ a) @ b
    np.testing.assert_allclose(np.asarray(layer(x, key)), want, rtol=1e-5, atol=1e-5)
    plain = np.asarray(x) @ kernel + ALPHA / RANK * (np.asarray(x) @ a) @ b
    np.testing.assert_allclose(np.asarray(layer(x)), plain, rtol=1e-5, atol=1e-5)  # no key: no dropout
    assert 0.15 < 1 - keep.mean() < 0.35

    # In the model: a step's key changes the log-probs; without one the model is the undropped model.
    cfg = dataclasses.replace(tiny_model_config(97), lora=dataclasses.replace(lora, dropout=0.0))
    model = adapted_model(97, RANK)
    dropping = nnx.merge(nnx.graphdef(create_model(dataclasses.replace(cfg, lora=lora))), nnx.state(model))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 97, (2, 12)), jnp.int32)
    targets = jnp.roll(ids, -1, axis=1)
    undropped = np.asarray(model.token_log_probs(ids, targets))
    np.testing.assert_array_equal(np.asarray(dropping.token_log_probs(ids, targets)), undropped)
    one, two = (np.asarray(dropping.token_log_probs(ids, targets, dropout_key=jax.random.key(k))) for k in (4, 5))
    assert np.abs(one - undropped).max() > 1e-3 and np.abs(one - two).max() > 1e-3
    np.testing.assert_array_equal(one, np.asarray(dropping.token_log_probs(ids, targets,
                                                                            dropout_key=jax.random.key(4))))
