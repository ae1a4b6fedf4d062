"""Control-plane scale bench: N simulated agents rendezvous through one real etcd server.

Each agent is the project's real etcd-v3 rendezvous handler (``create_handler``: its own etcd
client, membership lease and keep-alive, torch's dynamic rendezvous over the etcd backend and
store), run in a thread of this process; no workers are started. For each N the bench measures
the time until every agent has completed the first round, the etcd requests the round cost per
node (etcd's own ``grpc_server_handled_total``) and the etcd process's CPU seconds (/proc), then
the steady-state request rate per node while the agents only keep their leases alive.

Usage: ``nice -n 10 python bench/scale.py --nodes 16 64`` (``--no-cas-backoff`` for the baseline:
a lost CAS retried at once, as before the back-off) (bounded: every round has a timeout and
the steady-state window is ``--steady-s`` seconds; the bench stops by itself).

Not measured yet (see docs/scale.md): the 3-member cluster, rounds after a node or the leader
is lost, fault injection, and torch's c10d (TCPStore) rendezvous for comparison.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from torch.distributed.elastic.rendezvous import RendezvousParameters

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elasticft.rendezvous import backend as backend_module
from elasticft.rendezvous.backend import EtcdRendezvousBackend
from elasticft.rendezvous.handler import create_handler
from elasticft.rendezvous.health import HealthReport
from tests.servers import EtcdServer


def etcd_requests(server: EtcdServer) -> float:
    """Unary gRPC requests etcd has handled (KV, Lease, Watch, ...), from its /metrics."""
    text = urllib.request.urlopen(f"http://{server.endpoint}/metrics", timeout=5).read().decode()
    return sum(float(m.group(1)) for m in re.finditer(
        r'^grpc_server_handled_total\{[^}]*\} (\S+)$', text, re.M))


def etcd_cpu_s(server: EtcdServer) -> float:
    assert server.process is not None
    fields = Path(f"/proc/{server.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0


CAS_COUNTS = {"won": 0, "lost": 0}


def count_cas_outcomes() -> None:
    """Count won and lost compare-and-set writes of the rendezvous state (a wrapper, bench only)."""
    real_set_state = EtcdRendezvousBackend.set_state

    def counted(self, state, token=None):
        result = real_set_state(self, state, token)
        if result is not None:
            CAS_COUNTS["won" if result[2] else "lost"] += 1
        return result

    EtcdRendezvousBackend.set_state = counted  # type: ignore[method-assign]


def healthy() -> HealthReport:
    return HealthReport(ok=True, detail="", seconds=0.0)


def one_n(server: EtcdServer, n: int, steady_s: float, timeout_s: float,
          keep_alive_s: int) -> str:
    run_id = f"scale{n}-{int(time.time())}"
    conf = {"node_id": "", "join_timeout": str(int(timeout_s)), "last_call_timeout": "1",
            "rpc_timeout": "10", "keep_alive_interval": str(keep_alive_s)}
    handlers = []
    for i in range(n):
        params = RendezvousParameters("etcd-v3", server.endpoint, run_id, n, n,
                                      **{**conf, "node_id": f"node{i:05d}"})
        handlers.append(create_handler(params, health_check=healthy))
    done: list[float] = []
    errors: list[str] = []
    req0, cpu0 = etcd_requests(server), etcd_cpu_s(server)
    won0, lost0 = CAS_COUNTS["won"], CAS_COUNTS["lost"]
    start = time.monotonic()

    def join(h) -> None:
        try:
            h.next_rendezvous()
            done.append(time.monotonic() - start)
        except Exception as e:  # reported, not raised: the bench prints what failed
            errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=join, args=(h,), daemon=True) for h in handlers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, start + timeout_s - time.monotonic()))
    round_s = max(done) if len(done) == n else float("nan")
    req1, cpu1 = etcd_requests(server), etcd_cpu_s(server)
    won, lost = CAS_COUNTS["won"] - won0, CAS_COUNTS["lost"] - lost0
    time.sleep(steady_s)
    req2, cpu2 = etcd_requests(server), etcd_cpu_s(server)
    for h in handlers:
        try:
            h.shutdown()
            h.close_membership()
        except Exception:
            pass
    line = (f"N={n:5d}  round {round_s:7.2f} s  completed {len(done)}/{n}  "
            f"round requests/node {(req1 - req0) / n:7.1f}  CAS won {won} lost {lost}  "
            f"round etcd CPU {cpu1 - cpu0:6.2f} s  "
            f"steady requests/node/s {(req2 - req1) / n / steady_s:6.3f}  "
            f"steady etcd CPU {100 * (cpu2 - cpu1) / steady_s:5.1f}%")
    if errors:
        line += f"  errors {len(errors)} (first: {errors[0][:160]})"
    return line


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--steady-s", type=float, default=10.0)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--keep-alive-s", type=int, default=5,
                        help="torch keep_alive_interval: each agent rewrites the state this often")
    parser.add_argument("--no-cas-backoff", action="store_true",
                        help="retry a lost rendezvous CAS at once (baseline, torch's behaviour)")
    args = parser.parse_args()
    if args.no_cas_backoff:
        backend_module.cas_backoff_s = lambda *_args, **_kwargs: 0.0
    count_cas_outcomes()
    if any(n < 2 for n in args.nodes):
        print("--nodes: every N must be at least 2", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        data.mkdir(mode=0o700)
        server = EtcdServer(data, Path(tmp) / "etcd.log")
        server.start()
        try:
            backoff = "off" if args.no_cas_backoff else "on"
            print(f"etcd {server.endpoint} (one member), CAS back-off {backoff}, "
                  f"keep-alive every {args.keep_alive_s} s, "
                  f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
            for n in args.nodes:
                line = one_n(server, n, args.steady_s, args.timeout_s, args.keep_alive_s)
                print(line, flush=True)
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
