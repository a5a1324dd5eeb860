"""The generation engine: paged attention against dense attention, greedy equality with the static
sampler on real text for every family, batch-composition independence, page reuse, shared prompt
pages, refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from polyalign.core.errors import GenerationError
from polyalign.generate.engine import Engine, EngineConfig, Request, request_seed
from polyalign.generate.sampling import FINISH_LENGTH, FINISH_STOP, Sampler, SamplingConfig
from polyalign.model import load_hf_checkpoint
from polyalign.model.paged_cache import NULL_PAGE, READ_BLOCK, PagedKVCache
from tests.chat_exports import camrest_dialogues, camrest_messages, crosswoz_dialogues, crosswoz_messages
from tests.conftest import FIXTURES

# Small pages, chunks and slots, so that prompts span several prefill chunks and pages, requests wait
# for slots, and slots are reused.
SMALL = EngineConfig(slots=3, page_size=4, max_sequence=160, prefill_chunk=16, prefill_rows=2, steps_per_sync=5)


def real_prompts() -> list[np.ndarray]:
    """User turns of CamRest676 (English) and CrossWOZ (Chinese) dialogues as UTF-8 bytes: real text in
    the fixtures' 256-token vocabulary, 2 to 100 tokens long."""
    texts = [m["content"] for d in camrest_dialogues(4) for m in camrest_messages(d)[:3] if m["role"] == "user"]
    texts += [m["content"] for _, d in crosswoz_dialogues(3) for m in crosswoz_messages(d)[:3] if m["role"] == "user"]
    prompts = [np.frombuffer(t.encode()[:100], np.uint8).astype(np.int32) for t in texts]
    return prompts + [prompts[0][:1], prompts[1][:2]]


