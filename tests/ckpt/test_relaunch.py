"""A relaunch resumes: the example launched again the same way in the same directory continues
from the first launch's last step, whether the script names its checkpoint directory or leaves
it to elasticft-run; the agent says in one line where it resumed from; --fresh starts over."""

from __future__ import annotations

import re
import signal
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from elasticft.addon.api import AddOnContext
from elasticft.ckpt import settings
from elasticft.ckpt.control import announce_dir, announced_dirs, restore_line
from elasticft.ckpt.persisting import durable
from elasticft.ckpt.service import CheckpointAddOn
from elasticft.config import AgentConfig, CheckpointConfig, ConfigError, ElasticftConfig
from tests.agent.test_launch import wait_until
from tests.conftest import BIN, EXAMPLES

TRAIN = str(EXAMPLES / "train_elasticft.py")


@pytest.mark.parametrize(
    ("report", "line"),
    [
        ({"step": 20, "source": "local", "where": "/j/D"},
         "resumed from step 20 in /j/D (local checkpoint directory)"),
        ({"step": 20, "source": "remote", "where": "/shared/D"},
         "resumed from step 20 in /shared/D (remote checkpoint directory)"),
        ({"step": 7, "source": "memory", "where": "shared memory"},
         "resumed from step 7 in shared memory"),
        ({"step": 7, "source": "peer", "where": "the backup node"},
         "resumed from step 7 from the backup node (peer)"),
        ({"step": 7, "source": "reshard", "where": "/j/D/step-7"},
         "resumed from step 7 in /j/D/step-7 (resharded from another world size)"),
        ({"step": 7, "source": "other", "where": ""}, "resumed from step 7 (other)"),
        ({"step": None, "looked": ["shared memory", "/j/D"]},
         "no checkpoint to resume from (looked in shared memory, /j/D): starting from the "
         "beginning"),
        ({"step": None, "looked": []},
         "no checkpoint to resume from (looked in no checkpoint tier): starting from the "
         "beginning"),
    ],
)
def test_the_agents_restore_line(report: dict, line: str) -> None:
    assert restore_line(report) == line


def _steps(root: Path, *steps: int) -> None:
    for step in steps:
        (durable.step_dir(root, step)).mkdir(parents=True)
        (durable.step_dir(root, step) / durable.COMMIT_MARKER).write_text("{}")


@pytest.mark.timeout(30)
def test_start_fresh_removes_earlier_launches_steps_once_per_launch(tmp_path: Path) -> None:
    _steps(tmp_path, 10, 20)
    (tmp_path / "notes.txt").write_text("the user's")
    assert durable.start_fresh(tmp_path, "launch-a") == [10, 20]
    _steps(tmp_path, 1)  # this launch's own: a restarted worker of it keeps it
    assert durable.start_fresh(tmp_path, "launch-a") == []
    assert sorted(durable.list_steps(tmp_path)) == [1]
    assert durable.start_fresh(tmp_path, "launch-b") == [1]
    assert (tmp_path / "notes.txt").read_text() == "the user's"


