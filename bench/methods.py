"""Training methods compared over seeds on the bundled demo data.

Uniform SFT, Bucket-SFT with the default weights, with METHOD's N / (K n_b) and with adaptive weights,
then from the default Bucket-SFT model: DPO, HDPO, SimPO with HDPO's terms, and HDPO with on-policy
rounds. Each seed changes the model's initialisation, the data order, the sampled pairs and the sampled
test answers. For every method: per-bucket and macro BNG and HCR, F1, validation loss and worst bucket
(SFT methods), detectability (a classifier's AUC telling the model's answers from people's, beside
its human floor), as mean and standard deviation over the seeds, in OUT/methods.json, OUT/methods.md and
OUT/methods.png.

    python bench/methods.py --out runs/methods --seeds 0 1 2
    python bench/methods.py --out /tmp/m --seeds 0 --quick      # minutes: tiny steps, small samples
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from polyalign.demo import DEMO_MAX_LENGTH, run_demo  # noqa: E402
from polyalign.train.methods import method_spec  # noqa: E402

SFT_CONFIG, PREFERENCE_CONFIG, CRITIC_CONFIG = (ROOT / "configs" / f"{n}.yaml" for n in ("sft_demo", "hdpo_demo",
                                                                                         "critic_demo"))
SFT_METHODS = {  # name -> (build, overrides)
    "sft": ("default", ["weighting=uniform"]),
    "bucket_sft": ("default", ["weighting=bucket"]),
    "bucket_sft_method_weights": ("method", ["weighting=bucket"]),
    "bucket_sft_adaptive": ("default", ["weighting=adaptive"]),
}
PREFERENCE_METHODS = {  # name -> overrides, all from the default Bucket-SFT model
    "dpo": ["method=dpo"],
    "hdpo": ["method=hdpo"],
    "simpo_hdpo_terms": ["method=simpo", "hdpo_terms=true", "beta=2.0"],
    "hdpo_3_rounds": ["method=hdpo", "rounds=3"],
}
# Each variant trains a method of the one table (polyalign/train/methods.py); a name it lacks fails here.
for _overrides in PREFERENCE_METHODS.values():
    method_spec(next(o.split("=", 1)[1] for o in _overrides if o.startswith("method=")), "bench/methods.py")
SIZES = {False: {"sft_steps": 120, "preference_steps": 40, "pairs": (256, 64), "test": 256, "new_tokens": 64},
         True: {"sft_steps": 6, "preference_steps": 2, "pairs": (24, 12), "test": 24, "new_tokens": 12}}


def shared_runs(out: Path, quick: bool) -> dict[str, Path]:
    """The prepared, tokenised demo data, built once with the default weights and once with METHOD's."""
    from polyalign.inputs.build import build
    from polyalign.inputs.built import BuildOptions

    run = out / "run"
    if not (run / "build" / "manifest.json").is_file():
        run_demo(run, ["prepare", "stats", "tokenizer", "build"], quick=quick)
    method = out / "run_method_weights"
    if not (method / "build" / "manifest.json").is_file():
        method.mkdir(parents=True, exist_ok=True)
        for part in ("data", "stats", "tokenizer"):
            if not (method / part).exists():
                (method / part).symlink_to(run / part, target_is_directory=True)
        build(method, BuildOptions(max_length=DEMO_MAX_LENGTH, weights={"preset": "method"}), progress=False)
    return {"default": run, "method": method}


def evaluate_model(model: Path | None, run: Path, out: Path, seed: int, sizes: dict) -> dict:
    """Test answers sampled from the model (kept ones reused when `model` is None), evaluated against
    the train split's human support."""
    from polyalign.evaluate.run import EvaluateOptions, evaluate
    from polyalign.generate.run import GenerateOptions, SamplingConfig, generate_predictions

    predictions = out / "test_predictions.jsonl"
    if model is not None:
        generate_predictions(model, run / "data" / "test.jsonl", predictions,
                             GenerateOptions(sampling=SamplingConfig(sizes["new_tokens"], 0.8, 0.9), seed=seed,
                                             sample=sizes["test"]), progress=False)
    result = evaluate(run / "data" / "test.jsonl", predictions, out / "eval",
                      EvaluateOptions(allow_partial=True, references=run / "stats" / "references.json",
                                      support=run / "data" / "train.jsonl", diversity=False), overwrite=True)
    m = result["metrics"]
    return {"bng": m["bng"]["overall_macro"], "bng_floor": m["bng"]["floor_macro"], "bng_gap": m["bng"]["gap_macro"],
            "hcr": m["hcr"]["overall_macro"], "hcr_floor": m["hcr"]["floor_macro"],
            "f1": m["utility"]["overall"]["qa_f1"], "bng_by_bucket": m["bng"]["by_bucket"],
            "bng_gap_by_bucket": m["bng"]["gap_by_bucket"],
            "detectability": m["detectability"]["overall_macro"],
            "detectability_floor": m["detectability"]["floor_macro"],
            "detectability_by_bucket": m["detectability"]["by_bucket"],
            "baselines": {name: {"bng": row["bng_macro"], "hcr": row["hcr_macro"], "f1": row.get("f1"),
                                 "detectability": row.get("detectability_macro")}
                          for name, row in m["reference_rows"].items()}}


