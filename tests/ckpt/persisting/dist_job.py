"""A gloo job (env:// ranks) for the resharding test: ``save DIR`` on one world size,
``load DIR`` on another.

save: DDP model + AdamW (each replica stored once) + a DTensor sharded over all ranks,
checkpointed by a process-owned Checkpointer that persists every step. load: ``dcp.load`` (no
elasticft) into the same model and a DTensor sharded over the new world; writes what it found
to DIR/load-<rank>.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

from elasticft.ckpt import Checkpointer, capture
from elasticft.ckpt.persisting import durable


def build(world: int):
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Linear(12, 3))
    model = DistributedDataParallel(layers)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    mesh = init_device_mesh("cpu", (world,))
    table = distribute_tensor(torch.arange(60.0).reshape(10, 6), mesh, [Shard(0)])
    return model, optim, table


def main() -> None:
    mode, root = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optim, table = build(world)
    if mode == "save":
        ckpt = Checkpointer.from_env(optimizers=[optim], ckpt_dir=root, persist_every=1,
                                     dedup_replicas=True)  # DDP state stored once
        for step in (1, 2):
            model(torch.ones(4, 6)).sum().backward()
            optim.step()
            optim.zero_grad()
            with torch.no_grad():
                table.add_(1.0)   # 1..60 + step
            state = capture(model, optim, {"step": step}, rng=False)
            state["table"] = table
            ckpt.save(step, state).wait(60)
        # Every rank waits for step 2's commit before its close(), which would end a persist
        # still under way (a loaded machine: a rank closed before its part of step 2 was on disk).
        deadline = time.monotonic() + 120
        while 2 not in durable.committed_steps(root):
            assert time.monotonic() < deadline, f"rank {rank}: step 2 not committed in 120 s"
            time.sleep(0.05)
        if rank == 0:
            torch.save({k: v for k, v in model.module.state_dict().items()}, root / "expected.pt")
        ckpt.close()
    else:
        model_sd, optim_sd = get_state_dict(model, optim)
        state = {"model": model_sd, "optim": optim_sd, "table": table, "extra": {"step": -1}}
        dcp.load(state, checkpoint_id=str(durable.step_dir(root, 2)))
        expected = torch.load(root / "expected.pt", weights_only=True)
        result = {
            "step": state["extra"]["step"],
            "model_equal": all(torch.equal(model_sd[k], v) for k, v in expected.items()),
            "exp_avg_nonzero": bool(optim_sd["state"]["0.weight"]["exp_avg"].abs().sum() > 0),
            "local_rows": table.to_local()[:, 0].tolist(),
            "full_table_ok": bool(torch.equal(table.full_tensor(),
                                              torch.arange(60.0).reshape(10, 6) + 2)),
        }
        (root / f"load-{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    # What the test checks is written and the group is gone; leave without the interpreter's
    # finalization, where a gloo worker thread still holding a finished work's tensors can
    # abort the process (std::terminate, SIGABRT) in torch 2.13 once in a few runs.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
