"""A DDP training job on gloo that uses no checkpoint API, for the SIGKILL-at-any-moment test.

It waits for ``GO`` (argv[1]) before importing torch: workers started, their rings not yet
opened. Then it trains ``STEPS`` (argv[2]) steps, printing ``rank R step S`` to stderr, and
prints ``rank R last line`` as it ends.
"""

import os
import sys
import time
from pathlib import Path

go, steps = Path(sys.argv[1]), int(sys.argv[2])
while not go.exists():
    time.sleep(0.05)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

rank = int(os.environ["RANK"])
torch.set_num_threads(1)
dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 16))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(1, steps + 1):
    optimizer.zero_grad()
    model(torch.randn(8, 16)).pow(2).mean().backward()
    optimizer.step()
    print(f"rank {rank} step {step}", file=sys.stderr, flush=True)
    time.sleep(0.02)
dist.destroy_process_group()
print(f"rank {rank} last line", file=sys.stderr, flush=True)
