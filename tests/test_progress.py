"""Progress bars: shown on a terminal, never in a log file or when the user turns them off."""

import io

from polyalign.core.progress import progress_bar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bars_draw_on_a_terminal_only_and_never_with_no_progress():
    for stream, progress, drawn in ((Terminal(), True, True), (io.StringIO(), True, False),
                                    (Terminal(), False, False)):
        assert list(progress_bar(range(3), progress=progress, file=stream, desc="work")) == [0, 1, 2]
        assert ("work: 100%" in stream.getvalue()) == drawn, (progress, type(stream).__name__)
