"""The pre-started spare's pure parts, by tables: when the agent starts one, which failed rank it
takes, the environment it starts with; and the spare's side without a job: an assignment read
back whole, a Checkpointer rebound in place to another rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticft.ckpt.settings import ENV_CONTROL, ENV_SHM
from elasticft.inprocess.protocol import Assignment, Generation
from elasticft.inprocess.spare import is_spare
from elasticft.inprocess.spare_keeper import (
    FAILED_LIMIT,
    SpareMove,
    next_move,
    node_gpus,
    pick,
    spare_env,
)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("enabled", "running", "failed", "armed", "recovering", "warm", "move"), [
    (False, False, 0, True, False, None, SpareMove.OFF),  # the option is off
    (True, False, FAILED_LIMIT, True, False, None, SpareMove.OFF),  # too many spares exited
    (True, True, 0, True, False, True, SpareMove.KEEP),  # one runs (or waits)
    (True, True, 0, True, True, True, SpareMove.KEEP),  # a recovery does not end a waiting spare
    (True, False, 0, False, False, None, SpareMove.WAIT),  # the workers are still starting
    (True, False, 0, True, True, None, SpareMove.WAIT),  # a recovery is under way
    (True, False, 0, True, False, False, SpareMove.WAIT),  # the warm interpreter still imports
    (True, False, 0, True, False, True, SpareMove.START),  # forked from the warm interpreter
    (True, False, 0, True, False, None, SpareMove.START),  # no warm interpreter: a cold start
    (True, False, FAILED_LIMIT - 1, True, False, None, SpareMove.START),  # another after a failure
])
def test_when_the_agent_starts_a_spare(enabled: bool, running: bool, failed: int, armed: bool,
                                       recovering: bool, warm: bool | None,
                                       move: SpareMove) -> None:
    assert next_move(enabled=enabled, running=running, failed=failed, armed=armed,
                     recovering=recovering, warm_ready=warm) is move


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("ready", "alive", "failed", "taken"), [
    (True, True, [1], 1),
    (True, True, [3, 1], 1),  # one spare: the lowest rank; the others get new processes
    (False, True, [1], None),  # its set-up still runs: a new process is faster than waiting
    (True, False, [1], None),  # it exited
    (True, True, [], None),  # a regroup with no process replaced
])
def test_which_failed_rank_the_spare_takes(ready: bool, alive: bool, failed: list[int],
                                           taken: int | None) -> None:
    assert pick(ready=ready, alive=alive, failed_local_ranks=failed) == taken


@pytest.mark.timeout(30)
def test_the_spare_starts_in_a_world_of_its_own_without_the_rank_s_files() -> None:
    worker = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "MASTER_PORT": "29500",
              "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_ERROR_FILE": "/e/1.json",
              ENV_SHM: "/proc/1/fd/5", ENV_CONTROL: "/c", "ELASTICFT_STEP_LOG": "/s/3.jsonl",
              "ELASTICFT_DIAG_RING_DIR": "/r", "PYTHONPATH": "/boot", "OMP_NUM_THREADS": "1"}
    env = spare_env(worker, "2")
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                "TORCHELASTIC_USE_AGENT_STORE")} == {
        "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "0", "TORCHELASTIC_USE_AGENT_STORE": "False"}
    assert not {ENV_SHM, ENV_CONTROL, "ELASTICFT_STEP_LOG", "ELASTICFT_DIAG_RING_DIR",
                "TORCHELASTIC_ERROR_FILE"} & set(env)
    assert env["PYTHONPATH"] == "/boot" and env["OMP_NUM_THREADS"] == "1"
    assert is_spare(env) and not is_spare(worker)


@pytest.mark.timeout(30)
def test_an_assignment_is_read_back_whole_and_a_torn_one_is_none(tmp_path: Path) -> None:
    generation = Generation(2, "127.0.0.1", 4321, 2)
    assert Assignment.read(tmp_path, "1") is None
    Assignment(generation, 1, {"RANK": "1"}).write(tmp_path, "1")
    assert Assignment.read(tmp_path, "1") == Assignment(generation, 1, {"RANK": "1"})
    assert (tmp_path / "assign-1.json").stat().st_mode & 0o077 == 0  # the rank's secret
    (tmp_path / "assign-2.json").write_text('{"generation": {"generation": 2}}')
    assert Assignment.read(tmp_path, "2") is None


@pytest.mark.timeout(30)
def test_status_counts_the_spares_and_says_which_recovery_a_spare_made(tmp_path: Path) -> None:
    from elasticft.events import EventLog
    from elasticft.report.status import format_recoveries, format_spares, recoveries, spares

    log = EventLog(tmp_path, "node-a")
    for number, pid in ((1, 101), (2, 102)):
        log.emit("spare_started", spare=number, pid=pid, warm=True)
    log.emit("spare_ready", spare=1, pid=101, setup_s=1.5)
    log.emit("recover_in_process", generation=1, replaced={"1": 101}, spare={"1": 101},
             phases={"total_s": 0.5})
    log.emit("spare_failed", spare=2, pid=102, exitcode=1)
    log.close()
    assert spares(tmp_path) == {"started": 2, "ready": 1, "took_rank": 1, "exited": 1}
    assert format_spares(spares(tmp_path)) == (
        "spares: 2 started, 1 ready, 1 took a rank, 1 exited while waiting")
    assert "replaced rank(s) 1 (by the spare): total 0.50 s" in format_recoveries(
        *recoveries(tmp_path))


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("visible", "files", "gpus"), [
    (None, [], []),
    (None, ["/dev/nvidia1", "/dev/nvidia0", "/dev/nvidiactl"], ["0", "1"]),
    ("2,3", ["/dev/nvidia0", "/dev/nvidia1"], ["2", "3"]),
    ("", ["/dev/nvidia0"], []),  # CUDA_VISIBLE_DEVICES="": the workers see no GPU
])
def test_the_gpus_the_workers_see(visible: str | None, files: list[str], gpus: list[str]
                                  ) -> None:
    assert node_gpus(visible, files) == gpus
