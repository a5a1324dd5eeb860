"""LM features (FEATURES.md section 3) against an independent log-softmax of the model's logits."""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from polyalign.data.records import read_records
from polyalign.features.lm import FEATURE_NAMES, LMScorer, conditional_prefix, record_lm_features
from polyalign.model import create_model
from tests.conftest import tiny_model_config


@nnx.jit
def _logits(model, ids):
    return model(ids)


def independent_logprobs(model, ids):
    # Right padding to a multiple of 256 leaves a causal model's logits at the real positions as they
    # are, and the jitted call compiles once per padded length (op by op, each length took ~1 s).
    padded = np.zeros((1, -(-len(ids) // 256) * 256), np.int32)
    padded[0, :len(ids)] = ids
    logits = np.asarray(_logits(model, jnp.asarray(padded)), np.float64)[0, :len(ids)]
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return np.array([logp[t - 1, ids[t]] for t in range(1, len(ids))])


def test_conditional_prefix_layout():
    history = [{"role": "user", "text": "你好"}, {"role": "assistant", "text": "您好！"},
               {"role": "user", "text": "在吗"}]
    prefix = conditional_prefix("在吗", "北京 | 地址 | 海淀", history)
    assert prefix == ("Context:\n北京 | 地址 | 海淀\n\nDialogue History:\nUser: 你好\nAssistant: 您好！\n\n"
                      "Current User Message:\n在吗\n\nAssistant Response:\n")
    assert conditional_prefix("", "", []) == ""
    # a note between the question and the reply, and the earlier reply it interrupted, come after the question
    later = [{"role": "assistant", "text": "Why did the chicken cross the road?", "after_question": True},
             {"role": "system", "text": "Be brief.", "after_question": True}]
    assert conditional_prefix("Tell me a joke please.", "", later) == (
        "Current User Message:\nTell me a joke please.\n\nAssistant So Far:\nWhy did the chicken cross the road?"
        "\n\nSystem Message:\nBe brief.\n\nAssistant Response:\n")


def test_lm_features_match_an_independent_computation(demo_run, demo_tokenizer):
    run, _, _ = demo_run
    tokenizer = demo_tokenizer[0]
    records = [r for r in read_records(run / "data" / "val.jsonl") if r.response][:6]
    model = create_model(tiny_model_config(tokenizer.vocab_size), seed=2)
    scorer = LMScorer(model, tokenizer, max_seq_length=4096, batch_size=4)
    rows = record_lm_features(scorer, records)
    assert len(rows[0]) == len(FEATURE_NAMES) == 43 and set(rows[0]) == set(FEATURE_NAMES)
    for record, row in zip(records, rows):
        answer = tokenizer.encode(record.response)
        prefix = tokenizer.encode(conditional_prefix(record.question, record.context, record.history))
        for block, prefix_ids in (("lm_unconditional_", []), ("lm_conditional_", prefix)):
            ids = [tokenizer.bos_id] + prefix_ids + answer
            lp = independent_logprobs(model, ids)[-len(answer):]
            assert row[f"{block}logprob_sum"] == pytest.approx(lp.sum(), rel=1e-4)
            assert row[f"{block}surprisal_std"] == pytest.approx((-lp).std(), rel=1e-3, abs=1e-5)
            assert row[f"{block}perplexity"] == pytest.approx(math.exp(-lp.mean()), rel=1e-4)
            assert row[f"{block}scored_token_count"] == len(answer) and row[f"{block}score_coverage"] == 1.0
        assert row["lm_conditional_logprob_gain"] == pytest.approx(
            row["lm_conditional_logprob_sum"] - row["lm_unconditional_logprob_sum"], abs=1e-6)
        assert row["lm_answer_char_count"] == len(record.response) and row["lm_max_seq_length"] == 4096


def test_truncation_drops_the_prefix_first_then_the_answer(demo_tokenizer):
    tokenizer = demo_tokenizer[0]
    model = create_model(tiny_model_config(tokenizer.vocab_size), seed=2)
    answer = "The museum opens at nine and closes at five on weekdays."
    question = "When does the museum open? " * 6
    n_answer = len(tokenizer.encode(answer))
    n_prefix = len(tokenizer.encode(conditional_prefix(question, "", [])))
    budget = n_answer + 5
    row = LMScorer(model, tokenizer, max_seq_length=budget + 1).features([answer], [question], [""], [[]])[0]
    assert row["lm_conditional_lm_truncated"] == 1.0
    assert row["lm_conditional_lm_prefix_tokens_dropped"] == n_prefix - 5
    assert row["lm_conditional_prefix_token_count"] == 5 and row["lm_conditional_lm_answer_tokens_dropped"] == 0
    short = LMScorer(model, tokenizer, max_seq_length=n_answer - 2).features([answer], [question], [""], [[]])[0]
    assert short["lm_unconditional_lm_answer_tokens_dropped"] == 3  # 1 slot for BOS, answer loses 3 from the left
    assert short["lm_unconditional_scored_token_count"] == n_answer - 3
    assert short["lm_unconditional_score_coverage"] == pytest.approx((n_answer - 3) / n_answer)
    empty = LMScorer(model, tokenizer).features([answer], [""], [""], [[]])[0]
    assert empty["lm_conditional_available"] == 0.0 and empty["lm_conditional_perplexity_ratio"] == 0.0
    assert empty["lm_unconditional_available"] == 1.0
