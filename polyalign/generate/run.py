"""`polyalign generate`: one prediction per record, by id, from the generation engine."""

from __future__ import annotations

import dataclasses
import json
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from polyalign.core.errors import GenerationError
from polyalign.core.outputs import OutputLock, settings_record, sidecar, stage_output, write_record
from polyalign.core.paths import checkpoint_identity, file_digest, is_uri, recorded_path
from polyalign.core.progress import progress_bar
from polyalign.data.records import read_records
from polyalign.data.text import without_words
from polyalign.generate.budgets import bucket_budgets, truncation_by_bucket
from polyalign.generate.engine import Engine, EngineConfig, Request, request_seed
from polyalign.generate.sampling import FINISH_LENGTH, FINISH_STOP, SamplingConfig
from polyalign.generate.selection import select_records
from polyalign.generate.settings import asked_for, checkpoint_sampling, describe_sampling
from polyalign.mesh import parallel
from polyalign.model import load_hf_checkpoint
from polyalign.model.architecture import compute_dtype, longer_than_positions, position_limit
from polyalign.model.hf import checkpoint_tokenizer
from polyalign.model.tokenizer_check import GENERATE_CONSEQUENCE, check_folder, probe_texts, spread_records
from polyalign.tokens.chat import (
    choose_template,
    cut_prompt,
    get_template,
    lost_whole_turns,
    record_messages,
    say_unseen_profile_values,
    trained_profile,
)
from polyalign.tokens.tokenizer import never_trained_past, trained_length


@dataclass(frozen=True)
class GenerateOptions:
    """What `generate_predictions` samples and from which records; OUT.manifest.json records each field.

    profile: the system-prompt profile of the prompts (tokens/chat.py PROFILE_MODES; None: the one the
    checkpoint was trained with, else context); template: a chat
    template name (default: the checkpoint's own); batch_size: sequences the engine decodes at once;
    limit: the first N records; sample: a seeded random N of them, in file order; per_bucket: a seeded
    random N of each bucket's, in file order; seed: of the sampling (each record draws from its own seed,
    made from this one and its id) and of `sample` and `per_bucket`; model_name:
    the `model` of every row (default: the checkpoint's run folder). budget_records: `max_new_tokens
    auto`, each record budgeted by its bucket's human answers in these records (budgets.py: the
    budget_quantile of their token counts times budget_margin), sampling.max_new_tokens the ceiling.
    max_prompt_tokens: the prompt budget; "auto" chooses it (`default_prompt_budget`).
    dtype: of the weights and the computation (model/architecture.py compute_dtype: auto is bfloat16
    on GPU/TPU, float32 on a CPU); the manifest records the one used."""

    profile: str | None = None
    template: str | None = None
    sampling: SamplingConfig = SamplingConfig()
    batch_size: int = 16
    max_prompt_tokens: int | str = "auto"
    limit: int | None = None
    sample: int | None = None
    seed: int = 0
    per_bucket: int | None = None
    model_name: str | None = None
    budget_records: str | None = None
    budget_quantile: float = 0.99
    budget_margin: float = 1.2
    dtype: str = "auto"
    # the ceiling (sampling.max_new_tokens under budget_records) is BUDGET_CEILING, not given: a from-scratch
    # model's trained length may lower it (default_budgets). Not a setting of the answers: not recorded.
    budget_ceiling_chosen: bool = False


def stop_ids_of(tokenizer, chat) -> list[int]:
    """The tokens that end an answer: the template's end-of-turn tokens and the tokenizer's EOS."""
    stop_ids = [tokenizer.special_id(t) for t in chat.stop_tokens()]
    if tokenizer.eos_id is not None:
        stop_ids.append(tokenizer.eos_id)
    return stop_ids


def open_checkpoint(checkpoint, template: str | None, config: EngineConfig, dtype: str = "auto",
                    notes: list[str] | None = None):
    """(engine, tokenizer, chat template) for `checkpoint`: the parameters are loaded straight into their
    shardings and the sequences spread over data x fsdp; `template` None is the checkpoint's own
    (tokens/chat.py choose_template, which adds to `notes` a template other than that). On one device too
    the engine runs under a mesh, as the drift probe's does inside training: the programs are then traced
    alike and compiled once for both."""
    mesh = parallel.make_mesh()
    tokenizer = checkpoint_tokenizer(checkpoint)
    model = load_hf_checkpoint(checkpoint, dtype=compute_dtype(dtype), mesh=mesh)
    chat = get_template(choose_template(tokenizer, template, model.config.family, str(checkpoint), notes), tokenizer)
    return Engine(model, stop_ids_of(tokenizer, chat), config, mesh=mesh), tokenizer, chat


