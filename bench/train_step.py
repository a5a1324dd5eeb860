"""Time polyalign's SFT and HDPO training steps (and, when torch and transformers are importable, the
same step in PyTorch + transformers: the peer).

    python bench/train_step.py --preset tiny --batch 4 --seq 128                       # CPU, seconds
    python bench/train_step.py --preset qwen2.5-1.5b --batch 4 --seq 1024 --dtype bfloat16 \\
        --remat dots --attention cudnn --logprob-chunk 256                            # one H200
    python bench/train_step.py --preset qwen2.5-1.5b --batch 4 --seq 1024 --compile-only  # memory only

A step is what the trainer runs: SFT on `batch` sequences; HDPO on `batch` pairs (chosen and
rejected in one pass) with the reference log-probs of the batch computed by a frozen copy of the
model (timed separately and added). FLOPs as polyalign/model/flops.py counts them, the training
loop's MFU too: 6N per token for the policy's weights (N = matmul parameters including the LM head),
2N for the reference's forward, and attention over the keys each query sees (causal; packed segments
and tree-packed pairs their own). MFU is reported against the device kind's datasheet bf16 peak
(--peak-tflops overrides it) and against the rate one square matmul reaches here in the compute
dtype (MFU/mm), measured first. Prints a table and writes JSON to $OUT/train_step.json when OUT is set.

Each polyalign row is paired with a plain JAX step of the same model: one jitted value_and_grad of the
plain loss over full logits plus optax AdamW, nothing else (no micro-batch scan, no global
normalisation, no NaN guard, no metric sums). Their ratio is the trainer's overhead. Both report XLA's
compiled memory analysis (arguments + outputs - donated aliases + temporaries), which needs no
accelerator; `--compile-only` reports only that, for shapes too large to run here.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from result_file import write_result  # noqa: E402

from polyalign.inputs import pipeline  # noqa: E402
from polyalign.inputs.pair_rows import packed_pair_arrays  # noqa: E402
from polyalign.mesh import parallel  # noqa: E402
from polyalign.model import abstract_model, create_model  # noqa: E402
from polyalign.model.flops import matmul_parameters, segment_tokens, step_flops  # noqa: E402
from polyalign.model.log_probs import token_log_probs  # noqa: E402
from polyalign.model.presets import preset, preset_or_file  # noqa: E402
from polyalign.train.config import PreferenceConfig  # noqa: E402
from polyalign.train.losses import dpo_loss  # noqa: E402
from polyalign.train.preference import PreferenceObjective, sequence_logps  # noqa: E402
from polyalign.train.sft import SftObjective  # noqa: E402
from polyalign.train.throughput import known_peak_tflops  # noqa: E402
from polyalign.train.trainer import LoopConfig, OptimizerConfig, Trainer  # noqa: E402


def batch_segments(batch) -> list:
    """The causal segments a batch's rows hold, as model/flops.py step_flops counts them: tree-packed pairs
    as (prompt, [chosen, rejected]) trees, packed SFT rows segment by segment, row pairs as their two
    sequences, SFT rows as one sequence each (real tokens only)."""
    host = jax.tree.map(np.asarray, batch)
    if "branch_ids" in host:
        segments, branches = host["segment_ids"].reshape(-1, host["segment_ids"].shape[-1]), \
            host["branch_ids"].reshape(-1, host["branch_ids"].shape[-1])
        return [(int(((seg == s) & (branch == 0)).sum()), [int(((seg == s) & (branch == b)).sum()) for b in (1, 2)])
                for seg, branch in zip(segments, branches) for s in np.unique(seg[seg > 0])]
    if "segment_ids" in host:
        ids = host["segment_ids"].reshape(-1, host["segment_ids"].shape[-1])
        return [int((row == s).sum()) for row in ids for s in np.unique(row[row > 0])]
    if "chosen_length" in host:
        return [int(n) for side in ("chosen", "rejected") for n in host[f"{side}_length"].reshape(-1)]
    return [int(n) for n in host["length"].reshape(-1)]


def matmul_tflops(dtype: str, size: int | None = None) -> float:
    """The rate this device reaches on one square matmul in `dtype` (TFLOP/s): the bench's own ceiling,
    beside the datasheet peak (8192 on an accelerator, 1024 on a CPU)."""
    size = size or (1024 if jax.default_backend() == "cpu" else 8192)
    a = jnp.ones((size, size), dtype)
    product = jax.jit(lambda x, y: x @ y)
    seconds = _time(lambda: product(a, a), 5)[1]
    return 2 * size ** 3 / seconds / 1e12


def datasheet_peak(args) -> float | None:
    """--peak-tflops, else the device kind's datasheet peak (polyalign/train/throughput.py), else None."""
    return args.peak_tflops or known_peak_tflops(jax.devices()[0].device_kind)


