"""The GPU check: what the NCCL shim and elasticft do on a real GPU, printed as one table.

    bash bench/gpu_check.sh            (installs elasticft into the machine's torch, then this)
    python bench/gpu_check.py [--dry-run] [--torchrun-hang-s 90]
                              [--parts ops,overhead,hang,ckpt,recovery,inprocess,conformance,
                                       torchtitan,persist,tests]

With one GPU, NCCL runs with world size 1 (bench/gpu_check_worker.py is the script):

1. ``elasticft-run`` with default options starts an NCCL job: the shim's self-check ("NCCL
   timings active/inactive") from the event log, and the ring's record of each collective with
   its GPU time;
2. per-call host cost of 10,000 all_reduce calls of 4 bytes: plain ``torchrun``, ``torchrun``
   with only the shim preloaded, and ``elasticft-run`` (shim and Python recorder, whose wrappers
   leave NCCL groups to the shim once its calls are seen to reach it); two rounds, alternating,
   median per call; then (``gloo``) the same on a CPU tensor over gloo, plain ``torchrun``
   against ``elasticft-run``, whose Python recorder times gloo calls (this part alone,
   ``--parts gloo``, runs without a GPU too);
3. a hang found through the NCCL path: ``torch.cuda._sleep`` of minutes queued before an
   all_reduce. Detection time and action under ``elasticft-run`` (default options), against plain
   ``torchrun`` on the same script within ``--torchrun-hang-s``;
4. (``restart``) the plain DDP script examples/train_plain.py (NCCL on GPU 0, torch.save every 20
   steps): its worker SIGKILLed, then SIGSTOPped (a hang), at step 30; seconds to the first step
   after, under ``elasticft-run`` (targets 1.5 s and 5 s) and plain ``torchrun``;
5. bench/ckpt_gpu.py, the GPU checkpoint figures, and (``recovery``) bench/recovery_large.py,
   SIGKILL with 4.8 GB of CUDA state; (``inprocess``) the same with two ranks in three modes:
   torchrun, elasticft-run's restart and its in-process recovery (the survivor keeps its
   process and its CUDA context; NCCL's communicators are aborted through
   ``torch.distributed.distributed_c10d._abort_process_group``), and in process with a spare
   that takes the killed rank; before them bench/inprocess_abort_gpu.py, the device health
   check synchronizing the rank's device from its helper thread, an NCCL group aborted with a
   kernel pending, and a new group's collective (what one GPU allows);
   (``conformance``) bench/conformance.py's plain loops with dropout, augmentation and all
   patterns together on CUDA (CUDA's RNG; gloo, both ranks on one GPU), each cell exact or not;
   (``torchtitan``) bench/torchtitan_gpu.py: torchtitan's debug model under FSDP2 and under
   tensor parallel, rank 1 SIGKILLed, the restart mode against elasticft's torchtitan
   integration (2 GPUs, ``TORCHTITAN_DIR``);
6. (``persist``) bench/persist.py: a 4 GB persist beside a training loop, with ``O_DIRECT`` and
   through the page cache, against the machine's disk;
7. the test suite's ``gpu``-marked tests (pytest must be installed).

Without a CUDA device (or with ``--dry-run``) it checks what it can (the shim is built, the worker
script compiles, the launchers are found) and says so in one line. The table also goes to
``$OUT/gpu_check.json`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import py_compile
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "bench" / "gpu_check_worker.py"
CKPT_BENCH = ROOT / "bench" / "ckpt_gpu.py"
RECOVERY_BENCH = ROOT / "bench" / "recovery_large.py"
ABORT_BENCH = ROOT / "bench" / "inprocess_abort_gpu.py"
PERSIST_BENCH = ROOT / "bench" / "persist.py"
TITAN_BENCH = ROOT / "bench" / "torchtitan_gpu.py"
CONFORMANCE_BENCH = ROOT / "bench" / "conformance.py"
RUN_LIMIT_S = 300


def launcher(name: str) -> list[str]:
    """elasticft-run or torchrun of this interpreter (module form when not installed)."""
    module = {"elasticft-run": "elasticft.run", "torchrun": "torch.distributed.run"}[name]
    script = Path(sys.executable).parent / name
    return [str(script)] if script.exists() else [sys.executable, "-m", module]


# Every process this check starts carries this mark in its environment, so that workers left
# behind by a stopped launcher (in sessions of their own, a GPU kernel of minutes queued) can be
# found and ended by their pid.
RUN_MARK = f"GPU_CHECK_RUN={os.getpid()}-{time.time_ns()}"


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ELASTICFT_", "PET_", "TORCHELASTIC_")) and k != "LD_PRELOAD"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"  # the children's lines reach the log as they are printed
    key, _, value = RUN_MARK.partition("=")
    return {**env, key: value, **extra}


def end_leftovers() -> int:
    """SIGKILLs the processes that carry this run's mark; returns how many."""
    mark = RUN_MARK.encode()
    ended = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if mark in (entry / "environ").read_bytes().split(b"\0"):
                os.kill(int(entry.name), signal.SIGKILL)
                ended += 1
        except (OSError, ValueError):
            continue
    return ended


