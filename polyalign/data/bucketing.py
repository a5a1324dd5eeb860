"""Bucket schemes (buckets/*.yaml): dimensions, length unit and bins, source labels, and the
Bucket-Aware SFT weights of METHOD.md section 4."""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polyalign.core.outputs import differing_keys
from polyalign.core.scores import MIN_INTERVAL_ROWS
from polyalign.core.yaml_config import ConfigError, from_mapping, key_place, load_yaml
from polyalign.data.text import LENGTH_UNIT_PATTERNS

LABEL_FIELDS = ("track", "family", "style")


@dataclass(frozen=True)
class LengthBin:
    name: str
    max: int | None = None


@dataclass(frozen=True)
class WeightOptions:
    """How Bucket-SFT weights follow bucket sizes: w_b proportional to n_b^-temperature over the train
    split, with n_b replaced by its parent group's mean bucket size when the bucket has fewer than
    `borrow_below` records, scaled to mean 1 over records, then clipped. `warn_above` only reports."""

    temperature: float = 0.5
    clip: list[float] | None = field(default_factory=lambda: [0.2, 5.0])  # [w_min, w_max] or None
    min_bucket_size: int = 0  # buckets smaller than this get weight 0 (leave the objective)
    borrow_below: int = 20  # smaller buckets take the weight of their parent group (see bucket_weights)
    warn_above: float = 10.0  # the stats report and `polyalign build` warn about larger weights


# `default` keeps a handful of records from dominating a batch; `method` is METHOD section 4 exactly
# (N / (K n_b), every bucket equal total mass), which gave a 1-record demo bucket weight 565.
WEIGHT_PRESETS = {
    "default": WeightOptions(),
    "method": WeightOptions(temperature=1.0, clip=None, borrow_below=0),
}


def weight_options(mapping: Mapping[str, Any] | None, where: str) -> WeightOptions:
    """WeightOptions from a `weights:` mapping: `preset` (default | method) and any field overriding it."""
    mapping = dict(mapping or {})
    name = mapping.pop("preset", "default")
    if name not in WEIGHT_PRESETS:
        raise ConfigError(f"{key_place(where, 'preset')}: unknown weight preset {name!r} "
                          f"(known: {', '.join(WEIGHT_PRESETS)})")
    options = from_mapping(WeightOptions, {**dataclasses.asdict(WEIGHT_PRESETS[name]), **mapping}, where)
    if options.clip is not None and (len(options.clip) != 2 or not 0 <= options.clip[0] <= options.clip[1]
                                     or not 0 < options.clip[1] < math.inf):
        # w_max 0 set every weight to 0: a build whose every example trains nothing
        raise ConfigError(f"{key_place(where, 'clip')}: expected [w_min, w_max] with 0 <= w_min <= w_max and a "
                          f"finite w_max > 0, got {options.clip}")
    return options


@dataclass(frozen=True)
class SchemeFile:
    name: str
    dimensions: list[str]
    values: dict[str, Any]
    length_bins: list[LengthBin]
    length_unit: str = "v2"
    weights: dict[str, Any] = field(default_factory=dict)  # a preset and overrides (weight_options)
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
    definition: Any = field(default=None, compare=False, repr=False)  # the file's mapping (scheme_from_mapping)

    def length_bin(self, length: int) -> str:
        for length_bin in self.length_bins:
            if length_bin.max is None or length <= length_bin.max:
                return length_bin.name
        raise AssertionError("the last length bin is open")

    def bucket_id(self, values: Mapping[str, str]) -> str:
        return "|".join(values[d] for d in self.dimensions)

    def all_buckets(self) -> list[str]:
        axes = [self.values[d] if d != "length_bin" else tuple(b.name for b in self.length_bins)
                for d in self.dimensions]
        return ["|".join(combo) for combo in itertools.product(*axes)]

    def check_value(self, dimension: str, value: str) -> str | None:
        """None if `value` is allowed for `dimension`, else the reason."""
        allowed = self.values.get(dimension)
        if allowed is not None and value not in allowed:
            return f"unknown {dimension} {value!r} (the scheme allows {', '.join(allowed)})"
        return None


DIMENSIONS = ("language", "track", "family", "style", "length_bin")


def load_scheme(path: Path) -> Scheme:
    """The scheme of a YAML file (buckets/polyalign.yaml is the reference, docs/data.md the guide)."""
    return scheme_from_mapping(load_yaml(path), str(path), str(path))


