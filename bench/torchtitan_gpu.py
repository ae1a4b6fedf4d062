"""torchtitan's debug model under elasticft-run on a GPU node, rank 1 SIGKILLed once: the
restart mode against its entry re-entered in process. Not run anywhere yet.

    python bench/torchtitan_gpu.py --titan-dir <torchtitan checkout> [--crash-at-step 12]
    python bench/torchtitan_gpu.py --dry-run

torchtitan 0.3.0 does not run on a CPU-only torch (docs/frameworks.md, "torchtitan"), so this
is the GPU command of issue 63's torchtitan item. Both modes start torchtitan the way its users
do (``torchtitan.train``'s ``main`` with ``--module llama3 --config llama3_debugmodel``), its own
checkpoint every ``--ckpt-interval`` steps, NCCL, one rank a GPU (at least 2 GPUs):

* ``restart``: ``main()`` unchanged; elasticft restarts every rank, which resume from
  torchtitan's checkpoint;
* ``inprocess``: ``main()`` under :class:`elasticft.integrations.fit.FitRecovery` with the
  default group made first (torchtitan's ``init_distributed`` then keeps it): the survivor
  enters ``main()`` again after its regroup in the same process (CUDA context kept), and
  torchtitan builds its trainer again and resumes from its own checkpoint. This is not the
  integration issue 63 asks for (the survivors' sharded parameters are built again, not kept,
  and the steps since the checkpoint are redone); it measures what re-entry alone saves.

Prints per mode the report's fault record (kill -> first step = detection + repair, steps
rolled back) and the run's wall time. ``--dry-run`` (no GPU, no torchtitan needed) compiles the
script and says in one line what this machine lacks for the real run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
MODES = ("inprocess", "restart")


def titan_args(steps: int, ckpt_interval: int, folder: Path) -> list[str]:
    return ["--module", "llama3", "--config", "llama3_debugmodel", "--training.steps", str(steps),
            "--checkpoint.enable", "--checkpoint.interval", str(ckpt_interval),
            "--checkpoint.folder", str(folder)]


def worker(mode: str, crash_at: int, args: list[str]) -> None:
    """One rank (run by elasticft-run): torchtitan's ``main``, rank 1 SIGKILLed once after
    step ``crash_at``."""
    import torch
    import torch.distributed as dist
    from torchtitan import train as titan_train
    from torchtitan.trainer import Trainer

    rank = int(os.environ.get("RANK", "0"))
    first = os.environ.get("ELASTICFT_ATTEMPT", "0") == "0" and \
        os.environ.get("ELASTICFT_INPROCESS_GEN", "0") == "0"
    original = Trainer.train_step

    def train_step(self, *a, **k):  # type: ignore[no-untyped-def]
        done = original(self, *a, **k)
        if first and rank == 1 and self.step == crash_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return done

    Trainer.train_step = train_step  # type: ignore[method-assign]
    sys.argv = ["torchtitan.train", *args]
    if mode == "restart":
        titan_train.main()
        return
    from elasticft.integrations.fit import FitRecovery

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")  # before recovery arms; torchtitan keeps it
    FitRecovery("torchtitan").run(titan_train.main)


def one_run(work: Path, titan_dir: Path, mode: str, nproc: int, a: argparse.Namespace
            ) -> dict[str, object]:
    run_dir = work / mode
    cmd = [str(BIN / "elasticft-run"), "--standalone", "--nproc-per-node", str(nproc),
           "--max-restarts", "3", "--run-dir", str(run_dir), "--monitor-interval", "0.1",
           str(Path(__file__).resolve()), "--worker", mode, "--crash-at-step",
           str(a.crash_at_step), "--", *titan_args(a.steps, a.ckpt_interval, work / f"ckpt-{mode}")]
    started = time.monotonic()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=a.limit_s, cwd=titan_dir,
                         env=env)
    wall = time.monotonic() - started
    if out.returncode != 0:
        return {"error": f"exit {out.returncode}: " + (out.stdout + out.stderr)[-1500:]}
    report = subprocess.run([str(BIN / "elasticft"), "report", str(run_dir), "--json"],
                            capture_output=True, text=True, timeout=120)
    faults = json.loads(report.stdout)["faults"] if report.returncode == 0 else []
    fault = faults[0] if faults else {}
    return {"action": fault.get("action"),
            "first_step_s": (fault.get("detection_s") or 0.0) + (fault.get("repair_s") or 0.0),
            "rollback_steps": fault.get("rollback_steps"), "wall_s": wall}


def lacks(titan_dir: Path | None) -> list[str]:
    """What this machine lacks for the real run, one phrase each."""
    missing = []
    try:
        import torch
        if torch.cuda.device_count() < 2:  # NCCL: one rank a GPU; torchtitan: LOCAL_RANK's GPU
            missing.append(f"2 CUDA devices (torch {torch.__version__} sees "
                           f"{torch.cuda.device_count()})")
    except ImportError:
        missing.append("torch")
    if importlib.util.find_spec("torchtitan") is None:
        missing.append("torchtitan (pip install torchtitan==0.3.0 --no-deps beside the "
                       "machine's torch, then its dependencies)")
    if titan_dir is None or not (titan_dir / "tests" / "assets" / "tokenizer").is_dir():
        missing.append("--titan-dir: a torchtitan checkout with tests/assets (tokenizer, c4_test)")
    return missing


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--titan-dir", type=Path,
                        default=Path(os.environ["TORCHTITAN_DIR"])
                        if os.environ.get("TORCHTITAN_DIR") else None)
    parser.add_argument("--crash-at-step", type=int, default=12)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--ckpt-interval", type=int, default=10)
    parser.add_argument("--limit-s", type=float, default=600)
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("titan", nargs="*", help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.worker:
        worker(a.worker, a.crash_at_step, a.titan)
        return 0
    missing = lacks(a.titan_dir)
    if a.dry_run or missing:
        said = "lacks " + "; ".join(missing) if missing else "ready"
        print(f"bench/torchtitan_gpu.py: dry run, {said}; nothing measured")
        return 0
    import torch

    nproc = max(2, torch.cuda.device_count())
    print(f"{time.strftime('%Y-%m-%d %H:%M')}  torchtitan debug model, {nproc} ranks, rank 1 "
          f"SIGKILLed after step {a.crash_at_step}; kill -> first step (report)")
    with tempfile.TemporaryDirectory(prefix="elasticft-torchtitan-") as tmp:
        for mode in MODES:
            r = one_run(Path(tmp), a.titan_dir, mode, nproc, a)
            if "error" in r:
                print(f"{mode:10} failed: {r['error']}")
                continue
            print(f"{mode:10} {r['action']!s:20} {r['first_step_s']:>8.2f} s  rollback "
                  f"{r['rollback_steps']!s}  wall {r['wall_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
