"""A trained model as a folder other tools load as they are: transformers, vLLM, SGLang, TRL.

OUT/model holds the weights in the training dtype (sharded above 5 GB, with an index), config.json,
generation_config.json (every id that ends a turn stops generation), the tokenizer with a
chat_template that renders exactly what polyalign trained on, and a README.md model card saying what
the model was made from and how to prompt it.

The chat template: the one training used (a built-in one as Jinja, or the checkpoint's own), behind a
short preamble that writes polyalign's profile system prompt when the caller passes none and names
the profile, e.g. apply_chat_template(messages, family="dialogue", track="multi", style="open_chat").
Without those variables no system prompt is added (the `none` profile).

A tokenizer polyalign trained (SentencePiece) is exported as tokenizer.model and, for fast loading
everywhere, as an equivalent tokenizer.json (a `tokenizers` Unigram model with the same pieces and
scores, byte fallback and the same special tokens).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh
from safetensors.numpy import save_file
from tokenizers import AddedToken, decoders, models, normalizers
from tokenizers import Tokenizer as Tokenizers

from polyalign.core.errors import CheckpointError
from polyalign.core.outputs import settings_record
from polyalign.core.paths import TRAINING_RECORD, as_path, length_history, run_segments
from polyalign.mesh import parallel
from polyalign.model.architecture import compute_dtype
from polyalign.model.hf import save_hf_checkpoint
from polyalign.model.lora import has_adapters, merge_adapters, peft_config, peft_state_dict
from polyalign.model.transformer import Transformer
from polyalign.tokens.chat import PROFILE_PREAMBLE, TEMPLATES, ChatTemplate
from polyalign.tokens.profile_template import PROFILE_COMBINATIONS, PROFILE_MODE_KEYS, exported_source, profile_example
from polyalign.tokens.tokenizer import (
    MAX_LENGTH_KEY,
    SENTENCEPIECE_FILE,
    TOKENIZER_CONFIG,
    TOKENIZERS_FILE,
    SentencePieceTokenizer,
    Tokenizer,
    trained_length,
)

SHARD_BYTES = 5 * 1024**3  # transformers' default max_shard_size

def export_template(template: ChatTemplate, system: str = "keep", profile: str | None = None,
                    values: dict[str, Any] | None = None) -> str:
    """The chat_template an export carries: the training template behind the profile preamble of the
    build's system mode (tokens/profile_template.py), written once however many exports are chained; a
    template that takes no system message gets them folded into user turns, as training folded them;
    with the `profile` trained (and the `values` its data held), the variables are checked first."""
    return exported_source(template.jinja_source(), system, fold=not template.takes_system, profile=profile,
                           values=values)


def base_reference(base: str | None) -> str | None:
    """How an export names its base (the adapter's base_model_name_or_path, the model card): an
    absolute path for a local folder, so that it loads from any working directory; a bucket URI or
    any other name (a hub id) as the user gave it."""
    if base is None or "://" in str(base) or not os.path.exists(base):
        return base
    return os.path.abspath(base)


def base_generation_config(base: str | None) -> dict[str, Any] | None:
    """The base checkpoint's generation_config.json (its eos ids, its sampling settings), if it has one."""
    if base is None:
        return None
    path = as_path(base) / "generation_config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: line {err.lineno}: {err.msg}") from None
    return config if isinstance(config, dict) else None


def sentencepiece_json(tokenizer: SentencePieceTokenizer) -> str:
    """A tokenizer.json that encodes as the SentencePiece model does: a Unigram model with its pieces
    and scores, spaces as U+2581 (no dummy prefix: polyalign trains without one), byte fallback, and
    its control and listed special tokens split out whole."""
    sp = tokenizer._sp
    vocab = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]
    converted = Tokenizers(models.Unigram(vocab, unk_id=sp.unk_id(), byte_fallback=True))
    converted.normalizer = normalizers.Replace(" ", "\u2581")
    converted.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    converted.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tokenizer.added_tokens()])
    return converted.to_str()


