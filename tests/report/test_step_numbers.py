"""Step numbers that follow the training's real step: the pure numbering rules (tables), the
recorder across DCP's initialising step and restores (in process), and two real runs under
elasticft-run: a DCP-restoring DDP script killed after step 17, and an in-process recovery
that redoes a step."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from elasticft.report.tor import STEP_SOURCE_LINES, analyze, format_report
from elasticft.steps import (
    AutoStepRecorder,
    CountView,
    StepRecord,
    is_init_step,
    must_read,
    number_step,
)
from tests.conftest import BIN, EXAMPLES
from tests.leftovers import assert_nothing_left

WORKERS = Path(__file__).parent / "workers"


@pytest.mark.parametrize("own, previous, last, expected", [
    (1, None, 0, (1, False)),  # a fresh run
    (16, None, 5, (16, False)),  # a restart that restored step 15: the optimizer's count wins
    (16, 17, 17, (16, False)),  # a restore in process: the count went back, so does the step
    (None, None, 0, (1, True)),  # SGD, fresh
    (None, None, 17, (18, True)),  # SGD after a restart: counted on, the restore is not seen
    (None, 4, 17, (5, True)),  # SGD within a process
])
def test_number_step_table(own, previous, last, expected):
    assert number_step(own, previous, last) == expected


@pytest.mark.parametrize("has_state, lrs, grads_zero, expected", [
    (False, [0.0], True, True),  # DCP's _init_optim_state
    (False, [0.0, torch.tensor(0.0)], True, True),  # a tensor learning rate, several groups
    (False, [0.0, 0.1], True, False),
    (False, [0.0], False, False),  # a warm-up from lr 0 with real gradients is a step
    (True, [0.0], True, False),  # an optimizer with state is past its first step
    (False, [], True, False),
    (False, [None], True, False),
])
def test_is_init_step_table(has_state, lrs, grads_zero, expected):
    assert is_init_step(has_state, lrs, grads_zero) is expected


HOST, DEV = False, True


@pytest.mark.parametrize("now, before, delta, expected", [
    (CountView(None), CountView(None), None, True),  # a plain number: always read
    (CountView(1, HOST, 5), CountView(1, HOST, 4), 1, True),  # host memory: always read
    (CountView(1, DEV, 5), CountView(None), None, True),  # first sight
    (CountView(1, DEV, 5), CountView(1, DEV, 4), None, True),  # no step-to-step delta yet
    (CountView(1, DEV, 6), CountView(1, DEV, 5), 1, False),  # a plain step: count on
    (CountView(1, DEV, 8), CountView(1, DEV, 5), 1, True),  # restored in place (copy_)
    (CountView(2, DEV, 1), CountView(1, DEV, 5), 1, True),  # load_state_dict: a new tensor
])
def test_must_read_table(now, before, delta, expected):
    assert must_read(now, before, delta) is expected


def steps_of(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def train(model: torch.nn.Module, optim: torch.optim.Optimizer, n: int) -> None:
    for _ in range(n):
        optim.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        optim.step()


def test_numbers_follow_dcp_init_step_and_every_restore(tmp_path):
    path = tmp_path / "rank0.auto.jsonl"
    model = torch.nn.Linear(2, 1)
    optim = torch.optim.AdamW(model.parameters())
    recorder = AutoStepRecorder(path).install()
    try:
        train(model, optim, 3)
        early = copy.deepcopy(optim.state_dict())
        train(model, optim, 2)
        saved = get_state_dict(model, optim)
        dcp.save({"model": saved[0], "optim": saved[1]}, checkpoint_id=tmp_path / "c")
        train(model, optim, 2)  # steps 6 and 7, to be redone
        recorder.close()
        # A restarted process: DCP's get_state_dict steps the fresh optimizer once.
        model = torch.nn.Linear(2, 1)
        optim = torch.optim.AdamW(model.parameters())
        recorder = AutoStepRecorder(path).install()
        state = get_state_dict(model, optim)
        loaded = {"model": state[0], "optim": state[1]}
        dcp.load(loaded, checkpoint_id=tmp_path / "c")
        set_state_dict(model, optim, model_state_dict=loaded["model"],
                       optim_state_dict=loaded["optim"])
        train(model, optim, 3)  # 6, 7, 8
        # A restore in place (an in-process recovery): the live count is set back.
        for value in optim.state.values():
            value["step"].copy_(torch.tensor(7.0))
        train(model, optim, 1)  # 8 again
        optim.load_state_dict(early)  # a plain load_state_dict of the state of step 3
        train(model, optim, 1)  # 4
    finally:
        recorder.close()
    assert steps_of(path) == [1, 2, 3, 4, 5, 6, 7, 6, 7, 8, 8, 4]


def report_of(run_dir: Path) -> tuple[dict, str]:
    def report(*extra: str) -> str:
        out = subprocess.run([str(BIN / "elasticft"), "report", str(run_dir), *extra],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout

    return json.loads(report("--json")), report()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dcp_restoring_script_killed_after_step_17_counts_40_steps_and_the_redo(
        tmp_path, job_env):
    """get_state_dict's zero-gradient step no longer numbers the restarted process's steps from
    1: the report counts the 40 steps and steps 16 and 17, done again, as rollback."""
    run_dir = tmp_path / "run"
    cmd = [str(BIN / "elasticft-run"), "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "3", "--monitor-interval", "0.2", "--run-dir", str(run_dir),
           str(WORKERS / "dcp_ddp.py"), "--steps", "40", "--save-to", str(tmp_path / "ckpt"),
           "--kill-after-step", "17"]
    job = subprocess.run(cmd, env=job_env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=240)
    assert job.returncode == 0, job.stderr[-3000:]
    assert (tmp_path / "ckpt" / "latest").read_text() == "40"
    data, text = report_of(run_dir)
    assert data["step_source"] == "optimizer"
    assert (data["first_step"], data["last_step"], data["steps_done"]) == (0, 40, 40)
    assert data["failures"] == 1 and data["faults"][0]["failure_class"] == "signal_crash"
    # Resumed from step 15; rank 0 (the reference) had finished 16 and 17.
    assert data["faults"][0]["rollback_steps"] == 2
    assert data["phases_s"]["rollback"] > 0
    assert "steps 0 -> 40 (40 that counted)" in text
    assert "step numbers: the optimizer's own step count" in text
    assert_nothing_left(run_dir)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_in_process_recovery_counts_30_steps_with_the_redone_step_as_rollback(
        tmp_path, job_env):
    """Rank 1 is killed after step 12, before its snapshot of it: rank 0 keeps its process,
    restores step 11 (the newest every rank holds) in place and does step 12 again (unless its
    own step 12 was refused before it finished). Its
    automatic records follow the restored optimizer count, so the redo is rollback, not a 31st
    step."""
    run_dir, pids = tmp_path / "run", tmp_path / "pids"
    cmd = [str(BIN / "elasticft-run"), "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "3", "--run-dir", str(run_dir), "--ckpt-persist-every", "0",
           "--monitor-interval", "0.1", str(EXAMPLES / "train_inprocess.py"), "--steps", "30",
           "--fault-rank", "1", "--crash-at-step", "12", "--crash-mode", "before-save",
           "--step-time", "0.05", "--no-step-records",
           "--pid-log", str(pids)]
    job = subprocess.run(cmd, env=job_env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=240)
    assert job.returncode == 0, job.stderr[-3000:]
    out = job.stdout + job.stderr
    assert "recover_in_process" in out and "restart_in_place" not in out, out[-3000:]
    # How many steps rank 0 did twice, from the script's own log (one pid: it kept its process).
    rank0 = [line.split() for line in pids.read_text().splitlines() if line.startswith("0 ")]
    assert len({pid for _, pid, _ in rank0}) == 1
    done = [int(step) for _, _, step in rank0]
    redone = len(done) - len(set(done))
    assert sorted(set(done)) == list(range(1, 31))
    # At most the step in flight: none when the interrupt refused rank 0's optimizer step of
    # step 12 before it finished (the kill is seen within milliseconds).
    assert redone <= 1, done
    data, text = report_of(run_dir)
    assert data["step_source"] == "optimizer"
    assert (data["last_step"], data["steps_done"]) == (30, 30)
    assert data["failures"] == 1 and data["faults"][0]["action"] == "recover_in_process"
    assert data["faults"][0]["rollback_steps"] == redone
    assert "steps 0 -> 30 (30 that counted)" in text
    assert_nothing_left(run_dir)


def in_process_run(automatic: bool, counted: bool):
    """Steps 1-12 at 1 s, rank 1 fails at 13.5, rank 0 recovers in process from step 11 and
    does step 12 again, then 13-30."""
    events = [
        {"time": 0.0, "node": "n0", "kind": "run_start", "run_id": "r"},
        {"time": 1.0, "node": "n0", "kind": "workers_started", "attempt": 0,
         "pids": {"0": 10, "1": 11}},
        {"time": 13.5, "node": "n0", "kind": "failure", "attempt": 0, "rank": 1,
         "failure_class": "signal_crash"},
        {"time": 13.5, "node": "n0", "kind": "decision", "attempt": 0,
         "action": "recover_in_process", "reason": "crash"},
        {"time": 14.5, "node": "n0", "kind": "recover_in_process", "attempt": 0,
         "phases": {"total_s": 1.0}},
        {"time": 35.0, "node": "n0", "kind": "run_end", "state": "succeeded"},
    ]
    # Counted on (no optimizer count): the redo of step 12 is numbered 13, the last step 31.
    numbers = list(range(1, 13)) + (list(range(13, 32)) if counted else list(range(12, 31)))
    times = [1.0 + i for i in range(12)] + [15.0 + i for i in range(len(numbers) - 12)]
    return events, {0: [StepRecord(t, n, 0, automatic=automatic, counted=counted)
                        for t, n in zip(times, numbers, strict=True)]}


@pytest.mark.parametrize("automatic, counted, steps_line, source", [
    (False, False, "steps 0 -> 30 (30 that counted)", "the script's own records"),
    (True, False, "steps 0 -> 30 (30 that counted)", "the optimizer's own step count"),
    (True, True, "31 optimizer steps (real step numbers not known)", "not known"),
])
def test_an_in_process_redo_is_rollback_and_the_report_names_its_step_numbers(
        automatic, counted, steps_line, source):
    a = analyze(*in_process_run(automatic, counted))
    text = format_report(a)
    assert steps_line in text
    assert sum(line.startswith("  step numbers: ") for line in text.splitlines()) == 1
    assert f"  step numbers: {source}" in text
    (fault,) = a.faults
    assert fault.action == "recover_in_process"
    assert fault.rollback_steps == (0 if counted else 1)
    assert a.to_json()["step_numbers"] == STEP_SOURCE_LINES[a.step_source]


class DeviceCount:
    """Stands for a step count kept on the GPU (fused or capturable optimizers): counts how
    often the host reads it, each read a wait for the device."""

    device = type("Device", (), {"type": "cuda"})()

    def __init__(self, value: int) -> None:
        self.value, self._version, self.reads = value, 0, 0

    def add_(self, n: int) -> None:  # what a step does
        self.value += n
        self._version += 1

    def copy_(self, value: int) -> None:  # what a restore in place does
        self.value = value
        self._version += 1

    def __int__(self) -> int:
        self.reads += 1
        return self.value


def test_a_count_on_the_device_is_read_only_after_a_restore(tmp_path):
    path = tmp_path / "rank0.auto.jsonl"
    param = torch.nn.Parameter(torch.zeros(1))
    count = DeviceCount(0)
    optim = type("FusedAdam", (), {"param_groups": [{"params": [param], "lr": 0.1}],
                                   "state": {param: {"step": count}}})()
    recorder = AutoStepRecorder(path)

    def step() -> None:
        count.add_(1)
        recorder.on_step(optim, (), {})

    try:
        for _ in range(5):
            step()
        assert count.reads == 2  # the first step, and the second to learn a step's writes
        count.copy_(3)  # an in-process restore of step 3
        step()
        step()  # the count's writes back to one a step: read once more to be sure
        step()
        reads = count.reads
        optim.state[param]["step"] = count = DeviceCount(6)  # load_state_dict: a new tensor
        step()
        assert (reads, count.reads) == (4, 1)
    finally:
        recorder.close()
    assert steps_of(path) == [1, 2, 3, 4, 5, 4, 5, 6, 7]