def run(cmd: list[str], env: dict[str, str], limit_s: float = RUN_LIMIT_S
        ) -> tuple[int | None, str]:
    """Exit code (None: stopped at the limit) and the end of the output.

    At the limit the launcher gets SIGTERM, so that it stops its workers (elasticft-run's and
    torchrun's workers run in sessions of their own), then SIGKILL 30 s later. The output goes
    to a file: a pipe would also wait for any worker left behind. With ``OUT`` set, that file
    is ``$OUT/gpu_check_children.log``, every run appended as it prints, so that a run stopped
    at a machine's time limit still brings back what its children said."""
    kept = Path(os.environ["OUT"], "gpu_check_children.log") if os.environ.get("OUT") else None
    with (kept.open("a+") if kept else tempfile.TemporaryFile("w+")) as log:
        log.write(f"\n### {' '.join(cmd)}\n")
        log.flush()
        start = log.tell()
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        code: int | None
        try:
            code = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            code = None
            proc.terminate()
            _reap(proc)
        end_leftovers()
        log.seek(start)
        return code, log.read()[-2000:]


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:160] if lines else ""


def elasticft_run(run_dir: Path, mode: str, out: Path, *extra: str) -> list[str]:
    return [*launcher("elasticft-run"), "--standalone", "--nproc-per-node", "1",
            "--run-dir", str(run_dir), *extra, str(WORKER), mode, str(out)]


def torchrun(mode: str, out: Path) -> list[str]:
    # A log directory beside the output: torchrun's default is a new /tmp/torchelastic_* a run.
    return [*launcher("torchrun"), "--standalone", "--nproc-per-node", "1", "--log-dir",
            f"{out}.torchrun-logs", str(WORKER), mode, str(out)]


