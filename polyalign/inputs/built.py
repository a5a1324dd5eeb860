"""What a build is made with and what it recorded, read without the build's own dependencies (TensorFlow
Datasets, JAX): its options, its manifest (RUN/build/manifest.json), the command that makes it again and
the records its tokenizer check reads. The trainer, the config checks, `--print-config`, `plan` and `show`
import this; the step benchmarks run on machines that hold the trainer's packages alone."""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from polyalign.core.paths import as_path, changed_since, recorded_path
from polyalign.core.yaml_config import ConfigError
from polyalign.data.layout import split_files
from polyalign.data.records import Record

BUILD_DIR = "build"
PREPARE_MANIFEST = "data/manifest.json"  # the prepare a build was made from
SPLITS = ("train", "val")


@dataclass(frozen=True)
class BuildOptions:
    tokenizer: str | None = None  # directory or file; default RUN/tokenizer
    template: str | None = None  # default: the tokenizer's own (polyalign for polyalign's tokenizer)
    profile: str = "context"
    max_length: int = 512  # the METHOD section 8 cutoff
    train_on: str = "last"
    # How a record's own system prompt (its source's system message) meets the profile prompt:
    # keep (the source's text, a blank line, the profile prompt), replace or drop (chat.SYSTEM_MODES).
    system: str = "keep"
    # Bucket-SFT weights: the scheme's (buckets/*.yaml `weights:`), with these keys replacing its own;
    # {"preset": "method"} starts from a preset instead (data.bucketing.WEIGHT_PRESETS).
    weights: dict[str, Any] = field(default_factory=dict)
    # How a prompt over its share of max_length is cut (TRUNCATIONS): left (METHOD's recipe) from its
    # start; keep_system keeps the opening system message (the profile prompt) and cuts the oldest tokens
    # after it; turns keeps it and drops the oldest whole turns, as generation does.
    truncation: str = "left"

    def __post_init__(self):  # the manifest names the tokenizer whichever folder the build ran from
        object.__setattr__(self, "tokenizer", recorded_path(self.tokenizer))


