"""Worker whose rank 1 loses a connection right after joining the group, at every attempt: a
communication fault that repeats identically before the first step."""

import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    raise ConnectionResetError("connection reset by peer while loading shard 3")
dist.barrier()
