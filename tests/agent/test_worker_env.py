"""Worker variables: each subsystem owns its names, and the agent's list is their union, which
``elasticft-run`` accepts in its own environment while still refusing a misspelt option."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticft import run, steps
from elasticft.agent import agent
from elasticft.ckpt import settings as ckpt_settings
from elasticft.diag import workerenv
from elasticft.inprocess import protocol, spare
from elasticft.plan import worker as plan_worker

OWNERS = {
    "agent": agent.WORKER_ENV,
    "ckpt": ckpt_settings.WORKER_ENV,
    "diag": workerenv.WORKER_ENV,
    "plan": plan_worker.WORKER_ENV,
    "steps": steps.WORKER_ENV,
    "inprocess": protocol.WORKER_ENV,
    "spare": spare.WORKER_ENV,
}


def test_the_agent_list_is_the_union_of_the_owners_and_each_name_has_one_owner() -> None:
    assert frozenset().union(*OWNERS.values()) == agent.WORKER_ENV_NAMES
    for name in agent.WORKER_ENV_NAMES:
        owners = [owner for owner, names in OWNERS.items() if name in names]
        assert len(owners) == 1, (name, owners)


def test_the_launcher_accepts_worker_variables_and_refuses_a_misspelt_option(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    for name in sorted(agent.WORKER_ENV_NAMES):
        monkeypatch.setenv(name, "1")
    run.parse(["--standalone", "train.py"])
    monkeypatch.setenv("ELASTICFT_RESTARTZ", "1")
    with pytest.raises(run.UsageError, match="unknown environment variable ELASTICFT_RESTARTZ"):
        run.parse(["--standalone", "train.py"])


def test_the_checkpoint_service_s_worker_variables_cannot_be_taken_for_options(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """They sit under ELASTICFT_WORKER_, where no option's variable is, so the option a user
    meant (ELASTICFT_CKPT_REMOTE_DIR) is never one typo away from a variable the launcher
    accepts: ELASTICFT_CKPT_REMOTE is refused, naming the option."""
    from elasticft import options

    assert not [name for name in options.known_env_names()
                if name.startswith("ELASTICFT_WORKER_")]
    assert all(name.startswith("ELASTICFT_WORKER_CKPT_") for name in ckpt_settings.WORKER_ENV)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    monkeypatch.setenv("ELASTICFT_CKPT_REMOTE", "/mnt/ckpt")
    with pytest.raises(run.UsageError, match="did you mean ELASTICFT_CKPT_REMOTE_DIR"):
        run.parse(["--standalone", "train.py"])
