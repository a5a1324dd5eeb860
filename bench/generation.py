"""Generation speed: the engine against the static sampler (and transformers' `generate` when torch is
installed) on the same prompts, greedy, with equal outputs checked.

    python bench/generation.py --run RUN [--checkpoint CKPT | --shape qwen2.5-0.5b] [--records 96]
                               [--budget human|fixed] [--max-new-tokens 128] [--batch 16]

RUN is a prepared run with a tokenizer (`polyalign demo` makes runs/demo); the prompts are the first
--records of RUN/data/test.jsonl, a mix of buckets. CKPT defaults to RUN/bucket_sft/model (the demo's
trained model, whose answers stop at different lengths); --shape samples a randomly initialised model of
that preset with the run's vocabulary instead (its answers never stop, so use --budget human).

--budget human gives each record a budget of its own human answer's length in tokens (at least 8, at
most --max-new-tokens): the bucket-mixed lengths polyalign's data has. The engine takes each budget as
it is; the static sampler, one budget per batch, decodes every batch to its longest budget and its
answers are cut to each record's budget afterwards (greedy answers are prefixes of longer ones), so
both give the same tokens. --budget fixed gives every record --max-new-tokens.

Prints one row per generator (wall seconds after a warm-up on the same prompts, new tokens per second,
ratio to the static sampler, whether its tokens equal the engine's) and writes JSON to $OUT when set.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from result_file import write_result

REPO = Path(__file__).resolve().parents[1]


def _timed(function, repeats: int = 1):
    function()  # compiles and warms up
    started = time.perf_counter()
    for _ in range(repeats):
        result = function()
    return result, (time.perf_counter() - started) / repeats


def transformers_greedy(folder: Path, prompts, budgets, pad_id: int, stop_ids, batch: int) -> list[list[int]] | None:
    """transformers' generate on the exported weights, batches of `batch` left-padded prompts, each batch
    to its longest budget, cut to each budget; None when torch or transformers is missing."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    outputs = []
    for start in range(0, len(prompts), batch):
        chunk, chunk_budgets = prompts[start:start + batch], budgets[start:start + batch]
        length = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), length), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), length), dtype=torch.long)
        for row, prompt in enumerate(chunk):
            ids[row, length - len(prompt):] = torch.as_tensor(prompt)
            mask[row, length - len(prompt):] = 1
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(chunk_budgets), do_sample=False,
                                 eos_token_id=list(stop_ids) or None, pad_token_id=pad_id)
        for row, budget in enumerate(chunk_budgets):
            tokens = out[row, length:length + budget].tolist()
            cut = next((i for i, t in enumerate(tokens) if t in stop_ids), None)
            outputs.append(tokens if cut is None else tokens[:cut])
    return outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True)
    parser.add_argument("--checkpoint", type=Path)
    parser.add_argument("--shape", help="a model preset, randomly initialised with the run's vocabulary")
    parser.add_argument("--records", type=int, default=96)
    parser.add_argument("--budget", choices=("human", "fixed"), default="human")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="static batch size and engine slots")
    parser.add_argument("--no-transformers", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    import tempfile

    from polyalign.data.records import read_records
    from polyalign.generate.engine import Engine, EngineConfig, Request
    from polyalign.generate.run import stop_ids_of
    from polyalign.generate.sampling import Sampler, SamplingConfig
    from polyalign.model import create_model, load_hf_checkpoint, save_hf_checkpoint
    from polyalign.model.presets import preset
    from polyalign.tokens.chat import encode_prompt, get_template, record_messages
    from polyalign.tokens.tokenizer import load_tokenizer

    records = read_records(args.run / "data" / "test.jsonl")[:args.records]
    if args.shape:
        tokenizer = load_tokenizer(args.run / "tokenizer")
        model = create_model(preset(args.shape, vocab_size=tokenizer.vocab_size, dtype="float32",
                                    param_dtype="float32"))
        checkpoint = None
        stop_ids: list[int] = []  # a random model's answers run to their budgets
        chat = get_template("polyalign", tokenizer)
    else:
        checkpoint = args.checkpoint or args.run / "bucket_sft" / "model"
        model, tokenizer = load_hf_checkpoint(checkpoint), load_tokenizer(checkpoint)
        chat = get_template("polyalign", tokenizer)
        stop_ids = stop_ids_of(tokenizer, chat)
    prompts = [np.asarray(encode_prompt(chat, tokenizer, record_messages(r, "context", with_response=False),
                                        max_tokens=512), np.int32) for r in records]
    if args.budget == "human":
        budgets = [int(np.clip(len(tokenizer.encode(r.response)), 8, args.max_new_tokens)) for r in records]
    else:
        budgets = [args.max_new_tokens] * len(records)

    engine = Engine(model, stop_ids, EngineConfig(slots=args.batch, max_sequence=512 + args.max_new_tokens))
    requests = [Request(p, SamplingConfig(max_new_tokens=b)) for p, b in zip(prompts, budgets)]
    engine_out, engine_s = _timed(lambda: [c[0].tokens for c in engine.generate(requests)])
    stats = engine.stats

    def static():
        # as the static sampler served `generate`: similar prompt lengths together, each batch to its longest budget
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        out: dict[int, list[int]] = {}
        for start in range(0, len(order), args.batch):
            chunk = order[start:start + args.batch]
            sampler = Sampler(model, stop_ids, tokenizer.pad_id, SamplingConfig(max(budgets[i] for i in chunk)))
            for i, (tokens, _) in zip(chunk, sampler.generate([prompts[i] for i in chunk])):
                out[i] = tokens[:budgets[i]]
        return [out[i] for i in range(len(prompts))]

    static_out, static_s = _timed(static)
    rows = [("engine", engine_s, engine_out), ("static sampler", static_s, static_out)]
    if not args.no_transformers:
        with tempfile.TemporaryDirectory() as folder:
            save_hf_checkpoint(model, Path(folder))
            hf = _timed(lambda: transformers_greedy(Path(folder), prompts, budgets, tokenizer.pad_id, set(stop_ids),
                                                    args.batch))
        if hf[0] is not None:
            rows.append(("transformers generate (torch, CPU)", hf[1], hf[0]))

    new_tokens = sum(len(t) for t in engine_out)
    label = args.shape or str(checkpoint)
    print(f"{len(records)} records of {args.run / 'data' / 'test.jsonl'}, model {label}, budgets {args.budget} "
          f"(mean {np.mean(budgets):.0f}, max {max(budgets)}), {args.batch} sequences at once, greedy")
    print(f"engine: {stats['decode_calls']} decode calls, {stats['live_slot_steps']}/{stats['slot_steps']} slot-steps "
          f"live, {stats['prefill_calls']} prefill calls, peak {stats['peak_pages']} of {stats['pool_pages']} pages")
    print(f"{'generator':36} {'wall s':>8} {'new tok/s':>10} {'vs static':>10}  tokens equal the engine's")
    result = {"records": len(records), "model": label, "budget": args.budget, "batch": args.batch,
              "new_tokens": new_tokens, "engine_stats": stats, "rows": []}
    for name, seconds, out in rows:
        equal = sum(a == b for a, b in zip(out, engine_out))
        print(f"{name:36} {seconds:8.2f} {new_tokens / seconds:10.1f} {static_s / seconds:9.2f}x  "
              f"{equal}/{len(out)}")
        result["rows"].append({"generator": name, "seconds": round(seconds, 3),
                               "new_tokens_per_s": round(new_tokens / seconds, 1),
                               "speedup_vs_static": round(static_s / seconds, 2), "equal_rows": equal})
    write_result("generation", result)


if __name__ == "__main__":
    main()
