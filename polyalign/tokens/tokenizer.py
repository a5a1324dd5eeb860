"""Tokenizers behind one interface: SentencePiece models (trained here or a checkpoint's
tokenizer.model) and `tokenizers` JSON files (a checkpoint's tokenizer.json)."""

from __future__ import annotations

import abc
import functools
import json
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import sentencepiece as spm
from tokenizers import Tokenizer as _Tokenizer

from polyalign.core.errors import TokenizerError
from polyalign.core.paths import as_path
from polyalign.core.yaml_config import unknown_key_message
from polyalign.tokens.profile_template import PROFILE_COMBINATIONS, PROFILE_KEYS, PROFILE_MODES, SYSTEM_MODES

TOKENIZER_CONFIG = "tokenizer_config.json"
SENTENCEPIECE_FILE = "tokenizer.model"
TOKENIZERS_FILE = "tokenizer.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where recent transformers versions save a checkpoint's template
# polyalign_max_length: the longest sequence any training of a model started from scratch by polyalign saw
# (the data.max_length of its runs): past it the model reads positions it never learned. Absent for a model
# trained on from another checkpoint, whose pretraining saw longer ones.
MAX_LENGTH_KEY = "polyalign_max_length"
# What polyalign's export writes into a checkpoint's tokenizer config (polyalign/model/export.py): any other
# key with the prefix is a typing slip that would otherwise render the chats as if it were absent.
POLYALIGN_CONFIG_KEYS = ("polyalign_tokenizer", "polyalign_chat_template", "polyalign_profile", "polyalign_system",
                         "polyalign_profile_values", "polyalign_profile_combinations", MAX_LENGTH_KEY)
# Special tokens of polyalign's own tokenizer: SentencePiece reserves the first four ids.
PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<s>", "</s>"


def exported_setting(checkpoint: str | os.PathLike, key: str) -> Any:
    """What a checkpoint's tokenizer_config.json says of `key` (one polyalign's export writes); None where it
    says nothing, or there is no such file."""
    config = as_path(checkpoint) / TOKENIZER_CONFIG
    try:
        return json.loads(config.read_text()).get(key) if config.is_file() else None
    except (json.JSONDecodeError, AttributeError, OSError):
        return None


def trained_length(checkpoint: str | os.PathLike) -> int | None:
    """A checkpoint's polyalign_max_length (its tokenizer_config.json); None where it says none."""
    value = exported_setting(checkpoint, MAX_LENGTH_KEY)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def never_trained_past(checkpoint, trained: int) -> str:
    """What a checkpoint's MAX_LENGTH_KEY says, in words: true of a model polyalign trained from scratch and
    of one trained on from it (an HDPO export of a from-scratch SFT model records its ancestor's length)."""
    return (f"{checkpoint} was never trained on a sequence longer than {trained} tokens ({MAX_LENGTH_KEY} in its "
            "tokenizer_config.json: polyalign trained it, or the model it was trained from, from scratch)")


def past_trained_note(checkpoint, max_length: int, reaching: str) -> str | None:
    """A note when data.max_length `max_length` lets a run's sequences (`reaching`: "pairs reach", "the
    critic encode responses at") past the longest a from-scratch checkpoint trained on: positions it never
    learned. None for a pretrained checkpoint (no record) or a bucket URI."""
    trained = None if "://" in str(checkpoint) else trained_length(checkpoint)
    if trained is None or max_length <= trained:
        return None
    return (f"note: {never_trained_past(checkpoint, trained)}: data.max_length {max_length} lets {reaching} "
            f"positions it never learned; data.max_length={trained} keeps within them")


