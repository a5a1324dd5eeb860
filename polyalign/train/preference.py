"""HDPO, DPO and IPO on the shared trainer (METHOD section 8).

Chosen and rejected responses of a micro-batch go through one forward pass (stacked on the batch
axis). The reference policy is the initial checkpoint; its log-probabilities are computed once, before
training, and travel with the pairs. HDPO's three terms are normalised over the global batch:
sum w l / sum w (pair weights), lambda_dist * mean R and gamma_ftx * mean anchor (pair counts).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from polyalign.core.outputs import same_path
from polyalign.core.paths import file_digest, is_uri
from polyalign.core.progress import progress_bar
from polyalign.core.wording import counted
from polyalign.core.yaml_config import ConfigError
from polyalign.data.records import Record
from polyalign.inputs import pipeline
from polyalign.inputs.built import built_manifest
from polyalign.inputs.pair_rows import (
    PAIR_FIELDS,
    is_packed,
    ordered_pair_rows,
    pair_arrays,
    pair_packing_note,
    tokenise_pairs,
    train_pair_batches,
)
from polyalign.model import export
from polyalign.model.architecture import longer_than_positions
from polyalign.model.flops import flops_per_token
from polyalign.model.hf import checkpoint_tokenizer
from polyalign.model.lora import base_model
from polyalign.model.tokenizer_check import (
    PROBE_CHARS,
    PROBE_RECORDS,
    check_export,
    check_folder,
    probe_texts,
    spread_records,
)
from polyalign.pairs.make import read_pairs
from polyalign.tokens.chat import choose_template, get_template, profile_prompt
from polyalign.tokens.profile_template import (
    PROFILE_COMBINATIONS,
    PROFILE_FIELDS,
    SYSTEM_LOST_WHY,
    seen_profile_values,
)
from polyalign.tokens.tokenizer import past_trained_note
from polyalign.train import losses
from polyalign.train.config import LoopConfig, PreferenceConfig, val_pairs_hint
from polyalign.train.drift import DriftProbe, load_references
from polyalign.train.methods import method_spec, require
from polyalign.train.run import Job, load_init, steps_phrase, steps_run
from polyalign.train.trainer import Trainer


def sequence_logps(model, batch, dropout_key=None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Summed response log-probs of chosen and rejected, and the chosen token counts, from one
    forward pass over both sides: [B] for row pairs (chosen and rejected stacked on the batch axis),
    [B, slots] for rows of tree-packed pairs (the two layouts of inputs/pair_rows.py). `dropout_key`: a
    training step's (adapter dropout)."""
    if is_packed(batch):
        return _packed_sequence_logps(model, batch, dropout_key)
    inputs = jnp.concatenate([batch["chosen_inputs"], batch["rejected_inputs"]])
    targets = jnp.concatenate([batch["chosen_targets"], batch["rejected_targets"]])
    mask = jnp.concatenate([batch["chosen_mask"], batch["rejected_mask"]])
    logps = (model.token_log_probs(inputs, targets, dropout_key=dropout_key) * mask).sum(-1)
    half = batch["chosen_inputs"].shape[0]
    return logps[:half], logps[half:], batch["chosen_mask"].sum(-1)


def _per_pair(batch, values: jax.Array) -> jax.Array:
    """Per-position values of packed rows summed per pair: [rows, slots]."""
    rows, slots = batch["valid"].shape
    # each position's pair, numbered across the micro-batch; padding (segment 0) carries zero masks
    pair = (jnp.maximum(batch["segment_ids"] - 1, 0) + slots * jnp.arange(rows)[:, None]).reshape(-1)
    return jax.ops.segment_sum(values.reshape(-1), pair, rows * slots).reshape(rows, slots)


def _packed_sequence_logps(model, batch, dropout_key=None) -> tuple[jax.Array, jax.Array, jax.Array]:
    logps = model.token_log_probs(batch["input_ids"], batch["targets"], positions=batch["positions"],
                                  segment_ids=batch["segment_ids"], branch_ids=batch["branch_ids"],
                                  dropout_key=dropout_key)
    return (_per_pair(batch, logps * batch["chosen_mask"]), _per_pair(batch, logps * batch["rejected_mask"]),
            _per_pair(batch, batch["chosen_mask"]))


