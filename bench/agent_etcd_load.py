"""etcd load of real agents: K ``elasticft-run`` agents (one worker each, gloo on CPU) train
through one real etcd server; the bench counts the requests etcd handles while they train.

bench/scale.py simulates many agents with the rendezvous and membership code alone; a real
agent also runs the diagnostics exchange, the recovery JIT watcher and the checkpoint service
over the same etcd. This bench runs the whole agent and reports, over a window in the middle of
training, etcd requests per node per second and which gRPC methods they are
(``grpc_server_handled_total`` from etcd's ``/metrics``; a stream counts once, when it ends).

Usage: ``python bench/agent_etcd_load.py --agents 2 --window-s 20`` (bounded: the training has a
fixed number of steps and every wait has a limit).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    from bench.scale import handled_by_method
    from tests.servers import EtcdServer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=2)
    parser.add_argument("--warmup-s", type=float, default=25.0,
                        help="seconds after the launch before the window opens")
    parser.add_argument("--window-s", type=float, default=20.0)
    args = parser.parse_args()
    if args.agents < 2:
        print("--agents: at least 2 (one node has no peers to watch)", file=sys.stderr)
        return 2
    steps = int((args.warmup_s + args.window_s + 20) / 0.1)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "data").mkdir(mode=0o700)
        etcd = EtcdServer(tmp / "data", tmp / "etcd.log")
        etcd.start()
        agents = []
        logs = [open(tmp / f"agent{i}.log", "w") for i in range(args.agents)]  # noqa: SIM115
        try:
            for i in range(args.agents):
                env = dict(os.environ, PYTHONPATH=str(ROOT))
                agents.append(subprocess.Popen(
                    [sys.executable, "-m", "elasticft.run", "--nnodes", str(args.agents),
                     "--nproc-per-node", "1", "--rdzv-backend", "etcd-v3",
                     "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", "load",
                     "--rdzv-conf", f"node_id=node{i}", "--max-restarts", "0",
                     "--run-dir", str(tmp / f"run{i}"),
                     str(ROOT / "examples" / "train_elasticft.py"), "--steps", str(steps),
                     "--step-time", "0.1", "--ckpt-dir", str(tmp / f"ckpt{i}")],
                    cwd=tmp, env=env, stdout=subprocess.DEVNULL, stderr=logs[i]))
            time.sleep(args.warmup_s)
            if any(a.poll() is not None for a in agents):
                print("an agent exited before the window; its log:", file=sys.stderr)
                for i in range(args.agents):
                    print((tmp / f"agent{i}.log").read_text()[-3000:], file=sys.stderr)
                return 1
            before = handled_by_method(etcd.endpoint)
            time.sleep(args.window_s)
            after = handled_by_method(etcd.endpoint)
            still = sum(a.poll() is None for a in agents)
        finally:
            for agent in agents:
                agent.terminate()
            for agent in agents:
                try:
                    agent.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    agent.kill()
            for log in logs:
                log.close()
            etcd.stop()
    delta = after - before
    total = sum(delta.values())
    per_node_s = total / args.agents / args.window_s
    print(f"{args.agents} agents training ({still} still running at the window's end), "
          f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}: {per_node_s:.2f} etcd requests per node "
          f"per second over {args.window_s:.0f} s")
    for method, count in delta.most_common():
        print(f"  {method:24s} {count / args.agents / args.window_s:6.2f} per node per second")
    return 0


if __name__ == "__main__":
    sys.exit(main())
