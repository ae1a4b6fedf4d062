"""Where the agent's interrupt reaches a survivor, pinned at the exact moments that went wrong:
one process, a real gloo group of one, the monitor's ``end`` and the asynchronous exception
driven through the seams (:class:`GroupOps`, the thread state), no timing left to chance.

1. The survivor's collective raised by itself (the dead peer's sockets closed) while the monitor
   was still ending the groups: the teardown and the regroup must wait until that end is over,
   or the end aborts the next generation's group and the regroup fails: the survivor exits 1
   and the job restarts.
2. The monitor's asynchronous exception is delivered after the training function has already
   raised, on the way into the recovery: it is absorbed there, not raised out of ``run``.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
from pathlib import Path
from typing import NoReturn

import pytest
import torch.distributed as dist

from elasticft.diag import groupsockets
from elasticft.inprocess import InProcess, cuda_graphs
from elasticft.inprocess.generations import InProcessCoordinator
from elasticft.inprocess.groups import GroupOps, destroy_registered, end_groups
from elasticft.inprocess.interrupt import PeerInterrupted, _raise_in
from elasticft.inprocess.protocol import INTERRUPT_FILE, InProcessSettings, worker_file
from elasticft.jsonfile import write_json

GLOO_CLOSED = ("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:912. "
               "This is typically caused by a remote worker crashing.")


def _agent(directory: Path, coordinator: InProcessCoordinator) -> threading.Thread:
    """The agent's side: publishes the next generation once the survivor reports its failure."""
    failed = worker_file(directory, "failed", 0)

    def publish() -> None:
        for _ in range(2000):
            if failed.exists():
                coordinator.publish("127.0.0.1", world_size=1)
                return
            threading.Event().wait(0.01)

    thread = threading.Thread(target=publish, daemon=True)
    thread.start()
    return thread


def _fail_once_the_end_began(directory: Path, coordinator: InProcessCoordinator,
                             ending: threading.Event) -> NoReturn:
    """A first entry's failure: the agent's notice, the monitor's end begun, then the step's
    collective raises by itself (its dead peer's connection closed meanwhile)."""
    _agent(directory, coordinator)
    write_json(directory / INTERRUPT_FILE, {"ended": 0})  # the agent's notice
    assert ending.wait(20)
    raise RuntimeError(GLOO_CLOSED)


@pytest.mark.timeout(60)
def test_the_teardown_and_regroup_wait_for_the_monitors_end(tmp_path: Path, group_of_one
                                                            ) -> None:
    directory = tmp_path / "ip"
    coordinator = InProcessCoordinator(directory, timeout_s=30)
    coordinator.reset()
    order: list[str] = []
    ending, regrouped, ended = threading.Event(), threading.Event(), threading.Event()

    groupsockets.install()

    def slow_end(backend: str, waiting) -> str:
        """The monitor's end, descheduled as it starts: it ends the groups only once the main
        thread regrouped, or after 1 s."""
        order.append("end")
        ending.set()
        regrouped.wait(1.0)
        how = end_groups(backend, waiting)
        order.append("end over")
        ended.set()
        return how

    def init(*args, **kwargs) -> None:
        order.append("init")
        dist.init_process_group(*args, **kwargs)
        regrouped.set()

    ops = GroupOps(destroy=lambda: (order.append("destroy"), destroy_registered()),
                   init=init, end=slow_end)
    recovery = InProcess(InProcessSettings(directory=directory, timeout_s=30), ops=ops)
    entries: list[int] = []

    def train() -> str:
        entries.append(recovery.generation)
        if len(entries) == 1:
            _fail_once_the_end_began(directory, coordinator, ending)
        # Once the end is over, the next generation's store still answers: the end did not
        # shut its connection down.
        assert ended.wait(5)
        store = dist.distributed_c10d._get_default_store()
        try:
            store.set("after", "regroup")
            return store.get("after").decode()
        except Exception as e:  # what the survivor met: its new group's connection shut down
            return f"{type(e).__name__}: {e}"

    try:
        assert recovery.run(train) == "regroup"
        assert order == ["end", "end over", "destroy", "init"]
        assert entries == [0, 1] and recovery.recoveries == 1
    finally:
        coordinator.close()


@pytest.mark.timeout(60)
def test_the_failed_calls_cuda_graphs_are_dropped_before_the_wait_for_the_abort(
        tmp_path: Path, group_of_one) -> None:
    """NCCL 2.26 on: a communicator's abort returns only once every CUDA graph that captured
    it is destroyed. The monitor's end here is such an abort: it waits until the graphs are
    dropped (it gives up after 10 s). Dropped at the next entry, after the survivor waited for
    that end, each would wait for the other until the teardown's limit; dropped as soon as the
    call failed, the end is over at once and the survivor regroups."""
    directory = tmp_path / "ip"
    coordinator = InProcessCoordinator(directory, timeout_s=30)
    coordinator.reset()
    order: list[str] = []
    ending, dropped = threading.Event(), threading.Event()

    def graph_bound_end(backend: str, waiting) -> str:
        order.append("end")
        ending.set()
        order.append("end over" if dropped.wait(10) else "end gave up")
        return end_groups(backend, waiting)

    def drop() -> None:
        order.append("graphs dropped")
        dropped.set()

    undrop = cuda_graphs.drop_on_failure(drop, "the step's graphs")
    recovery = InProcess(InProcessSettings(directory=directory, timeout_s=30),
                         ops=GroupOps(end=graph_bound_end))
    entries: list[int] = []

    def train() -> str:
        entries.append(recovery.generation)
        if len(entries) == 1:
            _fail_once_the_end_began(directory, coordinator, ending)
        return "regrouped"

    try:
        assert recovery.run(train) == "regrouped"
        assert order == ["end", "graphs dropped", "end over"]
        assert entries == [0, 1] and recovery.recoveries == 1
    finally:
        undrop()
        coordinator.close()


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        ours = socket.create_connection(server.getsockname())
        peer, _ = server.accept()
    return ours, peer