def response_lengths(batch) -> tuple[jax.Array, jax.Array]:
    """Labelled tokens of the chosen and the rejected response of each pair, shaped as sequence_logps."""
    if is_packed(batch):
        return _per_pair(batch, batch["chosen_mask"]), _per_pair(batch, batch["rejected_mask"])
    return batch["chosen_mask"].sum(-1), batch["rejected_mask"].sum(-1)


def reference_logps(model, examples: list[dict], length: int, pad_id: int, batch_size: int = 8,
                    progress: bool = True, mesh=None, pack: bool = False, desc: str = "reference log-probs") -> None:
    """Adds ref_chosen / ref_rejected (the frozen initial policy's log-probs) to every example, from
    batches of `batch_size` row pairs, or with `pack` of `batch_size` packed rows (as training packs
    them; the values are the same). With a `mesh` (the model sharded over it), every process gets
    every value."""
    graphdef, state = nnx.split(model)
    replicated = None if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    run = jax.jit(lambda state, batch: sequence_logps(nnx.merge(graphdef, state), batch)[:2], out_shardings=replicated)
    rows, arrays_of = ordered_pair_rows(examples, length, pad_id, pack)
    # every process computes every value; one bar says how far they are
    for start in progress_bar(range(0, len(rows), batch_size), progress=progress and jax.process_index() == 0,
                              desc=desc, unit="batch"):
        chunk = rows[start:start + batch_size]
        arrays = [arrays_of(row) for row in chunk] + [arrays_of(None)] * (batch_size - len(chunk))
        batch = {k: np.stack([a[k] for a in arrays]) for k in arrays[0]}
        chosen, rejected = (np.asarray(x).reshape(batch_size, -1) for x in jax.device_get(run(state, batch)))
        for r, row in enumerate(chunk):
            for slot, i in enumerate(row):
                examples[i]["ref_chosen"], examples[i]["ref_rejected"] = (float(chosen[r, slot]),
                                                                          float(rejected[r, slot]))


