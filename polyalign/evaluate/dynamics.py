"""Turn dynamics (TDM, METHOD section 9): how a response relates to the user turn it answers, for
human and generated responses of multi-turn rows."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.stats import wasserstein_distance
from sklearn.decomposition import TruncatedSVD
from sklearn.feature_extraction.text import TfidfVectorizer

from polyalign.evaluate.naturalness import MIN_BUCKET_ROWS
from polyalign.evaluate.text_metrics import tokens


def _cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    dots = (a * b).sum(axis=1)
    ok = (na > 1e-12) & (nb > 1e-12)
    return np.where(ok, dots / np.where(ok, na * nb, 1.0), 0.0)


def _gap(generated: np.ndarray, human: np.ndarray) -> float:
    std = float(human.std())
    return wasserstein_distance(generated, human) / (std if std > 1e-12 else 1.0)


def _transition_gap(q: np.ndarray, h: np.ndarray, g: np.ndarray) -> float:
    n = len(q)
    qc, hc, gc = (m - m.mean(axis=0) for m in (q, h, g))
    human = qc.T @ hc / n
    generated = qc.T @ gc / n
    denominator = float(np.linalg.norm(human))
    return float(np.linalg.norm(generated - human)) / (denominator if denominator > 1e-12 else 1.0)


def turn_dynamics(questions: Sequence[str], human: Sequence[str], generated: Sequence[str],
                  buckets: Sequence[str], tokenize: str) -> dict:
    """TDM per bucket (>= 20 rows) and overall, over multi-turn rows only (the caller selects them)."""
    n = len(questions)
    if n == 0:
        return {"overall_macro": None, "by_bucket": {}}
    vectorizer = TfidfVectorizer(lowercase=True, token_pattern=r"\b\w+\b", norm="l2")
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
    by_bucket = {}
    for bucket in sorted(set(buckets.tolist())):
        idx = np.flatnonzero(buckets == bucket)
        if len(idx) < MIN_BUCKET_ROWS:
            continue
        gaps = {k: _gap(rows["generated"][k][idx], rows["human"][k][idx])
                for k in ("length_ratio", "lexical", "semantic")}
        gaps["transition"] = _transition_gap(lq[idx], rows["human"]["latent"][idx], rows["generated"]["latent"][idx])
        similarities = {k: 1.0 / (1.0 + v) for k, v in gaps.items()}
        by_bucket[bucket] = {"tdm": float(np.mean(list(similarities.values()))), "gaps": gaps,
                             "similarities": similarities, "rows": int(len(idx))}
    overall = float(np.mean([b["tdm"] for b in by_bucket.values()])) if by_bucket else None
    return {"overall_macro": overall, "by_bucket": by_bucket, "rows": n}
