"""A stand-in for transformers (a dev-only dependency) in tests of the tokenizer checks: a module of the
same name whose AutoTokenizer loads a folder's tokenizer.json with the `tokenizers` library, as
transformers' fast tokenizers do, optionally reading it as a tokenizer class that transformers rebuilds
would (every digit apart, as the Qwen2 class's pre-tokenizer splits them; or lowercased)."""

import json
import types


def stand_in_transformers(split_digits: bool | str, lowercase: bool = False) -> types.ModuleType:
    """`split_digits`: True, or a model type for which the stand-in splits digits only when the folder's
    config.json names it (transformers 5 picks the class by config.json's model_type: Qwen2Tokenizer).
    `lowercase`: a class that adds a lowercasing normalizer (other ids for a SentencePiece model, which
    splits digits itself)."""
    from pathlib import Path

    from tokenizers import Tokenizer, pre_tokenizers

    class Loaded:
        def __init__(self, folder):
            self._tok = Tokenizer.from_file(f"{folder}/tokenizer.json")
            config = Path(folder) / "config.json"
            if isinstance(split_digits, str):
                splits = config.is_file() and json.loads(config.read_text())["model_type"] == split_digits
            else:
                splits = split_digits
            if splits:
                digits = pre_tokenizers.Digits(individual_digits=True)
                rest = self._tok.pre_tokenizer  # None for a Unigram tokenizer.json (its Metaspace is a normalizer)
                self._tok.pre_tokenizer = digits if rest is None else pre_tokenizers.Sequence([digits, rest])

        def encode(self, text, add_special_tokens=True):
            assert add_special_tokens is False
            return self._tok.encode(text.lower() if lowercase else text, add_special_tokens=False).ids

    module = types.ModuleType("transformers")
    module.__version__ = "stand-in"
    module.AutoTokenizer = types.SimpleNamespace(from_pretrained=Loaded)
    return module
