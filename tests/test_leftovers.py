"""Nothing of a run stays on its host: after a normal end; after SIGKILL of the agent's whole
process group at any moment, with nothing else started (its progress rings and checkpoint slots
have no name); and what older versions left the next start sweeps (never another user's files).
The run with a crashed worker is checked in tests/report/test_auto_steps.py."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from elasticft.ckpt.memory.shm import NAME_PREFIX, SHM_DIR
from elasticft.events import read_events
from elasticft.procs import gone
from tests.conftest import BIN, EXAMPLES
from tests.leftovers import (
    agent_pids,
    assert_nothing_left,
    held_by_name,
    held_without_name,
    named_after,
    run_processes,
    shm_entries,
    unnamed_slots,
)
from tests.tuned_run import tuned_run

OTHER_UID = 65534  # nobody


def launch(tmp_path: Path, name: str, steps: int, env: dict[str, str],
           ring_base: Path = SHM_DIR, options: tuple[str, ...] = ()) -> subprocess.Popen:
    run_dir = tmp_path / name
    return subprocess.Popen(
        [*tuned_run({"diag_ring_dir": ring_base}), "--standalone", "--nproc-per-node", "2",
         "--monitor-interval", "0.2", "--run-dir", str(run_dir), *options,
         str(EXAMPLES / "train_elasticft.py"), "--steps", str(steps), "--step-time", "0.05",
         "--ckpt-dir", str(tmp_path / f"{name}-ckpt")],
        env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_for_slots(pid: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Until the agent holds checkpoint slots a worker has sized (the run is training); they
    have no name: nothing of them is in /dev/shm by name."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if unnamed_slots(pid):
            assert shm_entries({pid}) == []
            return
        time.sleep(0.2)
    raise AssertionError(f"agent {pid} never held a sized checkpoint slot")


def dead_pid() -> int:
    done = subprocess.run(["sh", "-c", "echo $$"], capture_output=True, text=True, check=True)
    return int(done.stdout)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_normal_end_leaves_nothing(tmp_path, job_env):
    job = launch(tmp_path, "run", 12, job_env)
    try:
        wait_for_slots(job.pid, job)
        assert job.wait(timeout=150) == 0, job.stderr.read()[-3000:] if job.stderr else ""
    finally:
        if job.poll() is None:
            job.kill()
    assert_nothing_left(tmp_path / "run", marker=str(tmp_path))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_what_older_versions_and_killed_agents_left_is_swept_by_the_next_start(tmp_path, job_env):
    # Rings in a directory of the test's own: agents of other runs on this host sweep /dev/shm.
    rings = tmp_path / "rings"
    rings.mkdir()
    # A ring directory and a checkpoint segment as older versions named them, of an agent of
    # ours that is gone; and another user's ring directory and segment, of a process that is
    # gone, named as ours.
    stale = dead_pid()
    older = rings / f"elasticft-{os.getuid()}-{dead_pid()}-ba9876543210"
    older_segment = SHM_DIR / f"{NAME_PREFIX}-{dead_pid()}-job-l0-s0"
    foreign = [rings / f"elasticft-{os.getuid()}-{stale}-0123456789ab",
               SHM_DIR / f"{NAME_PREFIX}-{stale}-job-l0-s0"]
    foreign[0].mkdir()
    foreign[1].write_bytes(b"x")
    for path in foreign:
        os.chown(path, OTHER_UID, OTHER_UID)
    killed = launch(tmp_path, "killed", 2000, job_env, rings)
    try:
        wait_for_slots(killed.pid, killed)
        # This version's rings have no name: nothing of the agent's in the ring directory.
        assert [p for p in shm_entries({killed.pid}, rings) if p.parent == rings] == []
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
        # The killed agent's checkpoint slots went with it: they had no name.
        assert shm_entries({killed.pid}) == []
        # Planted now: the killed agent's own start swept the ring directory.
        older.mkdir()
        (older / "rank-0.py.ring").write_bytes(b"x")
        older_segment.write_bytes(b"x")

        # Diagnostics off in the next run: the start itself sweeps, whatever subsystems run.
        nxt = launch(tmp_path, "next", 4, job_env, rings, ("--diag-enabled", "false"))
        try:
            assert nxt.wait(timeout=150) == 0, nxt.stderr.read()[-3000:] if nxt.stderr else ""
        finally:
            if nxt.poll() is None:
                nxt.kill()
        # What the older version left (unless another run's agent on this host swept it).
        assert not older.exists() and not older_segment.exists()
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
        older_segment.unlink(missing_ok=True)


class Lines:
    """The lines a process writes to a pipe, read on a thread as they come."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, *texts: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(any(t in line for line in list(self.lines)) for t in texts):
                return
            time.sleep(0.05)
        raise AssertionError(f"never printed {texts}; the end:\n" + "\n".join(self.lines[-40:]))


