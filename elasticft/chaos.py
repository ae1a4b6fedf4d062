"""Fault injection for a running job: ``elasticft chaos ...``.

Faults are real: signals sent to the real worker processes, found through the run's event log
(the newest ``workers_started`` event names every rank's pid). Users run these against their own
job to see what recovery costs them; the demo and the tests use the same commands.

=================  ============================================================================
``kill``           SIGKILL one rank (a crash)
``term``           SIGTERM one rank (killed by mistake)
``stop``           SIGSTOP one rank (a hang)
``slow``           a SIGSTOP/SIGCONT duty cycle on one rank (a slow GPU or a throttled host)
``kill-node``      SIGKILL a node's agent and all its workers (by node id, from the event log)
``netcut``         ``ip link set LINK down``, optionally inside a network namespace (root)
``kill-leader``    kill-node on the round's leader, read from the etcd-v3 rendezvous
``restart-etcd``   SIGTERM an etcd server and start it again with the same command line
``bitflip``        flip one bit of one rank's parameters (silent data corruption)
=================  ============================================================================

``bitflip`` goes to the live worker through its checkpointer's control thread (the files of
:mod:`elasticft.ckpt.control` in the run's ``ckpt-control`` directory): at its next save the
worker flips one mantissa bit of the first element of its first parameter, and answers with the
step. The fingerprint watch (``--ckpt-fingerprint-every``) should then name that rank.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil

from elasticft.ckpt import control
from elasticft.events import read_events


class ChaosError(Exception):
    pass


def locate_rank(events: Sequence[dict[str, Any]], run_dir: Path, rank: int,
                is_running: Callable[[int], bool]) -> int:
    """The pid of ``rank``'s current worker, from the run's events; or a :class:`ChaosError`
    that says in a sentence why there is none (no run there yet, workers not started, no such
    rank, the run finished, the worker exited and is being restarted)."""
    starts = [e for e in events if e["kind"] == "run_start"]
    if not starts:
        raise ChaosError(f"no run in {run_dir}: elasticft-run writes its event log there when "
                         f"it starts with --run-dir {run_dir}")
    run = f"run {starts[-1].get('run_id', '?')}"
    newest_by_node: dict[str, dict[str, Any]] = {}
    for event in events:
        if event["kind"] == "workers_started":
            newest_by_node[event["node"]] = event
    if not newest_by_node:
        raise ChaosError(f"{run} has not started its workers yet; try again in a moment")
    owner = {int(r): (int(pid), e) for e in newest_by_node.values()
             for r, pid in e["pids"].items()}
    if rank not in owner:
        raise ChaosError(f"{run} has no rank {rank}; its ranks are "
                         f"{', '.join(map(str, sorted(owner)))}")
    pid, started = owner[rank]
    ended = [e for e in events if e["kind"] == "run_end" and e["node"] == started["node"]
             and e["time"] >= started["time"]]
    if ended:
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ended[-1]["time"]))
        raise ChaosError(f"rank {rank} of {run} is not running (the run finished at {at}, "
                         f"{ended[-1].get('state', 'ended')})")
    if not is_running(pid):
        raise ChaosError(f"rank {rank} of {run} is not running (its worker, pid {pid}, has "
                         "exited and the next one has not started); try again in a moment")
    return pid


def process_running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, dead but not yet reaped, is not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_for(path: Path | None, timeout_s: float) -> None:
    if path is None:
        return
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise ChaosError(f"{path} did not appear within {timeout_s:g} s")
        time.sleep(0.05)


def worker_pid(run_dir: Path, rank: int) -> int:
    """The pid of ``rank``'s current worker in the run at ``run_dir`` (:func:`locate_rank`)."""
    return locate_rank(read_events(run_dir), run_dir, rank, process_running)


def signal_rank(run_dir: Path, rank: int, sig: signal.Signals) -> int:
    """Sends ``sig`` to the current worker of ``rank``; returns its pid."""
    pid = worker_pid(run_dir, rank)
    try:
        os.kill(pid, sig)
    except ProcessLookupError:  # it exited between the look and the signal
        pid = locate_rank(read_events(run_dir), run_dir, rank, lambda _: False)
    return pid


def slow_rank(run_dir: Path, rank: int, duty: float, period_s: float, duration_s: float) -> int:
    """Stops ``rank`` for ``duty`` of every ``period_s`` for ``duration_s`` (or until it exits);
    returns the number of cycles. The process is always left running."""
    if not 0 < duty < 1:
        raise ChaosError(f"--duty {duty} must be between 0 and 1 (the stopped fraction)")
    pid = locate_rank(read_events(run_dir), run_dir, rank, process_running)
    deadline = time.monotonic() + duration_s
    cycles = 0
    try:
        while time.monotonic() < deadline:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(period_s * duty)
            os.kill(pid, signal.SIGCONT)
            time.sleep(period_s * (1 - duty))
            cycles += 1
    except ProcessLookupError:
        pass  # the rank exited (restarted by its agent): nothing left to slow
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    return cycles


