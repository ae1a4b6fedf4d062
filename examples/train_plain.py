"""A plain torchrun training script: no elasticft import.

A small GPT-like language model trained on CPU with gloo and DDP on synthetic data that depends
only on the step number, so a resumed run sees exactly the batches an uninterrupted one would.
Rank 0 writes a torch.save checkpoint every --ckpt-every steps (temporary file, fsync, rename)
and every rank resumes from the newest one at start. Run it with torchrun or elasticft-run:

    torchrun --standalone --nproc-per-node 2 examples/train_plain.py --steps 40
    elasticft-run --standalone --nproc-per-node 2 --max-restarts 3 examples/train_plain.py

--user-error-at-step injects a bug (a ZeroDivisionError in user code) on --fault-rank, for tests
and demos of the failure policy.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

VOCAB, SEQ = 64, 32


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, dim: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.zeros(SEQ, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)
        self.register_buffer("mask", torch.triu(torch.full((SEQ, SEQ), float("-inf")), 1))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos
        for block in self.blocks:
            x = block(x, self.mask)
        return self.head(self.ln(x))


def batch(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic per (step, rank): a noisy repeating pattern the model can learn."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(0, VOCAB, (size, 1), generator=g)
    seq = (start + torch.arange(SEQ + 1) * 3) % VOCAB
    noise = torch.rand(seq.shape, generator=g) < 0.1
    seq = torch.where(noise, torch.randint(0, VOCAB, seq.shape, generator=g), seq)
    return seq[:, :-1], seq[:, 1:]


def save_checkpoint(path: Path, step: int, model: nn.Module, optim: torch.optim.Optimizer) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        torch.save({"step": step, "model": model.state_dict(), "optim": optim.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--ckpt-dir", type=Path, default=Path("checkpoints"))
    parser.add_argument("--ckpt-every", type=int, default=5)
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step")
    parser.add_argument("--loss-log", type=Path, help="rank 0 appends 'step loss' lines here")
    parser.add_argument("--user-error-at-step", type=int, default=-1)
    parser.add_argument("--fault-rank", type=int, default=0)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(TinyGPT())
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)

    args.ckpt_dir.mkdir(parents=True, exist_ok=True)
    ckpt = args.ckpt_dir / "latest.pt"
    start = 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        model.module.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        start = state["step"]
        if rank == 0:
            print(f"resumed from step {start}", flush=True)

    for step in range(start, args.steps):
        if step == args.user_error_at_step and rank == args.fault_rank:
            steps_per_epoch = 0
            _ = step / steps_per_epoch  # the injected bug
        x, y = batch(step, rank, args.batch_size)
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        done = step + 1
        if args.step_time:
            time.sleep(args.step_time)
        if rank == 0:
            value = loss.item()
            print(f"step {done} loss {value:.4f}", flush=True)
            if args.loss_log:
                with open(args.loss_log, "a") as f:
                    f.write(f"{done} {value:.6f}\n")
            if done % args.ckpt_every == 0 or done == args.steps:
                save_checkpoint(ckpt, done, model.module, optim)
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"loss is {loss.item()} at step {done}")
    dist.barrier()
    if rank == 0:
        print(f"finished {args.steps} steps on {world} workers", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
