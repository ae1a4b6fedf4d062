"""A durable elasticft checkpoint is a DCP checkpoint: dcp.load reshards it to another world."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from elasticft.ckpt.persisting import durable
from tests.conftest import ROOT

JOB = Path(__file__).with_name("dist_job.py")


def _torchrun(nproc: int, mode: str, root: Path, env: dict[str, str]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "--log-dir", str(root / f"logs-{mode}"), str(JOB), mode,
           str(root)]
    out = subprocess.run(cmd, cwd=ROOT, env=dict(env, PYTHONPATH=str(ROOT)), timeout=170,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_dcp_load_reshards_an_elasticft_checkpoint_from_2_to_3_ranks(tmp_path: Path,
                                                                      job_env) -> None:
    _torchrun(2, "save", tmp_path, job_env)
    info = durable.commit_info(durable.step_dir(tmp_path, 2))
    assert info is not None and info["dcp"] and info["ranks"] == [0, 1]
    _torchrun(3, "load", tmp_path, job_env)
    results = [json.loads((tmp_path / f"load-{r}.json").read_text()) for r in range(3)]
    for result in results:
        assert result["step"] == 2
        assert result["model_equal"] and result["exp_avg_nonzero"] and result["full_table_ok"]
    # 10 rows over 3 ranks: 4, 4, 2; each rank got its own rows of the saved table (+2).
    assert [len(r["local_rows"]) for r in results] == [4, 4, 2]
    assert results[2]["local_rows"] == [50.0, 56.0]
