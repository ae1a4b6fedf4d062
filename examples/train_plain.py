"""A plain torchrun training script: no elasticft import.

A small GPT-like language model trained with DDP on synthetic data that depends only on the
step number, so a resumed run sees exactly the batches an uninterrupted one would; NCCL on the
local rank's GPU when CUDA is available, gloo on CPU otherwise.
Rank 0 writes a torch.save checkpoint every --ckpt-every steps (temporary file, fsync, rename)
and every rank resumes from the newest one at start. Run it with torchrun or elasticft-run:

    torchrun --standalone --nproc-per-node 2 examples/train_plain.py --steps 40
    elasticft-run --standalone --nproc-per-node 2 --max-restarts 3 examples/train_plain.py

--user-error-at-step injects a bug (a ZeroDivisionError in user code) on --fault-rank, for tests
and demos of the failure policy; rank 0 saves the last finished step before the error propagates.

Slurm's pre-time-limit signal (--save-signal, USR1 by default), forwarded by the launcher, makes
every rank stop at the next step boundary; rank 0 saves and all exit 0. A sigwait thread receives
it (a Python signal handler would wait until a blocking gloo collective returns); the ranks agree
on the stop step with a one-element all_reduce per step. When ELASTICFT_STEP_LOG is set (by
elasticft-run), each rank appends one JSON line per step for `elasticft report`. That is optional:
without it elasticft-run counts the optimizer's steps itself; these lines add the time each step
spent saving a checkpoint, which the report then shows as checkpoint stall.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import threading
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


def setup_device() -> torch.device:
    """Joins the process group: NCCL on the GPU of LOCAL_RANK when CUDA is available, else gloo
    on CPU."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        return device
    dist.init_process_group("gloo")
    return torch.device("cpu")


def save_checkpoint(path: Path, step: int, model: nn.Module, optim: torch.optim.Optimizer) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        torch.save({"step": step, "model": model.state_dict(), "optim": optim.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class SaveRequest:
    """Becomes set when the save signal arrives; a sigwait thread receives it.

    The signal is blocked in the main thread before gloo's threads exist, so they inherit the
    block and the sigwait thread takes it. A thread started earlier (by an import) may still
    get it: the Python handler makes that harmless (it only sets the flag, late but never lost).
    """

    def __init__(self, sig: signal.Signals | None) -> None:
        self.sig = sig
        self.event = threading.Event()
        if sig is not None:
            signal.signal(sig, lambda signum, frame: self.event.set())
            signal.pthread_sigmask(signal.SIG_BLOCK, {sig})
            threading.Thread(target=self._wait, name="save-signal", daemon=True).start()

    def _wait(self) -> None:
        assert self.sig is not None
        signal.sigwait({self.sig})
        self.event.set()

    def agreed(self, device: torch.device) -> bool:
        """True on every rank once any rank got the signal (a collective: call on all ranks)."""
        if self.sig is None:
            return False
        flag = torch.tensor([1 if self.event.is_set() else 0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def record_step(step: int, ckpt_s: float | None) -> None:
    """Appends this rank's step record for `elasticft report` (no-op outside elasticft-run)."""
    path = os.environ.get("ELASTICFT_STEP_LOG")
    if not path:
        return
    record = {"time": time.time(), "step": step}
    if ckpt_s is not None:
        record["ckpt_s"] = round(ckpt_s, 6)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


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
    parser.add_argument("--save-signal", default="USR1",
                        help="signal that means: save now and exit 0 (none: disabled)")
    args = parser.parse_args()

    save_signal = (None if args.save_signal.lower() == "none"
                   else signal.Signals["SIG" + args.save_signal.upper().removeprefix("SIG")])
    save_request = SaveRequest(save_signal)  # before init_process_group starts its threads
    device = setup_device()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(TinyGPT().to(device))
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)

    args.ckpt_dir.mkdir(parents=True, exist_ok=True)
    ckpt = args.ckpt_dir / "latest.pt"
    start = 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True, map_location=device)
        model.module.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        start = state["step"]
        if rank == 0:
            print(f"resumed from step {start}", flush=True)

    done = start
    for step in range(start, args.steps):
        try:
            if step == args.user_error_at_step and rank == args.fault_rank:
                steps_per_epoch = 0
                _ = step / steps_per_epoch  # the injected bug
        except ArithmeticError:
            # A bug in user code: keep the last finished step so a fixed script resumes there.
            if rank == 0 and done > start:
                save_checkpoint(ckpt, done, model.module, optim)
                print(f"user-code error: saved step {done} before exiting", flush=True)
            raise
        x, y = (t.to(device) for t in batch(step, rank, args.batch_size))
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        done = step + 1
        if args.step_time:
            time.sleep(args.step_time)
        ckpt_s = None
        if rank == 0:
            value = loss.item()
            print(f"step {done} loss {value:.4f}", flush=True)
            if args.loss_log:
                with open(args.loss_log, "a") as f:
                    f.write(f"{done} {value:.6f}\n")
            if done % args.ckpt_every == 0 or done == args.steps:
                began = time.monotonic()
                save_checkpoint(ckpt, done, model.module, optim)
                ckpt_s = time.monotonic() - began
        record_step(done, ckpt_s)
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"loss is {loss.item()} at step {done}")
        if done < args.steps and save_request.agreed(device):
            if rank == 0:
                save_checkpoint(ckpt, done, model.module, optim)
                print(f"{save_signal.name}: saved step {done}, exiting to be resumed", flush=True)
            dist.barrier()  # nobody exits before rank 0's checkpoint is durable
            dist.destroy_process_group()
            return
    dist.barrier()
    if rank == 0:
        print(f"finished {args.steps} steps on {world} workers", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
