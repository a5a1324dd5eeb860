"""The decoder against transformers' own logits (fixtures made by tools/make_fixtures.py), and the
checkpoint round trip."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from polyalign.model import (
    CheckpointError,
    ModelConfigError,
    create_model,
    family_defaults,
    load_hf_checkpoint,
    save_hf_checkpoint,
)
from polyalign.model.architecture import from_hf_config, to_hf_config
from polyalign.model.hf import INDEX_FILE
from tests.conftest import FIXTURES, cpu_devices_env

FAMILIES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3")
TOLERANCE = 1e-4


def expected(family):
    return load_file(FIXTURES / "hf" / family / "expected.safetensors")


def real_positions(mask):
    return mask.astype(bool)


def forward(model, ids, mask):
    return np.asarray(model(jnp.asarray(ids), attention_mask=jnp.asarray(mask)))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("scan_layers", [True, False])
def test_logits_match_transformers(family, scan_layers):
    ref = expected(family)
    model = load_hf_checkpoint(FIXTURES / "hf" / family, scan_layers=scan_layers)
    logits = forward(model, ref["input_ids"], ref["attention_mask"])
    assert logits.shape == ref["logits"].shape and logits.dtype == np.float32
    diff = np.abs(logits - ref["logits"])[real_positions(ref["attention_mask"])].max()
    assert diff <= TOLERANCE, f"{family}: max |dlogits| {diff:.2e}"


def test_fixtures_exercise_the_family_features():
    gemma = json.loads((FIXTURES / "hf" / "gemma2" / "config.json").read_text())
    ref = expected("gemma2")
    assert gemma["sliding_window"] < ref["input_ids"].shape[1]
    # Final soft-capping bends the logits: the largest sits well into tanh's curve.
    assert np.abs(ref["logits"]).max() > 0.8 * gemma["final_logit_softcapping"]
    llama = from_hf_config(json.loads((FIXTURES / "hf" / "llama" / "config.json").read_text()))
    assert llama.rope_scaling is not None and llama.num_kv_heads < llama.num_heads and not llama.tie_embeddings
    qwen = from_hf_config(json.loads((FIXTURES / "hf" / "qwen2" / "config.json").read_text()))
    assert qwen.attention_bias and qwen.tie_embeddings


def test_gemma3_fixture_uses_two_rope_bases_a_window_and_qk_norms():
    ref = expected("gemma3")
    model = load_hf_checkpoint(FIXTURES / "hf" / "gemma3")
    cfg = model.config
    assert cfg.qk_norm and cfg.is_gemma and cfg.attn_logit_softcap is None and cfg.final_logit_softcap is None
    assert cfg.sliding_window < ref["input_ids"].shape[1] and cfg.layer_types[1] == "full_attention"
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling.rope_type) == (1e6, 1e4, "linear")
    # Each of these would be a wrong model that the fixture catches.
    for wrong in (dict(rope_local_theta=None), dict(rope_scaling=None), dict(sliding_window=None, layer_types=())):
        other = nnx.merge(nnx.graphdef(create_model(cfg.replace(**wrong))), nnx.state(model))
        diff = np.abs(forward(other, ref["input_ids"], ref["attention_mask"]) - ref["logits"]).max()
        assert diff > 1e-2, wrong


def test_gemma3_config_in_the_transformers_4_layout_reads_the_same():
    hf = json.loads((FIXTURES / "hf" / "gemma3" / "config.json").read_text())
    legacy = {k: v for k, v in hf.items() if k not in ("rope_parameters", "layer_types")}
    legacy.update(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 4.0},
                  sliding_window_pattern=2, num_hidden_layers=3)
    assert from_hf_config(legacy) == from_hf_config(hf)


@pytest.mark.parametrize("prefix", ["model.language_model.", "language_model.model."])
def test_a_multimodal_gemma3_checkpoint_loads_its_language_model(prefix, tmp_path):
    """transformers 5 saves Gemma3ForConditionalGeneration under model.language_model.; the published
    4.x files under language_model.model.; the vision tower stays behind."""
    from safetensors.numpy import save_file

    ref = expected("gemma3")
    text = json.loads((FIXTURES / "hf" / "gemma3" / "config.json").read_text())
    tensors = {prefix + name.removeprefix("model."): value
               for name, value in load_file(FIXTURES / "hf" / "gemma3" / "model.safetensors").items()}
    tensors["model.vision_tower.vision_model.post_layernorm.weight"] = np.ones(8, np.float32)
    tensors["model.multi_modal_projector.mm_soft_emb_norm.weight"] = np.ones(8, np.float32)
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": {k: v for k, v in text.items() if k not in ("bos_token_id", "eos_token_id", "pad_token_id")},
        "vision_config": {"model_type": "siglip_vision_model"}, "eos_token_id": [1, 106]}))
    model = load_hf_checkpoint(tmp_path)
    assert model.config.eos_token_id == (1, 106)
    logits = forward(model, ref["input_ids"], ref["attention_mask"])
    diff = np.abs(logits - ref["logits"])[real_positions(ref["attention_mask"])].max()
    assert diff <= TOLERANCE


def test_llama3_rope_scaling_changes_the_logits():
    ref = expected("llama")
    model = load_hf_checkpoint(FIXTURES / "hf" / "llama")
    unscaled = nnx.merge(nnx.graphdef(create_model(model.config.replace(rope_scaling=None))), nnx.state(model))
    diff = np.abs(forward(unscaled, ref["input_ids"], ref["attention_mask"]) - ref["logits"]).max()
    assert diff > 1e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_export_then_import_gives_the_same_logits(family, tmp_path):
    ref = expected(family)
    model = load_hf_checkpoint(FIXTURES / "hf" / family)
    before = forward(model, ref["input_ids"], ref["attention_mask"])
    save_hf_checkpoint(model, tmp_path / "single")
    save_hf_checkpoint(model, tmp_path / "sharded", max_shard_bytes=100_000)
    assert (tmp_path / "sharded" / INDEX_FILE).is_file()
    assert len(list((tmp_path / "sharded").glob("model-*-of-*.safetensors"))) > 2
    for export in ("single", "sharded"):
        after = forward(load_hf_checkpoint(tmp_path / export), ref["input_ids"], ref["attention_mask"])
        np.testing.assert_array_equal(after, before)
    # Same tensor names and values as the checkpoint transformers wrote.
    original = load_file(FIXTURES / "hf" / family / "model.safetensors")
    exported = load_file(tmp_path / "single" / "model.safetensors")
    assert sorted(exported) == sorted(original)
    for name, value in original.items():
        np.testing.assert_array_equal(exported[name], value, err_msg=name)


def test_an_index_naming_shards_outside_its_folder_is_refused(tmp_path):
    import shutil

    from polyalign.model.hf import CheckpointError

    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(FIXTURES / "hf" / "llama", checkpoint)
    (tmp_path / "elsewhere.safetensors").write_bytes((checkpoint / "model.safetensors").read_bytes())
    for shard in ("../elsewhere.safetensors", str(tmp_path / "elsewhere.safetensors")):
        (checkpoint / INDEX_FILE).write_text(json.dumps({"weight_map": {"model.embed_tokens.weight": shard}}))
        with pytest.raises(CheckpointError, match="shard names must be file names"):
            load_hf_checkpoint(checkpoint)


def test_a_checkpoints_fingerprint_follows_its_weights_and_config_not_its_path(tmp_path):
    """What a training run records of its init (train/ownership.py): the same files anywhere give the same
    fingerprint; one projection's weights changed, as a merged adapter changes them, or the config edited,
    give another, also in a checkpoint of more tensors than the fingerprint reads."""
    from safetensors.numpy import save_file

    from polyalign.model.hf import checkpoint_fingerprint

    checkpoint, copy = tmp_path / "checkpoint", tmp_path / "elsewhere" / "copy"
    shutil.copytree(FIXTURES / "hf" / "llama", checkpoint)
    shutil.copytree(checkpoint, copy)
    assert checkpoint_fingerprint(checkpoint) == checkpoint_fingerprint(copy)
    tensors = load_file(checkpoint / "model.safetensors")
    name = next(n for n in sorted(tensors) if n.endswith("q_proj.weight"))
    save_file({**tensors, name: tensors[name] + 1e-3}, copy / "model.safetensors", metadata={"format": "pt"})
    assert checkpoint_fingerprint(copy) != checkpoint_fingerprint(checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "rope_theta": 1234.0}))
    before = checkpoint_fingerprint(checkpoint)
    shutil.copy(FIXTURES / "hf" / "llama" / "config.json", checkpoint / "config.json")
    assert checkpoint_fingerprint(checkpoint) != before
    # 7 projections a layer, 300 tensors: an adapter merged into one projection of each layer is seen
    rng = np.random.default_rng(0)
    many = {f"model.layers.{i // 7}.proj_{i % 7}.weight": rng.standard_normal((4, 2048), np.float32)
            for i in range(300)}
    (tmp_path / "many").mkdir()
    save_file(many, tmp_path / "many" / "model.safetensors")
    before = checkpoint_fingerprint(tmp_path / "many")
    save_file({k: v + 1e-3 if k.endswith("proj_3.weight") else v for k, v in many.items()},
              tmp_path / "many" / "model.safetensors")
    assert checkpoint_fingerprint(tmp_path / "many") != before


def test_config_round_trip():
    for family in FAMILIES:
        hf = json.loads((FIXTURES / "hf" / family / "config.json").read_text())
        cfg = from_hf_config(hf)
        assert from_hf_config(to_hf_config(cfg)) == cfg


def test_packed_segments_match_separate_sequences():
    cfg = family_defaults("gemma2", vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=8, sliding_window=3)
    model = create_model(cfg, seed=3)
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 97, 7), rng.integers(0, 97, 5)
    packed = np.concatenate([a, b])[None].astype(np.int32)
    segments = np.array([[1] * 7 + [2] * 5], np.int32)
    positions = np.array([list(range(7)) + list(range(5))], np.int32)
    together = np.asarray(model(jnp.asarray(packed), positions=jnp.asarray(positions),
                                segment_ids=jnp.asarray(segments)))
    alone_a = np.asarray(model(jnp.asarray(a[None].astype(np.int32))))
    alone_b = np.asarray(model(jnp.asarray(b[None].astype(np.int32))))
    np.testing.assert_allclose(together[0, :7], alone_a[0], atol=1e-5)
    np.testing.assert_allclose(together[0, 7:], alone_b[0], atol=1e-5)


def test_a_tree_row_matches_each_branch_run_alone():
    """A prompt computed once and two continuations that each see it (branch ids): every position's
    logits equal those of prompt + that continuation run on its own, sliding-window layers included."""
    cfg = family_defaults("gemma2", vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=8, sliding_window=3)
    model = create_model(cfg, seed=5)
    rng = np.random.default_rng(1)
    prompt, first, second = rng.integers(0, 97, 6), rng.integers(0, 97, 4), rng.integers(0, 97, 5)
    row = np.concatenate([prompt, first, second, [0, 0]])[None].astype(np.int32)
    segments = np.array([[1] * 15 + [0, 0]], np.int32)
    branches = np.array([[0] * 6 + [1] * 4 + [2] * 5 + [0, 0]], np.int32)
    positions = np.array([list(range(10)) + list(range(6, 11)) + [0, 0]], np.int32)
    tree = np.asarray(model(jnp.asarray(row), positions=jnp.asarray(positions), segment_ids=jnp.asarray(segments),
                            branch_ids=jnp.asarray(branches)))
    for continuation, span in ((first, slice(6, 10)), (second, slice(10, 15))):
        alone = np.asarray(model(jnp.asarray(np.concatenate([prompt, continuation])[None].astype(np.int32))))
        np.testing.assert_allclose(tree[0, :6], alone[0, :6], atol=1e-5)
        np.testing.assert_allclose(tree[0, span], alone[0, 6:], atol=1e-5)


def test_tree_mask_by_hand():
    from polyalign.model.transformer import attention_masks

    # one segment: prefix (2 tokens), branch 1 (1 token), branch 2 (2 tokens); then a second segment
    segments = jnp.asarray([[1, 1, 1, 1, 1, 2]])
    branches = jnp.asarray([[0, 0, 1, 2, 2, 0]])
    full, local = attention_masks(6, segments, None, 1, None, branches)
    expected = np.array([[1, 0, 0, 0, 0, 0],
                         [1, 1, 0, 0, 0, 0],
                         [1, 1, 1, 0, 0, 0],
                         [1, 1, 0, 1, 0, 0],  # the second branch does not see the first
                         [1, 1, 0, 1, 1, 0],
                         [0, 0, 0, 0, 0, 1]], bool)
    np.testing.assert_array_equal(np.asarray(full[0, 0]), expected)
    assert local is None
    # the window counts positions: branch 2 starts at position 2, right after the prefix
    positions = jnp.asarray([[0, 1, 2, 2, 3, 0]])
    _, local = attention_masks(6, segments, None, 1, 2, branches, positions)
    np.testing.assert_array_equal(np.asarray(local[0, 0, 3]), [0, 1, 0, 1, 0, 0])


def test_bfloat16_compute_stays_close_to_float32():
    ref = expected("qwen2")
    f32 = forward(load_hf_checkpoint(FIXTURES / "hf" / "qwen2"), ref["input_ids"], ref["attention_mask"])
    bf16_model = load_hf_checkpoint(FIXTURES / "hf" / "qwen2", compute_dtype="bfloat16", remat="full")
    assert bf16_model.layers.self_attn.q_proj.kernel[...].dtype == jnp.float32
    bf16 = forward(bf16_model, ref["input_ids"], ref["attention_mask"])
    assert bf16.dtype == np.float32
    assert 0 < np.abs(bf16 - f32).max() < 0.1


def test_gradients_reach_every_parameter():
    cfg = family_defaults("llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=8, remat="dots")
    model = create_model(cfg)
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 9)), jnp.int32)

    def loss(m):
        logits = m(ids[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], axis=-1))

    value, grads = nnx.value_and_grad(loss)(model)
    assert np.isfinite(float(value)) and abs(float(value) - np.log(64)) < 0.5
    norms = jax.tree.leaves(jax.tree.map(lambda g: float(jnp.abs(g).max()), nnx.to_pure_dict(grads)))
    assert len(norms) == 12 and all(n > 0 for n in norms)


def test_every_parameter_has_logical_axis_names():
    for family in FAMILIES:
        cfg = family_defaults(family, vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                              num_kv_heads=2, head_dim=8, **({"sliding_window": 4} if family == "gemma2" else {}))
        state = nnx.state(create_model(cfg), nnx.Param)
        for path, var in nnx.to_flat_state(state):
            names = var.get_metadata().get("out_sharding")
            assert names is not None and len(names) == var[...].ndim, path
            assert (names[0] == "layers") == (path[0] == "layers"), path


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral",
                                                      "architectures": ["MistralForCausalLM"]}))
    with pytest.raises(CheckpointError, match="unsupported model_type 'mistral'.*MistralForCausalLM"):
        load_hf_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="nowhere: no such checkpoint folder"):
        load_hf_checkpoint(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="empty: no config.json"):
        load_hf_checkpoint(tmp_path / "empty")


def test_missing_and_misshapen_tensors_are_listed(tmp_path):
    from safetensors.numpy import save_file

    source = FIXTURES / "hf" / "llama"
    tensors = load_file(source / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"], tensors["model.norm.weight"]
    tensors["model.layers.0.self_attn.q_proj.weight"] = tensors["model.layers.0.self_attn.q_proj.weight"][:, :10]
    tensors["model.layers.0.extra.weight"] = np.zeros(3, np.float32)
    shutil.copy(source / "config.json", tmp_path / "config.json")
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError) as err:
        load_hf_checkpoint(tmp_path)
    message = str(err.value)
    assert "missing tensors: model.layers.1.mlp.up_proj.weight, model.norm.weight" in message
    assert "wrong shapes: model.layers.0.self_attn.q_proj.weight (64, 10) (expected (64, 64))" in message
    assert "no place for: model.layers.0.extra.weight" in message


def test_rope_scaling_other_than_llama3_is_refused():
    hf = json.loads((FIXTURES / "hf" / "llama" / "config.json").read_text())
    hf.pop("rope_parameters", None)
    hf["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    with pytest.raises(ModelConfigError, match="rope_type 'yarn' is not supported"):
        from_hf_config(hf)


# One change to a real config.json each: what the decoder would compute differently, or a key of the
# wrong type, is refused in one line naming the key.
UNSUPPORTED_CONFIGS = [
    ("llama", {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported for llama"),
    ("qwen2", {"hidden_act": "relu"}, "hidden_act 'relu' is not supported for qwen2"),
    ("gemma2", {"hidden_activation": "silu"}, "hidden_activation 'silu' is not supported for gemma2"),
    ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not supported"),
    ("llama", {"mlp_bias": True}, "mlp_bias=true is not supported"),
    ("llama", {"hidden_size": "64"}, "hidden_size must be a positive integer, got '64'"),
    ("qwen3", {"num_key_value_heads": 4}, "num_attention_heads (6) must be a multiple of num_key_value_heads (4)"),
    ("llama", {"rms_norm_eps": "1e-5"}, "rms_norm_eps must be a number, got '1e-5'"),
    ("llama", {"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false, got 'false'"),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}},
     "rope_type 'llama3' needs a number for 'low_freq_factor', got None"),
]


@pytest.mark.parametrize("family,change,message", UNSUPPORTED_CONFIGS)
def test_a_config_json_the_decoder_would_compute_differently_is_refused(family, change, message):
    hf = json.loads((FIXTURES / "hf" / family / "config.json").read_text())
    from_hf_config(hf)  # the fixture itself loads
    target = hf.get("text_config", hf)
    target.update(change)
    with pytest.raises(ModelConfigError) as err:
        from_hf_config(hf, where="ckpt/config.json")
    assert str(err.value).startswith(f"ckpt/config.json: {message}")


def test_the_activations_polyalign_computes_are_accepted():
    for family, key, name in [("llama", "hidden_act", "swish"), ("gemma3", "hidden_activation", "gelu_new")]:
        hf = json.loads((FIXTURES / "hf" / family / "config.json").read_text())
        hf.get("text_config", hf)[key] = name
        assert from_hf_config(hf) == from_hf_config(json.loads((FIXTURES / "hf" / family / "config.json").read_text()))


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_corrupt_weights_file_is_named_in_one_line(tmp_path, damage):
    shutil.copytree(FIXTURES / "hf" / "llama", tmp_path / "ckpt")
    weights = tmp_path / "ckpt" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2] if damage == "truncated" else b"not safetensors")
    with pytest.raises(CheckpointError) as err:
        load_hf_checkpoint(tmp_path / "ckpt")
    assert str(err.value).startswith(f"{weights}: not a readable safetensors file (")
    assert "\n" not in str(err.value)


def test_save_never_replaces_a_checkpoint_unasked(tmp_path):
    model = load_hf_checkpoint(FIXTURES / "hf" / "qwen2")
    target = save_hf_checkpoint(model, tmp_path / "ckpt")
    before = (target / "model.safetensors").read_bytes()
    with pytest.raises(CheckpointError, match="exists and is not empty"):
        save_hf_checkpoint(model, target)
    assert (target / "model.safetensors").read_bytes() == before
    save_hf_checkpoint(model, target, overwrite=True, dtype="bfloat16")
    assert json.loads((target / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no staging folders left behind


def test_a_save_removes_what_a_save_stopped_outright_left(tmp_path, capsys):
    """A process killed while saving leaves its staging folder (and, mid-replacement, the retired model) beside
    the target, where its own cleanup never ran: the next save of that path removes them, saying so; another
    path's are not its to remove."""
    model = load_hf_checkpoint(FIXTURES / "hf" / "qwen2")
    for left in (".model.staging-0693c181", ".model.old", ".other.staging-12345678"):
        (tmp_path / left).mkdir()
        (tmp_path / left / "config.json").write_text("{}")
    save_hf_checkpoint(model, tmp_path / "model")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.staging-12345678", "model"]
    err = capsys.readouterr().err
    assert f"note: {tmp_path / '.model.staging-0693c181'} removed: an unfinished save of model (a process stopped " \
           "while writing it)" in err and err.count("note: ") == 2


