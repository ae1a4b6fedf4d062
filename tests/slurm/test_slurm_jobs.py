"""elasticft-run inside real Slurm batch jobs: time limit -> checkpoint -> requeue -> resume,
scancel -> prompt exit without a checkpoint, a user-code error -> non-zero exit, no resubmit.

The cluster is the real two-node Slurm of ``conftest.py``. The time-limit jobs have two minutes
with ``--signal=B:USR1@40``. slurmctld checks time limits every 30 s and signals a job whose end
is within the lead time plus those 30 s, so the signal comes 50-80 s into the job: after the
workers have trained a while and installed their own handler, also on a loaded machine (at one
minute and ``@20`` it came 10-40 s in, and once before the workers could save on it). Their
first allocation trains at 0.8 s a step (160 steps: longer than the time limit).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from elasticft.events import read_events
from tests.conftest import BIN, EXAMPLES, free_port

pytestmark = pytest.mark.slow

STEPS = 160
FIRST_STEP_TIME = 0.8


def write_job(root: Path, name: str, sbatch: list[str], run_args: list[str],
              script_args: list[str], first_run_env: str = "", *,
              ckpt: Path, loss: Path, run_dir: Path, nproc_per_node: int = 2,
              launch: str = "exec") -> Path:
    """A batch script that runs ``train_plain.py`` under elasticft-run (``launch``: ``exec``
    in the batch shell, or ``exec srun`` for a launcher per node)."""
    lines = ["#!/bin/bash", *(f"#SBATCH {o}" for o in sbatch)]
    lines += [
        f"#SBATCH --output={root / (name + '-%j.out')}",
        "#SBATCH --open-mode=append",
        "#SBATCH --requeue",
        "echo \"allocation: job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0}\"",
        # The first allocation trains slowly so that the time limit comes first; a requeued
        # one runs at full speed (as on a machine that is not shared).
        f'if [ -z "$SLURM_RESTART_COUNT" ]; then {first_run_env or ":"}; fi',
        f"{launch} {BIN / 'elasticft-run'} --nproc-per-node {nproc_per_node} "
        "--monitor-interval 0.2 "
        f"--run-dir {run_dir} {' '.join(run_args)} {EXAMPLES / 'train_plain.py'} "
        f"--ckpt-dir {ckpt.parent} --loss-log {loss} --ckpt-every 100000 "
        f"{' '.join(script_args)} --steps {STEPS} --step-time ${{STEP_TIME:-0}}",
        "",
    ]
    script = root / f"{name}.sh"
    script.write_text("\n".join(lines))
    script.chmod(0o755)
    return script


def submit(cluster, script: Path, env: dict[str, str]) -> str:
    done = subprocess.run(
        ["sbatch", "--parsable", f"--chdir={script.parent}", str(script)],
        env=cluster.env(env), capture_output=True, text=True, timeout=30,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def loss_steps(loss: Path) -> list[int]:
    if not loss.exists():
        return []
    return [int(line.split()[0]) for line in loss.read_text().splitlines() if line.strip()]


def kinds(run_dir: Path) -> list[str]:
    return [e["kind"] for e in read_events(run_dir)]


def job_output(root: Path, name: str, job_id: str) -> str:
    path = root / f"{name}-{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else "(no output)"


def requeued_once_then_completed(cluster, job: str, root: Path, name: str) -> str:
    """Waits for the job's requeue, lets its next allocation finish, and returns the output of
    both once Slurm says it requeued the job exactly once."""
    restarted = lambda: int(cluster.job_field(job, "Restarts") or 0) >= 1  # noqa: E731
    cluster.wait_job(job, restarted, 150, "a requeue")
    # The next allocation gets room to finish (its own time limit would signal it again).
    cluster.run("scontrol", "update", f"JobId={job}", "TimeLimit=10")
    # 160 steps of two ranks: seconds on a quiet machine, over two minutes on a loaded one.
    cluster.wait_job(job, lambda: cluster.job_field(job, "JobState") == "COMPLETED", 360,
                     "completion")
    out = job_output(root, name, job)
    assert cluster.job_field(job, "Restarts") == "1", out
    return out


SCONTROL_OUTLIVED_BY_THE_REQUEUE = """#!/bin/bash
# scontrol as a loaded machine may run it: the requeue is done, and Slurm's SIGTERM to every
# process of the job (the requeue ends the allocation) comes before this one has exited.
{real} "$@" || exit $?
if [ "$1" = requeue ]; then sleep 30; fi
"""


@pytest.mark.parametrize("scontrol", ["exits", "ended-by-the-requeue"])
@pytest.mark.timeout(600)
def test_time_limit_checkpoints_requeues_and_resumes(slurm_cluster, job_env, tmp_path, scontrol):
    root = slurm_cluster.root / f"timelimit-{scontrol}"
    root.mkdir()
    ckpt, loss, run_dir = root / "ckpt" / "latest.pt", root / "loss.txt", root / "run"
    first_run_env = f"export STEP_TIME={FIRST_STEP_TIME}"
    if scontrol == "ended-by-the-requeue":
        shim = root / "bin"
        shim.mkdir()
        real = shutil.which("scontrol", path=slurm_cluster.env()["PATH"])
        (shim / "scontrol").write_text(SCONTROL_OUTLIVED_BY_THE_REQUEUE.format(real=real))
        (shim / "scontrol").chmod(0o755)
        first_run_env += f"; export PATH={shim}:$PATH"
    script = write_job(
        root, "tl", ["--time=2", "--signal=B:USR1@40"], ["--slurm-signal", "B:USR1@40"], [],
        first_run_env=first_run_env, ckpt=ckpt, loss=loss, run_dir=run_dir,
    )
    out = requeued_once_then_completed(slurm_cluster, submit(slurm_cluster, script, job_env),
                                       root, "tl")

    # First allocation: signalled, saved step K, requeued, exited 0 as "requeued".
    events = read_events(run_dir)
    ends = [e for e in events if e["kind"] == "run_end"]
    assert [e["state"] for e in ends] == ["requeued", "succeeded"], out
    assert ends[0]["exit_code"] == 0
    checkpoint = next(e for e in events if e["kind"] == "slurm_checkpoint")
    assert checkpoint["durable"] is True, checkpoint
    requeue = next(e for e in events if e["kind"] == "slurm_requeue")
    assert requeue["ok"] is True and requeue["how"] == "scontrol", requeue
    # scontrol ended by the SIGTERM: -15, or 143 when its shell outlived the sleep it ran.
    assert ("yet Restarts=1: requeued" in requeue["detail"]) is (scontrol != "exits"), requeue
    saved = [line for line in out.splitlines() if "SIGUSR1: saved step" in line]
    assert len(saved) == 1, out
    saved_step = int(saved[0].split("saved step ")[1].split(",")[0])
    assert 0 < saved_step < STEPS

    # Second allocation resumed exactly there: every step once, in order, none lost or redone.
    assert f"resumed from step {saved_step}" in out, out
    assert loss_steps(loss) == list(range(1, STEPS + 1)), out
    allocations = [e for e in events if e["kind"] == "slurm_allocation"]
    assert [e["restart_count"] for e in allocations] == [0, 1]
    assert torch_step(ckpt) == STEPS


@pytest.mark.timeout(600)
def test_a_job_of_two_nodes_requeues_once_and_every_node_ends_requeued(
        slurm_cluster, job_env, tmp_path):
    root = slurm_cluster.root / "timelimit-two-nodes"
    root.mkdir()
    ckpt, loss, run_dir = root / "ckpt" / "latest.pt", root / "loss.txt", root / "run"
    # A launcher per node (srun), each signalled by Slurm (no B:); node rank and node count
    # come from the allocation, the address is given (the test nodes' names do not resolve).
    script = write_job(
        root, "tl2", ["--nodes=2", "--ntasks-per-node=1", "--time=2", "--signal=USR1@40"],
        ["--slurm-signal", "USR1@40", "--master-addr", "127.0.0.1", "--master-port",
         str(free_port())], [],
        first_run_env=f"export STEP_TIME={FIRST_STEP_TIME}", ckpt=ckpt, loss=loss,
        run_dir=run_dir, nproc_per_node=1, launch="exec srun --kill-on-bad-exit=0",
    )
    out = requeued_once_then_completed(slurm_cluster, submit(slurm_cluster, script, job_env),
                                       root, "tl2")

    events = read_events(run_dir)
    ends = sorted((e["time"], e["state"], e["exit_code"]) for e in events
                  if e["kind"] == "run_end")
    assert [(state, code) for _, state, code in ends] == [
        ("requeued", 0), ("requeued", 0), ("succeeded", 0), ("succeeded", 0)], out
    # One node requeued, once the other had said its save was over; the other left it to it.
    requeues = [e for e in events if e["kind"] == "slurm_requeue"]
    assert len(requeues) == 2 and all(e["ok"] for e in requeues), requeues
    assert [e["detail"] for e in requeues].count("left to the round's first node") == 1
    met = [e for e in events if e["kind"] == "slurm_nodes_saved"]
    assert [(e["nodes"], e["missing"]) for e in met] == [(2, [])], met
    saved = [line for line in out.splitlines() if "SIGUSR1: saved step" in line]
    assert len(saved) == 1, out
    saved_step = int(saved[0].split("saved step ")[1].split(",")[0])
    assert f"resumed from step {saved_step}" in out, out
    assert loss_steps(loss) == list(range(1, STEPS + 1)), out
    assert torch_step(ckpt) == STEPS


def torch_step(path: Path) -> int:
    import torch

    return int(torch.load(path, weights_only=True)["step"])


@pytest.mark.timeout(240)
def test_scancel_exits_without_checkpoint_or_resubmission(slurm_cluster, job_env):
    root = slurm_cluster.root / "cancel"
    root.mkdir()
    ckpt, loss, run_dir = root / "ckpt" / "latest.pt", root / "loss.txt", root / "run"
    script = write_job(
        root, "cancel", ["--time=5", "--signal=B:USR1@50"], [], [],
        first_run_env="export STEP_TIME=0.4", ckpt=ckpt, loss=loss, run_dir=run_dir,
    )
    job = submit(slurm_cluster, script, job_env)
    slurm_cluster.wait_job(job, lambda: len(loss_steps(loss)) >= 3, 120, "three training steps")
    cancelled_at = time.monotonic()
    slurm_cluster.run("scancel", job)
    slurm_cluster.wait_job(
        job, lambda: "run_end" in kinds(run_dir), 60, "the launcher's run_end event"
    )
    exit_s = time.monotonic() - cancelled_at
    out = job_output(root, "cancel", job)

    end = next(e for e in read_events(run_dir) if e["kind"] == "run_end")
    assert end["state"] == "stopped" and end["exit_code"] == 143, (end, out)
    assert "slurm_cancel" in kinds(run_dir)
    assert "slurm_requeue" not in kinds(run_dir) and "slurm_checkpoint" not in kinds(run_dir)
    assert not ckpt.exists(), "a cancelled job saved a checkpoint"
    print(f"the launcher's run_end came {exit_s:.1f} s after scancel")
    # COMPLETING until Slurm has reaped the job's steps: wait for the state, never assume it.
    slurm_cluster.wait_job(job, lambda: slurm_cluster.job_field(job, "JobState") == "CANCELLED",
                           60, "state CANCELLED")
    assert slurm_cluster.job_field(job, "Restarts") == "0"
    queue = slurm_cluster.run("squeue", "-h", "-o", "%i %T")
    assert queue.strip() == "", f"something was resubmitted: {queue}"


@pytest.mark.timeout(240)
def test_user_code_error_saves_and_exits_nonzero_without_resubmission(slurm_cluster, job_env):
    root = slurm_cluster.root / "usererror"
    root.mkdir()
    ckpt, loss, run_dir = root / "ckpt" / "latest.pt", root / "loss.txt", root / "run"
    script = write_job(
        root, "bug", ["--time=5", "--signal=B:USR1@50"], [], ["--user-error-at-step", "5"],
        ckpt=ckpt, loss=loss, run_dir=run_dir,
    )
    job = submit(slurm_cluster, script, job_env)
    slurm_cluster.wait_job(
        job, lambda: slurm_cluster.job_field(job, "JobState") in ("FAILED", "COMPLETED"), 150,
        "the job to end",
    )
    out = job_output(root, "bug", job)
    assert slurm_cluster.job_field(job, "JobState") == "FAILED", out
    assert slurm_cluster.job_field(job, "ExitCode") == "1:0", out
    assert slurm_cluster.job_field(job, "Restarts") == "0"
    events = read_events(run_dir)
    end = next(e for e in events if e["kind"] == "run_end")
    assert end["state"] == "failed" and end["exit_code"] == 1
    assert "slurm_no_resubmit" in kinds(run_dir)
    assert "slurm_requeue" not in kinds(run_dir)
    assert torch_step(ckpt) == 5, "the last finished step was not saved"
    assert slurm_cluster.run("squeue", "-h").strip() == "", "something was resubmitted"
