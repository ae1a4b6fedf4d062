"""elasticft-run's answer to bad input: one line naming the problem and the fix, exit code 2,
and nothing started."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import BIN, EXAMPLES

SCRIPT = str(EXAMPLES / "train_plain.py")


def run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "elasticft-run"), *args], env=env, cwd=cwd, capture_output=True, text=True,
        timeout=60,
    )


def assert_usage_error(result: subprocess.CompletedProcess[str], cwd: Path, *fragments: str):
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("elasticft-run: error: ")
    for fragment in fragments:
        assert fragment in lines[0]
    assert result.stdout == ""
    assert not (cwd / "elasticft-runs").exists(), "nothing may start on bad input"


@pytest.mark.timeout(60)
def test_unknown_flag(tmp_path: Path, job_env: dict[str, str]) -> None:
    result = run(["--standalone", "--nprocs-per-host", "2", SCRIPT], job_env, tmp_path)
    assert_usage_error(result, tmp_path, "--nprocs-per-host", "--help")


@pytest.mark.timeout(60)
def test_malformed_yaml(tmp_path: Path, job_env: dict[str, str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("agent: {restart_on_user_error: 1\n")
    result = run(["--standalone", "--config", str(bad), SCRIPT], job_env, tmp_path)
    assert_usage_error(result, tmp_path, "bad.yaml", "malformed YAML", "line")


@pytest.mark.timeout(60)
def test_wrong_typed_yaml_value(tmp_path: Path, job_env: dict[str, str]) -> None:
    bad = tmp_path / "typed.yaml"
    bad.write_text("agent:\n  restart_on_user_error: often\n")
    result = run(["--standalone", "--config", str(bad), SCRIPT], job_env, tmp_path)
    assert_usage_error(result, tmp_path, "agent.restart_on_user_error", "'often'", "whole number")


@pytest.mark.timeout(60)
def test_bad_elasticft_env_value(tmp_path: Path, job_env: dict[str, str]) -> None:
    env = {**job_env, "ELASTICFT_RESTART_ON_USER_ERROR": "-3"}
    result = run(["--standalone", SCRIPT], env, tmp_path)
    assert_usage_error(result, tmp_path, "ELASTICFT_RESTART_ON_USER_ERROR", "minimum")


@pytest.mark.timeout(60)
def test_bad_torchrun_env_value(tmp_path: Path, job_env: dict[str, str]) -> None:
    env = {**job_env, "PET_MAX_RESTARTS": "lots"}
    result = run(["--standalone", SCRIPT], env, tmp_path)
    assert_usage_error(result, tmp_path, "--max-restarts", "'lots'")


@pytest.mark.timeout(60)
def test_bad_nproc_per_node(tmp_path: Path, job_env: dict[str, str]) -> None:
    result = run(["--standalone", "--nproc-per-node", "two", SCRIPT], job_env, tmp_path)
    assert_usage_error(result, tmp_path, "two")


@pytest.mark.timeout(60)
def test_missing_script(tmp_path: Path, job_env: dict[str, str]) -> None:
    result = run(["--standalone", "no_such_train.py"], job_env, tmp_path)
    assert_usage_error(result, tmp_path, "'no_such_train.py' not found", "Python file")


@pytest.mark.timeout(60)
def test_help_documents_every_option(tmp_path: Path, job_env: dict[str, str]) -> None:
    result = subprocess.run(
        [str(BIN / "elasticft-run"), "--help"], env=job_env, cwd=tmp_path, capture_output=True,
        text=True, timeout=60,
    )
    assert result.returncode == 0
    for text in ("--nproc-per-node", "--rdzv-backend", "--restart-on-user-error",
                 "ELASTICFT_RESTART_ON_USER_ERROR", "--config"):
        assert text in result.stdout