def run_name(checkpoint) -> str:
    """A checkpoint's name in predictions and /v1/models: its run folder (RUN/model -> RUN), with the run
    above it for a round of on-policy rounds (hdpo/round-2/model -> hdpo/round-2: every lineage has a
    round-2)."""
    folder = Path(str(checkpoint))
    run = folder.parent if folder.name == "model" else folder
    return f"{run.parent.name}/{run.name}" if re.fullmatch(r"round-\d+", run.name) and run.parent.name else run.name


def generate_predictions(checkpoint: Path, records_path: Path, out: Path, options: GenerateOptions = GenerateOptions(),
                         progress: bool = True, overwrite: bool = False) -> dict:
    """Writes one JSONL row per record: {id, prediction, model, finish_reason, new_tokens}. OUT.manifest.json
    records the settings, the records' digest and the checkpoint; predictions made with other settings are
    not replaced unless `overwrite`."""
    options = dataclasses.replace(options, dtype=compute_dtype(options.dtype))  # the one used, in the manifest
    budgeted = options.budget_records is not None
    prompt_tokens, answers, chosen = default_budgets(checkpoint, options.max_prompt_tokens,
                                                     options.sampling.max_new_tokens, budgeted,
                                                     options.budget_ceiling_chosen)
    options = dataclasses.replace(options, max_prompt_tokens=prompt_tokens,
                                  sampling=dataclasses.replace(options.sampling, max_new_tokens=answers))
    options, fitted = fitted_to_positions(checkpoint, options)
    fitted = [*chosen, *fitted]
    settings = {"checkpoint": recorded_path(checkpoint), "records": str(Path(records_path).resolve()),
                **asdict(options)}
    del settings["budget_ceiling_chosen"]  # how the ceiling came about; the ceiling itself is recorded
    # penalties and min_p recorded when asked for: predictions of earlier versions, made without them, match
    settings["sampling"] = asked_for(settings["sampling"])
    if options.per_bucket is None:  # predictions made before --per-bucket existed keep their settings
        del settings["per_bucket"]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with stage_output(out, sidecar(out), settings, overwrite, ours=[out], inputs={"records": records_path},
                      lock=OutputLock.for_file(out), paths=["checkpoint"]):
        return _generate_predictions(checkpoint, Path(records_path), Path(out), options, settings, progress, fitted)


PROMPT_TOKENS = 512  # the prompt budget where a checkpoint does not say how long it was trained
BUDGET_CEILING = 1024  # --max-new-tokens auto: the most tokens of any bucket, unless given or chosen to fit
PARTIAL_HEADER = "polyalign_partial"  # the first line of OUT.partial: what made the answers below it


def partial_path(out: Path) -> Path:
    """Where a run keeps its answers as they finish, until OUT is written whole."""
    return out.with_name(out.name + ".partial")


def resumed_answers(partial: Path, identity: dict, ids: set[str], notes: list[str]) -> dict[str, dict]:
    """The answers an interrupted run of the same settings, records and checkpoint kept in `partial`, by id
    (only the records this run answers), with a note; {} (and a note saying why) when it was made otherwise.
    A last line cut short by the interruption is left out."""
    if not partial.is_file():
        return {}
    lines = partial.read_text(encoding="utf-8").splitlines()
    try:
        header = json.loads(lines[0]) if lines else {}
    except ValueError:
        header = {}
    if not isinstance(header, dict) or header.get(PARTIAL_HEADER) != json.loads(json.dumps(identity, default=str)):
        notes.append(f"note: {partial} holds answers of an interrupted run with other settings, records or checkpoint; "
                     "starting over")
        return {}
    kept = {}
    for line in lines[1:]:
        try:
            answer = json.loads(line)
        except ValueError:
            continue
        if isinstance(answer, dict) and answer.get("id") in ids:
            kept[answer["id"]] = answer
    if kept:
        notes.append(f"resuming: {len(kept)} of {len(ids)} answers kept from an interrupted run of this command "
                     f"({partial}); {len(ids) - len(kept)} to go")
    return kept