class PreferenceObjective:
    """A preference loss (HDPO, DPO, IPO, robust DPO, length-normalised DPO, SimPO, ORPO, KTO) for the
    trainer. HDPO is DPO with pair weights, the critic distance term (lambda_dist) and the SFT anchor
    (gamma_ftx); `hdpo_terms: true` adds the same three to any other loss. Metric sums include rewards
    and per-bucket margins."""

    def __init__(self, config: PreferenceConfig, num_buckets: int):
        self.config, self.num_buckets = config, num_buckets
        self.spec = method_spec(config.method)
        self.hdpo_terms = adds_hdpo_terms(config)
        extra = {"dist": config.lambda_dist, "anchor": config.gamma_ftx} if self.hdpo_terms else {}
        self.coefficients = {"dpo": 1.0, **extra}

    def _weights(self, batch):
        weights = batch["weight"] if self.hdpo_terms else jnp.ones_like(batch["weight"])
        return jnp.where(batch["valid"], weights, 0.0)

    def pair_losses(self, logps: losses.PairLogps) -> jax.Array:
        """The method's loss of each pair, by the function its entry in the method table names."""
        return getattr(losses, self.spec.pair_loss)(logps, self.config)

    def denominators(self, batch):
        def global_sum(x):  # [micro_batches, rows, (slots)] -> the total, once per micro-batch
            return jnp.broadcast_to(x.sum(), x.shape[:1])

        count = global_sum(batch["valid"].astype(jnp.float32))
        return {"dpo": global_sum(self._weights(batch)), "dist": count, "anchor": count}

    def numerators(self, model, mb, key=None):
        c = self.config
        packed = is_packed(mb)
        pc, pr, n_chosen = (x.reshape(-1) for x in sequence_logps(model, mb, key))
        if c.reference == "in_step" and self.spec.needs_reference:
            ref_chosen, ref_rejected, _ = jax.lax.stop_gradient(sequence_logps(base_model(model), mb))
            mb = {**mb, "ref_chosen": ref_chosen, "ref_rejected": ref_rejected}
        n_rejected = response_lengths(mb)[1].reshape(-1)
        tokens = mb["chosen_mask"].sum() + mb["rejected_mask"].sum()
        # every real token the forward pass runs (prompts included; a packed row's shared prefix once)
        processed = mb["length"].sum() if packed else mb["chosen_length"].sum() + mb["rejected_length"].sum()
        mb = {key: mb[key].reshape(-1) for key in PAIR_FIELDS}  # one entry per pair (packed: per slot)
        rc, rr = mb["ref_chosen"], mb["ref_rejected"]
        valid = mb["valid"].astype(jnp.float32)
        per_pair = self.pair_losses(losses.PairLogps(pc, pr, rc, rr, n_chosen, n_rejected))
        numerators = {"dpo": (self._weights(mb) * per_pair).sum()}
        dist = losses.distance_regulariser(pc, pr, mb["critic_chosen"], mb["critic_rejected"], c.beta) * valid
        anchor = losses.sft_anchor(pc, n_chosen) * valid
        if self.hdpo_terms:
            numerators.update(dist=dist.sum(), anchor=anchor.sum())
        if self.spec.needs_reference:
            rewards = losses.preference_rewards(pc, pr, rc, rr, c.beta)
        else:  # SimPO, ORPO: no reference; their reward is beta times the mean log-prob per token (as TRL logs it)
            rewards = losses.preference_rewards(pc / jnp.maximum(n_chosen, 1.0), pr / jnp.maximum(n_rejected, 1.0),
                                                0.0, 0.0, c.beta)
        sums = {f"rewards_{k}": (v * valid).sum() for k, v in rewards.items()}
        # the method's own loss term, weighted as the step weighs it: validation reports the objective from it
        sums.update(loss_weighted=numerators["dpo"], loss_weight=self._weights(mb).sum())
        sums.update(pairs=valid.sum(), tokens=tokens, processed_tokens=processed.astype(jnp.float32),
                    dist_reg=dist.sum(), sft_anchor=anchor.sum(),
                    dist_gap=((mb["critic_rejected"] - mb["critic_chosen"]) * valid).sum(),
                    dist_reach=(losses.distance_reach(pc, pr, c.beta) * valid).sum(),
                    bucket_margin=jax.ops.segment_sum(rewards["margin"] * valid, mb["bucket"], self.num_buckets),
                    bucket_pairs=jax.ops.segment_sum(valid, mb["bucket"], self.num_buckets))
        return numerators, sums


def summarize(host: dict[str, np.ndarray], buckets: list[str], prefix: str = "", scored: bool = True,
              coefficients: dict[str, float] | None = None) -> dict[str, Any]:
    """The logged means over the pairs. `scored`: the pairs carry the critic's scores; without them the
    critic's terms (dist_reg, dist_gap) read 0.0, which would look like a measurement, and are left out.
    `coefficients` (the objective's): `{prefix}loss` is the objective over these pairs, each term's weighted
    mean times its coefficient as the step computes it (validation; a step logs its own loss)."""
    n = max(float(host["pairs"]), 1.0)
    out = {f"{prefix}rewards/{k}": round(float(host[f"rewards_{k}"]) / n, 6)
           for k in ("chosen", "rejected", "margin", "accuracy")}
    if coefficients is not None and (scored or "dist" not in coefficients):
        means = {"dpo": float(host["loss_weighted"]) / max(float(host["loss_weight"]), 1e-12),
                 "dist": float(host["dist_reg"]) / n, "anchor": float(host["sft_anchor"]) / n}
        out[f"{prefix}loss"] = round(sum(c * means[k] for k, c in coefficients.items()), 6)
    critic = ("dist_reg", "dist_gap", "dist_reach") if scored else ()
    out.update({f"{prefix}pairs": int(host["pairs"]),
                **{f"{prefix}{k}": round(float(host[k]) / n, 6) for k in ("sft_anchor", *critic)}})
    margins = {b: round(float(host["bucket_margin"][i] / host["bucket_pairs"][i]), 6)
               for i, b in enumerate(buckets) if host["bucket_pairs"][i] > 0}
    out[f"{prefix}margin_by_bucket"] = margins
    return out


