"""Kill/restart cycles: plain torchrun against elasticft-run, in the same run.

Each launcher trains examples/train_plain.py with 2 gloo workers; every time a step completes
after the previous recovery, one worker is SIGKILLed (alternating ranks). A cycle succeeds when
training makes progress again; the restart latency is the time from the kill to the first step
completed after it. elasticft-run runs with cold restarts here (bench/restart_breakdown.py
compares cold and warm). Prints per-launcher success counts, the median latency and the ratio.

    python bench/restart_cycles.py --cycles 10
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def step_lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def workers_of(launcher: psutil.Process) -> list[psutil.Process]:
    workers = []
    try:
        children = launcher.children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    for child in children:
        try:
            if "train_plain.py" in " ".join(child.cmdline()):
                workers.append(child)
        except psutil.Error:
            continue
    return sorted(workers, key=lambda p: p.pid)


def run_cycles(tool: str, cycles: int, workdir: Path, progress_timeout: float) -> dict:
    loss_log = workdir / f"{tool}-losses.txt"
    command = [
        str(BIN / tool), "--standalone", "--nproc-per-node", "2", "--max-restarts", str(cycles + 2),
        str(ROOT / "examples" / "train_plain.py"), "--steps", "100000", "--ckpt-every", "5",
        "--ckpt-dir", str(workdir / f"{tool}-ckpt"), "--loss-log", str(loss_log),
    ]
    if tool == "elasticft-run":
        # Cold restarts, as torchrun does them: idle warm-pool interpreters share the worker's
        # command line, and workers_of() would pick them. bench/restart_breakdown.py measures
        # warm starts.
        command[1:1] = ["--run-dir", str(workdir / "run"), "--warm-start", "false"]
    env = {**os.environ, "LOGLEVEL": "ERROR", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    launcher = psutil.Process(proc.pid)
    latencies: list[float] = []
    failed = 0
    try:
        deadline = time.monotonic() + progress_timeout
        while step_lines(loss_log) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        for cycle in range(cycles):
            workers = workers_of(launcher)
            if len(workers) < 2 or proc.poll() is not None:
                failed += cycles - cycle
                break
            before = step_lines(loss_log)
            killed_at = time.monotonic()
            workers[cycle % 2].send_signal(signal.SIGKILL)
            deadline = killed_at + progress_timeout
            while step_lines(loss_log) <= before and time.monotonic() < deadline:
                if proc.poll() is not None:
                    break
                time.sleep(0.02)
            if step_lines(loss_log) > before:
                latencies.append(time.monotonic() - killed_at)
            else:
                failed += 1
            time.sleep(0.5)  # let the new attempt settle before the next kill
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return {"ok": len(latencies), "failed": failed, "latencies": latencies}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=10)
    parser.add_argument("--progress-timeout", type=float, default=60.0)
    args = parser.parse_args()
    print(f"# restart cycles, {datetime.date.today()}, {platform.node()}, {os.cpu_count()} CPUs, "
          f"python {platform.python_version()}")
    results = {}
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        for tool in ("torchrun", "elasticft-run"):
            results[tool] = run_cycles(tool, args.cycles, Path(tmp), args.progress_timeout)
            r = results[tool]
            median = statistics.median(r["latencies"]) if r["latencies"] else float("nan")
            print(f"{tool:14s} cycles ok {r['ok']:2d}/{args.cycles}  failed {r['failed']:2d}  "
                  f"median restart latency {median:.2f} s")
    ours, theirs = results["elasticft-run"], results["torchrun"]
    if ours["latencies"] and theirs["latencies"]:
        ratio = statistics.median(theirs["latencies"]) / statistics.median(ours["latencies"])
        print(f"median latency ratio torchrun/elasticft-run: {ratio:.2f}x")
    print(f"successful cycles: torchrun {theirs['ok']}, elasticft-run {ours['ok']} "
          f"of {args.cycles}")


if __name__ == "__main__":
    main()
