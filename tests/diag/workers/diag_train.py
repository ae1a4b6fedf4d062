"""A small DDP training loop on gloo for the diagnostics tests (not an elasticft example).

Resumes from ``--state`` (the step count, written by rank 0), so a restarted group finishes the
remaining steps. ``--marker-at`` writes ``<run_dir>/marker`` when rank 0 reaches that step, so a
test knows the group is in steady state before it injects a fault.
"""

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--state", type=Path, required=True)
    parser.add_argument("--step-sleep", type=float, default=0.05)
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow-sleep", type=float, default=0.0)
    parser.add_argument("--nan-at-step", type=int, default=-1)
    parser.add_argument("--marker-at", type=int, default=-1)
    parser.add_argument("--marker", type=Path)
    parser.add_argument("--use-init", action="store_true")
    parser.add_argument("--first-step-sleep", type=float, default=0.0,
                        help="rank 0 sleeps this long before its first step (slow data)")
    parser.add_argument("--busy-at", type=int, default=-1,
                        help="at this step rank 0 computes outside collectives (evaluation)")
    parser.add_argument("--busy-s", type=float, default=0.0)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)))
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    diag = None
    if args.use_init:
        import elasticft

        diag = elasticft.init(model=model)
    start = int(args.state.read_text()) if args.state.exists() else 0
    for step in range(start, args.steps):
        x = torch.randn(16, 64)
        if rank == 0 and step == start and start == 0:
            time.sleep(args.first_step_sleep)
        if rank == 0 and step == args.busy_at:
            until = time.monotonic() + args.busy_s
            while time.monotonic() < until:
                sum(i * i for i in range(10_000))
        if rank == args.slow_rank:
            time.sleep(args.slow_sleep)
        time.sleep(args.step_sleep)
        loss = model(x).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        value = float("nan") if step == args.nan_at_step else loss.item()
        if diag is not None:
            diag.report_loss(value)
        if rank == 0:
            tmp = args.state.with_suffix(".tmp")
            tmp.write_text(str(step + 1))
            os.replace(tmp, args.state)
            if step + 1 == args.marker_at and args.marker:
                args.marker.write_text(str(os.getpid()))
    dist.barrier()
    if rank == 0:
        print(f"finished {args.steps} steps", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
