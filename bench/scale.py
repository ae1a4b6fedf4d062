"""Control-plane scale bench: N agents rendezvous through one real etcd server.

Each agent is the project's real etcd-v3 rendezvous handler (``create_handler``: its own etcd
client, lease and keep-alive, the round protocol over per-node keys, the agents' ``EtcdStore``),
run as a thread; the agents are spread over ``--procs`` worker processes (default: one per 256
agents) so that one Python interpreter's lock is not the limit. No training workers are started.

For each N the bench measures:

* **round**: from the moment every agent calls ``next_rendezvous`` until the last one has its
  rank; the etcd requests that round cost per node (etcd's own ``grpc_server_handled_total``)
  and etcd's CPU seconds (/proc);
* **steady**: the request rate per node while the agents only run: each calls
  ``num_nodes_waiting`` every 0.1 s as torch's agent monitor does (the handler asks etcd at most
  every 2 s) and keeps its lease alive;
* with ``--faults``: the round after 5% of the agents are lost (their leases revoked; the
  others rendezvous again, as they do when their workers fail), and the round after that with
  its coordinator lost mid-round (lease revoked as soon as it holds the coordinator key).

Usage: ``nice -n 10 python bench/scale.py --nodes 64 256 1024 --faults`` (bounded: every round
has ``--timeout-s``; the bench stops by itself). Not measured here: a 3-member etcd cluster, and
torch's c10d (TCPStore) rendezvous at the same N.
"""

from __future__ import annotations

import argparse
import json
import math
import re
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

def child(endpoint: str, run_id: str, n: int, first: int, count: int, timeout_s: float) -> None:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from elasticft.rendezvous.handler import create_handler
    from elasticft.rendezvous.health import HealthReport

    def healthy() -> HealthReport:
        return HealthReport(ok=True, detail="", seconds=0.0)

    min_nodes = max(1, math.floor(0.9 * n))
    conf = {"join_timeout": str(int(timeout_s)), "last_call_timeout": "1", "rpc_timeout": "10",
            "local_addr": "127.0.0.1"}
    handlers = {}
    for i in range(first, first + count):
        node = f"node{i:05d}"
        params = RendezvousParameters("etcd-v3", endpoint, run_id, min_nodes, n,
                                      **{**conf, "node_id": node})
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
        threads = [threading.Thread(target=join, args=(h,), daemon=True) for h in alive.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, t0 + timeout_s - time.time()))
        say(done=done, errors=errors, rounds=sorted({h.round for h in alive.values()}))

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

def etcd_requests(endpoint: str) -> float:
    """Unary gRPC requests etcd has handled (KV, Lease, ...), from its /metrics."""
    text = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=5).read().decode()
    return sum(float(m.group(1)) for m in re.finditer(
        r'^grpc_server_handled_total\{[^}]*\} (\S+)$', text, re.M))


def etcd_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0


