"""A survivor is bounded from the agent's interrupt notice: the decision by a table (which
survivors the agent kills, from their records and the notice), and end to end under a real
``elasticft-run --standalone --nproc-per-node 3`` (gloo, real signals): rank 2 is SIGKILLed
while rank 1 holds the GIL in a C call, so it never reports its failure; rank 1 is killed after
the limit and replaced in the same recovery, rank 0 keeps its process, and the losses are an
uninterrupted 3-worker run's, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticft.inprocess.generations import InProcessCoordinator
from elasticft.inprocess.protocol import worker_file
from elasticft.inprocess.recovery_timing import Recovery, SurvivorState, overruns
from elasticft.jsonfile import write_json
from tests.conftest import made_once
from tests.inprocess.test_inprocess import _run

# Also on the second torch (scripts/compat.sh): there the reconfigure path, here a new group.
pytestmark = pytest.mark.smoke

STEPS = 10
LIMIT = 10.0
NOTICE = 1000.0


def _killed(states: list[SurvivorState], now: float, at_step: bool = False,
            notified_at: float | None = NOTICE) -> list[int]:
    return [o.local_rank for o in overruns(states, notified_at=notified_at, now=now,
                                           limit_s=LIMIT, step_wait_s=10.0, at_step=at_step,
                                           grace_s=5.0)]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("state", "now", "at_step", "killed"), [
    # reported nothing: the limit and the grace from the notice
    (SurvivorState(0, 10), NOTICE + 14.9, False, False),
    (SurvivorState(0, 10), NOTICE + 15.1, False, True),
    # a notice for a step boundary: the monitor ends its groups only after the step wait
    (SurvivorState(0, 10), NOTICE + 15.1, True, False),
    (SurvivorState(0, 10), NOTICE + 25.1, True, True),
    # reported its failure: its teardown and health check count from its report
    (SurvivorState(0, 10, failed_at=NOTICE + 10.0), NOTICE + 34.9, False, False),
    (SurvivorState(0, 10, failed_at=NOTICE + 10.0), NOTICE + 35.1, False, True),
    # torn down: it waits in the regroup for the others (the recovery's deadline bounds it)
    (SurvivorState(0, 10, failed_at=NOTICE, torn_down=True), NOTICE + 100.0, False, False),
    # in the new group, or leaving by itself: not the agent's to end
    (SurvivorState(0, 10, failed_at=NOTICE, joined=True), NOTICE + 100.0, False, False),
    (SurvivorState(0, 10, left=True), NOTICE + 100.0, False, False),
], ids=["silent-within", "silent-past", "step-within", "step-past", "failed-within",
        "failed-past", "torn-down", "joined", "left"])
def test_which_survivors_the_agent_kills(state: SurvivorState, now: float, at_step: bool,
                                         killed: bool) -> None:
    assert _killed([state], now, at_step) == ([0] if killed else [])


@pytest.mark.timeout(30)
def test_an_overrun_says_why_and_what_the_agent_saw() -> None:
    (silent,) = overruns([SurvivorState(1, 11)], notified_at=NOTICE, now=NOTICE + 20.0,
                         limit_s=LIMIT, grace_s=5.0)
    assert silent.pid == 11 and "did not report its failure within 10 s" in silent.reason
    assert silent.evidence == {"notified_at": NOTICE, "at_step": False, "limit_s": LIMIT,
                               "grace_s": 5.0, "seen_at": NOTICE + 20.0, "over_s": 5.0}
    assert _killed([SurvivorState(1, 11)], NOTICE + 100.0, notified_at=None) == []


@pytest.mark.timeout(30)
def test_the_coordinator_reads_each_survivors_state_from_its_records(tmp_path: Path) -> None:
    coordinator = InProcessCoordinator(tmp_path / "ip", timeout_s=5.0, teardown_limit_s=LIMIT)
    coordinator.reset()
    coordinator.interrupt()
    notified = coordinator.notified
    assert notified is not None and notified[0] == 0
    generation = coordinator.publish("127.0.0.1", 3)
    assert coordinator.notice_of(0, 5.0, False) == (notified[1], False)
    assert coordinator.notice_of(1, 5.0, True) == (5.0, True)  # no notice: the publication
    write_json(worker_file(coordinator.directory, "failed", 0),
               {"pid": 10, "generation": 0, "failed": NOTICE})
    write_json(worker_file(coordinator.directory, "failed", 1),  # an older process's record
               {"pid": 99, "generation": 0, "failed": NOTICE})
    pids = {0: 10, 1: 11, 2: 12}
    assert coordinator.survivors(pids, replaced={2: 20}) == [
        SurvivorState(0, 10, failed_at=NOTICE), SurvivorState(1, 11)]
    coordinator.recovery = Recovery(generation.generation, "crash", 0.0, 0.0, 0.0, {2: 20},
                                    deadline=0.0, notified_at=NOTICE)
    assert [o.local_rank for o in coordinator.overruns(pids, NOTICE + 14.0)] == []
    assert [o.local_rank for o in coordinator.overruns(pids, NOTICE + 16.0)] == [1]
    assert [o.local_rank for o in coordinator.overruns(pids, NOTICE + 26.0)] == [0, 1]
    write_json(worker_file(coordinator.directory, "torn", 0),
               {"pid": 10, "generation": 0, "aborted": NOTICE + 1.0})
    assert [o.local_rank for o in coordinator.overruns(pids, NOTICE + 26.0)] == [1]
    coordinator.close()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """An uninterrupted 3-worker run's losses, made once per test run."""
    from tests.conftest import clean_job_env

    def run() -> dict[int, str]:
        return _run(tmp_path_factory.mktemp("reference-3"), "reference", clean_job_env(),
                    "--steps", str(STEPS), nproc=3)["losses"]

    made = made_once(tmp_path_factory, f"inprocess-reference-3-{STEPS}", run)
    return {int(step): loss for step, loss in made.items()}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_survivor_that_holds_the_gil_is_killed_after_the_limit_and_replaced(
        tmp_path: Path, job_env: dict[str, str], reference: dict[int, str]) -> None:
    assert sorted(reference) == list(range(1, STEPS + 1))
    run = _run(tmp_path, "gil", job_env, "--fault-rank", "2", "--crash-at-step", "6",
               "--crash-mode", "after-save", "--gil-hold-rank", "1", "--gil-hold-at-step", "6",
               launch=("--recovery-inprocess-teardown-limit-s", "3"), nproc=3)
    events = run["events"]
    kinds = [e["kind"] for e in events]
    assert "restart" not in kinds, run["text"][-5000:]
    (killed,) = [e for e in events if e["kind"] == "survivor_killed"]
    assert killed["rank"] == 1 and "did not report its failure" in killed["reason"], killed
    assert killed["notified_at"] <= killed["seen_at"]
    (replaced,) = [e for e in events if e["kind"] == "survivor_replaced"]
    assert replaced["rank"] == 1 and replaced["reason"] == killed["reason"], replaced
    (done,) = [e for e in events if e["kind"] == "recover_in_process"]
    assert sorted(int(r) for r in done["replaced"]) == [1, 2], done
    assert len(run["pids"][0]) == 1, run["pids"]  # rank 0 kept its process
    assert len(run["pids"][1]) == 2 and len(run["pids"][2]) == 2, run["pids"]
    assert run["losses"] == reference


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_three_ranks_recovered_in_process_have_an_uninterrupted_runs_losses(
        tmp_path: Path, job_env: dict[str, str], reference: dict[int, str]) -> None:
    """Two survivors and a replacement: the survivors' re-made DDPs sum their buckets as the
    replacement's new one and the uninterrupted run's do (the recorder's bucket hook on every
    DDP of every generation), so 3 ranks are bit-exact."""
    run = _run(tmp_path, "three", job_env, "--fault-rank", "2", "--crash-at-step", "6",
               "--crash-mode", "after-save", nproc=3)
    (done,) = [e for e in run["events"] if e["kind"] == "recover_in_process"]
    assert sorted(int(r) for r in done["replaced"]) == [2], done
    assert len(run["pids"][0]) == 1 and len(run["pids"][1]) == 1, run["pids"]
    assert run["losses"] == reference
