"""Fixtures shared by the recovery tests."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist
from filelock import FileLock

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


@pytest.fixture(scope="session")
def inprocess_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """Losses of an uninterrupted run of examples/train_inprocess.py on 2 workers
    (:data:`INPROCESS_REFERENCE_STEPS` steps), made once per test run for the in-process and
    spare tests. A step's loss does not depend on ``--steps`` (no schedule looks at the total),
    so its first N steps are an N-step run's. pytest-xdist's workers share it through a file in
    the run's common temporary directory: the first to need it runs it, under a lock; the
    others read it."""
    from tests.conftest import clean_job_env
    from tests.recovery.test_inprocess import _run

    def run() -> dict[int, str]:
        return _run(tmp_path_factory.mktemp("inprocess-reference"), "reference",
                    clean_job_env(), "--steps", str(INPROCESS_REFERENCE_STEPS))["losses"]

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return run()
    shared = tmp_path_factory.getbasetemp().parent / "inprocess-reference.json"
    with FileLock(f"{shared}.lock"):
        if not shared.exists():
            shared.write_text(json.dumps(run()))
    return {int(step): loss for step, loss in json.loads(shared.read_text()).items()}