@pytest.mark.timeout(30)
def test_the_scripts_directory_wins_over_the_agents(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    agent = {settings.ENV_SHM: "", settings.ENV_LOCAL: "/run/ckpt"}
    assert settings.WorkerSettings.from_env(agent).local_dir == Path("/run/ckpt")
    chosen = settings.WorkerSettings.from_env(agent, ckpt_dir="D")
    assert chosen.local_dir == chosen.chosen_dir == tmp_path / "D"
    node = settings.WorkerSettings.from_env(
        {**agent, settings.ENV_LOCAL: "/run/ckpt/node-a", settings.ENV_NODE_DIR: "node-a"},
        ckpt_dir="D")
    assert (node.local_dir, node.chosen_dir) == (tmp_path / "D" / "node-a", tmp_path / "D")
    assert settings.WorkerSettings.from_env({**agent, settings.ENV_FRESH: "t"}).fresh_launch == "t"
    # The agent hears of it through the control directory, by local rank.
    announce_dir(tmp_path, 1, tmp_path / "D")
    assert announced_dirs(tmp_path, [0, 1]) == {1: tmp_path / "D"}


@pytest.mark.timeout(30)
def test_fresh_is_refused_where_a_remote_directory_holds_earlier_checkpoints(
        tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    options = ElasticftConfig(agent=AgentConfig(fresh=True),
                              ckpt=CheckpointConfig(ckpt_remote_dir=remote))
    context = AddOnContext(options, SimpleNamespace(local_addr=None), {})  # type: ignore[arg-type]
    service = CheckpointAddOn().build(context, {})  # empty: nothing to lose
    assert service is not None
    service.close()
    _steps(remote, 5)
    with pytest.raises(ConfigError, match=r"--fresh: --ckpt-remote-dir .* holds checkpoints of "
                       r"earlier launches.*give a new remote directory"):
        CheckpointAddOn().build(context, {})


def _command(*extra: str) -> list[str]:
    return [str(BIN / "elasticft-run"), "--standalone", "--nproc-per-node", "2",
            "--monitor-interval", "0.2", *extra]


def _launch(cwd: Path, env: dict[str, str], command: list[str]) -> str:
    out = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    return text


def _trained(text: str) -> list[int]:
    return [int(m) for m in re.findall(r"^step (\d+) loss", text, flags=re.M)]


def _agent_line(text: str) -> str:
    """The checkpoint service's line (not the example's own "resumed from step N (source=...)")."""
    lines = [line for line in text.splitlines()
             if re.search(r"elasticft[./]ckpt[./]service", line)
             and ("resumed from" in line or "no checkpoint to resume" in line)]
    assert len(lines) == 1, text[-4000:]
    return lines[0]


@pytest.mark.slow
@pytest.mark.timeout(700)
def test_a_relaunch_with_the_scripts_ckpt_dir_resumes_from_it_and_fresh_starts_over(
        tmp_path: Path, job_env: dict[str, str]) -> None:
    ckpt, losses = tmp_path / "D", tmp_path / "losses.txt"
    command = [*_command(), TRAIN, "--steps", "12", "--layers", "1", "--ckpt-dir", str(ckpt),
               "--loss-log", str(losses), "--step-time", "0.3"]
    # The first launch is stopped part way, as a preempted job's is.
    first = subprocess.Popen(command, env=job_env, cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: losses.exists() and len(losses.read_text().splitlines()) >= 4, 240,
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


def _launch_failing(cwd: Path, env: dict[str, str], command: list[str]) -> str:
    out = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 1, text[-4000:]
    return text


@pytest.mark.slow
@pytest.mark.timeout(700)
def test_a_relaunch_told_to_train_longer_resumes_another_model_stops_and_fresh_starts_over(
        tmp_path: Path, job_env: dict[str, str]) -> None:
    """The most common relaunch: the same job with other arguments, in the same directory,
    with default options (the script leaves its checkpoints to elasticft-run). First the same
    command again, whose job was done: it resumes in the same run directory and trains
    nothing."""
    command = [*_command(), TRAIN, "--steps", "20", "--layers", "1"]
    first = _launch(tmp_path, job_env, command)
    assert _trained(first) == list(range(1, 21))
    assert "no checkpoint to resume from" in _agent_line(first)
    (run_dir,) = (tmp_path / "elasticft-runs").iterdir()
    assert run_dir.name.startswith("train_elasticft-")
    assert f"run directory {run_dir}" in first  # said at the start, not only at the end
    run_id = run_dir.name

    again = _launch(tmp_path, job_env, command)
    assert _trained(again) == [], "the job was done: nothing to train again"
    assert "resumed from step 20 (source=local)" in again
    assert _agent_line(again).endswith(
        f"resumed from step 20 in {run_dir / 'ckpt'} (local checkpoint directory)")
    assert "(a relaunch: 1 earlier agent(s) of this job ran there)" in again
    assert list((tmp_path / "elasticft-runs").iterdir()) == [run_dir]

    longer = _launch(tmp_path, job_env, [*_command(), TRAIN, "--steps", "30", "--layers", "1"])
    assert list((tmp_path / "elasticft-runs").iterdir()) == [run_dir], "the same job's home"
    relaunch = next(line for line in longer.splitlines() if "relaunch of run" in line)
    assert relaunch.endswith(
        f"relaunch of run {run_id}: resumes from its newest checkpoint, step 20 in "
        f"{run_dir / 'ckpt'}; script arguments changed since the last launch: --steps 20 -> 30; "
        "--fresh starts over"), relaunch
    assert _agent_line(longer).endswith(
        f"run {run_id}: resumed from step 20 in {run_dir / 'ckpt'} (local checkpoint directory)")
    assert _trained(longer) == list(range(21, 31))

    # Another model size: the checkpoint cannot be restored; the run stops at once, in one line
    # naming the run, the first tensor that does not fit and --fresh, with no restart spent.
    other_model = [TRAIN, "--steps", "5", "--layers", "1", "--dim", "32"]
    stopped = _launch_failing(tmp_path, job_env, [*_command("--max-restarts", "3"),
                                                  *other_model])
    (decision,) = [line for line in stopped.splitlines() if "decision: stop" in line]
    assert re.search(
        rf"not restarted \(a restart would fail the same way; 3 of --max-restarts 3 left "
        rf"unused\): rank \d \(user_code\) StateMismatch: run {run_id}: cannot restore the "
        rf"checkpoint of step 30 \({re.escape(str(run_dir / 'ckpt'))}\) into this model: "
        r"checkpoint item 'model\.\w+' is a whole tensor of shape \[\d+, 64\]; the live one is "
        r"a whole tensor of shape \[\d+, 32\].*start this run over with elasticft-run --fresh",
        decision), decision
    assert "with 0 restart(s)" in stopped
    assert "--steps 30 -> 5, --dim 32 added" in stopped
    assert max(durable.committed_steps(run_dir / "ckpt")) == 30, "nothing removed without --fresh"

    # Started over on purpose: that model trains from step 1.
    fresh = _launch(tmp_path, job_env, [*_command("--fresh"), *other_model])
    assert f"relaunch of run {run_id} with --fresh: starts from step 0" in fresh
    assert "no checkpoint to resume from" in _agent_line(fresh)
    assert _trained(fresh) == list(range(1, 6))

    # On another number of workers it is another job, which starts from step 0, not silently.
    one = [str(BIN / "elasticft-run"), "--standalone", "--nproc-per-node", "1",
           "--monitor-interval", "0.2", TRAIN, "--steps", "2", "--layers", "1", "--dim", "32"]
    alone = _launch(tmp_path, job_env, one)
    warning = next(line for line in alone.splitlines() if "starts from step 0, but" in line)
    assert warning.endswith(
        f"the same script has a checkpoint (step 5) in {run_dir}, run {run_id} (--nnodes 1:1 "
        f"--nproc-per-node 2; this launch: --nnodes 1:1 --nproc-per-node 1): another job. To "
        f"continue that one, give --run-dir {run_dir} (its checkpoint is resharded to this "
        "number of workers)"), warning
    assert _trained(alone) == [1, 2]