def bitflip_rank(run_dir: Path, rank: int, timeout_s: float) -> dict[str, Any]:
    """Has ``rank``'s live worker flip one bit of its parameters at its next save; returns its
    answer (the step and the tensor's shape) once it has."""
    pid = worker_pid(run_dir, rank)
    for record in sorted(run_dir.glob("ckpt-control/*/watching-l*.json")):
        local_rank = int(record.stem.removeprefix("watching-l"))
        if control.watching_pid(record.parent, local_rank) != pid:
            continue
        request_id = control.request_bitflip(record.parent, local_rank)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            answer = control.read_flipped(record.parent, local_rank, request_id)
            if answer is not None:
                if answer.get("error"):
                    raise ChaosError(f"rank {rank} flipped nothing: {answer['error']}")
                return answer
            time.sleep(0.05)
        raise ChaosError(f"rank {rank} (pid {pid}) took the bit-flip request but did not save "
                         f"within {timeout_s:g} s; the flip happens at its next save")
    raise ChaosError(f"rank {rank} (pid {pid}) has no checkpoint control thread in "
                     f"{run_dir}/ckpt-control: a bit flip is delivered through the worker's "
                     "elasticft.ckpt.Checkpointer under elasticft-run; make one in the script")


def node_agent_pid(run_dir: Path, node: str) -> int:
    """The pid of ``node``'s agent: its newest ``run_start`` event."""
    starts = [e for e in read_events(run_dir) if e["kind"] == "run_start" and e["node"] == node]
    if not starts:
        nodes = sorted({e["node"] for e in read_events(run_dir)})
        raise ChaosError(f"no agent of node {node!r} under {run_dir}; nodes there: {nodes}")
    return int(starts[-1]["pid"])


def kill_process_tree(pid: int) -> list[int]:
    """SIGKILLs a process and all its descendants (workers run in their own sessions, so a
    process-group kill would miss them); returns the pids killed. The process is stopped
    first: a node that dies takes everything at once, and an agent that saw its workers die
    before it would report their failure to the other nodes, which a lost node never does."""
    try:
        root = psutil.Process(pid)
        root.send_signal(signal.SIGSTOP)
        victims = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        raise ChaosError(f"process {pid} is not running") from None
    killed = []
    for proc in victims:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGKILL)
            killed.append(proc.pid)
    return killed


def kill_node(run_dir: Path, node: str) -> list[int]:
    return kill_process_tree(node_agent_pid(run_dir, node))


def netcut(link: str, netns: str | None = None) -> None:
    """Takes a network link down (in ``netns`` when given): the node stays up, unreachable."""
    cmd = ["ip", *(["-n", netns] if netns else []), "link", "set", link, "down"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ChaosError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()} (needs root)")


def leader_agent(endpoint: str, run_id: str, conf: dict[str, str] | None = None
                 ) -> tuple[str, int]:
    """(node id, agent pid) of the current leader, read from the etcd-v3 rendezvous."""
    from elasticft.rendezvous.etcd import EtcdSettings, Keys, LazyClient
    from elasticft.rendezvous.membership import read_leader

    settings = EtcdSettings.from_conf(endpoint, conf or {})
    client = LazyClient(settings)
    try:
        leader = read_leader(client, Keys(settings.root, run_id), settings)
    finally:
        client.close()
    if leader is None:
        raise ChaosError(f"job {run_id!r} has no leader in etcd at {endpoint} right now")
    return leader.node_id, leader.pid


