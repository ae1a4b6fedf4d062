"""Reading a rank's shard back from disk: elasticft's reader against the file's plain read.

A restore from the disk tier (a requeued Slurm job, a replaced node) reads each rank's shard.
Per round, with the file's pages dropped from the page cache before each read:

* **read**: the shard file read sequentially into new memory of its size (the floor);
* **elasticft**: ``durable.read_rank_shard``, every tensor's bytes read straight into their
  place in a new payload and every blob checked against its CRC-32;
* **torch.load**: what the reader did before: the file read into memory, then each blob through
  ``torch.load`` and copied into the payload, each blob checked against its CRC-32.

    .venv/bin/python bench/disk_restore.py [--gb 1 --repeat 3 --dir DIR]

``--dir`` must be on a real disk (not tmpfs). Not a test: figures depend on the disk and the
load; docs/benchmarks.md keeps runs.
"""

from __future__ import annotations

import argparse
import io
import mmap
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from persist import model_state  # the same state the persist bench writes (bench/ is the path)

from elasticft.ckpt.api import Snapshot
from elasticft.ckpt.persisting import durable
from elasticft.ckpt.persisting.diskfile import crc32
from elasticft.ckpt.snapshot import flatten, stored_here, tensor_view


def drop_cache(path: Path) -> None:
    """Evicts the file's (fsynced, so clean) pages: the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def plain_read(path: Path, buffer: Any) -> None:
    with open(path, "rb", buffering=0) as f:
        view, done = memoryview(buffer), 0
        while got := f.readinto(view[done:]):
            done += got


def torch_load_read(directory: Path) -> bytearray:
    manifest = durable.read_rank_manifest(directory, 0)
    data = memoryview((directory / manifest["file"]).read_bytes())
    payload = bytearray(int(manifest["payload_bytes"]))
    for item in manifest["items"]:
        if not stored_here(item):
            continue
        place = manifest["storage"][item["fqn"]]
        blob = data[place["offset"] : place["offset"] + place["length"]]
        assert crc32(blob) == place["crc32"]
        if item["kind"] == "tensor":
            tensor_view(payload, item).copy_(torch.load(io.BytesIO(blob), weights_only=True))
    return payload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="disk-restore-bench-", dir=args.dir or Path.cwd()))
    try:
        layout = flatten(model_state(int(args.gb * (1 << 30))))
        payload = mmap.mmap(-1, layout.payload_bytes)
        for entry in layout.tensors:
            tensor_view(payload, entry.to_json()).copy_(entry.tensor)
        directory = durable.write_rank_shard(root, Snapshot(layout.manifest(1, 0, 1), payload))
        shard = directory / durable.shard_name(0)
        size = shard.stat().st_size
        times: dict[str, list[float]] = {"read": [], "elasticft": [], "torch.load": []}
        for round_ in range(1, args.repeat + 1):
            for name in times:
                drop_cache(shard)
                started = time.perf_counter()
                if name == "read":
                    plain_read(shard, bytearray(size))
                    restored = None
                elif name == "elasticft":
                    restored = durable.read_rank_shard(directory, 0).payload
                else:
                    restored = torch_load_read(directory)
                times[name].append(time.perf_counter() - started)
                assert restored is None or restored == payload[:]  # checked outside the time
                restored = None
            print(f"round {round_}: " + ", ".join(
                f"{name} {t[-1]:.2f} s ({size / t[-1] / 1e9:.2f} GB/s)"
                for name, t in times.items()), flush=True)
        medians = {name: statistics.median(t) for name, t in times.items()}
        floor = medians["read"]
        print(f"{size / 1e9:.2f} GB shard, {args.repeat} rounds, medians: " + ", ".join(
            f"{name} {m:.2f} s ({m / floor:.2f}x the read)" for name, m in medians.items()))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
