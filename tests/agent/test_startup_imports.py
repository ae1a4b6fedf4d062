"""An agent imports what it runs on, not what it might read one day: a whole launch, from the
command line to the run's end, never imports torch's distributed checkpointing (DCP and DTensor,
over a second of CPU), which the agent needs only when it commits a checkpoint to disk."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import BIN, clean_job_env

PRINT_ARGV = Path(__file__).parent / "workers" / "print_argv.py"
HEAVY = ("torch.distributed.checkpoint", "torch.distributed.tensor")


def imported(importtime_stderr: str) -> set[str]:
    """The modules ``python -X importtime`` reports (its lines end with ``| <module name>``)."""
    return {line.rsplit("|", 1)[1].strip() for line in importtime_stderr.splitlines()
            if line.startswith("import time:")}


def test_imported_reads_importtime_lines() -> None:
    text = ("import time: self [us] | cumulative | imported package\n"
            "import time:       301 |    1301270 |             torch.distributed.tensor\n"
            "I1127 elasticft: something else | not an import\n")
    assert imported(text) == {"imported package", "torch.distributed.tensor"}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_launch_never_imports_torch_distributed_checkpointing(tmp_path: Path) -> None:
    env = {**clean_job_env(), "ARGV_OUT": str(tmp_path / "argv.json")}
    done = subprocess.run(
        [sys.executable, "-X", "importtime", str(BIN / "elasticft-run"), "--standalone",
         "--nproc-per-node", "2", "--run-dir", str(tmp_path / "run"), str(PRINT_ARGV), "a"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stderr[-5000:]
    assert (tmp_path / "argv.json").read_text() == '["a"]'
    modules = imported(done.stderr)
    assert "elasticft.ckpt.service" in modules and "elasticft.agent.agent" in modules
    assert not modules & set(HEAVY), sorted(modules & set(HEAVY))
