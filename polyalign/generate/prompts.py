"""`polyalign prompts`: the exact prompts polyalign would generate from, for an external engine.

One row per record: {"id", "messages", "prompt"}. `messages` are the chat messages polyalign renders
(the profile system prompt included), for engines that apply the chat template themselves (vLLM's
chat API, SGLang); `prompt` is the rendered string ending with the assistant header, for engines
given raw text. Either way the answers, as rows {"id", "prediction"}, feed `polyalign pairs` and
`polyalign evaluate` unchanged (docs/evaluation.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from polyalign.core.errors import GenerationError
from polyalign.core.outputs import OutputLock, sidecar, stage_output, write_record
from polyalign.core.paths import file_digest, recorded_path
from polyalign.data.records import read_records
from polyalign.generate.selection import select_records
from polyalign.model.architecture import checkpoint_family
from polyalign.tokens.chat import (
    PROFILE_MODES,
    choose_template,
    fold_system,
    get_template,
    record_messages,
    say_unseen_profile_values,
    trained_profile,
)
from polyalign.tokens.tokenizer import load_tokenizer


def write_prompts(checkpoint, records_path: Path, out: Path, *, profile: str | None = None, template: str | None = None,
                  limit: int | None = None, sample: int | None = None, seed: int = 0,
                  overwrite: bool = False) -> dict[str, Any]:
    if profile is not None and profile not in PROFILE_MODES:
        raise GenerationError(f"profile must be one of {', '.join(PROFILE_MODES)}, got {profile!r}")
    records_path, out = Path(records_path), Path(out)
    settings = {"checkpoint": recorded_path(checkpoint), "records": str(records_path.resolve()), "profile": profile,
                "template": template, "limit": limit,
                # only when sampled, so that prompts written before --sample existed keep their settings
                **({"sample": sample, "seed": seed} if sample is not None else {})}
    with stage_output(out, sidecar(out), settings, overwrite, ours=[out], inputs={"records": records_path},
                      lock=OutputLock.for_file(out), paths=["checkpoint"]):
        tokenizer = load_tokenizer(checkpoint)
        records, notes = select_records(read_records(records_path), records_path, limit, sample, seed)
        profile = trained_profile(tokenizer, profile, str(checkpoint), notes)
        say_unseen_profile_values(tokenizer, records, profile, str(checkpoint), notes)
        name = choose_template(tokenizer, template, checkpoint_family(checkpoint), str(checkpoint), notes)
        chat = get_template(name, tokenizer)
        with out.open("w", encoding="utf-8") as handle:
            for record in records:
                messages = record_messages(record, profile, with_response=False, system=tokenizer.system_mode)
                # an engine applying a template that refuses system messages gets them folded, as trained
                sent = messages if chat.takes_system else [m for _, m in fold_system(messages)]
                row = {"id": record.id, "messages": [{"role": m.role, "content": m.content} for m in sent],
                       "prompt": chat.render(messages, add_generation_prompt=True)}
                handle.write(json.dumps(row, ensure_ascii=False) + "\n")
        summary = {"records": len(records), "template": name, "profile": profile, "system": tokenizer.system_mode,
                   "stop": list(chat.stop_tokens()), "out": str(out),
                   "notes": notes}
        write_record(sidecar(out), settings, {"records": file_digest(records_path)}, summary=summary)
    return summary