def unscored_pairs(pairs: list[dict]) -> int:
    """Pairs without the critic's scores of both sides (`polyalign train critic` writes them)."""
    return sum(1 for p in pairs if p.get("critic_chosen") is None or p.get("critic_rejected") is None)


def check_pairs(config: PreferenceConfig, paths: dict[str, str], train_pairs: list[dict],
                val_pairs: list[dict] = ()) -> None:
    """Refuses inputs a run would train on without a word of what they lack: validation pairs that are
    the training pairs, and HDPO's distance term on pairs the critic has not scored (missing scores read
    as 0, so the term would be identically zero and the run weighted DPO)."""
    train_file, val_file = paths["pairs"], paths["val_pairs"]
    if same_path(train_file, val_file) or (Path(val_file).is_file()
                                           and file_digest(train_file) == file_digest(val_file)):
        raise ConfigError(f"val_pairs {val_file} holds the training pairs ({train_file}): validation on them "
                          "measures nothing held out; give pairs of other prompts (`polyalign pairs import "
                          "--val-fraction 0.05` splits one file into both)")
    shared = sorted({p["id"] for p in train_pairs} & {p["id"] for p in val_pairs})
    if shared:
        raise ConfigError(f"{val_file}: {len(shared)} pair ids are also in {train_file} (e.g. {shared[0]!r}): files "
                          "imported apart under one --dataset number their rows alike; import the validation file "
                          "with another --dataset, or split one file with `pairs import --val-fraction`")
    if trains_distance_term(config):
        unscored = unscored_pairs(train_pairs)
        if unscored:
            raise ConfigError(f"{train_file}: {unscored} of {len(train_pairs)} pairs carry no critic scores "
                              "(critic_chosen, critic_rejected), so HDPO's distance term would be zero on them; "
                              "score them with `polyalign train critic` (its OUT/train_pairs.jsonl), or set "
                              "lambda_dist=0 to train without the distance term")


def _missing_pairs_hint(config: PreferenceConfig, key: str) -> str:
    """What to run when a pairs file is missing: the critic writes the scored pairs HDPO's distance term
    needs into RUN/critic/ (the default place); `polyalign pairs` makes unscored ones, enough for the
    other methods."""
    scored = trains_distance_term(config)
    made = "make pairs with `polyalign pairs` or `polyalign pairs import`"
    # the path was not given: say where it came from, or the user looks for a setting they never made
    defaulted = (f"{key} is not set, so the critic's scored pairs in data.dir's critic/ are read; "
                 if getattr(config, key) is None else "")
    if scored:
        out = f"{str(config.data.dir).rstrip('/')}/critic" if getattr(config, key) is None else "CRITIC"
        return (f"{defaulted}HDPO reads pairs the critic scored: {made}, then `polyalign train critic --out {out} "
                f"pairs=... val_pairs=...` writes them scored to {out}/train_pairs.jsonl and {out}/val_pairs.jsonl")
    held_out = val_pairs_hint(config.pairs) if key == "val_pairs" else ""
    return f"{defaulted}{made} and set {key}= to the file{held_out}" if defaulted else made


def pairs_whose_cut(examples: list[dict], took: str) -> int:
    """How many pairs a side's cut took `took` from (an Encoded field pair_rows keeps in "cuts"), each pair
    counted once, whichever side it was."""
    return sum(any(getattr(side, took) for side in e.get("cuts", {}).values()) for e in examples)


