"""Regenerates the test fixtures that need torch and transformers (development tools only; the tests
read the files this writes and import neither).

    pip install torch==2.13.0 transformers   # the local CPU build of torch; never an unpinned torch
    python tools/make_fixtures.py --chat-templates DIR

Writes, under tests/fixtures/:
  hf/{llama,qwen2,gemma2}/   a tiny random checkpoint (config.json + model.safetensors) that
                             transformers saved, and expected.safetensors: input ids, attention mask
                             and the float32 logits transformers computes for them.
  chat/fixtures.json         real records from the bundled demo data rendered by the official chat
                             templates through transformers' apply_chat_template.
  losses/trl_dpo.json        DPO, cDPO and IPO losses from TRL's formulas evaluated in torch.
  losses/trl_family.json     robust DPO, SimPO, ORPO, KTO and length-normalised DPO, likewise.

DIR holds the official templates, copied from each model's tokenizer_config.json ("chat_template"):
qwen.jinja (Qwen2.5 Instruct), llama3.jinja (Llama 3.2 Instruct) and gemma.jinja (Gemma 2 Instruct).
Without --chat-templates the chat fixtures are left as they are.

It also checks the other direction: each checkpoint goes through polyalign's loader and
save_hf_checkpoint, transformers loads the export, and the logits difference is printed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.numpy import save_file

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
SEED = 1234
BATCH, LENGTH, PADDED = 3, 40, 9  # the last row ends in PADDED padding tokens

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, initializer_range=0.1, max_position_embeddings=128, rms_norm_eps=1e-5)
MODELS = {
    # GQA, untied, Llama 3 RoPE scaling with a short original context so that all three frequency
    # bands (kept, interpolated, slowed) occur in 40 positions.
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        num_hidden_layers=2, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    # Tied embeddings and q/k/v biases.
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(
        num_hidden_layers=2, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    # Soft-capping low enough to bend the scores, a sliding window shorter than the sequence,
    # query_pre_attn_scalar unlike head_dim, and three layers: sliding, full, sliding.
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM, dict(
        num_hidden_layers=3, query_pre_attn_scalar=24, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
        sliding_window=8, attn_implementation="eager")),
}


def make_model(family: str):
    config_cls, model_cls, extra = MODELS[family]
    torch.manual_seed(SEED)
    model = model_cls(config_cls(**COMMON, **extra)).eval()
    # Norm weights and biases start at constants; perturb them so a wrong mapping shows in the logits.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
    return model


def inputs() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(SEED)
    ids = rng.integers(0, COMMON["vocab_size"], size=(BATCH, LENGTH)).astype(np.int32)
    mask = np.ones((BATCH, LENGTH), np.int32)
    mask[-1, -PADDED:] = 0
    return ids, mask


def hf_logits(model, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long())
    return out.logits.float().numpy()


def write_model_fixtures() -> None:
    from polyalign.model import load_hf_checkpoint, save_hf_checkpoint

    ids, mask = inputs()
    for family in MODELS:
        target = FIXTURES / "hf" / family
        model = make_model(family)
        model.save_pretrained(target, safe_serialization=True)
        logits = hf_logits(model, ids, mask)
        save_file({"input_ids": ids, "attention_mask": mask, "logits": logits}, target / "expected.safetensors")
        for stray in target.glob("generation_config.json"):
            stray.unlink()
        ours = load_hf_checkpoint(target)
        with tempfile.TemporaryDirectory() as tmp:
            save_hf_checkpoint(ours, Path(tmp) / "export")
            reloaded = transformers.AutoModelForCausalLM.from_pretrained(Path(tmp) / "export").eval()
            roundtrip = hf_logits(reloaded, ids, mask)
        real = mask.astype(bool)
        diff = np.abs(roundtrip - logits)[real].max()
        print(f"{family:7s} {sum(p.numel() for p in model.parameters()):>7} params  "
              f"max|logit| {np.abs(logits).max():.3f}  polyalign export -> transformers: max|dlogits| {diff:.2e}")


CHAT_CASES = [
    # (template, dataset, at least this many history turns, profile): real test records of the demo data
    ("qwen", "kdconv", 2, "oracle"),
    ("qwen", "polyalign_sample", 0, "none"),
    ("llama3", "camrest676", 2, "context"),
    ("llama3", "cmrc2018", 0, "oracle"),
    ("gemma", "crosswoz", 2, "context"),
    ("gemma", "lccc", 0, "none"),
    ("polyalign", "coig_cqia", 0, "context"),
    ("polyalign", "kdconv", 2, "oracle"),
]
SPECIAL = {"qwen": dict(eos_token="<|im_end|>"), "llama3": dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"),
           "gemma": dict(bos_token="<bos>", eos_token="<eos>")}


def official_render(template_text: str, name: str, messages: list[dict]) -> str:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")),
                                               **SPECIAL[name])
    if name == "gemma" and messages[0]["role"] == "system":
        # Gemma 2's template rejects system messages; polyalign opens the first user turn with it.
        system, first = messages[0], messages[1]
        messages = [{"role": "user", "content": f"{system['content']}\n\n{first['content']}"}, *messages[2:]]
    return tok.apply_chat_template(messages, tokenize=False, chat_template=template_text, date_string="26 Jul 2024")


def write_chat_fixtures(template_dir: Path) -> None:
    from polyalign.chat import get_template, record_messages
    from polyalign.data.prepare import prepare
    from polyalign.data.records import read_records

    with tempfile.TemporaryDirectory() as tmp:
        prepare(REPO / "configs" / "data" / "demo.yaml", Path(tmp), progress=False)
        records = list(read_records(Path(tmp) / "data" / "test.jsonl"))
    cases = []
    for name, dataset, min_history, profile in CHAT_CASES:
        record = next(r for r in records if r.dataset == dataset and r.response and len(r.history) >= min_history)
        messages = record_messages(record, profile)
        as_dicts = [{"role": m.role, "content": m.content} for m in messages]
        if name == "polyalign":
            expected = get_template(name).render(messages)  # polyalign's own template has no other source
        else:
            expected = official_render((template_dir / f"{name}.jinja").read_text(), name, as_dicts)
        as_json = record.to_json()
        as_json["meta"] = {"group": record.meta.get("group")}  # source paths would name this machine's folders
        cases.append({"template": name, "profile": profile, "record": as_json, "expected": expected})
        print(f"chat {name:9s} {dataset:16s} {len(messages)} messages, {len(expected)} chars")
    out = FIXTURES / "chat" / "fixtures.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(cases, ensure_ascii=False, indent=1) + "\n")


def write_loss_fixtures() -> None:
    """DPO, cDPO and IPO losses from TRL's formulas (trl.DPOTrainer.dpo_loss, loss_type sigmoid / ipo),
    evaluated in torch on fixed log-probs."""
    import torch.nn.functional as F

    rng = np.random.default_rng(SEED)
    logps = {name: (-rng.uniform(5, 60, 16)).round(3) for name in ("pc", "pr", "rc", "rr")}
    t = {k: torch.tensor(v, dtype=torch.float64) for k, v in logps.items()}
    logits = (t["pc"] - t["pr"]) - (t["rc"] - t["rr"])
    cases = []
    for beta, smoothing in [(0.1, 0.0), (0.5, 0.0), (0.1, 0.2)]:
        losses = -F.logsigmoid(beta * logits) * (1 - smoothing) - F.logsigmoid(-beta * logits) * smoothing
        cases.append({"loss_type": "sigmoid", "beta": beta, "label_smoothing": smoothing, "losses": losses.tolist()})
    for beta in (0.1, 0.5):
        cases.append({"loss_type": "ipo", "beta": beta, "losses": ((logits - 1 / (2 * beta)) ** 2).tolist()})
    out = FIXTURES / "losses" / "trl_dpo.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"logps": {k: v.tolist() for k, v in logps.items()}, "cases": cases}, indent=1) + "\n")
    print(f"losses: {len(cases)} TRL formula cases")
    write_loss_family_fixtures(logps)


def write_loss_family_fixtures(logps: dict[str, np.ndarray]) -> None:
    """Robust DPO, SimPO and ORPO as TRL computes them (DPOTrainer loss_type robust, CPOTrainer
    loss_type simpo, ORPOTrainer.odds_ratio_loss plus the chosen NLL), KTO's kto_loss, and DPO on
    length-normalised log-probs, evaluated in torch on the same log-probs with response lengths."""
    import torch.nn.functional as F

    rng = np.random.default_rng(SEED + 1)
    lengths = {"nc": rng.integers(5, 40, 16), "nr": rng.integers(5, 40, 16)}
    t = {k: torch.tensor(v, dtype=torch.float64) for k, v in {**logps, **lengths}.items()}
    logits = (t["pc"] - t["pr"]) - (t["rc"] - t["rr"])
    mean_c, mean_r = t["pc"] / t["nc"], t["pr"] / t["nr"]
    cases = []
    for beta, eps in [(0.1, 0.1), (0.5, 0.3)]:
        z = beta * logits
        losses = (-F.logsigmoid(z) * (1 - eps) + F.logsigmoid(-z) * eps) / (1 - 2 * eps)
        cases.append({"loss_type": "robust", "beta": beta, "label_smoothing": eps, "losses": losses.tolist()})
    for beta, gamma, eps in [(2.0, 0.5, 0.0), (2.5, 1.4, 0.1)]:
        z = beta * ((mean_c - mean_r) - gamma / beta)
        losses = -F.logsigmoid(z) * (1 - eps) - F.logsigmoid(-z) * eps
        cases.append({"loss_type": "simpo", "beta": beta, "simpo_gamma": gamma, "label_smoothing": eps,
                      "losses": losses.tolist()})
    for beta in (0.1, 1.0):
        log_odds = (mean_c - mean_r) - (torch.log1p(-torch.exp(mean_c)) - torch.log1p(-torch.exp(mean_r)))
        losses = -mean_c - beta * F.logsigmoid(log_odds)
        cases.append({"loss_type": "orpo", "beta": beta, "losses": losses.tolist()})
    for beta, kl, wd, wu in [(0.1, 0.0, 1.0, 1.0), (0.5, 0.8, 1.0, 1.33)]:
        chosen = 1 - torch.sigmoid(beta * ((t["pc"] - t["rc"]) - kl))
        rejected = 1 - torch.sigmoid(beta * (kl - (t["pr"] - t["rr"])))
        cases.append({"loss_type": "kto", "beta": beta, "kl": kl, "desirable_weight": wd, "undesirable_weight": wu,
                      "chosen_losses": (wd * chosen).tolist(), "rejected_losses": (wu * rejected).tolist()})
    for beta in (0.1, 1.0):
        ln_logits = (mean_c - t["rc"] / t["nc"]) - (mean_r - t["rr"] / t["nr"])
        cases.append({"loss_type": "ln_dpo", "beta": beta, "losses": (-F.logsigmoid(beta * ln_logits)).tolist()})
    out = FIXTURES / "losses" / "trl_family.json"
    out.write_text(json.dumps({"logps": {k: v.tolist() for k, v in {**logps, **lengths}.items()}, "cases": cases},
                              indent=1) + "\n")
    print(f"losses: {len(cases)} preference-family cases")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chat-templates", type=Path, help="directory with qwen.jinja, llama3.jinja, gemma.jinja")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    write_model_fixtures()
    write_loss_fixtures()
    if args.chat_templates:
        write_chat_fixtures(args.chat_templates)
    return 0


if __name__ == "__main__":
    sys.exit(main())
