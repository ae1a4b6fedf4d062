"""What a fault costs under torchrun and under elasticft-run, measured in the same session.

For each launcher and fault it trains 2 gloo workers on this machine, injects the fault once
training is past ``--fault-step``, and follows the loss log (polled every 20 ms) to print:

* **first step**: seconds from the fault to the first step logged after it;
* **recomputed**: steps logged before the fault and again after it (work lost);
* **past fault**: seconds from the fault until training logs a step beyond the last one
  logged before it (the whole cost of the fault).

Runs: the plain torchrun script (``examples/train_plain.py``, torch.save every
``--ckpt-every`` steps) under ``torchrun`` and under ``elasticft-run``, and the worker-API example
(``examples/train_elasticft.py``, a memory snapshot every step) under ``elasticft-run``, whose
agent persists snapshots to disk at the same cadence as the plain script's torch.save
(``--persist-every``, default ``--ckpt-every``). Faults:
and the in-process example (``examples/train_inprocess.py``, the same training under
``elasticft.inprocess.worker.InProcess``: the survivor keeps its process), also with
``--recovery-inprocess-spare`` (launcher ``elasticft-run+spare``: a pre-started spare takes the
failed rank). Faults:
``kill`` (SIGKILL of rank 1) and ``hang`` (SIGSTOP of rank 1; torchrun waits for gloo's
30-minute timeout, so it is given up after ``--hang-cap`` seconds), and for the in-process runs
``keep``: rank 1 hands its sockets to a child outside the job and is then SIGKILLed (the
example's ``--crash-mode keep-sockets``), so the survivor's collective never raises by itself
and only the agent's interrupt frees it. In-process runs also print the recovery's phases
(the ``recover_in_process`` event): ``survivors_out`` is the agent seeing the failure → every
survivor out of its collective. ``--runs inprocess`` keeps only the in-process runs.

The last lines compare crash recovery with torchrun's (the time until training is past the
fault, elasticft-run with the worker API over torchrun with the plain script; target at most
1/5).

Then the TOR of a run with periodic faults: ``--tor-script`` (the worker-API example by
default) under elasticft-run for ``--tor-minutes`` with a SIGKILL of rank 1 every
``--tor-every`` seconds, analysed by ``elasticft report``'s machinery
(:mod:`elasticft.report.tor`; target TOR at least 0.9 with a fault every 60 s).

    .venv/bin/python bench/recovery.py                    # about 15 minutes on 2 cores
    .venv/bin/python bench/recovery.py --tor-minutes 2    # a short TOR run
    .venv/bin/python bench/recovery.py --skip-tor --faults kill
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hoststeal import cpu_times, steal_share  # noqa: E402  (bench/, beside this script)
from jobenv import clean_job_env  # noqa: E402  (bench/, beside this script)

from elasticft import chaos  # noqa: E402
from elasticft.events import read_events  # noqa: E402
from elasticft.report.tor import analyze, format_report  # noqa: E402
from elasticft.steps import read_steps  # noqa: E402
from tests.tuned_run import tuned_run  # noqa: E402  (tuning constants have no flag)

BIN = Path(sys.executable).parent
PLAIN = ROOT / "examples" / "train_plain.py"
API = ROOT / "examples" / "train_elasticft.py"
INPROCESS = ROOT / "examples" / "train_inprocess.py"
_IN_FLIGHT_S = 0.5
"""A step logged this soon after the fault, right after the last one, was already in flight."""


def read_log(path: Path) -> list[int]:
    if not path.exists():
        return []
    steps = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2:
            steps.append(int(parts[0]))
    return steps


def torchrun_pids(proc: subprocess.Popen[bytes]) -> dict[int, int]:
    """Rank -> pid of torchrun's workers (its grandchildren run the script; RANK in environ)."""
    import psutil

    pids = {}
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            rank = child.environ().get("RANK")
        except psutil.Error:
            continue
        if rank is not None and "train_" in " ".join(child.cmdline()):
            pids[int(rank)] = child.pid
    return pids


