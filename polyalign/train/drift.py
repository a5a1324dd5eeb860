"""Length and style drift of a policy while preference training runs.

Preference losses can move a model away from how people answer (longer answers, another register)
while the reward margin looks fine. At every evaluation the probe samples the current policy on a fixed
set of validation prompts and logs, overall and per bucket: the ratio of generated to human response
length in tokens, the support distance d(y, b) of the samples to their bucket's human references (when
RUN/stats/references.json exists), and the trained critic's score of the samples (when the critic's
folder is known). Every process runs the same sampling, so it works on a mesh and on several hosts.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from polyalign.data.records import Record
from polyalign.data.text import without_words
from polyalign.features.references import read_references
from polyalign.generate.engine import Engine, EngineConfig, Request
from polyalign.generate.run import stop_ids_of
from polyalign.generate.sampling import SamplingConfig
from polyalign.tokens.chat import ChatTemplate, encode_prompt, record_messages
from polyalign.train.critic_model import CriticScorer, support_targets


def _mean_by_bucket(values: Sequence[float], buckets: Sequence[str]) -> dict[str, float]:
    groups: dict[str, list[float]] = defaultdict(list)
    for value, bucket in zip(values, buckets):
        if np.isfinite(value):
            groups[bucket].append(float(value))
    return {b: round(float(np.mean(v)), 4) for b, v in sorted(groups.items())}


class DriftProbe:
    """Samples the policy on fixed prompts and measures how far its answers drift from the human ones."""

    def __init__(self, pairs: list[dict], model, tokenizer, template: ChatTemplate, profile: str, mesh,
                 max_new_tokens: int, references: dict | None = None, critic_dir: Path | None = None,
                 seed: int = 0, distance_term: bool = True):
        self.tokenizer, self.references, self.seed, self.distance_term = tokenizer, references, seed, distance_term
        records = [Record.from_json(p["record"]) for p in pairs]
        self.buckets = [p["bucket_id"] for p in pairs]
        self.human_tokens = np.array([len(tokenizer.encode(p["chosen"])) for p in pairs], np.float64)
        # rendered as the policy was trained to read them (its export's system mode)
        messages = [record_messages(r, profile, with_response=False, system=tokenizer.system_mode) for r in records]
        self.prompts = [np.asarray(encode_prompt(template, tokenizer, m, max_tokens=512), np.int32) for m in messages]
        # greedy: the same prompts and the same policy give the same samples, so evaluations compare
        self.requests = [Request(prompt, SamplingConfig(max_new_tokens=max_new_tokens)) for prompt in self.prompts]
        self.engine = Engine(model, stop_ids_of(tokenizer, template),
                             EngineConfig(slots=16, max_sequence=512 + max_new_tokens), mesh=mesh)
        self.critic, self.said_empty, self.said_blind, self.said_wordless = None, False, False, False
        if critic_dir is not None and (Path(critic_dir) / "critic.json").is_file():
            self.critic = CriticScorer(Path(critic_dir))
        # people's own answers to the same prompts, measured once per prompt: the mark the policy's drift reads
        # against, over the prompts the policy answered at each probe
        chosen = [p["chosen"] for p in pairs]
        self.people_scores = {
            "drift/people_support_distance": None if references is None else np.asarray(
                support_targets(chosen, self.buckets, references), np.float64),
            "drift/people_critic": None if self.critic is None else np.asarray(self.critic(chosen, self.buckets),
                                                                                np.float64)}

    def __call__(self, trainer) -> dict[str, Any]:
        self.engine.set_model(trainer.model(trainer.state["params"]))  # the current parameters, no copy kept
        samples = [completions[0].tokens for completions in self.engine.generate(self.requests)]
        self.engine.release()  # the trainer's memory is the trainer's between probes
        texts = [self.tokenizer.decode(tokens, skip_special=True).strip() for tokens in samples]
        # an answer's tokens as its text reads, as the human answers' are counted: tokens that decode to nothing
        # (special ones the model wrote) made a length ratio of 1.68 out of answers that were all empty
        generated = np.array([len(self.tokenizer.encode(text)) for text in texts], np.float64)
        by_bucket: dict[str, list[int]] = defaultdict(list)
        for i, bucket in enumerate(self.buckets):
            by_bucket[bucket].append(i)
        # punctuation alone ("，，，，"): text a model degenerates into, which the scores below would measure
        wordless = sum(without_words(t) for t in texts)
        out: dict[str, Any] = {
            "drift/length_ratio": round(float(generated.sum() / max(self.human_tokens.sum(), 1.0)), 4),
            "drift/length_ratio_by_bucket": {
                b: round(float(generated[rows].sum() / max(self.human_tokens[rows].sum(), 1.0)), 4)
                for b, rows in sorted(by_bucket.items())},
            "drift/empty": round(float(np.mean([not t for t in texts])), 4),
            "drift/without_words": round(wordless / max(len(texts), 1), 4),
        }
        if not any(texts) and not self.said_empty and jax.process_index() == 0:
            self.said_empty = True  # once a run: later probes' drift/empty says whether it lasts
            print(f"warning: drift probe: all {len(texts)} greedy answers of the policy to the prompts of its "
                  "validation pairs were empty (drift/empty 1.0), so drift/length_ratio is 0 and no support distance "
                  "or critic score is logged; a small or early model often ends its turn at once under greedy "
                  "decoding, and sampled answers (generate --temperature) tell more", file=sys.stderr, flush=True)
        if wordless * 2 >= len(texts) and wordless and not self.said_wordless and jax.process_index() == 0:
            self.said_wordless = True  # once a run: later probes' drift/without_words says whether it lasts
            print(f"warning: drift probe: {wordless} of {len(texts)} greedy answers of the policy to the prompts of "
                  "its validation pairs hold no word, only punctuation (drift/without_words "
                  f"{out['drift/without_words']}): the policy has degenerated, whatever its support distance and "
                  "critic score (which measure these answers as text) say; read them (`polyalign generate`), and "
                  "lower the learning rate or stop earlier", file=sys.stderr, flush=True)
        out.update(answer_scores(texts, self.buckets, self.references, self.critic))
        answered = [i for i, text in enumerate(texts) if text]
        people = self.people_means(answered)
        if not self.said_blind and (warning := critic_blind_warning(out, people, self.distance_term)) and \
                jax.process_index() == 0:
            self.said_blind = True  # once a run: drift/critic and drift/support_distance say whether it lasts
            print(warning, file=sys.stderr, flush=True)
        if trainer.first_evaluation():  # fixed for the run: logged with its first evaluation, over every prompt
            out.update(self.people_means(range(len(texts))))
        return out

    def people_means(self, rows) -> dict[str, float]:
        """People's support distance and critic score averaged over the probe prompts `rows`."""
        rows = list(rows)
        means = {}
        for key, scores in self.people_scores.items():
            chosen = scores[rows] if scores is not None and rows else np.array([])
            if np.isfinite(chosen).any():
                means[key] = round(float(np.nanmean(chosen)), 4)
        return means


