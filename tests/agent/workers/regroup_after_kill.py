"""A gloo group of the launch's ranks; on the first attempt the last rank SIGKILLs itself once
every rank has printed that the group formed (a barrier after the print: the agent sees the kill
within milliseconds and stops the others, which could otherwise come before rank 0's print). On
the restart rank 0 arrives last, so a rank that reads a stale address of the attempt before
connects to it first. Prints ``grouped <attempt> <rank>``."""

import os
import signal
import time

import torch
import torch.distributed as dist

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if attempt > 0 and rank == 0:
    time.sleep(2.0)
dist.init_process_group("gloo")
dist.all_reduce(torch.ones(1))
print(f"grouped {attempt} {rank}", flush=True)
dist.barrier()
if attempt == 0 and rank == world - 1:
    os.kill(os.getpid(), signal.SIGKILL)
if attempt == 0:
    time.sleep(1.0)
dist.destroy_process_group()
