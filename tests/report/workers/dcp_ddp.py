"""A plain DDP script that checkpoints the way torchtitan and most FSDP2 scripts do: no
elasticft import, no step records of its own.

Saves with ``get_state_dict`` + ``dcp.save`` every --save-every steps, and at start restores
the newest one with ``get_state_dict`` (which steps a fresh optimizer once on zero gradients to
give it state), ``dcp.load`` and ``set_state_dict``. With --kill-after-step N, --kill-rank
SIGKILLs itself after step N of the first attempt.
"""

import argparse
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--save-to", type=Path, required=True)
parser.add_argument("--save-every", type=int, default=5)
parser.add_argument("--kill-after-step", type=int, default=-1)
parser.add_argument("--kill-rank", type=int, default=1)
parser.add_argument("--step-time", type=float, default=0.05)
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
model = DistributedDataParallel(torch.nn.Linear(16, 4))
optim = torch.optim.AdamW(model.parameters(), lr=0.01)
start = 0
latest = args.save_to / "latest"
if latest.exists():
    start = int(latest.read_text())
    model_state, optim_state = get_state_dict(model, optim)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=args.save_to / f"step{start}")
    set_state_dict(model, optim, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
for step in range(start + 1, args.steps + 1):
    loss = model(torch.randn(8, 16)).square().mean()
    optim.zero_grad()
    loss.backward()
    optim.step()
    time.sleep(args.step_time)
    if step == args.kill_after_step and rank == args.kill_rank and first_attempt:
        os.kill(os.getpid(), signal.SIGKILL)
    if step % args.save_every == 0:
        model_state, optim_state = get_state_dict(model, optim)
        dcp.save({"model": model_state, "optim": optim_state},
                 checkpoint_id=args.save_to / f"step{step}")
        if rank == 0:
            (args.save_to / "latest.tmp").write_text(str(step))
            os.replace(args.save_to / "latest.tmp", latest)
dist.barrier()
dist.destroy_process_group()