def tokenizer_files(tokenizer: Tokenizer, template: ChatTemplate, profile: str, system: str = "keep",
                    values: dict[str, Any] | None = None, max_length: int | None = None
                    ) -> dict[str, str | bytes]:
    """tokenizer.json (and tokenizer.model where there is one) and a tokenizer_config.json with the
    special tokens, the training template (behind the preamble of the build's system mode and the
    profile check) and, for a built-in template, its name; `values`: the profile values training saw;
    `max_length`: the longest sequence the model ever trained on, where polyalign knows it
    (MAX_LENGTH_KEY)."""
    source = as_path(tokenizer.path)
    directory = source if source.is_dir() else source.parent
    files: dict[str, str | bytes] = {}
    config: dict[str, Any] = {}
    if (directory / TOKENIZER_CONFIG).is_file():
        config = json.loads((directory / TOKENIZER_CONFIG).read_text())
    if isinstance(tokenizer, SentencePieceTokenizer):
        files[SENTENCEPIECE_FILE] = source.read_bytes()
        files[TOKENIZERS_FILE] = sentencepiece_json(tokenizer)
        config["tokenizer_class"] = "PreTrainedTokenizerFast"  # loads tokenizer.json; no SentencePiece needed
        # polyalign itself reads the model it trained with (the conversion splits a few near-ties
        # differently), so training on from this export sees the same ids as the run that made it
        config["polyalign_tokenizer"] = SENTENCEPIECE_FILE
        config.setdefault("additional_special_tokens", [])
    else:
        files[TOKENIZERS_FILE] = source.read_bytes()
    config.update({key: value for key, value in tokenizer.template_tokens().items() if value is not None})
    config["chat_template"] = export_template(template, system, profile, values)
    config["polyalign_profile"], config["polyalign_system"] = profile, system
    for key in ("polyalign_profile_values", "polyalign_profile_combinations"):
        config.pop(key, None)  # a base export's, when this one's data says nothing
    if values:
        config["polyalign_profile_values"] = {k: v for k, v in values.items() if k != PROFILE_COMBINATIONS}
        if values.get(PROFILE_COMBINATIONS):
            config["polyalign_profile_combinations"] = values[PROFILE_COMBINATIONS]
    config.pop(MAX_LENGTH_KEY, None)  # the tokenizer's folder's (an earlier export), when this model's is unknown
    if max_length:
        config[MAX_LENGTH_KEY] = max_length
    if template.name in TEMPLATES:
        config["polyalign_chat_template"] = template.name
    else:
        config.pop("polyalign_chat_template", None)
    files[TOKENIZER_CONFIG] = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
    return files


def generation_config(tokenizer: Tokenizer, template: ChatTemplate, base: dict[str, Any] | None = None
                      ) -> dict[str, Any]:
    """Generation stops at the template's end-of-turn token as well as at EOS. With the base checkpoint's
    generation config, that config is kept (its sampling settings, its other keys) and its eos ids
    merged with these, its own first; without one, decoding is greedy."""
    stops = [tokenizer.token_to_id(t) for t in template.stop_tokens()] + [tokenizer.eos_id]
    stops = sorted({i for i in stops if i is not None})
    ours = {"bos_token_id": tokenizer.bos_id, "eos_token_id": stops if len(stops) > 1 else stops[0],
            "pad_token_id": tokenizer.pad_id, "do_sample": False}
    if not base:
        return ours
    merged = {key: value for key, value in base.items() if key != "transformers_version"}
    given = base.get("eos_token_id")
    given = [] if given is None else given if isinstance(given, list) else [given]
    eos = list(dict.fromkeys([*given, *stops]))
    merged["eos_token_id"] = eos if len(eos) > 1 else eos[0]
    for key in ("bos_token_id", "pad_token_id", "do_sample"):
        if merged.get(key) is None and ours[key] is not None:
            merged[key] = ours[key]
    return merged


SYSTEM_MODE_CARD = {
    "keep": "your opening system messages come first in the system prompt (joined by a newline), then, when you "
            "name the profile, a blank line and the profile prompt",
    "replace": "a system message of yours that opens the conversation is left out: the model was trained with the "
               "profile prompt in its place",
    "drop": "system messages of yours are left out: the model was trained without them",
}


PROFILE_COVERAGE = "profile prompt in training"  # the card row an SFT run fills from its build's counts


def _profile_coverage(card: dict[str, Any]) -> str:
    """How many training examples held the profile prompt, as the card's row says (an SFT run counts the
    ones truncation cut it from); without the row, what every example was rendered with."""
    said = card.get(PROFILE_COVERAGE)
    if not said:
        return "Every training example was rendered with the profile prompt (an example cut to fit may have lost it)"
    return f"The profile prompt was {said}"