def events(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    from elasticft.events import read_events

    return [e for e in read_events(run_dir) if e.get("kind") == kind]


def check_ops(tmp: Path, rows: list[tuple[str, str]]) -> None:
    run_dir, out = tmp / "ops-run", tmp / "ops.json"
    code, text = run(elasticft_run(run_dir, "ops", out), child_env())
    rows.append(("elasticft-run, default options, NCCL job",
                 "started and finished" if code == 0 else f"exit {code}: {last_line(text)}"))
    timings = events(run_dir, "nccl_timings") if run_dir.exists() else []
    rows.append(("shim self-check (event log)",
                 timings[-1]["message"] if timings else "no nccl_timings event"))
    if not out.exists():
        return
    found = json.loads(out.read_text())
    rows.append(("torch's NCCL calls reach the shim",
                 str(found.get("interception") or "not checked (no active shim)")))
    for r in found["records"]:
        gpu = f"GPU {r['gpu_ms'] * 1e3:.1f} us" if r["timed"] else "no GPU time"
        state = "complete" if r["complete"] else "IN FLIGHT"
        rows.append((f"  record: {r['op']}", f"{r['bytes']} B, {gpu}, {state}, "
                                             f"NCCL result {r['nccl_result']}"))
    if not found["records"]:
        rows.append(("  records", "none in the NCCL ring"))


def check_overhead(tmp: Path, rows: list[tuple[str, str]]) -> None:
    from elasticft.diag.workerenv import shim_library

    shim = shim_library()
    rings = tmp / "rings"
    rings.mkdir(exist_ok=True)
    out = tmp / "o.json"
    measure_calls(tmp, rows, "all_reduce", {
        "torchrun": (torchrun("overhead", out), child_env()),
        "torchrun + shim only": (torchrun("overhead", out), child_env(
            LD_PRELOAD=str(shim), ELASTICFT_DIAG_SHIM="1", ELASTICFT_DIAG_RING_DIR=str(rings))),
        "elasticft-run (shim + recorder)": (
            elasticft_run(tmp / "overhead-run", "overhead", out), child_env()),
    })


def check_gloo_overhead(tmp: Path, rows: list[tuple[str, str]]) -> None:
    """The Python recorder's cost a call where it times (gloo: no shim there); no GPU needed."""
    out = tmp / "o.json"
    measure_calls(tmp, rows, "gloo all_reduce", {
        "torchrun": (torchrun("overhead-gloo", out), child_env()),
        "elasticft-run (Python timing)": (
            elasticft_run(tmp / "overhead-gloo-run", "overhead-gloo", out), child_env()),
    })


def measure_calls(tmp: Path, rows: list[tuple[str, str]], what: str,
                  settings: dict[str, tuple[list[str], dict[str, str]]]) -> None:
    """Two rounds of every setting, alternating; one row each: the median host time of a call
    and what it adds to the first setting's."""
    out = tmp / "o.json"
    medians: dict[str, list[float]] = {name: [] for name in settings}
    detail: dict[str, dict[str, Any]] = {}
    for _ in range(2):
        for name, (cmd, env) in settings.items():
            out.unlink(missing_ok=True)
            code, text = run(cmd, env)
            if code != 0 or not out.exists():
                detail[name] = {"error": f"exit {code}: {last_line(text)}"}
                continue
            found = json.loads(out.read_text())
            medians[name].append(found["median_us"])
            detail[name] = found
    base_name = next(iter(settings))
    base = statistics.median(medians[base_name]) if medians[base_name] else None
    for name in settings:
        if not medians[name]:
            rows.append((f"10,000 {what}: {name}", detail[name].get("error", "no result")))
            continue
        median = statistics.median(medians[name])
        added = "" if base is None or name == base_name else f", {median - base:+.2f} us a call"
        found = detail[name]
        ring = ""
        if found.get("ring_head"):
            ring = (f"; ring head {found['ring_head']}, {found['records_with_gpu_time']}/"
                    f"{found['records_kept']} kept records with GPU time (median "
                    f"{found['gpu_median_ms'] or 0:.4f} ms)")
        if found.get("python_wrappers") is not None:
            ring += f"; Python wrappers {'on' if found['python_wrappers'] else 'off'}"
        rows.append((f"10,000 {what}: {name}",
                     f"median {median:.2f} us a call (rounds "
                     f"{', '.join(f'{m:.2f}' for m in medians[name])}){added}{ring}"))


PLAIN = ROOT / "examples" / "train_plain.py"
RESTART_TARGETS_S = {"crash": 1.5, "hang": 5.0}


def logged_steps(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


def script_worker(mark_pid: int) -> int | None:
    """The pid of this check's running train_plain.py worker (not its launcher)."""
    mark = RUN_MARK.encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == mark_pid:
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if (mark in (entry / "environ").read_bytes().split(b"\0") and str(PLAIN).encode()
                    in argv and b"-u" in argv[1:2]):
                return int(entry.name)
        except (OSError, ValueError):
            continue
    return None


def fault_to_step(tmp: Path, name: str, fault: str, fault_step: int = 30,
                  cap_s: float = 60.0) -> str:
    """Runs examples/train_plain.py on one rank (NCCL on GPU 0 where there is one), SIGKILLs
    (``crash``) or SIGSTOPs (``hang``) its worker once it has logged ``fault_step`` steps;
    seconds from the signal to the first step logged after it."""
    log, ckpt = tmp / f"{fault}-{name}.log", tmp / f"{fault}-{name}-ckpt"
    script = [str(PLAIN), "--steps", "100000", "--ckpt-every", "20", "--ckpt-dir", str(ckpt),
              "--loss-log", str(log)]
    cmd = ([*launcher("elasticft-run"), "--run-dir", str(tmp / f"{fault}-run")]
           if name == "elasticft-run"
           else [*launcher("torchrun"), "--log-dir", str(tmp / f"{fault}-torchrun-logs")])
    cmd += ["--standalone", "--nproc-per-node", "1", "--max-restarts", "3", *script]
    with tempfile.TemporaryFile("w+") as output:
        proc = subprocess.Popen(cmd, env=child_env(), stdout=output, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            deadline = time.monotonic() + RUN_LIMIT_S
            while logged_steps(log) < fault_step and proc.poll() is None:
                if time.monotonic() > deadline:
                    return f"step {fault_step} not reached in {RUN_LIMIT_S} s"
                time.sleep(0.05)
            if name == "elasticft-run":  # as `elasticft chaos` finds it (not the warm server)
                from elasticft.chaos import ChaosError, worker_pid

                try:
                    worker: int | None = worker_pid(tmp / f"{fault}-run", 0)
                except ChaosError:
                    worker = None
            else:
                worker = script_worker(proc.pid)
            if worker is None:
                output.seek(0)
                return f"no worker to signal: {last_line(output.read())}"
            before = logged_steps(log)
            signalled = time.monotonic()
            os.kill(worker, signal.SIGKILL if fault == "crash" else signal.SIGSTOP)
            while logged_steps(log) == before:
                if time.monotonic() - signalled > cap_s:
                    return f"no step within {cap_s:.0f} s"
                time.sleep(0.02)
            return f"{time.monotonic() - signalled:.2f} s"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            _reap(proc)
            end_leftovers()


def _reap(proc: subprocess.Popen) -> None:
    """Waits for a launcher that was asked to stop; its process group is killed after 30 s."""
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def check_restart(tmp: Path, rows: list[tuple[str, str]]) -> None:
    """The plain DDP script, a crash and a hang at step 30: first step after, both launchers."""
    for fault, target in RESTART_TARGETS_S.items():
        found = {name: fault_to_step(tmp, name, fault) for name in ("torchrun", "elasticft-run")}
        what = "SIGKILL" if fault == "crash" else "SIGSTOP (hang)"
        rows.append((f"plain DDP script, {what} -> first step",
                     f"elasticft-run {found['elasticft-run']} (target <= {target} s on a GPU); "
                     f"torchrun {found['torchrun']}"))


def check_hang(tmp: Path, rows: list[tuple[str, str]], torchrun_limit_s: float) -> None:
    run_dir, marker = tmp / "hang-run", tmp / "hang.json"
    limit_s = 240.0  # the whole check must fit in the 10 minutes a lent GPU machine allows
    code, text = run(elasticft_run(run_dir, "hang", marker, "--max-restarts", "1"), child_env(),
                     limit_s=limit_s)
    hang_at = json.loads(marker.read_text())["hang_at"] if marker.exists() else None
    hangs = [e for e in events(run_dir, "detection") if e.get("detector") == "hang"] \
        if run_dir.exists() else []
    decisions = events(run_dir, "decision") if run_dir.exists() else []
    if hang_at is None:
        rows.append(("hang, elasticft-run", f"the hang was not reached: exit {code}: "
                                            f"{last_line(text)}"))
    elif not hangs:
        rows.append(("hang, elasticft-run", f"not detected within {limit_s:.0f} s (stopped)"
                     if code is None else f"not detected; exit {code}: {last_line(text)}"))
    else:
        after = [d for d in decisions if d.get("time", 0) >= hangs[0]["time"]]
        action = (f"{after[0].get('action', '?')} ({after[0].get('reason', '')})"[:100] if after
                  else "no decision event")
        rows.append(("hang, elasticft-run", f"detected {hangs[0]['time'] - hang_at:.1f} s after "
                                            f"the hang; action {action}; run exit {code}"))
        rows.append(("  detection", hangs[0].get("message", "")[:160]))
    marker.unlink(missing_ok=True)
    started = time.monotonic()
    code, text = run(torchrun("hang", marker), child_env(), limit_s=torchrun_limit_s)
    result = (f"not recovered within {torchrun_limit_s:.0f} s (killed)" if code is None
              else f"exit {code} after {time.monotonic() - started:.0f} s: {last_line(text)}")
    rows.append(("hang, plain torchrun", result))


def check_ckpt(rows: list[tuple[str, str]]) -> None:
    code, text = run([sys.executable, str(CKPT_BENCH)], child_env())
    rows.append(("GPU checkpoints (bench/ckpt_gpu.py)", f"exit {code}"))
    rows.extend(("  ckpt", line[:160]) for line in text.strip().splitlines()[-12:])


def check_recovery(rows: list[tuple[str, str]]) -> None:
    """bench/recovery_large.py: SIGKILL with 4.8 GB of CUDA state, elasticft-run vs torchrun."""
    code, text = run([sys.executable, str(RECOVERY_BENCH), "--limit-s", "300"],
                     child_env(**part_out("recovery")), limit_s=900)
    rows.append(("recovery, 4.8 GB (bench/recovery_large.py)", f"exit {code}"))
    rows.extend(("  recovery", line[:160]) for line in text.strip().splitlines()[-8:])


def check_inprocess(rows: list[tuple[str, str]]) -> None:
    """bench/inprocess_abort_gpu.py (an NCCL group aborted with a kernel pending, within the
    hard limit, the health check, a new group: what one GPU allows), then
    bench/recovery_large.py with two ranks: torchrun, elasticft-run, elasticft in process,
    and in process with a spare."""
    code, text = run([sys.executable, str(ABORT_BENCH)], child_env(), limit_s=300)
    rows.append(("NCCL abort with a kernel pending (bench/inprocess_abort_gpu.py)",
                 f"exit {code}"))
    rows.extend(("  abort", line[:200]) for line in text.strip().splitlines()[-8:])
    code, text = run([sys.executable, str(RECOVERY_BENCH), "--nproc", "2", "--limit-s", "300",
                      "--launchers",
                      "torchrun,elasticft-run,elasticft-inprocess,elasticft-spare"],
                     child_env(**part_out("inprocess")), limit_s=1500)
    rows.append(("in-process recovery, 4.8 GB x 2 ranks (bench/recovery_large.py)",
                 f"exit {code}"))
    rows.extend(("  inprocess", line[:160]) for line in text.strip().splitlines()
                if line.startswith(("launcher", "torchrun", "elasticft")))


def check_conformance(rows: list[tuple[str, str]]) -> None:
    """bench/conformance.py on CUDA: the plain loops whose draws come from CUDA's RNG (dropout,
    augmentation, every pattern together) at every fault point, gloo with both ranks on one GPU
    (NCCL needs a GPU per rank)."""
    code, text = run([sys.executable, str(CONFORMANCE_BENCH), "--device", "cuda", "--only",
                      "dropout,augment,all"], child_env(), limit_s=900)
    rows.append(("conformance on CUDA (bench/conformance.py --device cuda)", f"exit {code}"))
    rows.extend(("  conformance", line[:200]) for line in text.strip().splitlines()
                if not line.startswith("pattern"))


def part_out(part: str) -> dict[str, str]:
    """``OUT`` for a bench that writes its table there: a folder of the part's own, so that two
    parts running the same bench keep both tables."""
    if not os.environ.get("OUT"):
        return {}
    folder = Path(os.environ["OUT"], part)
    folder.mkdir(exist_ok=True)
    return {"OUT": str(folder)}


def check_persist(rows: list[tuple[str, str]]) -> None:
    """bench/persist.py: a 4 GB persist beside a training loop, with ``O_DIRECT`` and through the
    page cache, against the machine's disk (under the checkout, not tmpfs)."""
    code, text = run([sys.executable, str(PERSIST_BENCH), "--gb", "4", "--repeat", "3",
                      "--train", "--dir", str(ROOT)], child_env(), limit_s=900)
    rows.append(("persist, 4 GB beside training (bench/persist.py)", f"exit {code}"))
    rows.extend(("  persist", line[:160]) for line in text.strip().splitlines()[-3:])


def check_torchtitan(rows: list[tuple[str, str]]) -> None:
    """bench/torchtitan_gpu.py: torchtitan's debug model under FSDP2 and tensor parallel,
    rank 1 SIGKILLed, the restart mode against elasticft's torchtitan integration (needs 2
    GPUs, torchtitan and a checkout of it in ``TORCHTITAN_DIR``; else its one line says what is
    missing)."""
    code, text = run([sys.executable, str(TITAN_BENCH)], child_env(), limit_s=2400)
    rows.append(("torchtitan debug model (bench/torchtitan_gpu.py)", f"exit {code}"))
    rows.extend(("  torchtitan", line[:240]) for line in text.strip().splitlines()[-5:])


def check_gpu_tests(rows: list[tuple[str, str]]) -> None:
    """The test suite's ``gpu``-marked tests (the CUDA path of the checkpoint memory tier)."""
    # Only the files with gpu tests: the others import extras this machine may not have.
    files = [str(p) for p in sorted(ROOT.glob("tests/**/test_*.py")) if "mark.gpu" in p.read_text()]
    code, text = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m",
                      "gpu", "-rfs", *files], child_env())
    lines = text.strip().splitlines()
    rows.append(("pytest -m gpu", f"exit {code}: {lines[-1] if lines else 'no output'}"[:160]))
    rows.extend(("  failed", line[:160]) for line in lines if line.startswith("FAILED"))


def dry_run(reason: str, parts: list[str] | None = None) -> int:
    from elasticft.diag.workerenv import shim_library

    py_compile.compile(str(WORKER), doraise=True)
    py_compile.compile(str(CKPT_BENCH), doraise=True)
    py_compile.compile(str(RECOVERY_BENCH), doraise=True)
    for part in sorted(RECOVERY_BENCH.parent.glob("recovery_large_*.py")):  # its modules
        py_compile.compile(str(part), doraise=True)
    py_compile.compile(str(ABORT_BENCH), doraise=True)
    py_compile.compile(str(PERSIST_BENCH), doraise=True)
    py_compile.compile(str(TITAN_BENCH), doraise=True)
    py_compile.compile(str(CONFORMANCE_BENCH), doraise=True)
    py_compile.compile(str(CONFORMANCE_BENCH.parent / "conformance_loop.py"), doraise=True)
    shim = shim_library()
    launchers = [" ".join(launcher(n)) for n in ("elasticft-run", "torchrun")]
    broken: list[str] = []
    inprocess = ""
    if parts is not None and "inprocess" in parts:
        from elasticft.torch_contracts import CONTRACTS

        named = [name.split("(")[0].strip() for name in CONTRACTS if "_abort_process_group" in name
                 or "replacing one worker" in name or "ProcessGroup.abort" in name]
        broken = [name for name in CONTRACTS if name.split("(")[0].strip() in named
                  and not CONTRACTS[name]()]
        inprocess = (f"; in-process recovery's torch parts ({', '.join(named)}) "
                     + ("present" if not broken else f"MISSING {broken}"))
        # The abort bench's parts that need no GPU (the known answer, the rank's device, the
        # abort and a new group on gloo), in its one line.
        code, text = run([sys.executable, str(ABORT_BENCH), "--dry-run"], child_env(),
                         limit_s=120)
        said = text.strip().splitlines()[-1] if text.strip() else "no output"
        said = said.split("): ", 1)[-1].removesuffix("; nothing measured on a GPU")
        inprocess += f"; bench/inprocess_abort_gpu.py: {said}"
        if code != 0:
            broken.append(f"bench/inprocess_abort_gpu.py --dry-run exit {code}")
    if parts is not None and "torchtitan" in parts:
        code, text = run([sys.executable, str(TITAN_BENCH), "--dry-run"], child_env(),
                         limit_s=120)
        said = text.strip().splitlines()[-1] if text.strip() else "no output"
        inprocess += "; " + said.removesuffix("; nothing measured")
        if code != 0:
            broken.append(f"bench/torchtitan_gpu.py --dry-run exit {code}")
    print(f"gpu_check: dry run, {reason}: shim {'built' if shim else 'NOT BUILT'}, worker script "
          f"and bench/ckpt_gpu.py compile, launchers {launchers[0]!r} and {launchers[1]!r}"
          f"{inprocess}; nothing measured")
    return 0 if shim and not broken else 1


PARTS = ("ops", "overhead", "gloo", "hang", "restart", "ckpt", "recovery", "inprocess",
         "conformance", "torchtitan", "persist", "tests")
CPU_PARTS = ("gloo", "restart", "persist")
"""Parts that need no GPU: asked for alone (``--parts gloo,restart``), they run on a CPU machine
too (gloo)."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="check the set-up only")
    parser.add_argument("--torchrun-hang-s", type=float, default=90.0,
                        help="how long plain torchrun is given to get out of the hang")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"which checks to run, comma-separated (default: all of {PARTS})")
    args = parser.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown --parts {unknown}; choose from {', '.join(PARTS)}")
    try:
        import torch
    except ImportError:
        return dry_run("no torch")
    cpu_only = set(parts) <= set(CPU_PARTS)
    if not torch.cuda.is_available() and not (cpu_only and not args.dry_run):
        return dry_run(f"no CUDA device (torch {torch.__version__})", parts)
    if args.dry_run:
        return dry_run("--dry-run", parts)
    when = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
    if torch.cuda.is_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        machine = f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, NCCL {nccl}"
    else:
        machine = f"no CUDA device, {os.cpu_count()} CPUs, torch {torch.__version__}"
    rows: list[tuple[str, str]] = [
        ("machine", f"{machine}, {when}"),
        ("cc", shutil.which("cc") or "none"),
    ]
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        checks = {"ops": lambda: check_ops(tmp, rows),
                  "overhead": lambda: check_overhead(tmp, rows),
                  "gloo": lambda: check_gloo_overhead(tmp, rows),
                  "hang": lambda: check_hang(tmp, rows, args.torchrun_hang_s),
                  "restart": lambda: check_restart(tmp, rows),
                  "ckpt": lambda: check_ckpt(rows), "recovery": lambda: check_recovery(rows),
                  "inprocess": lambda: check_inprocess(rows),
                  "conformance": lambda: check_conformance(rows),
                  "torchtitan": lambda: check_torchtitan(rows),
                  "persist": lambda: check_persist(rows),
                  "tests": lambda: check_gpu_tests(rows)}
        shown = 0
        for part in parts:
            try:
                checks[part]()
            except Exception as e:  # one broken check must not hide the others' rows
                rows.append(("check failed", f"{part}: {type(e).__name__}: {e}"[:160]))
            # Each part's rows as soon as it is done: a run stopped at its time limit keeps
            # what it measured.
            shown = show(rows, shown)
    return 0


def show(rows: list[tuple[str, str]], shown: int) -> int:
    """Prints the rows not printed yet and saves them all to $OUT; returns how many are shown."""
    width = max(36, *(len(name) for name, _ in rows))
    print("\n".join(f"{name:<{width}}  {value}" for name, value in rows[shown:]), flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_check.json").write_text(json.dumps(rows, indent=1))
    return len(rows)


if __name__ == "__main__":
    sys.exit(main())
