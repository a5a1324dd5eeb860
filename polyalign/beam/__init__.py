"""Apache Beam versions of `polyalign prepare` and `polyalign build`, for corpora that outgrow one machine.

The same steps as the single-machine path, as Beam transforms: importing is a map per source file,
group protection and exact dedup are group-bys (on the conversation key and on the content key),
near-duplicates meet through MinHash band keys, and bucketing, splitting and tokenising are per-record
maps. Runs on any Beam runner: DirectRunner here and in tests; Dataflow, Flink or Spark at scale
(docs/scale.md). Needs the optional extra: `pip install 'polyalign[beam]'`.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shlex
from collections.abc import Iterator
from typing import Any

from polyalign.core.errors import ConfigError, PolyalignError
from polyalign.core.extras import require


class _UserErrorFilter(logging.Filter):
    """Beam's runner logs every exception a transform raises with its traceback before re-raising
    it; a problem the user can fix (a bad row, a missing extra) reaches the CLI's one line instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], PolyalignError))


_USER_ERRORS = _UserErrorFilter()


class _ImportNoiseFilter(logging.Filter):
    """apache_beam warns on the root logger at import that its BigQuery clients are missing: polyalign
    reads and writes no BigQuery, and the line read as a problem with the run (a user asked)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name == "root" and str(record.msg).startswith("apitools not found"))


_IMPORT_NOISE = _ImportNoiseFilter()


def require_beam():
    root = logging.getLogger()
    if _IMPORT_NOISE not in root.filters:
        root.addFilter(_IMPORT_NOISE)
    beam = require("apache_beam", "beam", "--beam (Apache Beam)",
                   "in an environment of its own: apache-beam pins older protobuf and pyarrow; add "
                   "apache-beam[gcp] for Dataflow")
    runner_log = logging.getLogger("apache_beam.runners.common")
    if _USER_ERRORS not in runner_log.filters:
        runner_log.addFilter(_USER_ERRORS)
    return beam


def pipeline_options(flags: str | None) -> Any:
    """Beam PipelineOptions from a command-line string such as
    "--runner=DataflowRunner --project=P --region=R --temp_location=gs://B/tmp"; DirectRunner by default."""
    beam = require_beam()
    args = shlex.split(flags or "")
    if not any(a == "--runner" or a.startswith("--runner=") for a in args):
        args.append("--runner=DirectRunner")
    options = beam.options.pipeline_options.PipelineOptions(args)
    # Elements are plain dataclasses defined in polyalign; workers import polyalign rather than unpickle
    # the main session.
    options.view_as(beam.options.pipeline_options.SetupOptions).save_main_session = False
    return options


def without_step(text: str) -> str:
    """An error's message less the step the DirectRunner appends when it re-raises it from a transform."""
    return re.sub(r"\s*\[while running '.*'\]$", "", text).strip()


@contextlib.contextmanager
def runner_errors() -> Iterator[None]:
    """What a runner wraps, as the single-machine path raises it: Ctrl-C (the DirectRunner re-raises it as a
    RuntimeError naming the step) as KeyboardInterrupt, so the command says `interrupted` and exits 130, and a
    runner Beam does not know (`--beam-options=--runner=...`) as one line naming the option."""
    try:
        yield
    except PolyalignError as err:
        text = without_step(str(err))
        if text == str(err):
            raise
        try:
            again = type(err)(text)
        except TypeError:  # an error class that takes more than its message
            raise err from None
        again.__dict__.update(err.__dict__)  # what it carries besides its message (a JsonProblem's line)
        raise again from None
    except Exception as err:
        text = str(err)
        if "KeyboardInterrupt" in text:
            raise KeyboardInterrupt from None
        if isinstance(err, ValueError) and "runner" in text.lower():
            raise ConfigError(f"--beam-options: {text.strip().splitlines()[0]}") from None
        raise
