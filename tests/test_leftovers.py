"""Nothing of a run stays on its host: after a normal end, and after the agent itself is
SIGKILLed (the next start sweeps what it left, and never another user's files). The run with a
crashed worker is checked in tests/report/test_auto_steps.py."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from elasticft.ckpt.shm import NAME_PREFIX, SHM_DIR
from elasticft.events import read_events
from elasticft.procs import gone
from tests.conftest import BIN, EXAMPLES
from tests.leftovers import assert_nothing_left, shm_entries

OTHER_UID = 65534  # nobody


def launch(tmp_path: Path, name: str, steps: int, env: dict[str, str],
           ring_base: Path = SHM_DIR, options: tuple[str, ...] = ()) -> subprocess.Popen:
    run_dir = tmp_path / name
    return subprocess.Popen(
        [str(BIN / "elasticft-run"), "--standalone", "--nproc-per-node", "2",
         "--monitor-interval", "0.2", "--run-dir", str(run_dir),
         "--diag-ring-dir", str(ring_base), *options,
         str(EXAMPLES / "train_elasticft.py"), "--steps", str(steps), "--step-time", "0.05",
         "--ckpt-dir", str(tmp_path / f"{name}-ckpt")],
        env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_for_shm(pid: int, proc: subprocess.Popen, ring_base: Path = SHM_DIR,
                 kinds: int = 2, timeout: float = 120) -> None:
    """Until the agent's rings and checkpoint segments exist (the run is training)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        names = [p.name for p in shm_entries({pid}, ring_base)]
        if sum(any(n.startswith(k) for n in names)
               for k in (f"elasticft-{os.getuid()}-", NAME_PREFIX)) >= kinds:
            return
        time.sleep(0.2)
    raise AssertionError(f"no rings and segments of agent {pid} appeared")


def dead_pid() -> int:
    done = subprocess.run(["sh", "-c", "echo $$"], capture_output=True, text=True, check=True)
    return int(done.stdout)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_normal_end_leaves_nothing(tmp_path, job_env):
    job = launch(tmp_path, "run", 12, job_env)
    try:
        wait_for_shm(job.pid, job)
        assert job.wait(timeout=150) == 0, job.stderr.read()[-3000:] if job.stderr else ""
    finally:
        if job.poll() is None:
            job.kill()
    assert_nothing_left(tmp_path / "run", marker=str(tmp_path))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_agent_killed_with_sigkill_is_swept_by_the_next_start(tmp_path, job_env):
    # Rings in a directory of the test's own: agents of other runs on this host sweep /dev/shm.
    rings = tmp_path / "rings"
    rings.mkdir()
    # Another user's ring directory and segment, of a process that is gone, named as ours.
    stale = dead_pid()
    foreign = [rings / f"elasticft-{os.getuid()}-{stale}-0123456789ab",
               SHM_DIR / f"{NAME_PREFIX}-{stale}-job-l0-s0"]
    foreign[0].mkdir()
    foreign[1].write_bytes(b"x")
    for path in foreign:
        os.chown(path, OTHER_UID, OTHER_UID)
    killed = launch(tmp_path, "killed", 2000, job_env, rings)
    try:
        wait_for_shm(killed.pid, killed, rings)
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)
        # Its workers live on as orphans; they are the user's to stop (here: the test's).
        workers = {int(pid) for e in read_events(tmp_path / "killed")
                   if e["kind"] == "workers_started" for pid in e["pids"].values()}
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not all(gone(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        # What a SIGKILLed agent cannot remove itself (its checkpoint segments too, unless
        # another run's agent on this host has swept them already).
        assert [p for p in shm_entries({killed.pid}, rings) if p.parent == rings]

        # Diagnostics off in the next run: the start itself sweeps, whatever subsystems run.
        nxt = launch(tmp_path, "next", 4, job_env, rings, ("--diag-enabled", "false"))
        try:
            assert nxt.wait(timeout=150) == 0, nxt.stderr.read()[-3000:] if nxt.stderr else ""
        finally:
            if nxt.poll() is None:
                nxt.kill()
        assert shm_entries({killed.pid}, rings) == []
        assert_nothing_left(tmp_path / "next", marker=str(tmp_path / "next"), ring_base=rings)
        assert all(path.exists() for path in foreign)  # never another user's
    finally:
        if killed.poll() is None:
            killed.kill()
        for path in foreign:
            if path.is_dir():
                path.rmdir()
            elif path.exists():
                path.unlink()