def one_fault(launcher: str, script: Path, fault: str, args: argparse.Namespace,
              work: Path, env: dict[str, str]) -> dict[str, object]:
    tag = f"{launcher}-{script.stem}-{fault}"
    run_dir = work / tag
    loss_log = work / f"{tag}.loss"
    keeper = work / f"{tag}.keeper"
    train = [str(script), "--steps", str(args.steps), "--batch-size", "4", "--step-time",
             str(args.step_time), "--loss-log", str(loss_log)]
    if fault == "keep":  # the worker kills itself after forking its sockets' keeper
        train += ["--fault-rank", "1", "--crash-at-step", str(args.fault_step + 1),
                  "--crash-mode", "keep-sockets", "--keeper-pid", str(keeper)]
    if script == PLAIN:
        train += ["--ckpt-dir", str(work / f"{tag}-ckpt"), "--ckpt-every", str(args.ckpt_every)]
    if launcher == "torchrun":
        cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2",
               "--max-restarts", "3", "--log-dir", str(work / f"{tag}-torchrun-logs"), *train]
    else:
        spare = ["--recovery-inprocess-spare"] if launcher == "elasticft-run+spare" else []
        cmd = [*elasticft_run(args), *spare, "--standalone", "--nproc-per-node", "2",
               "--max-restarts", "3", "--run-dir", str(run_dir), "--monitor-interval", "0.1",
               "--shutdown-timeout", "5",
               "--ckpt-persist-every", str(persist_every(args)), *train]
    log = (work / f"{tag}.out").open("wb")
    proc = subprocess.Popen(cmd, env=env, cwd=work, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    result: dict[str, object] = {"run": f"{launcher} {script.name}", "fault": fault}
    try:
        deadline = time.monotonic() + 300
        while max(read_log(loss_log), default=0) < args.fault_step:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{tag}: never reached step {args.fault_step}; see "
                                   f"{work / f'{tag}.out'}")
            time.sleep(0.02)
        if fault == "keep":
            while not keeper.exists() and time.monotonic() < deadline:
                time.sleep(0.002)
            before = read_log(loss_log)
            fault_at = time.monotonic()
        else:
            victim = torchrun_pids(proc)[1] if launcher == "torchrun" else chaos.worker_pid(
                run_dir, 1)
            before = read_log(loss_log)
            fault_at = time.monotonic()
            os.kill(victim, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        last_before = max(before)
        seen = len(before)
        first = past = None
        cap = fault_at + (args.hang_cap if fault == "hang" else 240)
        while time.monotonic() < cap and past is None and proc.poll() is None:
            now_steps = read_log(loss_log)
            if len(now_steps) > seen and now_steps[seen] == last_before + 1 and \
                    time.monotonic() - fault_at < _IN_FLIGHT_S and first is None:
                # The step in flight at the fault finished on rank 0 anyway: not a recovery.
                seen += 1
                last_before += 1
                continue
            if len(now_steps) > seen:
                now = time.monotonic()
                first = first if first is not None else now - fault_at
                if any(s > last_before for s in now_steps[seen:]):
                    past = now - fault_at
            time.sleep(0.02)
        steps = read_log(loss_log)
        in_flight = last_before - max(before)  # lines of the step in flight, skipped above
        after = steps[len(before) + in_flight:]
        recomputed = len([s for s in after if s <= last_before])
        result.update(first_step_s=first, recomputed=recomputed if first is not None else None,
                      past_fault_s=past)
        if script == INPROCESS:
            done = [e for e in read_events(run_dir) if e.get("kind") == "recover_in_process"]
            result["phases"] = done[0]["phases"] if done else None
    finally:
        if keeper.exists():
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(keeper.read_text()), signal.SIGKILL)
        import psutil

        try:
            root = psutil.Process(proc.pid)
            victims = [*root.children(recursive=True), root]
        except psutil.Error:
            victims = []
        for p in victims:
            try:
                p.send_signal(signal.SIGCONT)
                p.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass
        proc.wait(timeout=60)
        log.close()
    return result


