"""Response features, feature set `v1` (FEATURES.md): 134 text features computed on the normalised text.

`v1` is the reference extractor's deterministic behaviour without NLTK data: every token is POS-tagged
`X`, the stopword list is empty and sentiment is zero, so those features are constants kept only for
comparability. Floats are rounded to 6 decimals; every division by zero gives 0.
"""

from __future__ import annotations

import functools
import math
import re
from collections import Counter
from collections.abc import Sequence

from polyalign.data.text import CJK_IDEOGRAPH, LENGTH_UNIT_PATTERNS, normalize

FEATURE_SET = "v1"

WORD_TOKEN = LENGTH_UNIT_PATTERNS["v2"]
LEXICAL_TOKEN = re.compile(rf"([A-Za-z]+(?:'[A-Za-z]+)?)|\d+|[{CJK_IDEOGRAPH}]")
ALPHA_TOKEN = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)?")
SENTENCE_BREAK = re.compile(r"(?<=[.!?。！？；;])|\n+")
PARAGRAPH_BREAK = re.compile(r"\n\s*\n")
PUNCTUATION_CHAR = re.compile(r"[^\w\s]")
NON_LETTER = re.compile(r"[^a-z]")
VOWEL_RUN = re.compile(r"[aeiouy]+")
ELLIPSIS = re.compile(r"\.\.\.|…")
YEAR = re.compile(r"\b(1[5-9]\d\d|20\d\d|2100)\b")
ORDINAL = re.compile(r"\b\d+(st|nd|rd|th)\b", re.IGNORECASE)
URL = re.compile(r"(https?://|www\.)\S+", re.IGNORECASE)
EMAIL = re.compile(r"\b[\w.+-]+@[\w-]+\.[\w.-]+\b")
BULLET_LINE = re.compile(r"^\s*[-*•]\s", re.MULTILINE)
ENUMERATED_LINE = re.compile(r"^\s*(\d+|[A-Za-z])[.)]\s", re.MULTILINE)
REPEATED_CHAR = re.compile(r"(.)\1{2,}", re.DOTALL)

SENTENCE_END = ".!?。！？"
UNIVERSAL_TAGS = ("ADJ", "ADP", "ADV", "CONJ", "DET", "NOUN", "NUM", "PRON", "PRT", "VERB", "X")
# Punctuation features: ASCII and full-width variants are counted together.
PUNCTUATION_GROUPS = {
    "question_mark_count": "?？",
    "exclamation_mark_count": "!！",
    "comma_count": ",，",
    "semicolon_count": ";；",
    "colon_count": ":：",
    "period_count": ".。",
    "quote_count": "\"“”‘’「」『』",
    "apostrophe_count": "'",
    "hyphen_count": "-–—－",
    "slash_count": "/",
    "parenthesis_count": "()（）",
    "bracket_count": "[]{}【】",
}

