"""Diagnostics soak: a healthy run of N minutes on default settings must raise no detection.

    .venv/bin/python bench/soak.py [--minutes 10] [--nodes 1] [--nproc 2] [--dim 128]

``elasticft-run --standalone`` runs this file's worker (a plain DDP script, no elasticft import,
so the recorder is installed by the agent's bootstrap, as for any unmodified script) with every
diagnostics option at its default. The worker trains ``examples/train_plain.py``'s TinyGPT and
does what real jobs do that could look like trouble to a detector:

* the first steps (start-up, no history for the adaptive timeouts yet);
* a checkpoint save by rank 0 every ``--ckpt-every`` steps (the other ranks wait for it in the
  next collective, so their collective runs long);
* an evaluation pause every ``--eval-every`` steps (``--eval-s`` seconds of forward passes
  without gradients on every rank, then an all-reduce of the evaluation loss);
* an input-pipeline wait per step (``--data-s``), which also keeps the CPU use moderate.

After ``--minutes`` the agent is stopped (SIGTERM). Every ``detection`` event raised before the
stop is printed with its evidence summary; the acceptance is "detections: 0".
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_plain.py"


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    spec = importlib.util.spec_from_file_location("train_plain", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(example.TinyGPT(args.dim, args.layers, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt = Path(args.ckpt_dir) / "latest.pt"
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    step = 0
    while True:
        time.sleep(args.data_s)  # waiting for the input pipeline
        x, y = example.batch(step, rank, args.batch_size)
        loss = F.cross_entropy(model(x).reshape(-1, example.VOCAB), y.reshape(-1))
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        step += 1
        value = loss.item()
        if step % args.eval_every == 0:
            began = time.monotonic()
            total, batches = 0.0, 0
            with torch.no_grad():
                while time.monotonic() - began < args.eval_s:
                    ex, ey = example.batch(10**6 + batches, rank, args.batch_size)
                    out = model.module(ex).reshape(-1, example.VOCAB)
                    total += F.cross_entropy(out, ey.reshape(-1)).item()
                    batches += 1
            mean = torch.tensor([total / max(batches, 1)])
            dist.all_reduce(mean)
            if rank == 0:
                print(f"step {step} eval loss {mean.item() / dist.get_world_size():.4f}",
                      flush=True)
        if rank == 0 and step % args.ckpt_every == 0:
            example.save_checkpoint(ckpt, step, model.module, optim)
            print(f"step {step} loss {value:.4f} saved", flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--nodes", type=int, default=1,
                        help="agents on this host acting as nodes (c10d rendezvous on loopback)")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--ckpt-every", type=int, default=50)
    parser.add_argument("--eval-every", type=int, default=400)
    parser.add_argument("--eval-s", type=float, default=5.0)
    parser.add_argument("--data-s", type=float, default=0.03)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ckpt-dir", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0

    from elasticft.events import read_events

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        log = Path(tmp) / "out.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICFT_", "PET_"))}
        port = free_port()
        script = [str(Path(__file__).resolve()), "--worker",
               "--ckpt-dir", str(Path(tmp) / "ckpt"), "--dim", str(args.dim),
               "--layers", str(args.layers), "--batch-size", str(args.batch_size),
               "--ckpt-every", str(args.ckpt_every), "--eval-every", str(args.eval_every),
               "--eval-s", str(args.eval_s), "--data-s", str(args.data_s)]
        started = time.time()
        procs = []
        with open(log, "wb") as out:
            for node in range(args.nodes):
                where = (["--standalone"] if args.nodes == 1 else
                         ["--nnodes", str(args.nodes), "--rdzv-backend", "c10d",
                          "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "soak",
                          "--local-addr", "127.0.0.1", "--node-id", f"node{node}"])
                cmd = [str(Path(sys.executable).parent / "elasticft-run"), *where,
                       "--nproc-per-node", str(args.nproc), "--max-restarts", "0",
                       "--run-dir", str(run_dir), *script]
                procs.append(subprocess.Popen(cmd, env=env, stdout=out,
                                              stderr=subprocess.STDOUT))
        try:
            procs[0].wait(timeout=args.minutes * 60)
            print(f"the run ended early (exit {procs[0].returncode}); log tail:\n"
                  f"{log.read_text()[-3000:]}")
            return 1
        except subprocess.TimeoutExpired:
            stopped = time.time()
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
            for proc in procs:
                proc.wait(timeout=120)
        events = read_events(run_dir)
        text = log.read_text(errors="replace")
    detections = [e for e in events if e["kind"] == "detection" and e["time"] < stopped]
    preflight = [e for e in events if e["kind"] == "preflight"]
    steps = [int(line.split()[1]) for line in text.splitlines()
             if line.startswith("step ") and "saved" in line]
    evals = sum(1 for line in text.splitlines() if " eval loss " in line)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}, "
          f"Python {platform.python_version()}; date {datetime.date.today()}")
    print(f"run: {args.nodes} elasticft-run agent(s) as nodes x --nproc-per-node {args.nproc}, "
          f"diagnostics on "
          f"default settings; TinyGPT dim {args.dim}, {args.layers} layers, batch "
          f"{args.batch_size}; {args.data_s * 1e3:.0f} ms input wait per step")
    print(f"duration: {(stopped - started) / 60:.1f} min; steps: {max(steps, default=0)}; "
          f"checkpoint saves: {len(steps)} (every {args.ckpt_every} steps); evaluation pauses: "
          f"{evals} ({args.eval_s:g} s every {args.eval_every} steps)")
    print(f"preflight: {'ok' if preflight and preflight[0]['ok'] else preflight}")
    print(f"detections: {len(detections)}")
    for e in detections:
        print(f"  {time.strftime('%H:%M:%S', time.localtime(e['time']))} {e['detector']}: "
              f"{e['message']}")
    return 0 if not detections else 2


if __name__ == "__main__":
    sys.exit(main())
