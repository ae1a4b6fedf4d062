"""A DDP training job on gloo with a memory snapshot every step, for the SIGKILL-at-any-moment
test.

It waits for ``GO`` (argv[1]) before importing torch: workers started, their rings not yet
opened. Then it trains ``STEPS`` (argv[2]) steps, saving each (``Checkpointer.from_env``),
printing ``rank R step S`` to stderr once step S is in shared memory, and prints
``rank R last line`` as it ends.
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

from elasticft.ckpt import Checkpointer, StateCapture  # noqa: E402

rank = int(os.environ["RANK"])
torch.set_num_threads(1)
dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 16))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
checkpointer = Checkpointer.from_env(optimizers=[optimizer])
capture = StateCapture(model, optimizer)
for step in range(1, steps + 1):
    optimizer.zero_grad()
    model(torch.randn(8, 16)).pow(2).mean().backward()
    optimizer.step()
    checkpointer.save(step, capture()).wait(30)
    print(f"rank {rank} step {step}", file=sys.stderr, flush=True)
    time.sleep(0.02)
checkpointer.close()
dist.destroy_process_group()
print(f"rank {rank} last line", file=sys.stderr, flush=True)
