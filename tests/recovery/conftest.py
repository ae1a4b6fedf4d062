"""Fixtures shared by the recovery tests (the job's reference runs are the suite's:
``tests/conftest.py``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist


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
