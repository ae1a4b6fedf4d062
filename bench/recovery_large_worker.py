"""The worker of bench/recovery_large.py: what each rank runs under the launcher being measured.

It trains an MLP whose parameters and AdamW state come to ``--gb`` GB (per rank; with
``--fsdp`` or ``--tp`` the model is sharded over the ranks by :mod:`recovery_large_fsdp`) and
logs what the driver reads, one JSON line per record in the shared log: ``built`` (the
script's start-up), ``start`` (the step it resumed from, the restore's time), ``step`` (its
time and where that time went), ``save`` and ``landed`` (a snapshot's call and its copy), and
after training the copy ``floor`` of a restarted worker. Under ``elasticft-run`` it
checkpoints with the documented API (``Checkpointer.from_env``, ``StateCapture``,
``restore``); under torchrun the way a torchrun user does (:class:`TorchFiles`: torch.save of
every rank's state; DCP for a sharded model). In the in-process modes the training loop runs
under ``InProcess``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import threading
import time
from pathlib import Path
from typing import Any

import recovery_large_fsdp as fsdp  # bench/ is the path when run as a script
from machine_counters import (
    busiest,
    machine_cpu,
    meminfo_gb,
    page_counters,
    process_age_s,
    process_cpu,
    thread_cpu,
)


def log_record(path: Path, **record: Any) -> None:
    """Appends one record of this process to the shared log."""
    record.update(t=time.time(), pid=os.getpid(), rank=int(os.environ.get("RANK", "0")))
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def _landed(log: Path, request: Any) -> None:
    with contextlib.suppress(Exception):  # the status says it
        request.wait(600)
    log_record(log, event="landed", step=request.step, status=request.status)


def copy_floor() -> dict[str, float]:
    """A plain copy of this rank's newest slot out of /dev/shm, timed in this process: into
    fresh memory (page faults included, as a restore's new optimizer state pays them) and
    again into the same memory (the bare memory copy)."""
    import numpy

    from elasticft.ckpt.memory.shm import SlotSet, read_slot
    from elasticft.ckpt.settings import WorkerSettings

    settings = WorkerSettings.from_env()
    slots = SlotSet(settings.shm_slots or "", settings.slots)
    try:
        newest = slots.newest()
        slot = slots.get(newest[0]) if newest else None
        if slot is None:
            return {}
        with slot.shared() as locked:
            if not locked:
                return {}
            source = numpy.frombuffer(read_slot(slot, verify=False, prefault=False).payload,
                                      dtype=numpy.uint8)
            started = time.perf_counter()
            target = numpy.empty(len(source), dtype=numpy.uint8)
            numpy.copyto(target, source)
            fresh = time.perf_counter() - started
            started = time.perf_counter()
            numpy.copyto(target, source)
            touched = time.perf_counter() - started
            # The same into fresh memory on every core, as the restore copies.
            import torch

            from elasticft.ckpt.hostcopy import copy_all

            del target
            started = time.perf_counter()
            fresh_target = torch.empty(len(source), dtype=torch.uint8)
            copy_all([(fresh_target, torch.from_numpy(source))])
            fresh_parallel = time.perf_counter() - started
            nbytes = len(source)
            del source, fresh_target
        return {"floor_fresh_s": fresh, "floor_touched_s": touched,
                "floor_fresh_parallel_s": fresh_parallel, "floor_bytes": float(nbytes)}
    finally:
        slots.close()


class TorchFiles:
    """torchrun's checkpoints of an unsharded model: every rank torch.saves its model and
    optimizer to ``<ckpt_file>.<rank>.step<N>`` and keeps its newest two; a restart loads the
    newest step every rank holds."""

    def __init__(self, ckpt_file: str, grouped: bool) -> None:
        self.base = f"{ckpt_file}.{os.environ.get('RANK', '0')}"
        self.grouped = grouped

    def _steps(self) -> list[int]:
        """Steps of this rank's files, oldest first."""
        base = Path(self.base)
        return sorted(int(p.name.rsplit(".step", 1)[1]) for p in base.parent.glob(
            f"{base.name}.step*") if p.name.rsplit(".step", 1)[1].isdigit())

    def resume(self, model: Any, optim: Any, device: str) -> int:
        """Loads the newest step every rank holds (a rank killed during a save holds one step
        fewer than the others); returns it, 0 where there is none."""
        import torch
        import torch.distributed as dist

        held = self._steps()
        newest = torch.tensor([held[-1] if held else 0])
        if self.grouped:
            dist.all_reduce(newest, op=dist.ReduceOp.MIN)
        step = int(newest.item())
        if step not in held:
            return 0
        state = torch.load(f"{self.base}.step{step}", map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        return int(state["step"])

    def save(self, step: int, model: Any, optim: Any) -> None:
        import torch

        saved = Path(f"{self.base}.step{step}")
        torch.save({"model": model.state_dict(), "optim": optim.state_dict(), "step": step},
                   f"{saved}.tmp")
        os.replace(f"{saved}.tmp", saved)
        for old in self._steps()[:-2]:  # the newest two stay
            Path(f"{self.base}.step{old}").unlink(missing_ok=True)


def train_step(log: Path, model: Any, optim: Any, batch: Any, sync: Any, grouped: bool,
               step: int) -> None:
    """One step, logged with what its time went to; in a group, with its one all-reduce."""
    import torch
    import torch.distributed as dist

    # Read before and after the step, outside its time: where a slow step's time goes.
    threads, machine, vmstat = thread_cpu(), machine_cpu(), page_counters()
    processes = process_cpu()
    free_gb = meminfo_gb("MemFree")
    began, usage = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    model(batch).pow(2).mean().backward()
    if grouped:
        on_gpu = dist.get_backend() == "nccl"
        dist.all_reduce(torch.ones(1, device=batch.device if on_gpu else "cpu"))
    optim.step()
    optim.zero_grad(set_to_none=True)
    sync()
    step_s, after = time.perf_counter() - began, resource.getrusage(resource.RUSAGE_SELF)
    threads_after, machine_after, vmstat_after = thread_cpu(), machine_cpu(), page_counters()
    others = busiest(processes, process_cpu())
    tick = os.sysconf("SC_CLK_TCK")
    # CPU of its own (by thread), page faults, waiting for a core, and what the whole
    # machine did meanwhile (the agent, the launcher, the kernel) and who used it most.
    log_record(log, event="step", step=step + 1, step_s=step_s,
               user_s=after.ru_utime - usage.ru_utime, sys_s=after.ru_stime - usage.ru_stime,
               minor_faults=after.ru_minflt - usage.ru_minflt,
               preempted=after.ru_nivcsw - usage.ru_nivcsw,
               threads={name: [round(u - threads.get(name, [0.0, 0.0])[0], 2),
                               round(s - threads.get(name, [0.0, 0.0])[1], 2)]
                        for name, (u, s) in threads_after.items()
                        if u + s - sum(threads.get(name, [0.0, 0.0])) >= 0.02},
               machine_s=[round((a - b) / tick, 2) for a, b in zip(machine_after, machine,
                                                                    strict=True)],
               vmstat={k: v - vmstat.get(k, 0) for k, v in vmstat_after.items()
                       if v != vmstat.get(k, 0)},
               mem_free_gb=free_gb, busiest=others)


def _init_group(args: argparse.Namespace, device: str) -> None:
    """The rank's process group: NCCL with a GPU per rank; ranks sharing one GPU all-reduce
    their number over gloo. By the job's size, not the world of one a spare waits in: the rank
    it takes joins the survivors' group, whose backend they chose by the job's size."""
    import torch
    import torch.distributed as dist

    nccl = device == "cuda" and torch.cuda.device_count() >= args.nproc
    if nccl:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    backend = "nccl" if nccl else "gloo"
    if args.mode == "torch":
        # torchrun's restarted workers meet on its agent's store of the first attempt, whose
        # keys the new group would read (its gloo group never forms): a prefix of their own
        # per attempt.
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              is_master=False)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(backend, store=dist.PrefixStore(f"attempt-{attempt}", store),
                                rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
    else:
        dist.init_process_group(backend)


def _wait_for_spare(timeout_s: float = 600.0) -> None:
    """Waits until this node's spare has finished its set-up (before the first step)."""
    from elasticft.inprocess.protocol import InProcessSettings

    directory = InProcessSettings.from_env().directory
    deadline = time.monotonic() + timeout_s
    while directory is not None and time.monotonic() < deadline and not any(
            directory.glob("spare-*.json")):
        time.sleep(0.05)


def _is_spare() -> bool:
    from elasticft.inprocess.spare import is_spare

    return is_spare()


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    log = Path(args.log)
    device = args.device
    width = 8192 if args.gb >= 1 else 512
    # AdamW: parameters + two moments, fp32: 12 bytes per parameter.
    sharded = args.fsdp or args.tp
    layers = max(1, round(args.gb * (args.nproc if sharded else 1) * 1e9 / 12
                          / (width * width)))
    torch.manual_seed(0)
    model = None if sharded else torch.nn.Sequential(*[
        torch.nn.Linear(width, width, bias=False) for _ in range(layers)]).to(device)
    batch = torch.randn(args.batch, width, device=device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    spare = args.mode == "spare" and _is_spare()
    grouped = world > 1 or spare  # a spare is rank 0 of 1 until it takes the killed rank
    if grouped:
        _init_group(args, device)
    if model is None:  # sharded over the group
        model = (fsdp.build_tp if args.tp else fsdp.build)(width, layers, device)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device == "cuda")

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    log_record(log, event="built", startup_s=process_age_s())
    if args.mode != "torch":
        from elasticft.ckpt import Checkpointer, StateCapture

        ckpt = Checkpointer.from_env(optimizers=[optim])
        snapshot = StateCapture(model, optim)
    else:
        files: Any = (fsdp.DcpFiles(Path(args.ckpt_file).parent / "dcp") if sharded
                      else TorchFiles(args.ckpt_file, grouped))
    if spare:  # the state a first step makes, in memory it touches; the restore overwrites it
        model(batch).pow(2).mean().backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        sync()
        log_record(log, event="spare_ready", startup_s=process_age_s())

    def train() -> int:
        started = time.perf_counter()
        if args.mode != "torch":
            available = meminfo_gb()
            restored = ckpt.restore(model, optim)
            log_record(log, event="restore_call", seconds=time.perf_counter() - started,
                       mem_available_gb=available)
            start = int(restored[1]["step"]) if restored else 0
            if args.mode == "spare" and not start:
                _wait_for_spare()
        else:
            start = files.resume(model, optim, device)
        sync()
        log_record(log, event="start", resumed=start,
                   restore_s=time.perf_counter() - started if start else None)
        for step in range(start, args.steps):
            train_step(log, model, optim, batch, sync, grouped, step)
            if (step + 1) % args.every == 0:
                called = time.perf_counter()
                if args.mode != "torch":
                    request = ckpt.save(step + 1, snapshot(extra={"step": step + 1}))
                    log_record(log, event="save", step=step + 1,
                               save_s=time.perf_counter() - called)
                    # logged when its copy lands, off the training thread
                    threading.Thread(target=_landed, args=(log, request), daemon=True).start()
                else:
                    files.save(step + 1, model, optim)
                    log_record(log, event="save", step=step + 1,
                               save_s=time.perf_counter() - called)
        return start

    if args.mode in ("inprocess", "spare"):
        from elasticft.inprocess import InProcess

        start = InProcess(modules=[model] if sharded else []).run(train)
    else:
        start = train()
    if args.mode != "torch":
        ckpt.close()
        if start and device == "cpu":  # after training: not part of kill -> first step
            log_record(log, event="floor", **copy_floor())
    if grouped:
        dist.destroy_process_group()
    return 0