def model_card(card: dict[str, Any], template: ChatTemplate, profile: str, system: str = "keep",
               values: dict[str, Any] | None = None) -> str:
    """README.md: what the model was made from and how to prompt it."""
    rows = "\n".join(f"| {key} | {value} |" for key, value in card.items() if value is not None)
    keys = PROFILE_MODE_KEYS[profile]
    variables = ", ".join(f'{k}="{v}"' for k, v in profile_example(values, keys).items())
    prompt = ("trained without a profile system prompt (profile `none`): pass the conversation as it is"
              if profile == "none" else
              f"trained with polyalign's profile system prompt (profile `{profile}`): `{PROFILE_PREAMBLE} "
              "family=...; track=...; style=...`. The chat template writes it when you name the profile: "
              f"`tokenizer.apply_chat_template(messages, add_generation_prompt=True, {variables})`")
    prompt += f". The template renders a system message of yours as training did: {SYSTEM_MODE_CARD[system]}"
    if keys:
        prompt += (". It refuses a profile named in part" + (", or with a value the training data did not hold (the "
                                                              "values it held are listed below)" if values else "")
                   + f". {_profile_coverage(card)}; without the variables the template writes none. "
                   + _track_words(values) + "; `family` is the kind of interaction (assistant, qa, dialogue) "
                   "and `style` the kind of answer, as the training data's buckets name them")
    seen = "".join(f"| {key} | {', '.join(values[key])} |\n" for key in keys if values and values.get(key))
    seen = f"\n## Profile values in the training data\n\n| variable | values |\n|---|---|\n{seen}" if seen else ""
    together = [c for c in (values or {}).get(PROFILE_COMBINATIONS) or [] if all(key in c for key in keys)]
    if seen and together:  # the values are not independent: a client needs the ones the data held together
        seen += (f"\nTogether, most common first (a profile of values each held but never together is refused):\n\n"
                 f"| {' | '.join(keys)} |\n|{'---|' * len(keys)}\n"
                 + "".join(f"| {' | '.join(c[key] for key in keys)} |\n" for c in together))
    return (f"# {card.get('method', 'polyalign')} model\n\nTrained with polyalign.\n\n| | |\n|---|---|\n{rows}\n"
            f"| chat template | {template.name} |\n| profile | {profile} |\n| system messages | {system} |\n\n"
            "## Prompt format\n\nThe model was "
            f"{prompt}. Generation stops at the template's end-of-turn token (generation_config.json).\n{seen}")


def _track_words(values: dict[str, Any] | None) -> str:
    """What the card says `track` is: how polyalign labels conversations, or, where the training data held
    one track only (a data source set it), that one, which the template accepts whatever the turn."""
    held = (values or {}).get("track") or []
    if len(held) == 1:
        return (f"`track` was `{held[0]}` in every training example (a data source set it): pass "
                f"track=\"{held[0]}\" for every turn, the first question's too")
    return ("`track` is `multi` when the conversation has an earlier user or assistant turn and `single` for its "
            "first question (as polyalign labels conversations unless a data source sets it)")


def profile_coverage(train: dict[str, Any], truncation: str, unit: str = "training examples",
                     option: str = "--truncation ") -> str | None:
    """The card's words for a build's train split (RUN/build/manifest.json), or a preference run's pairs (with
    `unit` and `option` theirs): in how many the profile prompt stood whole, and how many lost it, whole or
    in part, to truncation (and of those, how many left it out whole)."""
    examples, cut = train.get("examples"), train.get("system_cut")
    if not examples or cut is None:
        return None
    if not cut:
        return f"whole in all {examples} {unit}"
    whole = train.get("system_left_out") or 0  # over half of the prompt's share: left out, not kept as a tail
    return (f"whole in {examples - cut} of {examples} {unit}; {cut} lost it, whole or in part, to {option}"
            f"{truncation} (long conversations cut to fit"
            + (f"; {whole} of them left it out whole rather than keep its last tokens" if whole else "")
            + "), so the model also read conversations without it")