# Parameter counts the model cards publish (embedding included, tied heads counted once).
PUBLISHED_SIZES = {"qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304, "qwen2.5-3b": 3_085_938_688,
                   "llama3.2-1b": 1_235_814_400, "llama3.2-3b": 3_212_749_824, "gemma2-2b": 2_614_341_888,
                   "qwen3-0.6b": 596_049_920, "qwen3-8b": 8_190_735_360, "gemma3-1b": 999_885_952,
                   "qwen2.5-7b": 7_615_616_512}


@pytest.mark.parametrize("name", sorted(PUBLISHED_SIZES))
def test_presets_have_the_published_parameter_counts(name):
    from polyalign.model import abstract_model
    from polyalign.model.presets import preset

    cfg = preset(name)
    shapes = jax.tree.leaves(nnx.state(abstract_model(cfg), nnx.Param))  # shapes only, nothing allocated
    assert sum(int(np.prod(s.shape)) for s in shapes) == cfg.num_parameters() == PUBLISHED_SIZES[name]


def test_configs_models_are_the_presets_and_carry_the_published_hyperparameters():
    from polyalign.model.presets import PRESETS, preset

    repo_files = sorted(p.name for p in (Path(__file__).parents[1] / "configs" / "models").glob("*.yaml"))
    assert repo_files == sorted(f"{name}.yaml" for name in PRESETS) and len(repo_files) == 12
    qwen, llama, gemma = preset("qwen2.5-1.5b"), preset("llama3.2-3b"), preset("gemma2-2b")
    # values from the checkpoints' own config.json files
    assert (qwen.rope_theta, qwen.rms_norm_eps, qwen.attention_bias, qwen.eos_token_id) == (1e6, 1e-6, True, 151645)
    assert (llama.rope_scaling.factor == 32.0 and llama.rope_theta == 500000.0
            and llama.eos_token_id == (128001, 128008, 128009))
    assert (gemma.attn_logit_softcap, gemma.final_logit_softcap, gemma.sliding_window) == (50.0, 30.0, 4096)
    assert gemma.layer_types[:2] == ("sliding_attention", "full_attention")
    qwen3 = preset("qwen3-8b")
    assert (qwen3.qk_norm, qwen3.attention_bias, qwen3.rope_theta, qwen3.head_dim) == (True, False, 1e6, 128)
    gemma3 = preset("gemma3-4b")
    assert (gemma3.rope_theta, gemma3.rope_local_theta, gemma3.rope_scaling.factor, gemma3.sliding_window) == (
        1e6, 1e4, 8.0, 1024)
    assert gemma3.layer_types.count("full_attention") == 5 and gemma3.layer_types[5] == "full_attention"
    # The language model of the published 4B (the checkpoint less its vision tower and projector).
    assert gemma3.num_parameters() == 3_880_263_168


