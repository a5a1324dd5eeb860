"""The engine's repetition, presence and frequency penalties and min-p, as vLLM applies them: the formulas
by hand, greedy decoding on real text against a plain decoder that runs the whole model on the sequence so
far at every step, neutral settings that change nothing. `generate`'s flags: tests/test_generate.py."""

import functools
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from polyalign.core.errors import GenerationError
from polyalign.generate.engine import Engine, EngineConfig, Request, request_seed
from polyalign.generate.sampling import Sampler, SamplingConfig, apply_penalties, min_p_mask
from polyalign.model import load_hf_checkpoint
from tests.chat_exports import camrest_dialogues, camrest_messages, crosswoz_dialogues, crosswoz_messages
from tests.conftest import FIXTURES

SMALL = EngineConfig(slots=3, page_size=4, max_sequence=160, prefill_chunk=16, prefill_rows=2, steps_per_sync=5)


def real_prompts() -> list[np.ndarray]:
    """User turns of CamRest676 and CrossWOZ as UTF-8 bytes (the fixtures' 256-token vocabulary)."""
    texts = [m["content"] for d in camrest_dialogues(3) for m in camrest_messages(d)[:3] if m["role"] == "user"]
    texts += [m["content"] for _, d in crosswoz_dialogues(2) for m in crosswoz_messages(d)[:3] if m["role"] == "user"]
    return [np.frombuffer(t.encode()[:60], np.uint8).astype(np.int32) for t in texts]


def test_penalties_follow_vllms_formulas_by_hand():
    logits = jnp.asarray([[2.0, -1.0, 0.5, 3.0, -0.5]])
    prompt_seen = jnp.asarray([[True, True, False, False, False]])
    counts = jnp.asarray([[0, 0, 2, 1, 0]])
    out = apply_penalties(logits, prompt_seen, counts, jnp.asarray([2.0]), jnp.asarray([0.5]), jnp.asarray([0.25]))
    # prompt tokens: 2 / 2, -1 * 2; answer tokens: 0.5 / 2 - 2 * 0.25 - 0.5 and 3 / 2 - 0.25 - 0.5; unseen: as it was
    np.testing.assert_allclose(np.asarray(out), [[1.0, -2.0, -0.75, 0.75, -0.5]])
    neutral = apply_penalties(logits, prompt_seen, counts, jnp.ones(1), jnp.zeros(1), jnp.zeros(1))
    assert np.array_equal(np.asarray(neutral), np.asarray(logits))
    # min-p on probabilities 0.5, 0.3, 0.15, 0.05: min_p 0.3 keeps what is at least 0.15 likely
    probs = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    assert np.asarray(min_p_mask(probs, jnp.asarray([0.3, 0.0]))).tolist() == [[True, True, True, False]] + [[True] * 4]


@functools.cache
def _forward(graphdef):
    # right padding to one length: one compiled program, and a causal model's earlier positions ignore it
    return jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids)[0])


def whole_sequence_logits(model, tokens: list[int], length: int = 128) -> jax.Array:
    """The next-token logits after `tokens`, from the whole model run on the sequence (no cache)."""
    graphdef, state = nnx.split(model)
    ids = np.zeros((1, length), np.int32)
    ids[0, :len(tokens)] = tokens
    return _forward(graphdef)(state, jnp.asarray(ids))[len(tokens) - 1]