def training_card(config: Any) -> dict[str, Any]:
    """The model card's rows from a training config."""
    pairs = config.pair_files()["pairs"] if hasattr(config, "pair_files") else None  # the preference methods'
    lora = getattr(config.model, "lora", None)
    opt = config.optimizer
    return {"method": config.method,
            "base": base_reference(config.init) or f"trained from scratch (preset {config.model.preset})",
            "data": config.data.dir, "pairs": pairs,
            # SFT's objective: bucket (Bucket-SFT), uniform (plain SFT) or adaptive
            "weighting": getattr(config, "weighting", None), "steps": config.train.steps,
            # what tells two runs of one recipe apart where the card travels without its run's config.json
            "optimizer": (f"AdamW, learning rate {opt.lr:g} ({opt.warmup_ratio:g} of the steps warming up, cosine to "
                          f"{opt.min_lr_ratio:g} of it), weight decay {opt.weight_decay:g}, clip {opt.clip}"),
            "global batch": packed_batch_words(config),
            "seed": (f"data order {config.train.seed}" if config.init else
                     f"data order {config.train.seed}, initialisation {config.model.seed}"),
            "training dtype": compute_dtype(config.model.dtype),
            "adapters": (f"LoRA rank {lora.rank}, alpha {lora.alpha:g} on {', '.join(lora.targets)}; merged into "
                         "this folder's weights (OUT/adapter holds them apart)" if lora and lora.rank else None),
            # QLoRA: the adapter learned against the quantised base, which OUT/model holds dequantised
            "frozen base": (f"quantised to {config.model.quantize} in training (QLoRA); this folder's weights are "
                            "that base, dequantised, with the adapter merged: what was trained"
                            if getattr(config.model, "quantize", None) else None)}


def packed_batch_words(config: Any) -> int | str:
    """The card's global batch: train.global_batch, or for a packed run what its steps held (rows, each of
    one or more examples or pairs), since a packed step may train on more than an unpacked one of that batch."""
    if not config.data.pack:
        return config.train.global_batch
    unit = "pairs" if hasattr(config, "pair_files") else "examples"
    return (f"{config.train.global_batch} rows of packed {unit} (data.pack): a step trained on as many {unit} as fit "
            "its rows, at least one a row (metrics.jsonl logs how many)")


def export_trained(model: Transformer, tokenizer: Tokenizer, out, mesh: Mesh | None, config: Any,
                   template: ChatTemplate, profile: str, system: str = "keep",
                   values: dict[str, Any] | None = None, coverage: str | None = None,
                   max_length: int | None = None, card_rows: dict[str, str] | None = None,
                   segments: list[dict] | None = None) -> dict[str, str]:
    """OUT/model from a finished run, in model.export_dtype (default: the training dtype). A run with
    adapters also writes them as a PEFT adapter folder, OUT/adapter, and OUT/model holds the merged
    weights W + (alpha / r) A B. `values`: the profile values the run's data held (seen_profile_values);
    `coverage`: how many training examples held the profile prompt whole (profile_coverage); `max_length`:
    the longest sequence this run trained on (default data.max_length); `card_rows`: the method's own rows
    for the model card (HDPO's critic); `segments`: the invocations that trained the run, this one included
    (default: those OUT/summary.json records, which this one has not yet joined)."""
    written = {}
    card = {**training_card(config), **(card_rows or {})}
    segments = run_segments(out) if segments is None else segments
    lengths = length_history(segments, config.train.steps)
    if lengths:  # resumed with another train.steps: the schedule changed where it resumed
        card["steps"] = f"{lengths}, resumed on the new length's learning-rate schedule"
    dtype = config.model.export_dtype or compute_dtype(config.model.dtype)
    if has_adapters(model):
        export_adapter(model, as_path(out) / "adapter", mesh, base=config.init, card=card, merged_dtype=dtype)
        written["adapter"] = str(as_path(out) / "adapter")
        with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
            model = merge_adapters(model)
    export_checkpoint(model, tokenizer, as_path(out) / "model", mesh, template=template, profile=profile,
                      dtype=dtype,
                      card={**card, **({PROFILE_COVERAGE: coverage} if coverage else {})},
                      base=config.init, system=system, values=values,
                      max_length=longest_trained(config.init, max_length or config.data.max_length),
                      training={"config": settings_record(dataclasses.asdict(config)), "segments": segments})
    if written and jax.process_index() == 0:
        # the tokenizer beside the adapter: PEFT's AutoPeftModelForCausalLM reads it from the adapter's folder, and
        # without it went to the network for the base's, warning offline
        for name in (TOKENIZERS_FILE, TOKENIZER_CONFIG, SENTENCEPIECE_FILE):
            if (as_path(out) / "model" / name).exists():
                (as_path(out) / "adapter" / name).write_bytes((as_path(out) / "model" / name).read_bytes())
    return {"model": str(as_path(out) / "model"), **written}