def _sft_batch(rng, micro, b, seq, vocab):
    """Random full-length examples with random bucket weights, as the input pipeline lays them out."""
    rows = [pipeline.example_arrays({"input_ids": rng.integers(0, vocab, seq + 1), "loss_mask": np.ones(seq + 1),
                                     "weight": rng.uniform(0.5, 2.0), "bucket": 0}, seq, 0)
            for _ in range(micro * b)]
    return {k: np.stack([r[k] for r in rows]).reshape(micro, b, *rows[0][k].shape) for k in rows[0]}


def _pair_batch(rng, micro, b, seq, vocab):
    batch = {"weight": rng.uniform(0.5, 2.0, (micro, b)).astype(np.float32), "bucket": np.zeros((micro, b), np.int32),
             "valid": np.ones((micro, b), bool), "critic_chosen": np.zeros((micro, b), np.float32),
             "critic_rejected": np.ones((micro, b), np.float32), "ref_chosen": np.zeros((micro, b), np.float32),
             "ref_rejected": np.zeros((micro, b), np.float32)}
    for side in ("chosen", "rejected"):
        ids = rng.integers(0, vocab, (micro, b, seq + 1)).astype(np.int32)
        batch[f"{side}_inputs"], batch[f"{side}_targets"] = ids[..., :-1], ids[..., 1:]
        mask = np.zeros((micro, b, seq), np.float32)
        mask[..., seq // 4:] = 1.0  # the last three quarters are the response
        batch[f"{side}_mask"] = mask
        batch[f"{side}_length"] = np.full((micro, b), seq, np.int32)
    return batch


def _packed_sft_batch(rng, b, seq, vocab, per_row=4):
    """Rows of `seq` positions, each packing `per_row` full examples (segments) end to end."""
    size = seq // per_row + 1
    rows = [pipeline.packed_arrays([{"input_ids": rng.integers(0, vocab, size), "loss_mask": np.ones(size),
                                     "weight": rng.uniform(0.5, 2.0), "bucket": 0} for _ in range(per_row)], seq, 0)
            for _ in range(b)]
    return {k: np.stack([r[k] for r in rows])[None] for k in rows[0]}


def _packed_pair_batch(rng, b, seq, vocab, per_row=2):
    """Rows of `seq` positions, each holding `per_row` pairs as trees: a prompt of seq/8 tokens computed
    once, then a chosen and a rejected continuation of 3 seq/16 tokens each."""
    prompt, response = seq // 8, 3 * seq // 16

    def pair(k):
        shared = rng.integers(0, vocab, prompt)
        sides = {side: np.concatenate([shared, rng.integers(0, vocab, response)]) for side in ("chosen", "rejected")}
        mask = np.r_[np.zeros(prompt), np.ones(response)]
        return {"id": str(k), "chosen_ids": sides["chosen"], "rejected_ids": sides["rejected"], "chosen_mask": mask,
                "rejected_mask": mask, "weight": rng.uniform(0.5, 2.0), "critic_chosen": 0.0, "critic_rejected": 1.0}

    rows = [packed_pair_arrays([pair(k) for k in range(per_row)], seq, 0, per_row, seq) for _ in range(b)]
    return {k: np.stack([r[k] for r in rows])[None] for k in rows[0]}


def _time(fn, steps):
    started = time.perf_counter()
    jax.block_until_ready(fn())
    compile_s = time.perf_counter() - started
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - started)
    return compile_s, statistics.median(times)


_peak_reported = []


def _peak_memory():
    """The device's peak bytes in use, for the first step timed in this process only: the allocator's
    peak never resets, so for later steps it would be the largest of everything run so far (XLA's
    compiled estimate, reported for every row, is per step)."""
    if _peak_reported:
        return None
    _peak_reported.append(True)
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def compiled_memory(compiled) -> dict[str, float | None]:
    """XLA's memory analysis of a compiled step, in GiB: temporaries, and the estimated peak
    (arguments + outputs - donated aliases + temporaries)."""
    analysis = compiled.memory_analysis()
    if analysis is None:
        return {"xla_temp_gib": None, "xla_peak_gib": None}
    peak = (analysis.argument_size_in_bytes + analysis.output_size_in_bytes - analysis.alias_size_in_bytes
            + analysis.temp_size_in_bytes)
    return {"xla_temp_gib": round(analysis.temp_size_in_bytes / 2**30, 3), "xla_peak_gib": round(peak / 2**30, 3)}


