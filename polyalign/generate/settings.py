"""What a request decodes with when it leaves settings unset: OpenAI's defaults, the values that ask for
nothing, and a checkpoint's generation_config.json read as vLLM reads it. Plain Python (no JAX): the
reports name decodings with it too."""

from __future__ import annotations

import json
from pathlib import Path

# OpenAI's defaults for a request that sets none (vLLM's too, where the checkpoint's generation_config.json
# sets none); transformers' own default top_k, which vLLM leaves out as no setting of the checkpoint's
OPENAI_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
TRANSFORMERS_DEFAULT_TOP_K = 50

# vLLM's further settings, with the values that ask for nothing. min_p and repetition_penalty are also
# read from a checkpoint's generation_config.json (Qwen2.5-Instruct sets repetition_penalty 1.05); the
# presence and frequency penalties are OpenAI's request parameters.
NEUTRAL = {"min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
CHECKPOINT_KEYS = (*OPENAI_SAMPLING, "min_p", "repetition_penalty")


def checkpoint_sampling(checkpoint) -> dict[str, float | int]:
    """The sampling settings a checkpoint's generation_config.json sets (temperature, top_p, top_k, min_p,
    repetition_penalty), read as vLLM reads them for requests that set none (its `generation_config: auto`):
    a value equal to transformers' default is no setting. {} for a checkpoint without the file or a remote one."""
    found = _numbers(checkpoint, CHECKPOINT_KEYS)
    if found.get("top_k") == TRANSFORMERS_DEFAULT_TOP_K:
        del found["top_k"]
    return asked_for(found)


def asked_for(settings: dict) -> dict:
    """`settings` without the penalties and min_p that ask for nothing (as records of earlier versions,
    which had none, read)."""
    return {key: value for key, value in settings.items() if key not in NEUTRAL or value != NEUTRAL[key]}


# What a sampling setting that is neither given nor set by the checkpoint decodes with (its temperature
# aside: `generate` decodes greedily unless told)
NEUTRAL_FLAGS = {key: {**OPENAI_SAMPLING, **NEUTRAL}[key] for key in CHECKPOINT_KEYS if key != "temperature"}


def unset_from_checkpoint(given: dict[str, float | int | None], checkpoint) -> tuple[dict, dict]:
    """`given` (top_p, top_k, min_p, repetition_penalty; None = not given) completed as `serve` and vLLM
    complete a request: the checkpoint's generation_config.json value where it sets one, else none. The
    temperature is not taken (`generate` decodes greedily unless told). Returns (chosen, taken from the
    checkpoint)."""
    theirs = checkpoint_sampling(checkpoint)
    taken = {key: theirs[key] for key in NEUTRAL_FLAGS if given.get(key) is None and key in theirs}
    chosen = {key: given[key] if given.get(key) is not None else taken.get(key, NEUTRAL_FLAGS[key])
              for key in NEUTRAL_FLAGS}
    return chosen, taken


def checkpoint_greedy(checkpoint) -> bool:
    """Whether the checkpoint's generation_config.json says `do_sample: false` (transformers decodes it
    greedily; vLLM reads no such key)."""
    return _generation_config(checkpoint).get("do_sample") is False


def _numbers(checkpoint, keys) -> dict[str, float | int]:
    """The numeric settings among `keys` the checkpoint's generation_config.json holds."""
    config = _generation_config(checkpoint)
    return {key: config[key] for key in keys
            if isinstance(config.get(key), int | float) and not isinstance(config.get(key), bool)}


def _generation_config(checkpoint) -> dict:
    """A checkpoint's generation_config.json as read for serving: {} where there is none, or none that reads
    as a JSON object (transformers and vLLM then fall back to their own defaults too)."""
    try:
        config = json.loads((Path(str(checkpoint)) / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def describe_sampling(settings: dict[str, float | int]) -> str:
    """temperature, top_p and top_k as set, then the further settings that ask for something."""
    asked = asked_for(settings)
    said = [key for key in (*OPENAI_SAMPLING, *NEUTRAL) if key in asked]
    return ", ".join(f"{key} {asked[key]:g}" for key in said)
