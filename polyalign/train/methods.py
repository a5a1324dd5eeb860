"""The training methods polyalign knows, and how a method's config is read.

A method is one entry in METHODS: its config schema (polyalign/train/config.py), the module whose
`setup(config, mesh, progress)` returns the Job the run harness trains (polyalign/train/run.py), and
its help text. `polyalign train NAME`, `polyalign plan` and the demo read this table, so adding a
method touches the table, not the CLI.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import textwrap
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

from polyalign.core.errors import UnknownKeyError
from polyalign.core.paths import is_uri
from polyalign.core.yaml_config import (
    BUILD_FLAGS,
    ConfigError,
    apply_overrides,
    blamed_on_override,
    from_mapping,
    load_mapping,
    out_of_range,
    section_keys,
    settings_of,
)
from polyalign.inputs.built import built_manifest
from polyalign.tokens.profile_template import PROFILE_MODES, TRUNCATIONS
from polyalign.train import config as schema


@dataclass(frozen=True)
class MethodSpec:
    name: str
    config: type  # the config dataclass
    module: str  # defines setup(config, mesh, progress) -> Job and summary_line(result) -> str
    summary: str  # one line in `polyalign train --help`
    description: str
    example: str  # a config to start from, relative to the repository
    epilog: str = ""
    # optimizer.lr when model.lora.rank > 0 and neither the file nor an override sets optimizer.lr:
    # adapters start at B = 0 and move far less per step than full weights at the same rate
    lora_lr: float | None = None
    # Preference methods: the function of polyalign/train/losses.py that is the method's loss of one pair
    # (named, so that reading the table never imports jax), and whether it compares against a reference
    # policy (without one there is no reference pass, and rewards are beta x the policy's mean log-prob per token).
    pair_loss: str | None = None
    needs_reference: bool = True

    def implementation(self) -> ModuleType:
        return importlib.import_module(self.module)


_PREFERENCE_EPILOG = """\
  init=SFT_CHECKPOINT data.dir=RUN (scored pairs from RUN/critic/)
  beta, lambda_dist, gamma_ftx, label_smoothing, profile, truncation; model.dtype, model.remat,
  model.attention_impl, model.logprob_chunk; data.max_length; optimizer.*, train.*, parallel.*
  data.pack=true               whole pairs packed into rows of 2 x data.max_length, each prompt computed
                               once for both responses (exact; train.global_batch then counts rows)
  model.lora.rank=16           train LoRA adapters on the frozen init (model.lora.alpha, .targets,
                               .dropout; model.quantize=nf4|int8 for QLoRA); reference=in_step computes
                               the reference (the base, adapters off) in each step instead of before