def reference_greedy(model, prompt: np.ndarray, steps: int, sampling: SamplingConfig) -> tuple[list[int], int]:
    """Greedy tokens of a decoder that runs the whole model on the sequence so far at every step and
    applies the penalties to a copy of the logits in numpy, with how many of them are trustworthy: those
    before the first step whose two best logits lie within 1e-3 (which could go either way under another
    summation order, and everything after it with it)."""
    tokens, made, sure = list(prompt), [], None
    for step in range(steps):
        logits = np.asarray(whole_sequence_logits(model, tokens), np.float64)
        for token in set(tokens):  # the prompt and the answer so far
            r = sampling.repetition_penalty
            logits[token] = logits[token] / r if logits[token] > 0 else logits[token] * r
        for token, times in Counter(made).items():
            logits[token] -= sampling.frequency_penalty * times + sampling.presence_penalty
        best, second = np.sort(logits)[-2:][::-1]
        if sure is None and best - second < 1e-3:
            sure = step
        made.append(int(np.argmax(logits)))
        tokens.append(made[-1])
    return made, steps if sure is None else sure


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma2", "gemma3"])
def test_greedy_decoding_with_penalties_equals_a_plain_decoder_on_real_text(family):
    model = load_hf_checkpoint(FIXTURES / "hf" / family)
    prompts = real_prompts()
    steps = 24
    settings = [SamplingConfig(steps, repetition_penalty=1.6), SamplingConfig(steps, presence_penalty=1.5),
                SamplingConfig(steps, frequency_penalty=0.8, repetition_penalty=0.9),
                SamplingConfig(steps)]
    requests = [Request(p, settings[i % len(settings)]) for i, p in enumerate(prompts)]
    engine = Engine(model, [], SMALL)
    together = engine.generate(requests)  # penalised and plain requests share the slots and their histories
    compared, changed = 0, 0
    for request, completions in zip(requests, together):
        expected, sure = reference_greedy(model, request.prompt, steps, request.sampling)
        assert completions[0].tokens[:sure] == expected[:sure]
        compared += sure
        if request.sampling.penalised:
            plain = engine.generate([Request(request.prompt, SamplingConfig(steps))])[0][0].tokens
            changed += plain != completions[0].tokens
    assert compared >= 0.8 * steps * len(requests)
    assert changed >= len(requests) // 2  # the penalties do something on most prompts
    # a plain request's tokens do not depend on penalised ones beside it (neutral settings change nothing)
    plain = [r for r in requests if not r.sampling.penalised]
    assert [c for r, c in zip(requests, together) if not r.sampling.penalised] == engine.generate(plain)
    assert engine.stats["pages_in_use"] == 0


def test_a_reused_slot_forgets_its_last_requests_tokens():
    model = load_hf_checkpoint(FIXTURES / "hf" / "llama")
    prompts = real_prompts()
    engine = Engine(model, [], EngineConfig(slots=1, page_size=4, max_sequence=160, prefill_chunk=16,
                                            steps_per_sync=4))
    penalised = [Request(p, SamplingConfig(16, repetition_penalty=1.5, frequency_penalty=0.5)) for p in prompts[:4]]
    one_slot = engine.generate(penalised)  # one after another in the single slot
    assert one_slot == [engine.generate([r])[0] for r in penalised[::-1]][::-1]


def test_min_p_of_one_samples_the_likeliest_token():
    model = load_hf_checkpoint(FIXTURES / "hf" / "qwen3")
    prompts = real_prompts()[:4]
    engine = Engine(model, [], SMALL)
    greedy = engine.generate([Request(p, SamplingConfig(20)) for p in prompts])
    seeds = [request_seed(f"r{i}") for i in range(len(prompts))]
    only_best = engine.generate([Request(p, SamplingConfig(20, temperature=1.5, min_p=1.0), seed=s)
                                 for p, s in zip(prompts, seeds)])
    free = engine.generate([Request(p, SamplingConfig(20, temperature=1.5), seed=s) for p, s in zip(prompts, seeds)])
    assert only_best == greedy and free != greedy


def test_settings_out_of_range_and_the_static_sampler_refuse():
    for bad in ({"min_p": 1.5}, {"repetition_penalty": 0.0}, {"presence_penalty": 2.5}, {"frequency_penalty": -3}):
        with pytest.raises(GenerationError):
            SamplingConfig(**bad)
    model = load_hf_checkpoint(FIXTURES / "hf" / "llama")
    with pytest.raises(GenerationError, match="the engine"):
        Sampler(model, [], 0, SamplingConfig(repetition_penalty=1.1))

