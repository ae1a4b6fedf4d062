"""Crash recovery with gigabytes of state per rank: elasticft-run (restart and in process)
against torchrun, one run.

Each of ``--nproc`` workers trains an MLP whose parameters and AdamW state come to ``--gb`` GB
on ``--device`` (4.8 GB on CUDA by default, the size of docs/benchmarks.md's H100 run). Under
``elasticft-run`` with default options it uses the documented API (``Checkpointer.from_env``,
``StateCapture``, ``restore``) and saves every ``--every`` steps; under ``torchrun
--max-restarts 1`` the same script uses ``torch.save``/``torch.load`` at the same cadence. With
``--nproc 2`` or more the workers form a gloo (CUDA: NCCL) group and all-reduce one number per
step, the collective a survivor meets a dead peer in; the launcher ``elasticft-inprocess`` is
``elasticft-run`` with the loop under ``elasticft.recovery.inprocess.InProcess``: the survivors
keep their processes, and ``elasticft-spare`` is that with ``--recovery-inprocess-spare``: a
pre-started spare (its model built, its AdamW state made by one step of its own) takes the
killed rank; its workers wait for the spare to be ready before their first step, so the kill
finds it waiting. The last rank is SIGKILLed two steps after its ``--kill-after-saves``-th
save. Printed per launcher:

* kill -> first step: seconds from the SIGKILL to the first step the restarted worker finishes;
* failure -> decision: from the agent's event log (elasticft-run only);
* restore: seconds the restarted worker spent in ``restore()`` (or torch.load + load_state_dict);
* first saves: the save calls of the restarted worker, first ones apart from the later ones;
* resumed: the step the restarted worker resumed from, against the newest save issued before
  the kill (and whether that save's copy had landed);
* kill -> first step split into the restarted script's own start-up (process start to model
  built), its first step, and the rest: what the launcher and the restore cost;
* on CPU, the copy floor: the same bytes copied out of /dev/shm by plain numpy in the
  restarted worker (after training), into fresh memory and into touched memory;
* survivors (``--nproc`` 2 or more): whether rank 0 kept its process, and its first step after
  the kill against its median step.

    python bench/recovery_large.py                          # CUDA, 4.8 GB
    python bench/recovery_large.py --device cpu --gb 3      # the CPU bench (docs/benchmarks.md)
    python bench/recovery_large.py --device cpu --gb 0.05   # a dry run (tests/bench)
    python bench/recovery_large.py --device cpu --gb 1 --nproc 2 \
        --launchers torchrun,elasticft-run,elasticft-inprocess  # the three modes
    python bench/recovery_large.py --device cpu --gb 1 --nproc 2 \
        --launchers elasticft-run,elasticft-inprocess,elasticft-spare  # and with the spare

With ``--fsdp`` the model is sharded with FSDP2 over all ranks (``fully_shard`` on each layer and
on the root), ``--gb`` stays the state per rank (the model is ``--nproc`` times larger), and the
in-process mode keeps the sharded model (``InProcess(modules=[model])``); torchrun and the
spare do not take part:

    python bench/recovery_large.py --device cpu --gb 1 --nproc 2 --fsdp \
        --launchers elasticft-run,elasticft-inprocess

``bench/gpu_check.sh --parts recovery`` runs it on a GPU. Not a test: the numbers are the
machine's. The table also goes to ``$OUT/recovery_large.json`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from fresh_memory import page_reporting  # bench/ is the path when run as a script
from machine_counters import machine_cpu, meminfo_gb, page_counters, process_age_s, thread_cpu

ROOT = Path(__file__).resolve().parents[1]
WORKER_SPEC = "RECOVERY_LARGE_WORKER"


# ----------------------------------------------------------------------------------------------
# The worker (run by the launcher).


def _log(path: Path, **record: Any) -> None:
    record.update(t=time.time(), pid=os.getpid(), rank=int(os.environ.get("RANK", "0")))
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def _landed(log: Path, request: Any) -> None:
    with contextlib.suppress(Exception):  # the status says it
        request.wait(600)
    _log(log, event="landed", step=request.step, status=request.status)


def _copy_floor() -> dict[str, float]:
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


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    log = Path(args.log)
    device = args.device
    width = 8192 if args.gb >= 1 else 512
    # AdamW: parameters + two moments, fp32: 12 bytes per parameter.
    fsdp = args.fsdp
    layers = max(1, round(args.gb * (args.nproc if fsdp else 1) * 1e9 / 12 / (width * width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False)
                                  for _ in range(layers)]).to(device)
    batch = torch.randn(args.batch, width, device=device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    spare = args.mode == "spare" and _is_spare()
    grouped = world > 1 or spare  # a spare is rank 0 of 1 until it takes the killed rank
    if grouped:
        # NCCL with a GPU per rank; ranks sharing one GPU all-reduce their number over gloo.
        # By the job's size, not the world of one a spare waits in: the rank it takes joins
        # the survivors' group, whose backend they chose by the job's size.
        nccl = device == "cuda" and torch.cuda.device_count() >= args.nproc
        if nccl:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl" if nccl else "gloo"
        if args.mode == "torch":
            # torchrun's restarted workers meet on its agent's store of the first attempt,
            # whose keys the new group would read (its gloo group never forms): a prefix of
            # their own per attempt.
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                  is_master=False)
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            dist.init_process_group(backend, store=dist.PrefixStore(f"attempt-{attempt}", store),
                                    rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]))
        else:
            dist.init_process_group(backend)
    if fsdp:  # over every rank, torchtitan's way; no collective: a replacement's set-up
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device == "cuda")

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    _log(log, event="built", startup_s=process_age_s())
    if args.mode != "torch":
        from elasticft.ckpt import Checkpointer, StateCapture

        ckpt = Checkpointer.from_env(optimizers=[optim])
        snapshot = StateCapture(model, optim)
    if spare:  # the state a first step makes, in memory it touches; the restore overwrites it
        model(batch).pow(2).mean().backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        sync()
        _log(log, event="spare_ready", startup_s=process_age_s())

    def train() -> int:
        start = 0
        started = time.perf_counter()
        if args.mode != "torch":
            called = time.perf_counter()
            available = meminfo_gb()
            restored = ckpt.restore(model, optim)
            _log(log, event="restore_call", seconds=time.perf_counter() - called,
                 from_env_s=called - started, mem_available_gb=available)
            start = int(restored[1]["step"]) if restored else 0
            if args.mode == "spare" and not start:
                _wait_for_spare()
        else:
            base = f"{args.ckpt_file}.{os.environ.get('RANK', '0')}"
            path = _torch_resume_file(base, grouped)
            if path is not None:
                state = torch.load(path, map_location=device, weights_only=True)
                model.load_state_dict(state["model"])
                optim.load_state_dict(state["optim"])
                start = int(state["step"])
                del state
        sync()
        _log(log, event="start", resumed=start, restore_s=time.perf_counter() - started
             if start else None)
        for step in range(start, args.steps):
            _train_step(args, log, model, optim, batch, sync, grouped, step)
            if (step + 1) % args.every == 0:
                called = time.perf_counter()
                if args.mode != "torch":
                    request = ckpt.save(step + 1, snapshot(extra={"step": step + 1}))
                    save_s = time.perf_counter() - called
                    request_of = request
                else:
                    saved = Path(f"{base}.step{step + 1}")
                    torch.save({"model": model.state_dict(), "optim": optim.state_dict(),
                                "step": step + 1}, f"{saved}.tmp")
                    os.replace(f"{saved}.tmp", saved)
                    for old in _torch_steps(base)[:-2]:  # the newest two stay
                        Path(f"{base}.step{old}").unlink(missing_ok=True)
                    save_s, request_of = time.perf_counter() - called, None
                _log(log, event="save", step=step + 1, save_s=save_s)
                if request_of is not None:  # logged when its copy lands, off the training thread
                    threading.Thread(target=_landed, args=(log, request_of), daemon=True).start()
        return start

    if args.mode in ("inprocess", "spare"):
        from elasticft.recovery.inprocess import InProcess

        start = InProcess(modules=[model] if fsdp else []).run(train)
    else:
        start = train()
    if args.mode != "torch":
        ckpt.close()
        if start and device == "cpu":  # after training: not part of kill -> first step
            _log(log, event="floor", **_copy_floor())
    if grouped:
        dist.destroy_process_group()
    return 0


def _is_spare() -> bool:
    from elasticft.recovery.spare import is_spare

    return is_spare()


def _wait_for_spare(timeout_s: float = 600.0) -> None:
    """Waits until this node's spare has finished its set-up (before the first step)."""
    from elasticft.recovery.protocol import InProcessSettings

    directory = InProcessSettings.from_env().directory
    deadline = time.monotonic() + timeout_s
    while directory is not None and time.monotonic() < deadline and not any(
            directory.glob("spare-*.json")):
        time.sleep(0.05)


