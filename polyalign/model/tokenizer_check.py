"""Does transformers read a tokenizer as polyalign does? A build encodes with polyalign's own reader; a
model trained on it is later served through transformers (or vLLM/SGLang, which load the tokenizer as
transformers does) from the exported tokenizer files. When the two readers give other ids for the same
text (a tokenizer class whose pre-tokenizer transformers rebuilds, e.g. one splitting every digit; a
SentencePiece model's near-ties converted differently), the model sees other ids at inference than in
training. `polyalign build` therefore encodes a probe set of the run's own records both ways and records
the outcome in RUN/build/manifest.json (`tokenizer_check`); training checks its exported folder again,
as transformers loads it (its config.json, which picks the tokenizer class, is known only then: a model
trained from a preset on a tokenizer.json of the user's), in OUT/summary.json and the model card. When
transformers is not installed both say so instead.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax

from polyalign.model.export import tokenizer_files
from polyalign.tokens.tokenizer import TOKENIZERS_FILE
from polyalign.tokens.tokenizer_training import record_texts

PROBE_RECORDS = 64  # records spread evenly over train and val (inputs/built.py, probe_records)
PROBE_CHARS = 2000  # each text cut to this many characters, so long contexts stay cheap
SHOWN = 3  # differing texts named in the manifest

Encode = Callable[[str], list[int]]


def probe_texts(records: Sequence) -> list[str]:
    """Every distinct text (question, context, history turns, response) of the probe records, cut to
    PROBE_CHARS characters."""
    return [text[:PROBE_CHARS] for text in dict.fromkeys(record_texts(records)) if text]


def _transformers():
    """The transformers module, or None where it is not installed (it is no dependency; the check says so).
    Its advice at import ("PyTorch was not found...": only its tokenizers are used here) is silenced: it was
    printed into the middle of a build's output."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    try:
        import transformers  # optional: see above
    except ImportError:
        return None
    return transformers


def transformers_encoder(tokenizer, template, profile: str) -> tuple[Encode | None, str]:
    """transformers' AutoTokenizer on the tokenizer files an export of this build ships (what users and
    serving engines load), as text -> ids without special tokens added; (None, why) when transformers is
    not installed or cannot load them. The second element names the reader."""
    transformers = _transformers()
    if transformers is None:
        checkpoint_config = tokenizer.path.parent / "config.json"
        model_type = _model_type(checkpoint_config) if checkpoint_config.is_file() else None
        return _without_transformers(model_type, tokenizer.path if tokenizer.path.name == TOKENIZERS_FILE else None,
                                     "(pip install transformers to check that it reads this tokenizer with the "
                                     "same ids as polyalign)")

    with tempfile.TemporaryDirectory(prefix="polyalign-tokenizer-check-") as folder:
        for name, content in tokenizer_files(tokenizer, template, profile).items():
            (Path(folder) / name).write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
        # A checkpoint's config.json goes beside them, as in the export a model trained from it carries:
        # transformers picks the tokenizer class by its model_type (Qwen2Tokenizer for qwen2, whatever
        # tokenizer_config.json names) and that class may rebuild the pre-tokenizer (every digit apart).
        checkpoint_config = tokenizer.path.parent / "config.json"
        if checkpoint_config.is_file():
            (Path(folder) / "config.json").write_bytes(checkpoint_config.read_bytes())
        return _auto_tokenizer(transformers, folder)


def folder_encoder(folder) -> tuple[Encode | None, str]:
    """transformers' AutoTokenizer on an exported model folder as it is (its config.json picks the class)."""
    transformers = _transformers()
    if transformers is None:
        folder = Path(folder)
        model_type = _model_type(folder / "config.json") if (folder / "config.json").is_file() else None
        json_file = folder / TOKENIZERS_FILE
        return _without_transformers(model_type, json_file if json_file.is_file() else None, "")
    return _auto_tokenizer(transformers, folder)


# transformers 5 reads every qwen2 checkpoint with Qwen2Tokenizer, whatever tokenizer_config.json names
# (qwen2 is in its MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS), and that class rebuilds the normalizer and
# pre-tokenizer from its own defaults around the file's vocabulary and merges: a user's own BPE under a
# qwen2 config.json is read with other ids. Emulated with the tokenizers library when transformers is
# not installed, so the check still warns.
QWEN2_PRETOKENIZE = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                     r"""\s*[\r\n]+|\s+(?!\S)|\s+""")


