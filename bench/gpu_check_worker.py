"""The training script of bench/gpu_check.py: one NCCL rank (world size 1) on one GPU.

    python gpu_check_worker.py ops|overhead|overhead-gloo|hang OUT_JSON

* ``ops``: one call of each collective torch issues through NCCL; then reads its own NCCL ring
  (the shim's records, when the shim is there) and the shim's self-check;
* ``overhead``: 10,000 all_reduce calls of 4 bytes, each timed on the host;
* ``overhead-gloo``: the same on a CPU tensor over gloo (no GPU needed): the Python recorder's
  cost where there is no shim;
* ``hang``: 50 ordinary steps, then a ``torch.cuda._sleep`` of minutes queued before an
  all_reduce, then a wait for it (the first start only: a restarted worker finishes at once).

Writes its findings to OUT_JSON (``ops`` and ``overhead``) or the time of the hang (``hang``).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def init() -> torch.device:
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    return device


def own_ring() -> dict[str, object]:
    """This rank's NCCL records and the shim's self-check (empty without diagnostics)."""
    from elasticft.diag import shimcheck
    from elasticft.diag.recorder import installed
    from elasticft.diag.ring import FLAG_TIMED, RingFiles, RingReader

    recorder = installed()
    check = recorder.nccl_check if recorder is not None else None
    found: dict[str, object] = {"probe": shimcheck.probe().to_json(), "records": [], "head": 0,
                                "interception": check.verdict if check is not None else None}
    files = RingFiles.from_env(os.environ, int(os.environ.get("RANK", "0")))
    if files is None or files.nccl is None:
        return found
    time.sleep(0.3)  # the shim's thread polls its events every 2 ms
    header, records = RingReader(files.nccl).poll()
    found["head"] = header.head if header else 0
    found["records"] = [{"op": r.op_name, "bytes": r.nbytes, "gpu_ms": r.value,
                         "timed": bool(r.flags & FLAG_TIMED), "nccl_result": (r.flags >> 8) & 0xFF,
                         "complete": not r.in_flight, "comm_seq": r.comm_seq} for r in records]
    return found


def ops(out: Path) -> None:
    device = init()
    x = torch.ones(1 << 20, device=device)
    dist.all_reduce(x)
    dist.broadcast(x, src=0)
    gathered = torch.empty(1 << 20, device=device)
    dist.all_gather_into_tensor(gathered, x)
    dist.reduce_scatter_tensor(x, gathered)
    dist.all_to_all_single(gathered, x)
    dist.barrier()
    torch.cuda.synchronize()
    out.write_text(json.dumps(own_ring()))
    dist.destroy_process_group()


def python_wrappers() -> bool | None:
    """Whether the recorder's Python wrappers are on the public collectives (None: none)."""
    from elasticft.diag.recorder import installed

    recorder = installed()
    return None if recorder is None else recorder.collectives_wrapped


def overhead(out: Path, calls: int = 10_000, backend: str = "nccl") -> None:
    if backend == "nccl":
        device = init()
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    x = torch.ones(1, device=device)
    for _ in range(500):
        dist.all_reduce(x)
    if device.type == "cuda":
        torch.cuda.synchronize()
    host_ns = []
    clock = time.perf_counter_ns
    for _ in range(calls):
        start = clock()
        dist.all_reduce(x)
        host_ns.append(clock() - start)
    if device.type == "cuda":
        torch.cuda.synchronize()
    ring = own_ring() if device.type == "cuda" else {"records": [], "head": 0, "probe": None}
    records = [r for r in ring["records"] if r["op"] == "all_reduce"]  # type: ignore[union-attr]
    gpu_ms = [r["gpu_ms"] for r in records if r["timed"] and r["complete"]]
    out.write_text(json.dumps({
        "calls": calls, "median_us": statistics.median(host_ns) / 1e3,
        "mean_us": statistics.fmean(host_ns) / 1e3, "ring_head": ring["head"],
        "records_kept": len(records), "records_with_gpu_time": len(gpu_ms),
        "gpu_median_ms": statistics.median(gpu_ms) if gpu_ms else None,
        "probe": ring["probe"], "python_wrappers": python_wrappers()}))
    dist.destroy_process_group()


def hang(out: Path, sleep_s: float = 600.0) -> None:
    device = init()
    model = torch.nn.Linear(256, 256, device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, 256, device=device)
    for _ in range(50):
        loss = model(x).pow(2).mean()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        optimizer.step()
        optimizer.zero_grad()
        torch.cuda.synchronize()
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        # ~1.4-2 GHz: cycles for sleep_s seconds; the all_reduce waits behind it on the GPU.
        torch.cuda._sleep(int(sleep_s * 2e9))
        out.write_text(json.dumps({"hang_at": time.time()}))
        dist.all_reduce(x)
        torch.cuda.synchronize()
    dist.destroy_process_group()


if __name__ == "__main__":
    modes = {"ops": ops, "overhead": overhead, "hang": hang,
             "overhead-gloo": lambda out: overhead(out, backend="gloo")}
    modes[sys.argv[1]](Path(sys.argv[2]))