def _torch_steps(base: str) -> list[int]:
    """Steps of the torch.save files of one rank, oldest first."""
    return sorted(int(p.name.rsplit(".step", 1)[1]) for p in Path(base).parent.glob(
        f"{Path(base).name}.step*") if p.name.rsplit(".step", 1)[1].isdigit())


def _torch_resume_file(base: str, grouped: bool) -> Path | None:
    """The torch.save file of the newest step every rank holds (each keeps its newest two: a
    rank killed during a save holds one step fewer than the others)."""
    import torch
    import torch.distributed as dist

    held = _torch_steps(base)
    newest = torch.tensor([held[-1] if held else 0])
    if grouped:
        dist.all_reduce(newest, op=dist.ReduceOp.MIN)
    step = int(newest.item())
    return Path(f"{base}.step{step}") if step in held else None


def _train_step(args: argparse.Namespace, log: Path, model: Any, optim: Any, batch: Any,
                sync: Any, grouped: bool, step: int) -> None:
    """One step, logged with what its time went to; in a group, with its one all-reduce."""
    import torch
    import torch.distributed as dist

    # Read before and after the step, outside its time: where a slow step's time goes.
    threads, machine, vmstat = thread_cpu(), machine_cpu(), page_counters()
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
    tick = os.sysconf("SC_CLK_TCK")
    # CPU of its own (by thread), page faults, waiting for a core, and what the whole
    # machine did meanwhile (the agent, the launcher, the kernel).
    _log(log, event="step", step=step + 1, step_s=step_s,
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
         mem_free_gb=free_gb)


