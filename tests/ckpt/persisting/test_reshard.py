"""A durable elasticft checkpoint is a DCP checkpoint: dcp.load reshards it to another world."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from elasticft.ckpt.persisting import durable
from tests.conftest import ROOT, free_port
from tests.forked import killed, start_forked

JOB = Path(__file__).with_name("dist_job.py")


def _ranks(nproc: int, mode: str, root: Path, env: dict[str, str]) -> None:
    """``nproc`` ranks of the job with the variables torchrun gives them (env:// rendezvous),
    forked from one interpreter (:mod:`tests.forked`): the launcher is not what is checked."""
    env = dict(env, PYTHONPATH=str(ROOT))
    port = str(free_port())
    ranks = [(dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank),
                   LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc)),
              [str(JOB), mode, str(root)]) for rank in range(nproc)]
    with killed(start_forked(ranks, ("tests.ckpt.persisting.dist_job",), env, ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)) as job:
        out = job.communicate(timeout=170)[0]
    assert job.returncode == 0, out[-6000:]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_dcp_load_reshards_an_elasticft_checkpoint_from_2_to_3_ranks(tmp_path: Path,
                                                                      job_env) -> None:
    _ranks(2, "save", tmp_path, job_env)
    info = durable.commit_info(durable.step_dir(tmp_path, 2))
    assert info is not None and info["dcp"] and info["ranks"] == [0, 1]
    _ranks(3, "load", tmp_path, job_env)
    results = [json.loads((tmp_path / f"load-{r}.json").read_text()) for r in range(3)]
    for result in results:
        assert result["step"] == 2
        assert result["model_equal"] and result["exp_avg_nonzero"] and result["full_table_ok"]
    # 10 rows over 3 ranks: 4, 4, 2; each rank got its own rows of the saved table (+2).
    assert [len(r["local_rows"]) for r in results] == [4, 4, 2]
    assert results[2]["local_rows"] == [50.0, 56.0]