class Tokenizer(abc.ABC):
    """What polyalign needs from a tokenizer. `encode` never adds BOS/EOS: chat templates place them."""

    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    chat_template: str | None = None  # name of a polyalign template, when the tokenizer's config names one
    template_source: str | None = None  # the checkpoint's own Jinja chat template, when it ships one
    unk_token: str | None = None
    listed_special_tokens: tuple[str, ...] = ()  # additional_special_tokens and added_tokens_decoder of the config
    # How the model this tokenizer came with was trained to read a conversation's own system messages
    # beside the profile prompt (profile_template.SYSTEM_MODES): its export's polyalign_system.
    system_mode: str = "keep"
    # The profile prompt a checkpoint was trained with (its export's polyalign_profile); None: not said.
    profile_mode: str | None = None
    # Whether polyalign wrote the tokenizer's config (a key polyalign_*): a checkpoint without one is another
    # tool's, trained without polyalign's profile prompt.
    from_polyalign: bool = False
    # The profile values the checkpoint's training data held, per key (its export's
    # polyalign_profile_values: {"family": [...], ...}), and under PROFILE_COMBINATIONS the combinations it
    # held (polyalign_profile_combinations); None: not said.
    profile_values: dict[str, Any] | None = None

    @property
    def config_file(self) -> Path:
        """The tokenizer_config.json beside the tokenizer's file: where a checkpoint says how it was trained."""
        return self.path.parent / TOKENIZER_CONFIG

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int: ...

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    @abc.abstractmethod
    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """The text of `ids`; with `skip_special` the special tokens left out, as a generated answer is
        shown (vLLM's and transformers' pipelines do the same), rather than written into it."""

    @abc.abstractmethod
    def token_to_id(self, token: str) -> int | None:
        """The id of a whole token (special or not); None if the vocabulary lacks it."""

    def special_id(self, token: str) -> int:
        token_id = self.token_to_id(token)
        if token_id is None:
            raise TokenizerError(f"{self}: has no token {token!r}")
        return token_id

    def _optional_id(self, token: str | None) -> int | None:
        return None if token is None else self.token_to_id(token)

    @property
    def bos_id(self) -> int | None:
        return self._optional_id(self.bos_token)

    @property
    def eos_id(self) -> int | None:
        return self._optional_id(self.eos_token)

    @property
    def pad_id(self) -> int:
        """Padding id: the pad token, else EOS, else 0 (padding is masked, so its id never matters)."""
        for token in (self.pad_token, self.eos_token):
            token_id = self._optional_id(token)
            if token_id is not None:
                return token_id
        return 0

    def added_tokens(self) -> list[str]:
        """Every token the tokenizer splits out of text whole (special tokens, a chat template's markers):
        a rendered chat template is cut at these, and each is looked up by id."""
        named = [self.bos_token, self.eos_token, self.pad_token, self.unk_token, *self.listed_special_tokens]
        return [t for t in dict.fromkeys(named) if t and self.token_to_id(t) is not None]

    def template_tokens(self) -> dict[str, str | None]:
        """The special tokens as a chat template sees them."""
        return {"bos_token": self.bos_token, "eos_token": self.eos_token, "pad_token": self.pad_token,
                "unk_token": self.unk_token}

    def _apply_config(self, config: dict) -> None:
        def token(value):
            return value.get("content") if isinstance(value, dict) else value

        for field in ("bos_token", "eos_token", "pad_token", "unk_token"):
            if field in config:
                setattr(self, field, token(config[field]))
        for key in config:
            if key.startswith("polyalign_") and key not in POLYALIGN_CONFIG_KEYS:
                raise TokenizerError(unknown_key_message(key, POLYALIGN_CONFIG_KEYS, str(self.config_file),
                                                         prefix="polyalign_"))
        self.from_polyalign = any(key.startswith("polyalign_") for key in config)
        self.chat_template = config.get("polyalign_chat_template", self.chat_template)
        self.system_mode = config.get("polyalign_system", self.system_mode)
        self.profile_mode = config.get("polyalign_profile", self.profile_mode)
        if self.profile_mode is not None and self.profile_mode not in PROFILE_MODES:
            raise TokenizerError(f"{self.config_file}: polyalign_profile {self.profile_mode!r} is not one of "
                                 f"{', '.join(PROFILE_MODES)}")
        if self.system_mode not in SYSTEM_MODES:
            raise TokenizerError(f"{self.config_file}: polyalign_system {self.system_mode!r} is not one of "
                                 f"{', '.join(SYSTEM_MODES)}")
        values = config.get("polyalign_profile_values", self.profile_values)
        if values is not None and not (isinstance(values, dict) and all(
                key in PROFILE_KEYS and isinstance(seen, list) and all(isinstance(v, str) for v in seen)
                for key, seen in values.items())):
            raise TokenizerError(f"{self.config_file}: polyalign_profile_values must map profile keys "
                                 f"({', '.join(PROFILE_KEYS)}) to lists of strings, got {json.dumps(values)[:200]}")
        combinations = config.get("polyalign_profile_combinations")
        if combinations is not None:
            if not (isinstance(combinations, list) and all(
                    isinstance(c, dict) and all(k in PROFILE_KEYS and isinstance(v, str) for k, v in c.items())
                    for c in combinations)):
                raise TokenizerError(f"{self.config_file}: polyalign_profile_combinations must be a list of "
                                     f"{{profile key: value}} objects, got {json.dumps(combinations)[:200]}")
            values = {**(values or {}), PROFILE_COMBINATIONS: combinations}
        self.profile_values = values
        listed = [token(t) for t in config.get("additional_special_tokens") or []]
        decoder = config.get("added_tokens_decoder")
        if isinstance(decoder, dict):
            listed += [token(t) for t in decoder.values()]
        self.listed_special_tokens = tuple(t for t in listed if isinstance(t, str))
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: the default one renders chats
            source = next((t.get("template") for t in source
                           if isinstance(t, dict) and t.get("name") == "default"), None)
        if isinstance(source, str) and source:
            self.template_source = source


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, model_file: str | os.PathLike):
        self.path = as_path(model_file)
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=self.path.read_bytes())
        except (OSError, RuntimeError) as err:
            raise TokenizerError(f"{self.path}: not a SentencePiece model ({err})") from None
        sp = self._sp
        self.bos_token = sp.id_to_piece(sp.bos_id()) if sp.bos_id() >= 0 else None
        self.eos_token = sp.id_to_piece(sp.eos_id()) if sp.eos_id() >= 0 else None
        self.pad_token = sp.id_to_piece(sp.pad_id()) if sp.pad_id() >= 0 else None

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({self.path})"

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._sp.encode(list(texts))

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        if skip_special:  # SentencePiece drops its control symbols itself, not the chat markers added as pieces
            special = self._special_ids
            ids = [i for i in ids if int(i) not in special]
        return self._sp.decode([int(i) for i in ids])

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        return frozenset(self.token_to_id(t) for t in self.added_tokens())

    def token_to_id(self, token: str) -> int | None:
        token_id = self._sp.piece_to_id(token)
        return token_id if self._sp.id_to_piece(token_id) == token else None

    def added_tokens(self) -> list[str]:
        controls = [self._sp.id_to_piece(i) for i in range(self.vocab_size) if self._sp.is_control(i)]
        return list(dict.fromkeys([*super().added_tokens(), *controls]))


