"""Control-plane scale bench: N agents rendezvous through one real etcd server.

Each agent is the project's real etcd-v3 rendezvous handler (``create_handler``: its own etcd
client, lease and keep-alive, the round protocol over per-node keys, the agents' ``EtcdStore``),
run as a thread; the agents are spread over ``--procs`` worker processes (default: one per 256
agents) so that one Python interpreter's lock is not the limit. No training workers are started.

For each N the bench measures:

* **round**: from the moment every agent calls ``next_rendezvous`` until the last one has its
  rank; the etcd requests that round cost per node (etcd's own ``grpc_server_handled_total``),
  the bytes its clients exchanged with etcd per node (``etcd_network_client_grpc_*_bytes_total``)
  and etcd's CPU seconds (/proc);
* **steady**: the request and byte rates per node while the agents only run: each calls
  ``num_nodes_waiting`` every 0.1 s as torch's agent monitor does (the handler asks etcd at most
  every 2 s) and keeps its lease alive;
* with ``--faults``: the round after 5% of the agents are lost (their leases revoked; the
  others rendezvous again, as they do when their workers fail), and the round after that with
  its coordinator lost mid-round (lease revoked as soon as it holds the coordinator key); with
  ``--etcd-members 3`` also a round during which an etcd follower restarts, and one during
  which the etcd leader is killed (and restarted after the round). ``--cycles K`` repeats that
  sequence K times and counts the rounds that failed (an agent left without a rank, or an
  error other than the lost coordinator's own).

With ``--c10d``, torch's own c10d rendezvous (a TCPStore served by the driver, as torchrun's
host serves it) runs the first round with the same N agents in the same worker processes.

Usage: ``nice -n 10 python bench/scale.py --nodes 64 256 1024 --faults --c10d`` (bounded: every
round has ``--timeout-s``; the bench stops by itself).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

AGENTS_PER_PROC = 256
MONITOR_INTERVAL_S = 0.1


# ---------------------------------------------------------------------------------------------
# Worker process: a share of the agents, driven by one-line commands on stdin.

def child(backend: str, endpoint: str, run_id: str, n: int, first: int, count: int,
          timeout_s: float, min_fraction: float, switch_interval_s: float) -> None:
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    from elasticft.rendezvous.factory import create_handler
    from elasticft.rendezvous.health import HealthReport

    def healthy() -> HealthReport:
        return HealthReport(ok=True, detail="", seconds=0.0)

    # Up to 256 agents share this interpreter (a real agent is alone in its process): with
    # Python's default 5 ms its threads hand the interpreter lock around so often that the
    # hand-offs, not the agents, take most of the CPU (docs/scale.md).
    sys.setswitchinterval(switch_interval_s)
    min_nodes = max(1, math.floor(min_fraction * n))
    conf = {"join_timeout": str(int(timeout_s)), "last_call_timeout": "1",
            "local_addr": "127.0.0.1"}
    handlers = {}
    for i in range(first, first + count):
        node = f"node{i:05d}"
        if backend == "c10d":  # torch's own, over the driver's TCPStore
            params = RendezvousParameters("c10d", endpoint, run_id, min_nodes, n,
                                          **conf, is_host="false")
            handlers[node] = get_rendezvous_handler(params)
        else:
            params = RendezvousParameters("etcd-v3", endpoint, run_id, min_nodes, n,
                                          **conf, rpc_timeout="10", node_id=node)
            handlers[node] = create_handler(params, health_check=healthy)
    alive = dict(handlers)
    monitor_stop = threading.Event()
    say = lambda **kw: print(json.dumps(kw), flush=True)  # noqa: E731
    say(ready=count)

    def rendezvous(t0: float) -> None:
        done: list[float] = []
        errors: list[str] = []

        def join(h: Any) -> None:
            try:
                h.next_rendezvous()
                done.append(time.time() - t0)
            except Exception as e:  # reported, not raised: the bench prints what failed
                errors.append(f"{type(e).__name__}: {e}"[:160])

        time.sleep(max(0.0, t0 - time.time()))
        cpu0 = time.process_time()
        threads = [threading.Thread(target=join, args=(h,), daemon=True) for h in alive.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, t0 + timeout_s - time.time()))
        say(done=done, errors=errors, cpu_s=time.process_time() - cpu0,
            rounds=sorted({getattr(h, "round", -1) for h in alive.values()}))

    def monitor() -> None:
        while not monitor_stop.wait(MONITOR_INTERVAL_S):
            for h in list(alive.values()):
                h.num_nodes_waiting()

    for line in sys.stdin:
        command, *rest = line.split()
        if command == "go":  # in a thread: a "lose" may come during the round
            threading.Thread(target=rendezvous, args=(float(rest[0]),), daemon=True).start()
        elif command == "monitor":
            monitor_stop.clear()
            threading.Thread(target=monitor, daemon=True).start()
            say(monitoring=True)
        elif command == "unmonitor":
            monitor_stop.set()
            say(monitoring=False)
        elif command == "lose":
            for node in rest:
                alive.pop(node).leave()
            say(lost=len(rest))
        elif command == "stop":
            break
    monitor_stop.set()
    for h in alive.values():
        h.shutdown()


# ---------------------------------------------------------------------------------------------
# The driver: etcd, the worker processes, the measurements.

def handled_by_method(endpoint: str) -> collections.Counter[str]:
    """gRPC requests the etcd member at ``endpoint`` has finished, by method (Range, Txn,
    LeaseKeepAlive, ...), from its ``grpc_server_handled_total`` (a stream counts once, when
    it ends)."""
    return _handled_in(_metrics(endpoint))


def _metrics(endpoint: str) -> str:
    return urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=5).read().decode()


def _handled_in(metrics: str) -> collections.Counter[str]:
    counts: collections.Counter[str] = collections.Counter()
    for labels, value in re.findall(r'^grpc_server_handled_total\{([^}]*)\} (\S+)$', metrics,
                                    re.M):
        method = re.search(r'grpc_method="([^"]+)"', labels)
        counts[method.group(1) if method else "?"] += float(value)
    return counts


class Etcd:
    """The etcd under test: one member, or a cluster of several on loopback."""

    def __init__(self, tmp: Path, members: int) -> None:
        from tests.servers import EtcdCluster, EtcdServer

        if members == 1:
            data = tmp / "data"
            data.mkdir(mode=0o700)
            self.cluster = None
            self.members = [EtcdServer(data, tmp / "etcd.log")]
        else:
            self.cluster = EtcdCluster(tmp, members)
            self.members = self.cluster.members

    @property
    def endpoint(self) -> str:
        return ",".join(m.endpoint for m in self.members)

    def start(self) -> None:
        if self.cluster is not None:
            self.cluster.start()
        else:
            self.members[0].start()

    def stop(self) -> None:
        for member in self.members:
            member.stop()

    def leader(self) -> Any:
        return self.cluster.leader() if self.cluster is not None else self.members[0]

    def traffic(self) -> tuple[float, float]:
        """Unary gRPC requests the members have handled (KV, Lease, ...) and bytes they have
        received from and sent to clients, from one read of each member's /metrics (nan while
        one is down: a restarted member starts counting again)."""
        requests = client_bytes = 0.0
        for member in self.members:
            try:
                metrics = _metrics(member.endpoint)
            except OSError:
                return math.nan, math.nan
            requests += sum(_handled_in(metrics).values())
            client_bytes += sum(float(v) for v in re.findall(
                r"^etcd_network_client_grpc_(?:received|sent)_bytes_total (\S+)$", metrics,
                re.M))
        return requests, client_bytes

    def cpu_s(self) -> float:
        total = 0.0
        for member in self.members:
            if member.process is None:
                return float("nan")
            stat = Path(f"/proc/{member.process.pid}/stat").read_text()
            fields = stat.rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / 100.0
        return total


class Fleet:
    """The worker processes holding N agents."""

    def __init__(self, endpoint: str, run_id: str, n: int, procs: int, timeout_s: float,
                 min_fraction: float, switch_interval_s: float, backend: str = "etcd-v3"):
        self.n = n
        self.run_id = run_id
        self.alive = {f"node{i:05d}" for i in range(n)}
        share = math.ceil(n / procs)
        self.procs = []
        self.owner: dict[str, Any] = {}
        for first in range(0, n, share):
            count = min(share, n - first)
            proc = subprocess.Popen(
                [sys.executable, __file__, "--child", backend, endpoint, run_id, str(n),
                 str(first), str(count), str(timeout_s), str(min_fraction),
                 str(switch_interval_s)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            self.procs.append(proc)
            for i in range(first, first + count):
                self.owner[f"node{i:05d}"] = proc
        for proc in self.procs:
            self._read(proc, "ready")

    def _read(self, proc: Any, key: str) -> dict[str, Any]:
        """The next reply of ``proc`` that carries ``key`` (others answer commands sent
        without waiting)."""
        while True:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError("a bench worker process exited; see its stderr above")
            reply = json.loads(line)
            if key in reply:
                return reply

    def send(self, line: str, key: str, procs: list[Any] | None = None) -> list[dict[str, Any]]:
        targets = self.procs if procs is None else procs
        for proc in targets:
            proc.stdin.write(line + "\n")
            proc.stdin.flush()
        return [self._read(proc, key) for proc in targets]

    def go(self, t0: float) -> list[dict[str, Any]]:
        return self.send(f"go {t0}", "done")

    def lose(self, nodes: list[str], wait: bool = True) -> None:
        by_proc: dict[Any, list[str]] = {}
        self.alive -= set(nodes)
        for node in nodes:
            by_proc.setdefault(self.owner[node], []).append(node)
        for proc, mine in by_proc.items():
            if wait:
                self.send("lose " + " ".join(mine), "lost", [proc])
            else:  # from a thread during a round: the reply is skipped by the next read
                proc.stdin.write("lose " + " ".join(mine) + "\n")
                proc.stdin.flush()

    def stop(self) -> None:
        for proc in self.procs:
            try:
                proc.stdin.write("stop\n")
                proc.stdin.close()
            except OSError:
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def closed_at(endpoint: str, run_id: str, round_: int) -> float:
    """When round ``round_``'s result was written (its closer's clock), 0 if it has none."""
    from elasticft.rendezvous.etcd import EtcdSettings, Keys, LazyClient

    settings = EtcdSettings.from_conf(endpoint, {})
    client = LazyClient(settings)
    try:
        for attempt in range(10):  # the client moves to the next endpoint after a failure
            try:
                value, _ = client.get(Keys(settings.root, run_id).result(round_))
                break
            except Exception:
                if attempt == 9:
                    raise
                time.sleep(0.5)
    finally:
        client.close()
    return float(json.loads(value)["at"]) if value else 0.0


@dataclasses.dataclass
class Round:
    line: str
    seconds: float
    failed: bool


def measure_round(fleet: Fleet, etcd: Etcd, during: Any = None, expected_errors: int = 0
                  ) -> Round:
    """One rendezvous round of the agents alive now (``during(t0)`` runs alongside, in a
    thread: the fault); failed when an agent still alive ends without a rank or with an error
    beyond the ``expected_errors`` (a lost coordinator's own)."""
    (req0, bytes0), cpu0 = etcd.traffic(), etcd.cpu_s()
    t0 = time.time() + 0.5
    if during is not None:
        threading.Thread(target=during, args=(t0,), daemon=True).start()
    reports = fleet.go(t0)
    expected = len(fleet.alive)  # after the fault, which may have lost an agent
    done = [d for r in reports for d in r["done"]]
    errors = [e for r in reports for e in r["errors"]]
    rounds = sorted({x for r in reports for x in r["rounds"]})
    agents_cpu = sum(r["cpu_s"] for r in reports)
    (req1, bytes1), cpu1 = etcd.traffic(), etcd.cpu_s()
    if req1 < req0 or cpu1 < cpu0:  # a member restarted during the round: counters restarted
        req1 = bytes1 = cpu1 = math.nan
    round_s = max(done) if len(done) >= expected and done else float("nan")
    closed_s = closed_at(etcd.endpoint, fleet.run_id, max(rounds)) - t0 if rounds else math.nan
    line = (f"round {round_s:6.2f} s (closed at {closed_s:5.2f} s)  "
            f"completed {len(done)}/{expected} (round {rounds})  "
            f"requests/node {(req1 - req0) / expected:5.1f}  "
            f"KB/node {(bytes1 - bytes0) / expected / 1e3:6.1f}  etcd CPU {cpu1 - cpu0:5.2f} s  "
            f"agents CPU {agents_cpu:5.1f} s")
    if errors:
        line += f"  errors {len(errors)} (first: {errors[0]})"
    failed = len(done) < expected or len(errors) > expected_errors
    return Round(line, round_s, failed)


def lose_coordinator(fleet: Fleet, etcd: Etcd, timeout_s: float, victim: list[str]) -> Any:
    """A fault for :func:`measure_round`: the agent that holds the coordinator key of the next
    round is lost as soon as it holds it."""
    from elasticft.rendezvous.etcd import EtcdSettings, Keys, LazyClient

    settings = EtcdSettings.from_conf(etcd.endpoint, {})
    client, keys = LazyClient(settings), Keys(settings.root, fleet.run_id)
    next_round = int(client.get(keys.last_round)[0]) + 1

    def fault(t0: float) -> None:
        try:
            time.sleep(max(0.0, t0 - time.time()))
            while time.time() < t0 + timeout_s:
                value, _ = client.get(keys.coordinator(next_round))
                if value:
                    victim.append(value.decode())
                    fleet.lose(victim, wait=False)
                    return
                time.sleep(0.05)
        finally:
            client.close()

    return fault


def restart_member(member: Any, after_s: float, down_s: float) -> Any:
    """A fault for :func:`measure_round`: an etcd member stops ``after_s`` into the round and
    comes back ``down_s`` later."""
    def fault(t0: float) -> None:
        time.sleep(max(0.0, t0 + after_s - time.time()))
        member.stop()
        time.sleep(down_s)
        member.start(wait=False)

    return fault


def kill_member(member: Any, after_s: float) -> Any:
    """A fault for :func:`measure_round`: an etcd member is SIGKILLed ``after_s`` into the
    round (the caller starts it again after the round)."""
    def fault(t0: float) -> None:
        time.sleep(max(0.0, t0 + after_s - time.time()))
        member.stop(signal.SIGKILL)

    return fault


def fault_rounds(fleet: Fleet, etcd: Etcd, n: int, timeout_s: float) -> list[Round]:
    """One sequence of fault rounds (see the module docstring)."""
    results = []
    lost = sorted(fleet.alive)[::20]  # 5%
    fleet.lose(lost)
    result = measure_round(fleet, etcd)
    print(f"N={n:5d}  after losing {len(lost)} agents: {result.line}", flush=True)
    results.append(result)

    victim: list[str] = []
    result = measure_round(fleet, etcd, lose_coordinator(fleet, etcd, timeout_s, victim),
                           expected_errors=1)
    print(f"N={n:5d}  coordinator {victim[0] if victim else '?'} lost mid-round: "
          f"{result.line}", flush=True)
    results.append(result)
    if etcd.cluster is None:
        return results

    leader = etcd.leader()
    follower = next(m for m in etcd.members if m is not leader)
    result = measure_round(fleet, etcd, restart_member(follower, 0.3, 1.0))
    follower.wait_ready(30)
    print(f"N={n:5d}  etcd follower {follower.name} restarted mid-round: {result.line}",
          flush=True)
    results.append(result)

    leader = etcd.leader()
    result = measure_round(fleet, etcd, kill_member(leader, 0.3))
    leader.start()
    print(f"N={n:5d}  etcd leader {leader.name} killed mid-round (new leader "
          f"{etcd.leader().name}): {result.line}", flush=True)
    results.append(result)
    return results


def one_n(etcd: Etcd, n: int, procs: int, steady_s: float, timeout_s: float, faults: bool,
          cycles: int, min_fraction: float, switch_interval_s: float) -> None:
    run_id = f"scale{n}-{int(time.time())}"
    fleet = Fleet(etcd.endpoint, run_id, n, procs, timeout_s, min_fraction, switch_interval_s)
    try:
        result = measure_round(fleet, etcd)
        print(f"N={n:5d} ({len(fleet.procs)} procs)  first {result.line}", flush=True)
        fleet.send("monitor", "monitoring")
        time.sleep(1.0)
        (req1, bytes1), cpu1 = etcd.traffic(), etcd.cpu_s()
        time.sleep(steady_s)
        (req2, bytes2), cpu2 = etcd.traffic(), etcd.cpu_s()
        fleet.send("unmonitor", "monitoring")
        print(f"N={n:5d}  steady requests/node/s {(req2 - req1) / n / steady_s:6.3f}  "
              f"bytes/node/s {(bytes2 - bytes1) / n / steady_s:7.1f}  "
              f"etcd CPU {100 * (cpu2 - cpu1) / steady_s:5.1f}%", flush=True)
        if not faults:
            return
        results = []
        for _ in range(cycles):
            results += fault_rounds(fleet, etcd, n, timeout_s)
        failed = sum(r.failed for r in results)
        print(f"N={n:5d}  fault rounds: {len(results)}, failed: {failed}, slowest "
              f"{max(r.seconds for r in results):.2f} s, {len(fleet.alive)} agents left",
              flush=True)
    finally:
        fleet.stop()


def c10d_round(n: int, procs: int, timeout_s: float, min_fraction: float,
               switch_interval_s: float) -> None:
    """The first round of torch's c10d rendezvous with the same N agents (threads of the same
    worker processes), over a TCPStore served by this process, as torchrun's host serves it."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    fleet = Fleet(f"127.0.0.1:{store.port}", f"c10d{n}-{int(time.time())}", n, procs,
                  timeout_s, min_fraction, switch_interval_s, backend="c10d")
    try:
        t0 = time.time() + 0.5
        reports = fleet.go(t0)
        done = [d for r in reports for d in r["done"]]
        errors = [e for r in reports for e in r["errors"]]
        round_s = max(done) if len(done) == n else float("nan")
        line = f"N={n:5d}  c10d first round {round_s:6.2f} s  completed {len(done)}/{n}"
        if done and len(done) < n:
            line += f" (the last of them at {max(done):.2f} s)"
        if errors:
            line += f"  errors {len(errors)} (first: {errors[0]})"
        print(line, flush=True)
    finally:
        fleet.stop()


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        backend, endpoint, run_id, n, first, count, timeout_s, min_fraction, switch = sys.argv[2:11]
        child(backend, endpoint, run_id, int(n), int(first), int(count), float(timeout_s),
              float(min_fraction), float(switch))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--procs", type=int, default=0,
                        help=f"worker processes (default: one per {AGENTS_PER_PROC} agents)")
    parser.add_argument("--etcd-members", type=int, default=1, choices=(1, 3, 5))
    parser.add_argument("--steady-s", type=float, default=10.0)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--faults", action="store_true",
                        help="also measure rounds with faults (see the module docstring)")
    parser.add_argument("--cycles", type=int, default=1,
                        help="with --faults: how many times to run the sequence of faults")
    parser.add_argument("--c10d", action="store_true",
                        help="also time torch's c10d rendezvous (TCPStore) at each N")
    parser.add_argument("--min-fraction", type=float, default=0.9,
                        help="--nnodes is floor(F*N):N (lower it for many --cycles: every "
                             "cycle loses 5%% of the agents and a coordinator)")
    parser.add_argument("--switch-interval", type=float, default=0.05,
                        help="Python's thread switch interval in the worker processes, seconds "
                             "(default 0.05; Python's own is 0.005): see docs/scale.md")
    args = parser.parse_args()
    if any(n < 2 for n in args.nodes):
        print("--nodes: every N must be at least 2", file=sys.stderr)
        return 2
    if not 0 < args.min_fraction <= 1:
        print("--min-fraction: give a fraction in (0, 1]", file=sys.stderr)
        return 2

    with tempfile.TemporaryDirectory() as tmp:
        etcd = Etcd(Path(tmp), args.etcd_members)
        etcd.start()
        try:
            print(f"etcd {etcd.endpoint} ({args.etcd_members} member(s)), "
                  f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}", flush=True)
            for n in args.nodes:
                procs = args.procs or max(1, math.ceil(n / AGENTS_PER_PROC))
                one_n(etcd, n, procs, args.steady_s, args.timeout_s, args.faults, args.cycles,
                      args.min_fraction, args.switch_interval)
                if args.c10d:
                    c10d_round(n, procs, args.timeout_s, args.min_fraction,
                               args.switch_interval)
        finally:
            etcd.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
