"""How much training stalls for a checkpoint: torch.save vs dcp.save vs dcp.async_save vs elasticft.

Two gloo workers train the example model (examples/train_plain.py's TinyGPT, scaled to about 25M
parameters) with AdamW, and in the same processes, one after the other, run the same N steps
with each checkpoint method every k steps, plus once without checkpoints. Printed per method:

* blocking: median time per save that the training thread could not train (for elasticft: the
  save() call plus any wait of the next optimizer step for the copy still in flight; for the
  others: until the call returns, state-dict capture included for all);
* load: time to restore the newest checkpoint into the model and optimizer, and that plus the
  first training step after it (a restore that defers work, e.g. page faults, shows there);
* whole cost: wall time of the N steps with checkpoints minus the N steps without (until the
  last step is done), which counts background writers competing with training for the CPU;
* the floor: the state's bytes over the memcpy bandwidth measured in this run.

    .venv/bin/python bench/ckpt.py [--steps 8 --every 2 --dim 512 --layers 8]

Not a test: numbers depend on the machine; README.md's checkpoint section has recorded runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from train_plain import VOCAB, TinyGPT, batch  # noqa: E402

from elasticft.ckpt import Checkpointer, StateCapture, WorkerSettings  # noqa: E402
from elasticft.ckpt.memory.shm import segment_prefix  # noqa: E402
from elasticft.ckpt.persisting import durable  # noqa: E402

METHODS = ("torch.save", "dcp.save", "dcp.async_save", "elasticft")


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{platform.node()}: {cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, "
            f"Python {platform.python_version()}, torch {torch.__version__}")


def memcpy_bandwidth(nbytes: int) -> float:
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in first: the floor is a warm copy
    times = []
    for _ in range(3):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return nbytes / min(times)


class Trainer:
    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        self.args, self.rank = args, rank
        torch.manual_seed(0)
        self.model = DistributedDataParallel(TinyGPT(dim=args.dim, layers=args.layers))
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.step_no = 0

    def step(self) -> None:
        x, y = batch(self.step_no, self.rank, self.args.batch_size)
        loss = F.cross_entropy(self.model(x).reshape(-1, VOCAB), y.reshape(-1))
        self.optim.zero_grad(set_to_none=True)
        loss.backward()
        self.optim.step()
        self.step_no += 1

    def state_bytes(self) -> int:
        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        total = 0
        for sd in (model_sd, optim_sd["state"]):
            stack: list[Any] = [sd]
            while stack:
                item = stack.pop()
                if isinstance(item, dict):
                    stack.extend(item.values())
                elif isinstance(item, torch.Tensor):
                    total += item.numel() * item.element_size()
        return total


def save(trainer: Trainer, method: str, i: int, root: Path, pg: Any,
         ckpt: Checkpointer | None, snapshot: StateCapture | None) -> Any:
    """One checkpoint of step ``i``; returns dcp.async_save's future (else None)."""
    if method == "torch.save":
        if trainer.rank == 0:
            path = root / f"step-{i}.pt"
            with open(path, "wb") as f:
                torch.save({"model": trainer.model.module.state_dict(),
                            "optim": trainer.optim.state_dict()}, f)
                f.flush()
                os.fsync(f.fileno())
    elif method == "dcp.save":
        model_sd, optim_sd = get_state_dict(trainer.model, trainer.optim)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(root / f"s{i}"))
    elif method == "dcp.async_save":
        model_sd, optim_sd = get_state_dict(trainer.model, trainer.optim)
        future = dcp.async_save({"model": model_sd, "optim": optim_sd},
                                checkpoint_id=str(root / f"s{i}"), process_group=pg)
        if i < 0:
            future.result()
        return future
    else:
        assert ckpt is not None and snapshot is not None
        request = ckpt.save(i, snapshot({"step": i}))
        if i < 0:
            request.wait()
    return None


