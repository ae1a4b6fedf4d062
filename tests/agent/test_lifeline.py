"""Workers die with their agent: a SIGKILLed agent leaves no worker running, warm-forked or
cold, and an agent that starts ends the strays of its job (real processes, real signals)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elasticft import procs
from elasticft.agent import lifeline
from tests.conftest import BIN

HERE = Path(__file__).parent


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.mark.parametrize(("environ", "parent", "agent_alive", "stray"), [
    ({"TORCHELASTIC_RUN_ID": "j", "ELASTICFT_AGENT_PID": "10"}, 1, False, True),
    ({"TORCHELASTIC_RUN_ID": "j", "ELASTICFT_AGENT_PID": "10"}, 10, True, False),   # supervised
    ({"TORCHELASTIC_RUN_ID": "j", "ELASTICFT_AGENT_PID": "10"}, 7, True, False),    # mid-fork
    ({"TORCHELASTIC_RUN_ID": "k", "ELASTICFT_AGENT_PID": "10"}, 1, False, False),   # other job
    ({"TORCHELASTIC_RUN_ID": "j"}, 1, False, False),                # not started by an agent
    ({"TORCHELASTIC_RUN_ID": "j", "ELASTICFT_AGENT_PID": "x"}, 1, False, False),
    ({"TORCHELASTIC_RUN_ID": "j", "ELASTICFT_AGENT_PID": "10"}, None, False, False),  # gone
])
@pytest.mark.timeout(10)
def test_a_stray_is_a_worker_of_the_job_whose_agent_is_gone_and_not_its_parent(
        environ: dict[str, str], parent: int | None, agent_alive: bool, stray: bool) -> None:
    assert lifeline.is_stray(environ, parent, "j", lambda pid: agent_alive) is stray


@pytest.mark.timeout(60)
def test_an_agent_ends_the_strays_of_its_job_and_says_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    env = {**os.environ, "TORCHELASTIC_RUN_ID": f"strays-{os.getpid()}",
           "ELASTICFT_AGENT_PID": str(gone.pid)}
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    stray = subprocess.Popen(sleeper, env=env, start_new_session=True)
    other_job = subprocess.Popen(sleeper, env={**env, "TORCHELASTIC_RUN_ID": "another"},
                                 start_new_session=True)
    try:
        wait_until(lambda: lifeline._environ(stray.pid).get("ELASTICFT_AGENT_PID"), 10,
                   "the stray's environment")
        with caplog.at_level(logging.WARNING, logger=lifeline.__name__):
            assert lifeline.end_strays(env["TORCHELASTIC_RUN_ID"]) == [stray.pid]
        assert stray.wait(timeout=30) == -signal.SIGKILL
        assert other_job.poll() is None
        assert [r.getMessage() for r in caplog.records] == [
            f"ended 1 stray worker(s) of job {env['TORCHELASTIC_RUN_ID']} left by an agent "
            f"that is gone (pids {stray.pid})"]
        assert lifeline.end_strays(env["TORCHELASTIC_RUN_ID"]) == []
    finally:
        for proc in (stray, other_job):
            proc.kill()
            proc.wait()


@pytest.mark.slow
@pytest.mark.parametrize("warm", ["1", "0"], ids=["warm-forked", "cold"])
@pytest.mark.timeout(120)
def test_the_workers_of_a_sigkilled_agent_die_with_it(
        tmp_path: Path, job_env: dict[str, str], warm: str) -> None:
    out = tmp_path / "pids"
    out.mkdir()
    agent = subprocess.Popen(
        [str(BIN / "elasticft-run"), "--standalone", "--nproc-per-node", "2",
         str(HERE / "workers" / "report_pid.py"), str(out)],
        env={**job_env, "ELASTICFT_WARM_START": warm}, cwd=tmp_path,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        # A file exists before its pid is written in it.
        wait_until(lambda: sum(1 for p in out.iterdir() if p.read_text()) == 2, 90,
                   "both workers to start")
        workers = [int(p.read_text()) for p in out.iterdir()]
        assert all(procs.exists(pid) for pid in workers)
        agent.kill()  # the agent alone: its workers are in sessions of their own
        agent.wait()
        wait_until(lambda: not any(procs.exists(pid) for pid in workers), 30,
                   f"workers {workers} to die with their agent")
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        for path in out.iterdir():
            pid = int(path.read_text() or 0)
            if pid and procs.exists(pid):
                os.killpg(pid, signal.SIGKILL)