def truncation_note(examples: list[dict], pairs_file: str, max_length: int,
                    truncation: str = "left", profile: str = "context") -> str | None:
    """How many training pairs were cut to data.max_length, and how many of those lost the start of their
    opening system message (the profile prompt), as `build` says of SFT examples."""
    cut = [e for e in examples if e["truncated"]]
    if not cut:
        return None
    lost = sum(e["system_cut"] for e in cut)
    whole, notes = pairs_whose_cut(cut, "system_left_out"), pairs_whose_cut(cut, "system_dropped")
    how = {"left": "from its start", "keep_system": "after its opening system message",
           "turns": "by its oldest whole turns (its opening system message kept where it fits)"}[truncation]
    return (f"note: {len(cut)} of {len(examples)} training pairs of {pairs_file} ({len(cut) / len(examples):.0%}) are "
            f"longer than data.max_length {max_length} and are cut, the prompt {how} and each answer from its end"
            + (f"; {lost} of them lose their opening system message, whole or in part ("
               f"{SYSTEM_LOST_WHY[truncation].format(option='truncation=')})" if lost else "")
            + (f" ({whole} left out whole, over half of the prompt's share, rather than keep its last tokens)"
               if whole else "")
            + (f"; {notes} lose system messages from inside the conversation with the turns dropped" if notes else "")
            + f"; a larger data.max_length keeps more (`polyalign show {pairs_file} --checkpoint INIT "
              f"--max-length {max_length} --truncation {truncation}"
              + (f" --profile {profile}" if profile != "context" else "") + "` shows them)")


def cut_unlike_sft_notes(config: PreferenceConfig) -> list[str]:
    """Notes where pairs are cut otherwise than the SFT stage before them cut its examples: data.dir's build
    (another --max-length or --truncation than data.max_length and truncation here), and an init trained
    from scratch on shorter sequences than data.max_length (positions it never learned)."""
    notes = []
    built = None if is_uri(str(config.data.dir)) else built_manifest(config.data.dir)
    if built is not None:
        options = built["options"]
        length, cut = options.get("max_length"), options.get("truncation", "left")
        # shorter pairs than the SFT examples are no mismatch (the defaults: build 512, pairs 256)
        if cut != config.truncation or (length is not None and config.data.max_length > length):
            notes.append(f"note: {config.data.dir}'s build cut its SFT examples to {length} tokens by --truncation "
                         f"{cut}; this run cuts pairs to data.max_length {config.data.max_length} by truncation="
                         f"{config.truncation}: give data.max_length={length} truncation={cut} to cut them alike")
    past = past_trained_note(config.init, config.data.max_length, "pairs reach")
    return [*notes, *[past] * bool(past)]


def scoring_critic(config: PreferenceConfig, pairs_file: str) -> dict[str, Any] | None:
    """How well the critic whose scores HDPO's distance term trains on ranked its held-out pairs (critic.json
    beside the scored pairs, as `train critic` writes them): its file, ranking accuracy, AUC and pairs. None
    where the run has no distance term or the pairs were scored elsewhere."""
    if not trains_distance_term(config):
        return None
    path = Path(pairs_file).parent / "critic.json"
    try:
        record = json.loads(path.read_text())
        accuracy, auc = record["val"]["ranking_accuracy"], record["val"].get("auc")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # scored elsewhere, or of another shape
        return None
    if not isinstance(accuracy, int | float):
        return None
    # the AUC is None where a side was empty, and an earlier critic.json has none
    return {"file": str(path), "ranking_accuracy": accuracy, "auc": auc if isinstance(auc, int | float) else None,
            "val_pairs": record.get("val_pairs")}


def backward_critic_note(config: PreferenceConfig, critic: dict[str, Any] | None, pairs_file: str) -> str | None:
    """The critic's own warning, said again where HDPO's distance term trains on its scores (`critic`:
    scoring_critic): a critic that ranked its held-out pairs worse than chance pushes the policy toward the
    rejected answers, and a user who missed the critic run's warning trained on it without a word."""
    if critic is None or critic["ranking_accuracy"] >= 0.5:
        return None
    return (f"warning: the critic that scored {pairs_file} ranks its held-out pairs worse than chance "
            f"({critic['ranking_accuracy']:.3f}, {critic['file']}): HDPO's distance term (lambda_dist "
            f"{config.lambda_dist}) pushes toward the rejected answers; train the critic longer, or set lambda_dist=0")