def test_an_architecture_file_of_ones_own_works_and_bad_fields_are_named(tmp_path):
    from polyalign.model import ModelConfigError
    from polyalign.model.presets import preset

    path = tmp_path / "mine.yaml"
    path.write_text("family: qwen2\nvocab_size: 1000\nhidden_size: 64\nintermediate_size: 128\nnum_layers: 2\n"
                    "num_heads: 4\nnum_kv_heads: 2\nhead_dim: 16\n")
    cfg = preset(str(path), dtype="bfloat16")
    assert (cfg.family, cfg.num_layers, cfg.attention_bias, cfg.dtype) == ("qwen2", 2, True, "bfloat16")
    path.write_text(path.read_text() + "num_experts: 8\n")
    with pytest.raises(ModelConfigError, match="mine.yaml: .*num_experts"):
        preset(str(path))
    with pytest.raises(ModelConfigError, match="unknown model preset 'qwen3'"):
        preset("qwen3")


@pytest.mark.parametrize("attention_bias", [False, True])  # Llama / Qwen2 structure
def test_causal_only_attention_equals_the_explicit_mask(attention_bias):
    """Unpacked, unpadded batches attend with is_causal and no [T, T] mask (what the fused kernels
    want); the result equals attention under the explicit causal mask."""
    from polyalign.model import create_model
    from polyalign.model.transformer import attention_masks
    from tests.conftest import tiny_model_config

    model = create_model(tiny_model_config(97, attention_bias=attention_bias), seed=2)
    ids = jax.random.randint(jax.random.key(0), (2, 24), 0, 97)
    assert attention_masks(24, None, None, 2, None) == (None, None)
    implicit = model(ids)
    explicit = model(ids, attention_mask=jnp.ones_like(ids))  # forces the [B, 1, T, T] mask path
    np.testing.assert_allclose(implicit, explicit, atol=1e-5)


