"""`polyalign prompts`: the exact prompts polyalign would generate from, for an external engine.

One row per record: {"id", "messages", "prompt"} ({"id", "messages"} without a checkpoint). `messages`
are the chat messages polyalign renders (the profile system prompt included), for engines that apply the
chat template themselves (vLLM's chat API, SGLang); `prompt` is the rendered string ending with the
assistant header, for engines given raw text. Either way the answers, as rows {"id", "prediction"}, feed
`polyalign pairs` and `polyalign evaluate` unchanged (docs/evaluation.md).

With a token budget (`--max-prompt-tokens`, as `polyalign generate` cuts its prompts) each row also
holds `prompt_token_ids`, the very ids `generate` would feed (vLLM's TokensPrompt), and a long
conversation's `messages`, `prompt` and ids lose their oldest whole turns until they fit (chat.cut_prompt;
ids still over with the last question alone keep their end; such a row says `"messages_over_budget": true`).
With `--max-new-tokens N|auto` each row holds `max_tokens`, the answer budget `generate` would give it
(auto: its bucket's, from the human answers of the budget records).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from polyalign.core.errors import GenerationError
from polyalign.core.outputs import OutputLock, sidecar, stage_output, write_record
from polyalign.core.paths import file_digest, recorded_path
from polyalign.data.records import read_records
from polyalign.generate.budgets import bucket_budgets
from polyalign.generate.run import (
    BUDGET_CEILING,
    answer_room,
    default_budgets,
    past_trained_length,
    say_tokenizer_reading,
)
from polyalign.generate.sampling import SamplingConfig
from polyalign.generate.selection import select_records
from polyalign.model.architecture import checkpoint_family
from polyalign.model.hf import checkpoint_tokenizer
from polyalign.model.tokenizer_check import PROMPTS_CONSEQUENCE
from polyalign.tokens.chat import (
    PROFILE_MODES,
    choose_template,
    cut_prompt,
    fold_system,
    get_template,
    lost_whole_turns,
    record_messages,
    say_unseen_profile_values,
    trained_profile,
)


def write_prompts(checkpoint, records_path: Path, out: Path, *, profile: str | None = None, template: str | None = None,
                  limit: int | None = None, sample: int | None = None, seed: int = 0,
                  per_bucket: int | None = None, max_prompt_tokens: int | str | None = "auto",
                  max_new_tokens: int | str | None = None,
                  budget_records: Path | None = None, budget_quantile: float = 0.99, budget_margin: float = 1.2,
                  budget_ceiling: int | None = None, overwrite: bool = False) -> dict[str, Any]:
    """`max_prompt_tokens`: the prompt budget, chosen as generate chooses it by default ("auto":
    run.default_prompt_budget; None: whole prompts, no prompt_token_ids). `max_new_tokens`: each row's
    `max_tokens`, a number or "auto" (its bucket's budget from the answers of `budget_records`, as
    `generate --max-new-tokens auto` sets it); None writes none.
    Without a `checkpoint` the rows hold the messages alone, whole (the profile's system prompt included):
    for a chat API that applies its own template and tokenizer; nothing is rendered, counted or cut."""
    if profile is not None and profile not in PROFILE_MODES:
        raise GenerationError(f"profile must be one of {', '.join(PROFILE_MODES)}, got {profile!r}")
    if checkpoint is None:
        needs = [name for name, given in (("--template", template is not None),
                                          ("--max-new-tokens auto", max_new_tokens == "auto")) if given]
        if needs:
            raise GenerationError(f"{' and '.join(needs)} need{'s' * (len(needs) == 1)} a --checkpoint: they render "
                                  "or count in a model's tokenizer (without one, the rows hold the messages alone)")
        max_prompt_tokens = None  # a cut counts a model's tokens
    records_path, out = Path(records_path), Path(out)
    fitted: list[str] = []  # what was chosen or changed to fit the model's positions, as generate does
    auto = max_new_tokens == "auto"
    ceiling_chosen = budget_ceiling is None  # not given: a from-scratch model's trained length may lower it
    budget_ceiling = BUDGET_CEILING if budget_ceiling is None else budget_ceiling
    if max_prompt_tokens is not None:
        answers = (budget_ceiling if auto else SamplingConfig().max_new_tokens if max_new_tokens is None
                   else int(max_new_tokens))
        max_prompt_tokens, answers, fitted = default_budgets(checkpoint, max_prompt_tokens, answers, auto,
                                                             ceiling_chosen)
        budget_ceiling = answers if auto else budget_ceiling
    if max_prompt_tokens is not None and max_new_tokens is not None:
        room, changed = answer_room(checkpoint, max_prompt_tokens, budget_ceiling if auto else int(max_new_tokens),
                                    budgeted=auto)
        fitted += changed
        budget_ceiling = room if auto else budget_ceiling
    settings = {"checkpoint": None if checkpoint is None else recorded_path(checkpoint),
                "records": str(records_path.resolve()), "profile": profile,
                "template": template, "limit": limit,
                # only when sampled, so that prompts written before --sample existed keep their settings
                **({"sample": sample, "seed": seed} if sample is not None else {}),
                **({"per_bucket": per_bucket, "seed": seed} if per_bucket is not None else {}),
                **({"max_prompt_tokens": max_prompt_tokens} if max_prompt_tokens is not None else {}),
                **({"max_new_tokens": max_new_tokens} if max_new_tokens is not None else {}),
                **({"budget_records": str(Path(budget_records).resolve()), "budget_quantile": budget_quantile,
                    "budget_margin": budget_margin, "budget_ceiling": budget_ceiling}
                   if max_new_tokens == "auto" else {})}
    with stage_output(out, sidecar(out), settings, overwrite, ours=[out], inputs={"records": records_path},
                      lock=OutputLock.for_file(out), paths=["checkpoint"]):
        records, notes = select_records(read_records(records_path), records_path, limit, sample, seed, per_bucket)
        if checkpoint is None:
            return _write_messages(records, records_path, out, profile or "context", max_new_tokens, settings, notes)
        tokenizer = checkpoint_tokenizer(checkpoint, model_required=False)
        notes += fitted
        say_tokenizer_reading(checkpoint, tokenizer, records, PROMPTS_CONSEQUENCE, notes)
        profile = trained_profile(tokenizer, profile, str(checkpoint), notes)
        say_unseen_profile_values(tokenizer, records, profile, str(checkpoint), notes)
        name = choose_template(tokenizer, template, checkpoint_family(checkpoint), str(checkpoint), notes)
        chat = get_template(name, tokenizer)
        budgets = None
        if max_new_tokens == "auto":
            budgets = bucket_budgets(read_records(budget_records), tokenizer.encode, budget_quantile, budget_margin,
                                     ceiling=budget_ceiling)
        if max_prompt_tokens is not None and max_new_tokens is not None:
            past = past_trained_length(checkpoint, max_prompt_tokens, budgets.fallback if budgets is not None
                                       else int(max_new_tokens), budgeted=budgets is not None)
            notes += [past] if past else []
        cut = Counter()
        with out.open("w", encoding="utf-8") as handle:
            for record in records:
                messages = record_messages(record, profile, with_response=False, system=tokenizer.system_mode)
                row = {"id": record.id}
                if max_prompt_tokens is not None:
                    ids = cut_prompt(chat, tokenizer, messages, max_prompt_tokens)
                    # counts, not flags: an empty Counter's first update keeps the values as given (True)
                    cut.update(cut=int(ids.cut), system_lost=int(ids.system_lost),
                               turns_dropped=int(lost_whole_turns(messages, ids.messages)), over=int(ids.mid_turn))
                    row["prompt_token_ids"], messages = ids.ids.tolist(), ids.messages
                    if ids.mid_turn:  # a chat API cannot cut inside a turn: these messages go over the budget
                        row["messages_over_budget"] = True
                # an engine applying a template that refuses system messages gets them folded, as trained
                sent = messages if chat.takes_system else [m for _, m in fold_system(messages)]
                row.update(messages=[{"role": m.role, "content": m.content} for m in sent],
                           prompt=chat.render(messages, add_generation_prompt=True))
                if max_new_tokens is not None:  # the answer's budget, as generate gives it (vLLM's max_tokens)
                    row["max_tokens"] = budgets(record.bucket_id) if budgets is not None else max_new_tokens
                handle.write(json.dumps(row, ensure_ascii=False) + "\n")
        summary = {"records": len(records), "template": name, "profile": profile, "system": tokenizer.system_mode,
                   "stop": list(chat.stop_tokens()), "out": str(out), "notes": notes,
                   # what the budget took: prompts over it (their ids cut as generate cuts them), those whose
                   # opening system message went too, those whose messages lost whole turns, and those whose
                   # messages stay over it (with only the opening system message and the last question left)
                   **({"max_prompt_tokens": max_prompt_tokens, "prompts_cut": cut["cut"],
                       "prompts_cut_system_lost": cut["system_lost"], "messages_turns_dropped": cut["turns_dropped"],
                       "messages_over_budget": cut["over"]} if max_prompt_tokens is not None else {}),
                   **({"budgets": budgets.by_bucket, "budget_fallback": budgets.fallback,
                       "budget_records": str(budget_records)} if budgets is not None else {})}
        write_record(sidecar(out), settings, {"records": file_digest(records_path)}, summary=summary)
    return summary


def _write_messages(records, records_path: Path, out: Path, profile: str, max_new_tokens: int | None,
                    settings: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    """The rows of `write_prompts` without a checkpoint: {id, messages} (and max_tokens), the conversation
    whole, its system messages kept in place, as `record_messages` makes it."""
    with out.open("w", encoding="utf-8") as handle:
        for record in records:
            messages = record_messages(record, profile, with_response=False)
            row = {"id": record.id, "messages": [{"role": m.role, "content": m.content} for m in messages]}
            if max_new_tokens is not None:
                row["max_tokens"] = max_new_tokens
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    summary = {"records": len(records), "template": None, "profile": profile, "system": "keep", "stop": [],
               "out": str(out), "notes": notes, "prompts_cut": 0}
    write_record(sidecar(out), settings, {"records": file_digest(records_path)}, summary=summary)
    return summary