@pytest.mark.timeout(60)
def test_an_interrupt_delivered_on_the_way_into_the_recovery_is_absorbed(
        tmp_path: Path, group_of_one) -> None:
    directory = tmp_path / "ip"
    coordinator = InProcessCoordinator(directory, timeout_s=30)
    coordinator.reset()
    recovery = InProcess(InProcessSettings(directory=directory, timeout_s=30),
                         ops=GroupOps(end=lambda backend, waiting: "test"))
    entries: list[int] = []

    def train() -> str:
        entries.append(recovery.generation)
        if len(entries) == 1:
            _agent(directory, coordinator)
            # The main thread waits in a call that fails in C (as a collective does when its
            # peer's connection resets); the monitor's exception is set meanwhile, so it is
            # delivered only after the call's own error left the function: on the way into
            # the recovery.
            ours, peer = _tcp_pair()
            main = threading.get_ident()

            def monitor_then_reset() -> None:
                threading.Event().wait(0.3)  # the main thread waits in recv by then
                _raise_in(main, PeerInterrupted)
                peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                threading.Event().wait(0.3)
                peer.close()

            threading.Thread(target=monitor_then_reset, daemon=True).start()
            ours.recv(1)  # no `with`: its exit is Python code, where the exception would land
            return "the call did not fail"
        return "done"

    try:
        assert recovery.run(train) == "done"
        assert entries == [0, 1] and recovery.recoveries == 1
        assert os.getpid() == coordinator._record("joined", 0, os.getpid(), 1)["pid"]
    finally:
        coordinator.close()


@pytest.mark.timeout(30)
def test_a_notice_at_the_step_boundary_ends_nothing_until_the_boundary_or_its_limit(
        tmp_path: Path) -> None:
    """Nodes join (no peer failed): the monitor asks the main thread to stop at its next step
    boundary and ends the groups only once ``step_wait_s`` passed without one."""
    import time

    from elasticft.inprocess.interrupt import Monitor
    from elasticft.jsonfile import read_json

    ended: list[float] = []

    def end() -> str:
        ended.append(time.monotonic())
        return "ended"

    monitor = Monitor(tmp_path, read_json, end, poll_s=0.005, grace_s=60.0, step_wait_s=0.5)
    monitor.start()
    try:
        monitor.entering(0)
        assert not monitor.stop_due()
        write_json(tmp_path / INTERRUPT_FILE, {"ended": 0, "at_step": True})
        deadline = time.monotonic() + 10
        while not monitor.stop_due():
            assert time.monotonic() < deadline, "the monitor never asked for a stop"
            time.sleep(0.01)
        asked = time.monotonic()
        assert not ended  # nothing ended while the main thread may still reach a boundary
        assert monitor.left(5.0)  # the boundary: the main thread left, nothing was ended
        assert not ended and not monitor.stop_due()

        monitor.entering(0)  # a main thread that reaches no boundary: ended after the limit
        deadline = time.monotonic() + 10
        while not ended:
            assert time.monotonic() < deadline, "the groups were never ended"
            time.sleep(0.01)
        assert ended[0] - asked >= 0.5
        assert monitor.left(5.0) and monitor.interrupted
    finally:
        monitor.stop()


@pytest.mark.timeout(60)
def test_the_ended_groups_are_held_past_the_reducer_and_let_go_after(group_of_one) -> None:
    """A DDP's reducer, which destroys a group with the GIL held (a deadlock with a gloo worker
    thread that needs it), is never a group's last holder: :func:`end_groups` holds every
    group it ended until :func:`release_ended`, whose handle destroys it without the GIL."""
    import gc

    import torch
    from torch.nn.parallel import DistributedDataParallel

    from elasticft.inprocess import groups

    default = dist.distributed_c10d._get_default_group()
    ddp = DistributedDataParallel(torch.nn.Linear(4, 4))
    ddp(torch.randn(2, 4)).sum().backward()
    end_groups("gloo", lambda: False)
    assert not dist.is_initialized()  # torch's table let go of it
    assert any(group is default for group in groups._ended)
    del ddp, default
    gc.collect()
    assert groups._ended  # still held once the reducer is gone
    assert groups.release_ended() >= 1
    assert not groups._ended
