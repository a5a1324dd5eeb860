"""Configuration loading: YAML (safe loader only) into dataclasses, with unknown keys rejected and the
closest known key suggested, and dotted `key=value` overrides from the command line."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from polyalign.core.errors import ConfigError, UnknownKeyError
from polyalign.core.ranges import Range

T = TypeVar("T")


class _UniqueKeyLoader(yaml.SafeLoader):
    """The safe loader, refusing a key given twice in one mapping: YAML keeps the last silently, so a
    source written `name: a` ... `name: b` was named b and a second `scheme:` replaced the first."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: keys given beside it override the base's
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (list, dict)):  # unhashable: the safe loader's own error says so
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} given twice in one mapping",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_yaml(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text ({err.reason})") from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # the safe loader's tags only (_UniqueKeyLoader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ConfigError(f"{where}: invalid YAML: {getattr(err, 'problem', err)}") from None


# Names other trainers (transformers' TrainingArguments, TRL, optax examples) give settings that
# polyalign names otherwise: an unknown key that is one of them is pointed at polyalign's name.
OTHER_TRAINERS_NAMES = {
    "learning_rate": "lr", "max_steps": "steps", "num_train_epochs": "epochs", "num_epochs": "epochs",
    "batch_size": "global_batch", "train_batch_size": "global_batch", "gradient_accumulation_steps": "micro_batches",
    "warmup": "warmup_ratio", "max_grad_norm": "clip", "grad_clip": "clip", "adam_beta1": "b1", "adam_beta2": "b2",
    "adam_epsilon": "eps", "max_seq_length": "max_length", "max_len": "max_length", "logging_steps": "log_every",
    "eval_steps": "eval_every", "save_steps": "checkpoint_every", "save_total_limit": "keep_checkpoints",
    "lora_r": "rank", "r": "rank", "lora_alpha": "alpha"}


# Settings of how SFT examples are built, which an SFT config cannot hold: `polyalign build`'s flags.
BUILD_FLAGS = {"truncation": "--truncation", "train_on": "--train-on", "system": "--system",
               "template": "--template", "tokenizer": "--tokenizer"}


def unknown_key_message(key: str, known: Sequence[str], where: str, prefix: str = "",
                        nested: Sequence[str] = (), built: bool = False) -> str:
    """`where: unknown key 'k'` with the nearest known key, else the known ones. Keys that all begin with
    `prefix` are compared without it, which would make every key look close to every other. `nested`:
    the config's dotted keys, from its root, that end in `key` (or in its name in other trainers), meant
    when a key is given without its section or in another (`lr=1e-3`, `train.lr` for optimizer.lr). `built`:
    the config trains on a build (its class says BUILD_SETTINGS), so a build's flag given to it is pointed
    at `polyalign build`."""
    alias = OTHER_TRAINERS_NAMES.get(key)
    stems = {k.removeprefix(prefix): k for k in known}
    close = [alias] if alias in known else list(nested) or [
        stems[c] for c in difflib.get_close_matches(key.removeprefix(prefix), list(stems), n=1, cutoff=0.5)]
    hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else f" (known: {', '.join(known)})"
    if built and key in BUILD_FLAGS and not nested:
        hint = (f": SFT examples are rendered and cut when they are built (`polyalign build RUN {BUILD_FLAGS[key]} "
                "...`); an SFT run trains on the build data.dir names")
    return f"{where}: unknown key {key!r}{hint}"


def section_keys(cls: type, key: str, path: str = "") -> list[str]:
    """The dotted keys of `cls`'s sections (dataclass fields, at any depth) whose last part is `key` or
    its name in other trainers: where a key given without its section belongs."""
    names = {key, OTHER_TRAINERS_NAMES.get(key)}
    found = []
    for f in dataclasses.fields(cls):
        annotation = typing.get_type_hints(cls)[f.name]
        if not dataclasses.is_dataclass(annotation):
            continue
        inner = {g.name for g in dataclasses.fields(annotation)}
        found += [f"{path}{f.name}.{name}" for name in sorted(names & inner)]
        found += section_keys(annotation, key, f"{path}{f.name}.")
    return found


# A number as YAML 1.2 writes it and YAML 1.1 (PyYAML) reads as a string: 1e-3, 5E-7, +2e4.
_NUMBER = re.compile(r"[-+]?(\d[\d_]*(\.\d*)?|\.\d+)([eE][-+]?\d+)?")


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def key_place(where: str, key: str) -> str:
    """Where key `key` of the mapping read at `where` stands, for messages: the file, then the key's dotted
    path (`sft.yaml: train`, then `sft.yaml: train.steps`; `sft.yaml.train.steps` read as one file's name)."""
    return f"{where}.{key}" if ": " in where else f"{where}: {key}"


