"""Fixtures shared by the recovery tests."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from filelock import FileLock

from tests.recovery.cluster import Losses, reference_losses

INPROCESS_REFERENCE_STEPS = 60


@pytest.fixture
def round_store() -> Iterator[Callable[[int], dist.Store]]:
    """A round's store as one agent sees it: its own client connection (a TCPStore client
    serialises its calls, so agents sharing one would wait for each other's blocking reads)."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=30))

    def connect(round_: int) -> dist.Store:
        client = dist.TCPStore("127.0.0.1", server.port, is_master=False,
                               timeout=timedelta(seconds=30))
        return dist.PrefixStore(f"torch.rendezvous.job.{round_}", client)

    yield connect



def made_once(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[], Any]
              ) -> Any:
    """``make()``'s result (JSON), made once per test run: pytest-xdist's workers share it
    through a file in the run's common temporary directory; the first to need it makes it,
    under a lock, and the others read it."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's, above each worker's own
    path = root / f"{name}.json"
    with FileLock(f"{path}.lock"):
        if not path.exists():
            path.write_text(json.dumps(make()))
    return json.loads(path.read_text())


@pytest.fixture(scope="session")
def inprocess_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """Losses of an uninterrupted run of examples/train_inprocess.py on 2 workers
    (:data:`INPROCESS_REFERENCE_STEPS` steps), made once per test run (:func:`made_once`) for
    the in-process and spare tests. A step's loss does not depend on ``--steps`` (no schedule
    looks at the total), so its first N steps are an N-step run's."""
    from tests.conftest import clean_job_env
    from tests.recovery.test_inprocess import _run

    def run() -> dict[int, str]:
        return _run(tmp_path_factory.mktemp("inprocess-reference"), "reference",
                    clean_job_env(), "--steps", str(INPROCESS_REFERENCE_STEPS))["losses"]

    made = made_once(tmp_path_factory, "inprocess-reference", run)
    return {int(step): loss for step, loss in made.items()}


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[Path, int], Losses]:
    """Uninterrupted runs of the node-fault tests, one per example script, each made once per
    test run (:func:`made_once`); ``reference[script, steps]`` is an uninterrupted
    ``steps``-step run's losses.

    A step's loss does not depend on ``--steps`` (no schedule looks at the total), so the
    first N steps of one LONG-step run are the losses of an uninterrupted N-step run: one
    reference run per script serves every run length up to LONG."""
    from tests.recovery.test_faults import LONG

    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ELASTICFT_", "PET_", "TORCHELASTIC_", "SLURM_"))}
    env["PYTHONUNBUFFERED"] = "1"
    full: dict[Path, Losses] = {}

    def run(script: Path) -> dict[str, dict[int, Any]]:
        losses = reference_losses(tmp_path_factory.mktemp(script.stem), env, script, LONG)
        return {"values": losses.values, "logged": losses.logged}

    class Lazy(dict):
        def __missing__(self, key: tuple[Path, int]) -> Losses:
            script, steps = key
            assert steps <= LONG, f"reference runs have {LONG} steps, not {steps}"
            if script not in full:
                made = made_once(tmp_path_factory, f"reference-{script.stem}",
                                 lambda: run(script))
                full[script] = Losses({int(s): v for s, v in made["values"].items()},
                                      {int(s): n for s, n in made["logged"].items()})
            whole = full[script]
            self[key] = Losses({s: v for s, v in whole.values.items() if s <= steps},
                               {s: n for s, n in whole.logged.items() if s <= steps})
            return self[key]

    return Lazy()


@pytest.fixture
def group_of_one(monkeypatch: pytest.MonkeyPatch) -> Iterator[dist.TCPStore]:
    """A gloo default group of one rank on a store of its own, as a survivor's (an ``env://``
    group's key prefix; its port as ``MASTER_PORT``), destroyed after the test if still there."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("default_pg", store), rank=0,
                            world_size=1)
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    yield store
    if dist.is_initialized():
        dist.destroy_process_group()
