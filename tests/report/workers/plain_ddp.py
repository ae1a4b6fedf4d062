"""A plain DDP script: no elasticft import, no step records of its own.

Trains a small linear model with gloo and Adam (or SGD with --sgd), saves a checkpoint with the
optimizer state every --save-every steps, resumes from it, and with --crash-at-step N SIGKILLs
--crash-rank at step N of the first attempt.
"""

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--save-to", required=True)
parser.add_argument("--save-every", type=int, default=5)
parser.add_argument("--crash-at-step", type=int, default=-1)
parser.add_argument("--crash-rank", type=int, default=1)
parser.add_argument("--step-time", type=float, default=0.05)
parser.add_argument("--sgd", action="store_true")
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
model = DistributedDataParallel(torch.nn.Linear(16, 4))
optim = (torch.optim.SGD(model.parameters(), lr=0.01) if args.sgd
         else torch.optim.Adam(model.parameters(), lr=0.01))
start = 0
if os.path.exists(args.save_to):
    state = torch.load(args.save_to, weights_only=True)
    model.module.load_state_dict(state["model"])
    optim.load_state_dict(state["optim"])
    start = state["step"]
first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
for step in range(start + 1, args.steps + 1):
    if step == args.crash_at_step and rank == args.crash_rank and first_attempt:
        os.kill(os.getpid(), signal.SIGKILL)
    loss = model(torch.randn(8, 16)).square().mean()
    optim.zero_grad()
    loss.backward()
    optim.step()
    time.sleep(args.step_time)
    if rank == 0 and step % args.save_every == 0:
        torch.save({"step": step, "model": model.module.state_dict(),
                    "optim": optim.state_dict()}, args.save_to + ".tmp")
        os.replace(args.save_to + ".tmp", args.save_to)
dist.barrier()
dist.destroy_process_group()
