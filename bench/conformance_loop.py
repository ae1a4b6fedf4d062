"""A plain DDP training loop as users write one, recovered in process: the worker of
bench/conformance.py and tests/inprocess/test_conformance_loops.py. It imports only
``InProcess``, ``Checkpointer`` and ``StateCapture`` from elasticft; everything else is torch,
numpy and Python as a user's script has it.

The patterns, each a flag, any of them together:

--zero-grad before|after   ``optim.zero_grad(set_to_none=True)`` before the backward, or after
                           ``optim.step()`` (nanoGPT's order)
--accum N                  N micro-batches per step, all but the last under DDP's ``no_sync``
--clip                     ``clip_grad_norm_`` before the step
--warmup                   a ``LambdaLR`` warm-up, its state saved in the checkpoint's extras
--dropout                  an ``nn.Dropout`` (torch's RNG)
--augment                  noise from torch's, numpy's and Python's RNGs added to each input
--loader                   a ``DataLoader`` over a ``DistributedSampler`` that shuffles, with
                           ``set_epoch``, positioned at the restored step by skipping the
                           epoch's first batches; no generator of its own (torch's default: each
                           iterator draws its workers' base seed from torch's RNG); given to
                           ``StateCapture(loaders=...)``
--loader-generator         that ``DataLoader`` with a seeded generator of its own (torch's
                           reproducibility recipe: each iterator draws its seed from it)
--loader-workers N         that ``DataLoader``'s ``num_workers`` (default 0: in the process)
--worker-augment           noise from torch's, numpy's and Python's RNGs added to each sample in
                           the dataset's ``__getitem__``, so in the loader's worker processes
                           (their RNGs seeded from the iterator's base seed); needs
                           --loader-workers (in the process, the skipped batches' draws would
                           come from the training's own RNG: no resume by skipping is exact there)
--autocast                 the forward under CPU autocast to bfloat16
--ema                      an exponential moving average of the weights kept outside the
                           optimizer (``torch.optim.swa_utils.AveragedModel``), saved in the
                           checkpoint's extras; a hash of its parameters is logged too
--compile                  the DDP model under ``torch.compile`` (inductor)
--device cpu|cuda          where the model, the batches, dropout and torch's augmentation are
                           (default cpu): on ``cuda`` they draw from CUDA's RNG, every rank on
                           ``cuda:LOCAL_RANK`` modulo the GPUs there are (one GPU: all on it)
--backend gloo|nccl        the process group's (default gloo; nccl needs a GPU per rank)

The fault, in the first attempt on --fault-rank only: a SIGKILL at --crash-at-step N, where
--crash-mode says: ``after-save`` once the save of step N is complete and the others are in
step N+1's collectives, ``right-after-save`` at once after ``save()`` returns, ``before-save``
before the save (the others redo step N), ``mid-step`` in step N's backward of its last
micro-batch (after the first ones), ``in-optimizer-step`` inside step N's ``optimizer.step()``
(a step pre-hook; the other ranks are held inside theirs, so the recovery interrupts them there),
``twice`` as ``after-save`` and then again in the replacement's first step after the recovery,
mid-backward (a second failure right after the first recovery). Every rank appends
``rank step loss,hash`` (the loss's ``repr``, a hash of the parameters' bytes after the step)
to --loss-log and ``rank pid step`` to --pid-log; the killed rank writes the wall-clock time of
its SIGKILL to --kill-log, if given, just before sending it.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import random
import signal
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from elasticft.ckpt import Checkpointer, StateCapture
from elasticft.inprocess import InProcess

SAMPLES, FEATURES, CLASSES = 128, 16, 4


def digest(tensors: Iterable[torch.Tensor]) -> str:
    """A short hash of the tensors' bytes, in their order."""
    hashed = hashlib.sha1()
    for tensor in tensors:
        hashed.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return hashed.hexdigest()[:16]


