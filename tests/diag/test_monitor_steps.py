"""The agent's monitor reading a real ring over a long run: busy time per step stays right and
the collective history it keeps for it stays small."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from elasticft.addon.api import GroupInfo, WorkerInfo
from elasticft.config import DiagConfig, ElasticftConfig
from elasticft.diag.monitor import DiagMonitor
from elasticft.diag.ring import Op, RingWriter
from elasticft.launcher import sweep_leftovers

MS = 1_000_000


def test_busy_time_of_every_step_and_no_growing_history(tmp_path: Path) -> None:
    now = [10**12]
    config = DiagConfig(diag_preflight="off", diag_check_interval_s=0.0, health_interval_s=3600)
    monitor = DiagMonitor(config, base_env={}, event_dir=tmp_path, clock_ns=lambda: now[0])
    group = GroupInfo("run", "node0", tmp_path, 0, 0, 1, 0, (WorkerInfo(0, 0, 1),))
    env = monitor.worker_env(group, group.workers[0])
    monitor.on_workers_started(group)
    writer = RingWriter(Path(env["ELASTICFT_DIAG_PY_RING"]), 0)
    try:
        for step in range(1, 301):
            # A 10 ms step: 6 ms of compute, then four 1 ms collectives (two overlapping).
            start = now[0]
            for begin in (6, 7, 7, 8):
                writer.append(Op.ALL_REDUCE, comm=1, enqueue_ns=start + begin * MS,
                              complete_ns=start + (begin + 1) * MS)
            now[0] = start + 10 * MS
            writer.append(Op.STEP, enqueue_ns=start, complete_ns=now[0], value=float(step))
            assert monitor.check(group) is None
            track = monitor._tracks[0]
            assert track.steps == step
            if step > 1:  # the first step absorbs start-up and is not judged
                assert track.busy[-1] == 0.007  # 10 ms less the 3 ms inside collectives
            assert len(track.spans) <= 4
    finally:
        writer.close()
        monitor.on_workers_stopped(group)
        monitor.close()


def test_rings_have_no_name_and_older_ring_directories_of_dead_agents_are_swept(
        tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    def ring_dir(base: Path, agent_pid: int, tag: str) -> Path:
        """A ring directory as older versions named it (after the user and the agent)."""
        return base / f"elasticft-{os.getuid()}-{agent_pid}-{tag}"

    rings = tmp_path / "rings"
    rings.mkdir()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead = ring_dir(rings, int(gone.stdout), "0123456789ab")
    alive = ring_dir(rings, os.getppid(), "ba9876543210")  # the pytest runner's parent
    unnamed = rings / f"elasticft-{os.getuid()}-0bee6bf3c4bf"  # no pid: not ours to judge
    for path in (dead, alive, unnamed):
        path.mkdir()
        (path / "rank-0.py.ring").write_bytes(b"x")
    config = DiagConfig(diag_preflight="off", diag_ring_dir=rings, health_interval_s=3600)
    monitor = DiagMonitor(config, base_env={}, event_dir=tmp_path, nccl_shim=Path("/x/shim.so"))
    group = GroupInfo("run", "node0", tmp_path, 0, 0, 1, 0, (WorkerInfo(0, 0, 1),))
    sweep_leftovers(ElasticftConfig(diag=config))  # every start's one sweep, before any worker
    env = monitor.worker_env(group, group.workers[0])
    assert not dead.exists() and alive.exists() and unnamed.exists()
    names = [f"ELASTICFT_DIAG_{n}" for n in ("PY_RING", "NCCL_RING", "NCCL_STATUS")]
    files = [Path(env[n]) for n in names]
    assert all(f.parent == Path(f"/proc/{os.getpid()}/fd") for f in files)
    # Backed by the ring directory's file system, yet named nowhere in it.
    assert all(os.stat(f).st_dev == rings.stat().st_dev for f in files)
    assert set(rings.iterdir()) == {alive, unnamed}
    again = monitor.worker_env(group, group.workers[0])  # a restart: fresh files
    assert set(rings.iterdir()) == {alive, unnamed}
    monitor.close()
    assert not any(Path(again[n]).exists() for n in names)


def test_process_state_is_read_only_for_a_rank_without_progress(tmp_path: Path) -> None:
    import signal
    import subprocess
    import time

    from elasticft import procs

    now = [10**12]
    config = DiagConfig(diag_preflight="off", diag_check_interval_s=0.0, health_interval_s=3600)
    monitor = DiagMonitor(config, base_env={}, event_dir=tmp_path, clock_ns=lambda: now[0])
    sleeper = subprocess.Popen(["sleep", "60"])
    group = GroupInfo("run", "node0", tmp_path, 0, 0, 1, 0, (WorkerInfo(0, 0, 1, sleeper.pid),))
    env = monitor.worker_env(group, group.workers[0])
    monitor.on_workers_started(group)
    writer = RingWriter(Path(env["ELASTICFT_DIAG_PY_RING"]), 0)
    try:
        sleeper.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while procs.state(sleeper.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        writer.append(Op.STEP, enqueue_ns=now[0] - 10 * MS, complete_ns=now[0], value=1.0)
        writer.heartbeat(now[0])
        now[0] += 100 * MS
        monitor.check(group)
        [fresh] = monitor.views(group, now[0])
        assert fresh.process_state is None  # stepped and beat 0.1 s ago: /proc is not read
        now[0] += 300 * MS
        [late_beat] = monitor.views(group, now[0])  # stepped 0.4 s ago, but missed 3 beats
        assert late_beat.process_state == "T"
        now[0] += 600 * MS
        writer.heartbeat(now[0])
        assert monitor.check(group) is None  # reads the new heartbeat
        [no_step] = monitor.views(group, now[0])  # beating, but no step for 1 s
        assert no_step.heartbeat_age_s == 0 and no_step.process_state == "T"
    finally:
        sleeper.kill()
        sleeper.wait()
        writer.close()
        monitor.on_workers_stopped(group)
        monitor.close()


_WALKER = """
import itertools, time
def walk(depth):
    if depth:
        return walk(depth - 1)
    time.sleep(0.05)  # little CPU: only the stack shows that this process moves
