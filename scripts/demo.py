"""The demo: a short training run under elasticft-run with a worker SIGKILLed mid-run.

It starts ``elasticft-run --standalone --nproc-per-node 2`` on examples/train_plain.py (a plain
torchrun script), SIGKILLs rank 1 right after step ``--kill-at-step`` (as ``elasticft chaos
kill`` does), lets the agent restart the group, and prints the run's summary and report when
training completes. Exit code: the launcher's.

``--gpu`` (the default when CUDA is available): one worker per GPU, on NCCL, and after the crash
a hang too (a SIGSTOP, as ``elasticft chaos stop``, after ``--hang-at-step``), found and
recovered by the agent.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def tool(name: str) -> list[str]:
    """elasticft's command ``name`` of this interpreter (module form when not on its path)."""
    script = BIN / name
    module = {"elasticft-run": "elasticft.run", "elasticft": "elasticft.cli"}[name]
    return [str(script)] if script.exists() else [sys.executable, "-m", module]


def cuda_devices() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill-at-step", type=int, default=12)
    parser.add_argument("--step-time", type=float, default=0.1)
    default_out = ROOT / "elasticft-runs" / f"demo-{int(time.time())}"
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument("--gpu", action=argparse.BooleanOptionalAction, default=None,
                        help="NCCL on every GPU, and a hang after the crash "
                             "(default: when CUDA is available)")
    parser.add_argument("--hang-at-step", type=int, default=None,
                        help="SIGSTOP a rank at this step (default: 24 with --gpu, else none)")
    args = parser.parse_args()
    gpus = cuda_devices()
    if args.gpu and not gpus:
        parser.error("--gpu: torch sees no CUDA device here; run without --gpu (gloo on CPU)")
    gpu = bool(gpus) if args.gpu is None else args.gpu
    nproc = gpus if gpu else 2
    hang_at = args.hang_at_step if args.hang_at_step is not None else (24 if gpu else None)
    fault_rank = str(nproc - 1)

    out: Path = args.out
    run_dir, ckpt_dir, loss_log = out / "run", out / "ckpt", out / "losses.txt"
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.setdefault("LOGLEVEL", "WARNING")
    # torch's own default for several workers a node; set, it is not announced in a banner.
    env.setdefault("OMP_NUM_THREADS", "1")
    command = [
        *tool("elasticft-run"), "--standalone", "--nproc-per-node", str(nproc),
        "--max-restarts", "3",
        "--run-dir", str(run_dir), str(ROOT / "examples" / "train_plain.py"),
        "--steps", str(args.steps), "--ckpt-dir", str(ckpt_dir), "--ckpt-every", "5",
        "--step-time", str(args.step_time), "--loss-log", str(loss_log),
    ]
    print("$ " + " ".join(command), flush=True)
    job = subprocess.Popen(command, env=env)

    def latest_step() -> int:
        if not loss_log.exists():
            return 0
        lines = loss_log.read_text().split("\n")
        return max((int(line.split()[0]) for line in lines if line.strip()), default=0)

    # The signal is sent from here, as `elasticft chaos kill` sends it, the moment rank 0 has
    # logged the step: a new interpreter for the command would land it steps later.
    from elasticft.chaos import signal_rank

    faults = [(args.kill_at_step, signal.SIGKILL, "SIGKILL")]
    if hang_at is not None:
        faults.append((hang_at, signal.SIGSTOP, "SIGSTOP (a hang)"))
    for at_step, sig, what in faults:
        while job.poll() is None and latest_step() < at_step:
            time.sleep(0.01)
        if job.poll() is None:
            signal_rank(run_dir, int(fault_rank), sig)
            print(f"\n>>> demo: {what} to rank {fault_rank} after step {latest_step()} "
                  f"(elasticft chaos {'kill' if sig is signal.SIGKILL else 'stop'} "
                  f"--run-dir {run_dir} --rank {fault_rank})\n", flush=True)
    code = job.wait()

    report = subprocess.run([*tool("elasticft"), "report", str(run_dir)], capture_output=True,
                            text=True)
    if report.returncode == 0:
        print("\n" + report.stdout, flush=True)
    print(f"demo: launcher exit code {code}; files in {out}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