# ----------------------------------------------------------------------------------------------
# The driver.


MODES = {"elasticft-run": "elasticft", "elasticft-inprocess": "inprocess",
         "elasticft-spare": "spare", "torchrun": "torch"}
"""Launcher name in the table → how the worker checkpoints and recovers."""


def _launcher(name: str) -> list[str]:
    name = "torchrun" if name == "torchrun" else "elasticft-run"
    module = {"elasticft-run": "elasticft.run", "torchrun": "torch.distributed.run"}[name]
    script = Path(sys.executable).parent / name
    return [str(script)] if script.exists() else [sys.executable, "-m", module]


def _records(log: Path) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def measure(name: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    log = tmp / f"{name}.jsonl"
    run_dir = tmp / f"run-{name}"
    mode = MODES[name]
    # The worker's settings go by environment: the launchers parse options that would clash.
    spec = {"mode": mode, "log": str(log), "device": args.device, "gb": args.gb,
            "every": args.every, "steps": args.steps, "batch": args.batch,
            "ckpt_file": str(tmp / "torch_ckpt.pt"), "nproc": args.nproc, "fsdp": args.fsdp}
    worker_args = [str(Path(__file__).resolve())]
    nproc = str(args.nproc)
    if mode != "torch":
        spare = ["--recovery-inprocess-spare"] if mode == "spare" else []
        command = [*_launcher(name), "--nproc-per-node", nproc, "--max-restarts", "1",
                   "--run-dir", str(run_dir), *spare, *worker_args]
    else:
        command = [*_launcher("torchrun"), "--nproc-per-node", nproc, "--max-restarts", "1",
                   "--standalone", "--log-dir", str(tmp / "torchrun-logs"), *worker_args]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               **{WORKER_SPEC: json.dumps(spec)})
    kill_step = args.every * args.kill_after_saves + 2
    victim_rank = args.nproc - 1
    with (tmp / f"{name}.stderr").open("w") as stderr:
        proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=stderr,
                                start_new_session=True)
    killed_at: float | None = None
    victim: int | None = None
    deadline = time.monotonic() + args.limit_s
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            records = _records(log)
            if killed_at is None:
                hit = [r for r in records if r["event"] == "step" and r["step"] == kill_step
                       and r.get("rank", 0) == victim_rank]
                if hit:
                    victim = hit[0]["pid"]
                    killed_at = time.time()
                    os.kill(victim, signal.SIGKILL)
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    records = _records(log)
    survivor = [r for r in records if r.get("rank", 0) != victim_rank]
    records = [r for r in records if r.get("rank", 0) == victim_rank]
    before = [r for r in records if r["pid"] == victim]
    after = [r for r in records if killed_at is not None and r["pid"] != victim
             and r["t"] > killed_at]
    saves_before = [r["step"] for r in before if r["event"] == "save"]
    # A save that was skipped (no free slot: the agent's persist held the other one) or failed
    # never landed: only a snapshot whole in memory is one the restart must resume from.
    landed_before = [r["step"] for r in before if r["event"] == "landed"
                     and r["status"] == "memory"]
    skipped_before = [r["step"] for r in before if r["event"] == "landed"
                      and r["status"] != "memory"]
    start_after = next((r for r in after if r["event"] == "start"), None)
    first_step = next((r for r in after if r["event"] == "step"), None)
    built_after = next((r for r in after if r["event"] == "built"), None)
    floor = next((r for r in after if r["event"] == "floor"), {})
    save_after = [r["save_s"] for r in after if r["event"] == "save"]
    first_run_saves = [r["save_s"] for r in before if r["event"] == "save"]
    row: dict[str, Any] = {
        "launcher": name, "exit": proc.returncode, "killed": killed_at is not None,
        "kill_to_first_step_s": first_step["t"] - killed_at if first_step and killed_at else None,
        "restore_s": start_after.get("restore_s") if start_after else None,
        "resumed": start_after["resumed"] if start_after else None,
        "last_save": saves_before[-1] if saves_before else None,
        "last_landed": landed_before[-1] if landed_before else None,
        "not_landed": skipped_before,
        "first_saves_s": (first_run_saves[:2], save_after[:2]),
        "later_save_s": statistics.median(first_run_saves[2:] + save_after[2:])
        if len(first_run_saves[2:] + save_after[2:]) else None,
        "failure_to_decision_s": None,
        "startup_s": built_after["startup_s"] if built_after else None,
        "first_step_s": first_step.get("step_s") if first_step else None,
        "steady_step_s": statistics.median(steps) if (steps := [
            r["step_s"] for r in before + after if r["event"] == "step"][1:]) else None,
        "mem_available_gb": next((r.get("mem_available_gb") for r in after
                                  if r["event"] == "restore_call"), None),
        "first_step_usage": {k: first_step.get(k) for k in ("user_s", "sys_s", "minor_faults",
                                                            "preempted")} if first_step else {},
        "first_step_threads": first_step.get("threads") if first_step else None,
        "first_step_machine_s": first_step.get("machine_s") if first_step else None,
        "first_step_vmstat": first_step.get("vmstat") if first_step else None,
        "first_step_mem_free_gb": first_step.get("mem_free_gb") if first_step else None,
        "floor_fresh_s": floor.get("floor_fresh_s"),
        "floor_touched_s": floor.get("floor_touched_s"),
        "floor_fresh_parallel_s": floor.get("floor_fresh_parallel_s"),
        "restore_call_s": next((r["seconds"] for r in after if r["event"] == "restore_call"),
                               None),
    }
    took = next((r for r in survivor if r["event"] == "spare_ready" and first_step
                 and r["pid"] == first_step["pid"]), None)
    row["spare_setup_s"] = took["startup_s"] if took else None
    if survivor and killed_at is not None:
        # Rank 0: did it keep its process, and how long was its first step after the kill?
        steps0 = [r for r in survivor if r["event"] == "step" and r.get("rank") == 0]
        later = [r for r in steps0 if r["t"] > killed_at]
        row["survivor_pids"] = len({r["pid"] for r in steps0})
        row["survivor_first_step_s"] = later[0]["step_s"] if later else None
        row["survivor_median_step_s"] = statistics.median(
            [r["step_s"] for r in steps0[1:]]) if len(steps0) > 1 else None
    if None not in (row["kill_to_first_step_s"], row["startup_s"], row["first_step_s"]):
        row["launcher_share_s"] = (row["kill_to_first_step_s"] - row["startup_s"]
                                   - row["first_step_s"])
    if mode != "torch" and killed_at is not None:
        events = []
        for path in run_dir.rglob("events-*.jsonl"):
            events += [json.loads(line) for line in path.read_text().splitlines() if line]
        failure = next((e for e in events if e["kind"] == "failure" and e["time"] >= killed_at),
                       None)
        decision = next((e for e in events if e["kind"] == "decision" and failure
                         and e["time"] >= failure["time"]), None)
        row["snapshots_skipped"] = sum(e["kind"] == "snapshot_skipped" for e in events)
        if failure is not None:
            row["kill_to_failure_s"] = failure["time"] - killed_at
        if failure is not None and decision is not None:
            row["failure_to_decision_s"] = decision["time"] - failure["time"]
        row["in_process"] = next((e["phases"] for e in events
                                  if e["kind"] == "recover_in_process"), None)
    if mode != "torch":  # the workers' own account of an in-process recovery
        row["recovery_lines"] = [line.split("] ", 1)[-1] for line in (
            tmp / f"{name}.stderr").read_text().splitlines()
            if "took rank" in line or "rejoined in generation" in line]
    if proc.returncode != 0 or killed_at is None:
        row["stderr_tail"] = (tmp / f"{name}.stderr").read_text()[-1500:]
    return row


