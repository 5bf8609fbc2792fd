"""The fault suite prints one timing line per fault; the summary repeats them at the end of the run."""

from __future__ import annotations

import pytest

from .helpers import TIMINGS


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if TIMINGS:
        terminalreporter.section("fault timings (fault -> final state)")
        for line in TIMINGS:
            terminalreporter.write_line(line)
