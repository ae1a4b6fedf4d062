"""How a survivor ends its process groups (:mod:`elasticft.inprocess.groups`): every group's
abort at once, torch's table cleared after them, and gloo's pending waits released whenever a
group has a gloo backend, whatever the default group's backend string says. Real gloo groups
of one rank; the per-group abort is the seam the tests replace."""

from __future__ import annotations

import functools
import threading
from typing import Any

import pytest
import torch.distributed as dist

from elasticft.diag import groupsockets
from elasticft.inprocess import groups
from elasticft.inprocess.groups import GroupOps, destroy_registered, end_groups, tear_down


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch):
    """A store for a group of one, torch's table emptied after the test."""
    made = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_PORT", str(made.port))
    yield made
    if dist.is_initialized():
        dist.destroy_process_group()
    groups.release_ended()


class _AbortWaitsForTheOthers:
    """A group's abort that returns only once every other group's abort began: what
    ``ncclCommAbort`` does when its device-wide synchronisation waits behind another
    communicator's kernel, which ends only when that communicator's abort begins
    (NVIDIA/nccl#1013). One abort after another waits here until ``bound_s`` and fails."""

    def __init__(self, expected: list[Any], bound_s: float = 10.0) -> None:
        self.began = {id(group): threading.Event() for group in expected}
        self.bound_s = bound_s
        self.stuck: list[str] = []

    def __call__(self, group: Any) -> None:
        self.began[id(group)].set()
        others = [event for key, event in self.began.items() if key != id(group)]
        if not all(event.wait(self.bound_s) for event in others):
            self.stuck.append(str(group.group_name))
            raise TimeoutError("this abort waited for ever behind another group's kernel")
        group.abort()


@pytest.mark.timeout(60)
def test_every_group_is_aborted_at_once_then_torchs_table_is_cleared(store) -> None:
    """TP + DP as on a GPU: the default group and two side groups. Every abort waits until the
    others began; aborted one after another, the first would wait for ever (here: its bound,
    then it fails)."""
    dist.init_process_group("gloo", store=dist.PrefixStore("default_pg", store), rank=0,
                            world_size=1)
    dist.new_group(backend="gloo")
    dist.new_group(backend="gloo")
    table = groups.process_groups()
    abort = _AbortWaitsForTheOthers(table)
    ops = GroupOps(abort=functools.partial(groups.abort_groups, abort=abort, limit_s=30.0),
                   destroy=destroy_registered)
    how = tear_down("nccl", ops)
    assert abort.stuck == []
    assert "abort(3 of 3 groups at once; is_initialized() False after)" in how, how
    assert not dist.is_initialized()


@pytest.mark.timeout(60)
def test_an_abort_still_running_at_the_limit_leaves_the_table_to_the_hard_limit(store) -> None:
    """An abort that does not return by the limit: the others are done, torch's table is left
    as it is (clearing it would wait behind that abort), and the log says so; the worker's
    hard limit then sends the survivor away."""
    dist.init_process_group("gloo", store=dist.PrefixStore("default_pg", store), rank=0,
                            world_size=1)
    side = dist.new_group(backend="gloo")
    release = threading.Event()

    def abort(group: Any) -> None:
        if group is side:
            release.wait(30)
        group.abort()

    try:
        how = groups.abort_groups(abort=abort, limit_s=5.0)
        assert "abort(1 of 2 groups at once, 1 still aborting at the limit; " \
               "is_initialized() True after)" in how, how
        assert dist.is_initialized()
    finally:
        release.set()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("configs", "gloo"), [
    (["cpu:gloo"], True),
    (["cuda:nccl"], False),
    (["cpu:gloo,cuda:nccl"], True),  # a default group made with no backend, or both named
    (["cuda:nccl", "cpu:gloo"], True),  # an NCCL job's new_group(backend="gloo")
    (["cuda:nccl", "cuda:nccl"], False),
    (["CPU:GLOO"], True),
    ([], False),
    ([""], False),  # a group torch no longer knows
])
def test_whether_an_end_must_release_gloo_waits_is_decided_per_group(
        configs: list[str], gloo: bool) -> None:
    assert groups.waits_on_gloo(configs) is gloo


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("default_backend", "side_backend", "armed"), [
    (None, None, "undefined"),  # init_process_group() with no backend: torch 2.13 says so
    ("cpu:gloo", None, "cpu:gloo"),
    ("gloo", "gloo", "nccl"),  # an NCCL job's gloo side group (the default group as armed)
])
def test_gloo_waits_are_released_from_the_groups_own_backends(
        store, default_backend: str | None, side_backend: str | None, armed: str) -> None:
    """The end takes the gloo part (the recorded connections, here none waiting) from the
    groups it ends, not from the default group's backend string."""
    groupsockets.install()
    kwargs = {"backend": default_backend} if default_backend else {}
    dist.init_process_group(store=dist.PrefixStore("default_pg", store), rank=0, world_size=1,
                            **kwargs)
    if side_backend:
        dist.new_group(backend=side_backend)
    how = end_groups(armed, lambda: False)
    assert not dist.is_initialized()
    assert how.endswith("+nothing shut down (the call returned by itself)"), how


@pytest.mark.timeout(60)
def test_a_regroups_init_leaves_one_rank_prefix_on_a_traceback(store) -> None:
    """torch's ``init_process_group`` wraps ``sys.excepthook`` in one that writes ``[rank<r>]: ``
    before each line; the regroup takes it off before its own init, so a survivor's traceback
    after two groups says its rank once, the new one."""
    import io
    import sys

    before = sys.excepthook
    try:
        dist.init_process_group("gloo", store=dist.PrefixStore("first", store), rank=0,
                                world_size=1)
        dist.destroy_process_group()
        groups.unwrap_rank_excepthook()  # what the regroup does before its init
        dist.init_process_group("gloo", store=dist.PrefixStore("second", store), rank=0,
                                world_size=1)
        written = io.StringIO()
        sys.stderr, stderr = written, sys.stderr
        try:
            try:
                raise ValueError("after the regroup")
            except ValueError as e:
                sys.excepthook(type(e), e, e.__traceback__)
        finally:
            sys.stderr = stderr
        lines = [line for line in written.getvalue().splitlines() if line]
        assert lines and all(line.startswith("[rank0]: ") for line in lines), lines
        assert not any(line.startswith("[rank0]: [rank0]:") for line in lines), lines
        groups.unwrap_rank_excepthook()
        assert getattr(sys.excepthook, "__name__", "") != groups.TORCH_RANK_HOOK
    finally:
        sys.excepthook = before
