"""`elasticft status` and `elasticft blacklist` read a run directory or etcd without importing torch
(which costs over a second of CPU per call); torch's connection error class is looked up only once
etcd has failed, and that failure is still one line naming etcd, exit code 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import BIN, ROOT, clean_job_env, free_port


@pytest.mark.timeout(60)
def test_the_status_and_blacklist_modules_import_without_torch() -> None:
    # torch made unimportable: any import of it on the way fails this process.
    code = ("import sys; sys.modules['torch'] = None; "
            "import elasticft.report.status, elasticft.rendezvous.cli, elasticft.cli; "
            "from elasticft.report.status import register; print('no torch')")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=clean_job_env(),
                          capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "no torch"


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", [["status", "--rdzv-id", "job"], ["blacklist", "list"]])
def test_an_unreachable_etcd_is_still_one_line(command: list[str]) -> None:
    endpoint = f"127.0.0.1:{free_port()}"  # nothing listens there
    done = subprocess.run([str(BIN / "elasticft"), *command, "--rdzv-endpoint", endpoint],
                          env=clean_job_env(), capture_output=True, text=True, timeout=100)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"elasticft {command[0]}: error: etcd at {endpoint} failed")
    assert "check that etcd is running" in lines[0]