def test_default_attention_is_cudnn_only_where_it_applies():
    from polyalign.model.presets import preset
    from polyalign.model.transformer import default_attention_implementation

    qwen_bf16, qwen_f32 = preset("qwen2.5-1.5b", dtype="bfloat16"), preset("qwen2.5-1.5b")
    assert default_attention_implementation(qwen_bf16, "gpu") == "cudnn"
    assert default_attention_implementation(qwen_f32, "gpu") is None  # cuDNN's kernel is half precision
    assert default_attention_implementation(preset("gemma2-2b", dtype="bfloat16"), "gpu") is None  # soft-cap, head 256
    assert default_attention_implementation(qwen_bf16, "cpu") is None
    # Gemma 3's heads of 256 (no soft-cap): cuDNN from Hopper (compute capability 9.0) on, as jax allows
    gemma3 = preset("gemma3-1b", dtype="bfloat16")
    assert gemma3.head_dim == 256 and gemma3.attn_logit_softcap is None
    assert default_attention_implementation(gemma3, "gpu", compute_capability="9.0") == "cudnn"
    assert default_attention_implementation(gemma3, "gpu", compute_capability="8.0") is None
    assert default_attention_implementation(qwen_bf16, "gpu", compute_capability="8.0") == "cudnn"  # head 128
    assert default_attention_implementation(qwen_bf16, "tpu") == "splash"  # head 128
    assert default_attention_implementation(preset("qwen2.5-0.5b"), "tpu") is None  # head 64


