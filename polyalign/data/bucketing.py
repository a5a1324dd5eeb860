"""Bucket schemes (buckets/*.yaml): dimensions, length unit and bins, source labels, and the
Bucket-Aware SFT weights of METHOD.md section 4."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polyalign.config import ConfigError, from_mapping, load_yaml
from polyalign.data.text import LENGTH_UNIT_PATTERNS

LABEL_FIELDS = ("track", "family", "style")


@dataclass(frozen=True)
class LengthBin:
    name: str
    max: int | None = None


@dataclass(frozen=True)
class WeightOptions:
    temperature: float = 1.0
    min_bucket_size: int = 0
    clip: list[float] | None = None


@dataclass(frozen=True)
class SchemeFile:
    name: str
    dimensions: list[str]
    values: dict[str, Any]
    length_bins: list[LengthBin]
    length_unit: str = "v2"
    weights: WeightOptions = field(default_factory=WeightOptions)
    reference_min_bucket_size: int = 20
    sources: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Scheme:
    """A validated bucket scheme."""

    name: str
    dimensions: tuple[str, ...]
    values: dict[str, tuple[str, ...]]
    length_bins: tuple[LengthBin, ...]
    length_unit: str
    weights: WeightOptions
    reference_min_bucket_size: int
    sources: dict[str, dict[str, str]]
    path: str = ""

    def length_bin(self, length: int) -> str:
        for length_bin in self.length_bins:
            if length_bin.max is None or length <= length_bin.max:
                return length_bin.name
        raise AssertionError("the last length bin is open")

    def bucket_id(self, values: Mapping[str, str]) -> str:
        return "|".join(values[d] for d in self.dimensions)

    def all_buckets(self) -> list[str]:
        axes = [self.values[d] if d != "length_bin" else tuple(b.name for b in self.length_bins) for d in self.dimensions]
        return ["|".join(combo) for combo in itertools.product(*axes)]

    def check_value(self, dimension: str, value: str) -> str | None:
        """None if `value` is allowed for `dimension`, else the reason."""
        allowed = self.values.get(dimension)
        if allowed is not None and value not in allowed:
            return f"unknown {dimension} {value!r} (the scheme allows {', '.join(allowed)})"
        return None


def load_scheme(path: Path) -> Scheme:
    raw = from_mapping(SchemeFile, load_yaml(path), str(path))
    where = str(path)
    if raw.length_unit not in LENGTH_UNIT_PATTERNS:
        raise ConfigError(f"{where}: length_unit must be one of {sorted(LENGTH_UNIT_PATTERNS)}, got {raw.length_unit!r}")
    values = {}
    for dimension in ("language", "track", "family", "style"):
        items = raw.values.get(dimension)
        if not isinstance(items, list) or not items or not all(isinstance(v, str) for v in items):
            raise ConfigError(f"{where}: values.{dimension} must be a non-empty list of names")
        values[dimension] = tuple(items)
    for dimension in raw.dimensions:
        if dimension not in values and dimension != "length_bin":
            raise ConfigError(f"{where}: dimension {dimension!r} has no values")
    bins = tuple(raw.length_bins)
    bounds = [b.max for b in bins]
    if not bins or bounds[-1] is not None or any(b is None for b in bounds[:-1]) or bounds[:-1] != sorted(set(bounds[:-1])):
        raise ConfigError(f"{where}: length_bins need rising 'max' bounds and an open last bin")
    sources = {}
    for name, labels in raw.sources.items():
        if not isinstance(labels, dict) or set(labels) - set(LABEL_FIELDS):
            raise ConfigError(f"{where}: sources.{name} must map track/family/style to values")
        for key, value in labels.items():
            if value not in values[key]:
                raise ConfigError(f"{where}: sources.{name}.{key}: unknown value {value!r}")
        sources[str(name)] = dict(labels)
    return Scheme(
        name=raw.name, dimensions=tuple(raw.dimensions), values=values, length_bins=bins,
        length_unit=raw.length_unit, weights=raw.weights, reference_min_bucket_size=raw.reference_min_bucket_size,
        sources=sources, path=str(path),
    )


def bucket_weights(counts: Mapping[str, int], options: WeightOptions = WeightOptions()) -> dict[str, float]:
    """Per-bucket Bucket-SFT weights from train counts: w_b proportional to n_b^-t, scaled so that the mean
    weight over records is 1 (t = 1 gives N / (K n_b): every bucket gets equal total mass). Buckets below
    `min_bucket_size` get 0; `clip` bounds the result."""
    eligible = {b: n for b, n in counts.items() if n > 0 and n >= options.min_bucket_size}
    weights = {b: 0.0 for b in counts}
    if not eligible:
        return weights
    total = sum(eligible.values())
    raw = {b: float(n) ** (-options.temperature) for b, n in eligible.items()}
    scale = total / sum(eligible[b] * raw[b] for b in eligible)
    for b in eligible:
        weights[b] = raw[b] * scale
    if options.clip is not None:
        low, high = options.clip
        weights = {b: (min(max(w, low), high) if b in eligible else 0.0) for b, w in weights.items()}
    return weights
