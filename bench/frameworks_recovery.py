"""Kill → first step of a framework's training, recovered in process against the restart mode,
measured in the same session.

For each framework example (``examples/train_lightning_inprocess.py`` with DDP and with FSDP2
under the model-parallel strategy, ``examples/train_hf_inprocess.py``) it runs 2 gloo workers
under ``elasticft-run``, SIGKILLs rank 1 at ``--crash-at-step`` (the examples' own fault), once
with the integration (in process) and once with ``--restart-mode`` (the framework's own entry,
which elasticft restarts), and prints for each the report's detection + repair of that fault
(kill → the first step after it), the steps the run ended with, and the in-process / restart
ratio.

    .venv/bin/python bench/frameworks_recovery.py              # about 3 minutes on 2 cores
    .venv/bin/python bench/frameworks_recovery.py --frameworks lightning
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SCRIPTS = {"lightning": ("train_lightning_inprocess.py",),
           "lightning-fsdp2": ("train_lightning_inprocess.py", "--model-parallel"),
           "hf": ("train_hf_inprocess.py",)}
"""Each framework's example and its arguments."""


def one_run(work: Path, framework: str, mode: str, crash_at: int) -> dict[str, object]:
    """One job with one SIGKILL; the report's fault record of it."""
    run_dir = work / f"{framework}-{mode}"
    cmd = [str(BIN / "elasticft-run"), "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "3", "--run-dir", str(run_dir), "--ckpt-persist-every", "0",
           "--monitor-interval", "0.1", str(ROOT / "examples" / SCRIPTS[framework][0]),
           *SCRIPTS[framework][1:],
           "--crash-at-step", str(crash_at), *(["--restart-mode"] if mode == "restart" else [])]
    started = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=work)
    if out.returncode != 0:
        return {"error": (out.stdout + out.stderr)[-2000:]}
    report = subprocess.run([str(BIN / "elasticft"), "report", str(run_dir), "--json"],
                            capture_output=True, text=True, timeout=120)
    faults = json.loads(report.stdout)["faults"]
    fault = faults[0] if faults else {}
    return {"action": fault.get("action"),
            "first_step_s": (fault.get("detection_s") or 0.0) + (fault.get("repair_s") or 0.0),
            "rollback_steps": fault.get("rollback_steps"),
            "wall_s": time.monotonic() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frameworks", default=",".join(SCRIPTS))
    parser.add_argument("--crash-at-step", type=int, default=5)
    args = parser.parse_args()
    print(f"{time.strftime('%Y-%m-%d %H:%M')}  kill -> first step (report: detection + repair)")
    print(f"{'framework':15} {'mode':10} {'action':20} {'first step':>10} {'rollback':>8}")
    with tempfile.TemporaryDirectory(prefix="elasticft-frameworks-") as tmp:
        for framework in args.frameworks.split(","):
            results = {}
            for mode in ("inprocess", "restart"):
                result = one_run(Path(tmp), framework, mode, args.crash_at_step)
                results[mode] = result
                if "error" in result:
                    print(f"{framework:15} {mode:10} failed:\n{result['error']}")
                    continue
                print(f"{framework:15} {mode:10} {result['action']!s:20} "
                      f"{result['first_step_s']:>8.2f} s {result['rollback_steps']!s:>8}")
            inproc, restart = results["inprocess"], results["restart"]
            if inproc.get("first_step_s") and restart.get("first_step_s"):
                print(f"{framework}: in process / restart = "
                      f"{inproc['first_step_s'] / restart['first_step_s']:.2f}")


if __name__ == "__main__":
    main()