def run_method(trainer: Trainer, method: str | None, every: int, root: Path,
               pg: Any) -> dict[str, Any]:
    """N steps, checkpointing every ``every`` with ``method`` (None: no checkpoint)."""
    args, rank = trainer.args, trainer.rank
    blocking: list[float] = []
    ckpt: Checkpointer | None = None
    snapshot: StateCapture | None = None
    pending: Any = None
    if method and method.startswith("elasticft"):
        # Named after the launching process, like the segments of one agent's workers: a
        # restoring rank finds the other ranks' shares of the replicated state on this host.
        settings = WorkerSettings(
            local_rank=rank, shm_slots=segment_prefix(os.getppid(), "bench", rank),
            local_dir=root, persist_every=0 if method.endswith("memory") else every,
            owner_pid=os.getppid())
        ckpt = Checkpointer(settings, optimizers=[trainer.optim],
                            dedup_replicas=not args.no_dedup)
        snapshot = StateCapture(trainer.model, trainer.optim, rng=False)
    if method is not None:
        # One save outside the clock: first-call costs (thread pools, planner caches, the memory
        # tier's one-time allocation) are paid once per job, not per checkpoint.
        warm = root / "warmup"
        warm.mkdir(exist_ok=True)
        save(trainer, method, -1, warm, pg, ckpt, snapshot)
    dist.barrier()
    started = time.perf_counter()
    for i in range(1, args.steps + 1):
        stall_before = ckpt.stall_s if ckpt else 0.0
        trainer.step()
        hook_wait = (ckpt.stall_s - stall_before) if ckpt else 0.0
        if blocking and ckpt is not None:
            blocking[-1] += hook_wait  # the optimizer step waited for the previous copy
        if method is None or i % every:
            continue
        t = time.perf_counter()
        if pending is not None:
            pending.result()
        pending = save(trainer, method, i, root, pg, ckpt, snapshot)
        blocking.append(time.perf_counter() - t)
    dist.barrier()
    # Training's view: the N steps are done. What a background writer still has to do is not
    # lost training time (it overlaps the steps that follow in a real run).
    wall = time.perf_counter() - started
    if pending is not None:
        pending.result()
    if ckpt is not None:
        ckpt.close()
    dist.barrier()
    return {"wall_s": wall, "blocking_s": blocking, "ckpt": ckpt}