def scheme_from_mapping(mapping: Any, where: str, path: str = "") -> Scheme:
    """A validated scheme from its file's mapping (`where` names it in errors; `path`: the file it came
    from). The scheme keeps the mapping (`definition`), so that a prepared run can record the scheme its
    records were bucketed by and later stages read that one, not the file as it is now."""
    raw = from_mapping(SchemeFile, mapping, where)
    if raw.length_unit not in LENGTH_UNIT_PATTERNS:
        raise ConfigError(f"{where}: length_unit must be one of {sorted(LENGTH_UNIT_PATTERNS)}, "
                          f"got {raw.length_unit!r}")
    values = {}
    for dimension in ("language", "track", "family", "style"):
        items = raw.values.get(dimension)
        if not isinstance(items, list) or not items or not all(isinstance(v, str) for v in items):
            raise ConfigError(f"{where}: values.{dimension} must be a non-empty list of names")
        values[dimension] = tuple(items)
    for dimension in raw.dimensions:
        if dimension not in DIMENSIONS:
            close = difflib.get_close_matches(str(dimension), DIMENSIONS, n=1)
            raise ConfigError(f"{where}: dimensions: unknown dimension {dimension!r}"
                              + (f"; did you mean {close[0]!r}?" if close else "")
                              + f" (a bucket id is made of {', '.join(DIMENSIONS)}, in the order you list them)")
    repeated = sorted({d for d in raw.dimensions if raw.dimensions.count(d) > 1})
    if repeated or not raw.dimensions:
        raise ConfigError(f"{where}: dimensions: " + (f"{', '.join(repeated)} listed twice" if repeated else
                                                      "none listed (a bucket id needs at least one)"))
    bins = tuple(raw.length_bins)
    bins_problem = _length_bins_problem(bins)
    if bins_problem:
        raise ConfigError(f"{where}: length_bins: {bins_problem}")
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
        length_unit=raw.length_unit, weights=weight_options(raw.weights, f"{where}: weights"),
        reference_min_bucket_size=raw.reference_min_bucket_size,
        sources=sources, path=path, definition=mapping,
    )


def _length_bins_problem(bins: tuple[LengthBin, ...]) -> str | None:
    """What is wrong with a scheme's length bins, naming the bin: every bin but the last has a `max` above
    the one before it, and the last has none (it holds every longer response)."""
    if not bins:
        return "none listed (at least one bin: the last, with no max, holds every length)"
    for k, length_bin in enumerate(bins):
        said = f"bin {k + 1} ({length_bin.name!r})"
        if k == len(bins) - 1:
            if length_bin.max is not None:
                return (f"the last {said} has max {length_bin.max}: the last bin has no max, so that a response "
                        f"longer than {length_bin.max} has a bin")
        elif length_bin.max is None:
            return f"{said} has no max: only the last bin is open"
        elif k and length_bin.max <= bins[k - 1].max:
            return f"{said} has max {length_bin.max}, not above the bin before it ({bins[k - 1].max})"
    names = [b.name for b in bins]
    if len(set(names)) < len(names):
        return f"two bins are named {sorted({n for n in names if names.count(n) > 1})[0]!r}"
    return None


def prepared_scheme(manifest: Mapping[str, Any], manifest_path: Path) -> tuple[Scheme, list[str]]:
    """The scheme a prepared run's records were bucketed by, as its manifest records it, with a note where
    the scheme file has changed since (its records keep the buckets they were given). A manifest of an
    earlier release records only the file: that is read, as it is now."""
    recorded = manifest.get("scheme") or {}
    path = Path(recorded.get("path") or "")
    if recorded.get("definition") is None:
        if not path.is_file():
            raise ConfigError(f"{manifest_path}: the run's bucket scheme {path} is missing; run its "
                              "`polyalign prepare` again")
        return load_scheme(path), []
    scheme = scheme_from_mapping(recorded["definition"], f"{manifest_path}: scheme", str(path))
    notes = []
    try:
        now = load_yaml(path) if path.is_file() else None
    except ConfigError:  # the file broken since: the recorded scheme is the one that counts
        now = "unreadable"
    if now is None:
        notes.append(f"{path} (the scheme prepare bucketed the run by) is gone: its definition as prepare read it "
                     f"is in {manifest_path}, and is used")
    elif now != recorded["definition"]:
        changed = (differing_keys(recorded["definition"], now) if isinstance(now, dict)
                   else ["it no longer reads as YAML"])
        notes.append(f"{path} has changed since prepare bucketed this run ({', '.join(changed[:4])}"
                     f"{f' and {len(changed) - 4} more' if len(changed) > 4 else ''}): its records keep the buckets "
                     f"and length bins of the scheme as prepare read it (in {manifest_path}), which is used here; "
                     "run `polyalign prepare --overwrite` to bucket them by the file as it is now")
    return scheme, notes