`polyalign train dpo` (and ipo, robust_dpo, ln_dpo, simpo, orpo, kto) is `train hdpo` with that
method; hdpo_terms=true adds HDPO's pair weights, distance term and SFT anchor to any of them.
Reference log-probs come from the initial checkpoint, computed once (not for simpo and orpo, which
need none). Logs rewards (chosen, rejected, margin, accuracy), sft_anchor, and dist_reg and dist_gap
where the pairs carry critic scores, per step, margins per bucket, and the same on the validation pairs
every train.eval_every steps. Writes OUT/model at the end; resumes like train sft.
"""


# The methods' learning rates with adapters (docs/lora.md): the usual QLoRA SFT rate, and for the
# preference losses the 1e-4..5e-5 order: at full tuning's 5e-7 adapters (B = 0 at the start) barely
# move, and the reward margin still reads 0.0000 after the first steps.
SFT_LORA_LR, PREFERENCE_LORA_LR = 2e-4, 5e-5


def _preference(name: str, summary: str, pair_loss: str, needs_reference: bool = True) -> MethodSpec:
    return MethodSpec(
        name, schema.PreferenceConfig, "polyalign.train.preference", summary,
        "HDPO: pair-weighted DPO + lambda_dist * critic distance + gamma_ftx * length-normalised NLL of the "
        "human response; DPO and IPO are the same run without the critic terms.",
        "configs/hdpo_demo.yaml", _PREFERENCE_EPILOG, lora_lr=PREFERENCE_LORA_LR, pair_loss=pair_loss,
        needs_reference=needs_reference)


METHODS: dict[str, MethodSpec] = {
    "sft": MethodSpec(
        "sft", schema.SftConfig, "polyalign.train.sft", "Bucket-Aware SFT (or plain SFT with weighting=uniform)",
        "Bucket-Aware SFT: sum_i w_i l_i / sum_i w_i over each global batch.", "configs/sft_demo.yaml",
        lora_lr=SFT_LORA_LR,
        epilog="""\
  weighting: bucket | uniform | adaptive   Bucket-SFT weights from the build, plain SFT, or weights
                                   that follow the buckets' losses (adaptive.step_size, adaptive.floor)
  init: /path/to/hf/checkpoint     start from a checkpoint (build with its tokenizer) instead of
                                   training model.preset from scratch
  data.dir=RUN data.pack=true      the build to train on; pack examples into rows (exact)
  model.lora.rank=16               train LoRA adapters on a frozen base (model.lora.alpha, .targets,
                                   .dropout; model.quantize=nf4|int8 for QLoRA); docs/lora.md
  train.steps / global_batch / micro_batches / checkpoint_every / eval_every / stop_at

Writes OUT/metrics.jsonl (one JSON object per step: loss, lr, grad_norm, tokens/s, per-bucket
losses; validation losses per bucket every eval_every steps), OUT/tensorboard/, OUT/checkpoints/
(Orbax, the last keep_checkpoints kept) and, at the end, OUT/model (safetensors + config.json + the
tokenizer). Running the same command again resumes from the latest checkpoint; SIGTERM or Ctrl-C
saves a checkpoint and exits. Several processes (GPU nodes, CPU tests) start with
POLYALIGN_COORDINATOR=host:port POLYALIGN_NUM_PROCESSES=N POLYALIGN_PROCESS_ID=i; TPU VMs need nothing.
"""),
    "critic": MethodSpec(
        "critic", schema.CriticConfig, "polyalign.train.critic", "the support-distance critic (docs/preference.md)",
        "Train the critic c(y, b) on the frozen SFT encoder; write its scores onto the pairs "
        "(OUT/train_pairs.jsonl, OUT/val_pairs.jsonl).", "configs/critic_demo.yaml", """\
  init=SFT_CHECKPOINT pairs=TRAIN_PAIRS val_pairs=VAL_PAIRS data.dir=RUN (for RUN/stats/references.json)
  train.epochs, train.global_batch (regression rows per step), pair_batch, dropout, data.max_length
  (response tokens encoded), data.eval_batch (responses per encoding batch)

