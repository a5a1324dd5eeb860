"""Named architectures: the demo's tiny model and the public checkpoints the method was run on.

Real presets describe shapes only (for planning, benchmarks and abstract evaluation); weights always
come from the user's Hugging Face checkpoint through `load_hf_checkpoint`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from polyalign.core.yaml_config import load_yaml
from polyalign.model.architecture import ModelConfig, ModelConfigError, RopeScaling, family_defaults

# One YAML file per architecture; the repository's configs/models/ is this folder.
ARCHITECTURES = Path(__file__).with_name("architectures")
PRESETS: dict[str, Path] = {path.stem: path for path in sorted(ARCHITECTURES.glob("*.yaml"))}
_TUPLE_FIELDS = ("eos_token_id", "layer_types")


def read_architecture(path: Path) -> tuple[str, dict[str, Any]]:
    """(family, fields) of an architecture file such as configs/models/qwen2.5-1.5b.yaml."""
    raw = load_yaml(Path(path))
    if not isinstance(raw, dict) or "family" not in raw:
        raise ModelConfigError(f"{path}: expected a mapping with 'family' and the architecture's sizes")
    fields = dict(raw)
    family = fields.pop("family")
    if isinstance(fields.get("rope_scaling"), dict):
        fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
    for name in _TUPLE_FIELDS:
        if isinstance(fields.get(name), list):
            fields[name] = tuple(fields[name])
    return family, fields


def preset(name: str, **overrides: Any) -> ModelConfig:
    """The named architecture (a file of configs/models, or the path of a YAML file in that format);
    keywords override fields (dtype, scan_layers, remat, vocab_size, ...)."""
    path = PRESETS.get(name)
    if path is None and str(name).endswith((".yaml", ".yml")):
        path = Path(name)
        if not path.is_file():
            raise ModelConfigError(f"{path}: no such architecture file")
    if path is None:
        raise ModelConfigError(f"unknown model preset {name!r} (known: {', '.join(PRESETS)}; or a YAML file "
                               "like configs/models/tiny.yaml)")
    family, fields = read_architecture(path)
    try:
        return family_defaults(family, **{**fields, **overrides})
    except TypeError as err:  # an unknown field name
        raise ModelConfigError(f"{path}: {err}") from None


def preset_or_file(value: str) -> str:
    """argparse type for a model shape: what `preset` reads (a preset name or the path of an architecture
    YAML file), refused with its message otherwise."""
    try:
        preset(value)
    except ModelConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return value
