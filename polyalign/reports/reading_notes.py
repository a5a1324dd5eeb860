"""Sentences a reader needs beside an evaluation's numbers, where they hold: one answer that makes much of
the BNG macro, answers written in another language's script than their conversation's, macros that count
buckets too small for intervals, multi-turn buckets TDM leaves out, a detectability below people's own.
evaluate prints them, and the evaluation and comparison reports write them."""

from __future__ import annotations

from polyalign.core.scores import interval_text
from polyalign.core.wording import counted
from polyalign.data.language import SCRIPT_WORDS


def one_answer_text(found: dict) -> str:
    """The finding of evaluate's `one_answer_of_macro` (metrics.json bng.one_answer) in words."""
    return (f"one answer makes much of the BNG macro: {found['bng_macro']:.4f}, {found['bng_macro_without']:.4f} "
            f"without the answer to {found['id']} ({found['characters']:,} characters where people in "
            f"{found['bucket']} write a median {found['people_characters_median']:,}; that bucket's BNG "
            f"{found['bucket_bng']:.4f}, {found['bucket_bng_without']:.4f} without it, {found['bucket_rows']} rows); "
            "BNG weighs every answer by its distance, so read the macro with this answer in mind")


def wrong_script_text(section: dict) -> str | None:
    """metrics.json answers.wrong_script in words; None where no answer is in another script."""
    if not section or not section.get("answers"):
        return None
    parts = [f"{n} {language} in {SCRIPT_WORDS.get(script, script)}"
             for language, scripts in section["by_language"].items() for script, n in sorted(scripts.items())]
    n = section["answers"]
    return (f"{n} of {section['rows']} answers {'are' if n != 1 else 'is'} written in another "
            f"language's script than {'their' if n != 1 else 'its'} conversation's ({', '.join(parts)}; people's "
            f"own answers: {section['people']}), e.g. {', '.join(section['ids'][:3])}; every metric scores them as "
            "they are")


def tdm_coverage_text(tdm: dict) -> str | None:
    """Which multi-turn buckets TDM's macro is over, where it leaves some out (under 20 rows, as METHOD
    defines it); None where it covers every one (or there is no TDM)."""
    left = tdm.get("left_out") or {}
    if tdm.get("overall_macro") is None or not left:
        return None
    measured = tdm["by_bucket"]
    rows = sum(b["rows"] for b in measured.values())
    listed = ", ".join(f"{b} ({counted(n, 'row')})" for b, n in left.items())
    return (f"TDM is over {len(measured)} of {len(measured) + len(left)} multi-turn buckets ({rows} of {tdm['rows']} "
            f"rows): {listed} "
            f"{'is' if len(left) == 1 else 'are'} under {tdm['min_bucket_rows']} rows and left out")


def below_people_text(detect: dict) -> str | None:
    """Detectability whose interval lies wholly below people's floor: not more human than human, but answers a
    classifier cannot tell from the human ones they sit beside, as copies of people's texts are (retrieved or
    reused answers). None where it does not, or either has no interval."""
    model, floor = detect.get("macro_interval"), detect.get("floor_macro_interval")
    if detect.get("status") != "computed" or not model or not floor or model[1] >= floor[0]:
        return None
    return (f"detectability {detect['overall_macro']:.4f} {interval_text(model)} lies below people's own "
            f"{detect['floor_macro']:.4f} {interval_text(floor)}: the classifier tells these answers from "
            "people's less well than people's from each other, as when answers repeat people's own texts (copied "
            "or retrieved answers); read it as that, not as more human than people")


def small_buckets_text(metrics: dict) -> str | None:
    """Buckets too small for an interval of their own (under min_interval_rows test rows) that the BNG and HCR
    macros count as fully as any other: their few answers carry no spread, so the macros' intervals
    understate the noise, and a macro can rest on one answer (a 1-row bucket at HCR 1.0 made a macro of
    0.1000 [0.100, 0.100] over ten buckets). None where there are none."""
    bng, hcr = metrics.get("bng") or {}, metrics.get("hcr") or {}
    small = sorted(set(bng.get("small_buckets") or []) | set(hcr.get("small_buckets") or []))
    if not small or bng.get("overall_macro") is None:
        return None
    rows = {b: (metrics.get("buckets") or {}).get(b, {}).get("rows") for b in small}
    weighted = "; ".join(f"{name} weighted by test rows {section['overall_weighted']:.4f}"
                         for name, section in (("BNG", bng), ("HCR", hcr))
                         if isinstance(section.get("overall_weighted"), float))
    listed = ", ".join(f"{b} ({counted(n, 'row')})" for b, n in rows.items())
    return (f"the BNG and HCR macros count {len(small)} of {bng.get('buckets', len(small))} buckets with fewer than "
            f"{bng.get('min_interval_rows')} test rows ({listed}) as "
            "fully as any other, and their few answers carry no spread of their own: the macros' intervals "
            "understate the noise" + (f" ({weighted}, which weigh those buckets by their rows)" if weighted else ""))


def notes_for_reader(result: dict) -> list[tuple[str, bool]]:
    """What a reader needs beside an evaluation's numbers (metrics.json as `result`), as sentences, each with
    whether it warns (an answer or a number to distrust) or informs (what a number covers)."""
    found = result["metrics"]["bng"].get("one_answer")
    wrong = (result.get("answers") or {}).get("wrong_script") or {}
    return [(text, warns) for text, warns in (
        (one_answer_text(found) if found else None, True),
        # as many as people's own (code-switching in the data) informs; more warns
        (wrong_script_text(wrong), wrong.get("answers", 0) > wrong.get("people", 0)),
        (below_people_text(result["metrics"].get("detectability") or {}), True),
        (small_buckets_text(result["metrics"]), False),
        (tdm_coverage_text(result["metrics"].get("tdm") or {}), False)) if text]