def test_packed_and_tree_rows_take_the_fused_kernel_outside_cached_decoding(monkeypatch):
    """attention_impl null: packed, tree and padded rows in training go to the backend's fused kernel
    (cuDNN with the mask as a bias on GPU); a KV-cache decode step stays on XLA."""
    from polyalign.model import transformer

    chosen = []
    monkeypatch.setattr(transformer, "default_attention_implementation", lambda cfg: "cudnn")
    monkeypatch.setattr(transformer, "attend", lambda *a, implementation, **k: chosen.append(implementation)
                        or jnp.zeros(a[0].shape, a[0].dtype))
    cfg = family_defaults("llama", vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                          num_kv_heads=2, head_dim=8, scan_layers=False)
    model = create_model(cfg)
    ids = jnp.ones((1, 8), jnp.int32)
    model(ids, segment_ids=jnp.ones((1, 8), jnp.int32), branch_ids=jnp.zeros((1, 8), jnp.int32))
    model(ids, attention_mask=jnp.ones((1, 8), jnp.int32))
    from polyalign.model.transformer import KVCache

    model.decode(ids[:, :1], jnp.zeros((1, 1), jnp.int32), KVCache.empty(cfg, 1, 8), jnp.ones((1, 8), bool))
    assert chosen == ["cudnn", "cudnn", None]


