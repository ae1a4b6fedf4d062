"""Data x tensor parallel training that follows the layout elasticft chooses for each round.

Runs on CPU with gloo: a tiny MLP language model whose blocks are split with
``torch.distributed.tensor.parallel`` (column-wise up-projection, row-wise down-projection) over
the TP dimension of a device mesh; gradients are averaged over the DP dimension. The layout
(TP, DP, gradient accumulation) comes from ``elasticft.layout()``, so after a node is lost the
job restarts in the layout planned for the nodes that remain. The global batch is the same in
every layout (DP x accumulation x micro-batch), and the data of step k depends only on k, so
the loss curve does not depend on the layout.

With ``--fsdp`` the model is sharded over the DP dimension with FSDP2 (``fully_shard`` on each
block and on the root, outside the tensor parallelism), which then reduce-scatters the
gradients itself.

Checkpoints are torch.distributed.checkpoint (DCP) directories saved from the DTensor state of
model and optimizer (``get_state_dict``); on restart they are loaded into whatever mesh the new
layout gives, which reshards them, optimizer state included.

    elasticft-run --standalone --nproc-per-node 4 --layout 2,1,* \\
        examples/train_3d.py --steps 20 --ckpt-dir /tmp/ckpt --loss-log /tmp/loss.jsonl

With ``--inprocess`` the job recovers in process instead (``InProcess``, snapshots of every step
in the agent's memory): when a rank fails, the others keep their processes, their modules, local
shards and optimizer state; the mesh's groups are made again for the new generation and a
replacement takes the failed rank (``--crash-at-step N`` SIGKILLs ``--fault-rank`` once step N
is saved, in the first attempt).

    elasticft-run --standalone --nproc-per-node 4 --layout 2,1,* --max-restarts 3 \\
        examples/train_3d.py --fsdp --inprocess --crash-at-step 6
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

import elasticft
from elasticft.plan.api import Layout

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


def build(args: argparse.Namespace, layout: Layout) -> tuple[nn.Module, Any, Any]:
    """The model on this round's mesh: tensor parallel over ``tp`` (no collective: every rank
    builds the same full weights and keeps its own slice, ``src_data_rank=None``), and with
    ``--fsdp`` FSDP2 over ``dp`` outside it. Returns the model, its optimizer and the mesh."""
    mesh = init_device_mesh("cpu", (layout.dp, layout.tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)  # same full weights on every rank and in every layout
    model = TinyLM(args.vocab, args.hidden, args.layers)
    if layout.tp > 1:
        plan: dict[str, ParallelStyle] = {}
        for i in range(args.layers):
            plan[f"blocks.{i}.up"] = ColwiseParallel()
            plan[f"blocks.{i}.down"] = RowwiseParallel()
        parallelize_module(model, mesh["tp"], plan, src_data_rank=None)
    if args.fsdp:
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    if args.loss_mesh:  # as torchtitan averages its loss: over every rank, one flattened group
        mesh["dp", "tp"]._flatten("loss")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=False)
    return model, optimizer, mesh


def train_step(step: int, model: nn.Module, optimizer: Any, mesh: Any,
               layout: Layout, args: argparse.Namespace) -> float:
    """One optimizer step over the global batch of ``step``; returns its mean loss. The data
    parallel groups are looked up on every step (a mesh resolves them by name, so after an
    in-process recovery they are the new generation's)."""
    dp_group, dp_index = mesh["dp"].get_group(), mesh["dp"].get_local_rank()
    micro_batch = args.global_batch // (layout.dp * layout.grad_accum)
    data = global_batch(step, args)
    per_replica = micro_batch * layout.grad_accum
    mine = data[dp_index * per_replica:(dp_index + 1) * per_replica]
    optimizer.zero_grad()
    loss_sum = torch.zeros(())
    for j in range(layout.grad_accum):
        chunk = mine[j * micro_batch:(j + 1) * micro_batch]
        logits = model(chunk[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, args.vocab),
                                           chunk[:, 1:].reshape(-1))
        (loss / layout.grad_accum).backward()
        loss_sum += loss.detach()
    if layout.dp > 1:
        if not args.fsdp:  # FSDP2 reduce-scatters the gradients itself
            for p in model.parameters():
                grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                dist.all_reduce(grad, group=dp_group)
                grad.div_(layout.dp)
        if not args.loss_mesh:
            dist.all_reduce(loss_sum, group=dp_group)
    optimizer.step()
    if args.loss_mesh:  # every tp rank holds its replica's loss: the mean over all is the same
        dist.all_reduce(loss_sum, group=mesh["loss"].get_group())
        return loss_sum.item() / (layout.dp * layout.tp * layout.grad_accum)
    return loss_sum.item() / (layout.dp * layout.grad_accum)


def log_loss(args: argparse.Namespace, layout: Layout, done: int,
             loss: float) -> None:
    if dist.get_rank() == 0 and args.loss_log is not None:
        with args.loss_log.open("a") as f:
            f.write(json.dumps({
                "step": done, "loss": loss, "tp": layout.tp, "dp": layout.dp,
                "grad_accum": layout.grad_accum, "round": os.environ.get("ELASTICFT_ROUND"),
            }) + "\n")
    if args.pid_log is not None:
        with args.pid_log.open("a") as f:
            f.write(f"{dist.get_rank()} {os.getpid()} {done}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--ckpt-dir", type=Path,
                        help="where DCP checkpoints go (required without --inprocess)")
    parser.add_argument("--ckpt-every", type=int, default=1)
    parser.add_argument("--loss-log", type=Path)
    parser.add_argument("--pid-log", type=Path, help="every rank appends 'rank pid step' here")
    parser.add_argument("--step-sleep", type=float, default=0.0,
                        help="seconds to sleep per step (gives tests time to inject faults)")
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--fsdp", action="store_true",
                        help="shard over DP with FSDP2 (fully_shard) instead of replicating")
    parser.add_argument("--loss-mesh", action="store_true",
                        help="average the loss over a flattened (dp, tp) mesh, as torchtitan does")
    parser.add_argument("--inprocess", action="store_true",
                        help="recover in process (InProcess) with memory snapshots every step")
    parser.add_argument("--crash-at-step", type=int, default=-1,
                        help="--fault-rank SIGKILLs itself once step N is saved (first attempt)")
    parser.add_argument("--fault-rank", type=int, default=1)
    args = parser.parse_args()
    if not args.inprocess and args.ckpt_dir is None:
        parser.error("--ckpt-dir is required without --inprocess")

    dist.init_process_group("gloo")  # no collective from here to InProcess().run
    world = dist.get_world_size()
    layout = elasticft.layout()
    if layout.gpus_used != world or layout.pp != 1:
        raise SystemExit(
            f"train_3d runs TPxDP layouts over all ranks; got {layout.describe()} on {world} "
            "ranks (pin --layout *,1,* and a batch that DP can fill)"
        )
    if args.global_batch % (layout.dp * layout.grad_accum):
        raise SystemExit(f"global batch {args.global_batch} does not split as {layout.describe()}")
    model, optimizer, mesh = build(args, layout)
    if args.inprocess:
        train_in_process(args, layout, model, optimizer, mesh)
    else:
        train_with_dcp(args, layout, model, optimizer, mesh)
    dist.barrier()
    dist.destroy_process_group()