def _row(args, cfg, stack, method, compile_s, step_s, reference_s, memory, segments):
    """A table row; FLOPs as model/flops.py counts the batch's `segments` (the HDPO reference's forward
    pass included: it is timed and added)."""
    tokens = segment_tokens(segments)
    flops = step_flops(cfg, segments, reference_forward=method == "hdpo")
    row = {"stack": stack, "method": method, "compile_s": round(compile_s, 2), "tokens": tokens, **memory}
    if step_s is None:  # --compile-only
        return {**row, "step_s": None, "reference_s": None, "tokens_per_s": None, "tflops_per_s": None, "mfu": None,
                "mfu_vs_matmul": None, "peak_memory_gib": None}
    total_s = step_s + reference_s
    peak, rate = _peak_memory(), flops / total_s / 1e12
    return {**row, "step_s": round(total_s, 6), "reference_s": round(reference_s, 6),
            "tokens_per_s": round(tokens / total_s, 1), "tflops_per_s": round(rate, 3),
            "mfu": round(rate / args.peak, 3) if args.peak else None,
            "mfu_vs_matmul": round(rate / args.matmul_tflops, 3) if args.matmul_tflops else None,
            "peak_memory_gib": round(peak / 2**30, 2) if peak else None}


def _reference_seconds(args, cfg, batch) -> float:
    """The frozen reference's forward over the same pairs (HDPO precomputes these per batch)."""
    graphdef, state = nnx.split(create_model(cfg))
    reference = jax.jit(lambda s, b: sequence_logps(nnx.merge(graphdef, s), b)[:2])
    micro = jax.tree.map(lambda x: jnp.asarray(x[0]), batch)
    return _time(lambda: reference(state, micro), args.steps)[1]


def _batch(rng, args, cfg, method):
    make = _sft_batch if method == "sft" else _pair_batch
    return make(rng, 1, args.batch, args.seq, cfg.vocab_size)


def bench_polyalign(args, cfg, method: str) -> dict:
    rng = np.random.default_rng(0)
    if args.packed:
        make = _packed_sft_batch if method == "sft" else _packed_pair_batch
        batch = make(rng, args.batch, args.seq, cfg.vocab_size)
    else:
        batch = _batch(rng, args, cfg, method)
    stack = "polyalign (JAX) packed" if args.packed else "polyalign (JAX)"
    segments = batch_segments(batch)
    objective = SftObjective(1) if method == "sft" else PreferenceObjective(PreferenceConfig(init="bench"), 1)
    model = abstract_model(cfg) if args.compile_only else create_model(cfg)  # compile-only allocates nothing
    trainer = Trainer(model, objective, OptimizerConfig(lr=1e-5),
                      LoopConfig(steps=1000, global_batch=args.batch), parallel.make_mesh())
    started = time.perf_counter()
    memory = compiled_memory(trainer.compiled_step(batch))
    compile_s = time.perf_counter() - started
    if args.compile_only:
        return _row(args, cfg, stack, method, compile_s, None, None, memory, segments)
    step_s = _time(lambda: trainer.step(batch)["loss"], args.steps)[1]
    reference_s = _reference_seconds(args, cfg, batch) if method == "hdpo" else 0.0
    return _row(args, cfg, stack, method, compile_s, step_s, reference_s, memory, segments)