for depth in itertools.cycle(range(40)):
    walk(depth)
"""


@pytest.mark.parametrize("program, kind", [(_WALKER, "working"),
                                           ("import time; time.sleep(600)", "stuck")])
def test_a_collective_past_its_timeout_is_stuck_only_if_the_stack_stands_still(
        tmp_path: Path, program: str, kind: str) -> None:
    """Every rank in a call past the start-up timeout, no CPU measured yet: two py-spy samples
    of the real process decide between working (its Python moves) and stuck (it does not)."""
    now = [10**12]
    config = DiagConfig(diag_preflight="off", diag_check_interval_s=0.0, health_interval_s=3600)
    monitor = DiagMonitor(config, base_env={}, event_dir=tmp_path, clock_ns=lambda: now[0])
    worker = subprocess.Popen([sys.executable, "-c", program])
    group = GroupInfo("run", "node0", tmp_path, 0, 0, 1, 0, (WorkerInfo(0, 0, 1, worker.pid),))
    env = monitor.worker_env(group, group.workers[0])
    monitor.on_workers_started(group)
    writer = RingWriter(Path(env["ELASTICFT_DIAG_PY_RING"]), 0)
    try:
        time.sleep(1.0)  # the interpreter is up and in its loop
        writer.append(Op.ALL_REDUCE, comm=1, comm_seq=1, enqueue_ns=now[0])
        now[0] += int((config.hang_initial_timeout_s + 10) * 1e9)
        writer.heartbeat(now[0])
        detection = monitor.check(group)
        assert monitor.last_verdict is not None and monitor.last_verdict.kind == kind
        assert (detection is None) == (kind == "working")
        if kind == "working":
            assert "stack changing" in monitor.last_verdict.evidence[0]
    finally:
        worker.kill()
        worker.wait()
        writer.close()
        monitor.on_workers_stopped(group)
        monitor.close()
