"""The pre-started spare end to end under a real ``elasticft-run --standalone --nproc-per-node 2
--recovery-inprocess-spare`` (gloo, a real SIGKILL): once the spare is ready, rank 1 is killed;
the spare's process becomes rank 1 (no process is started for it), rank 0 keeps its process, and
the losses are an uninterrupted run's, bit for bit."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from elasticft.events import read_events
from tests.inprocess.test_inprocess import _run

STEPS = 60


def _kill_rank_1_once_the_spare_is_ready(run_dir: Path, pid_log: Path, killed: dict[str, int],
                                         stop: threading.Event) -> None:
    while not stop.wait(0.05):
        spares = [e for e in read_events(run_dir)
                  if e["kind"] == "spare_ready"] if run_dir.exists() else []
        rank_1 = [line.split() for line in (pid_log.read_text().splitlines()
                                            if pid_log.exists() else []) if line.startswith("1 ")]
        if spares and rank_1:
            killed.update(pid=int(rank_1[-1][1]), step=int(rank_1[-1][2]),
                          spare=int(spares[0]["pid"]))
            os.kill(killed["pid"], signal.SIGKILL)
            return


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_spare_takes_the_killed_rank_and_the_losses_are_exact(
        tmp_path: Path, job_env: dict[str, str], inprocess_reference: dict[int, str]) -> None:
    reference = {step: loss for step, loss in inprocess_reference.items() if step <= STEPS}
    assert sorted(reference) == list(range(1, STEPS + 1))
    killed: dict[str, int] = {}
    stop = threading.Event()
    killer = threading.Thread(target=_kill_rank_1_once_the_spare_is_ready, daemon=True, args=(
        tmp_path / "spare", tmp_path / "spare.pid", killed, stop))
    killer.start()
    started = time.monotonic()
    try:
        run = _run(tmp_path, "spare", {**job_env, "ELASTICFT_RECOVERY_INPROCESS_SPARE": "1"},
                   "--steps", str(STEPS), "--step-time", "0.3")
    finally:
        stop.set()
        killer.join(timeout=10)
    assert killed and killed["step"] < STEPS, (killed, time.monotonic() - started,
                                               run["text"][-3000:])
    kinds = [e["kind"] for e in run["events"]]
    assert "restart" not in kinds and kinds.count("workers_started") == 1, run["text"][-5000:]
    done = [e for e in run["events"] if e["kind"] == "recover_in_process"]
    assert len(done) == 1 and done[0]["spare"] == {"1": killed["spare"]}, run["text"][-5000:]
    assert run["pids"][0] == run["pids"][0][:1]  # rank 0 never left its process
    assert run["pids"][1] == [killed["pid"], killed["spare"]]  # the spare became rank 1
    assert run["losses"] == reference  # bitwise on CPU (losses logged with repr)