def _without_transformers(model_type: str | None, json_file, install: str) -> tuple[Encode | None, str]:
    """The reader where transformers is not installed: transformers 5's Qwen2Tokenizer emulated for a qwen2
    checkpoint's tokenizer.json (`json_file`), else none, with why."""
    if model_type != "qwen2" or json_file is None:
        return None, f"not checked: transformers is not installed {install}".rstrip()
    from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers  # a dependency; only for this emulation

    emulated = Tokenizer.from_str(Path(json_file).read_text(encoding="utf-8"))
    emulated.normalizer = normalizers.NFC()
    emulated.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return (lambda text: emulated.encode(text, add_special_tokens=False).ids), \
        ("transformers 5's Qwen2Tokenizer (chosen by config.json's model_type qwen2; emulated, since transformers "
         "is not installed)")


def _auto_tokenizer(transformers, folder) -> tuple[Encode | None, str]:
    """AutoTokenizer.from_pretrained(folder) as text -> ids without special tokens, and its name: the
    version, the class it chose and the config.json model_type that chose it."""
    config = Path(folder) / "config.json"
    model_type = _model_type(config) if config.is_file() else None
    try:
        loaded = transformers.AutoTokenizer.from_pretrained(os.fspath(folder))
    except Exception as err:  # transformers raises many kinds for files it cannot read
        return None, f"not checked: transformers {transformers.__version__} could not load it ({err})"
    chosen = f", loaded with config.json's model_type {model_type}" if model_type else ""
    return (lambda text: list(loaded.encode(text, add_special_tokens=False))), \
        f"transformers {transformers.__version__} AutoTokenizer ({type(loaded).__name__}{chosen})"


def _model_type(config) -> str | None:
    try:
        value = json.loads(config.read_text(encoding="utf-8")).get("model_type")
    except (ValueError, AttributeError):  # not JSON, or not an object: transformers will say so when it loads
        return None
    return value if isinstance(value, str) else None


# What other ids mean, said by the build and by training's check of its export
BUILD_CONSEQUENCE = ("a model trained on this build sees other ids at inference than in training "
                     "(RUN/build/manifest.json, tokenizer_check)")
INIT_CONSEQUENCE = ("training on these pairs teaches the model polyalign's ids, and it reads others where "
                    "transformers, vLLM or SGLang load it")
GENERATE_CONSEQUENCE = ("these answers come from polyalign's ids; transformers, vLLM or SGLang given the same "
                        "conversations read others")
PROMPTS_CONSEQUENCE = ("an engine given these rows' `prompt` or `messages` reads other ids than their "
                       "prompt_token_ids (polyalign's, training's): give it prompt_token_ids")
EXPORT_CONSEQUENCE = ("the model was trained on polyalign's ids and reads others where transformers, vLLM or SGLang "
                      "load this folder (OUT/summary.json, tokenizer_check; the model card says so)")


# What makes the two readings agree: the tokenizer.json transformers builds for the config's class, which
# polyalign then reads alike (a user's hand-made byte-level BPE under a qwen2 config read 64 of 302 texts
# otherwise, and the same ids on all 302 once saved so).
REMEDY = ("To make them agree, save the tokenizer as transformers reads it (`AutoTokenizer.from_pretrained(D)"
          ".save_pretrained(D)` with D = {folder} writes the tokenizer.json it builds for that class), then build "
          "and train on it again")