def parent_groups(bucket: str) -> list[str]:
    """The groups a bucket id belongs to, nearest first: en|single|qa|long -> en|single|qa, en|single, en."""
    parts = bucket.split("|")
    return ["|".join(parts[:k]) for k in range(len(parts) - 1, 0, -1)]


def effective_sizes(counts: Mapping[str, int], borrow_below: int) -> dict[str, float]:
    """Each bucket's size for weighting: its own count, or for a bucket under `borrow_below` records the
    mean bucket size of its nearest parent group that has at least `borrow_below` records (else of all
    buckets). A 1-record bucket then weighs what a typical bucket of its language|track|family does,
    not hundreds of times more."""
    present = {b: n for b, n in counts.items() if n > 0}
    groups: dict[str, list[int]] = {}
    for bucket, n in present.items():
        for group in parent_groups(bucket):
            groups.setdefault(group, []).append(n)
    overall = sum(present.values()) / max(len(present), 1)
    sizes = {}
    for bucket, n in present.items():
        if n >= borrow_below:
            sizes[bucket] = float(n)
            continue
        sizes[bucket] = overall
        for group in parent_groups(bucket):
            if sum(groups[group]) >= borrow_below:
                sizes[bucket] = sum(groups[group]) / len(groups[group])
                break
    return sizes


def bucket_weights(counts: Mapping[str, int], options: WeightOptions = WeightOptions()) -> dict[str, float]:
    """Per-bucket Bucket-SFT weights from train counts: w_b proportional to s_b^-t, where s_b is the
    bucket's effective size (its count, or its parent group's mean bucket size below `borrow_below`),
    scaled so that the mean weight over records is 1, then clipped to `clip`. With t = 1 and no
    borrowing or clipping (preset `method`) this is N / (K n_b): every bucket gets equal total mass.
    Buckets below `min_bucket_size` get 0. The objective divides by the batch's total weight, so the
    scale never changes an update; only the ratios do."""
    eligible = {b: n for b, n in counts.items() if n > 0 and n >= options.min_bucket_size}
    weights = {b: 0.0 for b in counts}
    if not eligible:
        return weights
    sizes = effective_sizes(eligible, options.borrow_below)
    total = sum(eligible.values())
    raw = {b: sizes[b] ** (-options.temperature) for b in eligible}
    # fsum: the same counts must give bit-identical weights whatever order they arrive in (a Beam build
    # collects them in shard order, the single-machine build in file order)
    scale = total / math.fsum(eligible[b] * raw[b] for b in eligible)
    for b in eligible:
        weights[b] = raw[b] * scale
    if options.clip is not None:
        low, high = options.clip
        weights = {b: (min(max(w, low), high) if b in eligible else 0.0) for b, w in weights.items()}
    return weights


def weight_warnings(weights: Mapping[str, float], train: Mapping[str, int], val: Mapping[str, int] | None,
                    test: Mapping[str, int] | None, warn_above: float) -> list[str]:
    """What a reader of Bucket-SFT weights should know: weights above `warn_above` (a few records that
    would dominate every batch they appear in), train buckets no validation or test row measures, and test
    buckets too small for an interval of their own (MIN_INTERVAL_ROWS)."""
    lines = [f"bucket {b}: weight {w:.1f} from {train.get(b, 0)} train records (above {warn_above:g}); "
             f"its records count {w:.1f}x an average record" for b, w in sorted(weights.items()) if w > warn_above]
    for split, counts in (("val", val), ("test", test)):
        if counts is None:  # split not known here
            continue
        absent = sorted(b for b, n in train.items() if n > 0 and not counts.get(b))
        if absent:
            lines.append(f"{len(absent)} train bucket(s) absent from {split}, so no {split} number covers them: "
                         + ", ".join(absent))
    few = sorted((b, n) for b, n in (test or {}).items() if 0 < n < MIN_INTERVAL_ROWS)
    if few:
        lines.append(f"{len(few)} of {sum(n > 0 for n in test.values())} test buckets have fewer than "
                     f"{MIN_INTERVAL_ROWS} rows ({', '.join(f'{b} {n}' for b, n in few)}): evaluate gives them no "
                     "interval of their own, so a comparison of models cannot judge the macro numbers they count "
                     "in; a larger test share (prepare's split.weights) gives them more rows")
    return lines