FEATURE_NAMES: tuple[str, ...] = (
    "char_count", "char_no_space_count", "whitespace_count", "newline_count", "paragraph_count",
    "punctuation_count", "digit_char_count", "alphabetic_char_count", "uppercase_char_count",
    "lowercase_char_count", "non_ascii_char_count",
    "token_count", "word_token_count", "unique_word_count", "sentence_count", "avg_char_per_token",
    "avg_char_per_sentence", "avg_word_length",
    "avg_tokens_per_sentence", "min_tokens_per_sentence", "max_tokens_per_sentence", "std_tokens_per_sentence",
    "avg_sentence_char_length", "min_sentence_char_length", "max_sentence_char_length", "std_sentence_char_length",
    "short_word_count", "medium_word_count", "long_word_count", "very_long_word_count",
    "short_word_ratio", "long_word_ratio", "very_long_word_ratio",
    "type_token_ratio", "root_ttr", "corrected_ttr", "hapax_ratio", "dislegomena_ratio",
    "distinct_1", "distinct_2", "distinct_3", "repeated_token_ratio", "repeated_bigram_ratio",
    "adjacent_repeat_count", "max_token_frequency", "max_token_frequency_ratio", "shannon_entropy",
    "syllable_count", "avg_syllables_per_word", "multisyllabic_word_count", "multisyllabic_word_ratio",
    "flesch_reading_ease", "flesch_kincaid_grade", "gunning_fog", "smog_index", "coleman_liau",
    "automated_readability_index",
    "question_mark_count", "exclamation_mark_count", "comma_count", "semicolon_count", "colon_count",
    "period_count", "ellipsis_count", "quote_count", "apostrophe_count", "hyphen_count", "slash_count",
    "parenthesis_count", "bracket_count", "punctuation_density",
    "question_sentence_ratio", "exclam_sentence_ratio", "terminal_punctuation_ratio",
    "sentence_initial_capital_ratio",
    "all_caps_token_count", "title_case_token_count", "lowercase_token_count", "all_caps_token_ratio",
    "title_case_token_ratio", "contraction_count", "number_token_count",
    "year_token_count", "ordinal_token_count", "url_count", "email_count",
    "stopword_count", "stopword_ratio", "content_word_count", "content_word_ratio", "lexical_density",
    "modal_count", "modal_ratio", "wh_word_count", "wh_word_ratio", "proper_noun_count", "proper_noun_ratio",
    "past_verb_count", "gerund_verb_count", "past_participle_count", "non_3sg_present_verb_count",
    "third_person_present_verb_count", "base_verb_count",
    *(f"pos_{tag.lower()}_{kind}" for tag in UNIVERSAL_TAGS for kind in ("count", "ratio")),
    "vader_neg", "vader_neu", "vader_pos", "vader_compound",
    "bullet_line_count", "enumerated_line_count", "code_fence_count", "inline_code_marker_count",
    "repeated_char_sequence_count",
)
assert len(FEATURE_NAMES) == 134, len(FEATURE_NAMES)