@pytest.mark.parametrize("length", [10, 300])
def test_paged_attention_equals_dense_attention_on_the_same_cache(length):
    # 300 positions on pages of 4: three blocks of READ_BLOCK (128) positions, read one after another
    rng = np.random.default_rng(0)
    batch, kv_heads, heads, dim, page_size = 2, 2, 4, 8, 4
    keys = rng.normal(size=(batch, length, kv_heads, dim)).astype(np.float32)
    values = rng.normal(size=(batch, length, kv_heads, dim)).astype(np.float32)
    queries = rng.normal(size=(batch, 1, heads, dim)).astype(np.float32)
    # Each row on its own scattered pages, the two rows interleaved, the rest of the table null.
    pages_needed = -(-length // page_size)
    order = rng.permutation(np.arange(1, 2 * pages_needed + 1))
    table = np.full((batch, pages_needed + 1), NULL_PAGE, np.int32)
    table[0, :pages_needed], table[1, :pages_needed] = order[::2], order[1::2]
    pool = np.full((2 * pages_needed + 1, page_size, kv_heads, dim), 99.0, np.float32)  # unwritten slots hold junk
    pool_v = pool.copy()
    for row in range(batch):
        for position in range(length - 1):
            pool[table[row, position // page_size], position % page_size] = keys[row, position]
            pool_v[table[row, position // page_size], position % page_size] = values[row, position]
    # The last token's keys and values are written by the update itself.
    positions = np.full((batch, 1), length - 1, np.int32)
    # one layer of a 3-layer pool; the other layers hold junk too
    pools = [np.stack([np.full_like(p, -7.0), p, np.full_like(p, 5.0)]) for p in (pool, pool_v)]
    cache = PagedKVCache.for_tokens((jnp.asarray(pools[0]), jnp.asarray(pools[1])), jnp.asarray(table),
                                    jnp.asarray(positions), jnp.ones((batch, 1), bool)).at_layer(jnp.int32(1))
    assert int(cache.blocks) == -(-length // READ_BLOCK)
    for window, softcap in ((None, None), (3, None), (None, 2.0), (200, 2.0)):
        full, local = cache.attention_masks(jnp.asarray(positions), window)
        _, paged = cache.store_and_attend(jnp.asarray(queries), jnp.asarray(keys[:, -1:]), jnp.asarray(values[:, -1:]),
                                          full if local is None else local, scale=dim ** -0.5, softcap=softcap)
        visible = slice(0, length) if window is None else slice(max(0, length - window), length)
        grouped_keys = np.repeat(keys[:, visible], heads // kv_heads, 2)
        scores = np.einsum("bhd,bshd->bhs", queries[:, 0], grouped_keys) * dim ** -0.5
        if softcap:
            scores = np.tanh(scores / softcap) * softcap
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        dense = np.einsum("bhs,bshd->bhd", probs, np.repeat(values[:, visible], heads // kv_heads, 2))
        np.testing.assert_allclose(np.asarray(paged)[:, 0], dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma2", "gemma3"])
def test_greedy_engine_equals_the_static_sampler_on_real_text(family):
    # Gemma's fixtures slide an 8-token window, which 40 new tokens after up to 100 prompt tokens cross.
    model = load_hf_checkpoint(FIXTURES / "hf" / family)
    prompts = real_prompts()
    config = SamplingConfig(max_new_tokens=40)
    static = Sampler(model, [], 0, config).generate(prompts)
    engine = Engine(model, [], SMALL)
    completions = engine.generate([Request(p, config) for p in prompts])
    assert [(c[0].tokens, c[0].finish_reason) for c in completions] == [(t, r) for t, r in static]
    assert engine.stats["pages_in_use"] == 0 and engine.stats["decode_calls"] > 1


def test_stop_tokens_and_budgets_are_per_request():
    model = load_hf_checkpoint(FIXTURES / "hf" / "llama")
    prompt = real_prompts()[0]
    free = Engine(model, [], SMALL).generate([Request(prompt, SamplingConfig(max_new_tokens=12))])[0][0]
    stop = free.tokens[4]
    engine = Engine(model, [stop], SMALL)
    stopped, short = engine.generate([Request(prompt, SamplingConfig(max_new_tokens=12)),
                                      Request(prompt, SamplingConfig(max_new_tokens=3))])
    assert stopped[0].finish_reason == FINISH_STOP and stopped[0].tokens == free.tokens[:free.tokens.index(stop)]
    assert short[0].finish_reason == FINISH_LENGTH and short[0].tokens == free.tokens[:3]


def test_sampled_tokens_do_not_depend_on_the_batch_or_the_slot():
    model = load_hf_checkpoint(FIXTURES / "hf" / "qwen3")
    prompts = real_prompts()
    settings = [SamplingConfig(24, 1.0, 0.9), SamplingConfig(24, 0.7, 1.0, top_k=20), SamplingConfig(24)]
    requests = [Request(p, settings[i % 3], seed=request_seed(f"record-{i}")) for i, p in enumerate(prompts)]
    engine = Engine(model, [], SMALL)
    together = engine.generate(requests)
    alone = [engine.generate([r])[0] for r in requests[:4]]
    reversed_ = engine.generate(requests[::-1])[::-1]
    assert together[:4] == alone and together == reversed_
    # a different seed draws differently; greedy rows ignore it
    reseeded = engine.generate([Request(r.prompt, r.sampling, seed=r.seed + 1) for r in requests[:3]])
    assert reseeded[0] != together[0] and reseeded[2] == together[2]


def test_pages_are_reused_across_many_requests_without_a_leak():
    model = load_hf_checkpoint(FIXTURES / "hf" / "llama")
    prompts = real_prompts()
    # Room for about two requests at a time: the rest wait for pages that finished requests give back.
    config = EngineConfig(slots=4, page_size=4, max_sequence=130, pages=70, prefill_chunk=32, steps_per_sync=4)
    engine = Engine(model, [], config)
    requests = [Request(prompts[i % len(prompts)], SamplingConfig(max_new_tokens=8 + 3 * (i % 5)), seed=i)
                for i in range(30)]
    finished = []
    completions = engine.generate(requests, progress=finished.append)
    assert [len(c[0].tokens) for c in completions] == [8 + 3 * (i % 5) for i in range(30)]
    assert sum(finished) == 30
    assert engine.stats["pages_in_use"] == 0 and engine.stats["peak_pages"] <= 69
    # the same requests alone give the same tokens: reused pages keep nothing of their last owner
    assert [engine.generate([r])[0] for r in requests[25:]] == completions[25:]


def test_n_samples_share_the_prompt_pages():
    model = load_hf_checkpoint(FIXTURES / "hf" / "gemma2")
    prompt = max(real_prompts(), key=len)  # 100 tokens: 24 full pages of 4 shared, then each sample's own
    engine = Engine(model, [], SMALL)
    greedy = engine.generate([Request(prompt, SamplingConfig(max_new_tokens=10), n=3)])[0]
    assert engine.stats["peak_pages"] == 24 + 3 * (-(-(100 + 10 - 1) // 4) - 24)
    single = engine.generate([Request(prompt, SamplingConfig(max_new_tokens=10))])[0][0]
    assert greedy == [single] * 3
    sampled = engine.generate([Request(prompt, SamplingConfig(10, temperature=1.0), seed=7, n=3)])[0]
    assert len({tuple(c.tokens) for c in sampled}) == 3
    assert engine.stats["pages_in_use"] == 0


@pytest.mark.parametrize("length", [97, 9])
def test_samples_wait_for_the_shared_prompt_pages_when_nothing_of_the_prompt_is_their_own(length):
    """A prompt of 4k + 1 tokens on pages of 4: every page but the last token's is shared, so each sample's
    own prefill is empty. Those empty prefills counted as done at once, and the samples decoded while the
    shared pages were still being written (over several prefill calls): sample 0 answered right, the
    others from half-written pages, and differently on a server whose pool held an earlier request's."""
    from polyalign.generate.engine import _Run

    model = load_hf_checkpoint(FIXTURES / "hf" / "llama")
    prompt = np.concatenate(real_prompts())[:length]
    assert (len(prompt) - 1) % SMALL.page_size == 0 and len(prompt) > SMALL.prefill_chunk * (length > 16)
    engine = Engine(model, [], SMALL)
    run = _Run(engine, [Request(prompt, SamplingConfig(max_new_tokens=10), n=3)], None)
    run._admit()
    while run.prefills:  # no sample decodes before every prompt position it reads is in the cache
        run._prefill_step()
        assert not run.slots["live"].any() or not run.prefills, [(j.slot, j.done_to, j.end) for j in run.prefills]
    single = engine.generate([Request(prompt, SamplingConfig(max_new_tokens=10))])[0][0]
    assert engine.generate([Request(prompt, SamplingConfig(max_new_tokens=10), n=3)])[0] == [single] * 3


def test_requests_the_engine_cannot_hold_are_refused_in_one_line():
    model = load_hf_checkpoint(FIXTURES / "hf" / "llama")
    engine = Engine(model, [], SMALL)
    with pytest.raises(GenerationError, match=r"request 1: 150 prompt tokens \+ 20 new tokens exceed the engine's "
                                              r"max_sequence of 160") as error:
        engine.generate([Request([5] * 10), Request([5] * 150, SamplingConfig(max_new_tokens=20))])
    assert "\n" not in str(error.value)
    with pytest.raises(GenerationError, match="n = 4 samples; the engine runs 1 to 3 at once"):
        engine.generate([Request([5] * 10, n=4)])
    with pytest.raises(GenerationError, match="the prompt is empty"):
        engine.generate([Request([])])


def test_request_seeds_are_stable_and_distinct():
    assert request_seed("a") == request_seed("a") and request_seed("a") != request_seed("b")
    assert request_seed("a", 1) != request_seed("a", 0) and 0 <= request_seed("zh-123") < 2 ** 32
    key = jax.random.fold_in(jax.random.key(0), request_seed("zh-123"))  # usable as fold-in data
    assert key.shape == ()


def test_an_adapted_quantised_model_samples_as_the_static_sampler_does():
    """The engine merges adapters and dequantises once per model; the static sampler does it in every
    step. Both give the same greedy tokens."""
    from flax import nnx

    from polyalign.model.architecture import LoraConfig
    from polyalign.model.lora import add_adapters, quantize_base

    base = load_hf_checkpoint(FIXTURES / "hf" / "qwen2")
    model = add_adapters(quantize_base(base, "int8"), LoraConfig(rank=4, alpha=8.0), seed=2)
    for path, value in nnx.iter_graph(model):
        if isinstance(value, nnx.LoRAParam) and path[-1] == "lora_b":
            value[...] = 0.05 * jax.random.normal(jax.random.key(len(path)), value[...].shape)
    prompts = real_prompts()[:4]
    config = SamplingConfig(max_new_tokens=16)
    static = Sampler(model, [], 0, config).generate(prompts)
    plain = Sampler(base, [], 0, config).generate(prompts)
    assert [t for t, _ in static] != [t for t, _ in plain]  # the adapters change the answers
    completions = Engine(model, [], SMALL).generate([Request(p, config) for p in prompts])
    assert [c[0].tokens for c in completions] == [t for t, _ in static]


def test_bucket_budgets_are_each_buckets_human_length_quantile():
    from polyalign.data.records import Record
    from polyalign.generate.budgets import bucket_budgets, truncation_by_bucket

    texts = [m["content"] for d in camrest_dialogues(6) for m in camrest_messages(d) if m["role"] == "assistant"]
    lengths = [len(t.split()) for t in texts]
    records = [Record(id=f"r{i}", dataset="camrest676", split="train", language="en", track="multi",
                      family="dialogue", style="task", question="q", context="", history=[], response=t,
                      length_tokens=0, length_bin="short", bucket_id="en/dialogue" if i % 3 else "en/other", meta={})
               for i, t in enumerate(texts)]
    budgets = bucket_budgets(records, str.split, quantile=0.9, margin=1.5, ceiling=40)
    for bucket, rows in (("en/dialogue", [n for i, n in enumerate(lengths) if i % 3]),
                         ("en/other", [n for i, n in enumerate(lengths) if not i % 3])):
        expected = min(40, max(8, int(np.ceil(np.quantile(rows, 0.9) * 1.5))))
        assert budgets(bucket) == expected
    assert budgets("zh/unseen") == max(budgets.by_bucket.values())
    assert truncation_by_bucket(["a", "a", "b", "a"], ["length", "stop", "stop", "length"]) == {"a": 0.6667, "b": 0.0}
    with pytest.raises(GenerationError, match="no answers"):
        bucket_budgets([], str.split)
