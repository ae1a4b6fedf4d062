"""A relaunch resumes: the example launched again the same way in the same directory continues
from the first launch's last step, whether the script names its checkpoint directory or leaves
it to elasticft-run; the agent says in one line where it resumed from; --fresh starts over."""

from __future__ import annotations

import re
import signal
import subprocess
from pathlib import Path

import pytest

from elasticft.ckpt import durable
from tests.agent.test_launch import wait_until
from tests.conftest import BIN, EXAMPLES

TRAIN = str(EXAMPLES / "train_elasticft.py")


def _command(*extra: str) -> list[str]:
    return [str(BIN / "elasticft-run"), "--standalone", "--nproc-per-node", "2",
            "--monitor-interval", "0.2", *extra]


def _launch(cwd: Path, env: dict[str, str], command: list[str]) -> str:
    out = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=200)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    return text


def _trained(text: str) -> list[int]:
    return [int(m) for m in re.findall(r"^step (\d+) loss", text, flags=re.M)]


def _agent_line(text: str) -> str:
    lines = [line for line in text.splitlines()
             if "elasticft.ckpt.service:" in line and ("resumed from" in line
                                                       or "no checkpoint to resume" in line)]
    assert len(lines) == 1, text[-4000:]
    return lines[0]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_relaunch_without_ckpt_dir_resumes_in_the_same_run_directory(
        tmp_path: Path, job_env: dict[str, str]) -> None:
    command = [*_command(), TRAIN, "--steps", "6", "--layers", "1"]
    first = _launch(tmp_path, job_env, command)
    assert _trained(first) == list(range(1, 7))
    assert "no checkpoint to resume from" in _agent_line(first)
    (run_dir,) = (tmp_path / "elasticft-runs").iterdir()
    assert run_dir.name.startswith("train_elasticft-")
    assert f"run directory {run_dir}" in first  # said at the start, not only at the end

    second = _launch(tmp_path, job_env, command)
    assert _trained(second) == [], "the job was done: nothing to train again"
    assert "resumed from step 6 (source=local)" in second
    assert _agent_line(second).endswith(
        f"resumed from step 6 in {run_dir / 'ckpt'} (local checkpoint directory)")
    assert "(a relaunch: 1 earlier agent(s) of this job ran there)" in second
    assert list((tmp_path / "elasticft-runs").iterdir()) == [run_dir]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_relaunch_with_the_scripts_ckpt_dir_resumes_from_it_and_fresh_starts_over(
        tmp_path: Path, job_env: dict[str, str]) -> None:
    ckpt, losses = tmp_path / "D", tmp_path / "losses.txt"
    command = [*_command(), TRAIN, "--steps", "12", "--layers", "1", "--ckpt-dir", str(ckpt),
               "--loss-log", str(losses), "--step-time", "0.3"]
    # The first launch is stopped part way, as a preempted job's is.
    first = subprocess.Popen(command, env=job_env, cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: losses.exists() and len(losses.read_text().splitlines()) >= 4, 150,
                   "four steps of the first launch")
        first.send_signal(signal.SIGTERM)
        first_text, _ = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert "stopped" in first_text, first_text[-4000:]
    # The agent persisted where the script said, not in its own directory.
    committed = durable.committed_steps(ckpt)
    assert committed and max(committed) >= 3, first_text[-4000:]
    (run_dir,) = (tmp_path / "elasticft-runs").iterdir()
    assert not durable.committed_steps(run_dir / "ckpt")
    last = max(committed)

    second = _launch(tmp_path, job_env, command)
    assert _agent_line(second).endswith(
        f"resumed from step {last} in {ckpt} (local checkpoint directory)")
    assert _trained(second) == list(range(last + 1, 13))
    assert max(durable.committed_steps(ckpt)) == 12

    # Started over on purpose: the earlier launches' checkpoints go, the run starts at step 1.
    fresh = _launch(tmp_path, job_env, [*_command("--fresh"), *command[len(_command()):]])
    assert "no checkpoint to resume from" in _agent_line(fresh)
    assert _trained(fresh) == list(range(1, 13))
