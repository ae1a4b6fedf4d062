"""Long pauses that are not hangs, under elasticft-run with default options.

Each scenario trains 2 gloo workers (DDP) and injects a long legitimate pause; the run must end
without any hang detection or restart. It prints, per scenario, the pause, the wall time, the
hang detections, the restarts and the "not a hang" verdicts the agent reported (with who the
others waited for):

* ``save``: rank 0 spends ``--long`` seconds in torch.save-like work (CPU) while rank 1 waits in
  a barrier;
* ``first-step``: rank 0's first step takes ``--long`` seconds (compile, slow data);
* ``loader``: rank 0's data loader stalls ``--stall`` seconds (sleeping, no CPU);
* ``soak``: ``--soak-minutes`` of steady training.

    .venv/bin/python bench/hang.py                          # about 4 minutes + the soak
    .venv/bin/python bench/hang.py --scenarios save,loader --soak-minutes 0
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from jobenv import clean_job_env  # bench/, beside this script

from elasticft.events import read_events

BIN = Path(sys.executable).parent

WORKER = textwrap.dedent('''
    import sys, time
    import torch, torch.distributed as dist, torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel
    scenario, pause, steps = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DistributedDataParallel(nn.Linear(64, 1))
    optim = torch.optim.SGD(model.parameters(), lr=0.01)

    def spin(seconds):
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            sum(i * i for i in range(10_000))

    for step in range(steps):
        if rank == 0 and step == 0 and scenario == "first-step":
            spin(pause)
        if rank == 0 and step == 20 and scenario == "loader":
            time.sleep(pause)
        time.sleep(0.05)
        model(torch.randn(8, 64)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
        if step == 20 and scenario == "save":
            if rank == 0:
                spin(pause)
            dist.barrier()
    dist.barrier()
    dist.destroy_process_group()
''')


def run(scenario: str, pause: float, steps: int, work: Path, env: dict[str, str]) -> str:
    script = work / "worker.py"
    script.write_text(WORKER)
    run_dir = work / scenario
    started = time.monotonic()
    proc = subprocess.run(
        [str(BIN / "elasticft-run"), "--standalone", "--nproc-per-node", "2",
         "--max-restarts", "3", "--run-dir", str(run_dir), str(script), scenario, str(pause),
         str(steps)], env=env, cwd=work, capture_output=True, text=True)
    wall = time.monotonic() - started
    events = read_events(run_dir)
    detections = [e for e in events if e["kind"] == "detection"]
    hangs = [e for e in detections if e["detector"] == "hang"]
    restarts = [e for e in events if e["kind"] == "restart"]
    waits = [e for e in detections if e["detector"] == "hang_verdict"]
    line = (f"{scenario:11} pause {pause:5.0f} s  wall {wall:6.1f} s  exit {proc.returncode}  "
            f"hangs {len(hangs)}  restarts {len(restarts)}  not-a-hang reports {len(waits)}")
    for event in [*hangs, *waits][:3]:
        line += f"\n    {event['detector']}: {event['message'][:300]}"
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default="save,first-step,loader,soak")
    parser.add_argument("--long", type=float, default=60.0)
    parser.add_argument("--stall", type=float, default=30.0)
    parser.add_argument("--soak-minutes", type=float, default=10.0)
    args = parser.parse_args()
    env = clean_job_env()
    work = Path(tempfile.mkdtemp(prefix="elasticft-hang-bench-"))
    print(f"# hang bench  {time.strftime('%Y-%m-%d %H:%M')}  {platform.node()}  "
          f"{os.cpu_count()} cores  python {platform.python_version()}  default options")
    for scenario in [s for s in args.scenarios.split(",") if s]:
        if scenario == "soak":
            if args.soak_minutes <= 0:
                continue
            # ~0.06 s per step on 2 cores: steps for the requested minutes.
            print(run("soak", 0.0, int(args.soak_minutes * 60 / 0.06), work, env), flush=True)
        else:
            pause = args.stall if scenario == "loader" else args.long
            print(run(scenario, pause, 60, work, env), flush=True)


if __name__ == "__main__":
    main()