def critic_card_row(critic: dict[str, Any] | None) -> dict[str, str]:
    """The model card's row on the critic whose scores the distance term trained on (scoring_critic)."""
    if critic is None:
        return {}
    pairs = f" on {critic['val_pairs']} held-out pairs" if isinstance(critic.get("val_pairs"), int) else ""
    auc = f", AUC {critic['auc']:.3f}" if critic["auc"] is not None else ""
    return {"critic": f"{critic['file']}: ranking accuracy {critic['ranking_accuracy']:.3f}{auc}{pairs} (0.5: "
                      "chance); the distance term trained on its scores"}


def profile_note(config: PreferenceConfig, tokenizer, pair: dict) -> str | None:
    """Said when the init checkpoint was not trained with polyalign's profile prompt (a user's own model)
    and this run adds one: the trained model then expects it wherever it is served."""
    if tokenizer.profile_mode not in (None, "none") or config.profile == "none":
        return None
    shown = profile_prompt(Record.from_json(pair["record"]), config.profile)
    return (f"note: {config.init} was not trained with a profile prompt; profile={config.profile} opens "
            f"every pair's prompt with one (the first pair's: {shown[:90]!r}...), so the trained model expects it: "
            "polyalign generate and serve write it, a chat template needs the profile variables (docs/model.md); "
            "profile=none trains on the pairs' own prompts")


def pair_texts(pairs: list[dict], count: int = PROBE_RECORDS) -> list[str]:
    """Probe texts of `count` preference pairs spread evenly over them: each one's record and both answers."""
    chosen = spread_records(pairs, count)
    answers = (pair[side][:PROBE_CHARS] for pair in chosen for side in ("chosen", "rejected") if pair[side])
    return list(dict.fromkeys([*probe_texts([Record.from_json(pair["record"]) for pair in chosen]), *answers]))


def tokenizer_note(config: PreferenceConfig, tokenizer, pairs: list[dict]) -> str | None:
    """transformers' reading of the init checkpoint's tokenizer against polyalign's, on the pairs, before
    any step: the same check the export gets afterwards (model/tokenizer_check.py). Process 0 only; nothing
    when transformers is missing or the init is no local Hugging Face folder."""
    init = Path(str(config.init))
    if jax.process_index() != 0 or is_uri(str(config.init)):
        return None
    warning = check_folder(init, tokenizer, pair_texts(pairs))
    return None if warning is None else f"warning: {warning}"


