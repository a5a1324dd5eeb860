"""Utility and diversity metrics on text (METHOD section 9): tokenisation, EM, token F1, ROUGE-L,
Distinct-n and Self-BLEU-4."""

from __future__ import annotations

import functools
import math
import random
import re
import string
import sys
import unicodedata
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence

import numpy as np
from scipy.stats import norm

from polyalign.data.text import CJK_IDEOGRAPH

TOKENIZATIONS = ("cjk", "reference")
# str.translate tables, not a loop over characters: every answer of an evaluation is tokenised several times
_DELETE_ASCII_PUNCTUATION = str.maketrans("", "", string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_CJK_RANGES = [(ord(first), ord(last)) for first, last in re.findall(r"(.)-(.)", CJK_IDEOGRAPH)]


def normalize_answer(text: str, tokenize: str = "cjk") -> str:
    """SQuAD's normalize_answer (lower-case, ASCII punctuation deleted, no a/an/the, single spaces:
    "don't" is "dont", "$5." is "5"); the `cjk` variant (METHOD section 9) also removes every other
    punctuation mark and spaces out every CJK character. A full-width mark becomes a space rather than
    nothing: Chinese text puts no space beside it, so "Python，Java" would otherwise read as one word."""
    text = text.lower().translate(_DELETE_ASCII_PUNCTUATION)
    if tokenize == "cjk":
        text = text.translate(_cjk_spacing())
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


@functools.cache
def _cjk_spacing() -> dict[int, str]:
    """The `cjk` tokenisation's table: every Unicode punctuation mark (category P*) to a space, every CJK
    ideograph to itself between spaces. Built once, on first use (about 0.25 s, 1 MB)."""
    table = {cp: " " for cp in range(sys.maxunicode + 1) if unicodedata.category(chr(cp)).startswith("P")}
    for first, last in _CJK_RANGES:
        table.update({cp: f" {chr(cp)} " for cp in range(first, last + 1)})
    return table


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
    clipped = []
    for n in range(1, max_n + 1):
        max_ref: Counter = Counter()
        for reference in references:
            max_ref |= _ngrams(reference, n)
        clipped.append({gram: max_ref[gram] for gram in _ngrams(hypothesis, n)})
    return _bleu(_ngram_table(hypothesis, max_n), clipped, len(hypothesis), [len(r) for r in references], epsilon)


def _ngram_table(tokens_: Sequence[str], max_n: int) -> list[Counter]:
    return [_ngrams(tokens_, n) for n in range(1, max_n + 1)]


def _bleu(hypothesis: list[Counter], reference_max: list[Mapping], hyp_len: int, reference_lengths: Sequence[int],
          epsilon: float) -> float:
    """BLEU from the hypothesis' n-gram counts and, for each of its n-grams, the largest count in any
    reference."""
    max_n = len(hypothesis)
    numerators = [sum(min(count, reference_max[n].get(gram, 0)) for gram, count in counts.items())
                  for n, counts in enumerate(hypothesis)]
    denominators = [max(1, sum(counts.values())) for counts in hypothesis]
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
    texts without tokens dropped; each candidate against up to max_references of the others: the mean
    of self_bleu_scores."""
    scores = self_bleu_scores(texts, tokenize, max_texts, max_references, seed)
    return sum(scores) / len(scores) if scores else 0.0


def self_bleu_scores(texts: Sequence[str], tokenize: str, max_texts: int = 500, max_references: int = 100,
                     seed: int = 42) -> list[float]:
    """Each sampled candidate's BLEU-4 against its sampled references (see self_bleu); none for fewer
    than two texts with tokens.

    Each text's n-grams are counted once, and an n-gram's largest count among a candidate's references
    is looked up in the n-gram's postings (the texts that contain it): most 3- and 4-grams occur in one
    text only, so this is far cheaper than scanning every reference for every n-gram."""
    rng = random.Random(seed)
    texts = list(texts)
    if len(texts) > max_texts:
        texts = rng.sample(texts, max_texts)
    token_lists = [t for t in (tokens(x, tokenize) for x in texts) if t]
    if len(token_lists) < 2:
        return []
    tables = [_ngram_table(t, 4) for t in token_lists]
    postings: list[dict[tuple, dict[int, int]]] = [defaultdict(dict) for _ in range(4)]
    for index, table in enumerate(tables):
        for n, counts in enumerate(table):
            for gram, count in counts.items():
                postings[n][gram][index] = count
    scores = []
    for i, table in enumerate(tables):
        others = [j for j in range(len(token_lists)) if j != i]
        if len(others) > max_references:
            # the reference code samples the token lists themselves; sampling their indices in the same
            # order draws the same ones
            others = rng.sample(others, max_references)
        chosen = set(others)
        reference_max = [{gram: _largest_count(postings[n][gram], chosen) for gram in counts}
                         for n, counts in enumerate(table)]
        scores.append(_bleu(table, reference_max, len(token_lists[i]), [len(token_lists[j]) for j in others], 0.1))
    return scores


def _largest_count(posting: dict[int, int], chosen: set[int]) -> int:
    """The largest count of an n-gram among the chosen texts, from its posting (text -> count), walking the
    smaller of the two: a common word's posting holds most texts, a rare 4-gram's one."""
    if len(posting) <= len(chosen):
        return max((c for j, c in posting.items() if j in chosen), default=0)
    return max((posting.get(j, 0) for j in chosen), default=0)


def diversity(texts: Sequence[str], tokenize: str) -> dict[str, float]:
    token_lists = [tokens(t, tokenize) for t in texts]
    return {"distinct_1": distinct_n(token_lists, 1), "distinct_2": distinct_n(token_lists, 2),
            "distinct_3": distinct_n(token_lists, 3), "self_bleu_4": self_bleu(texts, tokenize)}


def diversity_with_intervals(texts: Sequence[str], tokenize: str, draws: int, seed: int, level: float,
                             groups: int = 20) -> tuple[dict[str, float], dict[str, list[float] | None]]:
    """diversity(texts) and a central `level` interval for each of its numbers.

    Distinct-n is a ratio over the whole set, not a mean over responses: a bootstrap draw repeats
    responses and so lowers it, and a subset has fewer repeats and raises it. Its interval is the
    grouped jackknife's normal interval at the full size (the responses in `groups` seeded groups, each
    left out once). Self-BLEU is a mean of one score per candidate, bootstrapped over the candidates
    (`draws`). None where there are too few responses."""
    token_lists = [tokens(t, tokenize) for t in texts]
    scores = self_bleu_scores(texts, tokenize)
    values = {f"distinct_{n}": distinct_n(token_lists, n) for n in (1, 2, 3)}
    values["self_bleu_4"] = sum(scores) / len(scores) if scores else 0.0
    z = float(norm.ppf(0.5 + level / 2))
    intervals: dict[str, list[float] | None] = {
        f"distinct_{n}": _jackknife_interval(token_lists, n, groups, seed, z) for n in (1, 2, 3)}
    if len(scores) >= 2:
        rng = np.random.default_rng(seed)
        means = np.asarray(scores)[rng.integers(0, len(scores), (draws, len(scores)))].mean(axis=1)
        tail = (1 - level) / 2
        intervals["self_bleu_4"] = [float(np.quantile(means, tail)), float(np.quantile(means, 1 - tail))]
    else:
        intervals["self_bleu_4"] = None
    return values, intervals


def _jackknife_interval(token_lists: Sequence[Sequence[str]], n: int, groups: int, seed: int,
                        z: float) -> list[float] | None:
    """distinct_n ± z·se, se from the delete-a-group jackknife; each group's n-gram counts are taken
    off the totals, so the whole costs one pass over the n-grams."""
    per_text = [_ngrams(t, n) for t in token_lists]
    groups = min(groups, sum(1 for c in per_text if c))
    if groups < 2:
        return None
    order = np.random.default_rng(seed).permutation(len(per_text))
    total: Counter = Counter()
    for counts in per_text:
        total.update(counts)
    all_grams = sum(total.values())
    estimates = []
    for members in np.array_split(order, groups):
        left_out: Counter = Counter()
        for i in members:
            left_out.update(per_text[i])
        kept = all_grams - sum(left_out.values())
        vanished = sum(1 for gram, count in left_out.items() if total[gram] == count)
        estimates.append((len(total) - vanished) / kept if kept else 0.0)
    estimates = np.asarray(estimates)
    se = math.sqrt((groups - 1) / groups * float(((estimates - estimates.mean()) ** 2).sum()))
    point = len(total) / all_grams
    return [max(0.0, point - z * se), min(1.0, point + z * se)]