def longest_trained(init: str | None, length: int | None) -> int | None:
    """The longest sequence a model has trained on over all its training: this run's `length`, or its
    init's record's where that is longer; None for an init polyalign did not start from scratch (a
    pretrained checkpoint saw longer sequences than any fine-tuning)."""
    if not init or length is None:
        return length
    before = trained_length(init)
    return None if before is None else max(before, length)


def export_adapter(model: Transformer, path, mesh: Mesh | None = None, *, base: str | None = None,
                   card: dict[str, Any] | None = None, merged_dtype: str = "float32") -> None:
    """A PEFT adapter folder (adapter_config.json, adapter_model.safetensors in float32): PeftModel
    .from_pretrained(transformers' base model, path) gives the adapted model. `merged_dtype`: what `../model`
    holds the merged weights in (its README says a rounding the adapter does not have). Every process calls
    it; process 0 writes."""
    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
        adapters = parallel.to_host(nnx.state(model, nnx.LoRAParam))
    if jax.process_index() != 0:
        return
    path = as_path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(peft_state_dict(model.config, adapters), os.fspath(path / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    config = peft_config(model.config, base_reference(base))
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    card = dict(card or {})
    quantised = card.pop("frozen base", None)
    card.pop("adapters", None)  # the model card's row, said of OUT/model
    rows = "".join(f"| {key} | {value} |\n" for key, value in card.items() if value is not None)
    caveat = ("" if quantised is None else
              f"\n**The base was {quantised.split(' (QLoRA)')[0]} (QLoRA).** The adapter learned against that "
              "quantised base: on the full-precision base named above it gives other outputs than the model that "
              "was trained. `../model` is what was trained (the quantised base, dequantised, with the adapter "
              "merged); load the adapter onto the base only where that difference is acceptable.\n")
    if merged_dtype != "float32":  # a user compared the two and found logits a few hundredths apart, unsaid
        caveat += (f"\n`../model` holds the merged weights W + (alpha / r) A B rounded to {merged_dtype} "
                   "(model.export_dtype): its outputs differ from the base with this adapter by that rounding "
                   "(logits by a few hundredths on a small model); `model.export_dtype=float32` keeps the merge "
                   "exact.\n")
    (path / "README.md").write_text(f"# LoRA adapter (PEFT format)\n\n| | |\n|---|---|\n{rows}\n"
                                    "Load with `PeftModel.from_pretrained(base, this_folder)`; `../model` holds the "
                                    f"weights with the adapter merged.\n{caveat}")


def export_checkpoint(model: Transformer, tokenizer: Tokenizer, path: str | os.PathLike, mesh: Mesh | None = None, *,
                      template: ChatTemplate, profile: str = "context", dtype: str | None = None,
                      card: dict[str, Any] | None = None, max_shard_bytes: int = SHARD_BYTES,
                      base: str | None = None, system: str = "keep", values: dict[str, Any] | None = None,
                      max_length: int | None = None, training: dict[str, Any] | None = None) -> None:
    """Every process calls it: parameters sharded over `mesh` are gathered one at a time (never the
    whole model replicated on every device); process 0 writes. `dtype` defaults to the parameters'.
    `base`, the checkpoint trained from: its generation_config.json is kept and merged. `system`: how
    training composed a conversation's own system message with the profile prompt (SYSTEM_MODES).
    `values`: the profile values training saw (the card lists them, the chat template refuses others);
    `max_length`: the longest sequence the model ever trained on, where known (tokenizer_files); `training`:
    the run's config and invocations, kept as TRAINING_RECORD so the folder says how it was trained wherever
    it is copied (core/paths.py training_record)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
        params = parallel.to_host(params)
    if jax.process_index() != 0:
        return
    generation = generation_config(tokenizer, template, base_generation_config(base))
    extra = {**tokenizer_files(tokenizer, template, profile, system, values, max_length),
             "generation_config.json": json.dumps(generation, indent=2) + "\n",
             "README.md": model_card(card or {}, template, profile, system, values),
             **({TRAINING_RECORD: json.dumps(training, indent=2) + "\n"} if training else {})}
    save_hf_checkpoint(nnx.merge(graphdef, params, rest), path, dtype=dtype, max_shard_bytes=max_shard_bytes,
                       overwrite=True, extra_files=extra)
