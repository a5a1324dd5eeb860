"""Language identification for rows whose source does not declare a language.

Chinese, Japanese and Korean are told apart by script, which is exact and cheap; Traditional and
Simplified Chinese are both `zh`. Text in other scripts goes to lingua, a statistical detector that
runs offline (the `langid` extra: only sources without a declared language need it). Short
Latin-script texts are too ambiguous for any detector ("Yes." reads as Catalan), so they default to
English unless the detector is confident. lingua runs in its low-accuracy mode
(trigram models only): about 70 MB and a quarter second to load, against about 900 MB and five seconds
for the full models, with the same answers on sentence-length text.
"""

from __future__ import annotations

import functools
import unicodedata

UNDETERMINED = "und"
_MIN_LETTERS_FOR_DETECTOR = 24
_MIN_CONFIDENCE = 0.6


def _script_counts(text: str) -> dict[str, int]:
    counts = {"han": 0, "kana": 0, "hangul": 0, "latin": 0, "other": 0}
    for ch in text:
        cp = ord(ch)
        if 0x3400 <= cp <= 0x4DBF or 0x4E00 <= cp <= 0x9FFF or 0xF900 <= cp <= 0xFAFF or 0x20000 <= cp <= 0x2FA1F:
            counts["han"] += 1
        elif 0x3040 <= cp <= 0x30FF or 0x31F0 <= cp <= 0x31FF:
            counts["kana"] += 1
        elif 0xAC00 <= cp <= 0xD7AF or 0x1100 <= cp <= 0x11FF or 0x3130 <= cp <= 0x318F:
            counts["hangul"] += 1
        elif ch.isalpha():
            if cp < 0x250 or 0x1E00 <= cp <= 0x1EFF or 0xFF21 <= cp <= 0xFF5A:
                counts["latin"] += 1
            else:
                counts["other"] += 1
    return counts


# The script each declared language is written in; a language not listed is not checked.
_SCRIPT_OF = {"zh": ("han",), "ja": ("kana", "han"), "ko": ("hangul", "han")}
_LATIN_LANGUAGES = frozenset("en fr de es it pt nl sv da no fi pl cs sk sl hr ro hu tr id ms vi".split())
_MIN_LETTERS_FOR_SCRIPT = 10


def contradicting_script(declared: str, text: str) -> str | None:
    """The script most of `text`'s letters are in, when it cannot be the declared language's (e.g.
    Arabic or Hebrew letters in an `en` source, no Chinese character in a `zh` one); None when the text
    agrees, is too short to tell, or the language is not one whose script is known here."""
    expected = _SCRIPT_OF.get(declared) or (("latin",) if declared in _LATIN_LANGUAGES else None)
    if expected is None:
        return None
    counts = _script_counts(text)
    if sum(counts.values()) < _MIN_LETTERS_FOR_SCRIPT:
        return None
    # weighed as detect_language does: one CJK character carries about a short word
    weighed = {script: n * (3 if script in ("han", "kana", "hangul") else 1) for script, n in counts.items()}
    if sum(weighed[s] for s in expected) * 2 >= sum(weighed.values()):
        return None
    return max(weighed, key=weighed.get)


@functools.lru_cache(maxsize=1)
def _detector():
    from polyalign.extras import require

    lingua = require("lingua", "langid", "detecting the language of rows whose source declares none",
                     "or give the source a `language:` in the data config")
    return lingua.LanguageDetectorBuilder.from_all_languages().with_low_accuracy_mode().build()


def _lingua_code(text: str) -> tuple[str, float]:
    values = _detector().compute_language_confidence_values(text[:2000])
    if not values:
        return UNDETERMINED, 0.0
    best = values[0]
    return best.language.iso_code_639_1.name.lower(), best.value


def detect_language(text: str) -> str:
    """ISO 639-1 code of the dominant language of `text`, or "und" when there is no letter at all."""
    counts = _script_counts(text)
    cjk = counts["han"] + counts["kana"] + counts["hangul"]
    letters = cjk + counts["latin"] + counts["other"]
    if letters == 0:
        return UNDETERMINED
    # One CJK character carries about as much as a short Latin word; weigh them so that a Chinese
    # sentence quoting an English term stays Chinese and vice versa.
    if cjk * 3 >= counts["latin"] + counts["other"]:
        if counts["hangul"] > counts["han"] + counts["kana"]:
            return "ko"
        if counts["kana"] * 10 > counts["han"] + counts["kana"]:
            return "ja"
        return "zh"
    if counts["latin"] >= counts["other"]:
        if counts["latin"] < _MIN_LETTERS_FOR_DETECTOR:
            return "en"
        code, confidence = _lingua_code(text)
        return code if code != "en" and confidence >= _MIN_CONFIDENCE else "en"
    code, _ = _lingua_code(unicodedata.normalize("NFC", text))
    return code