def persist_every(args: argparse.Namespace) -> int:
    """elasticft's disk cadence: the baseline's torch.save cadence unless given. Persisting
    is the agent's background work; at 10 steps of 70 ms it takes a fifth of a core here."""
    return args.persist_every or args.ckpt_every


def tor_run(args: argparse.Namespace, work: Path, env: dict[str, str]) -> dict[str, object]:
    run_dir = work / "tor"
    loss_log = work / "tor.loss"
    script = API if args.tor_script == "api" else PLAIN
    cmd = [str(BIN / "elasticft-run"), "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1000", "--run-dir", str(run_dir), "--monitor-interval", "0.1",
           "--shutdown-timeout", "5", "--ckpt-persist-every", str(persist_every(args)),
           str(script), "--steps", "1000000", "--batch-size", "4",
           "--step-time", str(args.step_time), "--loss-log", str(loss_log)]
    if script == PLAIN:
        cmd += ["--ckpt-dir", str(work / "tor-ckpt"), "--ckpt-every", str(args.ckpt_every)]
    log = (work / "tor.out").open("wb")
    proc = subprocess.Popen(cmd, env=env, cwd=work, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    started = time.monotonic()
    before = cpu_times()
    faults = 0
    next_fault = started + args.tor_every
    try:
        while time.monotonic() - started < args.tor_minutes * 60:
            if time.monotonic() >= next_fault:
                try:
                    chaos.signal_rank(run_dir, 1, signal.SIGKILL)
                    faults += 1
                except (chaos.ChaosError, ProcessLookupError):
                    pass
                next_fault += args.tor_every
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)  # the launcher stops its workers and ends its log
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    steal = steal_share(before, cpu_times())
    analysis = analyze(read_events(run_dir), read_steps(run_dir))
    return {"tor": analysis.tor, "ettr": analysis.ettr, "faults": faults,
            "observed_s": analysis.observed_s, "steps": analysis.steps_done,
            "healthy_step_s": analysis.healthy_step_s, "report": format_report(analysis),
            "steal": steal}


def fmt(value: object, unit: str = "") -> str:
    if value is None:
        return "none"
    if isinstance(value, float):
        return f"{value:.1f}{unit}"
    return str(value)


def hang_tuning(args: argparse.Namespace) -> dict[str, float]:
    """The hang tuning constants --hang-floor sets (Python API only: no elasticft-run flag)."""
    return {} if args.hang_floor is None else {"hang_collective_floor_s": args.hang_floor}