class Fleet:
    """The worker processes holding N agents."""

    def __init__(self, endpoint: str, run_id: str, n: int, procs: int, timeout_s: float):
        self.n = n
        self.run_id = run_id
        share = math.ceil(n / procs)
        self.procs = []
        self.owner: dict[str, Any] = {}
        for first in range(0, n, share):
            count = min(share, n - first)
            proc = subprocess.Popen(
                [sys.executable, __file__, "--child", endpoint, run_id, str(n), str(first),
                 str(count), str(timeout_s)],
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

    def lose(self, nodes: list[str]) -> None:
        by_proc: dict[Any, list[str]] = {}
        for node in nodes:
            by_proc.setdefault(self.owner[node], []).append(node)
        for proc, mine in by_proc.items():
            self.send("lose " + " ".join(mine), "lost", [proc])

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
        value, _ = client.get(Keys(settings.root, run_id).result(round_))
    finally:
        client.close()
    return float(json.loads(value)["at"]) if value else 0.0


def measure_round(fleet: Fleet, endpoint: str, etcd_pid: int, expected: int,
                  during: Any = None) -> tuple[str, float]:
    req0, cpu0 = etcd_requests(endpoint), etcd_cpu_s(etcd_pid)
    t0 = time.time() + 0.5
    if during is not None:
        threading.Thread(target=during, args=(t0,), daemon=True).start()
    reports = fleet.go(t0)
    done = [d for r in reports for d in r["done"]]
    errors = [e for r in reports for e in r["errors"]]
    rounds = sorted({x for r in reports for x in r["rounds"]})
    req1, cpu1 = etcd_requests(endpoint), etcd_cpu_s(etcd_pid)
    round_s = max(done) if len(done) == expected else float("nan")
    closed_s = closed_at(endpoint, fleet.run_id, max(rounds)) - t0 if rounds else float("nan")
    line = (f"round {round_s:6.2f} s (closed at {closed_s:5.2f} s)  "
            f"completed {len(done)}/{expected} (round {rounds})  "
            f"requests/node {(req1 - req0) / expected:5.1f}  etcd CPU {cpu1 - cpu0:5.2f} s")
    if errors:
        line += f"  errors {len(errors)} (first: {errors[0]})"
    return line, round_s


def one_n(endpoint: str, etcd_pid: int, n: int, procs: int, steady_s: float, timeout_s: float,
          faults: bool) -> None:
    run_id = f"scale{n}-{int(time.time())}"
    fleet = Fleet(endpoint, run_id, n, procs, timeout_s)
    try:
        line, _ = measure_round(fleet, endpoint, etcd_pid, n)
        print(f"N={n:5d} ({len(fleet.procs)} procs)  first {line}", flush=True)
        fleet.send("monitor", "monitoring")
        time.sleep(1.0)
        req1, cpu1 = etcd_requests(endpoint), etcd_cpu_s(etcd_pid)
        time.sleep(steady_s)
        req2, cpu2 = etcd_requests(endpoint), etcd_cpu_s(etcd_pid)
        fleet.send("unmonitor", "monitoring")
        print(f"N={n:5d}  steady requests/node/s {(req2 - req1) / n / steady_s:6.3f}  "
              f"etcd CPU {100 * (cpu2 - cpu1) / steady_s:5.1f}%", flush=True)
        if not faults:
            return
        lost = [f"node{i:05d}" for i in range(0, n, 20)]  # 5%
        fleet.lose(lost)
        alive = n - len(lost)
        line, _ = measure_round(fleet, endpoint, etcd_pid, alive)
        print(f"N={n:5d}  after losing {len(lost)} agents: {line}", flush=True)

        from elasticft.rendezvous.etcd import EtcdSettings, Keys, LazyClient

        settings = EtcdSettings.from_conf(endpoint, {})
        client, keys = LazyClient(settings), Keys(settings.root, run_id)
        next_round = int(client.get(keys.last_round)[0]) + 1
        victim: list[str] = []

        def lose_coordinator(t0: float) -> None:
            time.sleep(max(0.0, t0 - time.time()))
            while time.time() < t0 + timeout_s:
                value, _ = client.get(keys.coordinator(next_round))
                if value:
                    victim.append(value.decode())
                    fleet.owner[victim[0]].stdin.write(f"lose {victim[0]}\n")
                    fleet.owner[victim[0]].stdin.flush()
                    return
                time.sleep(0.05)

        line, _ = measure_round(fleet, endpoint, etcd_pid, alive - 1, during=lose_coordinator)
        print(f"N={n:5d}  coordinator {victim[0] if victim else '?'} lost mid-round: {line}",
              flush=True)
        client.close()
    finally:
        fleet.stop()


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        endpoint, run_id, n, first, count, timeout_s = sys.argv[2:8]
        child(endpoint, run_id, int(n), int(first), int(count), float(timeout_s))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--procs", type=int, default=0,
                        help=f"worker processes (default: one per {AGENTS_PER_PROC} agents)")
    parser.add_argument("--steady-s", type=float, default=10.0)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--faults", action="store_true",
                        help="also measure the rounds after losing 5%% of the agents and after "
                             "losing the coordinator mid-round")
    args = parser.parse_args()
    if any(n < 2 for n in args.nodes):
        print("--nodes: every N must be at least 2", file=sys.stderr)
        return 2
    from tests.servers import EtcdServer

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        data.mkdir(mode=0o700)
        server = EtcdServer(data, Path(tmp) / "etcd.log")
        server.start()
        assert server.process is not None
        try:
            print(f"etcd {server.endpoint} (one member), "
                  f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}", flush=True)
            for n in args.nodes:
                procs = args.procs or max(1, math.ceil(n / AGENTS_PER_PROC))
                one_n(server.endpoint, server.process.pid, n, procs, args.steady_s,
                      args.timeout_s, args.faults)
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
