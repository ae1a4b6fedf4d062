"""Fixtures shared by the in-process recovery tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist

from tests.conftest import made_once

INPROCESS_REFERENCE_STEPS = 60


@pytest.fixture(scope="session")
def inprocess_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """Losses of an uninterrupted run of examples/train_inprocess.py on 2 workers
    (:data:`INPROCESS_REFERENCE_STEPS` steps), made once per test run (:func:`made_once`) for
    the in-process and spare tests. A step's loss does not depend on ``--steps`` (no schedule
    looks at the total), so its first N steps are an N-step run's."""
    from tests.conftest import clean_job_env
    from tests.inprocess.test_inprocess import _run

    def run() -> dict[int, str]:
        return _run(tmp_path_factory.mktemp("inprocess-reference"), "reference",
                    clean_job_env(), "--steps", str(INPROCESS_REFERENCE_STEPS))["losses"]

    made = made_once(tmp_path_factory, "inprocess-reference", run)
    return {int(step): loss for step, loss in made.items()}


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