def test_each_layout_reaches_the_attention_kernel_causal_and_masked_only_where_it_must(monkeypatch):
    """With cuDNN chosen, what jax.nn.dot_product_attention is asked for by each layout: SFT rows of one
    example and row pairs run causal with no mask at all (the kernel's plain causal path); packed SFT
    rows, tree-packed pairs and sliding windows pass their mask and still say causal (every such mask
    lies inside the causal triangle, so the kernel may skip the tiles above it); an odd length with a
    mask is padded to an even one (cuDNN's training kernel needs it) and gives the unpadded values;
    decoding against a KV cache runs XLA with its mask and no causal flag, and the paged cache calls
    no kernel. The calls run XLA here, on the CPU."""
    from polyalign.inputs import pipeline
    from polyalign.inputs.pair_rows import packed_pair_arrays, pair_arrays, tree_length
    from polyalign.model.paged_cache import PagedKVCache
    from polyalign.model.transformer import KVCache
    from polyalign.train.preference import sequence_logps
    from polyalign.train.sft import SftObjective

    real = jax.nn.dot_product_attention
    calls = []

    def recorded(q, k, v, *, mask=None, is_causal=False, scale=None, implementation=None, **rest):
        calls.append({"implementation": implementation, "causal": is_causal, "length": q.shape[1],
                      "mask": None if mask is None else tuple(mask.shape)})
        return real(q, k, v, mask=mask, is_causal=is_causal, scale=scale, implementation="xla", **rest)

    monkeypatch.setattr(jax.nn, "dot_product_attention", recorded)

    def asked(run, *args):  # compiled: op by op the layouts took 10 s
        calls.clear()
        out = nnx.jit(lambda *a: run(*a))(*args)
        return calls[:], out

    def model_of(**extra):
        return create_model(family_defaults("llama", vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=1,
                                            num_heads=4, num_kv_heads=2, head_dim=8, scan_layers=False,
                                            attention_impl="cudnn", **extra), seed=0)

    model = model_of()
    rng = np.random.default_rng(0)

    def example(n):
        return {"input_ids": rng.integers(1, 97, n), "loss_mask": np.r_[np.zeros(n // 2), np.ones(n - n // 2)],
                "weight": 1.0, "bucket": 0}

    def stack(rows):
        return {key: jnp.asarray(np.stack([row[key] for row in rows])) for key in rows[0]}

    one_each = stack([pipeline.example_arrays(example(n), 12, 0) for n in (9, 13)])
    packed = stack([pipeline.packed_arrays([example(5), example(6)], 12, 0)] * 2)
    sft = SftObjective(1)
    assert asked(sft.numerators, model, one_each)[0] == [
        {"implementation": "cudnn", "causal": True, "length": 12, "mask": None}]
    assert asked(sft.numerators, model, packed)[0] == [
        {"implementation": "cudnn", "causal": True, "length": 12, "mask": (2, 1, 12, 12)}]

    def pair(prompt, chosen, rejected):
        p = rng.integers(1, 97, prompt)
        c, r = np.r_[p, rng.integers(1, 97, chosen)], np.r_[p, rng.integers(1, 97, rejected)]
        return {"id": str(prompt), "chosen_ids": c, "rejected_ids": r, "weight": 1.0, "bucket": 0,
                "chosen_mask": np.r_[np.zeros(prompt), np.ones(chosen)],
                "rejected_mask": np.r_[np.zeros(prompt), np.ones(rejected)], "critic_chosen": 0.0,
                "critic_rejected": 0.0}

    pairs = [pair(5, 3, 4), pair(4, 2, 3)]
    row_pairs = stack([pair_arrays(p, 10, 0) for p in pairs])
    assert asked(sequence_logps, model, row_pairs)[0] == [
        {"implementation": "cudnn", "causal": True, "length": 10, "mask": None}]
    width = sum(tree_length(p, 10) for p in pairs)
    assert width % 2 == 1  # 8 + 7 positions: an odd row, so the masked kernel call is padded to 16
    trees = stack([packed_pair_arrays(pairs, width, 0, 2, 10)])
    seen, (chosen, rejected, _) = asked(sequence_logps, model, trees)
    even = width + 1
    assert seen == [{"implementation": "cudnn", "causal": True, "length": even, "mask": (1, 1, even, even)}]
    unpacked = sequence_logps(model, row_pairs)
    np.testing.assert_allclose(np.asarray(chosen)[0], np.asarray(unpacked[0]), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(rejected)[0], np.asarray(unpacked[1]), rtol=1e-5)

    windowed = model_of(sliding_window=4)
    assert asked(sft.numerators, windowed, one_each)[0] == [
        {"implementation": "cudnn", "causal": True, "length": 12, "mask": (2, 1, 12, 12)}]

    cfg = model.config
    ids = jnp.ones((1, 3), jnp.int32)
    seen, _ = asked(model.decode, ids, jnp.arange(3)[None], KVCache.empty(cfg, 1, 8), jnp.arange(8)[None] < 3)
    assert seen == [{"implementation": None, "causal": False, "length": 3, "mask": (1, 1, 3, 8)}]
    pool = PagedKVCache.empty_pool(cfg, 4, 16)
    cache = PagedKVCache.for_tokens(pool, jnp.array([[1, 0]], jnp.int32), jnp.arange(3)[None], jnp.ones((1, 3), bool))
    assert asked(model.decode_paged, ids, jnp.arange(3)[None], cache)[0] == []


@pytest.mark.parametrize("softcap", [None, 20.0])
def test_splash_attention_equals_xla_in_value_and_gradient(softcap):
    """The Pallas TPU kernel, interpreted on CPU, against the XLA attention: grouped heads (4 query heads
    per key/value head), a soft-cap as Gemma 2 uses, and the gradients."""
    from polyalign.model.splash import splash_attention
    from polyalign.model.transformer import attend

    def xla(q, k, v):
        return attend(q, k, v, None, scale=0.2, softcap=softcap, implementation="xla")

    def pallas(q, k, v):
        return splash_attention(q, k, v, scale=0.2, softcap=softcap, interpret=True)

    _assert_same_value_and_gradient(pallas, xla, query_heads=8, seed=0)


def _assert_same_value_and_gradient(kernel, reference, query_heads: int, seed: int):
    """`kernel` (jitted) against `reference` on random q [2, 256, query_heads, 32] and k, v with 2
    key/value heads: outputs, and the gradients of a random projection of them."""
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (2, 256, query_heads, 32))
    k, v = (jax.random.normal(key, (2, 256, 2, 32)) for key in keys[1:3])
    cotangent = jax.random.normal(keys[3], q.shape)
    np.testing.assert_allclose(jax.jit(kernel)(q, k, v), reference(q, k, v), atol=2e-5)
    want = jax.grad(lambda *a: (reference(*a) * cotangent).sum(), argnums=(0, 1, 2))(q, k, v)
    got = jax.jit(jax.grad(lambda *a: (kernel(*a) * cotangent).sum(), argnums=(0, 1, 2)))(q, k, v)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=2e-4, rtol=1e-4)