def reevaluate(seed_dir: Path, runs: dict[str, Path], sizes: dict) -> dict[str, dict]:
    """A finished seed's kept test answers evaluated again (after a change to the evaluation)."""
    results = json.loads((seed_dir / "results.json").read_text())
    seed = int(seed_dir.name.split("-")[1])
    for name, entry in results.items():
        entry.update(evaluate_model(None, runs["default"], seed_dir / name, seed, sizes))
    return results


def run_seed(seed: int, runs: dict[str, Path], out: Path, sizes: dict, methods: list[str]) -> dict[str, dict]:
    from polyalign.generate.run import GenerateOptions, SamplingConfig, generate_predictions
    from polyalign.pairs.make import make_pairs
    from polyalign.train.methods import load_config
    from polyalign.train.run import train

    seeded = [f"model.seed={seed}", f"train.seed={seed}"]
    results = {}
    for name, (build_name, overrides) in SFT_METHODS.items():
        if name not in methods and not (name == "bucket_sft" and set(methods) & set(PREFERENCE_METHODS)):
            continue
        directory = out / name
        config = load_config(SFT_CONFIG, [f"data.dir={runs[build_name]}", *overrides, *seeded,
                                          f"train.steps={sizes['sft_steps']}"], method="sft")
        last = train(config, directory, progress=False)["last"]
        results[name] = {"val_loss": last["val_loss"], "val_worst_bucket": last["val_worst_bucket"],
                         **evaluate_model(directory / "model", runs["default"], directory, seed, sizes)}
    if not set(methods) & set(PREFERENCE_METHODS):
        return results
    policy, run = out / "bucket_sft" / "model", runs["default"]
    for split, count in zip(("train", "val"), sizes["pairs"]):
        predictions = out / "pairs" / f"{split}_predictions.jsonl"
        generate_predictions(policy, run / "data" / f"{split}.jsonl", predictions,
                             GenerateOptions(sampling=SamplingConfig(sizes["new_tokens"], 0.8, 0.9), seed=seed,
                                             sample=count), progress=False)
        make_pairs(run / "data" / f"{split}.jsonl", predictions, out / "pairs" / f"{split}.jsonl")
    critic = load_config(CRITIC_CONFIG, [f"data.dir={run}", f"init={policy}", f"pairs={out / 'pairs' / 'train.jsonl'}",
                                         f"val_pairs={out / 'pairs' / 'val.jsonl'}", *seeded], method="critic")
    train(critic, out / "critic", progress=False)
    for name, overrides in PREFERENCE_METHODS.items():
        if name not in methods:
            continue
        directory = out / name
        config = load_config(PREFERENCE_CONFIG, [f"data.dir={run}", f"init={policy}", *overrides, f"train.seed={seed}",
                                                 f"pairs={out / 'critic' / 'train_pairs.jsonl'}",
                                                 f"val_pairs={out / 'critic' / 'val_pairs.jsonl'}",
                                                 f"train.steps={sizes['preference_steps']}",
                                                 f"on_policy.max_new_tokens={sizes['new_tokens']}"])
        result = train(config, directory, progress=False)
        results[name] = evaluate_model(Path(result["model"]), run, directory, seed, sizes)
    return results


