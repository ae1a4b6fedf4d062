"""The order of killing, reaping and replacing a failed worker in in-process recovery: on a CPU
node the replacement does not wait for the dead process's teardown; on a GPU node it does."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from elasticft.agent.replace import replace_after_kill

pytestmark = pytest.mark.timeout(60)


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def test_the_replacement_starts_before_the_reap_and_the_process_is_reaped_after() -> None:
    proc = _sleeper()
    seen: list[int | None] = []

    result = replace_after_kill([proc], 30.0, False, lambda: seen.append(proc.returncode) or 7)

    assert result == 7
    assert seen == [None]  # not reaped yet when the replacement started
    deadline = time.monotonic() + 30
    while proc.returncode is None and time.monotonic() < deadline:
        time.sleep(0.01)  # the background reap sets it
    assert proc.returncode == -9


def test_with_reap_first_the_replacement_starts_after_the_process_ended() -> None:
    proc = _sleeper()
    seen: list[int | None] = []

    replace_after_kill([proc], 30.0, True, lambda: seen.append(proc.returncode))

    assert seen == [-9]


def test_a_failed_replacement_still_reaps_the_killed_process() -> None:
    proc = _sleeper()

    def fail() -> None:
        raise RuntimeError("no replacement")

    with pytest.raises(RuntimeError, match="no replacement"):
        replace_after_kill([proc], 30.0, False, fail)
    deadline = time.monotonic() + 30
    while proc.returncode is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.returncode == -9