def compare_encoders(ours: Encode, theirs: Encode | None, reader: str, texts: Sequence[str],
                     tokenizer_name: str, consequence: str = BUILD_CONSEQUENCE) -> tuple[dict[str, Any], str | None]:
    """The `tokenizer_check` entry and a warning (None when the ids agree or nothing was compared): how
    many probe texts each reader encodes, how many differ, and the first few of those."""
    if theirs is None:
        return {"checked": False, "reason": reader}, None
    differing = []
    for text in texts:
        a, b = ours(text), theirs(text)
        if a != b:
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            differing.append({"text": text[:200], "first_difference": at, "polyalign": a[max(0, at - 2):at + 6],
                              "transformers": b[max(0, at - 2):at + 6]})
    entry = {"checked": True, "reader": reader, "probes": len(texts), "differing": len(differing),
             "examples": differing[:SHOWN]}
    if not differing:
        return entry, None
    first = differing[0]
    folder = tokenizer_name if not tokenizer_name.endswith((".json", ".model")) else str(Path(tokenizer_name).parent)
    return entry, (f"{reader} reads {tokenizer_name} with other ids than polyalign on {len(differing)} of "
                   f"{len(texts)} probe texts from the records (first {first['text'][:60]!r}: polyalign "
                   f"{first['polyalign']} vs transformers {first['transformers']} from token "
                   f"{first['first_difference']}); {consequence}. {REMEDY.format(folder=folder)}")


def check_tokenizer(tokenizer, template, profile: str, records: Sequence, tokenizer_name: str,
                    encoder: Callable[..., tuple[Encode | None, str]] = transformers_encoder
                    ) -> tuple[dict[str, Any], str | None]:
    """`compare_encoders` on the probe texts of `records`, transformers' reader made by `encoder`."""
    theirs, reader = encoder(tokenizer, template, profile)
    return compare_encoders(tokenizer.encode, theirs, reader, probe_texts(records), tokenizer_name)


def check_folder(folder, tokenizer, texts: Sequence[str], consequence: str = INIT_CONSEQUENCE) -> str | None:
    """A checkpoint folder read as transformers loads it, against polyalign's reading, before it is used (a
    preference run's init, a generation's checkpoint): the warning where the ids differ; None where they
    agree, where transformers cannot read it, or where the folder has no config.json (the tokenizer folder
    of a build, which no engine loads as a model)."""
    if not (Path(str(folder)) / "config.json").is_file():
        return None
    theirs, reader = folder_encoder(folder)
    if theirs is None:
        return None
    return compare_encoders(tokenizer.encode, theirs, reader, texts, str(folder), consequence)[1]


def spread_records(records: Sequence, count: int = PROBE_RECORDS) -> list:
    """`count` records spread evenly over `records`: the probe set of a file of them."""
    return list(records[::max(1, len(records) // count)])[:count]


def check_export(folder, tokenizer, texts: Sequence[str],
                 encoder: Callable[..., tuple[Encode | None, str]] = folder_encoder) -> dict[str, Any]:
    """Training's check of its exported folder (OUT/model) as transformers loads it, on probe texts of the
    training data: `tokenizer_check` (and `tokenizer_warning` when the ids differ) for OUT/summary.json,
    and a section of the model card saying the outcome. Process 0 alone, which wrote the folder."""
    if jax.process_index() != 0:
        return {}
    folder = Path(folder)
    theirs, reader = encoder(folder)
    entry, warning = compare_encoders(tokenizer.encode, theirs, reader, texts, str(folder), EXPORT_CONSEQUENCE)
    with (folder / "README.md").open("a", encoding="utf-8") as card:
        card.write(card_section(entry))
    return {"tokenizer_check": entry, **({"tokenizer_warning": warning} if warning else {})}


def card_section(entry: dict[str, Any]) -> str:
    """The model card's words on the export's tokenizer check."""
    if not entry["checked"]:
        body = (f"{entry['reason'].replace('not checked: ', 'Not checked: ', 1)} where this model was trained, so "
                "nothing compared the ids transformers reads from this folder with the ids training used.")
    elif not entry["differing"]:
        body = (f"{entry['reader']} reads this folder's tokenizer with the ids training used, on all "
                f"{entry['probes']} probe texts of the training data.")
    else:
        first = entry["examples"][0]
        body = (f"**{entry['reader']} reads this folder's tokenizer with other ids than training used**, on "
                f"{entry['differing']} of {entry['probes']} probe texts of the training data (first "
                f"{first['text'][:60]!r}: training {first['polyalign']}, transformers {first['transformers']} from "
                f"token {first['first_difference']}). Loaded with transformers, vLLM or SGLang, this model reads "
                "other ids than it was trained on.")
    return f"\n## Tokenizer check\n\n{body}\n"