def _div(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else 0.0


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _pstd(values: Sequence[float]) -> float:
    if len(values) < 2:
        return 0.0
    mean = _mean(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


@functools.lru_cache(maxsize=1 << 16)  # words repeat: a response's readability looks each one up
def syllables(word: str) -> int:
    """Vowel-group syllable count of an English word (FEATURES.md section 2, readability)."""
    letters = NON_LETTER.sub("", word.lower())
    if len(letters) <= 3:
        return 1
    count = len(VOWEL_RUN.findall(letters))
    if letters.endswith("e") and not letters.endswith(("le", "ye")) and count > 1:
        count -= 1
    return max(1, count)


def sentences(text: str) -> list[str]:
    """Split after every sentence-ending mark and at newline runs; strip; drop empty pieces."""
    return [piece.strip() for piece in SENTENCE_BREAK.split(text) if piece.strip()]


def lexical_tokens(text: str) -> list[str]:
    """Words (ASCII-alphabetic ones lower-cased), digit runs and single CJK characters; no punctuation."""
    return [m.group(0).lower() if m.group(1) else m.group(0) for m in LEXICAL_TOKEN.finditer(text)]


def _ngram_stats(tokens: Sequence[str], n: int) -> tuple[int, int, int]:
    """(number of n-grams, distinct n-grams, sum over n-gram types of count - 1)."""
    grams = list(zip(*(tokens[i:] for i in range(n))))
    counts = Counter(grams)
    return len(grams), len(counts), sum(c - 1 for c in counts.values() if c > 1)


def _readability(text: str, word_count: int, sentence_count: int, char_no_space: int,
                 alphabetic_chars: int) -> dict[str, float]:
    alpha_words = [w.lower() for w in ALPHA_TOKEN.findall(text)]
    english_words = len(alpha_words)
    counts = [syllables(w) for w in alpha_words]
    syllable_count = sum(counts)
    multisyllabic = sum(1 for c in counts if c >= 3)
    spw = _div(syllable_count, english_words)
    wps = _div(word_count, sentence_count)
    out = {
        "syllable_count": syllable_count,
        "avg_syllables_per_word": spw,
        "multisyllabic_word_count": multisyllabic,
        "multisyllabic_word_ratio": _div(multisyllabic, word_count),
    }
    if english_words == 0:
        return {**out, "flesch_reading_ease": 0.0, "flesch_kincaid_grade": 0.0, "gunning_fog": 0.0,
                "smog_index": 0.0, "coleman_liau": 0.0, "automated_readability_index": 0.0}
    return {
        **out,
        "flesch_reading_ease": 206.835 - 1.015 * wps - 84.6 * spw,
        "flesch_kincaid_grade": 0.39 * wps + 11.8 * spw - 15.59,
        "gunning_fog": 0.4 * (wps + 100 * multisyllabic / english_words),
        "smog_index": (1.043 * math.sqrt(multisyllabic * 30 / sentence_count) + 3.1291
                       if sentence_count and multisyllabic else 0.0),
        "coleman_liau": (0.0588 * (100 * alphabetic_chars / english_words)
                         - 0.296 * (100 * sentence_count / english_words) - 15.8),
        "automated_readability_index": 4.71 * (char_no_space / english_words) + 0.5 * wps - 21.43,
    }


def text_features(raw_text: str) -> dict[str, float]:
    """The 134 `v1` features of one response (normalised here, so raw model outputs are fine)."""
    text = normalize(raw_text)
    f: dict[str, float] = {}

    char_count = len(text)
    char_no_space = len(text.replace(" ", "").replace("\n", ""))
    f["char_count"] = char_count
    f["char_no_space_count"] = char_no_space
    f["whitespace_count"] = sum(map(str.isspace, text))
    f["newline_count"] = text.count("\n")
    f["paragraph_count"] = sum(1 for chunk in PARAGRAPH_BREAK.split(text) if chunk.strip()) if text else 0
    f["punctuation_count"] = punctuation_count = len(PUNCTUATION_CHAR.findall(text))
    f["digit_char_count"] = sum(map(str.isdigit, text))
    f["alphabetic_char_count"] = alphabetic_chars = sum(map(str.isalpha, text))
    f["uppercase_char_count"] = sum(map(str.isupper, text))
    f["lowercase_char_count"] = sum(map(str.islower, text))
    f["non_ascii_char_count"] = char_count - len(text.encode("ascii", "ignore"))

    tokens = WORD_TOKEN.findall(text)
    words = lexical_tokens(text)
    sentence_list = sentences(text)
    token_count, word_count, sentence_count = len(tokens), len(words), len(sentence_list)
    word_counts = Counter(words)
    types = len(word_counts)
    f["token_count"] = token_count
    f["word_token_count"] = word_count
    f["unique_word_count"] = types
    f["sentence_count"] = sentence_count
    f["avg_char_per_token"] = _div(char_no_space, token_count)
    f["avg_char_per_sentence"] = _div(char_count, sentence_count)
    f["avg_word_length"] = _mean([len(w) for w in words])

    per_sentence_tokens = [n for n in (len(WORD_TOKEN.findall(s)) for s in sentence_list) if n > 0]
    per_sentence_chars = [len(s) for s in sentence_list]
    for name, values in (("tokens_per_sentence", per_sentence_tokens), ("sentence_char_length", per_sentence_chars)):
        f[f"avg_{name}"] = _mean(values)
        f[f"min_{name}"] = min(values, default=0)
        f[f"max_{name}"] = max(values, default=0)
        f[f"std_{name}"] = _pstd(values)

    lengths = [len(w) for w in words]
    f["short_word_count"] = short = sum(1 for n in lengths if n <= 3)
    f["medium_word_count"] = sum(1 for n in lengths if 4 <= n <= 6)
    f["long_word_count"] = long_ = sum(1 for n in lengths if n >= 7)
    f["very_long_word_count"] = very_long = sum(1 for n in lengths if n >= 11)
    f["short_word_ratio"] = _div(short, word_count)
    f["long_word_ratio"] = _div(long_, word_count)
    f["very_long_word_ratio"] = _div(very_long, word_count)

    f["type_token_ratio"] = _div(types, word_count)
    f["root_ttr"] = _div(types, math.sqrt(word_count))
    f["corrected_ttr"] = _div(types, math.sqrt(2 * word_count))
    f["hapax_ratio"] = _div(sum(1 for c in word_counts.values() if c == 1), word_count)
    f["dislegomena_ratio"] = _div(sum(1 for c in word_counts.values() if c == 2), word_count)
    f["distinct_1"] = _div(types, word_count)
    bigrams, distinct_bigrams, repeated_bigrams = _ngram_stats(words, 2)
    trigrams, distinct_trigrams, _ = _ngram_stats(words, 3)
    f["distinct_2"] = _div(distinct_bigrams, bigrams)
    f["distinct_3"] = _div(distinct_trigrams, trigrams)
    f["repeated_token_ratio"] = _div(sum(c - 1 for c in word_counts.values() if c > 1), word_count)
    f["repeated_bigram_ratio"] = _div(repeated_bigrams, bigrams)
    f["adjacent_repeat_count"] = sum(1 for a, b in zip(words, words[1:]) if a == b)
    max_frequency = max(word_counts.values(), default=0)
    f["max_token_frequency"] = max_frequency
    f["max_token_frequency_ratio"] = _div(max_frequency, word_count)
    f["shannon_entropy"] = -sum((c / word_count) * math.log2(c / word_count) for c in word_counts.values()) + 0.0

    f.update(_readability(text, word_count, sentence_count, char_no_space, alphabetic_chars))

    for name, chars in PUNCTUATION_GROUPS.items():
        f[name] = sum(text.count(ch) for ch in chars)
    f["ellipsis_count"] = len(ELLIPSIS.findall(text))
    f["punctuation_density"] = _div(punctuation_count, token_count)

    f["question_sentence_ratio"] = _div(sum(1 for s in sentence_list if s[-1] in "?？"), sentence_count)
    f["exclam_sentence_ratio"] = _div(sum(1 for s in sentence_list if s[-1] in "!！"), sentence_count)
    f["terminal_punctuation_ratio"] = _div(sum(1 for s in sentence_list if s[-1] in SENTENCE_END), sentence_count)
    f["sentence_initial_capital_ratio"] = _div(sum(1 for s in sentence_list if s[0].isupper()), sentence_count)

    all_caps = sum(1 for t in tokens if len(t) > 1 and t.isupper())
    title_case = sum(1 for t in tokens if len(t) > 1 and t[0].isupper() and t[1:].islower())
    f["all_caps_token_count"] = all_caps
    f["title_case_token_count"] = title_case
    f["lowercase_token_count"] = sum(map(str.islower, tokens))
    f["all_caps_token_ratio"] = _div(all_caps, token_count)
    f["title_case_token_ratio"] = _div(title_case, token_count)
    f["contraction_count"] = sum(1 for t in tokens if "'" in t)
    f["number_token_count"] = sum(1 for t in tokens if any(map(str.isdigit, t)))
    f["year_token_count"] = len(YEAR.findall(text))
    f["ordinal_token_count"] = len(ORDINAL.findall(text))
    f["url_count"] = len(URL.findall(text))
    f["email_count"] = len(EMAIL.findall(text))

    # Offline v1: no stopword list, no tagger (every token is X), no sentiment lexicon.
    for name in ("stopword_count", "stopword_ratio", "content_word_count", "content_word_ratio", "lexical_density",
                 "modal_count", "modal_ratio", "wh_word_count", "wh_word_ratio", "proper_noun_count",
                 "proper_noun_ratio", "past_verb_count", "gerund_verb_count", "past_participle_count",
                 "non_3sg_present_verb_count", "third_person_present_verb_count", "base_verb_count",
                 "vader_neg", "vader_neu", "vader_pos", "vader_compound"):
        f[name] = 0
    for tag in UNIVERSAL_TAGS:
        count = token_count if tag == "X" else 0
        f[f"pos_{tag.lower()}_count"] = count
        f[f"pos_{tag.lower()}_ratio"] = _div(count, token_count)

    f["bullet_line_count"] = len(BULLET_LINE.findall(text))
    f["enumerated_line_count"] = len(ENUMERATED_LINE.findall(text))
    f["code_fence_count"] = text.count("```")
    f["inline_code_marker_count"] = text.count("`")
    f["repeated_char_sequence_count"] = len(REPEATED_CHAR.findall(text))

    return {name: (round(f[name], 6) if isinstance(f[name], float) else f[name]) for name in FEATURE_NAMES}
