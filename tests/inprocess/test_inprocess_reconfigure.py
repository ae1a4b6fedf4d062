"""The regroup by torch's reconfigure where the installed torch has it, and by a new group where
it does not: the same in-process recovery end to end on either torch (the compat run of README
command 2 runs it on torch 2.14.1, the main run on 2.13), and the path's pure parts."""

from __future__ import annotations

import contextlib
import os
import re
import signal
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from elasticft.inprocess import reconfigure
from tests.inprocess.test_inprocess import STEPS, _recovered_in_process, _run


@pytest.fixture(scope="module")
def reference(inprocess_reference: dict[int, str]) -> dict[int, str]:
    """An uninterrupted run's losses (the shared reference run's first STEPS)."""
    return {step: loss for step, loss in inprocess_reference.items() if step <= STEPS}


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("backend", "refused"), [
    ("gloo", False), ("nccl", False), ("cpu:gloo", False), ("cuda:nccl", False),
    # two backends in one default group: torch's reconfigure takes one
    ("cpu:gloo,cuda:nccl", True), ("undefined", True), ("mpi", True),
])
def test_a_default_group_goes_in_the_regime_only_on_one_backend(backend: str,
                                                                 refused: bool) -> None:
    refusal = reconfigure.backend_refusal(backend)
    assert (refusal is not None) == refused
    if refusal is not None:
        assert backend in refusal


@pytest.mark.timeout(30)
def test_the_ranks_of_a_generation_agree_on_its_uuid_through_its_store() -> None:
    """Every rank gets the first rank's proposal from the generation's store (the workers of
    a node that joins know the store, not the generation's number); a new store, a new one."""
    first, second = dist.HashStore(), dist.HashStore()
    agreed = {reconfigure.agreed_uuid(first) for _ in range(4)}
    assert len(agreed) == 1 and agreed.pop() > 0
    assert reconfigure.agreed_uuid(second) != reconfigure.agreed_uuid(first)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("env", "wanted"), [
    ({reconfigure.REGIME_ENV: "1"}, True), ({}, False), ({reconfigure.REGIME_ENV: "0"}, False)])
def test_the_regime_is_asked_for_by_the_agent_alone(env: dict[str, str], wanted: bool) -> None:
    assert reconfigure.wanted(env) is wanted
    if not wanted:  # nothing is wrapped for a job that did not ask
        assert reconfigure.install(env=env) is False


@pytest.mark.timeout(30)
def test_the_path_line_follows_what_this_torch_has() -> None:
    has = callable(getattr(dist, "_reconfigure", None))
    assert (reconfigure.unsupported() is None) == has
    assert ("in place" in reconfigure.path_line()) == has
    assert reconfigure.path_line("new-group") == (
        "in-process regroup: a new group (--recovery-inprocess-regroup new-group)")


@pytest.mark.timeout(30)
def test_the_switchable_store_forwards_everything_and_its_target_can_change() -> None:
    first, second = dist.HashStore(), dist.HashStore()
    store = reconfigure.SwitchableStore(first)
    store.set("a", b"1")
    assert store.get("a") == b"1" and first.get("a") == b"1"
    assert store.add("n", 2) == 2 and store.check(["a", "n"])
    store.wait(["a"], timedelta(seconds=1))
    assert store.num_keys() == first.num_keys()
    store.target = second  # the regroup's switch to the next generation's store
    assert not store.check(["a"])
    store.set("b", b"2")
    assert second.get("b") == b"2" and not first.check(["b"])
    assert store.delete_key("b") and not second.check(["b"])


@pytest.mark.slow
@pytest.mark.smoke
@pytest.mark.timeout(600)
def test_a_survivor_keeps_its_process_and_group_on_the_path_this_torch_has(
        tmp_path: Path, job_env: dict[str, str], reference: dict[int, str]) -> None:
    """Rank 1 SIGKILLed after a save, its sockets held open by a child (a silent peer): on a
    torch with reconfigure the survivor's default group stays in torch's table through the
    abort and is rebuilt in place (a ``rebuild_s`` phase in the event); on one without, the
    abort clears the table and a new group is made. Either way the losses are exact."""
    keeper = tmp_path / "keeper.pid"
    try:
        run = _run(tmp_path, "fault", job_env, "--fault-rank", "1", "--crash-at-step", "6",
                   "--crash-mode", "keep-sockets", "--keeper-pid", str(keeper))
    finally:
        if keeper.exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(keeper.read_text()), signal.SIGKILL)
    done = _recovered_in_process(run, [1])
    assert len(run["pids"][0]) == 1, run["pids"]
    assert run["losses"] == reference
    in_place = reconfigure.unsupported() is None
    assert ("is_initialized() True after" in run["text"]) == in_place, run["text"][-5000:]
    assert ("rebuild_s" in done["phases"]) == in_place, done["phases"]
    assert reconfigure.path_line() in run["text"], run["text"][-5000:]
    # The silent peer's wait was ended through the group's connections, which the reconfigure
    # made on that path (recorded there, not at the group's creation).
    ended = re.search(r"process groups ended \((.*)\) in", run["text"])
    assert ended is not None, run["text"][-5000:]
    shut = re.search(r"shutdown\((\d+) of (\d+) recorded group sockets\)", ended.group(1))
    assert shut is not None and int(shut.group(1)) >= 1, ended.group(1)