def aggregate(per_seed: dict[int, dict[str, dict]]) -> dict[str, dict]:
    """Mean and standard deviation over seeds of every number, per method (per bucket for BNG)."""
    summary: dict[str, dict] = {}
    methods = sorted({m for results in per_seed.values() for m in results})
    for method in methods:
        runs = [results[method] for results in per_seed.values() if method in results]
        entry: dict = {"seeds": len(runs)}
        for key in ("val_loss", "val_worst_bucket", "bng", "bng_floor", "bng_gap", "hcr", "hcr_floor", "f1",
                    "detectability", "detectability_floor"):
            values = [r[key] for r in runs if r.get(key) is not None]
            if values:
                entry[key] = {"mean": round(float(np.mean(values)), 4), "std": round(float(np.std(values)), 4)}
        for key in ("bng_by_bucket", "bng_gap_by_bucket", "detectability_by_bucket"):
            buckets = sorted({b for r in runs for b in r.get(key, {})})
            entry[key] = {b: round(float(np.mean([r[key][b] for r in runs if b in r.get(key, {})])), 4)
                          for b in buckets}
        summary[method] = entry
    # people and the no-model answers, measured the same way on each seed's test sample
    rows = [next((r["baselines"] for r in results.values() if "baselines" in r), None) for results in per_seed.values()]
    rows = [row for row in rows if row]
    for name in (rows[0] if rows else {}):
        entry = {"seeds": len(rows)}
        for key in ("bng", "hcr", "f1", "detectability"):
            values = [row[name][key] for row in rows if row[name].get(key) is not None]
            if values:
                entry[key] = {"mean": round(float(np.mean(values)), 4), "std": round(float(np.std(values)), 4)}
        summary[f"({name})"] = entry
    return summary


def table(summary: dict[str, dict]) -> str:
    def cell(entry, key):
        return f"{entry[key]['mean']:.3f} ± {entry[key]['std']:.3f}" if key in entry else "-"

    def with_floor(entry, key):
        return cell(entry, key) + (f" ({entry[key + '_floor']['mean']:.2f})" if key + "_floor" in entry else "")

    lines = ["| method | seeds | BNG macro (lower = closer to people) | BNG - human floor | HCR macro (human floor) "
             "| detectability AUC (human floor; 0.5 = as people) | F1 | val loss | worst bucket |",
             "|---|---|---|---|---|---|---|---|---|"]
    for method, entry in summary.items():
        lines.append(f"| {method} | {entry['seeds']} | {cell(entry, 'bng')} | {cell(entry, 'bng_gap')} | "
                     f"{with_floor(entry, 'hcr')} | {with_floor(entry, 'detectability')} | "
                     + " | ".join(cell(entry, k) for k in ("f1", "val_loss", "val_worst_bucket")) + " |")
    return "\n".join(lines) + "\n"


def plot(summary: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    for ax, key, title in ((axes[0], "bng", "BNG macro (lower is closer to people)"),
                           (axes[1], "hcr", "HCR macro (higher is more human-like)"),
                           (axes[2], "detectability", "detectability AUC (0.5: as people)")):
        names = [m for m in summary if key in summary[m]]
        ax.bar(range(len(names)), [summary[m][key]["mean"] for m in names],
               yerr=[summary[m][key]["std"] for m in names], capsize=3)
        ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
        ax.set_title(title, fontsize=9)
    fig.suptitle(f"mean ± std over {max(e['seeds'] for e in summary.values())} seeds", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="output folder (finished seeds are kept)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=[*SFT_METHODS, *PREFERENCE_METHODS],
                        choices=[*SFT_METHODS, *PREFERENCE_METHODS])
    parser.add_argument("--quick", action="store_true", help="tiny steps and samples: checks that it runs")
    parser.add_argument("--reevaluate", action="store_true",
                        help="evaluate finished seeds' kept test answers again (after a change to the evaluation)")
    args = parser.parse_args()
    sizes = SIZES[args.quick]
    started = time.perf_counter()
    runs = shared_runs(args.out, args.quick)
    per_seed = {}
    for seed in args.seeds:
        done = args.out / f"seed-{seed}" / "results.json"
        if done.is_file() and args.reevaluate:
            done.write_text(json.dumps(reevaluate(done.parent, runs, sizes), indent=1) + "\n")
        if not done.is_file():
            results = run_seed(seed, runs, args.out / f"seed-{seed}", sizes, args.methods)
            done.write_text(json.dumps(results, indent=1) + "\n")
        per_seed[seed] = json.loads(done.read_text())
        print(f"seed {seed} done ({time.perf_counter() - started:.0f} s)", flush=True)
    summary = aggregate(per_seed)
    (args.out / "methods.json").write_text(json.dumps({"sizes": sizes, "seeds": args.seeds, "methods": summary},
                                                      indent=1) + "\n")
    (args.out / "methods.md").write_text(table(summary))
    plot(summary, args.out / "methods.png")
    print(table(summary), end="")
    print(f"{args.out / 'methods.md'}, {args.out / 'methods.png'} ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
