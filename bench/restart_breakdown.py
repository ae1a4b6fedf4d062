"""Where a restart's time goes: torchrun, elasticft-run cold, elasticft-run warm, in one run.

Each launcher trains examples/train_plain.py with 2 gloo workers. Once training is steady (and
the warm pool refilled), one worker is SIGKILLed; the restart latency is the time from the kill
to the first step completed after it (a new line in the loss log). Repeated --cycles times.
Prints, per launcher, the median latency and the median time of each phase after the kill:

* agent side (elasticft-run's event log): failure detected, decision, rendezvous done,
  workers started;
* worker side (a probe ``sitecustomize`` on PYTHONPATH, which the workers inherit): the
  script's interpreter start-up done, ``import torch`` done, ``init_process_group`` returned.

    python bench/restart_breakdown.py --cycles 5
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import glob
import json
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

# Records, per worker process, when start-up reached a point. Bench-only: it wraps
# init_process_group to time it, which the library itself never does.
PROBE = r'''
import json, os, sys, time
_dir = os.environ.get("RESTART_PROBE_DIR")

def _mark(what):
    with open(os.path.join(_dir, f"{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "what": what, "time": time.time()}) + "\n")

def _after_torch(torch):
    _mark("torch_imported")
    import torch.distributed as dist
    original = dist.init_process_group
    def init_process_group(*args, **kwargs):
        result = original(*args, **kwargs)
        _mark("process_group_ready")
        return result
    dist.init_process_group = init_process_group

if _dir:
    _mark("script_start")
    if "torch" in sys.modules:
        _after_torch(sys.modules["torch"])
    else:
        import importlib.abc, importlib.util
        class _AfterTorch(importlib.abc.MetaPathFinder):
            busy = False
            def find_spec(self, name, path, target=None):
                if name != "torch" or self.busy:
                    return None
                self.busy = True
                try:
                    spec = importlib.util.find_spec(name)
                finally:
                    self.busy = False
                exec_module = spec.loader.exec_module
                def run(module):
                    exec_module(module)
                    sys.meta_path.remove(self)
                    _after_torch(module)
                spec.loader.exec_module = run
                return spec
        sys.meta_path.insert(0, _AfterTorch())
'''

LAUNCHERS = {
    "torchrun": ("torchrun", []),
    "elasticft-run cold": ("elasticft-run", ["--warm-start", "false"]),
    "elasticft-run warm": ("elasticft-run", ["--warm-start", "true"]),
}
AGENT_PHASES = [("failure", "failure detected"), ("decision", "decision"),
                ("rendezvous", "rendezvous done"), ("workers_started", "workers started")]
WORKER_PHASES = [("script_start", "script start-up done"), ("torch_imported", "import torch done"),
                 ("process_group_ready", "init_process_group done")]


def step_lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def workers_of(launcher: psutil.Process) -> list[psutil.Process]:
    workers = []
    with contextlib.suppress(psutil.NoSuchProcess):
        for child in launcher.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                # A pre-started interpreter has the same command line but is not in the
                # launcher's process tree as a worker until started: skip those still idle.
                if "train_plain.py" in " ".join(child.cmdline()) and _has_run_script(child):
                    workers.append(child)
    return sorted(workers, key=lambda p: p.pid)


def new_groups_ready(probe_dir: Path, old_pids: set[int]) -> int:
    """How many workers started after the kill have returned from init_process_group."""
    count = 0
    for path in probe_dir.glob("*.jsonl"):
        if int(path.stem) not in old_pids and '"process_group_ready"' in path.read_text():
            count += 1
    return count


def _has_run_script(process: psutil.Process) -> bool:
    probe_dir = Path(process.environ().get("RESTART_PROBE_DIR", "/nonexistent"))
    return (probe_dir / f"{process.pid}.jsonl").exists()


def run_launcher(name: str, cycles: int, workdir: Path, settle: float, timeout: float) -> dict:
    tool, flags = LAUNCHERS[name]
    slug = name.replace(" ", "-")
    loss_log, probe_dir, run_dir = (workdir / f"{slug}-losses.txt", workdir / f"{slug}-probe",
                                    workdir / f"{slug}-run")
    probe_dir.mkdir()
    command = [str(BIN / tool), "--standalone", "--nproc-per-node", "2", "--max-restarts",
               str(cycles + 2), *flags]
    if tool == "elasticft-run":
        command += ["--run-dir", str(run_dir)]
    command += [str(ROOT / "examples" / "train_plain.py"), "--steps", "100000", "--ckpt-every",
                "5", "--ckpt-dir", str(workdir / f"{slug}-ckpt"), "--loss-log", str(loss_log)]
    env = {**os.environ, "LOGLEVEL": "ERROR", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(workdir / "probe"),
                                                       os.environ.get("PYTHONPATH")])),
           "RESTART_PROBE_DIR": str(probe_dir)}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    launcher = psutil.Process(proc.pid)
    kills: list[float] = []
    latencies: list[float] = []
    failed = 0
    try:
        deadline = time.monotonic() + timeout
        while step_lines(loss_log) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        for cycle in range(cycles):
            time.sleep(settle)  # steady training; the warm pool has refilled
            workers = workers_of(launcher)
            if len(workers) < 2 or proc.poll() is not None:
                failed += cycles - cycle
                break
            old = {w.pid for w in workers}
            killed_at, killed_wall = time.monotonic(), time.time()
            workers[cycle % 2].send_signal(signal.SIGKILL)
            deadline = killed_at + timeout
            # The survivor may still log the step it was in; count only steps logged after
            # both new workers have their process group.
            lines_when_ready = None
            while time.monotonic() < deadline and proc.poll() is None:
                if lines_when_ready is None and new_groups_ready(probe_dir, old) >= 2:
                    lines_when_ready = step_lines(loss_log)
                if lines_when_ready is not None and step_lines(loss_log) > lines_when_ready:
                    break
                time.sleep(0.02)
            if lines_when_ready is not None and step_lines(loss_log) > lines_when_ready:
                latencies.append(time.monotonic() - killed_at)
                kills.append(killed_wall)
            else:
                failed += 1
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for child in psutil.process_iter():  # workers and idle interpreters of this run
            with contextlib.suppress(psutil.Error):
                if child.environ().get("RESTART_PROBE_DIR") == str(probe_dir):
                    child.kill()
    return {"latencies": latencies, "failed": failed,
            "phases": phases(kills, latencies, probe_dir, run_dir)}


def phases(kills: list[float], latencies: list[float], probe_dir: Path, run_dir: Path) -> dict:
    """Per phase, the time after each kill at which the restart reached it (the later worker)."""
    marks = [json.loads(line) for f in glob.glob(str(probe_dir / "*.jsonl"))
             for line in Path(f).read_text().splitlines()]
    events = [json.loads(line) for f in glob.glob(str(run_dir / "events-*.jsonl"))
              for line in Path(f).read_text().splitlines()]
    warm = []
    table: dict[str, list[float]] = {}
    for kill, latency in zip(kills, latencies, strict=True):
        end = kill + latency
        for kind, label in AGENT_PHASES:
            times = [e["time"] for e in events if e["kind"] == kind and kill <= e["time"] <= end]
            if times:
                table.setdefault(label, []).append(min(times) - kill)
        started = [e for e in events if e["kind"] == "workers_started" and kill <= e["time"] <= end]
        if started:
            warm.append(len(started[0].get("warm_local_ranks", [])))
        for what, label in WORKER_PHASES:
            times = [m["time"] for m in marks if m["what"] == what and kill <= m["time"] <= end]
            if times:
                table.setdefault(label, []).append(max(times) - kill)
        table.setdefault("first step after the kill", []).append(latency)
    return {"table": table, "warm_workers": warm}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--settle", type=float, default=8.0,
                        help="seconds of training before each kill (lets the pool refill)")
    parser.add_argument("--timeout", type=float, default=90.0)
    parser.add_argument("--launchers", nargs="+", choices=list(LAUNCHERS), default=list(LAUNCHERS))
    parser.add_argument("--per-kill", action="store_true", help="also print every kill's phases")
    args = parser.parse_args()
    print(f"# restart breakdown, {datetime.date.today()}, {platform.node()}, {os.cpu_count()} "
          f"CPUs, python {platform.python_version()}, load {os.getloadavg()[0]:.2f}")
    results = {}
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        (Path(tmp) / "probe").mkdir()
        (Path(tmp) / "probe" / "sitecustomize.py").write_text(PROBE)
        for name in args.launchers:
            results[name] = run_launcher(name, args.cycles, Path(tmp), args.settle, args.timeout)
            if args.per_kill:
                print(name, json.dumps(results[name]["phases"]["table"]))
    labels = [label for _, label in AGENT_PHASES + WORKER_PHASES] + ["first step after the kill"]
    names = list(args.launchers)
    print(f"\nmedian seconds after the SIGKILL ({args.cycles} kills each)")
    print(f"{'phase':28s}" + "".join(f"{n:>20s}" for n in names))
    for label in labels:
        row = []
        for name in names:
            values = results[name]["phases"]["table"].get(label)
            row.append(f"{statistics.median(values):20.2f}" if values else f"{'-':>20s}")
        print(f"{label:28s}" + "".join(row))
    print(f"{'restarts ok / failed':28s}" + "".join(
        f"{len(results[n]['latencies']):>16d} / {results[n]['failed']}" for n in names))
    print(f"{'warm workers per restart':28s}" + "".join(
        f"{results[n]['phases']['warm_workers'] or '-'!s:>20s}" for n in names))
    medians = {n: statistics.median(r["latencies"]) for n, r in results.items() if r["latencies"]}
    if "torchrun" in medians:
        for name in names[1:]:
            if name in medians:
                print(f"torchrun / {name}: {medians['torchrun'] / medians[name]:.1f}x")


if __name__ == "__main__":
    main()
