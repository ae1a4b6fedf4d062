"""One launcher's run of bench/recovery_large.py, measured: the job started under the launcher,
its last rank SIGKILLed two steps after its ``--kill-after-saves``-th save, and the workers'
log and the agent's event log read back into a row of figures (see recovery_large.py for what
each means).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORKER_SPEC = "RECOVERY_LARGE_WORKER"
"""The environment variable that carries the worker's settings (the launchers parse options
that would clash): when set, bench/recovery_large.py runs as a worker."""
SCRIPT = Path(__file__).resolve().parent / "recovery_large.py"


MODES = {"elasticft-run": "elasticft", "elasticft-inprocess": "inprocess",
         "elasticft-newgroup": "inprocess", "elasticft-spare": "spare", "torchrun": "torch"}
"""Launcher name in the table → how the worker checkpoints and recovers."""

IN_PROCESS = ("elasticft-inprocess", "elasticft-newgroup", "elasticft-spare")
"""The launchers whose survivors keep their processes."""

LAUNCHER_FLAGS = {"elasticft-spare": ["--recovery-inprocess-spare"],
                  "elasticft-newgroup": ["--recovery-inprocess-regroup", "new-group"]}
"""elasticft-run's own flags per launcher: ``elasticft-newgroup`` is the in-process mode on a
new group where the installed torch would rebuild the old one in place (the same path as
``elasticft-inprocess`` on a torch without reconfigure)."""


def _launcher(name: str) -> list[str]:
    name = "torchrun" if name == "torchrun" else "elasticft-run"
    module = {"elasticft-run": "elasticft.run", "torchrun": "torch.distributed.run"}[name]
    script = Path(sys.executable).parent / name
    return [str(script)] if script.exists() else [sys.executable, "-m", module]


def _records(log: Path) -> list[dict[str, Any]]:
    """The whole records of the workers' log: one still being written (or torn by the kill),
    the text after the last newline, is not one yet."""
    if not log.exists():
        return []
    whole = log.read_text().rpartition("\n")[0]
    return [json.loads(line) for line in whole.splitlines() if line.strip()]


def measure(name: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Runs the job under launcher ``name``, kills its last rank, and returns its row."""
    exitcode, killed_at, victim = _run(name, args, tmp)
    row = _row(name, args, tmp, killed_at, victim)
    row.update(exit=exitcode, killed=killed_at is not None)
    if exitcode != 0 or killed_at is None:
        row["stderr_tail"] = (tmp / f"{name}.stderr").read_text()[-1500:]
    return row


def _run(name: str, args: argparse.Namespace, tmp: Path
         ) -> tuple[int | None, float | None, int | None]:
    """The job under launcher ``name`` until it ends (or ``--limit-s``): its exit status,
    when its last rank was SIGKILLed and that rank's pid."""
    log = tmp / f"{name}.jsonl"
    run_dir = tmp / f"run-{name}"
    mode = MODES[name]
    # The worker's settings go by environment: the launchers parse options that would clash.
    spec = {"mode": mode, "log": str(log), "device": args.device, "gb": args.gb,
            "every": args.every, "steps": args.steps, "batch": args.batch,
            "ckpt_file": str(tmp / "torch_ckpt.pt"), "nproc": args.nproc, "fsdp": args.fsdp,
            "tp": args.tp}
    worker_args = [str(SCRIPT)]
    nproc = str(args.nproc)
    if mode != "torch":
        command = [*_launcher(name), "--nproc-per-node", nproc, "--max-restarts", "1",
                   "--run-dir", str(run_dir), *LAUNCHER_FLAGS.get(name, []), *worker_args]
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
    return proc.returncode, killed_at, victim


def _newest_landed_on_every_rank(survivors: list[dict[str, Any]], killed_at: float | None,
                                 victim_landed: list[int]) -> int | None:
    """The newest step whose copy was seen landed in memory before the kill on the victim and
    on every other rank (the survivors' records logged before the kill)."""
    if not victim_landed or killed_at is None:
        return None
    newest = [victim_landed[-1]]
    for rank in {r.get("rank", 0) for r in survivors}:
        landed = [r["step"] for r in survivors if r.get("rank", 0) == rank
                  and r["event"] == "landed" and r["status"] == "memory" and r["t"] <= killed_at]
        newest.append(landed[-1] if landed else 0)
    return min(newest)


def _row(name: str, args: argparse.Namespace, tmp: Path, killed_at: float | None,
         victim: int | None) -> dict[str, Any]:
    """The figures of one launcher's run, from the workers' log and the agent's event log."""
    mode = MODES[name]
    victim_rank = args.nproc - 1
    records = _records(tmp / f"{name}.jsonl")
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
    # The restart resumes from the newest step whole on every rank: a survivor torn down
    # in its own copy of the victim's newest landed step leaves the step before.
    landed_everywhere = _newest_landed_on_every_rank(survivor, killed_at, landed_before)
    skipped_before = [r["step"] for r in before if r["event"] == "landed"
                      and r["status"] != "memory"]
    start_after = next((r for r in after if r["event"] == "start"), None)
    first_step = next((r for r in after if r["event"] == "step"), None)
    built_after = next((r for r in after if r["event"] == "built"), None)
    floor = next((r for r in after if r["event"] == "floor"), {})
    save_after = [r["save_s"] for r in after if r["event"] == "save"]
    first_run_saves = [r["save_s"] for r in before if r["event"] == "save"]
    row: dict[str, Any] = {
        "launcher": name,
        "kill_to_first_step_s": first_step["t"] - killed_at if first_step and killed_at else None,
        "restore_s": start_after.get("restore_s") if start_after else None,
        "resumed": start_after["resumed"] if start_after else None,
        "last_save": saves_before[-1] if saves_before else None,
        "last_landed": landed_everywhere,
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
        "first_step_busiest": first_step.get("busiest") if first_step else None,
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
    # The new worker's process start, from its own start-up: torchrun's restart counts from
    # the kill (no event log says when it decided), elasticft-run's from its decision, below.
    started_after = built_after["t"] - built_after["startup_s"] if built_after else None
    if mode == "torch" and started_after is not None and killed_at is not None:
        row["restart_s"] = started_after - killed_at
    if None not in (row["kill_to_first_step_s"], row["startup_s"], row["first_step_s"]):
        row["launcher_share_s"] = (row["kill_to_first_step_s"] - row["startup_s"]
                                   - row["first_step_s"])
    if mode != "torch" and killed_at is not None:
        events = []
        for path in (tmp / f"run-{name}").rglob("events-*.jsonl"):
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
            if mode == "elasticft" and started_after is not None:
                row["restart_s"] = started_after - decision["time"]
        row["in_process"] = next((e["phases"] for e in events
                                  if e["kind"] == "recover_in_process"), None)
    if mode != "torch":  # the workers' own account of an in-process recovery
        row["recovery_lines"] = [line.split("] ", 1)[-1] for line in (
            tmp / f"{name}.stderr").read_text().splitlines()
            if "took rank" in line or "rejoined in generation" in line]
    return row
