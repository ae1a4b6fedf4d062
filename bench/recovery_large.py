"""Crash recovery with gigabytes of state per rank: elasticft-run (restart and in process)
against torchrun, one run.

Each of ``--nproc`` workers trains an MLP whose parameters and AdamW state come to ``--gb`` GB
on ``--device`` (4.8 GB on CUDA by default, the size of docs/benchmarks.md's H100 run). Under
``elasticft-run`` with default options it uses the documented API (``Checkpointer.from_env``,
``StateCapture``, ``restore``) and saves every ``--every`` steps; under ``torchrun
--max-restarts 1`` the same script uses ``torch.save``/``torch.load`` at the same cadence. With
``--nproc 2`` or more the workers form a gloo (CUDA: NCCL) group and all-reduce one number per
step, the collective a survivor meets a dead peer in; the launcher ``elasticft-inprocess`` is
``elasticft-run`` with the loop under ``elasticft.inprocess.worker.InProcess``: the survivors
keep their processes (their group rebuilt in place by torch's reconfigure where the installed
torch has it; ``elasticft-newgroup`` makes a new group there, as an older torch does), and
``elasticft-spare`` is that with ``--recovery-inprocess-spare``: a
pre-started spare (its model built, its AdamW state made by one step of its own) takes the
killed rank; its workers wait for the spare to be ready before their first step, so the kill
finds it waiting. The last rank is SIGKILLed two steps after its ``--kill-after-saves``-th
save. Printed per launcher:

* kill -> first step: seconds from the SIGKILL to the first step the restarted worker finishes;
* failure -> decision: from the agent's event log (elasticft-run only);
* restore: seconds the restarted worker spent in ``restore()`` (or torch.load + load_state_dict);
* first saves: the save calls of the restarted worker, first ones apart from the later ones;
* resumed: the step the restarted worker resumed from, against the newest save issued before
  the kill and the newest one whose copy every rank was seen to land before it;
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
    python bench/recovery_large.py --device cpu --gb 1 --nproc 2 \
        --launchers elasticft-run,elasticft-inprocess,elasticft-newgroup  # both regroup paths

With ``--fsdp`` the model is sharded with FSDP2 over all ranks (``fully_shard`` on each layer and
on the root), ``--gb`` stays the state per rank (the model is ``--nproc`` times larger), the
in-process mode keeps the sharded model (``InProcess(modules=[model])``), and torchrun's
workers checkpoint with torch.distributed.checkpoint (a directory per step, the newest
committed one loaded after the restart); the spare does not take part:

    python bench/recovery_large.py --device cpu --gb 1 --nproc 2 --fsdp \
        --launchers torchrun,elasticft-run,elasticft-inprocess

``--tp`` is the same with the model tensor parallel instead (``parallelize_module``: the
layers split by column and by row in turn over a 1-D mesh of the ranks), kept and
checkpointed the same ways.

Then the phase table: a row per launcher, a column per phase of its recovery, ``-`` where
the mode has none (:mod:`recovery_large_phases` says what each column is). The last lines
compare kill -> first step of each mode with the restart mode's and torchrun's.
The worker is :mod:`recovery_large_worker` (its FSDP2 parts :mod:`recovery_large_fsdp`), one
launcher's run and its figures :mod:`recovery_large_measure`.

``bench/gpu_check.sh --parts recovery`` runs it on a GPU. Not a test: the numbers are the
machine's. The table also goes to ``$OUT/recovery_large.json`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

from fresh_memory import page_reporting  # bench/ is the path when run as a script
from recovery_large_measure import IN_PROCESS, MODES, WORKER_SPEC, measure
from recovery_large_phases import phase_table


def _fmt(value: Any, unit: str = "s") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}{unit}"
    return str(value)


def print_ratios(rows: list[dict[str, Any]]) -> None:
    """Kill -> first step of every launcher against the restart mode's and torchrun's; and the
    same less the restarted worker's first step (a step of the training, which other jobs on
    a shared machine lengthen by any amount: the recovery's own part)."""
    whole = {r["launcher"]: r["kill_to_first_step_s"] for r in rows
             if r["kill_to_first_step_s"]}
    own = {r["launcher"]: r["kill_to_first_step_s"] - r["first_step_s"] for r in rows
           if r["kill_to_first_step_s"] and r["first_step_s"] is not None}
    for what, seconds in (("kill -> first step", whole),
                          ("kill -> first step less that step", own)):
        for base in ("elasticft-run", "torchrun"):
            if base not in seconds:
                continue
            against = [f"{name} {value / seconds[base]:.2f}x"
                       for name, value in seconds.items() if name != base and seconds[base]]
            if against:
                print(f"{what} against {base} ({seconds[base]:.3f} s): " + ", ".join(against)
                      + ("; target for in process <= 0.50x" if base == "elasticft-run"
                         and what == "kill -> first step" and "elasticft-inprocess" in seconds
                         else ""))


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
    sharding = parser.add_mutually_exclusive_group()
    sharding.add_argument("--fsdp", action="store_true",
                          help="shard the model with FSDP2 over the ranks (--gb per rank)")
    sharding.add_argument("--tp", action="store_true",
                          help="split the model's layers tensor-parallel over the ranks "
                          "(--gb per rank)")
    if os.environ.get(WORKER_SPEC):
        from recovery_large_worker import worker

        return worker(argparse.Namespace(**json.loads(os.environ[WORKER_SPEC])))
    args = parser.parse_args()
    from elasticft.report.tor import phase_name  # not in the workers: not in their start-up

    if args.gb is None:
        args.gb = 4.8 if args.device == "cuda" else 3.0
    if not args.steps:
        args.steps = args.every * (args.kill_after_saves + 2) + 2
    import torch

    unknown = sorted(set(args.launchers.split(",")) - set(MODES))
    if unknown:
        parser.error(f"--launchers {','.join(unknown)}: unknown; choose from {', '.join(MODES)}")
    in_process = set(IN_PROCESS) & set(args.launchers.split(","))
    if in_process and args.nproc < 2:
        parser.error(f"--launchers {','.join(sorted(in_process))} needs --nproc 2 or more (a "
                     "survivor that keeps its process)")
    if (args.fsdp or args.tp) and ("elasticft-spare" in args.launchers.split(",")
                                   or args.nproc < 2):
        parser.error(f"--{'fsdp' if args.fsdp else 'tp'} runs torchrun, elasticft-run and "
                     "elasticft-inprocess on --nproc 2 or more")
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"recovery_large: no CUDA device (torch {torch.__version__}); nothing measured")
        return 0
    load_at_start = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory(prefix="recovery_large_") as tmp_name:
        for name in args.launchers.split(","):
            rows.append(measure(name, args, Path(tmp_name)))
    when = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
    where = (torch.cuda.get_device_name(0) if args.device == "cuda"
             else f"CPU ({platform.machine()}, {os.cpu_count()} cores)")
    print(f"recovery_large: {where}, torch {torch.__version__}, {when}; {args.gb} GB of state, "
          f"{args.nproc} rank(s){' (FSDP2)' if args.fsdp else ' (TP)' if args.tp else ''}, "
          f"a save every {args.every} "
          f"step(s), SIGKILL of the last rank two "
          f"steps after save "
          f"{args.kill_after_saves}; free page reporting: {page_reporting()} (new memory costs "
          f"more where it is on: bench/fresh_memory.py); load average (1 min) "
          f"{load_at_start:.2f} at the start, {os.getloadavg()[0]:.2f} at the end")
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
            if r.get("first_step_busiest"):
                print(f"{r['launcher']}: the processes that used the most CPU during that step: "
                      + "; ".join(f"{seconds:.1f} s {command}"
                                  for command, seconds in r["first_step_busiest"]))
    for r in rows:
        if r.get("survivor_pids") is not None:
            print(f"{r['launcher']}: rank 0 ran in {r['survivor_pids']} process(es); its first "
                  f"step after the kill {_fmt(r.get('survivor_first_step_s'))}, median step "
                  f"{_fmt(r.get('survivor_median_step_s'))}"
                  + ("; in-process phases " + ", ".join(
                      f"{phase_name(name)} {seconds:.3f} s"
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
                  f"target <= 1.2x the last (the same copy the restore makes); restore() "
                  f"alone {r['restore_call_s']:.3f} s")
    print("phases (s): kill -> the job's first step, a column per phase, '-' where the mode "
          "has none (bench/recovery_large_phases.py says what each is)")
    for line in phase_table(rows):
        print(line)
    print_ratios(rows)
    for r in rows:
        if "stderr_tail" in r:
            print(f"--- {r['launcher']} stderr (tail)\n{r['stderr_tail']}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "recovery_large.json").write_text(json.dumps(
            {"when": when, "gb": args.gb, "device": args.device, "rows": rows}, indent=1))
    return 0 if all(r["exit"] == 0 and r["killed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