def default_budgets(checkpoint, asked: int | str, answers: int, budgeted: bool = False, ceiling_chosen: bool = False
                    ) -> tuple[int, int, list[str]]:
    """The prompt budget and the answer budget, with a note for what was chosen here (default_prompt_budget).
    Per-bucket budgets whose ceiling was not given (`ceiling_chosen`) beside a chosen prompt budget share a
    from-scratch model's trained length with it: the ceiling is what the prompt leaves, said in the same note,
    rather than a ceiling that a second note then says runs past the positions the model learned."""
    prompt, notes = default_prompt_budget(checkpoint, asked, answers, budgeted)
    trained = trained_length(checkpoint)
    if not (budgeted and ceiling_chosen and notes and trained is not None and prompt + answers > trained):
        return prompt, answers, notes
    ceiling = trained - prompt
    where = never_trained_past(checkpoint, trained)
    return prompt, ceiling, [
        f"--max-prompt-tokens {prompt} and --budget-ceiling {ceiling} (chosen): {where}, half of them for the prompt "
        f"and the rest for the longest answer (give either to choose; {PROMPT_TOKENS} and {BUDGET_CEILING} where a "
        "model does not say)"]


def default_prompt_budget(checkpoint, asked: int | str, answers: int, budgeted: bool = False) -> tuple[int, list[str]]:
    """The prompt budget (--max-prompt-tokens) and a note when it was chosen here: `asked` where it is a
    number; for "auto", PROMPT_TOKENS, or for a model trained from scratch on sequences of L tokens (its
    tokenizer_config.json says L) what L leaves after `answers` (the answer budget, or with `budgeted` the
    per-bucket budgets' ceiling), at least half of L: a model never learned positions past L, and 512
    prompt tokens would send every long prompt there."""
    if asked != "auto":
        return int(asked), []
    trained = trained_length(checkpoint)
    if trained is None or PROMPT_TOKENS + answers <= trained:
        return PROMPT_TOKENS, []
    budget = max(trained - answers, trained // 2)
    share = (f"and {'--budget-ceiling' if budgeted else '--max-new-tokens'} {answers} leaves {budget} of them"
             if budget == trained - answers else "half of them for the prompt")
    return budget, [f"--max-prompt-tokens {budget} (chosen): {never_trained_past(checkpoint, trained)}, {share} "
                    f"(give --max-prompt-tokens to choose; {PROMPT_TOKENS} where a model does not say)"]


def fitted_to_positions(checkpoint, options: GenerateOptions) -> tuple[GenerateOptions, list[str]]:
    """`options` whose longest sequence (the prompt's tokens and the answer's) fits the checkpoint's
    positions, with what was changed to fit (`answer_room`)."""
    room, fitted = answer_room(checkpoint, options.max_prompt_tokens, options.sampling.max_new_tokens,
                               budgeted=options.budget_records is not None)
    if room == options.sampling.max_new_tokens:
        return options, fitted
    return dataclasses.replace(options, sampling=dataclasses.replace(options.sampling, max_new_tokens=room)), fitted


def answer_room(checkpoint, max_prompt_tokens: int, answers: int, budgeted: bool) -> tuple[int, list[str]]:
    """The answer budget that fits the checkpoint's positions after a prompt of `max_prompt_tokens`, with
    what was changed to fit: `answers` where it fits; per-bucket budgets' ceiling (`budgeted`: --max-new-tokens
    auto) lowered to the positions the prompt leaves (the budgets themselves are usually far below it); a
    fixed --max-new-tokens past them refused, since the user asked for that many."""
    longest = max_prompt_tokens + answers
    limit = position_limit(str(checkpoint))
    if limit is None or longest <= limit:
        return answers, []
    room = limit - max_prompt_tokens
    if budgeted and room > 0:
        return room, [f"--budget-ceiling {answers} lowered to {room}: the model has {limit} positions and "
                      f"--max-prompt-tokens takes {max_prompt_tokens}"]
    what = (f"--max-prompt-tokens {max_prompt_tokens} + {'--budget-ceiling' if budgeted else '--max-new-tokens'} "
            f"{answers} = {longest}")
    raise GenerationError(longer_than_positions(str(checkpoint), longest, what,
                                                "lower --max-prompt-tokens or --max-new-tokens"))


def past_trained_length(checkpoint, max_prompt_tokens: int, answers: int, budgeted: bool = False) -> str | None:
    """A note when the prompt budget and `answers` (--max-new-tokens, or with `budgeted` the largest
    per-bucket budget) reach past the longest sequence the checkpoint was trained on (a model polyalign
    trained from scratch records it): the positions there are ones it never learned, and answers degrade
    where long prompts take them. The budgets are the user's to change."""
    trained = trained_length(checkpoint)
    longest = max_prompt_tokens + answers
    if trained is None or longest <= trained:
        return None
    what = f"the largest per-bucket budget {answers}" if budgeted else f"--max-new-tokens {answers}"
    if trained - answers >= trained // 2:
        fix = f"--max-prompt-tokens {trained - answers} keeps within them"
    else:
        prompt = min(max_prompt_tokens, trained // 2)
        fix = (f"--max-prompt-tokens {prompt} and {'--budget-ceiling' if budgeted else '--max-new-tokens'} "
               f"{trained - prompt} keep within them")
    return (f"{never_trained_past(checkpoint, trained)}; --max-prompt-tokens {max_prompt_tokens} + {what} = "
            f"{longest} lets a long prompt and its answer run past them, into positions the model never learned: "
            f"{fix} (a prompt cut shorter loses its opening system message where that takes over half of it)")


def say_checkpoint_sampling(checkpoint, sampling: SamplingConfig, notes: list[str]) -> None:
    """A note when greedy decoding meets a checkpoint whose generation_config.json samples: vLLM (and
    `serve`) decode its requests with its temperature, so answers from there differ from these."""
    theirs = checkpoint_sampling(checkpoint)
    if sampling.temperature == 0 and theirs.get("temperature", 0) > 0:
        notes.append(f"{Path(str(checkpoint)) / 'generation_config.json'} sets {describe_sampling(theirs)}: vLLM and "
                     f"`polyalign serve` sample with them for requests that set none; these answers are greedy "
                     f"(--temperature 0, the default): give --temperature {theirs['temperature']:g} to decode as "
                     "they do (`generate` takes the file's other settings that are not given)")


def say_tokenizer_reading(checkpoint, tokenizer, records, consequence: str, notes: list[str]) -> None:
    """A warning where transformers (vLLM, SGLang) reads the checkpoint's tokenizer with other ids than
    polyalign on the records' own texts: the training and export checks said so before, this says it where
    the answers or prompts are made."""
    if is_uri(str(checkpoint)):
        return
    warning = check_folder(checkpoint, tokenizer, probe_texts(spread_records(records)), consequence)
    notes += [f"warning: {warning}"] if warning else []


def _generate_predictions(checkpoint, records_path: Path, out: Path, options: GenerateOptions, settings: dict,
                          progress: bool, fitted: list[str]) -> dict:
    started = time.perf_counter()
    records, notes = select_records(read_records(records_path), records_path, options.limit, options.sample,
                                    options.seed, options.per_bucket)
    notes = [*fitted, *notes]

    engine, tokenizer, chat = open_checkpoint(
        checkpoint, options.template,
        EngineConfig(slots=options.batch_size,
                     max_sequence=options.max_prompt_tokens + options.sampling.max_new_tokens), options.dtype, notes)
    name = options.model_name or run_name(checkpoint)
    say_checkpoint_sampling(checkpoint, options.sampling, notes)
    say_tokenizer_reading(checkpoint, tokenizer, records, GENERATE_CONSEQUENCE, notes)
    budgets = None
    if options.budget_records is not None:
        budgets = bucket_budgets(read_records(options.budget_records), tokenizer.encode, options.budget_quantile,
                                 options.budget_margin, ceiling=options.sampling.max_new_tokens)
    past = past_trained_length(checkpoint, options.max_prompt_tokens, options.sampling.max_new_tokens if budgets is None
                               else budgets.fallback, budgeted=budgets is not None)
    notes += [past] if past else []
    # each record as the checkpoint was trained to read it (its export's profile and system mode)
    profile = trained_profile(tokenizer, options.profile, str(checkpoint), notes)
    say_unseen_profile_values(tokenizer, records, profile, str(checkpoint), notes)
    messages = [record_messages(record, profile, with_response=False, system=tokenizer.system_mode)
                for record in records]
    prompts = [cut_prompt(chat, tokenizer, m, options.max_prompt_tokens) for m in messages]
    requests = [Request(ids, options.sampling if budgets is None else
                        dataclasses.replace(options.sampling, max_new_tokens=budgets(record.bucket_id)),
                        seed=request_seed(record.id, options.seed)) for record, (ids, *_) in zip(records, prompts)]

    def row(record, completion) -> dict:
        prediction = tokenizer.decode(completion.tokens, skip_special=True).strip()  # no chat markers in the text
        return {"id": record.id, "prediction": prediction, "model": name, "finish_reason": completion.finish_reason,
                "new_tokens": len(completion.tokens), "profile": profile}

    # Each answer is kept the moment it finishes, so that the same command after an interruption answers
    # only the rest: a request's answer depends on its record and seed alone, never on its batch.
    partial = partial_path(out)
    identity = {"settings": settings_record(settings), "records": file_digest(records_path),
                "checkpoint": checkpoint_identity(checkpoint)}
    kept = resumed_answers(partial, identity, {record.id for record in records}, notes)
    todo = [i for i, record in enumerate(records) if record.id not in kept]
    with partial.open("a" if kept else "w", encoding="utf-8") as keeping, \
            progress_bar(total=len(records), progress=progress, desc="generate", unit="rec", initial=len(kept)) as bar:
        if not kept:
            keeping.write(json.dumps({PARTIAL_HEADER: identity}, ensure_ascii=False, default=str) + "\n")

        def each(index: int, completions) -> None:
            keeping.write(json.dumps(row(records[todo[index]], completions[0]), ensure_ascii=False) + "\n")
            keeping.flush()

        completions = engine.generate([requests[i] for i in todo], progress=bar.update, each=each)
    answered = {records[i].id: row(records[i], completion) for i, (completion,) in zip(todo, completions)}
    rows = [kept.get(record.id) or answered[record.id] for record in records]
    with out.open("w", encoding="utf-8") as handle:
        for one in rows:
            handle.write(json.dumps(one, ensure_ascii=False) + "\n")
    partial.unlink()
    seconds = time.perf_counter() - started
    new_tokens = sum(row["new_tokens"] for row in rows)
    counts = {reason: sum(row["finish_reason"] == reason for row in rows) for reason in (FINISH_STOP, FINISH_LENGTH)}
    # the template and profile the prompts were rendered with (settings keep what was asked, None for the default)
    summary = {"records": len(records), "template": chat.name, "profile": profile, "system": tokenizer.system_mode,
               "max_prompt_tokens": options.max_prompt_tokens, "finish_reasons": counts, "new_tokens": new_tokens,
               "empty": sum(1 for row in rows if not row["prediction"]),
               # answers of punctuation alone ("，，，，"): evaluate finds no word in them either
               "without_words": sum(1 for row in rows if without_words(row["prediction"])),
               # of them, the ones that ended the turn at once (no token before the end of the turn) and the ones
               # that decoded whitespace until the budget (the others decoded whitespace, then ended the turn)
               "empty_at_once": sum(1 for row in rows if not row["prediction"] and row["new_tokens"] == 0
                                    and row["finish_reason"] == FINISH_STOP),
               "empty_at_budget": sum(1 for row in rows
                                      if not row["prediction"] and row["finish_reason"] == FINISH_LENGTH),
               "prompts_cut": sum(p.cut for p in prompts),  # oldest whole turns dropped (chat.py cut_prompt)
               # of them, the ones still over with the last question alone (cut inside it, keeping its end), those
               # that lost whole turns, and those whose opening system message went too (over half the budget)
               "prompts_cut_mid_turn": sum(p.mid_turn for p in prompts),
               "prompts_cut_turns_dropped": sum(lost_whole_turns(m, p.messages) for p, m in zip(prompts, messages)),
               "prompts_cut_system_lost": sum(p.system_lost for p in prompts),
               "seconds": round(seconds, 1), "tokens_per_s": round(new_tokens / seconds, 1), "out": str(out),
               "truncated_by_bucket": truncation_by_bucket([r.bucket_id for r in records],
                                                           [row["finish_reason"] for row in rows]),
               "engine": engine.stats, "notes": notes}
    if budgets is not None:
        summary["budgets"] = {"by_bucket": budgets.by_bucket, "other_buckets": budgets.fallback,
                              "records": options.budget_records}
    write_record(sidecar(out), settings, {"records": file_digest(records_path),
                                          "checkpoint": checkpoint_identity(checkpoint)}, summary=summary)
    return summary
