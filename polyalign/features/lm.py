"""LM features (FEATURES.md section 3): how a scoring model sees a response, with and without its
conversation as the prefix. Any model polyalign loads can score; no chat template is used."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np
from flax import nnx

from polyalign.data.records import after_question, before_question
from polyalign.model.log_probs import token_log_probs

BLOCK_STATS = (
    "available", "condition_text_available", "answer_token_count", "prefix_token_count", "scored_token_count",
    "score_coverage", "logprob_sum", "logprob_mean", "nll_sum", "nll_mean", "perplexity", "bits_per_token",
    "surprisal_mean", "surprisal_std", "surprisal_min", "surprisal_max", "lm_truncated", "lm_prefix_tokens_dropped",
    "lm_answer_tokens_dropped",
)
BLOCKS = ("lm_unconditional_", "lm_conditional_")
FEATURE_NAMES = tuple(f"{block}{stat}" for block in BLOCKS for stat in BLOCK_STATS) + (
    "lm_answer_char_count", "lm_prefix_char_count", "lm_max_seq_length", "lm_conditional_logprob_gain",
    "lm_conditional_perplexity_ratio")
ROLE_NAMES = {"user": "User", "assistant": "Assistant", "system": "System"}


def conditional_prefix(question: str, context: str, history: Sequence[dict]) -> str:
    """Context, dialogue history and the current user message as labelled blocks (a system message that
    stood between the question and the reply after it, and an earlier reply that such a message
    interrupted, in their order), then the response header; "" when there is nothing to condition on."""
    turns = before_question(list(history))
    if turns and turns[-1]["role"] == "user" and turns[-1]["text"] == question:
        turns = turns[:-1]
    blocks = []
    if context:
        blocks.append(f"Context:\n{context}")
    if turns:
        blocks.append("Dialogue History:\n" + "\n".join(f"{ROLE_NAMES.get(t['role'], t['role'])}: {t['text']}"
                                                       for t in turns))
    if question:
        blocks.append(f"Current User Message:\n{question}")
    for turn in after_question(list(history)):  # in the order they stood
        header = "System Message" if turn["role"] == "system" else "Assistant So Far"  # a reply a note interrupted
        blocks.append(f"{header}:\n{turn['text']}")
    return "\n\n".join(blocks) + "\n\nAssistant Response:\n" if blocks else ""


@dataclass
class _Scored:
    prefix_tokens: int
    answer_tokens: int
    prefix_dropped: int
    answer_dropped: int
    logprobs: np.ndarray  # of the scored answer tokens


class LMScorer:
    """Scores answers given prefixes with one causal LM, in padded batches under one jit."""

    def __init__(self, model, tokenizer, max_seq_length: int = 1024, batch_size: int = 8):
        self.tokenizer, self.max_seq_length, self.batch_size = tokenizer, max_seq_length, batch_size
        self.start = [t for t in (tokenizer.bos_id, tokenizer.eos_id) if t is not None][:1]
        graphdef, state = nnx.split(model)
        self._state = state
        self._logps = jax.jit(lambda state, ids: token_log_probs(nnx.merge(graphdef, state)(ids[:, :-1]), ids[:, 1:]))

    def _layout(self, prefix: list[int], answer: list[int]) -> tuple[list[int], int, int, int]:
        """ids, position of the first answer token, prefix and answer tokens dropped: the prefix loses
        tokens from its left first, then the answer from its left."""
        budget = self.max_seq_length - len(self.start)
        over = max(0, len(prefix) + len(answer) - budget)
        prefix_dropped = min(over, len(prefix))
        answer_dropped = over - prefix_dropped
        prefix, answer = prefix[prefix_dropped:], answer[answer_dropped:]
        return self.start + prefix + answer, len(self.start) + len(prefix), prefix_dropped, answer_dropped

    def score(self, prefixes: Sequence[str], answers: Sequence[str]) -> list[_Scored]:
        encoded_prefixes = self.tokenizer.encode_batch(list(prefixes))
        encoded_answers = self.tokenizer.encode_batch(list(answers))
        layouts = [self._layout(p, a) for p, a in zip(encoded_prefixes, encoded_answers)]
        results: list[_Scored | None] = [None] * len(layouts)
        for start in range(0, len(layouts), self.batch_size):
            rows = list(range(start, min(start + self.batch_size, len(layouts))))
            width = max(16, -(-max(len(layouts[i][0]) for i in rows) // 16) * 16)
            ids = np.full((self.batch_size, width), self.tokenizer.pad_id, np.int32)
            for j, i in enumerate(rows):
                ids[j, :len(layouts[i][0])] = layouts[i][0]
            logps = np.asarray(self._logps(self._state, ids))
            for j, i in enumerate(rows):
                seq, answer_start, prefix_dropped, answer_dropped = layouts[i]
                # Position t predicts token t + 1: answer tokens answer_start .. end - 1.
                # With no start token and no prefix the first answer token has nothing to predict it.
                scored = logps[j, max(answer_start, 1) - 1:len(seq) - 1]
                results[i] = _Scored(answer_start - len(self.start), len(encoded_answers[i]), prefix_dropped,
                                     answer_dropped, scored.astype(np.float64))
        return results

    def features(self, answers: Sequence[str], questions: Sequence[str], contexts: Sequence[str],
                 histories: Sequence[Sequence[dict]]) -> list[dict[str, float]]:
        """The 43 LM features for each answer."""
        prefixes = [conditional_prefix(q, c, h) for q, c, h in zip(questions, contexts, histories)]
        unconditional = self.score([""] * len(answers), answers)
        conditional = self.score(prefixes, answers)
        rows = []
        for i, answer in enumerate(answers):
            row = _block(BLOCKS[0], unconditional[i], condition=False)
            row.update(_block(BLOCKS[1], conditional[i], condition=bool(prefixes[i])))
            both = row["lm_unconditional_available"] and row["lm_conditional_available"]
            row.update({
                "lm_answer_char_count": float(len(answer)),
                "lm_prefix_char_count": float(len(prefixes[i])),
                "lm_max_seq_length": float(self.max_seq_length),
                "lm_conditional_logprob_gain": (row["lm_conditional_logprob_sum"] - row["lm_unconditional_logprob_sum"])
                if both else 0.0,
                "lm_conditional_perplexity_ratio": (row["lm_unconditional_perplexity"]
                                                    / row["lm_conditional_perplexity"])
                if both else 0.0,
            })
            rows.append(row)
        return rows


def _block(prefix: str, scored: _Scored, condition: bool) -> dict[str, float]:
    lp = scored.logprobs
    available = len(lp) > 0 and (condition or prefix == BLOCKS[0])
    stats = dict.fromkeys(BLOCK_STATS, 0.0)
    stats["condition_text_available"] = float(condition)
    if available:
        nll = -lp
        nll_mean = float(nll.mean())
        stats.update({
            "available": 1.0, "answer_token_count": float(scored.answer_tokens),
            "prefix_token_count": float(scored.prefix_tokens), "scored_token_count": float(len(lp)),
            "score_coverage": len(lp) / scored.answer_tokens if scored.answer_tokens else 0.0,
            "logprob_sum": float(lp.sum()), "logprob_mean": float(lp.mean()), "nll_sum": float(nll.sum()),
            "nll_mean": nll_mean, "perplexity": math.exp(min(nll_mean, 50.0)), "bits_per_token": nll_mean / math.log(2),
            "surprisal_mean": nll_mean, "surprisal_std": float(nll.std()), "surprisal_min": float(nll.min()),
            "surprisal_max": float(nll.max()),
            "lm_truncated": float(scored.prefix_dropped + scored.answer_dropped > 0),
            "lm_prefix_tokens_dropped": float(scored.prefix_dropped),
            "lm_answer_tokens_dropped": float(scored.answer_dropped),
        })
    return {f"{prefix}{k}": v for k, v in stats.items()}


def record_lm_features(scorer: LMScorer, records, responses: Sequence[str] | None = None) -> list[dict[str, float]]:
    """LM features of each record's human response (or of `responses`, e.g. a model's, in its place)."""
    answers = [r.response for r in records] if responses is None else list(responses)
    return scorer.features(answers, [r.question for r in records], [r.context for r in records],
                           [r.history for r in records])