class AugmentedSamples(TensorDataset):
    """Samples with noise drawn from torch's, numpy's and Python's RNGs as they are read."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        x, y = super().__getitem__(index)
        noise = 0.1 * torch.randn_like(x) + float(np.random.normal(0.0, 0.1)) + random.random()
        return x + 0.1 * noise, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank, per micro-batch")
    parser.add_argument("--zero-grad", choices=("before", "after"), default="before")
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--clip", action="store_true")
    parser.add_argument("--warmup", action="store_true")
    parser.add_argument("--dropout", action="store_true")
    parser.add_argument("--augment", action="store_true")
    parser.add_argument("--loader", action="store_true")
    parser.add_argument("--loader-generator", action="store_true")
    parser.add_argument("--loader-workers", type=int, default=0)
    parser.add_argument("--worker-augment", action="store_true")
    parser.add_argument("--autocast", action="store_true")
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--crash-at-step", type=int, default=-1)
    parser.add_argument("--crash-mode", default="after-save",
                        choices=("after-save", "right-after-save", "before-save", "mid-step",
                                 "in-optimizer-step", "twice"))
    parser.add_argument("--ema", action="store_true")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--loss-log", type=Path, required=True)
    parser.add_argument("--pid-log", type=Path, required=True)
    parser.add_argument("--kill-log", type=Path, help="the SIGKILL's time.time(), written first")
    args = parser.parse_args()
    if args.worker_augment and not (args.loader and args.loader_workers > 0):
        parser.error("--worker-augment needs --loader and --loader-workers N > 0")

    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend)  # no collective before InProcess().run
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial model on every rank
    net = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(),
                        nn.Dropout(0.3) if args.dropout else nn.Identity(),
                        nn.Linear(32, CLASSES)).to(device)
    optim = torch.optim.AdamW(net.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / 5)) \
        if args.warmup else None
    sched_at_start = sched.state_dict() if sched is not None else None
    ema = torch.optim.swa_utils.AveragedModel(
        net, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)) if args.ema else None
    ema_at_start = {k: v.clone() for k, v in ema.state_dict().items()} if ema is not None \
        else None
    torch.manual_seed(1000 + rank)  # each rank its own dropout and augmentation
    np.random.seed(2000 + rank)
    random.seed(3000 + rank)

    data = torch.Generator().manual_seed(1)
    samples = (torch.randn(SAMPLES, FEATURES, generator=data),
               torch.randint(0, CLASSES, (SAMPLES,), generator=data))
    dataset = AugmentedSamples(*samples) if args.worker_augment else TensorDataset(*samples)
    per_step = args.batch_size * args.accum
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=per_step, sampler=sampler,
                        num_workers=args.loader_workers, drop_last=True,
                        generator=torch.Generator().manual_seed(7) if args.loader_generator
                        else None)
    ckpt = Checkpointer.from_env(optimizers=[optim])
    # The loader too: the iterator made again at the restored step draws its seed where the
    # epoch's first one did, not one draw later.
    snapshot = StateCapture(net, optim, loaders=[loader] if args.loader else ())
    first_attempt = os.environ.get("ELASTICFT_ATTEMPT", "0") == "0"
    armed = first_attempt and rank == args.fault_rank
    crash_at_step, crash_mode = args.crash_at_step, args.crash_mode
    if crash_mode == "twice" and not first_attempt and rank == args.fault_rank:
        # the first replacement only (a marker beside the pid log): killed again in its first
        # step, mid-backward
        with contextlib.suppress(FileExistsError):
            args.pid_log.with_suffix(".second-failure").open("x").close()
            armed, crash_at_step, crash_mode = True, crash_at_step + 1, "mid-step"
    if crash_mode == "twice":
        crash_mode = "after-save"

    def batches(start: int):
        """The batches of steps ``start`` on: the position follows the restored step."""
        if not args.loader:
            for step in range(start, args.steps):
                at = [(step * world * per_step + rank * per_step + i) % SAMPLES
                      for i in range(per_step)]
                x, y = dataset[at]
                yield step, (x.to(device), y.to(device))
            return
        epoch, skip = divmod(start, len(loader))
        step = start
        while step < args.steps:
            sampler.set_epoch(epoch)
            for i, batch in enumerate(loader):
                if i < skip:
                    continue
                x, y = batch
                yield step, (x.to(device), y.to(device))
                step += 1
                if step == args.steps:
                    return
            epoch, skip = epoch + 1, 0

    def augment(x: torch.Tensor) -> torch.Tensor:
        if not args.augment:
            return x
        noise = torch.from_numpy(np.random.normal(0.0, 0.1, x.shape).astype(np.float32)).to(
            x.device)
        return x * (1 + 0.1 * random.random()) + 0.1 * torch.randn_like(x) + noise

    def kill() -> None:
        if args.kill_log is not None:
            args.kill_log.write_text(f"{time.time()!r}\n")
        os.kill(os.getpid(), signal.SIGKILL)

    def in_optimizer_step(optimizer: torch.optim.Optimizer, *_: object) -> None:
        if crash_mode != "in-optimizer-step":
            return
        if armed_step[0]:
            kill()
        if held_step[0] and not held_once[0]:
            held_once[0] = True
            # The recovery interrupts this rank here, inside optimizer.step(): between short
            # sleeps, as an interrupt lands between Python's bytecodes, not inside a C call.
            for _ in range(200):
                time.sleep(0.01)

    armed_step, held_step, held_once = [False], [False], [False]
    optim.register_step_pre_hook(in_optimizer_step)

    def train() -> None:
        ddp = DistributedDataParallel(net)  # bound to this generation's group
        model = torch.compile(ddp) if args.compile else ddp
        restored = ckpt.restore(net, optim)
        start, extra = restored if restored is not None else (
            0, {"sched": sched_at_start, "ema": ema_at_start})
        if sched is not None:
            sched.load_state_dict(extra["sched"])
        if ema is not None:
            ema.load_state_dict(extra["ema"])
        for step, (x, y) in batches(start):
            done = step + 1
            crash_here = armed and done == crash_at_step
            armed_step[0] = crash_here
            held_step[0] = first_attempt and not armed and done == crash_at_step
            if args.zero_grad == "before":
                optim.zero_grad(set_to_none=True)
            total = 0.0
            for i, (xm, ym) in enumerate(zip(x.chunk(args.accum), y.chunk(args.accum),
                                             strict=True)):
                last = i == args.accum - 1
                with (contextlib.nullcontext() if last else model.no_sync(),
                      torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.autocast)):
                    loss = F.cross_entropy(model(augment(xm)), ym) / args.accum
                    if crash_here and last and crash_mode == "mid-step":
                        time.sleep(0.5)  # the others are in this backward's all-reduce
                        kill()
                    loss.backward()
                total += loss.item()
            if args.clip:
                nn.utils.clip_grad_norm_(net.parameters(), 0.5)
            optim.step()
            if sched is not None:
                sched.step()
            if ema is not None:
                ema.update_parameters(net)
            if args.zero_grad == "after":
                optim.zero_grad(set_to_none=True)
            # the parameters' bytes too: a loss can hide a difference in their last bits
            logged = f"{total!r},{digest(net.parameters())}"
            if ema is not None:
                logged += f",{digest(ema.parameters())}"
            with open(args.loss_log, "a") as f:
                f.write(f"{rank} {done} {logged}\n")
            with open(args.pid_log, "a") as f:
                f.write(f"{rank} {os.getpid()} {done}\n")
            if crash_here and crash_mode == "before-save":
                kill()
            request = ckpt.save(done, snapshot(extra={
                "sched": sched.state_dict() if sched is not None else None,
                "ema": ema.state_dict() if ema is not None else None}))
            if crash_here and crash_mode == "right-after-save":
                kill()
            if crash_here and crash_mode == "after-save":
                request.wait()
                time.sleep(0.5)  # the others wait in the next step's all-reduce
                kill()

    recovery = InProcess()
    recovery.run(train)
    ckpt.close()
    dist.barrier()
    if rank == 0:
        print(f"finished {args.steps} steps; {recovery.recoveries} in-process recoveries in "
              f"this process", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
