"""Two gloo ranks; rank 1 hits a bug (ZeroDivisionError), prints its traceback, closes its group
and lingers, as a worker does whose exit is slow (large memory to free, threads to join): rank 0,
waiting in a collective, fails first with gloo's "connection closed", and the agent stops rank 1
while it is still on its way out. The bug is the run's cause all the same."""

import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
dist.all_reduce(torch.ones(1))
if rank == 1:
    try:
        steps_per_epoch = 0
        _ = 1 / steps_per_epoch
    except ZeroDivisionError:
        traceback.print_exc()
        sys.stderr.flush()
        dist.destroy_process_group()
        time.sleep(60)
        raise
dist.all_reduce(torch.ones(1))
dist.destroy_process_group()
