"""The console's copy of the workers' stderr (agent/console.py): a traceback is held until what
follows it says whether it belongs to a failure the run recovers from."""

from __future__ import annotations

import io
import time
from pathlib import Path

import pytest

from elasticft.agent.console import GatedTailLog, TracebackHold

pytestmark = pytest.mark.timeout(30)

GLOO = [
    "[rank0]: Traceback (most recent call last):\n",
    '[rank0]:   File "train.py", line 201, in main\n',
    "[rank0]:     loss.backward()\n",
    "[rank0]:            ^^^^^^^^\n",
    "[rank0]: RuntimeError: [pair.cc:537] Read error: Connection reset by peer\n",
    "\n",
    "[rank0]: At:\n",
    "[rank0]:   recorder.py(432): done\n",
]
CHAINED = [
    "Traceback (most recent call last):\n", '  File "a.py", line 1, in f\n',
    "KeyError: 'x'\n", "\n",
    "During handling of the above exception, another exception occurred:\n", "\n",
    "Traceback (most recent call last):\n", '  File "a.py", line 3, in f\n',
    "ValueError: bad\n",
]


@pytest.mark.parametrize(("lines", "show_at_end", "shown"), [
    (["step 1\n", "step 2\n"], False, ["step 1\n", "step 2\n"]),  # no traceback: as written
    (["step 1\n", *GLOO], False, ["step 1\n"]),  # the run goes on: left out
    (["step 1\n", *GLOO], True, ["step 1\n", *GLOO]),  # the run stops: in full
    (CHAINED, False, []),  # a chained traceback is one
    (CHAINED, True, CHAINED),
    # Printed by the script, which goes on writing: shown, the next line after it.
    ([*GLOO[:5], "retrying\n"], False, [*GLOO[:5], "retrying\n"]),
    ([*CHAINED, "step 3\n", *GLOO], False, [*CHAINED, "step 3\n"]),
])
def test_a_traceback_is_shown_when_the_rank_goes_on_or_the_run_stops(
        lines: list[str], show_at_end: bool, shown: list[str]) -> None:
    hold = TracebackHold()
    out = [line for each in lines for line in hold.feed(each)]
    assert out + hold.end(show=show_at_end) == shown


def tail_console(log: Path, run_goes_on: bool) -> str:
    """What a :class:`GatedTailLog` of ``log`` writes to the console: a step, then a
    survivor's traceback, then the workers stop."""
    console = io.StringIO()
    tail = GatedTailLog("default", {0: str(log)}, console, interval_s=0.01).start()
    log.write_text("step 1\n" + "".join(GLOO))
    deadline = time.monotonic() + 10
    while "step 1" not in console.getvalue():
        assert time.monotonic() < deadline, "the tail copied nothing"
        time.sleep(0.01)
    tail.run_goes_on = run_goes_on
    tail.stop()
    return console.getvalue()


@pytest.mark.parametrize(("run_goes_on", "expected"), [
    (True, "[default0]:step 1\n"),
    (False, "[default0]:step 1\n" + "".join(f"[default0]:{line}" for line in GLOO)),
])
def test_the_tail_leaves_out_a_recovered_failures_traceback_and_shows_a_stopping_one(
        tmp_path: Path, run_goes_on: bool, expected: str) -> None:
    assert tail_console(tmp_path / "stderr.log", run_goes_on) == expected


def test_torchs_closing_signal_line_is_left_out_only_while_the_run_goes_on(
        tmp_path: Path) -> None:
    import inspect
    import logging

    from elasticft.agent import console
    from elasticft.torch_compat import SubprocessContext

    assert console.CLOSING_SIGNAL in inspect.getsource(SubprocessContext._close)
    assert SubprocessContext.__module__ == console.TORCH_LOGGER
    tail = GatedTailLog("default", {}, None).start()
    line = logging.LogRecord(console.TORCH_LOGGER, logging.WARNING, "api.py", 1,
                             console.CLOSING_SIGNAL + " %s", (12, "SIGTERM"), None)
    torch_logger = logging.getLogger(console.TORCH_LOGGER)
    assert torch_logger.filter(line)
    tail.run_goes_on = True
    assert not torch_logger.filter(line)
    tail.stop()
    assert torch_logger.filter(line)
