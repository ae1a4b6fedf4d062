"""The training of train_plain.py, checkpointed with elasticft's Checkpointer every step.

Same model, data and optimizer (imported from train_plain.py); the difference is the checkpoint:
a snapshot of every step goes to shared memory without stalling the step, and a restart
resumes from the newest step every rank holds, from the fastest source (memory, local disk,
backup peer, remote directory). Under elasticft-run the agent owns the memory and persists it,
in --ckpt-dir when given, else in the run directory; under plain torchrun or python the
script's own process does (--ckpt-dir, --persist-every). Launched again the same way, it
resumes from the newest committed checkpoint (elasticft-run --fresh starts from step 0).

    elasticft-run --standalone --nproc-per-node 2 --max-restarts 3 examples/train_elasticft.py
    torchrun --standalone --nproc-per-node 2 examples/train_elasticft.py --ckpt-dir ckpt

--crash-at-step N makes --fault-rank SIGKILL itself at step N of the first attempt, right after
the save returns (mid-save: the copy is still running) or once it is complete (--crash-mode
after-save), for tests and demos of recovery; --infra-error-at-step N makes it raise a
connection error before step N instead. --fsdp2 shards the model with FSDP2 instead of DDP.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_plain import VOCAB, TinyGPT, batch, record_step, setup_device

from elasticft.ckpt import Checkpointer, StateCapture


def first_attempt() -> bool:
    attempt = os.environ.get("ELASTICFT_ATTEMPT", os.environ.get("TORCHELASTIC_RESTART_COUNT"))
    return attempt in (None, "0")


def parallelize(model: TinyGPT, fsdp2: bool) -> torch.nn.Module:
    """DDP, or FSDP2 as torchtitan shards a transformer: each block, then the root. The
    checkpoint code is the same either way: each rank saves and restores its own shards."""
    if not fsdp2:
        return DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--ckpt-dir", type=Path,
                        help="where checkpoints persist (default: elasticft-run's directory; "
                        "without elasticft-run, none: memory only)")
    parser.add_argument("--persist-every", type=int, default=10,
                        help="without elasticft-run: persist every N steps (0: memory only)")
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step")
    parser.add_argument("--loss-log", type=Path, help="rank 0 appends 'step loss' lines here")
    parser.add_argument("--crash-at-step", type=int, default=-1)
    parser.add_argument("--crash-mode", choices=("mid-save", "after-save"), default="mid-save")
    parser.add_argument("--fault-rank", type=int, default=0)
    parser.add_argument("--fsdp2", action="store_true",
                        help="shard the model with FSDP2 (fully_shard on each block and on the "
                        "root) instead of replicating it with DDP")
    parser.add_argument("--infra-error-at-step", type=int, default=-1,
                        help="--fault-rank raises a connection error before this step "
                        "(first attempt): an infrastructure fault, not a bug")
    args = parser.parse_args()

    device = setup_device()  # NCCL on the local rank's GPU when there is one, else gloo
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = parallelize(TinyGPT(dim=args.dim, layers=args.layers).to(device), args.fsdp2)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ckpt = Checkpointer.from_env(optimizers=[optim], ckpt_dir=args.ckpt_dir,
                                 persist_every=args.persist_every)

    snapshot = StateCapture(model, optim)  # model, optimizer, RNG states, extras

    start = 0
    restored = ckpt.restore(model, optim)  # newest step every rank holds, fastest source
    if restored is not None:
        start, _extra = restored
        if rank == 0:
            print(f"resumed from step {start} (source={ckpt.last_source})", flush=True)

    stall_seen = ckpt.stall_s
    for step in range(start, args.steps):
        if step + 1 == args.infra_error_at_step and rank == args.fault_rank and first_attempt():
            raise ConnectionResetError("injected: connection reset by peer (NIC flap)")
        x, y = (t.to(device) for t in batch(step, rank, args.batch_size))
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()  # waits for the part of the previous snapshot still being copied
        done = step + 1
        if rank == 0:
            # Logged before the snapshot: a step that can be resumed from was also reported.
            value = loss.item()
            print(f"step {done} loss {value:.6f}", flush=True)
            if args.loss_log:
                with open(args.loss_log, "a") as f:
                    f.write(f"{done} {value!r}\n")  # exact, for bitwise comparisons
        request = ckpt.save(done, snapshot(extra={"step": done}))
        # For `elasticft report` (TOR): all that checkpointing cost this step, i.e. save() and
        # the optimizer step's wait for the copy in flight (on a GPU also the device's wait).
        stall_now = ckpt.stall_s
        record_step(done, stall_now - stall_seen)
        stall_seen = stall_now
        if done == args.crash_at_step and rank == args.fault_rank and first_attempt():
            if args.crash_mode == "after-save":
                request.wait()
                # The other ranks save this step too; they then wait for this one in the next
                # step's first collective. Crash once they have had the time to get there.
                time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGKILL)
        if args.step_time:
            time.sleep(args.step_time)
    ckpt.close()
    dist.barrier()
    if rank == 0:
        print(f"finished {args.steps} steps on {world} workers; checkpoint stall "
              f"{ckpt.stall_s:.3f} s in total", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
