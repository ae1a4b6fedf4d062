"""The sockets a process group made, and which of them the end of the groups shuts down: the
pure decisions by tables, then real sockets of this process (a descriptor number closed and
reused by another socket is left alone) and a real two-process gloo group whose record holds
its connection and none of the script's own."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from elasticft.diag import groupsockets as sockets
from elasticft.diag.groupsockets import GroupSockets, TcpSocket, made_by_group, still_recorded
from elasticft.inprocess import groups
from elasticft.inprocess.groups import destroy_registered, end_groups

ROOT = Path(__file__).resolve().parents[2]
EST, LISTEN = "01", "0A"


def _s(fd: int, inode: int, port: int = 40000, state: str = EST) -> TcpSocket:
    return TcpSocket(fd, inode, port, state)


STORE_SERVER = _s(5, 500, 29500, LISTEN)  # a TCPStore this process hosts
STORE_CLIENT = _s(6, 600, 51000)  # the script's own client, made before the group


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("before", "after", "made", "own"), [
    # The group's connection is the one established during its creation.
    ([STORE_CLIENT], [STORE_CLIENT, _s(7, 700)], [7], ()),
    # Connections the process had before are not the group's.
    ([STORE_CLIENT, _s(7, 700)], [STORE_CLIENT, _s(7, 700)], [], ()),
    # gloo's own listener is never recorded (its shutdown aborts gloo's accept loop); the
    # connection it accepted is the group's.
    ([], [_s(7, 700, 41000, LISTEN), _s(8, 800, 41000)], [8], ()),
    # A peer that joined the store this process hosts meanwhile is the store's client.
    ([STORE_SERVER], [STORE_SERVER, _s(7, 700, 29500), _s(8, 800, 41000)], [8], ()),
    # A group reconnected in place (torch's reconfigure) accepts on the listener it made at
    # its creation: those connections are its own, the store's clients still are not.
    ([STORE_SERVER, _s(7, 700, 41000, LISTEN)],
     [STORE_SERVER, _s(7, 700, 41000, LISTEN), _s(8, 800, 41000), _s(9, 900, 29500)], [8],
     (41000,)),
    ([STORE_SERVER, _s(7, 700, 41000, LISTEN)],
     [STORE_SERVER, _s(7, 700, 41000, LISTEN), _s(8, 800, 41000)], [], ()),
    # A descriptor number reused by a new socket during the creation: the new one is the group's.
    ([_s(7, 700)], [_s(7, 701)], [7], ()),
    # Closing connections (not established any more) are not recorded.
    ([], [_s(7, 700, state="06")], [], ()),
])
def test_which_sockets_a_group_made(before: list[TcpSocket], after: list[TcpSocket],
                                    made: list[int], own: tuple[int, ...]) -> None:
    found = made_by_group({s.fd: s for s in before}, {s.fd: s for s in after}, own)
    assert [s.fd for s in found] == made


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("now", "shut"), [
    ({7: 700, 8: 800}, [7, 8]),  # both descriptors still name the group's sockets
    ({7: 700, 8: 801}, [7]),  # 8 was closed and reused by another socket: left alone
    ({7: 700}, [7]),  # 8 was closed
    ({}, []),
    ({6: 600, 7: 700, 8: 800}, [7, 8]),  # a socket never recorded is never shut down
])
def test_only_recorded_sockets_their_descriptor_still_names_are_shut_down(
        now: dict[int, int], shut: list[int]) -> None:
    recorded = [_s(7, 700), _s(8, 800)]
    assert [s.fd for s in still_recorded(recorded, now)] == shut


def _alive(sock: socket.socket) -> bool:
    try:
        sock.sendall(b"x")
        return sock.recv(1) == b"x"
    except OSError:
        return False


@pytest.mark.timeout(60)
def test_a_recorded_descriptor_reused_by_another_socket_is_not_shut_down(
        echo_server: tuple[str, int]) -> None:
    group = socket.create_connection(echo_server)  # stands for a group's connection
    own = socket.create_connection(echo_server)  # the script's own client
    recording = GroupSockets()
    now = sockets.snapshot()
    recording.record("group", [now[group.fileno()]])
    assert recording.shut_down() == (1, 1)
    assert not _alive(group) and _alive(own)  # only the group's connection was shut down

    # The group's descriptor closed; its number now names another connection of the script.
    number = group.fileno()
    group.close()
    other = socket.create_connection(echo_server)
    if other.fileno() != number:  # the system did not reuse it by itself: reuse it here
        os.dup2(other.fileno(), number)
        os.close(other.detach())
        other = socket.socket(fileno=number)
    try:
        assert recording.shut_down() == (0, 1)
        assert _alive(other) and _alive(own)
        recording.record("next", [])  # a new group prunes the stale record
        assert recording.recorded() == [("next", [])]
    finally:
        other.close()
        own.close()


PEER = """
import sys
import torch
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False,
                      timeout=timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=1, world_size=2)
dist.all_reduce(torch.ones(1))
sys.stdin.read()  # until the test closes its end
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("waiting", [True, False], ids=["waiting", "returned"])
def test_a_gloo_groups_record_holds_its_connection_and_none_of_the_scripts(
        echo_server: tuple[str, int], waiting: bool) -> None:
    """A real two-process gloo group: the record of its creation holds the group's connection
    only (not the store it is made on, which this process hosts, nor the script's own client);
    the end aborts the group through torch, clears torch's table and shuts that connection
    down, and the script's client still works. When the main thread's call returned by itself
    (``waiting`` False), nothing is shut down. The ended group is held until
    :func:`~elasticft.inprocess.groups.release_ended`, and freed then."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    own = socket.create_connection(echo_server)
    recording = sockets.install()
    assert recording is not None
    peer = subprocess.Popen([sys.executable, "-c", PEER, str(store.port)],
                            stdin=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        dist.init_process_group("gloo", store=store, rank=0, world_size=2)
        _, made = recording.recorded()[-1]
        ours = {own.fileno()} | {s.fd for s in sockets.snapshot().values()
                                 if s.local_port == store.port}
        assert made and not {s.fd for s in made} & ours, (made, ours)
        dist.all_reduce(torch.ones(1))
        held = dist.group.WORLD  # as a pending collective holds it: the abort frees nothing
        how = end_groups("gloo", lambda: waiting)
        assert "abort(1 of 1 groups at once; is_initialized() False after)" in how, how
        assert not dist.is_initialized()
        assert _alive(own)
        open_now = {s.fd: s.inode for s in sockets.snapshot().values()}
        if waiting:
            assert f"shutdown({len(made)} of {len(made)} " in how, how
        else:
            assert "nothing shut down" in how, how
            assert still_recorded(made, open_now) == made  # open, and not shut down
            states = {s.fd: s.state for s in sockets.snapshot().values()}
            assert [states.get(s.fd) for s in made] == ["01"] * len(made)  # still established
        del held
        groups.release_ended()  # as the recovery does: freed, gloo closes what it still has open
        assert not still_recorded(made, {s.fd: s.inode for s in sockets.snapshot().values()})
    finally:
        destroy_registered()
        peer.communicate(timeout=60)
        own.close()