Encodes every human and model response once with the frozen SFT model (mean-pooled final hidden
states), computes its support distance to its bucket's train-only human references, and trains
Linear(H+64, 256) GELU Dropout Linear(256, 256) GELU Dropout Linear(256, 1) over the response and a
learned bucket embedding: mean |c - d| + mean max(0, 0.1 - c(model) + c(human)). Keeps the epoch with
the best validation loss, reports validation L1 and pairwise ranking accuracy (OUT/critic.json), and
refuses to score pairs when every pair ties. It trains in seconds and keeps no checkpoints.
"""),
    "hdpo": _preference("hdpo", "HDPO from the SFT checkpoint (DPO / IPO with method=dpo / ipo)", "dpo_pair_loss"),
    "dpo": _preference("dpo", "DPO from the SFT checkpoint (the HDPO run without the critic terms)", "dpo_pair_loss"),
    "ipo": _preference("ipo", "IPO from the SFT checkpoint", "ipo_pair_loss"),
    "robust_dpo": _preference("robust_dpo", "robust DPO (noisy preference labels, rate label_smoothing)",
                              "robust_dpo_pair_loss"),
    "ln_dpo": _preference("ln_dpo", "DPO on per-token log-probs: no margin for being longer", "ln_dpo_pair_loss"),
    "simpo": _preference("simpo", "SimPO: reference-free, length-normalised, target margin simpo_gamma",
                         "simpo_pair_loss", needs_reference=False),
    "orpo": _preference("orpo", "ORPO: reference-free, chosen NLL plus beta x log odds ratio", "orpo_pair_loss",
                        needs_reference=False),
    "kto": _preference("kto", "KTO: human responses desirable, the model's samples undesirable, each on its own",
                       "kto_pair_loss"),
}
# The methods trained by `polyalign train hdpo`'s harness: every entry with a pair loss.
PREFERENCE_METHODS = tuple(name for name, spec in METHODS.items() if spec.pair_loss is not None)


SHARED_SECTIONS = ("model", "data", "optimizer", "train", "parallel")


@functools.cache  # every parser build asks for every method's; a test session builds hundreds
def settings_help(config_class: type) -> str:
    """The method's own keys as `polyalign train METHOD --help` lists them: each with its default, its
    range and its help, all read from the fields (train/config.py)."""
    lines = []
    for key, f, value in settings_of(config_class()):
        if key.split(".")[0] in SHARED_SECTIONS or key == "method":
            continue
        allowed, text = f.metadata.get("range"), f.metadata.get("help", "")
        shown = "null" if value is None else str(value).lower() if isinstance(value, bool) else value
        head = f"  {key}={shown}" + (f" ({allowed})" if allowed else "")
        body = textwrap.wrap(text, 104 - 32)
        if not body:
            lines.append(head)
            continue
        lines += [f"{head:<32}{body[0]}"] if len(head) < 32 else [head, f"{'':<32}{body[0]}"]
        lines += [f"{'':<32}{more}" for more in body[1:]]
    return "The method's own keys (default, range):\n" + "\n".join(lines) + "\n"


def shared_sections_help() -> str:
    """The sections every method shares with their keys, "model (preset, dtype, ...), ... and parallel
    (...)", read from the schema so that `train --help` names every key there is."""
    def keys(section) -> str:
        return ", ".join(f.name for f in dataclasses.fields(section))

    config = schema.SftConfig()
    parts = [f"{name} ({keys(getattr(config, name))})" for name in SHARED_SECTIONS]
    return ", ".join(parts[:-1]) + " and " + parts[-1]


def method_spec(name: str, where: str = "config") -> MethodSpec:
    try:
        return METHODS[name]
    except KeyError:
        raise ConfigError(f"{where}: unknown method {name!r} (known: {', '.join(METHODS)})") from None