def test_splash_attention_within_packed_segments_equals_xla_in_value_and_gradient():
    """Packed rows through the kernel's segment ids (no [T, T] mask), interpreted on CPU, against XLA
    attention with the dense segment mask: segments of uneven lengths crossing the kernel's blocks,
    trailing padding (segment 0) and a row that is one segment."""
    from polyalign.model.splash import splash_attention
    from polyalign.model.transformer import SegmentMask, attend

    row = np.repeat([1, 2, 3, 0], [70, 131, 40, 15])
    segments = jnp.asarray(np.stack([row, np.ones(256, int)]), jnp.int32)

    def xla(q, k, v):
        return attend(q, k, v, SegmentMask(segments).dense(), scale=0.2, softcap=None, implementation="xla")

    def pallas(q, k, v):
        return splash_attention(q, k, v, scale=0.2, segment_ids=segments, interpret=True)

    _assert_same_value_and_gradient(pallas, xla, query_heads=4, seed=1)


def test_splash_attention_under_a_row_mask_equals_xla_in_value_and_gradient():
    """Masks that differ from row to row reach the kernel as each row's own block mask (interpreted on
    CPU), against XLA attention under the same mask: a row of two tree-packed prompts with two and
    three responses each and trailing padding, and a sliding-window row whose blocks far from the
    diagonal are empty."""
    from polyalign.model.splash import splash_attention
    from polyalign.model.transformer import attend, attention_masks

    segments = np.repeat([1, 2, 0], [150, 90, 16])
    branches = np.r_[np.repeat([0, 1, 2], [60, 50, 40]), np.repeat([0, 1, 2, 3], [30, 20, 20, 20]), np.zeros(16)]
    tree, _ = attention_masks(256, jnp.asarray(segments[None], jnp.int32), None, 1, None,
                              branch_ids=jnp.asarray(branches[None], jnp.int32))
    _, window = attention_masks(256, None, None, 1, 50)
    masks = jnp.concatenate([tree, window])  # [2, 1, 256, 256]
    assert not bool(masks[0, 0, 230, 185]) and bool(masks[0, 0, 230, 160])  # branch 3 sees its prefix, not branch 1

    def xla(q, k, v):
        return attend(q, k, v, masks, scale=0.2, softcap=None, implementation="xla")

    def pallas(q, k, v):
        return splash_attention(q, k, v, scale=0.2, mask=masks[:, 0], interpret=True)

    _assert_same_value_and_gradient(pallas, xla, query_heads=4, seed=2)


def test_packed_and_tree_rows_give_the_same_log_probs_with_splash_and_xla_attention():
    """The model's packed paths with attention_impl splash: SegmentMask reaches the kernel as segment
    ids, a tree (branch ids) as the row's own mask; with xla both are a dense mask."""
    from polyalign.model.transformer import SegmentMask, attention_masks

    cfg = family_defaults("qwen2", vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=8)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 97, (2, 128)), jnp.int32)
    segments = jnp.asarray(np.stack([np.repeat([1, 2, 0], [50, 60, 18]), np.repeat([1, 2], [100, 28])]), jnp.int32)
    positions = jnp.asarray(np.stack([np.r_[np.arange(50), np.arange(60), np.arange(18)],
                                      np.r_[np.arange(100), np.arange(28)]]), jnp.int32)
    targets = jnp.roll(ids, -1, axis=1)
    xla = create_model(cfg.replace(attention_impl="xla"), seed=2)
    splash_model = nnx.merge(nnx.graphdef(create_model(cfg.replace(attention_impl="splash"))), nnx.state(xla))
    want = xla.token_log_probs(ids, targets, positions=positions, segment_ids=segments)
    got = splash_model.token_log_probs(ids, targets, positions=positions, segment_ids=segments)
    np.testing.assert_allclose(got, want, atol=2e-5)
    full, _ = attention_masks(128, segments, None, 2, None)
    assert isinstance(full, SegmentMask)
    # Row 0 as a tree: a prompt of 20 and responses of 15 and 15, their positions counted from the prompt.
    branches = jnp.asarray(np.stack([np.r_[np.zeros(20), np.ones(15), 2 * np.ones(15), np.zeros(78)],
                                     np.zeros(128)]), jnp.int32)
    tree_positions = positions.at[0, 35:50].set(jnp.arange(20, 35))
    tree, _ = attention_masks(128, segments, None, 2, None, branch_ids=branches)
    assert isinstance(tree, jax.Array) and tree.shape == (2, 1, 128, 128)
    want = xla.token_log_probs(ids, targets, positions=tree_positions, segment_ids=segments, branch_ids=branches)
    got = splash_model.token_log_probs(ids, targets, positions=tree_positions, segment_ids=segments,
                                       branch_ids=branches)
    np.testing.assert_allclose(got, want, atol=2e-5)
    changed = xla.token_log_probs(ids, targets, positions=positions, segment_ids=segments)
    assert np.abs(np.asarray(want - changed))[0, 35:50].max() > 1e-3  # the tree is not the packed row


