"""How close the agent's persist comes to the disk's sequential write speed.

In one process, one after the other (``--repeat`` rounds, alternating):

* **disk**: N GB written sequentially to a fresh file in 64 MiB writes, then fsync (what ``dd
  bs=64M conv=fsync`` does), from memory already touched; the same with the disk's writeback
  started after every write (``sync_file_range``), so the disk writes while the next chunk is
  copied; and the same with ``O_DIRECT`` (``dd oflag=direct``). The disk's speed is the fastest
  of the three;
* **persist**: an N GB snapshot (a model's parameters and AdamW state, a few large tensors and
  many small ones) saved with ``Checkpointer.save`` into real shared-memory slots, then what the
  agent does to persist it with the default three slots: hold the slot (``pipeline.hold``) and
  write the rank's shard straight from it (``durable.write_rank_shard``: a checksummed
  ``torch.save`` blob per tensor, fsync, manifest), with ``O_DIRECT`` as the agent does and
  through the page cache, one after the other. ``--copy`` measures the two-slot path instead: a
  copy out of the slot into a reused staging buffer (``pipeline.copy_out``) first, timed apart
  from the write.

Printed: each round's seconds and GB/s, the medians, and persist/disk (the ratio of speeds).
``--train`` runs a training loop beside it all (a process of its own, one thread: a small MLP
with AdamW) and prints its median step while a persist runs against its median step while
nothing else does (no disk round, save or persist): how much a persist slows training. The
rounds then run at nice 19, as the agent's persist thread does.

    .venv/bin/python bench/persist.py [--gb 1 --repeat 3 --dir DIR] [--copy] [--train]

``--dir`` must be on a real disk (not tmpfs); the default is a temporary directory under the
current one. Not a test: figures depend on the disk and the load; docs/benchmarks.md keeps runs.
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from elasticft.ckpt import Checkpointer, WorkerSettings
from elasticft.ckpt.memory.shm import SlotSet, segment_prefix
from elasticft.ckpt.persisting import diskfile, durable
from elasticft.ckpt.persisting.pipeline import StagingBuffer, copy_out, hold

CHUNK = 64 << 20


def disk_write(path: Path, nbytes: int, buffer: mmap.mmap, writeback: bool = False,
               direct: bool = False) -> float:
    """Seconds to write ``nbytes`` of ``buffer`` (page-aligned, a multiple of 4 KiB long, as
    ``O_DIRECT`` asks) sequentially, fsync included."""
    view = memoryview(buffer)
    nbytes = nbytes // 4096 * 4096
    started = time.perf_counter()
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o600)
    try:
        left = nbytes
        while left:
            done = nbytes - left
            left -= os.write(fd, view[: min(CHUNK, left)])
            if writeback and diskfile.sync_file_range is not None:
                diskfile.sync_file_range(fd, done, nbytes - left - done, 2)
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - started


def train(steps_out: multiprocessing.Queue, stop: multiprocessing.Event) -> None:
    """Steps a small MLP with AdamW on one thread until ``stop``; each step's (start, end)
    on the system-wide monotonic clock goes to ``steps_out`` in batches."""
    torch.set_num_threads(1)
    # Its weights shrink towards zero on a fixed batch; once they reach denormal floats, every
    # step slows down by 2x, and a persist would take the blame for the drift.
    torch.set_flush_denormal(True)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 512))
    optim = torch.optim.AdamW(model.parameters())
    batch = torch.randn(64, 512)
    done: list[tuple[float, float]] = []
    while not stop.is_set():
        started = time.monotonic()
        model(batch).square().mean().backward()
        optim.step()
        optim.zero_grad()
        done.append((started, time.monotonic()))
        if len(done) >= 50:
            steps_out.put(done)
            done = []
    steps_out.put(done)
    steps_out.put(None)


def slowdown(steps: list[tuple[float, float]], busy: list[tuple[float, float]],
             persisting: list[tuple[float, float]], how: str) -> str:
    """Median step inside a persist against the median step overlapping nothing busy."""
    def overlaps(step: tuple[float, float], windows: list[tuple[float, float]]) -> bool:
        return any(step[0] < end and start < step[1] for start, end in windows)

    quiet = [b - a for a, b in steps if not overlaps((a, b), busy)]
    during = [b - a for a, b in steps
              if any(start <= a and b <= end for start, end in persisting)]
    if not quiet or not during:
        return f"training during a persist {how}: too few steps to compare (raise --gb or --repeat)"
    q, d = statistics.median(quiet), statistics.median(during)
    return (f"training step: {q * 1e3:.2f} ms with nothing else running ({len(quiet)} steps), "
            f"{d * 1e3:.2f} ms during a persist {how} ({len(during)} steps): slowed "
            f"{d / q - 1:+.1%}")


def model_state(nbytes: int) -> dict[str, torch.Tensor]:
    """Parameters plus AdamW's two moments: large matrices and one small vector per matrix."""
    state: dict[str, torch.Tensor] = {}
    per_param = nbytes // 3
    width = 2048
    rows = max(1, per_param // (width * 4) // 16)
    for i in range(16):
        for kind in ("param", "exp_avg", "exp_avg_sq"):
            state[f"layers.{i}.weight.{kind}"] = torch.randn(rows, width)
            state[f"layers.{i}.bias.{kind}"] = torch.randn(width)
    return state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--copy", action="store_true",
                        help="the two-slot path: copy out of the slot, then write")
    parser.add_argument("--train", action="store_true",
                        help="a training loop beside it: its step time during a persist")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="persist-bench-", dir=args.dir or Path.cwd()))
    nbytes = int(args.gb * (1 << 30))
    prefix = segment_prefix(os.getpid(), "persistbench", 0)
    state = model_state(nbytes)
    size = sum(t.numel() * t.element_size() for t in state.values())
    buffer = mmap.mmap(-1, CHUNK)  # page-aligned for O_DIRECT
    buffer.write(os.urandom(1 << 20) * (CHUNK >> 20))  # incompressible, touched
    settings = WorkerSettings(shm_slots=prefix, agent_owned=True)
    staging = StagingBuffer()
    disk: list[float] = []
    copy: list[float] = []
    write: dict[bool, list[float]] = {True: [], False: []}  # O_DIRECT or not
    trainer = None
    if args.train:
        spawn = multiprocessing.get_context("spawn")
        steps_out, stop = spawn.Queue(), spawn.Event()
        trainer = spawn.Process(target=train, args=(steps_out, stop), daemon=True)
        trainer.start()
        time.sleep(3)  # past its start-up and first steps: quiet steps to compare with
        diskfile.background_priority()  # as the agent persists: what training leaves
    busy: list[tuple[float, float]] = []
    persisting: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    try:
        # One reader for every round, as the agent keeps its mappings (no page faults after
        # the first persist).
        reader = SlotSet(prefix, settings.slots)
        with Checkpointer(settings) as ckpt:
            for step in range(1, args.repeat + 1):
                target = root / "dd.bin"
                busy_from = time.monotonic()
                disk.append(min(disk_write(target, size, buffer),
                                disk_write(target, size, buffer, writeback=True),
                                disk_write(target, size, buffer, direct=True)))
                target.unlink()
                ckpt.save(step, state).wait(120)
                newest = reader.newest()
                assert newest is not None and newest[1].step == step
                slot = reader.get(newest[0])
                assert slot is not None
                # Alternating which goes first, so neither always meets a disk still busy.
                for direct in (True, False) if step % 2 else (False, True):
                    started = time.perf_counter()
                    persist_from = time.monotonic()
                    with contextlib.ExitStack() as held:
                        snapshot = (copy_out(slot, step, staging) if args.copy
                                    else hold(slot, step, held))
                        assert snapshot is not None
                        copied = time.perf_counter()
                        durable.write_rank_shard(root / "ckpt", snapshot, direct=direct)
                    persisting[direct].append((persist_from, time.monotonic()))
                    if direct:
                        copy.append(copied - started)
                    write[direct].append(time.perf_counter() - copied)
                    shutil.rmtree(root / "ckpt")
                busy.append((busy_from, time.monotonic()))
                time.sleep(2 if trainer else 0)  # quiet steps between rounds
                gb = size / 1e9
                persisted = copy[-1] + write[True][-1]
                print(f"round {step}: disk {disk[-1]:.2f} s ({gb / disk[-1]:.2f} GB/s); persist "
                      f"{persisted:.2f} s = copy {copy[-1]:.2f} s + write {write[True][-1]:.2f} s "
                      f"({gb / persisted:.2f} GB/s); through the page cache: write "
                      f"{write[False][-1]:.2f} s", flush=True)
        reader.close()
    finally:
        for path in Path("/dev/shm").glob(f"{prefix}-s*"):
            path.unlink(missing_ok=True)
        shutil.rmtree(root, ignore_errors=True)
    gb = size / 1e9
    d = statistics.median(disk)
    p = statistics.median(c + w for c, w in zip(copy, write[True], strict=True))
    b = statistics.median(write[False])
    print(f"{gb:.2f} GB, {args.repeat} rounds, medians: disk {d:.2f} s ({gb / d:.2f} GB/s), "
          f"persist {p:.2f} s ({gb / p:.2f} GB/s; copy {statistics.median(copy):.2f} s, write "
          f"{statistics.median(write[True]):.2f} s); persist/disk speed {d / p:.2f}; through "
          f"the page cache {b:.2f} s ({gb / b:.2f} GB/s, {d / b:.2f} of the disk's speed)")
    if trainer is not None:
        stop.set()
        steps: list[tuple[float, float]] = []
        while (batch := steps_out.get(timeout=60)) is not None:
            steps += batch
        trainer.join(10)
        print(slowdown(steps, busy, persisting[True], "with O_DIRECT"))
        print(slowdown(steps, busy, persisting[False], "through the page cache"))


if __name__ == "__main__":
    main()