def _rename_deprecated(mapping: dict[str, Any], config_class: type, where: str) -> dict[str, Any]:
    """The mapping with old top-level keys moved to their places in the shared schema; a value also
    given at the new place wins."""
    out = {key: dict(value) if isinstance(value, dict) else value for key, value in mapping.items()
           if key not in schema.DEPRECATED_KEYS.get(config_class, {})}
    for key, value in mapping.items():
        for target in schema.deprecated_targets(config_class, key, where) or ():
            section, name = target.split(".")
            node = out.setdefault(section, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{where}: {section!r} must be a mapping")
            node.setdefault(name, value)
    return out


def _renamed_override(item: str, config_class: type) -> list[str]:
    key, sep, value = item.partition("=")
    targets = schema.deprecated_targets(config_class, key, "override") if sep else None
    return [f"{target}={value}" for target in targets] if targets else [item]


def _yaml_value(raw: str, item: str) -> Any:
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        raise ConfigError(f"override: {item} is not a value YAML reads; quote strings, and no tags") from None


def load_config(path: Path | None, overrides: list[str] = (), method: str | None = None) -> Any:
    """The typed config of a training run: the YAML file (None: every default), then `method` (the
    `polyalign train METHOD` subcommand), then `key=value` overrides. The method decides the schema.
    Unknown keys and bad values are errors naming the file and key; what only a run needs (init,
    data.dir) is checked by the method's setup, so any config can be printed."""
    where = str(path or "config")
    raw = load_mapping(path)
    name = str(raw.get("method", "sft"))
    if method is not None:  # the subcommand wins over the file within a family (`train dpo` on an HDPO config)
        if "method" in raw and method_spec(name, where).config is not method_spec(method).config:
            raise ConfigError(f"{where}: the config is for method {name!r}; train it with `polyalign train {name}`")
        raw["method"] = name = method
    for item in overrides:
        key, _, value = item.partition("=")
        if key == "method":  # read as every override is: method=dpo and method="dpo" are one method
            name = str(_yaml_value(value, item))
    spec = method_spec(name, where)
    if method is not None and spec.config is not method_spec(method).config:
        raise ConfigError(f"{where}: method {spec.name!r} is not trained by `polyalign train {method}`; "
                          f"use `polyalign train {spec.name}`")
    raw = _rename_deprecated(raw, spec.config, where)
    renamed = [new for item in overrides for new in _renamed_override(item, spec.config)]
    apply_overrides(raw, renamed)
    try:
        config = from_mapping(spec.config, raw, where)
        config = with_lora_defaults(config, spec, lr_given="lr" in (raw.get("optimizer") or {}))
        check_config(config, where)
    except ConfigError as err:
        raise blamed_on_override(another_methods_setting(err, where, spec), where, renamed) from None
    return config


def another_methods_setting(err: ConfigError, where: str, spec: MethodSpec) -> ConfigError:
    """An unknown top-level key that is another method's setting (`beta` given to SFT, `weighting` to DPO)
    said as such, naming the methods that read it, rather than pointed at a look-alike key of this one."""
    if not isinstance(err, UnknownKeyError) or not err.top_level:
        return err
    key = err.key
    readers = [name for name, other in METHODS.items() if key in {f.name for f in dataclasses.fields(other.config)}]
    # a key of one of this method's sections given bare, or a build's flag given to SFT, is pointed there
    # (unknown_key_message)
    if not readers or section_keys(spec.config, key) or (key in BUILD_FLAGS and getattr(spec.config,
                                                                                        "BUILD_SETTINGS", False)):
        return err
    return ConfigError(f"{where}: unknown key {key!r}: {key} is a setting of {', '.join(readers)}, not of {spec.name} "
                       f"(polyalign train {readers[0]})")


def retargeted_note(path: Path | None, method: str | None) -> str | None:
    """What `polyalign train METHOD --config C` says when C is another method's config of the same family
    (`train hdpo` on a DPO config trains HDPO: the subcommand wins, load_config); None otherwise."""
    written = str(load_mapping(path).get("method", "")) if path is not None and method is not None else ""
    if not written or written == method:
        return None
    return f"{path} says method: {written}; this run trains {method}, the subcommand's method"


def with_lora_defaults(config: Any, spec: MethodSpec, lr_given: bool) -> Any:
    """`config` with the method's LoRA learning rate when it trains adapters and no one set optimizer.lr."""
    if not config.model.lora.rank or lr_given or spec.lora_lr is None:
        return config
    return dataclasses.replace(config, optimizer=dataclasses.replace(config.optimizer, lr=spec.lora_lr))


def derived_notes(config: Any) -> list[str]:
    """What --print-config says beside the keys: values a default chose from other keys."""
    spec = method_spec(config.method)
    notes = []
    if config.model.lora.rank and spec.lora_lr is not None and config.optimizer.lr == spec.lora_lr:
        notes.append(f"optimizer.lr {spec.lora_lr:g} is {spec.name}'s learning rate with adapters (the default "
                     f"when model.lora.rank is set and optimizer.lr is not; full tuning's is "
                     f"{spec.config().optimizer.lr:g})")
    elif config.model.lora.rank and spec.lora_lr is not None:
        # a demo config's full-tuning rate, kept under adapters, would otherwise pass unremarked
        notes.append(f"optimizer.lr {config.optimizer.lr:g} is set (by the config file or an override) and kept with "
                     f"adapters; {spec.name}'s default with adapters is {spec.lora_lr:g} (docs/lora.md)")
    if getattr(config.model, "dtype", None) == "auto":  # said without starting JAX on a machine others may hold
        notes.append("model.dtype auto computes in bfloat16 on GPU and TPU, float32 on a CPU (the run's first line "
                     "says which); parameters and optimizer state stay float32")
    if config.init is not None and not is_uri(config.init) and not Path(config.init).exists():
        # said here too: --print-config is how a user checks a command before running it
        notes.append(f"init={config.init}: no such file or folder; the run refuses it")
    elif config.init is not None:
        notes.append(f"model.preset is not used: the architecture is init's ({config.init}/config.json)")
    if config.train.epochs is not None:
        notes.append(f"train.steps {config.train.steps} is not used: train.epochs={config.train.epochs} sets the steps "
                     "when the run starts, from the training data's epoch size (the run prints the number)")
    if isinstance(config, schema.SftConfig):
        notes.extend(_built_length_notes(config))
    notes.extend(_defaulted_pairs_notes(config))
    return notes


def _defaulted_pairs_notes(config: Any) -> list[str]:
    """Where an unset pairs or val_pairs is read from (RUN/critic/, the critic's scored pairs): printed as
    null, it read as "none" to a user the run then refused for the missing default file."""
    if not hasattr(config, "pair_file") or config.data.dir is None:
        return []
    notes = []
    for key in ("pairs", "val_pairs"):
        if getattr(config, key) is None:
            path = config.pair_file(key)
            missing = "" if is_uri(path) or Path(path).is_file() else ": no such file; the run refuses it"
            notes.append(f"{key} null reads {path} (the critic's scored pairs in data.dir){missing}")
    return notes


# Settings only some runs read, as (key, who reads it, whether this run does): one set where it is not read is
# said (--print-config beside the keys, a note when the run starts), not silently ignored.
_READ_BY = (
    ("label_smoothing", "dpo, hdpo, robust_dpo, ln_dpo and simpo",
     lambda c: c.method in ("dpo", "hdpo", "robust_dpo", "ln_dpo", "simpo")),
    ("simpo_gamma", "simpo", lambda c: c.method == "simpo"),
    ("kto_desirable_weight", "kto", lambda c: c.method == "kto"),
    ("kto_undesirable_weight", "kto", lambda c: c.method == "kto"),
    ("reference", "the methods with a reference model, not simpo or orpo",
     lambda c: method_spec(c.method).needs_reference),
    ("on_policy", "on-policy rounds, rounds > 1", lambda c: c.rounds > 1),
    ("lambda_dist", "hdpo, and the other preference methods with hdpo_terms: true",
     lambda c: c.method == "hdpo" or c.hdpo_terms),
    ("gamma_ftx", "hdpo, and the other preference methods with hdpo_terms: true",
     lambda c: c.method == "hdpo" or c.hdpo_terms),
    ("adaptive", "weighting: adaptive", lambda c: c.weighting == "adaptive"),
    ("model.lora.alpha", "adapters, model.lora.rank > 0", lambda c: c.model.lora.rank > 0),
    ("model.lora.targets", "adapters, model.lora.rank > 0", lambda c: c.model.lora.rank > 0),
    ("model.lora.dropout", "adapters, model.lora.rank > 0", lambda c: c.model.lora.rank > 0),
    ("model.lora.init", "adapters, model.lora.rank > 0", lambda c: c.model.lora.rank > 0),
)


def unread_settings(config: Any) -> list[str]:
    """The settings that differ from the method's defaults (set by the config file or an override) but that
    this run does not read: `kto_desirable_weight` in an ORPO run, `on_policy.temperature` with one round."""
    defaults = {key: value for key, _, value in settings_of(method_spec(config.method).config())}
    notes = []
    for key, _, value in settings_of(config):
        if value == defaults.get(key):
            continue
        for setting, readers, reads in _READ_BY:  # a setting, or a key of a section of them (on_policy)
            if (key == setting or key.startswith(f"{setting}.")) and not reads(config):
                notes.append(f"{key}={value} is set, but this {config.method} run does not read it (it is for "
                             f"{readers})")
    return notes


def built_length_mismatch(config: Any, built: int) -> str | None:
    """SFT trains on the rows `polyalign build` cut to its --max-length: another data.max_length is refused
    by the run (this message) and flagged by --print-config beside the keys."""
    if config.data.max_length in (None, built):
        return None
    run = Path(str(config.data.dir))
    return (f"data.max_length={config.data.max_length}: {run / 'build'} was built with max_length {built}; rebuild "
            "with `polyalign build --max-length` or leave data.max_length unset")


def _built_length_notes(config: Any) -> list[str]:
    """The build's max_length when data.dir has a build to read it from (none yet: the run checks it)."""
    manifest = built_manifest(config.data.dir)
    built = (manifest or {}).get("options", {}).get("max_length")
    if built is None:  # no build yet, or not one this can read: the run says
        return []
    mismatch = built_length_mismatch(config, built)
    if mismatch:
        return [f"{mismatch} (the run refuses it)"]
    build = Path(str(config.data.dir)) / "build"
    return [f"data.max_length is {built}, {build}'s (rows were cut when the build ran)"] \
        if config.data.max_length is None else []


def _check_choice(where: str, key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        shown = ", ".join("null" if c is None else str(c) for c in choices)
        raise ConfigError(f"{where}: {key} must be one of {shown}, got {value!r}")


def check_ranges(config: Any, where: str = "config") -> None:
    """Every numeric setting inside the range its field declares (train/config.py), named by its key; the
    batch divisible into micro-batches."""
    problem = out_of_range(config, where)
    if problem:
        raise ConfigError(problem)
    loop = config.train
    if loop.global_batch % loop.micro_batches:
        raise ConfigError(f"{where}: train.global_batch ({loop.global_batch}) must be divisible by "
                          f"train.micro_batches ({loop.micro_batches})")


def check_config(config: Any, where: str = "config") -> None:
    """Values every method shares the meaning of, and each method's own choices."""
    # heavy: polyalign.model imports jax, kept out of --help
    from polyalign.model.architecture import ATTENTION_IMPLEMENTATIONS, COMPUTE_DTYPES, REMAT_POLICIES

    _check_choice(where, "model.dtype", config.model.dtype, COMPUTE_DTYPES)
    _check_choice(where, "model.export_dtype", config.model.export_dtype, (None, "float32", "bfloat16", "float16"))
    _check_choice(where, "model.remat", config.model.remat, REMAT_POLICIES)
    _check_choice(where, "model.attention_impl", config.model.attention_impl, ATTENTION_IMPLEMENTATIONS)
    for tracker in config.train.report_to:
        _check_choice(where, "train.report_to", tracker, schema.TRACKERS)
    steps = config.train.profile_steps
    if steps is not None and (len(steps) != 2 or not 1 <= steps[0] <= steps[1]):
        raise ConfigError(f"{where}: train.profile_steps: expected [first, last] with 1 <= first <= last, got "
                          f"{list(steps)}")
    check_ranges(config, where)
    _check_lora(config, where)
    _check_preset(config, where)
    if isinstance(config, schema.SftConfig):
        _check_choice(where, "weighting", config.weighting, schema.WEIGHTINGS)
        _check_choice(where, "weight_normalization", config.weight_normalization, schema.NORMALIZATIONS)
    elif isinstance(config, schema.PreferenceConfig):
        _check_choice(where, "method", config.method, PREFERENCE_METHODS)
        _check_choice(where, "profile", config.profile, PROFILE_MODES)
        _check_choice(where, "truncation", config.truncation, TRUNCATIONS)
        _check_choice(where, "reference", config.reference, schema.REFERENCES)
        if config.data.max_length is None:
            raise ConfigError(f"{where}: data.max_length: each side of a pair is cut to it (docs/model.md), so "
                              "the preference methods need a number (default 256), not null")
        if config.reference == "in_step" and not config.model.lora.rank:
            raise ConfigError(f"{where}: reference: in_step computes the reference as the base with the adapters "
                              "off, which needs model.lora.rank > 0 (full tuning has no frozen base to use)")
    elif isinstance(config, schema.CriticConfig):
        from polyalign.features.references import COUNTS  # heavy: numpy, kept out of --help

        _check_choice(where, "distance_features", config.distance_features, schema.DISTANCE_FEATURES)
        _check_choice(where, "distance_counts", config.distance_counts, COUNTS)
        if config.data.pack:
            raise ConfigError(f"{where}: data.pack: the critic reads pooled encodings, which have nothing to pack")


def _check_preset(config: Any, where: str) -> None:
    """A preset name is checked where the config is read (--print-config included), not when training
    starts; an architecture file is read then."""
    from polyalign.model.presets import PRESETS  # heavy: polyalign.model imports jax, kept out of --help

    name = getattr(config.model, "preset", None)
    if name is None or getattr(config, "init", None) or name in PRESETS or str(name).endswith((".yaml", ".yml")):
        return
    close = difflib.get_close_matches(str(name), list(PRESETS), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ConfigError(f"{where}: model.preset: unknown preset {name!r}{hint} (known: {', '.join(PRESETS)}; or a "
                      "YAML file like configs/models/tiny.yaml)")


def _check_lora(config: Any, where: str) -> None:
    # heavy: polyalign.model imports jax, kept out of --help
    from polyalign.model.architecture import LORA_INITS, LORA_TARGETS, QUANTIZE_KINDS

    lora = config.model.lora
    unknown = [t for t in lora.targets if t not in LORA_TARGETS]
    if unknown or not lora.targets:
        # PEFT's and transformers' module names (q_proj, self_attn.v_proj, mlp.down_proj), the ones users bring
        peft = {path.split(".")[-1]: name for name, path in LORA_TARGETS.items()}
        meant = [peft.get(str(t).split(".")[-1], t if t in LORA_TARGETS else None) for t in lora.targets]
        hint = (f"; did you mean [{', '.join(meant)}] (polyalign's names for PEFT's {', '.join(map(str, unknown))})?"
                if lora.targets and all(meant) else "")
        raise ConfigError(f"{where}: model.lora.targets: expected some of {', '.join(LORA_TARGETS)}, got "
                          f"{list(lora.targets)}{hint}")
    _check_choice(where, "model.lora.init", lora.init, LORA_INITS)
    _check_choice(where, "model.quantize", config.model.quantize, (None, *QUANTIZE_KINDS))
    if config.model.quantize and not lora.rank:
        raise ConfigError(f"{where}: model.quantize: a quantised base is frozen, so it trains adapters only; set "
                          "model.lora.rank > 0 (QLoRA)")
    if lora.rank and isinstance(config, schema.CriticConfig):
        raise ConfigError(f"{where}: model.lora: the critic trains its head on frozen encodings; adapters on its "
                          "encoder are not supported")


def require(config: Any, *keys: str, hint: str = "") -> None:
    """Raises a ConfigError naming the first of `keys` (dotted) that is unset; `hint` says what it is."""
    for key in keys:
        node = config
        for part in key.split("."):
            node = getattr(node, part)
        if node is None:
            raise ConfigError(f"{key} is not set; pass {key}=PATH{f' ({hint})' if hint else ''}")


def config_as_yaml(config: Any) -> str:
    """Every key of a resolved config with its value, as YAML a run could read back; a preference method
    other than HDPO is told, in a comment, which keys are HDPO's."""
    text = yaml.safe_dump(dataclasses.asdict(config), sort_keys=False, allow_unicode=True)
    if getattr(config, "hdpo_terms", True) or config.method == "hdpo":
        return text
    return (f"# lambda_dist and gamma_ftx are HDPO's terms: {config.method} reads them only with hdpo_terms: true\n"
            + text)
