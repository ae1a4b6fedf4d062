"""Process facts from a pid, on real processes: running, stopped, zombie, reaped."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import time

from elasticft import procs


def _wait_state(pid: int, wanted: set[str]) -> str | None:
    deadline = time.monotonic() + 10
    while (current := procs.state(pid)) not in wanted and time.monotonic() < deadline:
        time.sleep(0.01)
    return current


def test_states_of_a_child_through_its_life() -> None:
    child = subprocess.Popen(["sleep", "60"])
    try:
        # A process just started may be in D for a moment (its executable still paging in):
        # wait for the sleep itself.
        assert _wait_state(child.pid, {"S"}) == "S"
        assert procs.responsive(child.pid) and not procs.gone(child.pid)
        child.send_signal(signal.SIGSTOP)
        assert _wait_state(child.pid, {"T"}) == "T"
        assert not procs.responsive(child.pid) and procs.exists(child.pid)
        child.send_signal(signal.SIGKILL)
        assert _wait_state(child.pid, {"Z"}) == "Z"  # not reaped yet: a zombie, still a pid
        assert not procs.responsive(child.pid) and not procs.exists(child.pid)
        assert not procs.gone(child.pid)
    finally:
        child.kill()
        child.wait()
    assert procs.state(child.pid) is None and procs.gone(child.pid)


def test_no_pid_and_our_own() -> None:
    assert procs.state(None) is None and procs.state(0) is None and not procs.responsive(None)
    assert procs.state(os.getpid()) == "R"


def test_exit_status_of_a_zombie_child() -> None:
    child = subprocess.Popen(["sh", "-c", "exit 3"])
    _wait_state(child.pid, {"Z"})
    status = procs.exit_status(child.pid)
    assert status is not None and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 3
    child.wait()
    assert procs.exit_status(child.pid) == 0  # reaped: ended, status no longer known
    running = subprocess.Popen(["sleep", "60"])
    try:
        assert procs.exit_status(running.pid) is None
    finally:
        running.kill()
        running.wait()


def test_ending_status_from_the_start_of_an_exit_to_the_reap() -> None:
    with subprocess.Popen(["sleep", "60"]) as running:
        assert procs.ending_status(running.pid) is None
        running.kill()
        assert _wait_state(running.pid, {"Z"}) == "Z"
        assert procs.ending_status(running.pid) == signal.SIGKILL  # a wait status
        running.wait()
    failed = subprocess.Popen(["sh", "-c", "exit 3"])
    assert _wait_state(failed.pid, {"Z"}) == "Z"
    assert os.waitstatus_to_exitcode(procs.ending_status(failed.pid) or 0) == 3
    failed.wait()
    assert procs.ending_status(failed.pid) is None  # reaped: no such process


def test_a_process_start_time_is_to_the_tick_not_to_the_second():
    before = time.time()
    child = subprocess.Popen(["sleep", "30"])
    after = time.time()
    try:
        tick = 1 / os.sysconf("SC_CLK_TCK")
        assert before - tick <= procs.started_at(child.pid) <= after + tick
    finally:
        child.kill()
        child.wait()


def test_a_kill_cuts_one_wait_short_and_only_one() -> None:
    """The agent's wait between polls returns with the pid killed by a signal; the same death,
    not yet reaped, does not cut the next wait short (the agent would spin), and neither does a
    running process or one that exited with a status (maybe a victim of the other's failure)."""
    watch = procs.ExitWatch()
    running = subprocess.Popen(["sleep", "60"])
    dying = subprocess.Popen(["sleep", "60"])
    failing = subprocess.Popen(["sh", "-c", "exit 3"])
    try:
        assert _wait_state(failing.pid, {"Z"}) == "Z"
        watched = [running.pid, dying.pid, failing.pid]
        assert watch.wait(watched, 0.1) == set()
        dying.kill()
        killed: set[int] = set()
        deadline = time.monotonic() + 30
        while not killed and time.monotonic() < deadline:
            killed = watch.wait(watched, 1.0)
        assert killed == {dying.pid}
        assert procs.state(dying.pid) == "Z"  # not reaped: it still reads as exited
        assert watch.wait(watched, 0.05) == set()
    finally:
        watch.close()
        for child in (running, dying, failing):
            child.kill()
            child.wait()


def test_imports_run_without_collections_and_the_collector_comes_back_as_it_was() -> None:
    try:
        for enabled_before in (True, False):
            (gc.enable if enabled_before else gc.disable)()
            with procs.no_collection_while_importing():
                assert not gc.isenabled()
            assert gc.isenabled() == enabled_before
    finally:
        gc.enable()
