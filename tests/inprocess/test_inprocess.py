"""In-process recovery end to end under a real ``elasticft-run --standalone --nproc-per-node 2``
(gloo, real signals): rank 1 fails mid-run, rank 0 keeps its process and rolls back in place, a
replacement takes rank 1, and the losses are an uninterrupted run's, bit for bit. A replacement
that fails too makes the agent fall back to a full restart, with the same losses."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from elasticft.events import read_events
from tests.cluster import losses_of
from tests.conftest import BIN, EXAMPLES, pids_by_rank

STEPS = 10


def _run(tmp: Path, name: str, env: dict[str, str], *extra: str,
         launch: tuple[str, ...] = (), nproc: int = 2) -> dict:
    losses, pids = tmp / f"{name}.loss", tmp / f"{name}.pid"
    cmd = [str(BIN / "elasticft-run"), "--standalone", "--nproc-per-node", str(nproc),
           "--max-restarts", "3", "--run-dir", str(tmp / name), "--ckpt-persist-every", "0",
           "--monitor-interval", "0.1", *launch, str(EXAMPLES / "train_inprocess.py"),
           "--steps", str(STEPS), "--loss-log", str(losses), "--pid-log", str(pids), *extra]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=tmp)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-5000:]
    by_step = losses_of(losses).values  # a step redone keeps its last try
    steps = [tuple(int(v) for v in line.split()) for line in pids.read_text().splitlines()]
    return {"text": text, "losses": by_step, "pids": pids_by_rank(pids), "steps": steps,
            "events": read_events(tmp / name)}


@pytest.fixture(scope="module")
def reference(inprocess_reference: dict[int, str]) -> dict[int, str]:
    """An uninterrupted run's losses, the first STEPS of the shared reference run."""
    losses = {step: loss for step, loss in inprocess_reference.items() if step <= STEPS}
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


def _recovered_in_process(run: dict, replaced: list[int]) -> dict:
    kinds = [e["kind"] for e in run["events"]]
    assert "restart" not in kinds, run["text"][-5000:]
    done = [e for e in run["events"] if e["kind"] == "recover_in_process"]
    assert len(done) == 1, run["text"][-5000:]
    assert sorted(int(r) for r in done[0]["replaced"]) == replaced, run["text"][-8000:]
    assert {"detect_s", "abort_s", "regroup_s", "restore_s", "redo_s", "total_s"} <= set(
        done[0]["phases"])
    # The walk to the first step: the failure, one decision, then only what it decided (the
    # survivors keep their state: no JIT checkpoint), counted from that decision alone.
    walk = [e["kind"] for e in run["events"] if e["kind"] in (
        "failure", "decision", "jit_checkpoint", "worker_replaced", "recover_in_process")]
    assert walk[walk.index("decision"):] == [
        "decision", "worker_replaced", "recover_in_process"], walk
    (decision,) = [e for e in run["events"] if e["kind"] == "decision"]
    assert (decision["action"], decision["checkpoint"]) == ("recover_in_process", "snapshot")
    assert [e["restarts"] for e in run["events"] if e["kind"] == "run_end"] == [1]
    return done[0]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("fault", "replaced"), [
    (("--crash-at-step", "6", "--crash-mode", "after-save"), [1]),  # SIGKILL
    # before any step was saved: the survivor rolls back to the state it started from
    (("--crash-at-step", "1", "--crash-mode", "before-save"), [1]),
    (("--hang-at-step", "6"), [1]),  # SIGSTOP: the hang verdict, then the frozen rank killed
    (("--infra-error-at-step", "6"), []),  # rank 1 raises a connection error and stays
    # rank 1 reports `failed`, then dies: no survivor, it is replaced in the same recovery
    (("--infra-error-at-step", "6", "--exit-after-failed"), [1]),
], ids=["sigkill", "sigkill-before-the-first-save", "sigstop", "infra-error",
         "dies-after-failed"])
