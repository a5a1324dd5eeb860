"""Utility and diversity metrics on text (METHOD section 9): tokenisation, EM, token F1, ROUGE-L,
Distinct-n and Self-BLEU-4."""

from __future__ import annotations

import math
import random
import re
import string
import unicodedata
from collections import Counter
from collections.abc import Sequence

from polyalign.data.text import CJK_IDEOGRAPH

TOKENIZATIONS = ("cjk", "reference")
_ASCII_PUNCTUATION = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_CJK_CHAR = re.compile(f"([{CJK_IDEOGRAPH}])")


def normalize_answer(text: str, tokenize: str = "cjk") -> str:
    """SQuAD's normalize_answer (lower-case, no ASCII punctuation, no a/an/the, single spaces); the
    `cjk` variant also removes all other punctuation and spaces out every CJK character."""
    text = text.lower()
    if tokenize == "cjk":
        text = "".join(" " if unicodedata.category(ch).startswith("P") else ch for ch in text)
        text = _CJK_CHAR.sub(r" \1 ", text)
    else:
        text = "".join(ch for ch in text if ch not in _ASCII_PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def tokens(text: str, tokenize: str = "cjk") -> list[str]:
    return normalize_answer(text, tokenize).split()


def token_f1(prediction: list[str], gold: list[str]) -> float:
    """SQuAD multiset-overlap F1; both empty = 1, one empty = 0."""
    if not prediction or not gold:
        return float(prediction == gold)
    common = sum((Counter(prediction) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(prediction), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    if len(a) < len(b):
        a, b = b, a
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b, start=1):
            current.append(previous[j - 1] + 1 if x == y else max(previous[j], current[j - 1]))
        previous = current
    return previous[-1]


def rouge_l_f1(prediction: list[str], gold: list[str]) -> float:
    """ROUGE-L F1 (beta 1) over tokens; both empty = 1, one empty = 0."""
    if not prediction or not gold:
        return float(prediction == gold)
    lcs = lcs_length(prediction, gold)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(prediction), lcs / len(gold)
    return 2 * precision * recall / (precision + recall)


def utility_scores(prediction: str, gold: str, tokenize: str) -> dict[str, float]:
    p, g = tokens(prediction, tokenize), tokens(gold, tokenize)
    return {"raw_em": float(prediction == gold), "em": float(p == g), "qa_f1": token_f1(p, g),
            "rouge_l_f1": rouge_l_f1(p, g)}


# --- diversity --------------------------------------------------------------------------------------

def distinct_n(token_lists: Sequence[Sequence[str]], n: int) -> float:
    """Unique n-grams / all n-grams, pooled over texts (never across two texts); 0 when there are none."""
    grams = [tuple(t[i:i + n]) for t in token_lists for i in range(len(t) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def _ngrams(tokens_: Sequence[str], n: int) -> Counter:
    return Counter(tuple(tokens_[i:i + n]) for i in range(len(tokens_) - n + 1))


def sentence_bleu(references: Sequence[Sequence[str]], hypothesis: Sequence[str], max_n: int = 4,
                  epsilon: float = 0.1) -> float:
    """Sentence BLEU with uniform weights and smoothing method 1, as NLTK defines them: clipped n-gram
    precisions, epsilon / denominator for a zero count, the closest reference length for the brevity
    penalty, and 0 when no unigram matches."""
    return _bleu([_ngram_table(r, max_n) for r in references], [len(r) for r in references],
                 _ngram_table(hypothesis, max_n), len(hypothesis), epsilon)


def _ngram_table(tokens_: Sequence[str], max_n: int) -> list[Counter]:
    return [_ngrams(tokens_, n) for n in range(1, max_n + 1)]


def _bleu(references: Sequence[list[Counter]], reference_lengths: Sequence[int], hypothesis: list[Counter],
          hyp_len: int, epsilon: float) -> float:
    """sentence_bleu from n-gram counts made once per text (Self-BLEU reuses each text's counts as a
    reference for every other candidate, which is where its time went)."""
    max_n = len(hypothesis)
    numerators, denominators = [], []
    for n, counts in enumerate(hypothesis):
        numerators.append(sum(min(count, max(r[n].get(gram, 0) for r in references)) for gram, count in counts.items()))
        denominators.append(max(1, sum(counts.values())))
    if numerators[0] == 0:
        return 0.0
    ref_len = min(reference_lengths, key=lambda r: (abs(r - hyp_len), r))
    if hyp_len == 0:
        return 0.0
    brevity = 1.0 if hyp_len > ref_len else math.exp(1 - ref_len / hyp_len)
    log_precision = 0.0
    for numerator, denominator in zip(numerators, denominators):
        p = numerator / denominator if numerator else epsilon / denominator
        log_precision += math.log(p) / max_n
    return brevity * math.exp(log_precision)


def self_bleu(texts: Sequence[str], tokenize: str, max_texts: int = 500, max_references: int = 100,
              seed: int = 42) -> float:
    """Self-BLEU-4 with the reference code's sampling: a fresh Random(seed); at most max_texts texts;
    texts without tokens dropped; each candidate against up to max_references of the others."""
    rng = random.Random(seed)
    texts = list(texts)
    if len(texts) > max_texts:
        texts = rng.sample(texts, max_texts)
    token_lists = [t for t in (tokens(x, tokenize) for x in texts) if t]
    if len(token_lists) < 2:
        return 0.0
    tables = [_ngram_table(t, 4) for t in token_lists]
    lengths = [len(t) for t in token_lists]
    scores = []
    for i in range(len(token_lists)):
        others = [j for j in range(len(token_lists)) if j != i]
        if len(others) > max_references:
            # the reference code samples the token lists themselves; sampling their indices in the same
            # order draws the same ones
            others = rng.sample(others, max_references)
        scores.append(_bleu([tables[j] for j in others], [lengths[j] for j in others], tables[i], lengths[i], 0.1))
    return sum(scores) / len(scores)


def diversity(texts: Sequence[str], tokenize: str) -> dict[str, float]:
    token_lists = [tokens(t, tokenize) for t in texts]
    return {"distinct_1": distinct_n(token_lists, 1), "distinct_2": distinct_n(token_lists, 2),
            "distinct_3": distinct_n(token_lists, 3), "self_bleu_4": self_bleu(texts, tokenize)}