# The policy's answers this many times further from people's support than people's own answers are far
# off by any reading; a critic that still scores them nearer people than people's own cannot guide them.
BLIND_DISTANCE_RATIO = 1.5


def critic_blind_warning(policy: dict[str, Any], people: dict[str, Any], distance_term: bool = True) -> str | None:
    """A warning when the critic scores the policy's answers nearer people than people's own answers to the
    same prompts (`people`: DriftProbe.people_means over the prompts it answered) while their support
    distance says they are much further (BLIND_DISTANCE_RATIO): the critic's distance, which HDPO's
    distance term follows (`distance_term`: this run has one), no longer tells these answers from people's."""
    critic, distance = policy.get("drift/critic"), policy.get("drift/support_distance")
    people_critic, people_distance = people.get("drift/people_critic"), people.get("drift/people_support_distance")
    if None in (critic, distance, people_critic, people_distance):
        return None
    if critic >= people_critic or distance <= BLIND_DISTANCE_RATIO * people_distance:
        return None
    return (f"warning: drift probe: the critic scores the policy's answers nearer people ({critic:.3f}) than "
            f"people's own answers to the same prompts ({people_critic:.3f}), while their support distance says they "
            f"are further ({distance:.3f} against people's {people_distance:.3f}): the critic no longer tells these "
            "answers from people's, " + (
                "so HDPO's distance term stops pushing back; read the answers (drift/empty, drift/without_words, "
                "`polyalign generate`), "
                "and retrain the critic on them (on_policy.refresh_critic, with rounds > 1) or lower the learning "
                "rate" if distance_term else
                "though this run has no distance term to follow it (hdpo, or hdpo_terms: true, has): the answers "
                "have moved away from people's; read them (drift/empty, drift/without_words, `polyalign "
                "generate`), and lower the learning rate or stop earlier"))


def answer_scores(texts: Sequence[str], buckets: Sequence[str], references: dict | None,
                  critic: Any = None) -> dict[str, Any]:
    """The support distance and the critic's score of the non-empty answers, overall and per bucket. An
    empty answer has no text to measure (drift/empty counts it): scoring it would log the distance of the
    empty string, a number for answers that all said nothing."""
    answered = [i for i, text in enumerate(texts) if text]
    texts, buckets = [texts[i] for i in answered], [buckets[i] for i in answered]
    out: dict[str, Any] = {}
    if not texts:
        return out
    if references is not None:
        distance = support_targets(texts, buckets, references)
        if np.isfinite(distance).any():
            out["drift/support_distance"] = round(float(np.nanmean(distance)), 4)
            out["drift/support_distance_by_bucket"] = _mean_by_bucket(distance, buckets)
    if critic is not None:
        scores = critic(texts, buckets)
        out["drift/critic"] = round(float(np.mean(scores)), 4)
        out["drift/critic_by_bucket"] = _mean_by_bucket(scores, buckets)
    return out


def load_references(run: str | None) -> dict | None:
    """RUN/stats/references.json, or None when there is no run or no stats."""
    path = Path(run) / "stats" / "references.json" if run else None
    if path is None or not path.is_file():
        return None
    references = read_references(path)  # one made from an earlier prepare is refused, as the critic does
    if not all("rates" in r for r in references["buckets"].values()):
        print(f"note: {path} predates per-token rates; drift is logged without the support distance "
              "(rerun `polyalign stats RUN` to have it)")
        return None
    return references