def test_survivors_keep_their_process_and_the_losses_are_exact(
        tmp_path: Path, job_env: dict[str, str], reference: dict[int, str],
        fault: tuple[str, ...], replaced: list[int]) -> None:
    run = _run(tmp_path, "fault", job_env, "--fault-rank", "1", *fault)
    _recovered_in_process(run, replaced)
    assert len(run["pids"][0]) == 1, run["pids"]  # rank 0 never left its process
    assert len(run["pids"][1]) == 1 + len(replaced), run["pids"]
    assert "1 in-process recoveries in this process" in run["text"]
    assert run["losses"] == reference  # bitwise on CPU (losses logged with repr)
    if "--hang-at-step" in fault:  # the frozen rank is killed, never continued to train on
        frozen = run["pids"][1][0]
        assert max(step for _, pid, step in run["steps"] if pid == frozen) == 6, run["steps"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_script_without_a_torch_optim_optimizer_completes_a_recovery(
        tmp_path: Path, job_env: dict[str, str]) -> None:
    run = _run(tmp_path, "manual", job_env, "--fault-rank", "1", "--crash-at-step", "6",
               "--crash-mode", "after-save", "--manual-sgd")
    _recovered_in_process(run, [1])
    assert len(run["pids"][0]) == 1, run["pids"]
    assert sorted(run["losses"]) == list(range(1, STEPS + 1))


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("fault", "reason"), [
    ("--stuck-teardown", "did not end within 3 s"),
    ("--sick-device", "failed the health check: injected"),
], ids=["stuck-teardown", "sick-device"])
def test_a_survivor_that_cannot_rejoin_is_replaced_and_the_other_goes_on(
        tmp_path: Path, job_env: dict[str, str], reference: dict[int, str], fault: str,
        reason: str) -> None:
    """Rank 1 raises a connection error and stays; its teardown never returns, or its device
    fails the check: it alone is replaced, after the hard limit (3 s here)."""
    run = _run(tmp_path, "leave", job_env, "--fault-rank", "1", "--infra-error-at-step", "6",
               fault, launch=("--recovery-inprocess-teardown-limit-s", "3"))
    _recovered_in_process(run, [1])
    assert len(run["pids"][0]) == 1, run["pids"]  # rank 0 kept its process
    assert len(run["pids"][1]) == 2, run["pids"]
    assert reason in run["text"], run["text"][-5000:]
    assert run["losses"] == reference


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_replacement_that_fails_falls_back_to_a_full_restart_with_the_same_losses(
        tmp_path: Path, job_env: dict[str, str], reference: dict[int, str]) -> None:
    run = _run(tmp_path, "fallback", job_env, "--fault-rank", "1", "--crash-at-step", "6",
               "--crash-mode", "after-save", "--replacement-fails")
    decisions = [e["action"] for e in run["events"] if e["kind"] == "decision"]
    assert decisions == ["recover_in_process", "restart_in_place"], run["text"][-5000:]
    assert [e["kind"] for e in run["events"] if e["kind"] == "restart"] == ["restart"]
    assert not [e for e in run["events"] if e["kind"] == "recover_in_process"]
    assert len(run["pids"][0]) == 2  # the full restart started every worker again
    assert run["losses"] == reference


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_failure_that_comes_back_after_an_in_process_recovery_restarts_every_rank(
        tmp_path: Path, job_env: dict[str, str], reference: dict[int, str]) -> None:
    """Rank 1 is killed before its save of step 6; after the in-process recovery the survivor,
    redoing step 6, hangs (a fault its own kept state brings back): the next recovery is a
    restart of every rank, not a second in-process try, and the run ends exact."""
    run = _run(tmp_path, "again", job_env, "--fault-rank", "1", "--crash-at-step", "6",
               "--crash-mode", "before-save", "--crash-again-after-recovery")
    decisions = [e for e in run["events"] if e["kind"] == "decision"]
    # The kill's decision may come before rank 0 recorded step 6 (the failure then counts as at
    # step 5, and the first hang, at 6, as a new failure recovered in process again): the hang
    # at the step of the failure a recovery answered is the one answered by a restart.
    actions = [d["action"] for d in decisions]
    assert actions in (["recover_in_process", "restart_in_place"],
                       ["recover_in_process", "recover_in_process", "restart_in_place"]), \
        run["text"][-5000:]
    last = decisions[-1]
    assert last["in_process_failed_at"] == 6 and last["newest_step"] == 6, last
    assert last["reason"].startswith("hang"), last["reason"]
    assert "not in process (the failure came again at step 6" in last["reason"]
    assert len(run["pids"][0]) >= 2  # the restart started every worker again
    assert run["losses"] == reference


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_replacement_that_restored_another_state_restarts_every_rank(
        tmp_path: Path, job_env: dict[str, str], reference: dict[int, str]) -> None:
    """The replacement flips one bit of a parameter after its restore (a torn copy): at the
    generation's first step the replicas' digests differ, every rank raises RestoreDiverged
    before the step changes anything, and the agent restarts every worker; the run ends
    exact."""
    run = _run(tmp_path, "diverged", job_env, "--fault-rank", "1", "--crash-at-step", "6",
               "--crash-mode", "after-save", "--corrupt-restore")
    decisions = [e for e in run["events"] if e["kind"] == "decision"]
    assert [d["action"] for d in decisions] == ["recover_in_process", "restart_in_place"], \
        run["text"][-5000:]
    # In the workers' own logs: the console holds a traceback of a run that goes on.
    logs = "".join(f.read_text() for f in (tmp_path / "diverged" / "logs").rglob("stderr.log"))
    assert "restored different states: rank(s) [1] differ from rank 0" in logs, logs[-5000:]
    assert len(run["pids"][0]) == 2  # the restart started every worker again
    assert run["losses"] == reference


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_recovery_that_cannot_publish_restarts_through_the_agents_path_after_a_checkpoint(
        tmp_path: Path, job_env: dict[str, str], reference: dict[int, str]) -> None:
    """The agent cannot publish the next generation (a directory stands where its file goes):
    the in-process recovery falls back to a restart, through the agent's one restart path, whose
    ``before_restart`` hook has the healthy rank 0, still alive and waiting for a generation,
    take its just-in-time checkpoint before it is stopped. The losses are an uninterrupted
    run's."""
    blocked = threading.Event()

    def block_the_generation_file() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            for directory in (tmp_path / "fallback-publish" / "inprocess").glob("*"):
                (directory / "generation.json" / "in-the-way").mkdir(parents=True)
                blocked.set()
                return
            time.sleep(0.05)

    threading.Thread(target=block_the_generation_file, daemon=True).start()
    run = _run(tmp_path, "fallback-publish", job_env, "--fault-rank", "1", "--crash-at-step",
               "6", "--crash-mode", "after-save", "--step-time", "0.3")
    assert blocked.is_set()
    events = run["events"]
    decisions = [e["action"] for e in events if e["kind"] == "decision"]
    assert decisions == ["recover_in_process"], run["text"][-5000:]
    (restart,) = [e for e in events if e["kind"] == "restart"]
    assert restart["cause"].startswith("in-process recovery failed") and not restart["counted"]
    jit = [e for e in events if e["kind"] == "jit_checkpoint"]
    assert len(jit) == 1, run["text"][-5000:]
    assert list(jit[0]["ranks"]) == ["0"] and jit[0]["ranks"]["0"] is not None, jit
    started = [e for e in events if e["kind"] == "workers_started"]
    assert restart["time"] <= jit[0]["time"] <= started[-1]["time"]
    assert len(run["pids"][0]) == 2  # the restart started every worker again
    assert run["losses"] == reference


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_second_failure_during_the_recovery_ends_in_a_correct_state(
        tmp_path: Path, job_env: dict[str, str], reference: dict[int, str]) -> None:
    """Rank 1 is killed; while the recovery is under way (the agent has published the next
    generation, the survivor has reported its failure and regroups), the survivor is killed
    too. The job
    ends in a correct state either way: the dead survivor replaced in the same generation, or
    every worker restarted from the snapshots; the losses are an uninterrupted run's."""
    killed: list[int] = []

    def kill_the_survivor_in_its_recovery() -> None:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not killed:
            for failed in (tmp_path / "second" / "inprocess").glob("*/failed-l0.json"):
                if not (failed.parent / "generation.json").exists():
                    continue  # the agent has not decided yet: not a failure during a recovery
                with contextlib.suppress(OSError, ValueError, KeyError):
                    pid = int(json.loads(failed.read_text())["pid"])
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
            time.sleep(0.005)

    threading.Thread(target=kill_the_survivor_in_its_recovery, daemon=True).start()
    run = _run(tmp_path, "second", job_env, "--fault-rank", "1", "--crash-at-step", "6",
               "--crash-mode", "after-save", "--step-time", "0.2")
    assert killed, run["text"][-5000:]
    events = run["events"]
    decisions = [e["action"] for e in events if e["kind"] == "decision"]
    assert decisions[0] == "recover_in_process", decisions
    recovered = [e for e in events if e["kind"] == "recover_in_process"]
    if recovered:  # the survivor was replaced in the same generation
        assert decisions == ["recover_in_process"], decisions
        (replaced,) = [e for e in events if e["kind"] == "survivor_replaced"]
        assert replaced["rank"] == 0 and sorted(recovered[0]["replaced"]) == ["0", "1"]
    else:  # or every worker restarted from the snapshots
        assert decisions[-1] == "restart_in_place", run["text"][-5000:]
    assert killed[0] in run["pids"][0] and len(run["pids"][0]) == 2, run["pids"]
    assert run["losses"] == reference