def restart_etcd(pid: int, down_s: float) -> int:
    """SIGTERMs the etcd server ``pid`` and starts its command line again; returns the new pid."""
    try:
        proc = psutil.Process(pid)
        cmdline, cwd = proc.cmdline(), proc.cwd()
    except psutil.NoSuchProcess:
        raise ChaosError(f"no etcd process {pid}") from None
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except psutil.TimeoutExpired:
        proc.kill()
    time.sleep(down_s)
    started = subprocess.Popen(cmdline, cwd=cwd, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    return started.pid


def _cmd_signal(args: argparse.Namespace) -> int:
    from elasticft.cli import CliError

    try:
        sig = signal.Signals[f"SIG{args.signal.upper().removeprefix('SIG')}"]
    except KeyError:
        raise CliError(f"unknown signal {args.signal!r}; use e.g. KILL, TERM, STOP") from None
    try:
        wait_for(args.when_exists, args.timeout)
        if args.after:
            time.sleep(args.after)
        pid = signal_rank(args.run_dir, args.rank, sig)
    except (ChaosError, ProcessLookupError) as e:
        raise CliError(str(e)) from None
    print(f"sent {sig.name} to rank {args.rank} (pid {pid})")
    return 0


def _run_fault(args: argparse.Namespace) -> int:
    from elasticft.cli import CliError

    try:
        wait_for(getattr(args, "when_exists", None), getattr(args, "timeout", 300.0))
        if getattr(args, "after", 0.0):
            time.sleep(args.after)
        print(args.fault_action(args), flush=True)
    except (ChaosError, ProcessLookupError) as e:
        raise CliError(str(e)) from None
    return 0


def _slow(args: argparse.Namespace) -> str:
    cycles = slow_rank(args.run_dir, args.rank, args.duty, args.period, args.duration)
    return f"slowed rank {args.rank} for {cycles} cycles (stopped {args.duty:.0%} of " \
           f"{args.period:g} s)"


def _bitflip(args: argparse.Namespace) -> str:
    answer = bitflip_rank(args.run_dir, args.rank, args.save_timeout)
    return (f"flipped one bit of rank {args.rank}'s parameter of shape {answer.get('shape')} "
            f"before its save of step {answer.get('step')}")


def _kill_node(args: argparse.Namespace) -> str:
    return f"killed node {args.node}: pids {kill_node(args.run_dir, args.node)}"


def _netcut(args: argparse.Namespace) -> str:
    netcut(args.link, args.netns)
    where = f" in network namespace {args.netns}" if args.netns else ""
    return f"link {args.link}{where} is down"


def _kill_leader(args: argparse.Namespace) -> str:
    node, pid = leader_agent(args.rdzv_endpoint, args.rdzv_id)
    return f"killed leader {node}: pids {kill_process_tree(pid)}"


def _restart_etcd(args: argparse.Namespace) -> str:
    return f"etcd restarted as pid {restart_etcd(args.pid, args.down)}"


def _timing_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--after", type=float, default=0.0, help="seconds to wait first")
    p.add_argument("--when-exists", type=Path, help="wait until this file exists first")
    p.add_argument("--timeout", type=float, default=300.0, help="for --when-exists")


def register(subparsers: argparse._SubParsersAction) -> None:
    chaos = subparsers.add_parser("chaos", help="inject faults into a running job")
    kinds = chaos.add_subparsers(dest="fault", required=True, metavar="FAULT")
    for name, default_signal, text in (
        ("kill", "KILL", "SIGKILL one worker (a crash)"),
        ("term", "TERM", "SIGTERM one worker (killed by mistake)"),
        ("stop", "STOP", "SIGSTOP one worker (a hang)"),
    ):
        p = kinds.add_parser(name, help=text)
        p.add_argument("--run-dir", type=Path, required=True, help="the run's event directory")
        p.add_argument("--rank", type=int, default=0, help="global rank to hit")
        p.add_argument("--after", type=float, default=0.0, help="seconds to wait first")
        p.add_argument("--when-exists", type=Path, help="wait until this file exists first")
        p.add_argument("--timeout", type=float, default=300.0, help="for --when-exists")
        p.set_defaults(handler=_cmd_signal, signal=default_signal)
    p = kinds.add_parser("slow", help="SIGSTOP/SIGCONT duty cycle on one worker (slow rank)")
    p.add_argument("--run-dir", type=Path, required=True, help="the run's event directory")
    p.add_argument("--rank", type=int, default=0, help="global rank to slow")
    p.add_argument("--duty", type=float, default=0.67, help="fraction of each period stopped")
    p.add_argument("--period", type=float, default=0.3, help="seconds per stop/continue cycle")
    p.add_argument("--duration", type=float, default=60.0, help="seconds to keep slowing")
    _timing_args(p)
    p.set_defaults(handler=_run_fault, fault_action=_slow)
    p = kinds.add_parser("bitflip", help="flip one bit of one rank's parameters (silent "
                         "data corruption), at its next save")
    p.add_argument("--run-dir", type=Path, required=True, help="the run's directory")
    p.add_argument("--rank", type=int, default=0, help="global rank whose parameters to hit")
    p.add_argument("--save-timeout", type=float, default=120.0,
                   help="seconds to wait for the rank's next save")
    _timing_args(p)
    p.set_defaults(handler=_run_fault, fault_action=_bitflip)
    p = kinds.add_parser("kill-node", help="SIGKILL a node's agent and all its workers")
    p.add_argument("--run-dir", type=Path, required=True, help="the run's event directory")
    p.add_argument("--node", required=True, help="node id (as in the event log)")
    _timing_args(p)
    p.set_defaults(handler=_run_fault, fault_action=_kill_node)
    p = kinds.add_parser("netcut", help="take a node's network link down (needs root)")
    p.add_argument("--link", required=True, help="interface name, e.g. the node's veth end")
    p.add_argument("--netns", help="network namespace the link is in")
    _timing_args(p)
    p.set_defaults(handler=_run_fault, fault_action=_netcut)
    p = kinds.add_parser("kill-leader", help="kill-node on the etcd-v3 round's leader")
    p.add_argument("--rdzv-endpoint", required=True, help="etcd endpoint(s) of the job")
    p.add_argument("--rdzv-id", required=True, help="the job's rendezvous id")
    _timing_args(p)
    p.set_defaults(handler=_run_fault, fault_action=_kill_leader)
    p = kinds.add_parser("restart-etcd", help="stop an etcd server and start it again")
    p.add_argument("--pid", type=int, required=True, help="the etcd server's pid")
    p.add_argument("--down", type=float, default=1.0, help="seconds to stay down")
    _timing_args(p)
    p.set_defaults(handler=_run_fault, fault_action=_restart_etcd)