def train_in_process(args: argparse.Namespace, layout: Layout, model: nn.Module,
                     optimizer: Any, mesh: Any) -> None:
    """Snapshots of every step in the agent's memory; a failed peer costs the others a roll
    back in place (the model, its shards and the optimizer state stay; the mesh's groups are
    made again for the new generation, since ``model`` is given to ``InProcess``)."""
    from elasticft.ckpt import Checkpointer, StateCapture
    from elasticft.inprocess import InProcess

    ckpt = Checkpointer.from_env(optimizers=[optimizer])
    snapshot = StateCapture(model, optimizer)
    armed = {"fault": os.environ.get("ELASTICFT_ATTEMPT", "0") == "0"
             and dist.get_rank() == args.fault_rank}

    def train() -> None:
        # The layout of this entry: after a shrink or a growth in process the survivors keep
        # their modules (the mesh took the new shape) and go on in the new layout.
        now = elasticft.layout()
        start = 0
        # In place, into the live shards; a rank that a growth brought, holding nothing, heals
        # from its data-parallel replica's memory (replicated state only: not under FSDP2).
        restored = ckpt.restore(model, optimizer,
                                replicas=None if args.fsdp else mesh["dp"].get_group())
        if restored is not None:
            start = restored[0]
            if dist.get_rank() == 0:
                print(f"resumed from step {start} (source={ckpt.last_source}) in "
                      f"{now.describe()}", flush=True)
        for step in range(start, args.steps):
            done = step + 1
            log_loss(args, now, done, train_step(step, model, optimizer, mesh, now, args))
            request = ckpt.save(done, snapshot(extra={"step": done}))
            if armed["fault"] and done == args.crash_at_step:
                request.wait()
                time.sleep(1.0)  # the others wait in the next step's first collective
                os.kill(os.getpid(), signal.SIGKILL)
            if args.step_sleep:
                time.sleep(args.step_sleep)

    recovery = InProcess(modules=[model], follows_layout=True)
    recovery.run(train)
    ckpt.close()
    if dist.get_rank() == 0:
        print(f"finished {args.steps} steps; {recovery.recoveries} in-process recoveries in "
              "this process", flush=True)


def train_with_dcp(args: argparse.Namespace, layout: Layout, model: nn.Module,
                   optimizer: Any, mesh: Any) -> None:
    """DCP checkpoints every ``--ckpt-every`` steps; a restart loads the newest into whatever
    mesh its layout gives."""
    rank = dist.get_rank()
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
    for step in range(start, args.steps):
        done = step + 1
        log_loss(args, layout, done, train_step(step, model, optimizer, mesh, layout, args))
        if done % args.ckpt_every == 0 or done == args.steps:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            path = args.ckpt_dir / f"step_{done:06d}"
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
            dist.barrier()
            if rank == 0:
                (path / COMMITTED).write_text(json.dumps({"step": done}))
        if args.step_sleep:
            time.sleep(args.step_sleep)


if __name__ == "__main__":
    main()
