"""One config schema for every training method, the method registry, and the trainer's random stream."""

import dataclasses
import json
import re
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from polyalign.cli import main
from polyalign.core.yaml_config import ConfigError
from polyalign.train import config as schema
from polyalign.train.methods import METHODS, load_config
from tests.conftest import REPO

SHARED = ("method", "init", "model", "data", "optimizer", "train", "parallel")
CONFIGS = {"sft": REPO / "configs" / "sft_demo.yaml", "critic": REPO / "configs" / "critic_demo.yaml",
           **{m: REPO / "configs" / "hdpo_demo.yaml"
              for m in ("hdpo", "dpo", "ipo", "robust_dpo", "ln_dpo", "simpo", "orpo", "kto")}}


def _fields(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def test_every_method_has_the_shared_sections_with_the_same_types():
    assert set(CONFIGS) == set(METHODS)
    for spec in METHODS.values():
        hints = {f.name: f.type for f in dataclasses.fields(spec.config)}
        assert set(SHARED) <= set(hints), spec.name
        config = spec.config()
        assert type(config.model) is schema.ModelSection and type(config.data) is schema.DataSection
        assert type(config.optimizer) is schema.OptimizerConfig and type(config.train) is schema.LoopConfig
        # the same execution keys in the same place for every method
        for key in ("dtype", "remat", "attention_impl", "logprob_chunk"):
            assert hasattr(config.model, key)
        assert hasattr(config.data, "max_length")
        # no untyped sections
        assert all(not isinstance(getattr(config, name), dict) for name in _fields(spec.config)), spec.name


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("typo, unknown, suggestion", [
    ("model.dtpye=bfloat16", "dtpye", "dtype"), ("data.dri=RUN", "dri", "dir"),
    ("data.max_lenght=64", "max_lenght", "max_length"), ("train.micro_batch=2", "micro_batch", "micro_batches"),
    ("optimizer.weight_decy=0", "weight_decy", "weight_decay"), ("parallel.fsdb=2", "fsdb", "fsdp"),
    ("initt=x", "initt", "init"), ("optimzer.lr=1e-3", "optimzer", "optimizer"),
    ("model.lora.rnk=4", "rnk", "rank"), ("modle.lora.rank=4", "modle", "model"),
])
def test_a_typo_anywhere_names_the_closest_key_and_the_override(method, typo, unknown, suggestion):
    """A typo at any depth of an override's path is blamed on that override, never on the config file."""
    with pytest.raises(ConfigError) as caught:
        load_config(CONFIGS[method], [typo], method=method)
    assert str(caught.value).startswith(f"override {typo}: ")
    assert f"unknown key '{unknown}'; did you mean '{suggestion}'" in str(caught.value)


def test_another_methods_setting_is_named_as_such_for_every_method_and_key(tmp_path):
    """Every top-level key of any method's config, given to a method that has no such key (`beta` to SFT,
    `weighting` to DPO), from an override or from the file, is said to be a setting of the methods that
    have it, rather than pointed at a look-alike (`did you mean 'data'?`)."""
    from polyalign.core.yaml_config import BUILD_FLAGS, section_keys

    tops = {name: set(_fields(spec.config)) for name, spec in METHODS.items()}
    checked = 0
    for method, own in tops.items():
        for key in sorted(set().union(*tops.values()) - own):
            if section_keys(METHODS[method].config, key) or (key in BUILD_FLAGS and method == "sft"):
                continue  # a key of one of its sections, bare, or a build's flag: pointed there
            readers = [name for name in METHODS if key in tops[name]]
            said = f"unknown key '{key}': {key} is a setting of {', '.join(readers)}, not of {method} " \
                   f"(polyalign train {readers[0]})"
            with pytest.raises(ConfigError) as caught:
                load_config(None, [f"{key}=1"], method=method)
            assert str(caught.value) == f"override {key}=1: {said}"
            checked += 1
    assert checked > 20
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump({"method": "sft", "beta": 0.3}))
    with pytest.raises(ConfigError, match=re.escape(f"{path}: unknown key 'beta': beta is a setting of hdpo, dpo")):
        load_config(path, [], method="sft")


@pytest.mark.parametrize("method", sorted(METHODS))
def test_a_key_given_without_its_section_is_pointed_at_its_section(method):
    """Every key of every section (at any depth), given bare (`lr=1e-3`, `steps=3`, `rank=8`), is refused
    naming a dotted key that ends in it; one of other trainers' names (`learning_rate`) likewise."""
    config_class = METHODS[method].config
    top = set(_fields(config_class))

    def leaves(cls, path=""):
        for f in dataclasses.fields(cls):
            annotation = typing.get_type_hints(cls)[f.name]
            if dataclasses.is_dataclass(annotation):
                yield from leaves(annotation, f"{path}{f.name}.")
            elif path:
                yield f"{path}{f.name}"

    dotted = list(leaves(config_class))
    # a deprecated bare key still works, with a notice (test_old_flat_keys_still_load_with_a_notice_naming_the_new_key)
    bare = {key.rsplit(".", 1)[1] for key in dotted} - top - set(schema.DEPRECATED_KEYS.get(config_class, {}))
    assert {"lr", "steps", "rank", "b1"} <= bare
    for key in sorted(bare) + ["learning_rate"]:
        with pytest.raises(ConfigError) as caught:
            load_config(CONFIGS[method], [f"{key}=1"], method=method)
        meant = {"learning_rate": "lr"}.get(key, key)
        suggested = re.search(r"did you mean ('[\w.]+'(?: or '[\w.]+')*)\?$", str(caught.value))
        # every dotted key it can be, none other (seed: model.seed or train.seed)
        assert suggested and suggested.group(1) == " or ".join(
            repr(k) for k in dotted if k.rsplit(".", 1)[1] == meant), (key, str(caught.value))
    # a key in another section than its own is pointed at its own
    for given, own in (("train.lr", "optimizer.lr"), ("optimizer.steps", "train.steps"),
                       ("model.rank", "model.lora.rank")):
        with pytest.raises(ConfigError, match=rf"did you mean '{re.escape(own)}'\?$"):
            load_config(CONFIGS[method], [f"{given}=1"], method=method)


def test_the_same_override_means_the_same_thing_for_every_method():
    for method in METHODS:
        config = load_config(CONFIGS[method], ["model.dtype=bfloat16", "model.remat=full", "data.max_length=64",
                                               "model.logprob_chunk=32", "model.attention_impl=xla"], method=method)
        assert (config.model.dtype, config.model.remat, config.data.max_length, config.model.logprob_chunk,
                config.model.attention_impl) == ("bfloat16", "full", 64, 32, "xla"), method


