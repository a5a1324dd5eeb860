"""Whether answers that need no model (evaluate/baselines.py: echoing the question, quoting the first
sentence of the context, saying nothing) do better than a model: the sentence the evaluation's summary
and reports lead their no-model rows with, so that a model that has not beaten them is said to be one."""

from __future__ import annotations

from polyalign.core.scores import interval_text
from polyalign.core.wording import listed

# What each no-model answer does, in words, for a reader told that it beats a model.
BASELINE_WORDS = {"echo_question": "copying the question", "first_sentence": "quoting the first sentence of the "
                  "context (of the question where there is none)", "empty_answer": "saying nothing"}
# The numbers a model is held against the no-model answers on: its metrics' value and interval, the
# reference row's key, and whether higher is better.
HELD_AGAINST = (
    ("the aggregate", lambda m: (m["aggregate"]["overall"], m["aggregate"].get("interval")), "aggregate", True),
    ("BNG macro", lambda m: (m["bng"]["overall_macro"], m["bng"].get("macro_interval")), "bng_macro", False),
)


def ahead_of_the_model(metrics: dict) -> str | None:
    """One sentence naming the no-model answers that do better than the model where the intervals say so
    (the two intervals apart), on the aggregate and on BNG macro; None when none does, or nothing can
    be judged (no intervals). Estimates alone are not enough: on a few rows they cross by chance."""
    references = metrics.get("reference_rows") or {}
    said, beaten_by = [], []
    for label, model_value, key, higher_better in HELD_AGAINST:
        value, interval = model_value(metrics)
        if value is None or not interval:
            continue
        ahead = []
        for name, row in references.items():
            other = row.get(f"{key}_interval")
            if name not in BASELINE_WORDS or row.get(key) is None or not other:
                continue
            if (other[0] > interval[1]) if higher_better else (other[1] < interval[0]):
                ahead.append(f"{name} {row[key]:.4f} {interval_text(other)}")
                beaten_by += [name] * (name not in beaten_by)
        if ahead:
            said.append(f"on {label}, {listed(ahead, 'and')} against the model's {value:.4f} "
                        f"{interval_text(interval)}")
    if not said:
        return None
    return (f"answers that need no model do better than this model, their intervals apart from its: {'; '.join(said)}."
            f" It has not yet beaten {listed([BASELINE_WORDS[name] for name in beaten_by], 'or')}")