def _run_on_eight_cpu_devices(script: Path) -> subprocess.CompletedProcess:
    """Runs a test script in a process of its own whose CPU is split into 8 XLA devices; it must succeed."""
    env = cpu_devices_env(8, PYTHONPATH=str(Path(__file__).parents[1]))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_splash_attention_under_a_mesh_equals_the_model_without_it(tmp_path):
    """The model with attention_impl=splash on a 2 x 2 x 2 mesh of CPU devices (shard_map over batch
    and key/value heads) gives the XLA model's logits, causal and for tree rows (each row's own mask)."""
    script = tmp_path / "splash_mesh.py"
    script.write_text(
        "import dataclasses, jax, numpy as np\n"
        "from polyalign.mesh import parallel\n"
        "from polyalign.model import create_model\n"
        "from tests.conftest import tiny_model_config\n"
        "cfg = tiny_model_config(97, num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64)\n"
        "ids = np.random.default_rng(0).integers(0, 97, (4, 128)).astype(np.int32)\n"
        "plain = np.asarray(create_model(cfg, seed=1)(ids))\n"
        "model = create_model(dataclasses.replace(cfg, attention_impl='splash'), seed=1)\n"
        "mesh = parallel.make_mesh(parallel.ParallelConfig(2, 2, 2))\n"
        "with jax.set_mesh(mesh):\n"
        "    ids_sharded = jax.device_put(ids, parallel.batch_sharding(mesh, 0))\n"
        "    out = np.asarray(jax.jit(lambda m, x: m(x))(model, ids_sharded))\n"
        "print('max diff', float(np.abs(out - plain).max()))\n"
        "assert np.allclose(out, plain, atol=2e-5)\n"
        "segments = np.ones((4, 128), np.int32)\n"
        "branches = np.repeat([[0, 1, 2, 3]], [40, 30, 30, 28], axis=1).repeat(4, 0).astype(np.int32)\n"
        "plain = np.asarray(create_model(cfg, seed=1)(ids, segment_ids=segments, branch_ids=branches))\n"
        "with jax.set_mesh(mesh):\n"
        "    out = np.asarray(jax.jit(lambda m, x, s, b: m(x, segment_ids=s, branch_ids=b))(\n"
        "        model, ids_sharded, segments, branches))\n"
        "print('tree max diff', float(np.abs(out - plain).max()))\n"
        "assert np.allclose(out, plain, atol=2e-5)\n")
    result = _run_on_eight_cpu_devices(script)
    assert "max diff" in result.stdout


@pytest.mark.slow
def test_sharded_initialisation_and_loading_place_each_shard_without_a_whole_copy(tmp_path):
    """On a 1 x 4 x 2 mesh of CPU devices, create_model(mesh=) and load_hf_checkpoint(mesh=) give the
    unsharded model's values, each parameter already in its logical sharding (the kernels split over
    fsdp and tensor), and parallel.to_host gathers them back."""
    script = tmp_path / "sharded_init.py"
    script.write_text(
        "import jax, numpy as np\n"
        "from flax import nnx\n"
        "from polyalign.mesh import parallel\n"
        "from polyalign.model import create_model, load_hf_checkpoint, save_hf_checkpoint\n"
        "from tests.conftest import tiny_model_config\n"
        "cfg = tiny_model_config(128)\n"
        "mesh = parallel.make_mesh(parallel.ParallelConfig(1, 4, 2))\n"
        "plain = create_model(cfg, seed=3)\n"
        f"save_hf_checkpoint(plain, {str(tmp_path / 'ckpt')!r})\n"
        "expected = jax.tree.leaves(nnx.state(plain, nnx.Param))\n"
        "for name, model in (('created', create_model(cfg, seed=3, mesh=mesh)),\n"
        f"                    ('loaded', load_hf_checkpoint({str(tmp_path / 'ckpt')!r}, mesh=mesh))):\n"
        "    state = nnx.state(model, nnx.Param)\n"
        "    wanted = jax.tree.leaves(parallel.param_shardings(state, mesh))\n"
        "    leaves = jax.tree.leaves(state)\n"
        "    assert all(x.sharding.is_equivalent_to(s, x.ndim) for x, s in zip(leaves, wanted)), name\n"
        "    split = [x for x in leaves if x.addressable_shards[0].data.size * 8 == x.size]\n"
        "    assert len(split) >= 4, (name, len(split))  # kernels split over all 8 devices\n"
        "    for got, want in zip(jax.tree.leaves(parallel.to_host(state)), expected):\n"
        "        # loading is exact; initialising compiled rather than op by op may round the last bit\n"
        "        np.testing.assert_allclose(got, np.asarray(want), rtol=0 if name == 'loaded' else 1e-6, atol=0)\n"
        "    print(name, 'ok', len(split), 'parameters split 8 ways')\n")
    result = _run_on_eight_cpu_devices(script)
    assert "created ok" in result.stdout and "loaded ok" in result.stdout, result.stdout


def test_pooled_encodings_do_not_depend_on_the_batch_and_compile_once_per_length_bucket(demo_tokenizer):
    """Each text's encoding is its own mean-pooled final hidden states, whatever else shares its batch and
    however long the padding is; texts of many lengths compile one program per power-of-two length."""
    from polyalign.model.pooling import _pooled, encode_responses
    from tests.conftest import tiny_model_config

    tokenizer = demo_tokenizer[0]
    model = create_model(tiny_model_config(tokenizer.vocab_size), seed=0)
    texts = ["Yes.", "好的，我明白了。", "The museum opens at nine and closes at five on weekdays. " * 3,
             "请问附近有没有便宜的餐厅？" * 6, "ok", "A much longer answer, " * 20]
    together = encode_responses(model, tokenizer, texts, max_tokens=200, batch_size=4, progress=False)
    for text, row in zip(texts, together):
        ids = tokenizer.encode(text)[:200]
        by_hand = np.asarray(model.hidden_states(jnp.asarray([ids]))[0]).mean(0)
        np.testing.assert_allclose(row, by_hand, atol=2e-5)
    alone = encode_responses(model, tokenizer, texts[::-1], max_tokens=200, batch_size=1, progress=False)[::-1]
    np.testing.assert_allclose(alone, together, atol=2e-5)
    before = _pooled._cache_size()
    encode_responses(model, tokenizer, [" ".join(["word"] * n) for n in range(1, 120, 7)], max_tokens=200,
                     batch_size=1, progress=False)
    assert _pooled._cache_size() - before <= 2  # 64 and 128 (32 was compiled above); not one per length
