"""``elasticft chaos`` finds a rank's worker from the run's events, or says in a sentence why it
cannot: no run there, workers not started, no such rank, the run finished, the worker exited."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

from elasticft import chaos, cli
from elasticft.events import EventLog

pytestmark = pytest.mark.timeout(30)

RUN_DIR = Path("elasticft-runs/quick")
START = {"kind": "run_start", "node": "a", "time": 1.0, "run_id": "job42"}
WORKERS = {"kind": "workers_started", "node": "a", "time": 2.0, "pids": {"0": 100, "1": 101}}
RESTARTED = {"kind": "workers_started", "node": "a", "time": 5.0, "pids": {"0": 200, "1": 201}}
OTHER_NODE = {"kind": "workers_started", "node": "b", "time": 2.5, "pids": {"2": 300, "3": 301}}
END = {"kind": "run_end", "node": "a", "time": 9.0, "state": "succeeded"}
OLD_END = {**END, "time": 1.5}  # an earlier launch in the same directory


@pytest.mark.parametrize(
    ("events", "rank", "alive", "answer"),
    [
        ([START, WORKERS], 1, {101}, 101),
        ([START, WORKERS, RESTARTED], 1, {201}, 201),
        ([START, WORKERS, OTHER_NODE], 3, {101, 301}, 301),
        ([OLD_END, START, WORKERS], 1, {101}, 101),
        ([], 1, set(), "no run in elasticft-runs/quick: elasticft-run writes its event log there "
                        "when it starts with --run-dir elasticft-runs/quick"),
        ([START], 1, set(), "run job42 has not started its workers yet; try again in a moment"),
        ([START, WORKERS], 5, {100, 101}, "run job42 has no rank 5; its ranks are 0, 1"),
        ([START, WORKERS, END], 1, set(), "rank 1 of run job42 is not running (the run finished "
                                          "at "),
        ([START, WORKERS], 1, {100}, "rank 1 of run job42 is not running (its worker, pid 101, "
                                     "has exited and the next one has not started); try again "
                                     "in a moment"),
    ],
)
def test_a_rank_is_found_or_the_reason_is_a_sentence(
        events: list[dict[str, Any]], rank: int, alive: set[int], answer: int | str) -> None:
    if isinstance(answer, int):
        assert chaos.locate_rank(events, RUN_DIR, rank, alive.__contains__) == answer
        return
    with pytest.raises(chaos.ChaosError) as caught:
        chaos.locate_rank(events, RUN_DIR, rank, alive.__contains__)
    assert str(caught.value).startswith(answer)
    assert "\n" not in str(caught.value) and "Errno" not in str(caught.value)


def test_killing_a_rank_of_a_finished_run_says_when_it_finished(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = EventLog(tmp_path, "a")
    log.emit("run_start", run_id="job42")
    log.emit("workers_started", pids={"0": os.getpid(), "1": 2**22 + 1})
    log.emit("run_end", state="succeeded")
    log.close()
    code = cli.main(["chaos", "kill", "--run-dir", str(tmp_path), "--rank", "1"])
    err = capsys.readouterr().err
    assert code == 2
    assert re.fullmatch(r"elasticft chaos: error: rank 1 of run job42 is not running \(the run "
                        r"finished at \d{4}-\d\d-\d\d \d\d:\d\d:\d\d, succeeded\)\n", err), err