def bench_plain(args, cfg, method: str) -> dict:
    """A plain JAX step of the same model: full logits, the plain loss, optax AdamW, donated state."""
    import dataclasses

    cfg = dataclasses.replace(cfg, logprob_chunk=0)
    batch = jax.tree.map(lambda x: jnp.asarray(x[0]), _batch(np.random.default_rng(0), args, cfg, method))
    graphdef, params = nnx.split(abstract_model(cfg) if args.compile_only else create_model(cfg))
    tx = optax.adamw(1e-5)
    opt_state = jax.eval_shape(tx.init, params) if args.compile_only else tx.init(params)

    def loss_fn(params, batch):
        model = nnx.merge(graphdef, params)
        if method == "sft":
            logps = token_log_probs(model(batch["input_ids"]), batch["targets"])
            return -(logps * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
        chosen, rejected, _ = sequence_logps(model, batch)
        return dpo_loss(chosen, rejected, batch["ref_chosen"], batch["ref_rejected"]).mean()

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    started = time.perf_counter()
    memory = compiled_memory(step.lower(params, opt_state, batch).compile())
    compile_s = time.perf_counter() - started
    if args.compile_only:
        return _row(args, cfg, "plain JAX", method, compile_s, None, None, memory, batch_segments(batch))
    carry = [params, opt_state]

    def run():
        carry[0], carry[1], loss = step(carry[0], carry[1], batch)
        return loss

    step_s = _time(run, args.steps)[1]
    reference_s = _reference_seconds(args, cfg, _batch(np.random.default_rng(0), args, cfg, method)) \
        if method == "hdpo" else 0.0
    return _row(args, cfg, "plain JAX", method, compile_s, step_s, reference_s, memory, batch_segments(batch))


def bench_peer(args, cfg, method: str) -> dict | None:
    """The same step in PyTorch + transformers: eager, sdpa, float32 master weights with bfloat16
    autocast on GPU (float32 on CPU)."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    from polyalign.model.architecture import to_hf_config

    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf_config = transformers.AutoConfig.for_model(**{k: v for k, v in to_hf_config(cfg).items()
                                                      if k not in ("architectures", "torch_dtype")})
    hf_config._attn_implementation = "eager" if cfg.is_gemma else "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(hf_config).to(device)
    reference = transformers.AutoModelForCausalLM.from_config(hf_config).to(device).eval() if method == "hdpo" else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    sequences = args.batch * (2 if method == "hdpo" else 1)
    ids = torch.randint(0, cfg.vocab_size, (sequences, args.seq + 1), device=device)
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda" and args.dtype == "bfloat16")

    def logps(m, inputs, targets):
        logits = m(input_ids=inputs).logits.float()
        return torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0].sum(-1)

    def step():
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            if method == "sft":
                loss = torch.nn.functional.cross_entropy(model(input_ids=ids[:, :-1]).logits.float().flatten(0, 1),
                                                         ids[:, 1:].flatten())
            else:
                with torch.no_grad():
                    ref = logps(reference, ids[:, :-1], ids[:, 1:])
                pol = logps(model, ids[:, :-1], ids[:, 1:])
                half = args.batch
                loss = -torch.nn.functional.logsigmoid(0.1 * ((pol[:half] - ref[:half])
                                                              - (pol[half:] - ref[half:]))).mean()
        loss.backward()
        optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize()

    started = time.perf_counter()
    step()
    compile_s = time.perf_counter() - started
    times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    step_s = statistics.median(times)
    tokens = sequences * args.seq
    flops = step_flops(cfg, [args.seq] * sequences, reference_forward=method == "hdpo")
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    return {"stack": "PyTorch + transformers", "method": method, "compile_s": round(compile_s, 2),
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
            "transformers": transformers.__version__,
            "step_s": round(step_s, 6), "reference_s": None, "tokens": tokens,
            "tokens_per_s": round(tokens / step_s, 1),
            "tflops_per_s": round(flops / step_s / 1e12, 3),
            "mfu": round(flops / step_s / (args.peak * 1e12), 3) if args.peak else None,
            "mfu_vs_matmul": round(flops / step_s / (args.matmul_tflops * 1e12), 3) if args.matmul_tflops else None,
            "peak_memory_gib": round(peak, 2) if peak else None, "xla_temp_gib": None, "xla_peak_gib": None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", type=preset_or_file,
                        help="a preset name or an architecture YAML file (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=4, help="sequences (SFT) or pairs (HDPO) per step")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--method", choices=("sft", "hdpo", "both"), default="both")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="compute dtype")
    parser.add_argument("--remat", choices=("none", "full", "dots"), default="none")
    parser.add_argument("--attention", choices=("xla", "cudnn"), help="jax.nn.dot_product_attention implementation")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--peak-tflops", type=float,
                        help="the device's peak for MFU (default: the device kind's datasheet bf16 peak, none on CPU)")
    parser.add_argument("--no-peer", action="store_true", help="skip the PyTorch + transformers peer")
    parser.add_argument("--vocab-size", type=int, help="override the preset's vocabulary (small CPU runs)")
    parser.add_argument("--logprob-chunk", type=int, default=0,
                        help="log-probs in sequence blocks of this size, never full [B, T, V] logits (0: full)")
    parser.add_argument("--no-plain", action="store_true", help="skip the plain JAX step")
    parser.add_argument("--packed", action="store_true",
                        help="polyalign's step on packed rows: 4 SFT examples per row, 2 preference pairs per row "
                             "as trees (the prompt once); the stack is reported as 'polyalign (JAX) packed'")
    parser.add_argument("--stacks", default="polyalign,plain,peer",
                        help="which stacks to time, comma-separated (on one GPU, run the peer in a process of its "
                             "own with JAX_PLATFORMS=cpu: JAX reserves most of the GPU's memory for itself)")
    parser.add_argument("--compile-only", action="store_true",
                        help="compile and report XLA's memory analysis only (implies --no-peer)")
    args = parser.parse_args()
    args.peak = datasheet_peak(args)
    args.matmul_tflops = None if args.compile_only else matmul_tflops(args.dtype)

    overrides = {"dtype": args.dtype, "remat": args.remat, "attention_impl": args.attention,
                 "logprob_chunk": args.logprob_chunk}
    if args.vocab_size:
        overrides["vocab_size"] = args.vocab_size
    cfg = preset(args.preset, **overrides)
    methods = ["sft", "hdpo"] if args.method == "both" else [args.method]
    stacks = set(args.stacks.split(","))
    unknown = stacks - {"polyalign", "plain", "peer"}
    if unknown:
        parser.error(f"--stacks: unknown {', '.join(sorted(unknown))} (polyalign, plain, peer)")
    rows = []
    for method in methods:
        if "polyalign" in stacks:
            rows.append(bench_polyalign(args, cfg, method))
        if not args.no_plain and "plain" in stacks:
            rows.append(bench_plain(args, cfg, method))
        if not args.no_peer and not args.compile_only and "peer" in stacks:
            peer = bench_peer(args, cfg, method)
            if peer:
                rows.append(peer)
    print(f"{args.preset}: {cfg.num_parameters() / 1e6:,.1f}M parameters, {matmul_parameters(cfg) / 1e6:,.1f}M in "
          f"matmuls; batch {args.batch} x seq {args.seq}, {args.dtype}, remat {args.remat}, "
          f"logprob chunk {args.logprob_chunk or 'off'}; "
          f"{jax.devices()[0].device_kind} (peak {args.peak or '-'} TFLOP/s; one {args.dtype} matmul "
          f"{'-' if args.matmul_tflops is None else f'{args.matmul_tflops:.3f}'} TFLOP/s)")
    print(f"{'stack':24s} {'method':6s} {'compile s':>9s} {'step s':>8s} {'tokens/s':>10s} {'TFLOP/s':>8s} "
          f"{'MFU':>5s} {'MFU/mm':>6s} {'peak GiB':>8s} {'XLA peak':>8s} {'XLA temp':>8s}")

    def cell(value, spec):
        return "-" if value is None else format(value, spec)

    for r in rows:
        print(f"{r['stack']:24s} {r['method']:6s} {r['compile_s']:9.2f} {cell(r['step_s'], '8.3f'):>8s} "
              f"{cell(r['tokens_per_s'], '10,.0f'):>10s} {cell(r['tflops_per_s'], '8.3f'):>8s} "
              f"{cell(r['mfu'], '.2f'):>5s} {cell(r['mfu_vs_matmul'], '.2f'):>6s} "
              f"{cell(r['peak_memory_gib'], '.1f'):>8s} {cell(r['xla_peak_gib'], '.3f'):>8s} "
              f"{cell(r['xla_temp_gib'], '.3f'):>8s}")
    for method in methods:
        ours = next((r for r in rows if r["stack"] == "polyalign (JAX)" and r["method"] == method), None)
        plain = next((r for r in rows if r["stack"] == "plain JAX" and r["method"] == method), None)
        if ours and plain and ours["step_s"] and plain["step_s"]:
            print(f"{method}: polyalign step / plain JAX step = {ours['step_s'] / plain['step_s']:.3f} (time)")
    result = {"preset": args.preset, "parameters": cfg.num_parameters(), "batch": args.batch, "seq": args.seq,
              "dtype": args.dtype, "remat": args.remat, "attention": args.attention,
              "logprob_chunk": args.logprob_chunk, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "peak_tflops": args.peak, "matmul_tflops": args.matmul_tflops, "rows": rows}
    write_result("train_step", result)


if __name__ == "__main__":
    main()
