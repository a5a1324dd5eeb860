"""Sampling with a KV cache against decoding by full recomputation, and `polyalign generate`."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from polyalign.generate.sampling import (
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationError,
    Sampler,
    SamplingConfig,
    nucleus_mask,
    sample_logits,
)
from polyalign.model import create_model, load_hf_checkpoint
from tests.conftest import FIXTURES, tiny_model_config


def greedy_by_recomputation(model, prompt, steps):
    """Greedy decoding that reruns the whole sequence for every token (no cache). The sequence sits
    in a fixed right-padded buffer: causal attention makes the padding after it irrelevant."""
    from flax import nnx

    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids))
    buffer = np.zeros((1, len(prompt) + steps), np.int32)
    buffer[0, :len(prompt)] = prompt
    for t in range(len(prompt), len(prompt) + steps):
        logits = forward(state, jnp.asarray(buffer))
        buffer[0, t] = int(jnp.argmax(logits[0, t - 1]))
    return buffer[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma2", "gemma3"])
def test_greedy_with_cache_equals_full_recomputation(family):
    # The Gemma fixtures slide an 8-token window, so 40 new tokens cross it.
    model = load_hf_checkpoint(FIXTURES / "hf" / family)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, n).astype(np.int32) for n in (5, 17, 11)]
    sampler = Sampler(model, stop_ids=[], pad_id=0, config=SamplingConfig(max_new_tokens=40))
    for prompt, (tokens, reason) in zip(prompts, sampler.generate(prompts)):
        assert reason == FINISH_LENGTH and len(tokens) == 40
        assert tokens == greedy_by_recomputation(model, prompt, 40)


def test_generation_stops_at_a_stop_token():
    model = load_hf_checkpoint(FIXTURES / "hf" / "llama")
    prompt = np.array([5, 9, 33, 2], np.int32)
    free = Sampler(model, [], 0, SamplingConfig(max_new_tokens=12)).generate([prompt])[0][0]
    stop = free[4]
    tokens, reason = Sampler(model, [stop], 0, SamplingConfig(max_new_tokens=12)).generate([prompt])[0]
    assert reason == FINISH_STOP and tokens == free[:free.index(stop)]


def test_sampling_filters():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 2000))
    keys = jax.random.split(jax.random.key(0), 1)[0]
    top_k = np.asarray(sample_logits(logits, keys, SamplingConfig(temperature=1.0, top_k=2)))
    assert set(top_k.tolist()) == {0, 1} and 0.55 < (top_k == 0).mean() < 0.70  # 0.5 / 0.8 = 0.625
    top_p = np.asarray(sample_logits(logits, keys, SamplingConfig(temperature=1.0, top_p=0.6)))
    assert set(top_p.tolist()) == {0, 1}  # 0.5 < 0.6, so the second token stays; the third does not
    greedy = np.asarray(sample_logits(logits, keys, SamplingConfig()))
    assert (greedy == 0).all()
    with pytest.raises(GenerationError):
        SamplingConfig(top_p=0.0)


def nucleus_by_counting(logits: np.ndarray, top_k: int, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """One row's kept tokens by the rule spelled out token by token in float64 (how many tokens, and how
    much top-k-renormalised mass, lie above each), and that mass (to tell a rounding tie at top_p from a
    wrong answer)."""
    above = logits[None, :] > logits[:, None]  # above[i, j]: token j lies above token i
    in_top_k = above.sum(1) < (top_k or len(logits))
    finite = np.where(in_top_k, logits.astype(np.float64), -np.inf)
    probs = np.exp(finite - finite.max())
    probs /= probs.sum()
    mass_above = above @ probs
    return in_top_k & (mass_above < top_p), mass_above


def test_the_nucleus_keeps_what_counting_keeps_for_every_setting():
    # Rows of every temperature-like spread, with ties (rounded logits) and masked tokens (-inf), under
    # every mix of top-k and top-p, against the rule computed token by token in float64.
    rng = np.random.default_rng(0)
    rows, vocab, checked = 48, 300, 0
    for spread in (0.1, 1.0, 4.0, 20.0):
        logits = rng.standard_normal((rows, vocab)) * spread
        logits[::3] = np.round(logits[::3])  # ties
        logits[::4, :40] = -np.inf
        top_k = np.where(rng.random(rows) < 0.5, 0, rng.integers(1, 60, rows)).astype(np.int32)
        top_p = np.where(rng.random(rows) < 0.2, 1.0, rng.uniform(0.05, 1.0, rows)).astype(np.float32)
        kept = np.asarray(nucleus_mask(jnp.asarray(logits, jnp.float32), jnp.asarray(top_k), jnp.asarray(top_p)))
        for row in range(rows):
            expected, mass_above = nucleus_by_counting(logits[row].astype(np.float32), top_k[row], top_p[row])
            # float32 sums meet top_p within rounding only on a token of the boundary
            settled = np.abs(mass_above - top_p[row]) > 1e-5
            np.testing.assert_array_equal(kept[row][settled], expected[settled], err_msg=f"spread {spread} row {row}")
            assert kept[row][np.argmax(logits[row])]  # the most likely token always stays
            # equal logits are kept or cut together
            for value in np.unique(logits[row][kept[row]]):
                assert kept[row][logits[row] == value].all()
            checked += 1
    assert checked == 4 * rows


def test_temperature_sampling_is_seeded():
    model = create_model(tiny_model_config(64), seed=1)
    sampler = Sampler(model, [], 0, SamplingConfig(max_new_tokens=8, temperature=1.0, top_p=0.9))
    prompts = [np.array([1, 2, 3], np.int32)]
    assert sampler.generate(prompts, seed=3) == sampler.generate(prompts, seed=3)
    assert sampler.generate(prompts, seed=3) != sampler.generate(prompts, seed=4)


@pytest.mark.slow
def test_cli_writes_one_row_per_record_by_id(built_run, tmp_path, demo_tokenizer, capsys, monkeypatch):
    from polyalign.cli import empty_answers_warning, main, said_as_note
    from polyalign.data.records import read_records
    from polyalign.generate.selection import select_records
    from polyalign.model import save_hf_checkpoint
    from polyalign.model.presets import preset

    run, manifest = built_run
    tokenizer = demo_tokenizer[0]
    model = create_model(preset("tiny", vocab_size=tokenizer.vocab_size, num_layers=2, hidden_size=64, num_heads=4,
                                num_kv_heads=2, head_dim=16, intermediate_size=128))
    directory = tokenizer.path.parent
    save_hf_checkpoint(model, tmp_path / "ckpt", extra_files={
        name: (directory / name).read_bytes() for name in ("tokenizer.model", "tokenizer_config.json")})
    out = tmp_path / "pred.jsonl"
    code = main(["generate", "--checkpoint", str(tmp_path / "ckpt"), "--records", str(run / "data" / "test.jsonl"),
                 "--out", str(out), "--limit", "12", "--max-new-tokens", "6", "--batch-size", "5", "--no-progress"])
    assert code == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    records = read_records(run / "data" / "test.jsonl")[:12]
    assert [r["id"] for r in rows] == [r.id for r in records]
    assert all(set(r) == {"id", "prediction", "model", "finish_reason", "new_tokens", "profile"} for r in rows)
    assert all(r["new_tokens"] <= 6 and r["model"] == "ckpt" for r in rows)
    # empty answers, by how they ended: the turn at once, or whitespace until the budget
    record = json.loads((tmp_path / "pred.manifest.json").read_text())
    summary = record["summary"]
    rate = f" ({summary['tokens_per_s']} tokens/s)" if summary["new_tokens"] else ""  # no "0.0 tokens/s"
    assert f": {summary['new_tokens']} new tokens in {summary['seconds']} s{rate}\n" in capsys.readouterr().out
    # what the prompts were rendered with, resolved (the tokenizer names the polyalign template), beside the
    # settings' request (None: the checkpoint's own)
    assert (summary["template"], summary["profile"]) == ("polyalign", rows[0]["profile"])
    assert (record["settings"]["template"], record["settings"]["profile"]) == (None, None)
    assert summary["empty"] == sum(not r["prediction"] for r in rows)
    assert summary["empty_at_budget"] == sum(not r["prediction"] and r["finish_reason"] == "length" for r in rows)
    assert summary["empty_at_once"] == sum(not r["prediction"] and r["new_tokens"] == 0 for r in rows)
    assert empty_answers_warning({"empty": 49, "records": 49, "empty_at_budget": 49, "empty_at_once": 0},
                                 greedy=True).startswith(
        "warning: 49 of 49 answers are empty after decoding (49 decoded only whitespace until the token budget); "
        "evaluate counts them")
    # a stage's notes print as every command's do (some were bare), and what says its kind keeps it
    assert [said_as_note(line) for line in ("ckpt names chat template 'x'", "warning: w", "note: n", "resuming: r")] \
        == ["note: ckpt names chat template 'x'", "warning: w", "note: n", "resuming: r"]
    # an answer of 13 newlines, then the end of the turn, did not end it at once (a user read "8 ended the turn
    # at once, 0 decoded only whitespace" of such an answer)
    assert empty_answers_warning({"empty": 8, "records": 8, "empty_at_budget": 0, "empty_at_once": 7},
                                 greedy=False).startswith(
        "warning: 8 of 8 answers are empty after decoding (7 ended the turn at once, 1 decoded only whitespace, "
        "then ended the turn); evaluate counts them")
    # answers of punctuation alone, as a 150-step model answered 320 of 320 prompts: counted as evaluate counts them
    import unicodedata

    from polyalign.evaluate.text_metrics import tokens
    wordless = [r for r in rows if r["prediction"] and all(
        unicodedata.category(c).startswith("P") or c.isspace() for c in r["prediction"])]
    assert summary["without_words"] == len(wordless)
    assert not any(tokens(r["prediction"], "cjk") for r in wordless)  # evaluate finds no word in them either
    assert empty_answers_warning({"empty": 0, "records": 320, "without_words": 320}, greedy=False) == (
        "warning: 320 of 320 hold no word (punctuation only); evaluate counts them and leaves them out of diversity")
    assert not tokens("，" * 8, "cjk") and tokens("好，", "cjk") and tokens("😀😀", "cjk")  # a symbol is a word there
    # --dtype: auto is float32 on this CPU; the manifest records the dtype the model ran in
    assert json.loads((tmp_path / "pred.manifest.json").read_text())["settings"]["dtype"] == "float32"
    assert main(["generate", "--checkpoint", str(tmp_path / "ckpt"), "--records", str(run / "data" / "test.jsonl"),
                 "--out", str(tmp_path / "half.jsonl"), "--limit", "12", "--per-bucket", "1", "--max-new-tokens", "6",
                 "--dtype", "bfloat16", "--no-progress"]) == 0
    half = json.loads((tmp_path / "half.manifest.json").read_text())["settings"]
    assert (half["dtype"], half["per_bucket"]) == ("bfloat16", 1)
    assert "per_bucket" not in record["settings"]  # recorded when asked for: earlier predictions still match
    one_each = select_records(records, run / "data" / "test.jsonl", per_bucket=1)[0]
    assert len(one_each) == len({r.bucket_id for r in records}) < 12
    assert [json.loads(line)["id"] for line in (tmp_path / "half.jsonl").read_text().splitlines()] == \
        [r.id for r in one_each]
    # penalties: recorded when asked for (so earlier versions' manifests still match), and they are applied
    assert "repetition_penalty" not in record["settings"]["sampling"]
    penalised = tmp_path / "penalised.jsonl"
    assert main(["generate", "--checkpoint", str(tmp_path / "ckpt"), "--records", str(run / "data" / "test.jsonl"),
                 "--out", str(penalised), "--limit", "12", "--max-new-tokens", "6", "--batch-size", "5",
                 "--repetition-penalty", "1.8", "--frequency-penalty", "1", "--no-progress"]) == 0
    sampling = json.loads((tmp_path / "penalised.manifest.json").read_text())["settings"]["sampling"]
    assert (sampling["repetition_penalty"], sampling["frequency_penalty"]) == (1.8, 1.0)
    assert "presence_penalty" not in sampling
    assert [json.loads(line)["prediction"] for line in penalised.read_text().splitlines()] != [
        r["prediction"] for r in rows]
    # Ctrl-C after 5 of 12 sampled answers: each was kept as it finished, and the same command answers only the
    # other 7, to the file an unbroken run writes
    from polyalign.generate.engine import Engine

    sampled = ["generate", "--checkpoint", str(tmp_path / "ckpt"), "--records", str(run / "data" / "test.jsonl"),
               "--limit", "12", "--max-new-tokens", "6", "--batch-size", "5", "--temperature", "0.8", "--no-progress"]
    assert main([*sampled, "--out", str(tmp_path / "whole.jsonl")]) == 0
    generate, asked = Engine.generate, []

    def stopped_after_five(self, requests, progress=None, each=None):
        def kept(index, completions):
            each(index, completions)
            if sum(1 for line in (tmp_path / "broken.jsonl.partial").open()) == 6:  # its header and 5 answers
                raise KeyboardInterrupt
        return generate(self, requests, progress, kept)

    monkeypatch.setattr(Engine, "generate", stopped_after_five)
    assert main([*sampled, "--out", str(tmp_path / "broken.jsonl")]) == 130
    assert not (tmp_path / "broken.jsonl").exists() and (tmp_path / "broken.jsonl.partial").is_file()
    monkeypatch.setattr(Engine, "generate", lambda self, requests, progress=None, each=None: (
        asked.append(len(requests)), generate(self, requests, progress, each))[1])
    capsys.readouterr()
    assert main([*sampled, "--out", str(tmp_path / "broken.jsonl")]) == 0
    assert f"resuming: 5 of 12 answers kept from an interrupted run of this command ({tmp_path / 'broken.jsonl'}" \
           ".partial); 7 to go" in capsys.readouterr().out
    assert asked == [7] and not (tmp_path / "broken.jsonl.partial").exists()
    assert (tmp_path / "broken.jsonl").read_text() == (tmp_path / "whole.jsonl").read_text()
    # answers kept under other settings are not taken: another seed starts over, and says so
    (tmp_path / "other.jsonl.partial").write_text((tmp_path / "broken.jsonl.partial").read_text()
                                                  if (tmp_path / "broken.jsonl.partial").exists() else
                                                  json.dumps({"polyalign_partial": {}}) + "\n")
    assert main([*sampled, "--seed", "1", "--out", str(tmp_path / "other.jsonl")]) == 0
    assert "holds answers of an interrupted run with other settings, records or checkpoint; starting over" in \
        capsys.readouterr().out and asked[-1] == 12
    monkeypatch.setattr(Engine, "generate", generate)
    # top-p under greedy decoding chooses nothing: said, with the setting that samples (the penalties above change
    # the logits greedy decoding reads, and were not)
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(tmp_path / "ckpt"), "--records", str(run / "data" / "test.jsonl"),
                 "--out", str(tmp_path / "top_p.jsonl"), "--limit", "2", "--max-new-tokens", "2", "--top-p", "0.5",
                 "--no-progress"]) == 0
    assert ("note: --top-p 0.5 does nothing under greedy decoding (--temperature 0, the default); give --temperature "
            "(e.g. 0.8) to sample from what it keeps") in capsys.readouterr().out
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(tmp_path / "ckpt"), "--records", str(run / "data" / "test.jsonl"),
                 "--out", str(penalised), "--presence-penalty", "3"]) == 2
    assert "--presence-penalty must be in [-2, 2], got 3" in capsys.readouterr().err
    # a misspelled checkpoint folder is named as missing, not as a folder without config.json
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(tmp_path / "cktp"), "--records", str(run / "data" / "test.jsonl"),
                 "--out", str(tmp_path / "x.jsonl"), "--no-progress"]) == 2
    assert capsys.readouterr().err.strip().endswith(f"{tmp_path / 'cktp'}: no such checkpoint folder")
    # a training run's folder for its model (RUN/config.json is the run's settings): named, with the model
    trained = tmp_path / "trained"
    shutil.copytree(tmp_path / "ckpt", trained / "model")
    (trained / "config.json").write_text(json.dumps({"method": "sft", "init": str(tmp_path / "ckpt")}))
    assert main(["generate", "--checkpoint", str(trained), "--records", str(run / "data" / "test.jsonl"),
                 "--out", str(tmp_path / "x.jsonl"), "--no-progress"]) == 2
    assert capsys.readouterr().err.strip().endswith(
        f"{trained} is a training run's folder (its config.json holds the run's settings); its model is "
        f"{trained / 'model'}")
    # --max-new-tokens auto: each record within its bucket's budget, taken from train.jsonl beside the records
    auto = tmp_path / "auto.jsonl"
    assert main(["generate", "--checkpoint", str(tmp_path / "ckpt"), "--records", str(run / "data" / "test.jsonl"),
                 "--out", str(auto), "--limit", "12", "--max-new-tokens", "auto", "--budget-ceiling", "9",
                 "--no-progress"]) == 0
    summary = json.loads((tmp_path / "auto.manifest.json").read_text())["summary"]
    budgets = summary["budgets"]["by_bucket"]
    train_buckets = {r.bucket_id for r in read_records(run / "data" / "train.jsonl")}
    assert set(budgets) == train_buckets and set(budgets.values()) <= set(range(8, 10))
    assert all(row["new_tokens"] <= budgets.get(record.bucket_id, 9) for row, record in
               zip((json.loads(line) for line in auto.read_text().splitlines()), records))
    assert set(summary["truncated_by_bucket"]) == {r.bucket_id for r in records}
    assert main(["generate", "--checkpoint", str(tmp_path / "ckpt"), "--records", str(auto), "--out",
                 str(tmp_path / "x.jsonl"), "--max-new-tokens", "auto"]) == 2  # no train.jsonl beside auto.jsonl
    assert main(["generate", "--checkpoint", str(tmp_path / "ckpt"), "--records", str(auto), "--out",
                 str(tmp_path / "x.jsonl"), "--budget-ceiling", "5"]) == 2  # only with auto
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(tmp_path / "ckpt"), "--records", str(auto), "--out",
                 str(tmp_path / "x.jsonl"), "--max-new-tokens", "0"]) == 2
    assert capsys.readouterr().err == "polyalign generate: error: --max-new-tokens must be at least 1, got 0\n"
    with pytest.raises(SystemExit) as refused:  # neither a number nor auto: argparse's usage and error, status 2
        main(["generate", "--checkpoint", str(tmp_path / "ckpt"), "--records", str(auto), "--out",
              str(tmp_path / "x.jsonl"), "--max-new-tokens", "many"])
    assert refused.value.code == 2
    # settings not given come from the checkpoint's generation_config.json, as serve and vLLM take them (its
    # temperature aside: greedy unless told); given ones win
    (tmp_path / "ckpt" / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.7, "top_k": 3, "repetition_penalty": 1.8}))
    capsys.readouterr()
    taken = tmp_path / "taken.jsonl"
    base = ["generate", "--checkpoint", str(tmp_path / "ckpt"), "--records", str(run / "data" / "test.jsonl"),
            "--limit", "12", "--max-new-tokens", "6", "--batch-size", "5", "--no-progress"]
    assert main([*base, "--out", str(taken)]) == 0
    printed = capsys.readouterr().out
    assert (f"note: top_k 3, repetition_penalty 1.8 from {tmp_path / 'ckpt'}/generation_config.json for the settings "
            "not given, as `polyalign serve` and vLLM take them (give them, e.g. --top-k 0 --repetition-penalty 1, "
            "to decode without)") in printed
    sampling = json.loads((tmp_path / "taken.manifest.json").read_text())["settings"]["sampling"]
    assert (sampling["temperature"], sampling["top_k"], sampling["repetition_penalty"]) == (0.0, 3, 1.8)
    assert main([*base, "--out", str(tmp_path / "given.jsonl"), "--repetition-penalty", "1"]) == 0
    sampling = json.loads((tmp_path / "given.manifest.json").read_text())["settings"]["sampling"]
    assert sampling["top_k"] == 3 and "repetition_penalty" not in sampling
    assert "repetition_penalty 1.8" not in capsys.readouterr().out.split("\n")[0]


@pytest.mark.slow
def test_sharded_generation_equals_unsharded(tmp_path):
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    out = tmp_path / "result.json"
    subprocess.run([sys.executable, str(REPO / "tests" / "train_worker.py"), "generate", str(tmp_path), str(out),
                    "--devices", "8", "--data", "4", "--fsdp", "1", "--tensor", "2"],
                   check=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert json.loads(out.read_text()) == {"equal": True, "rows": 3, "engine_equal": True, "decode_programs": 1,
                                           "engine_greedy_equals_sampler": True}


def test_every_limit_and_sample_takes_records_in_file_order_and_says_when_it_asked_for_more(demo_run):
    """For every --limit and --sample (below, at and above the file's count): the records taken are the
    file's, in its order, min(asked, held) of them, the same for the same seed; a note names each option
    that asked for more than there was, and no note otherwise."""
    from polyalign.data.records import read_records
    from polyalign.generate.selection import select_records

    run, _, _ = demo_run
    source = run / "data" / "val.jsonl"
    records = read_records(source)[:30]
    position = {r.id: i for i, r in enumerate(records)}
    for limit in (None, 1, 20, 30, 31, 500):
        for sample in (None, 1, 7, 20, 30, 45):
            taken, notes = select_records(records, source, limit, sample, seed=3)
            held = min(limit or 30, 30)
            assert len(taken) == min(sample or held, held)
            order = [position[r.id] for r in taken]
            assert order == sorted(set(order)) and max(order) < held
            assert [r.id for r in select_records(records, source, limit, sample, seed=3)[0]] == [r.id for r in taken]
            expected = [f"--limit {limit}: {source} holds 30 records; all are taken"] * bool(limit and limit > 30)
            # both choosing is said, whatever their values: neither reads as ignored
            expected += [f"--limit {limit} with --sample {sample}: chosen from the first {held} records only"] * bool(
                limit and sample)
            more = sample is not None and sample > held
            expected += [f"--sample {sample}: {held} records to sample from; all are taken"] * more
            assert notes == expected, (limit, sample, notes)
    other = select_records(records, source, None, 7, seed=4)[0]
    assert [r.id for r in other] != [r.id for r in select_records(records, source, None, 7, seed=3)[0]]
    with pytest.raises(Exception, match="no records"):
        select_records([], source)


def test_per_bucket_takes_n_of_every_bucket_in_file_order_whatever_else_the_file_holds(demo_run):
    """For every N and seed: each bucket gives min(N, its records), in file order, the same for the same
    seed; a bucket's records do not change when other buckets leave the file; the note names the buckets
    that hold fewer than N; --limit applies first; --sample with --per-bucket is refused."""
    from collections import Counter

    from polyalign.data.records import read_records
    from polyalign.generate.selection import select_records

    run, _, _ = demo_run
    source = run / "data" / "val.jsonl"
    records = read_records(source)
    held = Counter(r.bucket_id for r in records)
    position = {r.id: i for i, r in enumerate(records)}
    largest = max(held, key=held.get)
    for per_bucket in (1, 3, 8, max(held.values()) + 1):
        for seed in (0, 5):
            taken, notes = select_records(records, source, per_bucket=per_bucket, seed=seed)
            assert Counter(r.bucket_id for r in taken) == {b: min(per_bucket, n) for b, n in held.items()}
            order = [position[r.id] for r in taken]
            assert order == sorted(order)
            assert [r.id for r in select_records(records, source, per_bucket=per_bucket, seed=seed)[0]] == \
                [r.id for r in taken]
            alone = [r for r in records if r.bucket_id == largest]
            assert [r.id for r in select_records(alone, source, per_bucket=per_bucket, seed=seed)[0]] == \
                [r.id for r in taken if r.bucket_id == largest]
            fewer = {b: n for b, n in held.items() if n < per_bucket}
            if not fewer:
                assert notes == []
            else:
                assert len(notes) == 1 and notes[0].startswith(
                    f"--per-bucket {per_bucket}: {len(fewer)} of {len(held)} buckets hold fewer records; all of "
                    "theirs are taken (fewest: ")
                assert all(f"{b} ({n})" in notes[0] for b, n in sorted(fewer.items(), key=lambda kv: kv[1])[:3])
    assert select_records(records, source, per_bucket=2, seed=0)[0] != select_records(records, source, per_bucket=2,
                                                                                      seed=1)[0]
    first = records[:25]
    assert Counter(r.bucket_id for r in select_records(records, source, limit=25, per_bucket=2)[0]) == \
        {b: min(2, n) for b, n in Counter(r.bucket_id for r in first).items()}
    with pytest.raises(Exception, match="--sample and --per-bucket each choose the records; give one of them"):
        select_records(records, source, sample=5, per_bucket=2)


@pytest.mark.parametrize("template", ["built-in", "exported jinja", "exported gemma2 jinja"])
@pytest.mark.parametrize("system", ["keep", "replace", "drop"])
def test_prompts_render_system_turns_as_the_checkpoint_was_trained(system, template, demo_run, demo_tokenizer,
                                                                   tmp_path):
    """A checkpoint exported from a build with `--system MODE` says so (polyalign_system); `prompts` and
    `generate` render every record as that build did, not always as `keep`: with a built-in template, and
    with the Jinja template an export carries (whose profile preamble must not compose the composed
    conversation again: under replace and drop it would drop the profile prompt). A template that refuses
    system messages (Gemma 2's) gets them folded into user turns in `messages` too, as an engine applying
    it needs them."""
    import dataclasses
    import shutil

    from polyalign.data.records import read_records
    from polyalign.generate.prompts import write_prompts
    from polyalign.model.export import export_template
    from polyalign.tokens.chat import JinjaTemplate, fold_system, get_template, record_messages
    from polyalign.tokens.tokenizer import load_tokenizer
    from tests.conftest import FIXTURES

    checkpoint = tmp_path / "ckpt"
    shutil.copytree(demo_tokenizer[0].path.parent, checkpoint)
    config = {**json.loads((checkpoint / "tokenizer_config.json").read_text()), "polyalign_system": system}
    trained = get_template("polyalign")
    if template == "exported gemma2 jinja":
        trained = JinjaTemplate((FIXTURES / "chat" / "templates" / "gemma2.jinja").read_text(encoding="utf-8"),
                                demo_tokenizer[0])
    if template != "built-in":  # as an export of a checkpoint with its own template writes it
        config.pop("polyalign_chat_template")
        config["chat_template"] = export_template(trained, system)
    (checkpoint / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_tokenizer(checkpoint).system_mode == system
    val = read_records(demo_run[0] / "data" / "val.jsonl")[:6]
    # each record opens with a system turn of real text (another record's question)
    records = [dataclasses.replace(r, history=[{"role": "system", "text": val[-1 - i].question}, *r.history])
               for i, r in enumerate(val)]
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    write_prompts(checkpoint, path, tmp_path / "prompts.jsonl", max_prompt_tokens=None)
    rows = [json.loads(line) for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    for record, row in zip(records, rows):
        expected = record_messages(record, "context", with_response=False, system=system)
        sent = expected if trained.takes_system else [m for _, m in fold_system(expected)]
        assert [(m["role"], m["content"]) for m in row["messages"]] == [(m.role, m.content) for m in sent]
        assert trained.takes_system or all(m["role"] != "system" for m in row["messages"])
        if trained.takes_system:  # (folded, the first message holds the user's own text too)
            assert (record.history[0]["text"] in row["messages"][0]["content"]) == (system == "keep")
        assert row["prompt"] == trained.render(expected, add_generation_prompt=True)
        assert "Follow the target response profile" in row["prompt"]


def test_prompts_without_a_checkpoint_write_whole_conversations_as_messages(demo_run, tmp_path, capsys):
    """For a chat API that applies its own template (an external system evaluated beside polyalign's models):
    no checkpoint, so the rows hold each record's messages whole (profile prompt, system turns in place) and
    nothing rendered or counted; its selection is evaluated with --prompts; what needs a tokenizer is refused."""
    from polyalign.cli import main
    from polyalign.data.records import read_records
    from polyalign.tokens.chat import record_messages

    run = demo_run[0]
    records_path, out = run / "data" / "test.jsonl", tmp_path / "messages.jsonl"
    assert main(["prompts", "--records", str(records_path), "--out", str(out), "--per-bucket", "2",
                 "--max-new-tokens", "64"]) == 0
    printed = capsys.readouterr().out
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    by_id = {r.id: r for r in read_records(records_path)}
    assert len(rows) == 2 * len({r.bucket_id for r in by_id.values()}) - sum(  # buckets with one test record
        1 for b in {r.bucket_id for r in by_id.values()} if sum(r.bucket_id == b for r in by_id.values()) < 2)
    for row in rows:
        assert set(row) == {"id", "messages", "max_tokens"} and row["max_tokens"] == 64
        expected = record_messages(by_id[row["id"]], "context", with_response=False)
        assert row["messages"] == [{"role": m.role, "content": m.content} for m in expected]
        assert row["messages"][0]["role"] == "system" and "Follow the target response profile" in \
            row["messages"][0]["content"]
    assert f"{len(rows)} conversations written as messages (profile context, system messages in place), whole" \
        in printed
    # an engine's answers to them (people's own here) are evaluated as the records prompts chose
    predictions = tmp_path / "answers.jsonl"
    predictions.write_text("".join(json.dumps({"id": row["id"], "prediction": by_id[row["id"]].response}) + "\n"
                                   for row in rows))
    assert main(["evaluate", "--records", str(records_path), "--predictions", str(predictions), "--prompts", str(out),
                 "--out", str(tmp_path / "eval"), "--bootstrap-draws", "20", "--no-detectability",
                 "--no-baselines", "--no-diversity", "--no-progress"]) == 0
    assert f"{len(rows)} of {len(by_id)} rows (the ones `prompts --per-bucket 2 --seed 0` chose" in \
        capsys.readouterr().out
    # the engine's rows name no profile: the one the prompts were written with is the evaluation's
    assert json.loads((tmp_path / "eval" / "metrics.json").read_text())["config"]["profile"] == ["context"]
    command = ["prompts", "--records", str(records_path), "--out", str(tmp_path / "o.jsonl")]
    assert main([*command, "--max-prompt-tokens", "100"]) == 2  # one line, not argparse's usage block
    err = capsys.readouterr().err
    assert err.startswith("polyalign prompts: error: --max-prompt-tokens counts a model's tokens: give --checkpoint "
                          "too") and len(err.splitlines()) == 1
    for flags, needs in ((["--template", "qwen"], "--template needs a --checkpoint"),
                         (["--max-new-tokens", "auto"], "--max-new-tokens auto needs a --checkpoint")):
        assert main([*command, *flags]) == 2
        assert needs in capsys.readouterr().err


@pytest.mark.parametrize("trained", ["context", "oracle", "none"])
def test_prompts_use_the_profile_the_checkpoint_was_trained_with(trained, demo_run, demo_tokenizer, tmp_path, capsys):
    """A checkpoint exported from a build with `--profile P` says so (polyalign_profile): `prompts` and
    `generate` render its records with P unless asked otherwise, and asking for another is said."""
    import shutil

    from polyalign.data.records import read_records
    from polyalign.generate.prompts import write_prompts
    from polyalign.tokens.chat import record_messages, record_profile

    checkpoint = tmp_path / "ckpt"
    shutil.copytree(demo_tokenizer[0].path.parent, checkpoint)
    config = {**json.loads((checkpoint / "tokenizer_config.json").read_text()), "polyalign_profile": trained}
    (checkpoint / "tokenizer_config.json").write_text(json.dumps(config))
    path = demo_run[0] / "data" / "val.jsonl"
    records = read_records(path)[:4]
    summary = write_prompts(checkpoint, path, tmp_path / "default.jsonl", limit=4, max_prompt_tokens=None)
    rows = [json.loads(line) for line in (tmp_path / "default.jsonl").read_text().splitlines()]
    assert summary["profile"] == trained and capsys.readouterr().err == ""
    for record, row in zip(records, rows):
        expected = record_messages(record, trained, with_response=False)
        assert [(m["role"], m["content"]) for m in row["messages"]] == [(m.role, m.content) for m in expected]
    other = "context" if trained != "context" else "none"
    asked = write_prompts(checkpoint, path, tmp_path / "asked.jsonl", profile=other, limit=4,
                          max_prompt_tokens=None)
    note = f"{checkpoint} was trained with profile {trained!r}; rendering with {other!r} as asked"
    assert asked["profile"] == other and asked["notes"] == [note]  # the command prints its summary's notes
    # and the manifest keeps it, where a later reader of the prompts finds it
    assert json.loads((tmp_path / "asked.manifest.json").read_text())["summary"]["notes"] == [note]
    if trained == "none":
        return
    # Records naming values the checkpoint's training data did not hold (its polyalign_profile_values) are said.
    styles = sorted({r.style for r in records} - {records[-1].style}) or ["a style none of them has"]
    held = {"family": sorted({r.family for r in records}), "track": ["multi", "single"], "style": styles,
            "length": sorted({r.length_bin for r in records})}
    (checkpoint / "tokenizer_config.json").write_text(json.dumps({**config, "polyalign_profile_values": held}))
    unseen = [r for r in records if r.style not in styles]
    said = write_prompts(checkpoint, path, tmp_path / "unseen.jsonl", limit=4, max_prompt_tokens=None)["notes"]
    assert said == [f"{len(unseen)} of 4 records name profile values {checkpoint}'s training data did not hold "
                    f"(style {records[-1].style!r} {len(unseen)}): the model never read such profile prompts"]
    # ... and records whose values were each held, never together (the export's combinations): said apart
    first = record_profile(records[0], trained)
    together = [{key: f"other {value}" for key, value in first.items()}]
    everything = {key: sorted({getattr(r, field) for r in records}) for key, field in
                  (("family", "family"), ("track", "track"), ("style", "style"), ("length", "length_bin"))}
    (checkpoint / "tokenizer_config.json").write_text(json.dumps(
        {**config, "polyalign_profile_values": everything, "polyalign_profile_combinations": together}))
    apart = sum(record_profile(r, trained) not in together for r in records)
    said = write_prompts(checkpoint, path, tmp_path / "apart.jsonl", limit=4, max_prompt_tokens=None)["notes"]
    assert apart and said == [f"{apart} of 4 records name a profile whose values {checkpoint}'s training data held, "
                              "but never together: the model never read such profile prompts"]
    # every record's combination held: asked for `oracle` (context's three keys and the length) or `none` (no
    # profile prompt at all), nothing is said of combinations (both said every record's was never held)
    held_together = [record_profile(r, trained) for r in records]
    (checkpoint / "tokenizer_config.json").write_text(json.dumps(
        {**config, "polyalign_profile_values": everything, "polyalign_profile_combinations": held_together}))
    for asked_for in ("oracle", "none"):
        said = write_prompts(checkpoint, path, tmp_path / f"{asked_for}.jsonl", profile=asked_for, limit=4,
                             max_prompt_tokens=None)["notes"]
        assert not any("never together" in note for note in said), (asked_for, said)


def test_a_checkpoint_polyalign_did_not_train_is_prompted_as_it_was_trained(demo_run, demo_tokenizer, tmp_path):
    """A base model (a tokenizer config with no polyalign_* key) never read polyalign's profile prompt: prompts
    and generate render its records without it by default, and say so (given it, a comparison with the
    models trained from it measured the base on prompts it was never trained on: 109 of 120 answers changed).
    A polyalign export that does not name its profile keeps the evaluation default, context."""
    import shutil

    from polyalign.data.records import read_records
    from polyalign.generate.prompts import write_prompts
    from polyalign.tokens.chat import record_messages

    checkpoint = tmp_path / "base"
    shutil.copytree(demo_tokenizer[0].path.parent, checkpoint)
    ours = json.loads((checkpoint / "tokenizer_config.json").read_text())
    base = {key: value for key, value in ours.items() if not key.startswith("polyalign_")}
    assert base != ours  # the fixture is polyalign's own: the keys the export writes are taken out
    (checkpoint / "tokenizer_config.json").write_text(json.dumps(base))
    path = demo_run[0] / "data" / "val.jsonl"
    records = read_records(path)[:3]
    summary = write_prompts(checkpoint, path, tmp_path / "base.jsonl", limit=3, max_prompt_tokens=None,
                            template="polyalign")
    assert summary["profile"] == "none" and summary["notes"] == [
        f"{checkpoint} was not trained by polyalign (its tokenizer config names no polyalign_profile): prompted "
        "without polyalign's profile prompt, as it was trained (--profile context gives it the one the models "
        "polyalign trains read)"]
    rows = [json.loads(line) for line in (tmp_path / "base.jsonl").read_text().splitlines()]
    for record, row in zip(records, rows):
        expected = record_messages(record, "none", with_response=False)
        assert [(m["role"], m["content"]) for m in row["messages"]] == [(m.role, m.content) for m in expected]
        assert not any("target response profile" in m["content"] for m in row["messages"])
    asked = write_prompts(checkpoint, path, tmp_path / "asked.jsonl", profile="context", limit=3,
                          max_prompt_tokens=None, template="polyalign")
    assert asked["profile"] == "context" and asked.get("notes", []) == []
    # polyalign's export that names no profile (written before it did): the evaluation default
    (checkpoint / "tokenizer_config.json").write_text(json.dumps({**base, "polyalign_system": "keep"}))
    assert write_prompts(checkpoint, path, tmp_path / "older.jsonl", limit=3, max_prompt_tokens=None,
                         template="polyalign")["profile"] == "context"


def test_a_share_above_nothing_never_reads_zero_percent():
    from polyalign.cli import _share

    assert [_share(x) for x in (0.001, 0.005, 0.0099, 0.01, 0.5, 0.99, 0.996, 1.0)] == [
        "<1%", "<1%", "<1%", "1%", "50%", "99%", ">99%", "100%"]


def test_budgets_past_the_longest_sequence_a_model_trained_on_are_noted(tmp_path):
    """A model polyalign trained from scratch records the longest sequence it trained on, through every
    run trained on from it; generate notes prompt and answer budgets past it, and how to keep within it."""

    from polyalign.generate.run import GenerateOptions, default_prompt_budget, past_trained_length
    from polyalign.model.export import longest_trained

    scratch, base = tmp_path / "scratch", tmp_path / "pretrained"
    for folder, config in ((scratch, {"polyalign_max_length": 256}), (base, {"eos_token": "</s>"})):
        folder.mkdir()
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    # from scratch: the run's length; on from a recorded model: the longer of the two; on from a pretrained
    # checkpoint (no record): unknown, since its pretraining saw longer sequences
    assert longest_trained(None, 128) == 128
    assert longest_trained(str(scratch), 128) == 256 and longest_trained(str(scratch), 512) == 512
    assert longest_trained(str(base), 128) is None
    # generate's default prompt budget: what the trained length leaves after the answers (at least half of
    # it); 512 for a model that does not say, or one trained long enough; a given budget stays as given
    assert GenerateOptions(sampling=SamplingConfig(max_new_tokens=64)).max_prompt_tokens == "auto"
    assert default_prompt_budget(scratch, "auto", 64) == (192, [
        f"--max-prompt-tokens 192 (chosen): {scratch} was never trained on a sequence longer than 256 tokens "
        "(polyalign_max_length in its tokenizer_config.json: polyalign trained it, or the model it was trained from, "
        "from scratch), and --max-new-tokens 64 leaves 192 of them (give --max-prompt-tokens to choose; 512 where a "
        "model does not say)"])
    assert default_prompt_budget(scratch, "auto", 200)[0] == 128 and "half of them" in default_prompt_budget(
        scratch, "auto", 200)[1][0]
    assert default_prompt_budget(scratch, "auto", 1024, budgeted=True)[1][0].count("half of them") == 1
    assert default_prompt_budget(base, "auto", 64) == (512, []) and default_prompt_budget(scratch, 300, 64) == (300, [])
    (long := tmp_path / "long").mkdir()
    (long / "tokenizer_config.json").write_text(json.dumps({"polyalign_max_length": 576}))
    assert default_prompt_budget(long, "auto", 64) == (512, []) and default_prompt_budget(long, "auto", 65)[0] == 511
    # the chosen budget never reaches past the trained length where the answers leave room
    for answers in range(1, 256, 7):
        budget, _ = default_prompt_budget(scratch, "auto", answers)
        assert budget >= 128 and (past_trained_length(scratch, budget, answers) is None) == (answers <= 128)
    assert past_trained_length(scratch, 512, 64) == (
        f"{scratch} was never trained on a sequence longer than 256 tokens (polyalign_max_length in its "
        "tokenizer_config.json: polyalign trained it, or the model it was trained from, from scratch); "
        "--max-prompt-tokens 512 + --max-new-tokens 64 = 576 lets a long prompt and its answer run past them, into "
        "positions the model never learned: --max-prompt-tokens 192 keeps within them (a prompt cut shorter loses its "
        "opening system message where that takes over half of it)")
    assert past_trained_length(scratch, 192, 64) is None
    assert past_trained_length(base, 512, 64) is None
    # --max-new-tokens auto: the largest per-bucket budget counts, not the ceiling; a short prompt budget stays
    assert past_trained_length(scratch, 100, 300, True).endswith(
        "--max-prompt-tokens 100 + the largest per-bucket budget 300 = 400 lets a long prompt and its answer run "
        "past them, into positions the model never learned: --max-prompt-tokens 100 and --budget-ceiling 156 keep "
        "within them (a prompt cut shorter loses its opening system message where that takes over half of it)")
    # both budgets left to polyalign (--max-new-tokens auto, no --budget-ceiling) share the trained length: one
    # note says both, and no second note then says they run past it (they did: "128 (chosen)", then "128 + 1024")
    from polyalign.generate.run import BUDGET_CEILING, default_budgets

    prompt, ceiling, notes = default_budgets(scratch, "auto", BUDGET_CEILING, budgeted=True, ceiling_chosen=True)
    assert (prompt, ceiling) == (128, 128) and past_trained_length(scratch, prompt, ceiling, True) is None
    assert notes == [f"--max-prompt-tokens 128 and --budget-ceiling 128 (chosen): {scratch} was never trained on a "
                     "sequence longer than 256 tokens (polyalign_max_length in its tokenizer_config.json: polyalign "
                     "trained it, or the model it was trained from, from scratch), half of them for the prompt and the "
                     "rest for the longest answer (give either to choose; 512 and 1024 where a model does not say)"]
    # what a user gave stays as given (a ceiling, a prompt budget, a fixed answer budget), as for a model that
    # does not say how long it trained
    assert default_budgets(scratch, "auto", 1000, budgeted=True)[:2] == (128, 1000)
    assert default_budgets(scratch, "auto", BUDGET_CEILING, budgeted=True)[:2] == (128, BUDGET_CEILING)  # given
    assert default_budgets(scratch, 100, BUDGET_CEILING, True, ceiling_chosen=True) == (100, BUDGET_CEILING, [])
    assert default_budgets(scratch, "auto", 64) == (192, 64, default_prompt_budget(scratch, "auto", 64)[1])
    assert default_budgets(base, "auto", BUDGET_CEILING, True, ceiling_chosen=True) == (512, BUDGET_CEILING, [])


def test_prompts_cut_at_generates_prompt_budget_by_default_from_the_cli_and_the_api():
    """`prompts` is generate's prompts for another engine: its default budget is generate's, whichever way
    it is called (its rows would otherwise hold prompts generate cuts)."""
    import inspect

    from polyalign.cli import build_parser, prompts_budget
    from polyalign.generate.prompts import write_prompts
    from polyalign.generate.run import GenerateOptions

    budget = GenerateOptions().max_prompt_tokens
    assert inspect.signature(write_prompts).parameters["max_prompt_tokens"].default == budget == "auto"
    parser = build_parser()
    # not given on the command line: chosen by the checkpoint (run.default_prompt_budget)
    assert parser.parse_args(["generate", "--records", "r", "--checkpoint", "c", "--out", "o"]).max_prompt_tokens \
        is None
    assert prompts_budget(parser.parse_args(["prompts", "--records", "r", "--checkpoint", "c", "--out", "o"])) \
        == budget
    # without a checkpoint nothing counts tokens: whole conversations
    assert prompts_budget(parser.parse_args(["prompts", "--records", "r", "--out", "o"])) is None
