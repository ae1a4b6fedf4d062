"""Lightning's ``trainer.fit`` recovered in process under a real ``elasticft-run``, with DDP
(``InProcessDDPStrategy``), and with FSDP2 and with tensor parallel
(``InProcessModelParallelStrategy``, the survivor keeping its sharded module): rank 1 SIGKILLed
mid-training, rank 0 keeps its process, and the run ends with an uninterrupted run's steps and
parameters, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integrations.jobs import assert_recovered_in_process, needs_modules, run_job

pytestmark = needs_modules("lightning", "lightning")

SCRIPT = "train_lightning_inprocess.py"


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", [(), ("--model-parallel",),
                                      ("--model-parallel", "--tensor-parallel")],
                         ids=["ddp", "fsdp2", "tensor-parallel"])
def test_a_killed_rank_costs_the_survivor_a_rollback_not_its_process(
        tmp_path: Path, job_env: dict[str, str], strategy: tuple[str, ...]) -> None:
    reference = run_job(tmp_path, SCRIPT, "reference", job_env, *strategy)
    run = run_job(tmp_path, SCRIPT, "fault", job_env, *strategy, "--crash-at-step", "4",
                  "--checkpoint-dir", str(tmp_path / "own"))
    assert_recovered_in_process(run, reference)
    if strategy:  # the sharded module kept: its mesh's groups made again, FSDP2 re-pointed
        fsdp2 = 0 if "--tensor-parallel" in strategy else 1
        assert f"1 meshes, {fsdp2} FSDP2 group references" in run["text"]
    assert "Lightning entry 2 resumes from step 3" in run["text"]
    # Lightning's own checkpoints are written through the recovery as without it.
    # (every 3 steps: 12 steps with 2 data-parallel ranks, 24 when both are tensor parallel)
    saved = sorted(int(p.name.split("step=")[1].removesuffix(".ckpt"))
                   for p in (tmp_path / "own").iterdir())
    assert saved == list(range(3, run["report"]["last_step"] + 1, 3)), saved


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_rank_killed_before_the_first_snapshot_rolls_the_survivor_back_to_the_start(
        tmp_path: Path, job_env: dict[str, str]) -> None:
    """Killed at the start of its second batch, before the snapshot of its first step (taken
    there, after the callbacks): the survivor's model had taken the step, and only the start's
    snapshot (step 0) puts it back."""
    reference = run_job(tmp_path, SCRIPT, "reference", job_env)
    run = run_job(tmp_path, SCRIPT, "fault", job_env, "--crash-at-step", "1")
    assert_recovered_in_process(run, reference)
    assert "resumed from step 0 in shared memory" in run["text"], run["text"][-5000:]
    assert "entry 2 resumes" not in run["text"]
