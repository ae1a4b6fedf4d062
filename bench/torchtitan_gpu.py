"""torchtitan's debug model under elasticft-run on a GPU node, rank 1 SIGKILLed once: the
restart mode against elasticft's torchtitan integration, under FSDP2 and under tensor parallel.
Not run anywhere yet.

    python bench/torchtitan_gpu.py --titan-dir <torchtitan checkout> [--crash-at-step 12]
                                   [--layouts fsdp,tp]
    python bench/torchtitan_gpu.py --dry-run

torchtitan 0.3.0 does not train on a CPU-only torch (docs/frameworks/torchtitan.md), so this is
the GPU command of the torchtitan integration. Every run starts torchtitan the way its users
do (``torchtitan.train`` run as ``-m`` runs it, ``--module llama3 --config llama3_debugmodel``,
a fixed ``--debug.seed``), its own checkpoint every ``--ckpt-interval`` steps, NCCL, one rank a
GPU (at least 2 GPUs), for each layout (``fsdp``: FSDP2 over every rank; ``tp``: tensor
parallel over every rank):

* ``restart``: unchanged; elasticft restarts every rank, which resume from torchtitan's
  checkpoint;
* ``inprocess``: the same command line with the one key that turns the integration on
  (``--override.imports elasticft.integrations.torchtitan.inprocess``): the survivor enters
  ``Trainer.train()`` again in its process with its sharded model kept, restored from
  elasticft's memory, or, where the kept modules' meshes cannot be made again in process
  (logged when recovery arms; printed here), every rank restarts and resumes from that memory.

Prints per layout and mode the report's fault record (its action, kill -> first step =
detection + repair, steps rolled back), the run's wall time and the refusal logged, if any.
``--dry-run`` (no GPU, no torchtitan needed) compiles the script and says in one line what this
machine lacks for the real run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
MODES = ("inprocess", "restart")
LAYOUTS = {"fsdp": ["--parallelism.data_parallel_shard_degree", "-1"],
           "tp": ["--parallelism.data_parallel_shard_degree", "1",
                  "--parallelism.tensor_parallel_degree", "-1"]}
"""torchtitan's flags per layout; -1 (all ranks) is filled in with the rank count."""
REFUSAL = "is not made again in process"
"""What :mod:`elasticft.inprocess.meshes` logs when it cannot keep the modules in process."""


def titan_args(mode: str, layout: str, nproc: int, steps: int, ckpt_interval: int,
               folder: Path) -> list[str]:
    from elasticft.integrations.torchtitan_checks import ENABLE_TARGET

    parallel = [str(nproc) if value == "-1" else value for value in LAYOUTS[layout]]
    return ["--module", "llama3", "--config", "llama3_debugmodel", "--training.steps",
            str(steps), "--debug.seed", "42", *parallel,
            "--checkpoint.enable", "--checkpoint.interval", str(ckpt_interval),
            "--checkpoint.folder", str(folder),
            *(["--override.imports", ENABLE_TARGET] if mode == "inprocess" else [])]


def worker(crash_at: int, args: list[str]) -> None:
    """One rank (run by elasticft-run): ``torchtitan.train`` as ``-m`` runs it, rank 1
    SIGKILLed once after step ``crash_at``."""
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
    runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)


def one_run(work: Path, titan_dir: Path, mode: str, layout: str, nproc: int,
            a: argparse.Namespace) -> dict[str, object]:
    name = f"{layout}-{mode}"
    run_dir = work / name
    cmd = [str(BIN / "elasticft-run"), "--standalone", "--nproc-per-node", str(nproc),
           "--max-restarts", "3", "--run-dir", str(run_dir), "--monitor-interval", "0.1",
           str(Path(__file__).resolve()), "--worker", "--crash-at-step", str(a.crash_at_step),
           "--", *titan_args(mode, layout, nproc, a.steps, a.ckpt_interval,
                             work / f"ckpt-{name}")]
    started = time.monotonic()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=a.limit_s, cwd=titan_dir,
                         env=env)
    wall = time.monotonic() - started
    said = out.stdout + out.stderr
    if out.returncode != 0:
        return {"error": f"exit {out.returncode}: " + said[-1500:]}
    report = subprocess.run([str(BIN / "elasticft"), "report", str(run_dir), "--json"],
                            capture_output=True, text=True, timeout=120)
    faults = json.loads(report.stdout)["faults"] if report.returncode == 0 else []
    fault = faults[0] if faults else {}
    refused = next((line.split(" - ")[-1].strip() for line in said.splitlines()
                    if REFUSAL in line), "")
    return {"action": fault.get("action"),
            "first_step_s": (fault.get("detection_s") or 0.0) + (fault.get("repair_s") or 0.0),
            "rollback_steps": fault.get("rollback_steps"), "wall_s": wall, "refused": refused}


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
    parser.add_argument("--layouts", default="fsdp,tp",
                        help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("titan", nargs="*", help=argparse.SUPPRESS)
    a = parser.parse_args()
    unknown = set(a.layouts.split(",")) - set(LAYOUTS)
    if unknown:
        parser.error(f"unknown layout(s) {', '.join(sorted(unknown))}; use {', '.join(LAYOUTS)}")
    if a.worker:
        worker(a.crash_at_step, a.titan)
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
        for layout in a.layouts.split(","):
            for mode in MODES:
                r = one_run(Path(tmp), a.titan_dir, mode, layout, nproc, a)
                if "error" in r:
                    print(f"{layout:5} {mode:10} failed: {r['error']}")
                    continue
                print(f"{layout:5} {mode:10} {r['action']!s:20} {r['first_step_s']:>8.2f} s  "
                      f"rollback {r['rollback_steps']!s}  wall {r['wall_s']:.1f} s"
                      + (f"  ({r['refused']})" if r["refused"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
