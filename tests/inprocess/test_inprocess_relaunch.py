"""A relaunch after the agent died in the middle of an in-process recovery, under a real
``elasticft-run --standalone --nproc-per-node 2`` (gloo, real SIGKILLs): the dead agent's
in-process directory still holds its published generation, its notice and its workers'
records; the relaunch in the same run directory starts cleanly, resumes from the
checkpointed step and finishes with an uninterrupted run's losses."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from elasticft.events import read_events
from tests.conftest import BIN, EXAMPLES, communicate_or_explain
from tests.leftovers import run_processes

STEPS = 12


def _command(run_dir: Path, losses: Path, *extra: str) -> list[str]:
    return [str(BIN / "elasticft-run"), "--standalone", "--nproc-per-node", "2",
            "--max-restarts", "3", "--run-dir", str(run_dir), "--ckpt-persist-every", "1",
            "--monitor-interval", "0.1", str(EXAMPLES / "train_inprocess.py"),
            "--steps", str(STEPS), "--step-time", "0.3", "--loss-log", str(losses), *extra]


def _published(run_dir: Path) -> list[Path]:
    return list((run_dir / "inprocess").glob("*/generation.json"))


def _kill_the_job(agent: subprocess.Popen, run_dir: Path, marker: str) -> None:
    """SIGKILLs the agent, then every process of the job (the workers run in sessions of
    their own, and warm interpreters beside them) until none is left."""
    agent.kill()
    agent.communicate()
    deadline = time.monotonic() + 60
    while (left := run_processes(run_dir, marker)) and time.monotonic() < deadline:
        for process in left:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.send_signal(signal.SIGKILL)
        time.sleep(0.1)
    assert not run_processes(run_dir, marker)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_relaunch_after_the_agent_died_in_a_recovery_starts_cleanly(
        tmp_path: Path, job_env: dict[str, str], inprocess_reference: dict[int, str]) -> None:
    run_dir, losses = tmp_path / "job", tmp_path / "job.loss"
    first = subprocess.Popen(
        _command(run_dir, losses, "--fault-rank", "1", "--crash-at-step", "6",
                 "--crash-mode", "after-save"),
        env=job_env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not _published(run_dir) and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _published(run_dir), "no generation was published"
    finally:
        _kill_the_job(first, run_dir, str(tmp_path))
    assert _published(run_dir)  # the dead agent's leftovers, for the relaunch to meet
    # The step the relaunch resumes from is the newest the dead agent had committed to disk by
    # the kill (none yet on a loaded machine: then it starts from the beginning).
    committed = max((int(d.name.split("-")[1]) for d in (run_dir / "ckpt").glob("step-*")
                     if (d / "COMMITTED").exists()), default=0)
    earlier = len(read_events(run_dir))

    again = subprocess.Popen(_command(run_dir, losses), env=job_env, cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    text, _ = communicate_or_explain(again, 300)
    assert again.returncode == 0, text[-5000:]
    assert "ended by the agent" not in text, text[-5000:]  # no interrupt at generation 0
    assert "no in-process regroup" not in text, text[-5000:]
    events = read_events(run_dir)[earlier:]
    kinds = [e["kind"] for e in events]
    assert "failure" not in kinds and "restart" not in kinds, text[-5000:]
    assert kinds.count("workers_started") == 1, kinds
    resumed = [int(line.split("resumed from step ")[1].split()[0])
               for line in text.splitlines() if "resumed from step" in line]
    assert resumed[:1] == ([committed] if committed else []), (committed, text[-5000:])
    by_step = {}
    for line in losses.read_text().splitlines():
        step, value = line.split()
        by_step[int(step)] = value  # the relaunch's redone steps overwrite the first tries
    assert by_step == {s: v for s, v in inprocess_reference.items() if s <= STEPS}
