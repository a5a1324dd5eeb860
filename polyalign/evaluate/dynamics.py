"""Turn dynamics (TDM, METHOD section 9): how a response relates to the user turn it answers, for
human and generated responses of multi-turn rows."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from sklearn.decomposition import TruncatedSVD
from sklearn.feature_extraction.text import TfidfVectorizer

from polyalign.evaluate.naturalness import MIN_BUCKET_ROWS
from polyalign.evaluate.support import signed_w1
from polyalign.evaluate.text_metrics import tokens

# what a row contributes, for the human answer and the generated one alike
ROW_MEASURES = ("length_ratio", "lexical", "semantic")


def tfidf(tokenize: str) -> TfidfVectorizer:
    """TDM's TF-IDF: in the default mode over the evaluation's own tokens (every CJK character one, as F1
    and diversity count them: a run of Chinese characters is otherwise one "word", so a Chinese answer
    shares no word with its question); --compat reference's `\\b\\w+\\b`, as the authors' code."""
    if tokenize == "cjk":
        return TfidfVectorizer(tokenizer=lambda text: tokens(text, tokenize), token_pattern=None, lowercase=False,
                               norm="l2")
    return TfidfVectorizer(lowercase=True, token_pattern=r"\b\w+\b", norm="l2")


def _cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    dots = (a * b).sum(axis=1)
    ok = (na > 1e-12) & (nb > 1e-12)
    return np.where(ok, dots / np.where(ok, na * nb, 1.0), 0.0)


def _per_unit(value: np.ndarray) -> np.ndarray:
    """A divisor that leaves a (near) zero scale at 1: a constant human side is compared unscaled."""
    return np.where(value > 1e-12, value, 1.0)


def _gaps(generated: np.ndarray, human: np.ndarray, shares: np.ndarray) -> np.ndarray:
    """W1(generated, human) / std(human) of the rows weighted by each row of `shares` (D, n), which sum
    to 1: the rows are resampled in pairs, a question with both its answers."""
    w1 = signed_w1(np.concatenate([generated, human]), np.concatenate([shares, -shares], axis=1))
    centred = human[None, :] - (shares @ human)[:, None]
    std = np.sqrt((shares * centred**2).sum(axis=1))
    return w1 / _per_unit(std)


def _transition_gaps(q: np.ndarray, h: np.ndarray, g: np.ndarray, shares: np.ndarray) -> np.ndarray:
    """||C(q, g) - C(q, h)|| / ||C(q, h)|| of the question-answer cross-covariances under each row of
    `shares` (D, n)."""
    out = np.empty(len(shares))
    for d, share in enumerate(shares):
        qc = (q - share @ q) * share[:, None]
        human, generated = qc.T @ (h - share @ h), qc.T @ (g - share @ g)
        out[d] = np.linalg.norm(generated - human) / _per_unit(np.linalg.norm(human))
    return out


def _bucket_tdm(rows: dict, lq: np.ndarray, idx: np.ndarray, counts: np.ndarray) -> dict:
    """The gaps, their similarities 1/(1 + gap) and TDM (their mean) of the rows `idx` of one bucket, under
    each row of `counts` (D, len(idx)): how often each row is taken."""
    shares = counts / counts.sum(axis=1, keepdims=True)
    gaps = {k: _gaps(rows["generated"][k][idx], rows["human"][k][idx], shares) for k in ROW_MEASURES}
    gaps["transition"] = _transition_gaps(lq[idx], rows["human"]["latent"][idx], rows["generated"]["latent"][idx],
                                          shares)
    similarities = {k: 1.0 / (1.0 + v) for k, v in gaps.items()}
    return {"gaps": gaps, "similarities": similarities, "tdm": np.mean(list(similarities.values()), axis=0)}


def turn_dynamics(questions: Sequence[str], human: Sequence[str], generated: Sequence[str],
                  buckets: Sequence[str], tokenize: str) -> dict:
    """TDM per bucket (>= 20 rows) and overall, over multi-turn rows only (the caller selects them)."""
    return turn_dynamics_with_draws(questions, human, generated, buckets, tokenize)[0]


def turn_dynamics_with_draws(questions: Sequence[str], human: Sequence[str], generated: Sequence[str],
                             buckets: Sequence[str], tokenize: str,
                             weights: np.ndarray | None = None) -> tuple[dict, dict[str, np.ndarray]]:
    """TDM as `turn_dynamics`, and with `weights` (draws x rows: how often each bootstrap draw takes each
    row) each bucket's TDM under every draw, for the intervals of what averages or combines buckets. The
    TF-IDF and its SVD stay those of the rows themselves: a draw resamples rows, not the vocabulary."""
    n = len(questions)
    if n == 0:
        return {"overall_macro": None, "by_bucket": {}, "rows": 0, "left_out": {},
                "min_bucket_rows": MIN_BUCKET_ROWS}, {}
    vectorizer = tfidf(tokenize)
    vectorizer.fit(list(questions) + list(human) + list(generated))
    q, h, g = (vectorizer.transform(list(x)) for x in (questions, human, generated))
    r = min(n - 1, len(vectorizer.vocabulary_) - 1)
    if r >= 2:
        svd = TruncatedSVD(n_components=min(64, r), random_state=0).fit(q)
        lq, lh, lg = (svd.transform(m) for m in (q, h, g))
    else:
        lq, lh, lg = (m.toarray() for m in (q, h, g))
    q_dense, h_dense, g_dense = (m.toarray() for m in (q, h, g))
    q_len = np.array([max(len(tokens(t, tokenize)), 1) for t in questions], float)
    rows = {
        side: {"length_ratio": np.array([len(tokens(t, tokenize)) for t in texts], float) / q_len,
               "lexical": _cosine_rows(q_dense, dense), "semantic": _cosine_rows(lq, latent), "latent": latent}
        for side, texts, dense, latent in (("human", human, h_dense, lh), ("generated", generated, g_dense, lg))
    }
    buckets = np.asarray(buckets)
    by_bucket, draws, left_out = {}, {}, {}
    for bucket in sorted(set(buckets.tolist())):
        idx = np.flatnonzero(buckets == bucket)
        if len(idx) < MIN_BUCKET_ROWS:  # METHOD: too few rows for a distribution; in the fit, out of the report
            left_out[bucket] = int(len(idx))
            continue
        estimate = _bucket_tdm(rows, lq, idx, np.ones((1, len(idx))))
        by_bucket[bucket] = {"tdm": float(estimate["tdm"][0]), "rows": int(len(idx)),
                             **{part: {k: float(v[0]) for k, v in estimate[part].items()}
                                for part in ("gaps", "similarities")}}
        if weights is not None:  # apart from the estimate, which is then the same number to the last bit
            draws[bucket] = _bucket_tdm(rows, lq, idx, weights[:, idx])["tdm"]
    overall = float(np.mean([b["tdm"] for b in by_bucket.values()])) if by_bucket else None
    return {"overall_macro": overall, "by_bucket": by_bucket, "rows": n, "left_out": left_out,
            "min_bucket_rows": MIN_BUCKET_ROWS}, draws