class JsonTokenizer(Tokenizer):
    """A `tokenizers` library tokenizer.json, as Hugging Face checkpoints ship it."""

    def __init__(self, json_file: str | os.PathLike):
        self.path = as_path(json_file)
        try:
            self._tok = _Tokenizer.from_str(self.path.read_text(encoding="utf-8"))
        except Exception as err:  # the Rust side raises a bare Exception for malformed files
            raise TokenizerError(f"{self.path}: not a tokenizer.json ({err})") from None

    def __repr__(self) -> str:
        return f"JsonTokenizer({self.path})"

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def added_tokens(self) -> list[str]:
        # The tokenizers library splits every added token out of text, special or not (Qwen's <think>).
        return list(dict.fromkeys([*super().added_tokens(),
                                   *(t.content for t in self._tok.get_added_tokens_decoder().values())]))


def has_tokenizer_files(directory: str | os.PathLike) -> bool:
    """Whether a folder holds a tokenizer load_tokenizer would read (a checkpoint may come without one)."""
    directory = as_path(directory)
    return (directory / TOKENIZERS_FILE).is_file() or (directory / SENTENCEPIECE_FILE).is_file()


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """A tokenizer from a directory (tokenizer.json preferred, else tokenizer.model, plus
    tokenizer_config.json for the special tokens) or from one of those files directly; local or gs://.
    A polyalign export of a SentencePiece model holds both and names tokenizer.model as the original
    (`polyalign_tokenizer`): that one is read."""
    path = as_path(path)
    directory = path if path.is_dir() else path.parent
    config = _read_config(directory)
    if path.is_dir():
        original = (config or {}).get("polyalign_tokenizer")
        if original == SENTENCEPIECE_FILE and (path / SENTENCEPIECE_FILE).is_file():
            path = path / SENTENCEPIECE_FILE
        elif (path / TOKENIZERS_FILE).is_file():
            path = path / TOKENIZERS_FILE
        elif (path / SENTENCEPIECE_FILE).is_file():
            path = path / SENTENCEPIECE_FILE
        else:
            raise TokenizerError(f"{path}: no {TOKENIZERS_FILE} or {SENTENCEPIECE_FILE}")
    elif not path.is_file():
        raise TokenizerError(f"{path}: no such tokenizer file or folder")
    tokenizer: Tokenizer = JsonTokenizer(path) if path.suffix == ".json" else SentencePieceTokenizer(path)
    if config is not None:
        tokenizer._apply_config(config)
    if (directory / CHAT_TEMPLATE_FILE).is_file():  # transformers reads this file before the config's entry
        tokenizer.template_source = (directory / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    return tokenizer


def _read_config(directory) -> dict | None:
    """The folder's tokenizer_config.json, or None when there is none."""
    config_file = directory / TOKENIZER_CONFIG
    if not config_file.is_file():
        return None
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise TokenizerError(f"{config_file}: line {err.lineno}: {err.msg}") from None


# SentencePiece splits its sentences among this many threads and sums their statistics in that split, so the
# pieces depend on the number (2 against 4 threads on 3,000 demo texts: 3 of 2,000 pieces differ, 257 sit at
# other ids), not on the cores running them (4 threads on one core: the same pieces as on two): one fixed
# number trains the same tokenizer from the same records on every machine.
DEFAULT_TRAIN_THREADS = 2
TRAIN_SEED = 0


def train_sentencepiece(texts: Iterable[str], out_dir: str | os.PathLike, vocab_size: int, *,
                        special_tokens: Sequence[str] = (), chat_template: str = "polyalign",
                        model_type: str = "unigram", character_coverage: float = 0.9995,
                        max_sentences: int = 2_000_000,
                        threads: int = DEFAULT_TRAIN_THREADS) -> SentencePieceTokenizer:
    """Trains a bilingual SentencePiece model into OUT/tokenizer.model (+ tokenizer_config.json).

    Text is kept exactly: no NFKC (it folds full-width Chinese punctuation), no whitespace collapsing
    and no dummy prefix, so decode(encode(x)) == x and chat-template pieces can be encoded one by one.
    Characters outside the coverage fall back to UTF-8 bytes, so nothing maps to <unk>.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = (line for text in texts for line in text.split("\n") if line.strip())
    # past max_sentences SentencePiece samples the sentences it trains on, with its own generator: seeded, the
    # same records train the same tokenizer there too
    spm.set_random_generator_seed(TRAIN_SEED)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=lines, model_prefix=str(out / "tokenizer"), model_type=model_type,
            vocab_size=vocab_size, byte_fallback=True, character_coverage=character_coverage,
            normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False,
            allow_whitespace_only_pieces=True, split_digits=True, user_defined_symbols=list(special_tokens),
            pad_id=0, unk_id=1, bos_id=2, eos_id=3, pad_piece=PAD, unk_piece=UNK, bos_piece=BOS, eos_piece=EOS,
            input_sentence_size=max_sentences, shuffle_input_sentence=True, max_sentence_length=1 << 16,
            num_threads=threads, minloglevel=2)
    except RuntimeError as err:
        short = re.search(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)", str(err))
        if short:
            # SentencePiece's count holds the kept characters with the byte and special pieces, and a vocab of
            # that size trains (measured on CMRC 2018 text: 3,626 said, 3,626 trains, 3,620 does not)
            raise TokenizerError(f"vocab size {short[1]} cannot hold the {short[2]} pieces needed: one for each "
                                 f"character that character coverage {character_coverage} keeps, with the byte and "
                                 f"special pieces; give a vocab size of {short[2]} or more"
                                 + (", or a lower --character-coverage to keep fewer characters (0.98 is the least "
                                    "SentencePiece takes; the rest fall back to bytes)" if character_coverage > 0.98
                                    else " (0.98, the coverage given, is the least SentencePiece takes)")) from None
        high = re.search(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)", str(err))
        if high:
            raise TokenizerError(f"vocab size {high[1]} is more than these records can fill: at most {high[2]} "
                                 "pieces; give --vocab-size of that or less, or train on more text") from None
        raise TokenizerError(f"SentencePiece training failed: {err}") from None
    (out / "tokenizer.vocab").unlink(missing_ok=True)
    config = {"tokenizer_class": "polyalign.SentencePieceTokenizer", "bos_token": BOS, "eos_token": EOS,
              "pad_token": PAD, "unk_token": UNK, "additional_special_tokens": list(special_tokens),
              "polyalign_chat_template": chat_template}
    (out / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return load_tokenizer(out)
