"""Data x tensor parallel training that follows the layout elasticft chooses for each round.

Runs on CPU with gloo: a tiny MLP language model whose blocks are split with
``torch.distributed.tensor.parallel`` (column-wise up-projection, row-wise down-projection) over
the TP dimension of a device mesh; gradients are averaged over the DP dimension. The layout
(TP, DP, gradient accumulation) comes from ``elasticft.layout()``, so after a node is lost the
job restarts in the layout planned for the nodes that remain. The global batch is the same in
every layout (DP x accumulation x micro-batch), and the data of step k depends only on k, so
the loss curve does not depend on the layout.

Checkpoints are torch.distributed.checkpoint (DCP) directories saved from the DTensor state of
model and optimizer (``get_state_dict``); on restart they are loaded into whatever mesh the new
layout gives, which reshards them, optimizer state included.

    elasticft-run --standalone --nproc-per-node 4 --layout 2,1,* \\
        examples/train_3d.py --steps 20 --ckpt-dir /tmp/ckpt --loss-log /tmp/loss.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import elasticft

COMMITTED = "COMMITTED"


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def global_batch(step: int, args: argparse.Namespace) -> torch.Tensor:
    """The step's samples: sequences of x -> (3x + 1) mod vocab from random starts."""
    gen = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(args.vocab, (args.global_batch, 1), generator=gen)
    seq = [start]
    for _ in range(args.seq_len):
        seq.append((3 * seq[-1] + 1) % args.vocab)
    return torch.cat(seq, dim=1)


def latest_checkpoint(ckpt_dir: Path) -> tuple[int, Path] | None:
    done = sorted(p.parent for p in ckpt_dir.glob(f"step_*/{COMMITTED}"))
    if not done:
        return None
    return int(done[-1].name.removeprefix("step_")), done[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--ckpt-dir", type=Path, required=True)
    parser.add_argument("--ckpt-every", type=int, default=1)
    parser.add_argument("--loss-log", type=Path)
    parser.add_argument("--step-sleep", type=float, default=0.0,
                        help="seconds to sleep per step (gives tests time to inject faults)")
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = elasticft.layout()
    if layout.gpus_used != world or layout.pp != 1:
        raise SystemExit(
            f"train_3d runs TPxDP layouts over all ranks; got {layout.describe()} on {world} "
            "ranks (pin --layout *,1,* and a batch that DP can fill)"
        )
    mesh = init_device_mesh("cpu", (layout.dp, layout.tp), mesh_dim_names=("dp", "tp"))
    tp_mesh, dp_group = mesh["tp"], mesh["dp"].get_group()
    dp_index = mesh["dp"].get_local_rank()
    micro_batch = args.global_batch // (layout.dp * layout.grad_accum)
    if micro_batch * layout.dp * layout.grad_accum != args.global_batch:
        raise SystemExit(f"global batch {args.global_batch} does not split as {layout.describe()}")

    torch.manual_seed(0)  # same full weights on every rank and in every layout
    model = TinyLM(args.vocab, args.hidden, args.layers)
    plan = {}
    for i in range(args.layers):
        plan[f"blocks.{i}.up"] = ColwiseParallel()
        plan[f"blocks.{i}.down"] = RowwiseParallel()
    parallelize_module(model, tp_mesh, plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=False)

    start = 0
    found = latest_checkpoint(args.ckpt_dir)
    if found is not None:
        start, path = found
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        if rank == 0:
            print(f"resumed from step {start} in layout {layout.describe()}", flush=True)

    loss_fn = nn.CrossEntropyLoss()
    for step in range(start, args.steps):
        data = global_batch(step, args)
        per_replica = micro_batch * layout.grad_accum
        mine = data[dp_index * per_replica:(dp_index + 1) * per_replica]
        optimizer.zero_grad()
        loss_sum = torch.zeros(())
        for j in range(layout.grad_accum):
            chunk = mine[j * micro_batch:(j + 1) * micro_batch]
            logits = model(chunk[:, :-1])
            loss = loss_fn(logits.reshape(-1, args.vocab), chunk[:, 1:].reshape(-1))
            (loss / layout.grad_accum).backward()
            loss_sum += loss.detach()
        if layout.dp > 1:
            for p in model.parameters():
                grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                dist.all_reduce(grad, group=dp_group)
                grad.div_(layout.dp)
            dist.all_reduce(loss_sum, group=dp_group)
        optimizer.step()
        mean_loss = loss_sum.item() / (layout.dp * layout.grad_accum)
        done = step + 1
        if rank == 0 and args.loss_log is not None:
            with args.loss_log.open("a") as f:
                f.write(json.dumps({
                    "step": done, "loss": mean_loss, "tp": layout.tp, "dp": layout.dp,
                    "grad_accum": layout.grad_accum, "round": os.environ.get("ELASTICFT_ROUND"),
                }) + "\n")
        if done % args.ckpt_every == 0 or done == args.steps:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            path = args.ckpt_dir / f"step_{done:06d}"
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
            dist.barrier()
            if rank == 0:
                (path / COMMITTED).write_text(json.dumps({"step": done}))
        if args.step_sleep:
            time.sleep(args.step_sleep)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
