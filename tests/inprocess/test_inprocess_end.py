"""How a survivor ends its process groups, end to end under a real ``elasticft-run --standalone
--nproc-per-node 2`` on gloo: the calls a GPU job makes (every live group's abort at once,
then torch's ``_abort_process_group`` of the default group, which clears torch's table of
groups as it does on NCCL) run here too, and the survivor still recovers in its own process;
the gloo part, the shutdown of the connections the groups made, leaves the script's own TCP
clients working."""

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

# Also on the second torch (scripts/compat.sh): there the reconfigure path, here a new group.
pytestmark = pytest.mark.smoke

ABORTED_LIVE_GROUPS = ("abort(2 of 2 groups at once; is_initialized() "
                       f"{reconfigure.unsupported() is None} after)")
"""The survivor's log of its end of the groups: both groups (the default one and the script's
``new_group``) aborted at once, and torch's table cleared after them, or, on a torch with
reconfigure, the default group kept in it to be rebuilt in place."""


@pytest.fixture(scope="module")
def reference(inprocess_reference: dict[int, str]) -> dict[int, str]:
    return {step: loss for step, loss in inprocess_reference.items() if step <= STEPS}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_survivor_ends_its_groups_as_on_nccl_and_keeps_its_process(
        tmp_path: Path, job_env: dict[str, str], reference: dict[int, str]) -> None:
    """Rank 1 is SIGKILLed while the survivor runs Python after its step 6 (``--step-time``):
    the agent's notice makes the survivor's monitor end its two groups with torch's abort (the
    calls an NCCL job makes), which leaves torch with no group, and then interrupts the main
    thread. Its recovery reads nothing of torch's table: it keeps its process and goes on
    bit-exact. (Where the survivor's collective raised first, its teardown makes the same
    calls.)"""
    run = _run(tmp_path, "abort", job_env, "--fault-rank", "1", "--crash-at-step", "6",
               "--crash-mode", "after-save", "--extra-group", "--step-time", "3",
               "--step-time-at-step", "6")
    _recovered_in_process(run, [1])
    assert ABORTED_LIVE_GROUPS in run["text"], run["text"][-5000:]
    assert len(run["pids"][0]) == 1, run["pids"]  # the survivor kept its process
    assert len(run["pids"][1]) == 2, run["pids"]
    assert "1 in-process recoveries in this process" in run["text"]
    assert run["losses"] == reference


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_scripts_own_tcp_clients_live_through_a_recovery(
        tmp_path: Path, job_env: dict[str, str], reference: dict[int, str],
        echo_server: tuple[str, int]) -> None:
    """Every rank holds, from before ``run()``, a client of a TCPStore and a connection to an
    echo server (both hosted here). Rank 1 hands its sockets to a child outside the job and is
    SIGKILLed: its connections stay open, so the survivor's collective would wait for ever. The
    agent's notice makes the survivor end its own connections (the end of its groups shuts them
    down) and recover in process; its own clients still answer afterwards. (This test also
    carries the checks of a collective that never raises.)"""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    keeper, clients = tmp_path / "keeper.pid", tmp_path / "clients.log"
    try:
        run = _run(tmp_path, "own", job_env, "--fault-rank", "1", "--crash-at-step", "6",
                   "--crash-mode", "keep-sockets", "--keeper-pid", str(keeper), "--extra-group",
                   "--own-store", str(store.port), "--own-echo", str(echo_server[1]),
                   "--own-clients-log", str(clients))
        done = _recovered_in_process(run, [1])
        assert "survivors_out_s" in done["phases"]
        assert "generation 0 ended by the agent" in run["text"], run["text"][-5000:]
        os.kill(int(keeper.read_text()), 0)  # the sockets' holder lived through the recovery
        ended = re.search(r"process groups ended \((.*)\) in", run["text"])
        assert ended is not None, run["text"][-5000:]  # the monitor ended the groups
        shut = re.search(r"shutdown\((\d+) of (\d+) recorded group sockets\)", ended.group(1))
        assert shut is not None and int(shut.group(1)) >= 1, ended.group(1)
        assert ABORTED_LIVE_GROUPS in ended.group(1)
        # The survivor (one recovery) and the replacement: their own clients still work.
        assert sorted(clients.read_text().splitlines()) == ["0 ok 1", "1 ok 0"], \
            clients.read_text()
        assert len(run["pids"][0]) == 1, run["pids"]  # the survivor kept its process
        assert len(run["pids"][1]) == 2, run["pids"]
        assert run["losses"] == reference
    finally:
        if keeper.exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(keeper.read_text()), signal.SIGKILL)
