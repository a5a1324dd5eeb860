"""Progress: a bar on a terminal, plain lines now and then in a log, nothing when the user turns it off."""

import io

from polyalign.core import progress as progress_module
from polyalign.core.progress import progress_bar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_bar_on_a_terminal_lines_in_a_log_and_nothing_with_no_progress():
    terminal, log, quiet = Terminal(), io.StringIO(), Terminal()
    for stream, progress in ((terminal, True), (log, True), (quiet, False)):
        assert list(progress_bar(range(3), progress=progress, file=stream, desc="work")) == [0, 1, 2]
    assert "\r" in terminal.getvalue() and "work: 100%" in terminal.getvalue()
    # a log holds whole lines, no carriage returns and no bar, from the start to the end
    lines = log.getvalue().splitlines(keepends=True)
    assert "\r" not in log.getvalue() and all(line.endswith("\n") and line.strip() for line in lines)
    assert lines[0].startswith("work: 0/3 [") and lines[-1].startswith("work: 3/3 [") and "█" not in log.getvalue()
    assert quiet.getvalue() == ""


def test_a_log_gets_a_line_per_interval_however_many_updates(monkeypatch):
    """Thousands of updates within one interval write the first line and the last, whatever the postfix
    does between them; an iterable of unknown length says how far it got."""
    monkeypatch.setattr(progress_module, "LOG_LINE_SECONDS", 3600.0)
    log = io.StringIO()
    bar = progress_bar(total=5000, progress=True, file=log, desc="train", unit="step")
    for step in range(5000):
        bar.set_postfix(loss=f"{1 / (step + 1):.4f}", refresh=False)
        bar.update(1)
    bar.close()
    first, last = log.getvalue().splitlines()
    assert first.startswith("train: 0/5000 [") and last.startswith("train: 5000/5000 [") and "loss=0.0002" in last
    log = io.StringIO()
    assert sum(1 for _ in progress_bar(iter(range(7)), progress=True, file=log, desc="generate", unit="rec")) == 7
    assert log.getvalue().splitlines()[-1].startswith("generate: 7 [")


def test_a_bar_an_error_leaves_writes_no_line_after_it(monkeypatch):
    """The error's message is the last thing a failed command prints: a bar the failed function held
    writes nothing more when it is collected, after the message."""
    import gc

    monkeypatch.setattr(progress_module, "LOG_LINE_SECONDS", 3600.0)
    log = io.StringIO()

    def import_rows():
        bar = progress_bar(total=10, progress=True, file=log, desc="import", unit="source")
        for row in range(10):
            if row == 4:
                raise ValueError("row 4")
            bar.update(1)
        bar.close()

    try:
        import_rows()
    except ValueError as error:  # the traceback holds the bar until the message is out
        log.write(f"polyalign prepare: error: {error}\n")
    gc.collect()
    assert log.getvalue().splitlines() == [log.getvalue().splitlines()[0], "polyalign prepare: error: row 4"]


def test_work_every_process_does_alike_shows_one_bar(demo_run, demo_tokenizer, monkeypatch, capsys):
    """The critic's encoding and the reference log-probs run on every process of a launched run: process 0
    alone shows their bar (each process printed it)."""
    import jax

    from polyalign.data.records import read_records
    from polyalign.model import create_model
    from polyalign.model.pooling import encode_responses
    from tests.conftest import tiny_model_config

    answers = [r.response for r in read_records(demo_run[0] / "data" / "test.jsonl")[:4]]
    tokenizer = demo_tokenizer[0]
    model = create_model(tiny_model_config(tokenizer.vocab_size))
    for index, shown in ((0, True), (1, False)):
        monkeypatch.setattr(jax, "process_index", lambda index=index: index)
        encode_responses(model, tokenizer, answers, 16, 2, progress=True)
        assert ("encode: " in capsys.readouterr().err) == shown