def test_old_flat_keys_still_load_with_a_notice_naming_the_new_key(tmp_path, capsys):
    old = tmp_path / "old_hdpo.yaml"
    old.write_text("method: dpo\nmax_length: 128\ndtype: bfloat16\nremat: full\ndata: {dir: RUN}\n")
    config = load_config(old, ["logprob_chunk=16", "attention_impl=xla"])
    assert ((config.method, config.data.max_length, config.data.dir, config.model.dtype, config.model.remat,
             config.model.logprob_chunk, config.model.attention_impl)
            == ("dpo", 128, "RUN", "bfloat16", "full", 16, "xla"))
    notices = capsys.readouterr().err.strip().splitlines()
    assert len(notices) == 5  # three in the file, two overrides
    assert "key 'max_length' is deprecated" in notices[0] and "use 'data.max_length'" in notices[0]
    # a value at the new place wins over the old key
    both = tmp_path / "both.yaml"
    both.write_text("method: hdpo\nmax_length: 128\ndata: {max_length: 64}\n")
    assert load_config(both).data.max_length == 64

    critic = tmp_path / "old_critic.yaml"
    critic.write_text("method: critic\ndata: {dir: RUN}\nmax_tokens: 300\nepochs: 5\nregression_batch: 32\n"
                      "encode_batch: 4\nseed: 7\n")
    config = load_config(critic)
    assert (config.data.max_length, config.train.epochs, config.train.global_batch, config.data.eval_batch,
            config.model.seed, config.train.seed) == (300, 5, 32, 4, 7, 7)


def test_choices_are_checked():
    with pytest.raises(ConfigError, match="weighting must be one of bucket, uniform"):
        load_config(CONFIGS["sft"], ["weighting=square"])
    with pytest.raises(ConfigError, match="model.remat must be one of"):
        load_config(CONFIGS["hdpo"], ["model.remat=some"])
    with pytest.raises(ConfigError, match="train.keep_checkpoints must be at least 1, got 0"):
        load_config(CONFIGS["sft"], ["train.keep_checkpoints=0"])
    with pytest.raises(ConfigError, match="distance_features must be one of"):
        load_config(CONFIGS["critic"], ["distance_features=some"])
    with pytest.raises(ConfigError, match=r"label_smoothing must be in \[0, 0.5\)"):
        load_config(CONFIGS["robust_dpo"], ["label_smoothing=0.5"], method="robust_dpo")
    with pytest.raises(ConfigError, match="unknown method 'ppo'"):
        load_config(CONFIGS["hdpo"], ["method=ppo"])


BAD_SETTINGS = [
    ("sft", "train.steps=0", "train.steps must be at least 1, got 0"),
    ("sft", "train.global_batch=-4", "train.global_batch must be at least 1, got -4"),
    ("sft", "train.micro_batches=3", r"train.global_batch \(16\) must be divisible by train.micro_batches \(3\)"),
    ("sft", "train.eval_every=0", "train.eval_every must be at least 1 or null, got 0"),
    ("sft", "train.checkpoint_every=0", "train.checkpoint_every must be at least 1, got 0"),
    ("sft", "optimizer.lr=0", "optimizer.lr must be above 0, got 0"),
    ("sft", "optimizer.warmup_ratio=1.5", r"optimizer.warmup_ratio must be in \[0, 1\], got 1.5"),
    ("sft", "optimizer.b2=1", r"optimizer.b2 must be in \[0, 1\), got 1"),
    ("sft", "data.eval_limit=0", "data.eval_limit must be at least 1 or null, got 0"),
    ("sft", "adaptive.floor=2", r"adaptive.floor must be in \[0, 1\], got 2"),
    ("hdpo", "beta=0", "beta must be above 0, got 0"),
    ("hdpo", "beta=-0.1", "beta must be above 0, got -0.1"),
    ("hdpo", "on_policy.top_p=0", r"on_policy.top_p must be in \(0, 1\], got 0"),
    ("hdpo", "rounds=0", "rounds must be at least 1, got 0"),
    ("sft", "model.preset=qwen2.5-1.5",
     r"override model.preset=qwen2.5-1.5: unknown preset .qwen2.5-1.5.; did you mean .qwen2.5-1.5b.\?"),
    ("sft", "model.lora.targets=[q_proj,v_proj]",  # PEFT's names, pointed at polyalign's
     r"expected some of q, k, v, o, gate, up, down, got \['q_proj', 'v_proj'\]; did you mean \[q, v\]"),
    ("critic", "dropout=1", r"dropout must be in \[0, 1\), got 1"),
    ("critic", "pair_batch=0", "pair_batch must be at least 1, got 0"),
    ("dpo", "data.max_length=null", "override data.max_length=null: each side of a pair is cut to it"),
    ("sft", "train.steps=[1", "train.steps=\\[1 is not a value YAML reads"),
    ("sft", "train.steps=!!python/name:os.system", "is not a value YAML reads .*no tags"),
]


@pytest.mark.parametrize(("method", "override", "message"), BAD_SETTINGS)
def test_a_bad_setting_is_one_line_naming_its_key(method, override, message, capsys):
    assert main(["train", method, "--print-config", override]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert re.search(message, captured.err), captured.err


def leaf_fields(cls, prefix=""):
    """(dotted key, field, type) of every leaf setting of a config class, sections walked."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            yield from leaf_fields(kind, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, f, kind


def numeric_fields(cls):
    """(dotted key, field) of every int or float setting of a config class."""
    return [(key, f) for key, f, kind in leaf_fields(cls) if kind in (int, float, int | None, float | None)]


def test_a_wrong_value_in_a_config_file_names_the_file_then_the_keys_path(tmp_path):
    """Every setting of every method, given a value of the wrong type in a config file, is one line naming the
    file and then the key's dotted path (`c.yaml: train.steps: expected int`; it read `c.yaml.train.steps`,
    one file's name), and an unknown key in a section names the file and the section."""
    simple = (int, float, str, bool, int | None, float | None, str | None, bool | None)
    for spec in METHODS.values():
        checked = 0
        for key, _, kind in leaf_fields(spec.config):
            if kind not in simple or key == "method":  # the method picks the schema: its own refusal
                continue
            nested = {"method": spec.name}
            node = nested
            *sections, leaf = key.split(".")
            for section in sections:
                node = node.setdefault(section, {})
            node[leaf] = {"a": 1}  # a mapping is none of the simple types
            (tmp_path / "c.yaml").write_text(yaml.safe_dump(nested))
            with pytest.raises(ConfigError) as caught:
                load_config(tmp_path / "c.yaml")
            assert str(caught.value).startswith(f"{tmp_path / 'c.yaml'}: {key}: expected "), (key, str(caught.value))
            checked += 1
        assert checked >= 30, spec.name
    (tmp_path / "c.yaml").write_text("train:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path / 'c.yaml'}: train: unknown key 'stepz'; did you "
                                                    "mean 'steps'?")):
        load_config(tmp_path / "c.yaml")


