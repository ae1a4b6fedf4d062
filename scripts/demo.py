"""The demo: a short training run under elasticft-run with a worker SIGKILLed mid-run.

It starts ``elasticft-run --standalone --nproc-per-node 2`` on examples/train_plain.py (a plain
torchrun script), waits until the job has written a checkpoint, SIGKILLs rank 1 with
``elasticft chaos kill``, lets the agent restart the group, and prints the run's summary and
report when training completes. Exit code: the launcher's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill-at-step", type=int, default=12)
    parser.add_argument("--step-time", type=float, default=0.1)
    default_out = ROOT / "elasticft-runs" / f"demo-{int(time.time())}"
    parser.add_argument("--out", type=Path, default=default_out)
    args = parser.parse_args()

    out: Path = args.out
    run_dir, ckpt_dir, loss_log = out / "run", out / "ckpt", out / "losses.txt"
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.setdefault("LOGLEVEL", "WARNING")
    command = [
        str(BIN / "elasticft-run"), "--standalone", "--nproc-per-node", "2", "--max-restarts", "3",
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

    while job.poll() is None and latest_step() < args.kill_at_step:
        time.sleep(0.1)
    if job.poll() is None:
        print(f"\n>>> demo: SIGKILL rank 1 at step {latest_step()}\n", flush=True)
        subprocess.run(
            [str(BIN / "elasticft"), "chaos", "kill", "--run-dir", str(run_dir), "--rank", "1"],
            check=True,
        )
    code = job.wait()

    report = subprocess.run([str(BIN / "elasticft"), "report", str(run_dir)], capture_output=True,
                            text=True)
    if report.returncode == 0:
        print("\n" + report.stdout, flush=True)
    print(f"demo: launcher exit code {code}; files in {out}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