def setup(config: PreferenceConfig, mesh, progress: bool = True) -> Job:
    require(config, "init", hint="the SFT checkpoint")
    max_length = config.data.max_length
    too_long = longer_than_positions(config.init, max_length, f"data.max_length {max_length}",
                                     "set a smaller data.max_length")
    if too_long:
        raise ConfigError(too_long)
    # the training pairs are read before val_pairs is looked for: a file that needs `pairs import` says so first
    paths, read = {}, {}
    for key in ("pairs", "val_pairs"):
        paths[key] = config.pair_file(key)
        read[key] = read_pairs(Path(paths[key]), _missing_pairs_hint(config, key))
    train_pairs, val_pairs = read["pairs"], read["val_pairs"]
    if not train_pairs:
        raise ConfigError(f"{paths['pairs']}: no pairs")
    check_pairs(config, paths, train_pairs, val_pairs)
    tokenizer = checkpoint_tokenizer(config.init)
    model = load_init(config, mesh)
    template_name = choose_template(tokenizer, family=model.config.family, where=str(config.init))
    template = get_template(template_name, tokenizer)
    val_pairs = pipeline.capped_pairs(val_pairs, config.data.eval_limit)
    buckets = sorted({p["bucket_id"] for p in train_pairs + val_pairs})
    train_examples = tokenise_pairs(train_pairs, tokenizer, template, config.profile, max_length, buckets,
                                    config.truncation)
    val_examples = tokenise_pairs(val_pairs, tokenizer, template, config.profile, max_length, buckets,
                                  config.truncation)
    critic = scoring_critic(config, paths["pairs"])
    notes = [truncation_note(train_examples, paths["pairs"], max_length, config.truncation, config.profile),
             *cut_unlike_sft_notes(config), profile_note(config, tokenizer, train_pairs[0]),
             backward_critic_note(config, critic, paths["pairs"]),
             tokenizer_note(config, tokenizer, train_pairs),
             pair_packing_note(train_examples, max_length, config.train.seed, config.train.global_batch)
             if config.data.pack else None]
    if method_spec(config.method).needs_reference and config.reference == "precomputed":
        with jax.set_mesh(mesh):  # with adapters, the reference is the base with them off
            reference_logps(base_model(model), train_examples + val_examples, max_length, tokenizer.pad_id,
                            progress=progress, mesh=mesh, pack=config.data.pack)

    def batches(layout: pipeline.Layout, loop: LoopConfig):
        return pipeline.iterate(train_pair_batches(train_examples, layout, loop.steps, loop.seed, max_length,
                                                   tokenizer.pad_id, pack=config.data.pack))

    drift = None
    if config.drift_prompts > 0 and val_pairs:
        drift = DriftProbe(val_pairs[:config.drift_prompts], model, tokenizer, template, config.profile, mesh,
                           config.drift_new_tokens, load_references(config.data.dir), Path(paths["pairs"]).parent,
                           seed=config.train.seed, distance_term=trains_distance_term(config))

    objective = PreferenceObjective(config, len(buckets))

    def evaluate(trainer: Trainer) -> dict[str, Any]:
        dataset = pipeline.eval_batches(val_examples, trainer.eval_batch_size(config.data.eval_batch), max_length,
                                        tokenizer.pad_id, jax.process_index(), jax.process_count(), convert=pair_arrays)
        measured = summarize(trainer.metric_sums(dataset), buckets, prefix="val_", scored=not unscored_pairs(val_pairs),
                             coefficients=objective.coefficients)
        if not trainer.first_evaluation():  # the critic's scores of fixed pairs: logged with the first evaluation
            measured.pop("val_dist_gap", None)
        return {**measured, **(drift(trainer) if drift else {})}

    train_scored = not unscored_pairs(train_pairs)

    def finish(trainer: Trainer, out: Path, segments: list[dict]) -> dict[str, Any]:
        # the values the pairs held and those the policy's SFT data held (its export says them)
        pair_values = {key: {p["record"][field] for p in train_pairs} for key, field in PROFILE_FIELDS.items()}
        held = Counter(tuple(p["record"][field] for field in PROFILE_FIELDS.values()) for p in train_pairs)
        pair_values[PROFILE_COMBINATIONS] = [{**dict(zip(PROFILE_FIELDS, c)), "examples": n} for c, n in held.items()]
        # in how many training pairs the profile prompt stood whole (either side cut counts), as SFT's card says
        cut = {"examples": len(train_examples), "system_cut": sum(bool(e["system_cut"]) for e in train_examples),
               "system_left_out": pairs_whose_cut(train_examples, "system_left_out")}
        coverage = export.profile_coverage(cut, config.truncation, "training pairs", "truncation=")
        written = export.export_trained(trainer.model(), tokenizer, out, trainer.mesh, config, template,
                                        config.profile, tokenizer.system_mode,
                                        seen_profile_values(config.profile, pair_values, tokenizer.profile_values),
                                        None if config.profile == "none" else coverage,
                                        card_rows=critic_card_row(critic), segments=segments)
        return {**written, **check_export(written["model"], tokenizer, pair_texts(train_pairs))}

    return Job(model, objective, batches,
               epoch_size=None if config.data.pack else len(train_examples),
               evaluate=evaluate if val_examples else None,
               summarize=lambda host: summarize(host, buckets, scored=train_scored),
               checkpoint_meta={"method": config.method}, finish=finish,
               # the files under their own names: `val_pairs` is the count, as the metrics have it
               summary={"pairs_file": paths["pairs"], "val_pairs_file": paths["val_pairs"],
                        "train_pairs": len(train_examples), "val_pairs": len(val_examples),
                        "train_pairs_cut": sum(e["truncated"] for e in train_examples), "packed": config.data.pack,
                        **({"critic": critic} if critic else {})},
               notes=[note for note in notes if note],
               # a reference in the step adds its forward pass; a precomputed one costs the step nothing
               flops_per_token=flops_per_token(model.config, max_length, reference_forward=(
                   method_spec(config.method).needs_reference and config.reference == "in_step")))


