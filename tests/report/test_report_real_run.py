"""The report's TOR for a real run with injected crashes, checked against an independent one.

The run: ``elasticft-run`` on ``examples/train_plain.py`` (2 gloo workers), a worker SIGKILLed
twice with ``elasticft chaos kill``. The independent TOR uses nothing of the report: the wall time
is the test's own clock from starting the launcher to the launcher's summary line (the run's
end; the interpreter's teardown after it, 0.5 s on a quiet host and seconds on a busy one, is
nobody's training time), the healthy step time the median gap between consecutive ``step N``
lines as the test reads them from the job's stdout.
"""

from __future__ import annotations

import itertools
import json
import statistics
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import BIN, EXAMPLES

STEPS = 130


class StepWatcher:
    """Reads the launcher's stdout, stamping every ``step N`` line with the test's clock."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.lines: list[tuple[float, str]] = []
        self.changed = threading.Condition()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self.changed:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                self.changed.notify_all()

    def wait_for(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        with self.changed:
            while not predicate([line for _, line in self.lines]):
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self.thread.is_alive()):
                    raise AssertionError(f"{what} did not happen; output tail: "
                                         f"{[line for _, line in self.lines][-20:]}")
                self.changed.wait(min(left, 1.0))

    def steps(self) -> list[tuple[float, int]]:
        out = []
        for t, line in self.lines:
            if line.startswith("step ") and " loss " in line:
                out.append((t, int(line.split()[1])))
        return out


class SummaryWatcher:
    """Reads the launcher's stderr, stamping its summary line (``elasticft: run ...``)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.printed_at: float | None = None
        self.tail: list[str] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            if line.startswith("elasticft: run ") and self.printed_at is None:
                self.printed_at = time.monotonic()
            self.tail = [*self.tail[-19:], line.rstrip("\n")]


def independent_tor(wall_s: float, steps: list[tuple[float, int]], total: int) -> float:
    gaps = [t2 - t1 for (t1, s1), (t2, s2) in itertools.pairwise(steps) if s2 == s1 + 1]
    return total * statistics.median(gaps) / wall_s


def armed_kill(run_dir: Path, rank: int, trigger: Path) -> subprocess.Popen:
    """``elasticft chaos kill``, started ahead (the CLI takes seconds to start on a busy
    machine) and fired by creating ``trigger``; it looks the rank's pid up only then."""
    return subprocess.Popen(
        [str(BIN / "elasticft"), "chaos", "kill", "--run-dir", str(run_dir), "--rank",
         str(rank), "--when-exists", str(trigger), "--timeout", "250"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def fire(chaos: subprocess.Popen, trigger: Path) -> None:
    trigger.touch()
    _, err = chaos.communicate(timeout=60)
    assert chaos.returncode == 0, err


@pytest.mark.smoke
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_report_tor_matches_independent_tor_with_two_crashes(tmp_path, job_env):
    run_dir = tmp_path / "run"
    cmd = [str(BIN / "elasticft-run"), "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "3", "--monitor-interval", "0.2", "--run-dir", str(run_dir),
           str(EXAMPLES / "train_plain.py"), "--steps", str(STEPS), "--step-time", "0.15",
           "--ckpt-every", "10", "--ckpt-dir", str(tmp_path / "ckpt")]
    triggers = [tmp_path / "kill-1", tmp_path / "kill-2"]
    chaos = [armed_kill(run_dir, 1, triggers[0]), armed_kill(run_dir, 0, triggers[1])]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, env=job_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path)
    watcher = StepWatcher(proc)
    summary = SummaryWatcher(proc)
    try:
        watcher.wait_for(lambda ls: "step 25 loss" in " ".join(ls), 120, "step 25")
        fire(chaos[0], triggers[0])
        watcher.wait_for(lambda ls: any(line.startswith("resumed from") for line in ls), 120,
                         "the first restart")
        watcher.wait_for(lambda ls: "step 70 loss" in " ".join(ls), 120, "step 70")
        fire(chaos[1], triggers[1])
        assert proc.wait(timeout=200) == 0
    finally:
        for p in (proc, *chaos):
            if p.poll() is None:
                p.kill()
    watcher.thread.join(timeout=10)
    summary.thread.join(timeout=10)
    assert summary.printed_at is not None, summary.tail
    wall = summary.printed_at - started

    report = subprocess.run([str(BIN / "elasticft"), "report", str(run_dir), "--json",
                             "--plot", str(tmp_path / "timeline.png")],
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    data = json.loads(report.stdout)
    expected = independent_tor(wall, watcher.steps(), STEPS)
    print(f"\nTOR report {data['tor']:.4f} vs independent {expected:.4f} "
          f"(wall {wall:.1f} s, report observed {data['observed_s']:.1f} s, healthy step "
          f"{data['healthy_step_s'] * 1000:.1f} ms)")
    assert data["failures"] == 2
    assert data["steps_done"] == STEPS
    assert abs(data["tor"] - expected) / expected < 0.05, (data["tor"], expected, data)
    # The phases account for all of the wall time, and the crashes cost what they should.
    assert sum(data["phases_s"].values()) == pytest.approx(data["observed_s"], rel=1e-6)
    assert data["phases_s"]["rollback"] > 0 and data["phases_s"]["repair"] > 0
    assert all(f["rollback_steps"] <= 10 for f in data["faults"])
    assert {f["failure_class"] for f in data["faults"]} == {"signal_crash"}
    assert (tmp_path / "timeline.png").stat().st_size > 10_000