def drop_from_page_cache(root: Path) -> None:
    """Evicts the checkpoint's (fsynced, so clean) pages: a restart reads from the disk."""
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def load_time(trainer: Trainer, method: str, root: Path,
              ckpt: Checkpointer | None) -> tuple[float, float]:
    """Seconds to restore, and to restore and run the first step after it."""
    if method != "elasticft":
        drop_from_page_cache(root)
    dist.barrier()
    t = time.perf_counter()
    if method == "torch.save":
        newest = max(root.glob("step-*.pt"), key=lambda p: int(p.stem.split("-")[1]))
        state = torch.load(newest, weights_only=True)
        trainer.model.module.load_state_dict(state["model"])
        trainer.optim.load_state_dict(state["optim"])
    elif method in ("dcp.save", "dcp.async_save"):
        newest = max(root.glob("s*"), key=lambda p: int(p.name[1:]))
        model_sd, optim_sd = get_state_dict(trainer.model, trainer.optim)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(newest))
        set_state_dict(trainer.model, trainer.optim, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    else:
        assert ckpt is not None
        reader = Checkpointer(ckpt.settings)  # a restarted worker: memory tier first
        restored = reader.restore(trainer.model, trainer.optim)
        assert restored is not None and reader.last_source == "memory", reader.last_source
        reader.close()
    elapsed = time.perf_counter() - t
    trainer.step()
    with_step = time.perf_counter() - t
    dist.barrier()
    return elapsed, with_step


def worker(rank: int, args: argparse.Namespace, init_file: str, out: str, shared: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    pg = dist.new_group(backend="gloo")  # async_save's own group, apart from training's
    trainer = Trainer(args, rank)
    for _ in range(2):
        trainer.step()  # warm up; optimizer state exists before anything is measured
    work = Path(shared)
    results: dict[str, Any] = {"state_bytes": trainer.state_bytes(),
                               "memcpy_Bps": memcpy_bandwidth(trainer.state_bytes())}
    runs: list[tuple[str, str | None, int]] = [("none", None, args.every)]
    runs += [(m, m, args.every) for m in METHODS]
    runs += [("elasticft every step (memory)", "elasticft-memory", 1), ("none (again)", None, 1)]
    for i in range(args.repeat):  # interleaved pairs: a shared host's drift hits both alike
        runs += [(f"pair {i} none", None, 1), (f"pair {i} every step", "elasticft-memory", 1)]
    for label, method, every in runs:
        root = work / label.replace(" ", "_").replace("(", "").replace(")", "")
        root.mkdir(parents=True, exist_ok=True)
        measured = run_method(trainer, method, every, root, pg)
        entry: dict[str, Any] = {"wall_s": measured["wall_s"], "blocking_s": measured["blocking_s"]}
        if method in METHODS:
            entry["load_s"], entry["load_step_s"] = load_time(trainer, method, root,
                                                              measured["ckpt"])
        if method == "elasticft":
            deadline = time.monotonic() + 120
            while rank == 0 and not durable.committed_steps(root) and time.monotonic() < deadline:
                time.sleep(0.1)
            for path in Path("/dev/shm").glob(f"{segment_prefix(os.getppid(), 'bench', rank)}-*"):
                path.unlink(missing_ok=True)
        if method is not None and method.startswith("elasticft-memory"):
            for path in Path("/dev/shm").glob(f"{segment_prefix(os.getppid(), 'bench', rank)}-*"):
                path.unlink(missing_ok=True)
        results[label] = entry
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, results)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def report(args: argparse.Namespace, ranks: list[dict[str, Any]]) -> str:
    r0 = ranks[0]
    state_mb = r0["state_bytes"] / 1e6
    floor = r0["state_bytes"] / r0["memcpy_Bps"]
    base = max(r["none"]["wall_s"] for r in ranks)
    again = max(r["none (again)"]["wall_s"] for r in ranks)
    base = (base + again) / 2  # before and after the methods: drift on a shared host
    lines = [
        f"machine: {machine()}",
        f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"model: TinyGPT dim={args.dim} layers={args.layers} + AdamW, {state_mb:.0f} MB of state "
        f"per rank, 2 gloo ranks, {args.steps} steps, checkpoint every {args.every}",
        f"elasticft: {'whole state per rank' if args.no_dedup else 'replicas deduplicated'}",
        f"memcpy {r0['memcpy_Bps'] / 1e9:.2f} GB/s -> floor {floor * 1e3:.1f} ms per save",
        f"no checkpoint: {base:.2f} s for {args.steps} steps",
        "",
        f"{'method':<16}{'blocking/save':>15}{'load':>10}{'whole cost':>13}"
        "   (load: disk methods read with a cold page cache, elasticft from memory)",
    ]
    stats: dict[str, dict[str, float]] = {}
    base_step = base / args.steps
    for method in METHODS:
        # The slowest rank sets the pace of synchronous training.
        blocking = max(statistics.median(r[method]["blocking_s"]) for r in ranks)
        load = max(r[method]["load_s"] for r in ranks)
        cost = max(r[method]["wall_s"] for r in ranks) - base
        load_step = max(r[method]["load_step_s"] for r in ranks)
        stats[method] = {"blocking": blocking, "load": load, "cost": cost,
                         "load_step": load_step}
        lines.append(f"{method:<16}{blocking * 1e3:>12.1f} ms{load:>9.3f}s{cost:>12.2f}s")
    every_step = max(r["elasticft every step (memory)"]["wall_s"] for r in ranks)
    e, ts, a = stats["elasticft"], stats["torch.save"], stats["dcp.async_save"]
    slowdown = every_step / again - 1
    lines += [
        "",
        f"elasticft stall vs torch.save:      1/{ts['blocking'] / e['blocking']:.0f}  "
        "(target <= 1/20)",
        f"elasticft stall vs dcp.async_save:  1/{a['blocking'] / e['blocking']:.1f}  "
        "(target <= 1/3)",
        f"elasticft stall vs floor:           {e['blocking'] / floor:.2f}x  (target <= 2x)",
        f"elasticft whole cost vs async_save: {e['cost']:.2f} s vs {a['cost']:.2f} s  "
        "(target <= 1/5)",
        f"restore from memory vs torch.load:  {ts['load'] / e['load']:.1f}x faster  "
        f"({e['load']:.3f} s vs {ts['load']:.3f} s; target >= 10x)",
        f"  restore + first step:             {e['load_step']:.3f} s vs {ts['load_step']:.3f} s "
        f"({ts['load_step'] / e['load_step']:.1f}x; a step alone: {base_step:.3f} s)",
        f"snapshot every step (memory tier):  {slowdown * 100:+.1f}% wall time vs none "
        f"({every_step:.2f} s vs {again:.2f} s; target <= 3%)",
    ]
    if args.repeat:
        ratios = []
        for i in range(args.repeat):
            with_ = max(r[f"pair {i} every step"]["wall_s"] for r in ranks)
            without = max(r[f"pair {i} none"]["wall_s"] for r in ranks)
            ratios.append(with_ / without - 1)
        lines.append(
            f"snapshot every step, {args.repeat} interleaved pairs: median "
            f"{statistics.median(ratios) * 100:+.1f}% (each: "
            + ", ".join(f"{x * 100:+.1f}%" for x in ratios) + ")")
    lines.insert(3, f"load average at the end: {os.getloadavg()[0]:.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: $TMPDIR)")
    parser.add_argument("--json", type=Path, help="also write the raw per-rank numbers here")
    parser.add_argument("--repeat", type=int, default=0,
                        help="extra interleaved pairs of N steps without / with a snapshot "
                        "every step")
    parser.add_argument("--no-dedup", action="store_true",
                        help="elasticft: every rank snapshots the whole replicated state")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        init_file, out = os.path.join(tmp, "init"), os.path.join(tmp, "out.json")
        shared = tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir)
        try:
            mp.spawn(worker, args=(args, init_file, out, shared), nprocs=2, join=True)
        finally:
            shutil.rmtree(shared, ignore_errors=True)
        ranks = json.loads(Path(out).read_text())
    print(report(args, ranks))
    if args.json:
        args.json.write_text(json.dumps(ranks, indent=1))


if __name__ == "__main__":
    main()