def adds_hdpo_terms(config: PreferenceConfig) -> bool:
    """Whether a run's objective holds HDPO's pair weights, distance term and SFT anchor: HDPO's own, or
    another method's with `hdpo_terms: true`."""
    return config.method == "hdpo" or config.hdpo_terms


def trains_distance_term(config: PreferenceConfig) -> bool:
    """Whether the objective holds HDPO's critic distance term with a weight: it then reads the critic's scores."""
    return adds_hdpo_terms(config) and config.lambda_dist > 0


def summary_line(result: dict[str, Any]) -> str:
    last = result.get("last", {})
    trained = steps_phrase(result, steps_run(result))
    nan = float("nan")
    # the last step's batch, then the validation pairs where the last step evaluated them
    validation = (f"; validation ({counted(result['val_pairs'], 'pair')}): "
                  + (f"loss {last['val_loss']:.4f}, " if "val_loss" in last else "")
                  + f"reward margin {last['val_rewards/margin']:.4f}, "
                  f"accuracy {last.get('val_rewards/accuracy', nan):.3f}" if "val_rewards/margin" in last else "")
    # HDPO's distance term, where it was logged: a lambda_dist sweep otherwise shows no difference here
    where = "val_" if "val_dist_reg" in last else ""
    if f"{where}dist_reg" in last:
        owner = "its" if where else "the batch's"
        validation += (f"; {owner} distance term dist_reg {last[where + 'dist_reg']:.4f}, dist_reach "
                       f"{last.get(where + 'dist_reach', nan):.3f}")
    rounds = result.get("rounds", [])
    # every round's validation, so that the rounds compare where the run is read (summary.json has them too)
    earlier = "".join(f"round {r['round']}: to step {r['end_step']}"
                      + (f" (resumed at step {r['resumed_from_step']})" if r.get("resumed_from_step") else "")
                      + f" on {r.get('train_pairs')} pairs"
                      + (f"; validation reward margin {r['last']['val_rewards/margin']:.4f}, accuracy "
                         f"{r['last'].get('val_rewards/accuracy', nan):.3f}"
                         if "val_rewards/margin" in r.get("last", {}) else "") + "\n"
                      for r in rounds if r["round"] != result.get("round"))
    planned = result.get("rounds_planned", len(rounds))  # a run stopped inside a round lists the finished ones
    # each round's reference is the model it started from: its margins measure that round, not the run
    apart = ("\nthe rounds' reward margins are each against the model the round started from, so they do not "
             "compare across rounds; the drift probe's numbers and `polyalign evaluate` do") if earlier else ""
    kept, beyond = result.get("rounds_kept") or [], result.get("rounds_beyond") or []
    earlier = (f"round{'s' * (len(kept) > 1)} {_numbers(kept)} finished before: kept, not trained again (--overwrite "
               "trains every round again)\n" if kept else "") + earlier
    beyond_note = (f"\nround{'s' * (len(beyond) > 1)} {_numbers(beyond)}, finished by an earlier run with more rounds, "
                   f"{'are' if len(beyond) > 1 else 'is'} kept on disk but {'are' if len(beyond) > 1 else 'is'} not "
                   f"this run's model (rounds={planned}: OUT/summary.json names round {planned}'s)" if beyond else "")
    return (earlier + f"{result['method']}: {trained} on {result['train_pairs']} pairs; last step's batch: reward "
            f"margin {last.get('rewards/margin', nan):.4f}, accuracy {last.get('rewards/accuracy', nan):.3f}"
            f"{validation}" + (f" (round {result['round']} of {planned})" if "rounds" in result else "")
            + f"{apart}{beyond_note}\nmodel: {result['model']}")


def _numbers(rounds: list[int]) -> str:
    """Round numbers as a reader says them: "3", "1-3" for a run of them, else "1, 3"."""
    if len(rounds) > 2 and rounds == list(range(rounds[0], rounds[-1] + 1)):
        return f"{rounds[0]}-{rounds[-1]}"
    return ", ".join(map(str, rounds))
