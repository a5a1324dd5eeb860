"""How far a quantised base (model.quantize: nf4, int8) is from the checkpoint it came from, on real
text: the logits difference, the per-token KL divergence and the change in NLL of held-out records.

    python bench/quantize_drift.py --checkpoint RUN/bucket_sft/model --records RUN/data/test.jsonl

Prints a table; writes JSON to $OUT/quantize_drift.json when OUT is set.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from result_file import write_result  # noqa: E402

from polyalign.data.records import read_records  # noqa: E402
from polyalign.model import load_hf_checkpoint  # noqa: E402
from polyalign.model.lora import quantize_base  # noqa: E402
from polyalign.model.quantize import bits_per_weight  # noqa: E402
from polyalign.tokens.chat import choose_template, encode_conversation, get_template, record_messages  # noqa: E402
from polyalign.tokens.tokenizer import load_tokenizer  # noqa: E402


def encoded_batch(checkpoint: Path, records: Path, limit: int, length: int):
    tokenizer = load_tokenizer(checkpoint)
    base = load_hf_checkpoint(checkpoint)
    template = get_template(choose_template(tokenizer, family=base.config.family, where=str(checkpoint)), tokenizer)
    rows = [encode_conversation(template, tokenizer, record_messages(r, "context"), cutoff=length + 1)
            for r in read_records(records)[:limit]]
    ids = np.full((len(rows), length + 1), tokenizer.pad_id, np.int32)
    mask = np.zeros((len(rows), length), bool)
    for i, row in enumerate(rows):
        ids[i, :len(row.ids)] = row.ids
        mask[i, :len(row.ids) - 1] = True  # every real next token, prompt included
    return base, jnp.asarray(ids), mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--records", type=Path, required=True)
    parser.add_argument("--limit", type=int, default=64)
    parser.add_argument("--length", type=int, default=128)
    args = parser.parse_args()
    base, ids, mask = encoded_batch(args.checkpoint, args.records, args.limit, args.length)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    reference = jax.nn.log_softmax(base(inputs), -1)
    scale = float(np.abs(np.asarray(reference))[mask].max())
    ref_nll = float(-np.take_along_axis(np.asarray(reference), np.asarray(targets)[..., None], -1)[..., 0][mask].mean())
    print(f"{args.checkpoint}: {mask.sum():,} tokens of {len(mask)} records; base NLL {ref_nll:.4f}")
    print(f"{'storage':8} {'bits':>5} {'max |dlogp|':>12} {'mean KL':>10} {'NLL':>8} {'dNLL':>8}")
    rows = []
    for kind in ("nf4", "int8"):
        quantised = jax.nn.log_softmax(quantize_base(base, kind)(inputs), -1)
        diff = np.abs(np.asarray(quantised - reference))[mask].max()
        kl = float((jnp.exp(reference) * (reference - quantised)).sum(-1)[mask].mean())
        nll = float(-np.take_along_axis(np.asarray(quantised), np.asarray(targets)[..., None], -1)[..., 0][mask].mean())
        rows.append({"kind": kind, "bits_per_weight": bits_per_weight(kind), "max_abs_dlogp": float(diff),
                     "max_abs_logp": scale, "mean_kl": kl, "nll": nll, "base_nll": ref_nll})
        print(f"{kind:8} {bits_per_weight(kind):>5.2f} {diff:>12.4f} {kl:>10.2e} {nll:>8.4f} {nll - ref_nll:>+8.4f}")
    write_result("quantize_drift", {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows})


if __name__ == "__main__":
    main()