def wait_for(what: str, done: Callable[[], bool], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def events_of(run_dir: Path, kind: str) -> list[dict]:
    if not run_dir.is_dir():
        return []
    return [e for e in read_events(run_dir) if e["kind"] == kind]


TRAIN = Path(__file__).parent / "agent" / "workers" / "train_until_killed.py"
MOMENTS = ("in_rendezvous", "workers_started", "training", "after_last_line")


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("moment", MOMENTS)
def test_sigkill_of_the_agents_process_group_at_any_moment_leaves_nothing(
        moment, tmp_path, job_env):
    """The agent's process group SIGKILLed (Slurm's KillWait, an OOM kill, a harness that
    stops the launcher as soon as the script's last line shows): nothing of the run stays in
    /dev/shm or the temporary directories, and nothing else starts to clean up. While it runs,
    no process of the run holds a file there by name, so no moment could leave one. The script
    saves a memory snapshot every step: its checkpoint slots have no name either."""
    run_dir, go, tmpdir = tmp_path / "run", tmp_path / "go", tmp_path / "tmpdir"
    tmpdir.mkdir()
    if moment != "workers_started":
        go.touch()
    nodes = ["--nnodes", "2"] if moment == "in_rendezvous" else []  # a node that never comes
    steps = 5 if moment == "after_last_line" else 100_000
    job = subprocess.Popen(
        [str(BIN / "elasticft-run"), "--standalone", *nodes, "--nproc-per-node", "2",
         "--monitor-interval", "0.2", "--run-dir", str(run_dir), str(TRAIN), str(go),
         str(steps)],
        env=dict(job_env, TMPDIR=str(tmpdir)), cwd=tmp_path, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, start_new_session=True)
    workers: set[int] = set()
    try:
        output = Lines(job.stderr)
        wait_for("the agent's start", lambda: bool(events_of(run_dir, "run_start")))
        if moment != "in_rendezvous":
            wait_for("the workers' start", lambda: bool(events_of(run_dir, "workers_started")))
            workers = {int(p) for p in events_of(run_dir, "workers_started")[0]["pids"].values()}
        if moment == "training":
            output.wait_for("rank 0 step 3", "rank 1 step 3")
            # The rings and slots are there, mapped by the workers from /dev/shm, with no name,
            # and the agent holds the slots with a snapshot in them.
            assert all(held_without_name(pid) for pid in workers)
            assert unnamed_slots(job.pid)
        elif moment == "after_last_line":
            output.wait_for("rank 0 last line", "rank 1 last line")
        running = {job.pid, *(p.pid for p in run_processes(run_dir, str(tmp_path)))}
        assert held_by_name(running, tmp_path) == []
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(timeout=30)
        # Workers run in sessions of their own: the orphans hold nothing by name either. They
        # are the harness's to stop (Slurm ends the whole job step), here the test's.
        survivors = {p.pid for p in run_processes(run_dir, str(tmp_path))}
        assert held_by_name(survivors, tmp_path) == []
        for pid in survivors:
            os.kill(pid, signal.SIGKILL)
        wait_for("the workers' end", lambda: all(gone(pid) for pid in survivors | workers), 30)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        for process in run_processes(run_dir, str(tmp_path)):
            process.kill()
    run_ids = {str(e["run_id"]) for e in events_of(run_dir, "run_start")}
    assert named_after({*agent_pids(run_dir), *workers}, run_ids) == []
    # Not of this run: torch's compile cache, one per user and reused by every run, made by
    # ``import torch._dynamo`` (a DDP script's first forward; the warm interpreters preload it).
    cache = f"torchinductor_{psutil.Process().username()}"
    assert [p for p in tmpdir.iterdir() if p.name != cache] == []
    assert_nothing_left(run_dir, marker=str(tmp_path))