def _fmt(value: Any, unit: str = "s") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}{unit}"
    return str(value)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--gb", type=float, default=None,
                        help="GB of parameters + AdamW state (default: 4.8 on CUDA, 3 on CPU)")
    parser.add_argument("--every", type=int, default=1, help="save every N steps")
    parser.add_argument("--kill-after-saves", type=int, default=3,
                        help="SIGKILL two steps after this many saves")
    parser.add_argument("--steps", type=int, default=0,
                        help="steps in all (default: two saves past the kill)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--limit-s", type=float, default=900.0, help="per launcher")
    parser.add_argument("--launchers", default="elasticft-run,torchrun",
                        help=f"any of {', '.join(MODES)}")
    parser.add_argument("--nproc", type=int, default=1,
                        help="workers (the in-process modes need 2 or more: a survivor)")
    parser.add_argument("--fsdp", action="store_true",
                        help="shard the model with FSDP2 over the ranks (--gb per rank)")
    if os.environ.get(WORKER_SPEC):
        return worker(argparse.Namespace(**json.loads(os.environ[WORKER_SPEC])))
    args = parser.parse_args()
    if args.gb is None:
        args.gb = 4.8 if args.device == "cuda" else 3.0
    if not args.steps:
        args.steps = args.every * (args.kill_after_saves + 2) + 2
    import torch

    unknown = sorted(set(args.launchers.split(",")) - set(MODES))
    if unknown:
        parser.error(f"--launchers {','.join(unknown)}: unknown; choose from {', '.join(MODES)}")
    in_process = {"elasticft-inprocess", "elasticft-spare"} & set(args.launchers.split(","))
    if in_process and args.nproc < 2:
        parser.error(f"--launchers {','.join(sorted(in_process))} needs --nproc 2 or more (a "
                     "survivor that keeps its process)")
    if args.fsdp and ({"torchrun", "elasticft-spare"} & set(args.launchers.split(","))
                      or args.nproc < 2):
        parser.error("--fsdp runs elasticft-run and elasticft-inprocess on --nproc 2 or more")
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"recovery_large: no CUDA device (torch {torch.__version__}); nothing measured")
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="recovery_large_") as tmp_name:
        for name in args.launchers.split(","):
            rows.append(measure(name, args, Path(tmp_name)))
    when = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
    where = (torch.cuda.get_device_name(0) if args.device == "cuda"
             else f"CPU ({platform.machine()}, {os.cpu_count()} cores)")
    print(f"recovery_large: {where}, torch {torch.__version__}, {when}; {args.gb} GB of state, "
          f"{args.nproc} rank(s){' (FSDP2)' if args.fsdp else ''}, a save every {args.every} "
          f"step(s), SIGKILL of the last rank two "
          f"steps after save "
          f"{args.kill_after_saves}; free page reporting: {page_reporting()} (new memory costs "
          f"more where it is on: bench/fresh_memory.py)")
    print(f"{'launcher':<14} {'kill->step':>10} {'kill->fail':>10} {'fail->dec':>10} "
          f"{'restore':>9} {'resumed':>8} {'last save':>9} {'landed':>7}  saves: first (run 1 | "
          f"restarted), later median")
    for r in rows:
        first = " ".join(f"{s:.3f}" for s in r["first_saves_s"][0])
        again = " ".join(f"{s:.3f}" for s in r["first_saves_s"][1])
        print(f"{r['launcher']:<14} {_fmt(r['kill_to_first_step_s']):>10} "
              f"{_fmt(r.get('kill_to_failure_s')):>10} {_fmt(r['failure_to_decision_s']):>10} "
              f"{_fmt(r['restore_s']):>9} {_fmt(r['resumed']):>8} {_fmt(r['last_save']):>9} "
              f"{_fmt(r['last_landed']):>7}  {first} | {again}, {_fmt(r['later_save_s'])}"
              + ("" if r["exit"] == 0 and r["killed"] else f"  (exit {r['exit']}, "
                 f"killed: {r['killed']})")
              + (f"  (saves skipped or failed: {r['not_landed']})" if r.get("not_landed") else ""))
    print(f"{'launcher':<14} {'start-up':>10} {'1st step':>10} {'rest':>10}   kill -> first step "
          "= the restarted script's start-up (process start to model built) + its first step "
          "+ the rest (detection, decision, restart, restore)")
    for r in rows:
        print(f"{r['launcher']:<14} {_fmt(r['startup_s']):>10} {_fmt(r['first_step_s']):>10} "
              f"{_fmt(r.get('launcher_share_s')):>10}")
    for r in rows:
        usage = r.get("first_step_usage") or {}
        if None not in usage.values() and usage:
            print(f"{r['launcher']}: first step after the restart: {_fmt(r['first_step_s'])}, "
                  f"of it CPU {usage['user_s']:.2f} s user + {usage['sys_s']:.2f} s system, "
                  f"{usage['minor_faults']} page faults, preempted {usage['preempted']} times; "
                  f"median step {_fmt(r['steady_step_s'])}"
                  + (f"; {r['mem_available_gb']:.1f} GB available at the restore"
                     if r.get("mem_available_gb") else ""))
            if r.get("first_step_threads") is not None:
                by_thread = ", ".join(f"{name} {u:.2f}+{s:.2f}" for name, (u, s) in sorted(
                    r["first_step_threads"].items(), key=lambda kv: -sum(kv[1])))
                user, system, idle = r["first_step_machine_s"]
                print(f"{r['launcher']}: that step's CPU by thread (user+system s): {by_thread}; "
                      f"the whole machine meanwhile: {user:.2f} s user, {system:.2f} s system, "
                      f"{idle:.2f} s idle; the kernel's page counters: {r['first_step_vmstat']}; "
                      f"{r['first_step_mem_free_gb']:.1f} GB free before it")
    for r in rows:
        if r.get("survivor_pids") is not None:
            print(f"{r['launcher']}: rank 0 ran in {r['survivor_pids']} process(es); its first "
                  f"step after the kill {_fmt(r.get('survivor_first_step_s'))}, median step "
                  f"{_fmt(r.get('survivor_median_step_s'))}"
                  + ("; in-process phases " + ", ".join(
                      f"{name.removesuffix('_s')} {seconds:.3f} s"
                      for name, seconds in r["in_process"].items())
                     if r.get("in_process") else "")
                  + (f"; the spare that took the rank was ready {r['spare_setup_s']:.2f} s "
                     "after its start" if r.get("spare_setup_s") else ""))
    for r in rows:
        for line in r.get("recovery_lines", []):
            print(f"{r['launcher']}: {line}")
    for r in rows:
        if "snapshots_skipped" in r:
            print(f"{r['launcher']}: snapshots skipped: {r['snapshots_skipped']}")
        if r.get("floor_fresh_s") and r.get("restore_s"):
            print(f"{r['launcher']}: restore {r['restore_s']:.3f} s; a plain copy of the same "
                  f"bytes out of /dev/shm in that process: {r['floor_fresh_s']:.3f} s into fresh "
                  f"memory ({r['restore_s'] / r['floor_fresh_s']:.2f}x), "
                  f"{r['floor_touched_s']:.3f} s into touched memory "
                  f"({r['restore_s'] / r['floor_touched_s']:.2f}x), "
                  f"{r['floor_fresh_parallel_s']:.3f} s into fresh memory on every core as a "
                  f"restore copies ({r['restore_s'] / r['floor_fresh_parallel_s']:.2f}x); "
                  f"target <= 2x; restore() alone {r['restore_call_s']:.3f} s")
    for r in rows:
        if "stderr_tail" in r:
            print(f"--- {r['launcher']} stderr (tail)\n{r['stderr_tail']}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "recovery_large.json").write_text(json.dumps(
            {"when": when, "gb": args.gb, "device": args.device, "rows": rows}, indent=1))
    return 0 if all(r["exit"] == 0 and r["killed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
