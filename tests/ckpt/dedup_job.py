"""Two gloo ranks of DDP + AdamW whose checkpoints store each replicated tensor once.

``python dedup_job.py MODE RANK INIT_FILE SHM_TOKEN OWNER_PID DIR``

* ``train``: 3 steps with a deduplicated snapshot after each (the last persisted to DIR/ckpt), then
  writes the state after step 3 to DIR/expected.pt; rank 1 then SIGKILLs itself.
* ``restore``: a new model (other seed) restores in place; writes what it found to
  DIR/restore-<rank>.pt and DIR/restore-<rank>.json.
* ``load``: :meth:`Checkpointer.load` (not in place) of the newest step, into DIR/load-<rank>.pt
  and DIR/load-<rank>.json.
* ``restore+load``: both, one after the other in the same processes (a new model and
  checkpointer each), so one launch reads shared memory both ways.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elasticft.ckpt import Checkpointer, StateCapture, WorkerSettings
from elasticft.ckpt.memory.shm import segment_prefix
from elasticft.ckpt.persisting import durable

STEPS = 3


def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    layers = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32),
                                 torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
    model = DistributedDataParallel(layers)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def full_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict:
    return {"model": {k: v.clone() for k, v in model.module.state_dict().items()},
            "optim": {str(i): {k: v.clone() for k, v in s.items()}
                      for i, s in enumerate(optim.state[p] for p in model.parameters())}}


def main() -> None:
    mode, rank, init_file, token, owner = sys.argv[1:6]
    root = Path(sys.argv[6])
    rank_i = int(rank)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank_i, world_size=2)
    settings = WorkerSettings(local_rank=rank_i,
                              shm_slots=segment_prefix(int(owner), token, rank_i),
                              local_dir=root / "ckpt", persist_every=STEPS,
                              owner_pid=int(owner))
    if mode == "train":
        model, optim = build(0)
        ckpt = Checkpointer(settings, optimizers=[optim], dedup_replicas=True)
        snapshot = StateCapture(model, optim)
        for step in range(1, STEPS + 1):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step * 10 + rank_i))
            model(x).pow(2).mean().backward()
            optim.step()
            optim.zero_grad()
            ckpt.save(step, snapshot(extra={"step": step})).wait(60)
        ckpt.close()  # the persister finishes step 3 and rank 0 commits it
        dist.barrier()
        if rank_i == 0:
            torch.save(full_state(model, optim), root / "expected.pt")
        dist.barrier()
        if rank_i == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(0)
    for each in mode.split("+"):
        read_back(each, settings, root, rank)
    dist.destroy_process_group()


def read_back(mode: str, settings: WorkerSettings, root: Path, rank: str) -> None:
    """A new model (another seed) gets the newest step by ``restore`` or ``load``; what it got is
    written to DIR/<mode>-<rank>.pt and .json."""
    model, optim = build(1)
    ckpt = Checkpointer(settings, optimizers=[optim], dedup_replicas=True)
    if mode == "restore":
        step, extra = ckpt.restore(model, optim)
    else:
        step, state = ckpt.load()
        extra = state["extra"]
        model.module.load_state_dict(state["model"])
        optim_sd = {"state": {i: state["optim"]["state"][name]
                              for i, (name, _) in enumerate(model.module.named_parameters())},
                    "param_groups": [dict(optim.state_dict()["param_groups"][0])]}
        optim.load_state_dict(optim_sd)
    torch.save(full_state(model, optim), root / f"{mode}-{rank}.pt")
    committed = sorted(durable.committed_steps(root / "ckpt"))
    (root / f"{mode}-{rank}.json").write_text(json.dumps(
        {"step": step, "extra": extra, "source": ckpt.last_source, "committed": committed}))
    ckpt.close()
    dist.barrier()  # both ranks done with this checkpointer before the next one starts


if __name__ == "__main__":
    main()