def elasticft_run(args: argparse.Namespace) -> list[str]:
    tuning = hang_tuning(args)
    return tuned_run(tuning) if tuning else [str(BIN / "elasticft-run")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--fault-step", type=int, default=70)
    parser.add_argument("--ckpt-every", type=int, default=50, help="plain script's torch.save")
    parser.add_argument("--persist-every", type=int, default=0,
                        help="elasticft-run's --ckpt-persist-every (default: --ckpt-every)")
    parser.add_argument("--step-time", type=float, default=0.05)
    parser.add_argument("--hang-floor", type=float, default=None,
                        help="elasticft's DiagConfig.hang_collective_floor_s (default: elasticft's "
                        "default; hang detection uses default options)")
    parser.add_argument("--hang-cap", type=float, default=60.0)
    parser.add_argument("--tor-minutes", type=float, default=10.0,
                        help="length of the TOR run with periodic faults")
    parser.add_argument("--tor-every", type=float, default=60.0,
                        help="seconds between the TOR run's faults")
    parser.add_argument("--tor-script", choices=("api", "plain"), default="api",
                        help="the worker-API example or the plain torch.save script")
    parser.add_argument("--skip-tor", action="store_true")
    parser.add_argument("--faults", default="kill,hang",
                        help="comma-separated faults of the per-fault table (kill, hang, keep)")
    parser.add_argument("--runs", choices=("all", "inprocess"), default="all")
    args = parser.parse_args()

    env = clean_job_env()
    work = Path(tempfile.mkdtemp(prefix="elasticft-recovery-bench-"))
    print(f"# recovery benchmark  {time.strftime('%Y-%m-%d %H:%M')}  {platform.node()}  "
          f"{os.cpu_count()} cores  {platform.processor() or platform.machine()}  "
          f"python {platform.python_version()}")
    print(f"# 2 gloo workers, {args.steps} steps of ~{args.step_time} s extra, fault after step "
          f"{args.fault_step}; plain script saves every {args.ckpt_every} steps; elasticft "
          f"hang tuning {hang_tuning(args) or 'default'}")
    print(f"{'run':34} {'fault':6} {'first step':>11} {'recomputed':>10} {'past fault':>11}")
    runs = [("torchrun", PLAIN), ("elasticft-run", PLAIN), ("elasticft-run", API),
            ("elasticft-run", INPROCESS), ("elasticft-run+spare", INPROCESS)]
    results: dict[tuple[str, str], dict[str, object]] = {}
    try:
        for fault in [f for f in args.faults.split(",") if f]:
            for launcher, script in runs:
                if (fault == "keep" or args.runs == "inprocess") and script != INPROCESS:
                    continue
                r = one_fault(launcher, script, fault, args, work, env)
                results[(str(r["run"]), fault)] = r
                print(f"{r['run']:34} {fault:6} {fmt(r['first_step_s'], ' s'):>11} "
                      f"{fmt(r['recomputed']):>10} {fmt(r['past_fault_s'], ' s'):>11}",
                      flush=True)
                if r.get("phases"):
                    print(f"{'':34} phases: " + ", ".join(
                        f"{k.removesuffix('_s')} {v:.3f}" for k, v in r["phases"].items()),
                        flush=True)
        for fault in [f for f in args.faults.split(",") if f]:
            restart = results.get(("elasticft-run train_elasticft.py", fault), {})
            for name in ("elasticft-run", "elasticft-run+spare"):
                inproc = results.get((f"{name} train_inprocess.py", fault), {})
                if restart.get("first_step_s") and inproc.get("first_step_s"):
                    print(f"{fault}, first step: {name} in process "
                          f"{inproc['first_step_s']:.2f} s, restart "
                          f"{restart['first_step_s']:.2f} s, ratio "
                          f"{inproc['first_step_s'] / restart['first_step_s']:.2f}")
        base = results.get(("torchrun train_plain.py", "kill"), {})
        for name in ("train_plain.py", "train_elasticft.py"):
            ours = results.get((f"elasticft-run {name}", "kill"), {})
            if base.get("past_fault_s") and ours.get("past_fault_s"):
                print(f"crash, time past the fault: elasticft-run {name} / torchrun "
                      f"train_plain.py = {ours['past_fault_s'] / base['past_fault_s']:.2f} "
                      f"(target <= 0.20)")
        print(f"# load average at the end: {os.getloadavg()[0]:.1f}", flush=True)
        if not args.skip_tor:
            t = tor_run(args, work, env)
            name = API.name if args.tor_script == "api" else PLAIN.name
            print(f"TOR of elasticft-run {name}, {t['observed_s']:.0f} s with a SIGKILL "
                  f"every {args.tor_every:g} s ({t['faults']} faults, {t['steps']} steps, healthy "
                  f"step {t['healthy_step_s'] * 1e3:.0f} ms): TOR {t['tor']:.3f}, "
                  f"ETTR {t['ettr']:.3f} (target TOR >= 0.9; load average "
                  f"{os.getloadavg()[0]:.1f}; CPU time stolen by the host {t['steal']:.1%})")
            print(t["report"])
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