def _convert(value: Any, annotation: Any, where: str, default: Any = None, root: type | None = None) -> Any:
    """`value` as `annotation`; a mapping for a section starts from `default`, the section the
    enclosing class gives that field, so that it changes only the keys it names. `root`: the class of
    the whole config, where an unknown key is looked for in every section."""
    origin = typing.get_origin(annotation)
    if dataclasses.is_dataclass(annotation):
        return from_mapping(annotation, value, where, base=default if isinstance(default, annotation) else None,
                            root=root)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value is None:
            return None
        errors = []
        for option in options:
            try:
                return _convert(value, option, where, default, root)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0])
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__}")
        (item_type, *_) = typing.get_args(annotation) or (Any,)
        items = [_convert(v, item_type, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
        return dict(value)
    if annotation is Any:
        return value
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is float and isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        return float(value.strip().replace("_", ""))
    # a switch as 1/0 (data.pack=1) or quoted ("false" in a file), as YAML's yes/off already are
    if annotation is bool and type(value) is int and value in (0, 1):
        return bool(value)
    if annotation is bool and isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if annotation in (str, int, float, bool) and not isinstance(value, annotation) or (
        annotation is int and isinstance(value, bool)
    ):
        raise ConfigError(f"{where}: expected {annotation.__name__}, got {type(value).__name__} {value!r}")
    return value


def from_mapping(cls: type[T], mapping: Any, where: str, base: T | None = None, root: type | None = None) -> T:
    """Build dataclass `cls` from a mapping, checking keys and simple types. Keys the mapping does not
    name keep their value in `base` (default: the class's defaults), at any depth: a nested section
    given in part keeps the rest of the section `base`, or the field's default, holds."""
    if mapping is None:
        mapping = {}
    if not isinstance(mapping, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(mapping).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in mapping.items():
        if key not in fields:
            raise UnknownKeyError(unknown_key_message(str(key), list(fields), where,
                                                      nested=section_keys(root or cls, str(key)),
                                                      built=getattr(root or cls, "BUILD_SETTINGS", False)),
                                  str(key), top_level=root is None)
        default = getattr(base, key) if base is not None else _field_default(fields[key])
        kwargs[key] = _convert(value, hints[key], key_place(where, str(key)), default, root or cls)
    if base is not None:
        return dataclasses.replace(base, **kwargs)
    missing = [name for name, f in fields.items() if name not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{where}: missing key {missing[0]!r}")
    return cls(**kwargs)


def apply_overrides(mapping: dict[str, Any], overrides: list[str], where: str = "override",
                    schema: type | None = None) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides (value parsed as YAML) to a nested mapping, in place. With `schema`
    (the dataclass the mapping becomes), an override into a mapping-valued setting the file does not
    give (`split.weights.test=0.2`) changes that key of its default and keeps the others."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{where}: expected key=value, got {item!r}")
        node, section = mapping, schema
        parts = key.split(".")
        for part in parts[:-1]:
            if node.get(part) is None:  # absent, or a section left empty in the file (`optimizer:`)
                node[part] = _default_mapping(section, part)
            node = node[part]
            section = _section_type(section, part)
            if not isinstance(node, dict):
                raise ConfigError(f"{where}: {key!r} goes through a value that is not a mapping")
        try:
            node[parts[-1]] = yaml.safe_load(raw)
        except yaml.YAMLError as error:
            problem = getattr(error, "problem", None) or str(error).splitlines()[0]
            raise ConfigError(f"{where}: {key}={raw} is not a value YAML reads ({problem}); quote strings, "
                              "and no tags") from None
    return mapping


def blamed_on_override(err: ConfigError, where: str, overrides: list[str]) -> ConfigError:
    """An error about a key a `key=value` override set names that override, not the file it never was in."""
    message = str(err)
    for item in reversed(overrides):  # the last override of a key is the one that took effect
        key = item.partition("=")[0]
        parts = key.split(".")
        # an unknown key anywhere along the override's path: `optimzer.lr=...` as well as `train.stepz=...`
        unknown = [f"{key_place(where, '.'.join(parts[:k])) if k else where}: unknown key {parts[k]!r}"
                   for k in range(len(parts))]
        if message.startswith(f"{key_place(where, key)}:"):  # about the value itself: the override names the key
            return ConfigError(f"override {item}: {message[len(key_place(where, key)) + 1:].strip()}")
        for blamed in (f"{where}: {key} ", *unknown):
            if message.startswith(blamed):
                return ConfigError(f"override {item}: {message[len(where) + 1:].strip()}")
    return err


def _default_mapping(section: type | None, name: str) -> dict[str, Any]:
    """A copy of setting `name`'s default where it is a mapping (not a section), else an empty one."""
    fields = {f.name: f for f in dataclasses.fields(section)} if dataclasses.is_dataclass(section) else {}
    default = _field_default(fields[name]) if name in fields else None
    return copy.deepcopy(default) if isinstance(default, dict) else {}


def _section_type(section: type | None, name: str) -> type | None:
    """The dataclass of section `name` inside `section`, or None where it is no section."""
    if not dataclasses.is_dataclass(section):
        return None
    annotation = typing.get_type_hints(section).get(name)
    return annotation if dataclasses.is_dataclass(annotation) else None


def load_mapping(path: Path | None) -> dict[str, Any]:
    """The mapping a YAML config file holds (None or an empty file: an empty mapping)."""
    raw = (load_yaml(Path(path)) if path is not None else None) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping")
    return raw


def setting(default: Any = dataclasses.MISSING, *, range: Range | None = None, help: str = "",
            factory: Any = dataclasses.MISSING) -> Any:
    """A config field with what it means and the values it admits beside it (dataclass field metadata):
    `out_of_range` reads the range, `polyalign train METHOD --help` the help."""
    return dataclasses.field(default=default, default_factory=factory, metadata={"range": range, "help": help})


def settings_of(config: Any, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, Any]]:
    """(dotted key, field, value) of every leaf setting of a config instance, sections walked."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            yield from settings_of(value, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, f, value


def out_of_range(config: Any, where: str) -> str | None:
    """The one line for the first setting outside the range its field declares, or None."""
    for key, f, value in settings_of(config):
        allowed = f.metadata.get("range")
        if allowed is not None and not allowed.admits(value):
            return f"{where}: {allowed.refusal(key, value)}"
    return None