def probe_records(run: Path, count: int) -> list[Record]:
    """`count` records spread evenly over the train and val files (every k-th row), the probe set of the
    tokenizer check; only those rows are parsed, so a Beam build's driver reads them cheaply too."""
    files = [path for split in SPLITS for path in split_files(run, split)]
    rows = 0
    for path in files:
        with open(path, encoding="utf-8") as handle:
            rows += sum(1 for line in handle if line.strip())
    step, chosen, row = max(1, rows // count), [], 0
    for path in files:
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                if line.strip():
                    if row % step == 0 and len(chosen) < count:
                        chosen.append(Record.from_json(json.loads(line)))
                    row += 1
    return chosen


def built_manifest(data_dir) -> dict[str, Any] | None:
    """The build manifest of the run `data_dir` names, or None where it has none (yet) or it cannot be read:
    the run says why when it opens the build (inputs/build.py read_manifest)."""
    if data_dir is None:
        return None
    try:
        manifest = json.loads((Path(str(data_dir)) / "build" / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and isinstance(manifest.get("options"), dict) else None


def build_tokenizer_path(run, manifest: dict[str, Any]):
    """The tokenizer a build used: where the manifest says, or RUN/tokenizer when the run was copied or
    moved (to a bucket, another host) and that path is not there."""
    recorded, inside = as_path(manifest["tokenizer"]), as_path(run) / "tokenizer"
    return recorded if recorded.exists() or not inside.exists() else inside


def read_manifest(run, init: str | None = None) -> dict[str, Any]:
    """RUN/build/manifest.json, once checked to have been made from the prepare that RUN/data holds now.
    `init`: the checkpoint a run trains from, whose tokenizer the build command it suggests names when RUN
    has no tokenizer of its own (`polyalign build RUN` alone would look for RUN/tokenizer)."""
    path = as_path(run) / BUILD_DIR / "manifest.json"
    if not path.is_file() and (as_path(run) / "manifest.json").is_file() and (as_path(run) / "train.jsonl").is_file():
        # RUN/data given for RUN: prepare's output folder, whose parent is the run the build goes into
        parent = as_path(run).parent
        built = " (built there already)" if (parent / BUILD_DIR / "manifest.json").is_file() else ""
        raise ConfigError(f"{run}: this is prepare's output folder inside a run; give the run itself, "
                          f"data.dir={parent}{built}")
    if not path.is_file():
        own = (as_path(run) / "tokenizer").exists() or init is None
        command = shlex.join(["polyalign", "build", str(run), *([] if own else ["--tokenizer", str(init)])])
        raise ConfigError(f"{path}: missing; run `{command}` (or the demo's build stage) first")
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: damaged, not JSON ({err}); run `polyalign build {run} --overwrite`") from None
    if not isinstance(manifest, dict):
        raise ConfigError(f"{path}: not a build manifest; run `polyalign build {run} --overwrite`")
    made_from = manifest.get("made_from", {})
    # tokens.tokenizer loads sentencepiece and tokenizers, which the config checks (built_manifest) never need
    from polyalign.tokens.tokenizer import CHAT_TEMPLATE_FILE

    # a recorded chat_template.jinja now gone brings the config's template back: a change too (changed_since
    # passes over missing files, which an output copied without its inputs lacks)
    removed = [name for name, digest in made_from.items() if digest and Path(name).name == CHAT_TEMPLATE_FILE
               and not (as_path(run) / name).is_file() and (as_path(run) / name).parent.is_dir()]
    for name in [*changed_since(run, made_from), *removed]:  # builds made before it was recorded: unchecked
        if name == PREPARE_MANIFEST:
            why = f"made from another {name} than the one there now (`polyalign prepare` ran again?)"
        else:  # the tokenizer's own files: its ids or its chat template are no longer the ones the build encoded
            why = (f"encoded with {name}, which is gone (the config's chat template would be exported instead)"
                   if name in removed else
                   f"encoded with another {name} than the one there now (the tokenizer or its chat template "
                   "changed since; training on it would teach ids or a template its export does not have)"
                   if made_from[name] else f"encoded before {name} was there (it replaces the chat template)")
        raise ConfigError(f"{as_path(run) / BUILD_DIR}: {why}; rerun `{rebuild_command(run, manifest)}`")
    return manifest


# The build command's flags for BuildOptions' fields and weight keys, to say the command that made a build.
BUILD_FLAGS = {"tokenizer": "--tokenizer", "template": "--template", "profile": "--profile", "system": "--system",
               "max_length": "--max-length", "train_on": "--train-on", "truncation": "--truncation"}
WEIGHT_FLAGS = {"preset": "--weights", "temperature": "--weight-temperature", "clip": "--clip-weights",
                "borrow_below": "--borrow-below", "min_bucket_size": "--min-bucket-size"}


# What a build recorded without saying: builds made before --truncation existed cut prompts from the left.
LEGACY_SETTINGS = {"truncation": "left"}


def rebuild_command(run, manifest: dict[str, Any]) -> str:
    """The `polyalign build` command with the options a build was made with (as they were given, its
    settings), the ones at their defaults left out: what makes that build again."""
    given = {**LEGACY_SETTINGS, **(manifest.get("settings") or {})}
    defaults = asdict(BuildOptions())
    words = ["polyalign", "build", str(run)]
    for key, flag in BUILD_FLAGS.items():
        if given.get(key) is not None and given[key] != defaults[key]:
            words += [flag, str(given[key])]
    for key, flag in WEIGHT_FLAGS.items():
        value = (given.get("weights") or {}).get(key)
        if value is not None:
            words += [flag, *map(str, value if isinstance(value, list) else [value])]
    return shlex.join(words)