def test_every_numeric_setting_has_a_range():
    """A numeric key added to a section without a range beside it would go unchecked."""
    for spec in METHODS.values():
        fields = dict(numeric_fields(spec.config))
        unchecked = [key for key, f in fields.items() if f.metadata.get("range") is None
                     and not key.startswith("parallel.")]  # mesh sizes: -1 takes the rest, checked by the mesh
        assert not unchecked, (spec.name, unchecked)
        assert len(fields) >= 25, spec.name


def test_a_range_beside_a_field_is_what_the_config_check_applies():
    for spec in METHODS.values():
        for key, f in numeric_fields(spec.config):
            allowed = f.metadata.get("range")
            if allowed is None or allowed.low is None:
                continue
            below = allowed.low if allowed.low_open else allowed.low - 1
            with pytest.raises(ConfigError, match=re.escape(f"{key} must be {allowed}, got ")):
                load_config(None, [f"{key}={below}"], method=spec.name)


def test_the_subcommand_picks_the_method_and_refuses_another_schema(capsys, tmp_path):
    assert load_config(CONFIGS["hdpo"], [], method="dpo").method == "dpo"
    assert load_config(CONFIGS["hdpo"], ["method=ipo"], method="hdpo").method == "ipo"  # overrides come last
    # ... and said: in --print-config as a YAML comment (the output still reads back)
    assert main(["train", "dpo", "--config", str(CONFIGS["hdpo"]), "--print-config", "method=ipo"]) == 0
    printed = capsys.readouterr().out
    assert "\nmethod: ipo\n" in printed
    assert "\n# note: method=ipo (an override) trains ipo, not the subcommand's dpo\n" in printed
    assert "says method:" not in printed  # the override's note says it all
    assert main(["train", "dpo", "--config", str(CONFIGS["hdpo"]), "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert "# note: method=" not in printed
    # the file's own method, replaced by the subcommand's, is said too (at the start of a run as a note)
    assert f"\n# {CONFIGS['hdpo']} says method: hdpo; this run trains dpo, the subcommand's method\n" in printed
    assert main(["train", "hdpo", "--config", str(CONFIGS["hdpo"]), "--print-config"]) == 0
    assert "says method:" not in capsys.readouterr().out
    assert main(["train", "dpo", "--config", str(CONFIGS["hdpo"]), "--out", str(tmp_path / "nonexistent" / "out")]) == 2
    assert capsys.readouterr().err.startswith(f"note: {CONFIGS['hdpo']} says method: hdpo; this run trains dpo")
    with pytest.raises(ConfigError, match="the config is for method 'sft'; train it with `polyalign train sft`"):
        load_config(CONFIGS["sft"], [], method="hdpo")
    with pytest.raises(ConfigError, match="method 'sft' is not trained by `polyalign train critic`"):
        load_config(CONFIGS["critic"], ["method=sft"], method="critic")


@pytest.mark.parametrize("method", sorted(METHODS))
def test_print_config_shows_every_key_and_reads_back(method, capsys):
    assert main(["train", method, "--config", str(CONFIGS[method]), "--print-config", "train.steps=7"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    expected = dataclasses.asdict(load_config(CONFIGS[method], ["train.steps=7"], method=method))
    assert printed == expected
    assert printed["train"]["steps"] == 7 and printed["method"] == method
    # every default is there, not just what the file sets
    assert set(printed["model"]) == set(_fields(schema.ModelSection))

def test_print_config_says_which_keys_are_hdpos(capsys):
    for method, overrides, said in (("dpo", [], True), ("hdpo", [], False), ("dpo", ["hdpo_terms=true"], False),
                                    ("sft", [], False)):
        assert main(["train", method, "--print-config", *overrides]) == 0
        first = capsys.readouterr().out.splitlines()[0]
        assert (first == f"# lambda_dist and gamma_ftx are HDPO's terms: {method} reads them only with hdpo_terms: "
                         "true") == said, (method, overrides)


def test_a_setting_the_run_does_not_read_is_said_and_the_table_agrees_with_the_losses(capsys, monkeypatch, tmp_path):
    """Each loss setting of the preference family set for every method: said as not read exactly where changing it
    leaves the method's pair loss unchanged (computed here from polyalign.train.losses on real-sized log-probs);
    on-policy and adapter settings are said where there are no rounds or no adapters, in --print-config and when
    the run starts."""
    from polyalign.train import losses
    from polyalign.train.methods import PREFERENCE_METHODS, method_spec, unread_settings

    rng = np.random.default_rng(0)
    pairs = losses.PairLogps(*(rng.normal(-40.0, 8.0, 6) for _ in range(4)),
                             *(rng.integers(5, 30, 6).astype(np.float32) for _ in range(2)))
    changed = {"label_smoothing": 0.2, "simpo_gamma": 2.0, "kto_desirable_weight": 2.0, "kto_undesirable_weight": 3.0}
    for method in PREFERENCE_METHODS:
        base = load_config(None, [], method=method)
        assert unread_settings(base) == [], method
        loss = getattr(losses, method_spec(method).pair_loss)
        for key, value in changed.items():
            other = dataclasses.replace(base, **{key: value})
            reads = not np.allclose(np.asarray(loss(pairs, base)), np.asarray(loss(pairs, other)))
            said = [note for note in unread_settings(other) if note.startswith(f"{key}={value} is set")]
            assert bool(said) != reads, (method, key, said)
    # HDPO's own terms, read by hdpo and by the others with hdpo_terms; adaptive weighting's settings by it alone
    for method in PREFERENCE_METHODS:
        for terms in (False, True):
            config = load_config(None, ["lambda_dist=0.5", "gamma_ftx=0.2", f"hdpo_terms={terms}"], method=method)
            said = sorted(note.split("=")[0] for note in unread_settings(config))
            assert said == ([] if method == "hdpo" or terms else ["gamma_ftx", "lambda_dist"]), (method, terms, said)
    for weighting in ("uniform", "bucket", "adaptive"):
        config = load_config(None, [f"weighting={weighting}", "adaptive.step_size=0.5"], method="sft")
        assert [n.split("=")[0] for n in unread_settings(config)] == ([] if weighting == "adaptive" else
                                                                      ["adaptive.step_size"]), weighting
    assert main(["train", "kto", "--print-config", "on_policy.temperature=0.3", "model.lora.alpha=8"]) == 0
    comments = [line for line in capsys.readouterr().out.splitlines() if line.startswith("# ")]
    assert "# on_policy.temperature=0.3 is set, but this kto run does not read it (it is for on-policy rounds, " \
           "rounds > 1)" in comments
    assert ("# model.lora.alpha=8.0 is set, but this kto run does not read it (it is for adapters, "
            "model.lora.rank > 0)") in comments
    assert main(["train", "kto", "--print-config", "on_policy.temperature=0.3", "rounds=2", "model.lora.alpha=8",
                 "model.lora.rank=8"]) == 0
    assert "is set, but" not in capsys.readouterr().out
    # a key given twice: the last one wins, said
    assert main(["train", "kto", "--print-config", "optimizer.lr=1e-3", "optimizer.lr=5e-4"]) == 0
    printed = capsys.readouterr().out
    assert "# optimizer.lr is given 2 times (1e-3, then 5e-4): the last one, 5e-4, is used" in printed
    assert yaml.safe_load(printed)["optimizer"]["lr"] == 5e-4
    # said when the run starts too, before anything else can fail
    assert main(["train", "orpo", "--out", str(tmp_path / "nonexistent" / "out"), "simpo_gamma=2"]) == 2
    assert "note: simpo_gamma=2.0 is set, but this orpo run does not read it (it is for simpo)" in \
        capsys.readouterr().err
    # by process 0 of a job alone: every process reads the same command, and launch showed each note twice
    monkeypatch.setenv("POLYALIGN_PROCESS_ID", "1")
    assert main(["train", "orpo", "--out", str(tmp_path / "nonexistent" / "out"), "simpo_gamma=2"]) == 2
    assert "simpo_gamma" not in capsys.readouterr().err


def test_overrides_may_come_before_between_and_after_options(capsys):
    """key=value overrides anywhere on the line, in the order written (the last one wins); an unknown
    option is refused with the subcommand's own usage."""
    sft = str(CONFIGS["sft"])
    assert main(["train", "sft", "train.steps=3", "--config", sft, "data.max_length=64", "--print-config",
                 "train.steps=5", "optimizer.lr=0.001"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["train"]["steps"] == 5 and printed["data"]["max_length"] == 64
    assert printed["optimizer"]["lr"] == 0.001
    with pytest.raises(SystemExit):
        main(["train", "sft", "--config", sft, "--print-config", "train.steps=5", "--bogus"])
    err = capsys.readouterr().err
    assert "usage: polyalign train sft" in err and "unrecognized arguments: --bogus" in err


def test_print_config_without_a_file_gives_the_defaults(capsys):
    assert main(["train", "critic", "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed == dataclasses.asdict(schema.CriticConfig())


def test_print_config_says_the_builds_max_length_and_the_run_refuses_another(tmp_path, capsys):
    """SFT's rows were cut when `polyalign build` ran: --print-config reads the build's max_length beside
    the keys, and a different data.max_length is flagged there in the words the run refuses it with."""
    (tmp_path / "build").mkdir()
    manifest = {"options": {"max_length": 96}, "buckets": ["en"], "bucket_weights": {"en": 1.0}}
    (tmp_path / "build" / "manifest.json").write_text(json.dumps(manifest))
    notes = {}
    for length in ("null", "96", "64"):
        assert main(["train", "sft", "--print-config", f"data.dir={tmp_path}", f"data.max_length={length}"]) == 0
        notes[length] = [line for line in capsys.readouterr().out.splitlines() if "max_length" in line
                         and line.startswith("#")]
    assert notes["null"] == [f"# data.max_length is 96, {tmp_path / 'build'}'s (rows were cut when the build ran)"]
    assert notes["96"] == []
    refusal = (f"data.max_length=64: {tmp_path / 'build'} was built with max_length 96; rebuild with "
               "`polyalign build --max-length` or leave data.max_length unset")
    assert notes["64"] == [f"# {refusal} (the run refuses it)"]
    assert main(["train", "sft", "--out", str(tmp_path / "out"), f"data.dir={tmp_path}", "data.max_length=64"]) == 2
    assert refusal in capsys.readouterr().err
    # no build there yet: nothing to say, the run names what is missing
    assert main(["train", "sft", "--print-config", f"data.dir={tmp_path / 'none'}"]) == 0
    assert "# data.max_length" not in capsys.readouterr().out


def test_train_without_out_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "sft", "--config", str(CONFIGS["sft"])])
    assert exit_info.value.code == 2 and "--out is required" in capsys.readouterr().err


def test_the_cli_offers_every_registered_method(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name, spec in METHODS.items():
        assert name in text and spec.summary in text


def test_epochs_become_steps_and_eval_every_null_means_once_per_epoch():
    from polyalign.train.run import resolve_loop

    loop = resolve_loop(schema.LoopConfig(epochs=3, global_batch=16, eval_every=None), epoch_size=40, method="critic")
    assert (loop.steps, loop.eval_every) == (9, 3)  # ceil(40 / 16) = 3 steps an epoch
    assert resolve_loop(schema.LoopConfig(steps=5), epoch_size=None, method="sft").steps == 5
    with pytest.raises(ConfigError, match="train.epochs"):
        resolve_loop(schema.LoopConfig(epochs=2), epoch_size=None, method="sft")


class _DrawObjective:
    """A zero loss on a single parameter whose metric sums record the random draws the trainer gave."""

    coefficients = {"zero": 1.0}

    def denominators(self, batch):
        return {"zero": jnp.ones(batch["x"].shape[:1])}

    def numerators(self, model, micro_batch, key):
        draw = jax.random.uniform(key)
        return {"zero": 0.0 * model.w[...].sum() + 0.0 * micro_batch["x"].sum()}, {"draw": draw}


def test_the_trainer_gives_each_micro_batch_a_fresh_key_and_advances_its_own():
    from flax import nnx

    from polyalign.mesh import parallel
    from polyalign.train.trainer import Trainer

    class Model(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.zeros(3))

    seed, micro = 5, 2
    trainer = Trainer(Model(), _DrawObjective(), schema.OptimizerConfig(),
                      schema.LoopConfig(steps=3, global_batch=2, micro_batches=micro, seed=seed), parallel.make_mesh())
    batch = {"x": np.ones((micro, 1, 4), np.float32)}
    state_key = jax.random.key(seed)
    for _ in range(3):
        step_key, state_key = jax.random.split(state_key)
        expected = sum(float(jax.random.uniform(jax.random.fold_in(step_key, i))) for i in range(micro))
        metrics = jax.device_get(trainer.step(batch))
        assert float(metrics["draw"]) == pytest.approx(expected, abs=1e-6)
        np.testing.assert_array_equal(np.asarray(trainer.state["rng"]), np.asarray(jax.random.key_data(state_key)))


# --- one key changes one key: a method's defaults are the base, then a file, then overrides ---------

OTHER_STRINGS = {"model.dtype": "bfloat16", "model.export_dtype": "bfloat16", "model.remat": "full",
                 "model.attention_impl": "xla", "model.lora.init": "gaussian", "model.quantize": "nf4",
                 "model.preset": "qwen2.5-0.5b", "weighting": "uniform", "weight_normalization": "microbatch",
                 "profile": "oracle", "truncation": "keep_system", "reference": "in_step", "distance_features": "all",
                 "distance_counts": "raw"}
OTHER_LISTS = {"model.lora.targets": ["q", "v"], "train.report_to": ["tensorboard", "wandb"],
               "train.profile_steps": [2, 3]}
# A value that is valid only beside another: both keys then differ.
COMPANIONS = {"reference": {"model.lora.rank": 8}, "model.quantize": {"model.lora.rank": 8}}
# Keys whose change changes a documented default of another: adapters bring the method's LoRA
# learning rate (when optimizer.lr is not set).
DEPENDENTS = {"model.lora.rank": {"optimizer.lr"}, "reference": {"optimizer.lr"}, "model.quantize": {"optimizer.lr"}}
# Keys with no other valid value for a method: the other value is refused in one line.
ONLY_VALUE = {"critic": {"method": "sft", "data.pack": True, "model.lora.rank": 8, "model.quantize": "nf4"},
              "sft": {"method": "critic"}}


def _leaf_types(cls):
    return [(key, kind) for key, _, kind in leaf_fields(cls)]


def _other_value(method: str, key: str, kind, default):
    """A valid value of `key` that is not its default."""
    options = set(typing.get_args(kind)) - {type(None)} or {kind}
    if key == "method":
        return "ipo" if method == "dpo" else "dpo"
    if key in OTHER_STRINGS:
        return OTHER_STRINGS[key]
    if key in OTHER_LISTS:
        return OTHER_LISTS[key]
    if bool in options:
        return not default
    if int in options:
        return 3 if default is None else default + 1 if default != -1 else 2
    if float in options:
        return 0.5 if default is None else 0.25 if default == 0 else default / 2
    assert str in options, (key, kind)
    return "elsewhere" if default is None else default + "_other"


def _flat(mapping, prefix=""):
    for key, value in mapping.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield prefix + key, value


def _nested(flat: dict) -> dict:
    out: dict = {}
    for key, value in flat.items():
        *sections, leaf = key.split(".")
        node = out
        for section in sections:
            node = node.setdefault(section, {})
        node[leaf] = value
    return out


def _printed(capsys, args) -> dict:
    code = main(["train", *args, "--print-config"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    # libyaml's safe loader when PyYAML has it: the same YAML, read ~10x faster, ~300 times a run
    return dict(_flat(yaml.load(captured.out, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))))


@pytest.mark.parametrize("method", sorted(METHODS))
def test_one_key_changes_exactly_that_key_from_the_command_line_and_from_a_file(method, capsys, tmp_path):
    """For every leaf key of the method's schema: `key=<another valid value>`, and a config file holding
    only that key, give the method's defaults with that key (and only that key) changed."""
    plain = _printed(capsys, [method])
    assert plain == dict(_flat(dataclasses.asdict(load_config(None, [], method=method))))
    for key, kind in _leaf_types(METHODS[method].config):
        if key in ONLY_VALUE.get(method, {}):
            assert main(["train", method, "--print-config", f"{key}={json.dumps(ONLY_VALUE[method][key])}"]) == 2
            assert capsys.readouterr().err.count("\n") == 1
            continue
        change = {key: _other_value(method, key, kind, plain[key]), **COMPANIONS.get(key, {})}
        assert change[key] != plain[key], key
        overrides = [f"{k}={json.dumps(v)}" for k, v in change.items()]  # json writes 2.5e-07, as YAML 1.2 does
        config_file = tmp_path / f"{key}.yaml"
        config_file.write_text(yaml.safe_dump(_nested(change)))
        for args in ([method, *overrides], [method, "--config", str(config_file)]):
            printed = _printed(capsys, args)
            differ = {k for k in plain if printed[k] != plain[k]}
            if key == "method" and "--config" in args:  # the subcommand wins over the file's method
                assert differ == set(), differ
                continue
            assert differ == set(change) | DEPENDENTS.get(key, set()), (args, differ)
            assert all(printed[k] == pytest.approx(v) if isinstance(v, float) else printed[k] == v
                       for k, v in change.items()), args


def test_a_partial_section_keeps_the_methods_other_defaults(tmp_path):
    partial = tmp_path / "partial.yaml"
    partial.write_text("optimizer:\n  clip: 0.5\ntrain:\n  steps: 3\ndata:\n  dir: RUN\n")
    dpo = load_config(partial, [], method="dpo")
    assert (dpo.optimizer.lr, dpo.optimizer.clip, dpo.train.global_batch, dpo.train.steps, dpo.data.max_length,
            dpo.data.eval_batch) == (5e-7, 0.5, 8, 3, 256, 8)
    critic = load_config(partial, ["train.epochs=2"], method="critic")
    assert ((critic.data.max_length, critic.data.eval_batch, critic.train.seed, critic.train.log_every,
             critic.train.eval_every, critic.model.seed, critic.optimizer.warmup_ratio)
            == (512, 16, 42, 10, None, 42, 0.0))
    # an empty section in a file is the method's section
    empty = tmp_path / "empty.yaml"
    empty.write_text("optimizer:\ntrain:\n")
    assert load_config(empty, ["train.steps=4"], method="dpo").train.global_batch == 8


@pytest.mark.parametrize("text", ["1e-3", "5E-7", "+2e-4", "1.5e-3", "1_0e-4"])
def test_yaml_exponent_numbers_read_as_floats_where_a_float_is_expected(text, tmp_path):
    expected = float(text.replace("_", ""))
    assert load_config(None, [f"optimizer.lr={text}"], method="dpo").optimizer.lr == expected
    assert load_config(None, [f"optimizer.clip={text}"], method="dpo").optimizer.clip == expected  # float | None
    path = tmp_path / "c.yaml"
    path.write_text(f"optimizer:\n  lr: {text}\n")
    assert load_config(path, [], method="sft").optimizer.lr == expected
    with pytest.raises(ConfigError, match="override train.steps=1e-3: expected int, got str '1e-3'"):
        load_config(None, ["train.steps=1e-3"], method="sft")


@pytest.mark.parametrize("method", sorted(set(METHODS) - {"critic"}))
def test_adapters_bring_the_methods_lora_learning_rate_unless_one_is_set(method, tmp_path, capsys):
    from polyalign.train.methods import PREFERENCE_LORA_LR, SFT_LORA_LR

    expected = SFT_LORA_LR if method == "sft" else PREFERENCE_LORA_LR
    full = load_config(None, [], method=method).optimizer.lr
    assert load_config(None, ["model.lora.rank=16"], method=method).optimizer.lr == expected != full
    assert load_config(None, ["model.lora.rank=16", "optimizer.lr=1e-6"], method=method).optimizer.lr == 1e-6
    given = tmp_path / "c.yaml"
    given.write_text("optimizer:\n  lr: 3.0e-3\nmodel:\n  lora: {rank: 8}\n")
    assert load_config(given, [], method=method).optimizer.lr == 3e-3
    assert main(["train", method, "--print-config", "model.lora.rank=16"]) == 0
    out = capsys.readouterr().out
    assert yaml.safe_load(out)["optimizer"]["lr"] == expected
    assert f"# optimizer.lr {expected:g} is {method}'s learning rate with adapters" in out
    # a rate the file sets is kept with adapters, and said to be (a demo config's full-tuning rate)
    assert main(["train", method, "--config", str(given), "--print-config"]) == 0
    assert (f"# optimizer.lr 0.003 is set (by the config file or an override) and kept with adapters; {method}'s "
            f"default with adapters is {expected:g} (docs/lora.md)") in capsys.readouterr().out


def test_print_config_says_the_preset_is_unused_with_an_init(capsys, tmp_path):
    (tmp_path / "qwen").mkdir()
    assert main(["train", "dpo", "--print-config", f"init={tmp_path / 'qwen'}"]) == 0
    out = capsys.readouterr().out
    assert f"# model.preset is not used: the architecture is init's ({tmp_path / 'qwen'}/config.json)" in out
    # a path that is not there is said before the run refuses it (print-config exited 0 without a word)
    assert main(["train", "dpo", "--print-config", "init=/models/qwen"]) == 0
    assert "# init=/models/qwen: no such file or folder; the run refuses it" in capsys.readouterr().out
    assert main(["train", "sft", "--print-config"]) == 0
    # the one value a default always chooses from elsewhere: the compute dtype, from the machine
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("#")] == [
        "# model.dtype auto computes in bfloat16 on GPU and TPU, float32 on a CPU (the run's first line says which); "
        "parameters and optimizer state stay float32"]
    assert main(["train", "sft", "--print-config", "model.dtype=bfloat16"]) == 0
    assert "#" not in capsys.readouterr().out


def test_epochs_say_the_steps_they_set_in_place_of_train_steps(capsys):
    from polyalign.train.config import LoopConfig
    from polyalign.train.run import resolve_loop

    loop = resolve_loop(LoopConfig(steps=120, epochs=2, global_batch=4, eval_every=None), epoch_size=10, method="sft")
    assert loop.steps == 6 and loop.eval_every == 3  # ceil(10 / 4) = 3 steps an epoch
    assert capsys.readouterr().err.strip() == ("polyalign: train.epochs=2 sets train.steps to 6 (10 examples / "
                                               "global_batch 4 an epoch); train.steps (120) is not used")
    resolve_loop(LoopConfig(steps=6, epochs=2, global_batch=4), epoch_size=10, method="sft")
    assert capsys.readouterr().err == ""  # nothing to say when they agree


def test_a_stop_at_or_past_the_last_step_says_the_run_ends_as_usual(capsys):
    from polyalign.train.config import LoopConfig
    from polyalign.train.run import resolve_loop

    for stop_at, said in ((5, False), (6, True), (500, True)):
        assert resolve_loop(LoopConfig(steps=6, stop_at=stop_at), epoch_size=10, method="sft").stop_at == stop_at
        err = capsys.readouterr().err
        assert (err.strip() == f"polyalign: train.stop_at={stop_at} is at or past the last step (train.steps=6); "
                               "the run trains to step 6 and ends as usual") == said, err
    # with train.epochs, against the steps they set
    resolve_loop(LoopConfig(epochs=2, global_batch=4, stop_at=7), epoch_size=10, method="sft")
    assert "train.stop_at=7 is at or past the last step (train.steps=6)" in capsys.readouterr().err


def test_train_help_lists_every_own_key_with_its_default_range_and_help(capsys):
    from polyalign.core.yaml_config import settings_of
    from polyalign.train.methods import SHARED_SECTIONS

    for spec in METHODS.values():
        with pytest.raises(SystemExit):
            main(["train", spec.name, "--help"])
        text = capsys.readouterr().out
        section = text.split("The method's own keys (default, range):\n")[1].split("\n\n")[0]
        for key, f, value in settings_of(spec.config()):
            if key.split(".")[0] in SHARED_SECTIONS or key == "method":
                continue
            line = next(line for line in section.splitlines() if line.startswith(f"  {key}="))
            if f.metadata.get("range"):
                assert f"({f.metadata['range']})" in line, line
            assert f.metadata.get("help"), (spec.name, key, "has no help")


def test_model_dtype_auto_is_bfloat16_on_accelerators_and_float32_on_a_cpu(monkeypatch, capsys):
    """The compute dtype's default: bfloat16 where matrix units run it at full rate, float32 on a CPU;
    training resolves it once (after jax.distributed) and says so on an accelerator; a dtype given stays."""
    from polyalign.model.architecture import compute_dtype
    from polyalign.train.run import with_compute_dtype

    assert [compute_dtype("auto", backend) for backend in ("cpu", "gpu", "tpu")] == ["float32", "bfloat16", "bfloat16"]
    assert compute_dtype("float16", "tpu") == "float16" and compute_dtype("float32", "gpu") == "float32"
    config = load_config(REPO / "configs" / "hdpo_demo.yaml", [], method="hdpo")
    assert config.model.dtype == "auto"
    assert with_compute_dtype(config).model.dtype == "float32" and capsys.readouterr().out == ""  # a CPU: no notice
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert with_compute_dtype(config).model.dtype == "bfloat16"
    assert "polyalign: model.dtype auto: bfloat16 on gpu" in capsys.readouterr().out
    given = load_config(REPO / "configs" / "hdpo_demo.yaml", ["model.dtype=float32"], method="hdpo")
    assert with_compute_dtype(given).model.dtype == "float32"


@pytest.mark.parametrize("override, suggested", [
    ("optimizer.learning_rate=1e-3", "lr"), ("train.max_steps=10", "steps"), ("data.max_seq_length=128", "max_length"),
    ("train.gradient_accumulation_steps=2", "micro_batches"), ("model.lora.lora_r=8", "rank")])
def test_a_setting_named_as_other_trainers_name_it_points_at_polyaligns_name(override, suggested, capsys):
    from polyalign.cli import main

    assert main(["train", "sft", "--config", str(REPO / "configs" / "sft_demo.yaml"), "--out", "unused", override,
                 "--print-config"]) == 2
    key = override.split("=")[0].split(".")[-1]
    assert f"unknown key {key!r}; did you mean {suggested!r}?" in capsys.readouterr().err


def test_every_other_trainers_name_points_at_a_setting_that_exists():
    """The table is only as good as its targets: each is a setting of some method's schema."""
    import dataclasses
    import typing

    from polyalign.core.yaml_config import OTHER_TRAINERS_NAMES
    from polyalign.data.prepare import DataConfig
    from polyalign.train.methods import METHODS

    names, seen = set(), set()

    def walk(cls):
        if cls in seen:
            return
        seen.add(cls)
        for name, annotation in typing.get_type_hints(cls).items():
            names.add(name)
            for inner in (annotation, *typing.get_args(annotation)):
                if dataclasses.is_dataclass(inner):
                    walk(inner)

    for spec in METHODS.values():
        walk(spec.config)
    walk(DataConfig)
    assert set(OTHER_TRAINERS_NAMES.values()) <= names, set(OTHER_TRAINERS_NAMES.values()) - names


def test_a_run_says_what_it_is_about_to_do():
    """The steps, batch, devices, schedule and start of a run, from its resolved config (the warmup as
    make_optimizer computes it)."""
    from pathlib import Path

    from polyalign.mesh import parallel
    from polyalign.train.methods import load_config
    from polyalign.train.run import start_line

    config = load_config(CONFIGS["hdpo"], ["init=runs/bucket_sft/model", "train.steps=40", "train.global_batch=8",
                                           "train.micro_batches=2", "optimizer.min_lr_ratio=0.5"], method="hdpo")
    line = start_line(config, config.train, parallel.make_mesh(), Path("runs/hdpo"))
    assert line == ("polyalign: training hdpo for 40 steps, global batch 8 in 2 micro-batches, on 1 cpu device "
                    "(data 1, fsdp 1, tensor 1), computing in float32; learning rate 2.0e-04, 4 warmup steps, cosine "
                    "to 1.0e-04; from runs/bucket_sft/model -> runs/hdpo")
    config = load_config(CONFIGS["sft"], ["optimizer.warmup_ratio=0"], method="sft")
    assert "; learning rate 3.0e-03, cosine to 3.0e-04; from scratch (model.preset tiny) -> " in start_line(
        config, config.train, parallel.make_mesh(), Path("out"))


def test_the_cli_silences_transformers_advice_that_pytorch_is_missing(monkeypatch, capsys):
    """MAUVE and the build's tokenizer check import transformers where it is installed, which advises on
    stderr that PyTorch is missing; polyalign asks it for no model, so the CLI turns the advice off
    (TRANSFORMERS_NO_ADVISORY_WARNINGS), leaving a user's own setting alone."""
    import os

    monkeypatch.delenv("TRANSFORMERS_NO_ADVISORY_WARNINGS", raising=False)
    assert main(["train", "critic", "--print-config"]) == 0
    assert os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] == "1"
    monkeypatch.setenv("TRANSFORMERS_NO_ADVISORY_WARNINGS", "0")
    assert main(["train", "critic", "--print-config"]) == 0
    assert os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] == "0"


def test_a_critic_ranking_held_out_pairs_backwards_is_warned_about():
    from polyalign.train.critic import summary_line

    result = {"best_epoch": 4, "val_pairs": 22, "out": "critic",
              "val": {"l1": 0.0341, "ranking_accuracy": 0.273, "auc": 0.285}}
    line = summary_line(result)
    assert line.splitlines()[0] == ("critic: best epoch 4, validation L1 0.0341 (its support distances' mean error), "
                                    "ranking accuracy 0.273 on 22 held-out pairs (the chosen answer put nearer people "
                                    "than the rejected one), chosen-vs-rejected AUC 0.285 (0.5 is chance)")
    assert line.splitlines()[-1].startswith("warning: the critic ranks held-out pairs worse than chance (0.273)")
    result["val"]["ranking_accuracy"] = 0.75
    assert "warning" not in summary_line(result)


def test_a_preference_run_says_which_numbers_are_its_last_batch_and_which_validation():
    """The last step's batch (4 pairs) can read accuracy 1.000 where validation reads 0.818: the summary
    names each; without an evaluation at the last step it shows the batch's alone."""
    from polyalign.train.preference import summary_line

    last = {"rewards/margin": 0.1636, "rewards/accuracy": 1.0, "val_rewards/margin": 0.0912,
            "val_rewards/accuracy": 0.8182}
    result = {"method": "dpo", "end_step": 4, "start_step": 0, "seconds": 9.0, "train_pairs": 86, "val_pairs": 22,
              "last": last, "model": "out/model"}
    line = summary_line(result).splitlines()[0]
    assert line.endswith("on 86 pairs; last step's batch: reward margin 0.1636, accuracy 1.000; validation "
                         "(22 pairs): reward margin 0.0912, accuracy 0.818"), line
    result["last"] = {k: v for k, v in last.items() if not k.startswith("val_")}
    assert summary_line(result).splitlines()[0].endswith("last step's batch: reward margin 0.1636, accuracy 1.000")
    # HDPO's distance term, validation's where it was measured, else the batch's: a lambda_dist sweep shows
    result["last"] = {**last, "dist_reg": 0.61, "dist_reach": 0.2, "val_dist_reg": 0.618792, "val_dist_reach": 0.0734}
    assert summary_line(result).splitlines()[0].endswith(
        "accuracy 0.818; its distance term dist_reg 0.6188, dist_reach 0.073"), summary_line(result)
    result["last"] = {"rewards/margin": 0.1636, "rewards/accuracy": 1.0, "dist_reg": 0.61, "dist_reach": 0.2}
    assert summary_line(result).splitlines()[0].endswith(
        "accuracy 1.000; the batch's distance term dist_reg 0.6100, dist_reach 0.200")


def test_a_switch_reads_as_yaml_writes_it_and_as_1_0_or_a_quoted_word(tmp_path):
    """data.pack=yes/off (YAML 1.1), 1/0 and "false" in quotes are the switch; 2 and "maybe" are refused."""
    for given, read in (("yes", True), ("off", False), ("1", True), ("0", False), ("'false'", False),
                        ('"True"', True)):
        assert load_config(None, [f"data.pack={given}"], method="sft").data.pack is read, given
    path = tmp_path / "sft.yaml"
    path.write_text('method: sft\ndata:\n  pack: "false"\n')
    assert load_config(path, [], method="sft").data.pack is False
    for given in ("2", "maybe"):
        with pytest.raises(ConfigError, match="data.pack"):
            load_config(None, [f"data.pack={given}"], method="sft")


def test_an_sft_run_says_which_objective_its_training_loss_is():
    """The training loss is the last batch's objective, weighted as the run weighs buckets (adaptive weights
    too); the validation loss, a plain mean, is the one to compare runs by."""
    from polyalign.train.sft import summary_line

    result = {"end_step": 20, "start_step": 0, "seconds": 9.0, "last": {"loss": 7.5, "val_loss": 7.2}, "model": "m"}
    said = {w: summary_line({**result, "weighting": w}).splitlines()[0] for w in ("uniform", "bucket", "adaptive")}
    assert said["uniform"].endswith("final loss 7.5000 (the last batch's objective), validation loss 7.2000 (mean "
                                    "over examples: compare runs by it)")
    assert "(the last batch's bucket-weighted objective)" in said["bucket"]
    assert "(the last batch's adaptively bucket-weighted objective)" in said["adaptive"]


def test_a_model_card_says_the_objective_and_the_data_it_was_trained_on():
    """training_card: SFT names its weighting (Bucket-SFT, plain or adaptive: their exports are otherwise
    alike), a preference method its pairs file (the default one under data.dir when none is set)."""
    from polyalign.model.export import training_card

    for weighting in ("bucket", "uniform", "adaptive"):
        card = training_card(load_config(CONFIGS["sft"], [f"weighting={weighting}", "data.dir=runs/x"], method="sft"))
        assert card["weighting"] == weighting and card["pairs"] is None and card["data"] == "runs/x"
    # a model folder copied away from its run still says what set it apart from its recipe's other runs
    card = training_card(load_config(CONFIGS["sft"], ["data.dir=runs/x", "train.seed=3", "optimizer.min_lr_ratio=0.5"],
                                     method="sft"))
    assert card["seed"] == "data order 3, initialisation 0" and card["global batch"] == 16
    assert card["optimizer"] == ("AdamW, learning rate 0.003 (0.1 of the steps warming up, cosine to 0.5 of it), "
                                 "weight decay 0.01, clip 1.0")
    card = training_card(load_config(CONFIGS["hdpo"], ["data.dir=runs/x", "init=runs/x/sft/model"], method="hdpo"))
    assert card["seed"] == "data order 0"  # the weights are init's
    assert card["pairs"] == "runs/x/critic/train_pairs.jsonl" and card["weighting"] is None


def test_an_abbreviated_or_misspelt_option_is_refused_naming_the_one_meant(capsys):
    """argparse took `--bootstrap-draw` for `--bootstrap-draws`: options are written out in full, and the
    refusal names the option meant."""
    for argv, meant in ((["evaluate", "--records", "r", "--predictions", "p", "--out", "o", "--bootstrap-draw", "50"],
                         "--bootstrap-draws"),
                        (["generate", "--checkpoint", "c", "--records", "r", "--out", "o", "--temp", "0.7"],
                         "--temperature or --template"),
                        (["generate", "--checkpoint", "c", "--records", "r", "--out", "o", "--temperture", "0.7"],
                         "--temperature")):
        with pytest.raises(SystemExit) as stopped:
            main(argv)
        assert stopped.value.code == 2
        assert capsys.readouterr().err.rstrip().endswith(f"; did you mean {meant}?")
    # nothing close: no guess (never --help); a training command says how its settings are given
    for argv, said in ((["evaluate", "--records", "r", "--predictions", "p", "--out", "o", "--hlep"], "--hlep"),
                       (["train", "sft", "--stepz", "5"],
                        "--stepz; settings are key=value overrides (train.steps=5), not options")):
        with pytest.raises(SystemExit):
            main(argv)
        assert capsys.readouterr().err.rstrip().endswith(f"unrecognized arguments: {said}")


def test_a_build_option_given_to_an_sft_run_is_pointed_at_the_build():
    """`train sft truncation=turns` (and the build's other rendering flags): an SFT run trains on a build, so
    the refusal names `polyalign build`'s flag instead of the nearest config key ('train' for truncation)."""
    from polyalign.core.yaml_config import BUILD_FLAGS

    for key, flag in BUILD_FLAGS.items():
        with pytest.raises(ConfigError) as caught:
            load_config(CONFIGS["sft"], [f"{key}=x"], method="sft")
        assert str(caught.value) == (f"override {key}=x: unknown key {key!r}: SFT examples are rendered and cut when "
                                     f"they are built (`polyalign build RUN {flag} ...`); an SFT run trains on the "
                                     "build data.dir names")
    assert load_config(CONFIGS["hdpo"], ["truncation=turns"], method="hdpo").truncation == "turns"  # its own key
    for method in ("critic", "dpo"):  # they train on no build: no such pointer
        with pytest.raises(ConfigError) as caught:
            load_config(CONFIGS[method], ["template=x"], method=method)
        assert "polyalign build" not in str(caught.value)
