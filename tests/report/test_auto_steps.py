"""Step records without a script change: the optimizer-step recorder, the merge with explicit
records, the report of a run whose steps are unknown, and a real plain DDP run under
elasticft-run with a crashed worker."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from elasticft.cli import main as cli_main
from elasticft.diag.autoinstall import wanted
from elasticft.events import EventLog
from elasticft.report.eventsonly import summarize
from elasticft.steps import (
    AutoStepRecorder,
    StepRecord,
    auto_step_path,
    merge_steps,
    read_steps,
)
from tests.conftest import BIN
from tests.leftovers import assert_nothing_left

WORKERS = Path(__file__).parent / "workers"


def write(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_explicit_records_win_per_rank_and_automatic_fill_the_rest(tmp_path):
    steps = tmp_path / "steps"
    write(steps / "rank0.jsonl", [{"time": 1.0, "step": 1, "ckpt_s": 0.5},
                                  {"time": 2.0, "step": 2}])
    write(steps / "rank0.auto.jsonl", [{"time": 1.0, "step": 1}, {"time": 2.0, "step": 2}])
    write(steps / "rank1.auto.jsonl", [{"time": 1.1, "step": 1}, {"time": 2.1, "step": 2,
                                                                    "counted": True}])
    with open(steps / "rank1.auto.jsonl", "a") as f:
        f.write('{"time": 3.1, "st')  # torn by a crash
    merged = read_steps(tmp_path)
    assert [(r.step, r.ckpt_s, r.automatic) for r in merged[0]] == [(1, 0.5, False),
                                                                     (2, 0.0, False)]
    assert [(r.step, r.counted, r.automatic) for r in merged[1]] == [(1, False, True),
                                                                      (2, True, True)]


@pytest.mark.parametrize("explicit, automatic, expected", [
    ({}, {}, {}),
    ({0: [2.0, 1.0]}, {}, {0: [1.0, 2.0]}),  # time order
    ({}, {0: [1.0]}, {0: [1.0]}),
    ({0: [5.0]}, {0: [1.0, 2.0]}, {0: [5.0]}),  # never both: no step counted twice
    ({0: []}, {0: [1.0]}, {0: [1.0]}),  # an empty explicit file does not hide the rest
    ({1: [3.0]}, {0: [1.0], 1: [4.0]}, {0: [1.0], 1: [3.0]}),
])
def test_merge_table(explicit, automatic, expected):
    def records(table, auto):
        return {rank: [StepRecord(t, 1, rank, automatic=auto) for t in times]
                for rank, times in table.items()}

    merged = merge_steps(records(explicit, False), records(automatic, True))
    assert {rank: [r.time for r in rs] for rank, rs in merged.items()} == expected


@pytest.mark.parametrize("env, pid, expected", [
    ({}, 7, (False, False)),
    ({"ELASTICFT_DIAG_RING_DIR": "/r"}, 7, (True, False)),
    ({"ELASTICFT_DIAG_PY_RING": "/proc/1/fd/3"}, 7, (True, False)),
    ({"ELASTICFT_STEP_LOG": "/s"}, 7, (False, True)),
    ({"ELASTICFT_DIAG_RING_DIR": "/r", "ELASTICFT_DIAG_AUTO": "0",
      "ELASTICFT_STEP_LOG": "/s"}, 7, (False, True)),
    ({"ELASTICFT_STEP_LOG": "/s", "ELASTICFT_DIAG_OWNER_PID": "8"}, 7, (False, False)),
    ({"ELASTICFT_STEP_LOG": "/s", "ELASTICFT_DIAG_OWNER_PID": "7"}, 7, (False, True)),
])
def test_what_the_bootstrap_installs(env, pid, expected):
    assert wanted(env, pid) == expected


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_adam_steps_are_numbered_by_the_optimizer_and_survive_a_resume(tmp_path):
    path = auto_step_path(tmp_path / "rank0.jsonl")
    assert path.name == "rank0.auto.jsonl"
    model = torch.nn.Linear(2, 1)
    optim = torch.optim.Adam(model.parameters())
    other = torch.optim.Adam(torch.nn.Linear(2, 1).parameters())
    recorder = AutoStepRecorder(path).install()
    try:
        for _ in range(3):
            model(torch.ones(1, 2)).sum().backward()
            optim.step()
            other.step()  # a second optimizer's steps are not steps of training
        resumed = torch.optim.Adam(model.parameters())
        resumed.load_state_dict(optim.state_dict())  # a restart that loads the checkpoint
        recorder.close()
        recorder = AutoStepRecorder(path).install()
        resumed.step()
    finally:
        recorder.close()
    assert [r["step"] for r in lines(path)] == [1, 2, 3, 4]
    assert not any(r.get("counted") for r in lines(path))


def test_sgd_steps_are_counted_on_from_the_last_record(tmp_path):
    path = tmp_path / "rank0.auto.jsonl"
    model = torch.nn.Linear(2, 1)
    for _process in range(2):  # a restart: a new process appends to the same file
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        recorder = AutoStepRecorder(path).install()
        try:
            for _ in range(2):
                model(torch.ones(1, 2)).sum().backward()
                optim.step()
        finally:
            recorder.close()
    assert [(r["step"], r["counted"]) for r in lines(path)] == [(1, True), (2, True),
                                                                (3, True), (4, True)]


def ev(t: float, kind: str, node: str = "n0", **payload):
    return {"time": t, "node": node, "kind": kind, **payload}


def test_events_only_summary_of_a_crashed_run():
    events = [
        ev(0.0, "run_start", run_id="r", process_started=-1.0),
        ev(2.0, "workers_started", attempt=0),
        ev(10.0, "failure", attempt=0, rank=1, failure_class="signal_crash"),
        ev(10.0, "failure", attempt=0, rank=0, failure_class="infrastructure"),
        ev(13.0, "workers_started", attempt=1),
        ev(20.0, "failure", attempt=1, rank=0, failure_class="hang"),
        ev(24.0, "workers_started", attempt=2),
        ev(30.0, "run_end", state="succeeded", restarts=2),
    ]
    s = summarize(events, "no step records")
    assert s.observed_s == pytest.approx(31.0)
    assert s.restarts == 2
    assert [(f.failure_class, f.ranks, f.lost_s) for f in s.failures] == [
        ("signal_crash", (1, 0), 3.0), ("hang", (0,), 4.0)]
    assert s.lost_s == pytest.approx(7.0)
    assert s.to_json()["tor"] is None and s.to_json()["why_no_tor"] == "no step records"


def test_report_without_steps_gives_what_is_known(tmp_path, capsys):
    log = EventLog(tmp_path, "n0")
    log.emit("run_start", run_id="x")
    log.emit("workers_started", attempt=0, pids={"0": 1})
    log.emit("failure", attempt=0, rank=0, failure_class="signal_crash")
    log.emit("workers_started", attempt=1, pids={"0": 2})
    log.emit("run_end", state="succeeded", restarts=1)
    log.close()
    assert cli_main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "TOR and ETTR not computed: no step records" in out
    assert "1 restart(s), 1 failure(s)" in out
    assert cli_main(["report", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["tor"], data["failures"], data["restarts"]) == (None, 1, 1)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_plain_ddp_script_gets_tor_after_a_crash_and_leaves_nothing(tmp_path, job_env):
    """No elasticft import and no step records in the script: the report still has TOR/ETTR."""
    run_dir = tmp_path / "run"
    cmd = [str(BIN / "elasticft-run"), "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "2", "--monitor-interval", "0.2", "--run-dir", str(run_dir),
           str(WORKERS / "plain_ddp.py"), "--steps", "30", "--save-to", str(tmp_path / "c.pt"),
           "--crash-at-step", "12"]
    job = subprocess.run(cmd, env=job_env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=200)
    assert job.returncode == 0, job.stderr[-3000:]
    assert not list((run_dir / "steps").glob("rank?.jsonl"))  # the script wrote none itself
    report = subprocess.run([str(BIN / "elasticft"), "report", str(run_dir), "--json"],
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    data = json.loads(report.stdout)
    assert data["step_source"] == "optimizer"
    assert data["failures"] == 1 and data["faults"][0]["failure_class"] == "signal_crash"
    assert data["steps_done"] == 30 and data["last_step"] == 30
    assert 0 < data["tor"] < 1 and 0 < data["ettr"] < 1
    # Resumed from the step-10 checkpoint: step 11 was done twice, and the report knows it.
    assert data["faults"][0]["rollback_steps"] >= 1
    assert_nothing_left(run_dir)
