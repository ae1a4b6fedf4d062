"""Lightning's ``trainer.fit`` recovered in process under a real ``elasticft-run``, with DDP
(``InProcessDDPStrategy``) and with FSDP2 (``InProcessModelParallelStrategy``, the survivor
keeping its sharded module): rank 1 SIGKILLed mid-training, rank 0 keeps its process, and the
run ends with an uninterrupted run's steps and parameters, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integrations.jobs import assert_recovered_in_process, run_job

pytest.importorskip("lightning")

SCRIPT = "train_lightning_inprocess.py"


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", [(), ("--model-parallel",)], ids=["ddp", "fsdp2"])
def test_a_killed_rank_costs_the_survivor_a_rollback_not_its_process(
        tmp_path: Path, job_env: dict[str, str], strategy: tuple[str, ...]) -> None:
    reference = run_job(tmp_path, SCRIPT, "reference", job_env, *strategy)
    run = run_job(tmp_path, SCRIPT, "fault", job_env, *strategy, "--crash-at-step", "4",
                  "--checkpoint-dir", str(tmp_path / "own"))
    assert_recovered_in_process(run, reference)
    if strategy:  # the sharded module kept: its mesh's groups made again, FSDP2 re-pointed
        assert "1 meshes, 1 FSDP2 group references" in run["text"]
    assert "Lightning entry 2 resumes from step 3" in run["text"]
    # Lightning's own checkpoints are written through the recovery as without it.
    assert sorted(p.name for p in (tmp_path / "own").iterdir()) == [
        "epoch=0-step=3.ckpt", "epoch=0-step=6.ckpt", "epoch=1-step=12.ckpt",
        "epoch=1-step=9.ckpt"]
