"""Kill → first step of a framework's training, recovered in process against the restart mode,
measured in the same session.

For each framework example (``examples/train_lightning_inprocess.py`` with DDP and with FSDP2
under the model-parallel strategy, ``examples/train_hf_inprocess.py``) it runs 2 gloo workers
under ``elasticft-run``, SIGKILLs rank 1 at ``--crash-at-step`` (the examples' own fault), once
with the integration (in process) and once with ``--restart-mode`` (the framework's own entry,
which elasticft restarts), and prints for each the report's detection + repair of that fault
(kill → the first step after it), the steps the run ended with, and the in-process / restart
ratio. A third mode, ``cold-framework``, is the in-process one with the warm template kept to
torch (the tuning constant ``warm_frameworks=False``): the replacement imports the framework
itself, as before the template imported it. Each mode runs ``--runs`` times, the modes taking
turns; the medians (and the range) are printed.

    .venv/bin/python bench/frameworks_recovery.py              # about 15 minutes on 2 cores
    .venv/bin/python bench/frameworks_recovery.py --frameworks lightning --runs 3
"""

from __future__ import annotations

import argparse
import json
import statistics
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


MODES = ("inprocess", "cold-framework", "restart")

# elasticft-run with the warm template kept to torch: main() with that tuning constant.
_WITHOUT_FRAMEWORKS = (
    "import dataclasses, sys\n"
    "from elasticft.run import main\n"
    "def tune(options):\n"
    "    agent = dataclasses.replace(options.agent, warm_frameworks=False)\n"
    "    return dataclasses.replace(options, agent=agent)\n"
    "sys.exit(main(sys.argv[1:], tune=tune))\n")


def one_run(work: Path, framework: str, mode: str, crash_at: int, run: int
            ) -> dict[str, object]:
    """One job with one SIGKILL; the report's fault record of it."""
    run_dir = work / f"{framework}-{mode}-{run}"
    launcher = ([sys.executable, "-c", _WITHOUT_FRAMEWORKS] if mode == "cold-framework"
                else [str(BIN / "elasticft-run")])
    cmd = [*launcher, "--standalone", "--nproc-per-node", "2",
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
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    print(f"{time.strftime('%Y-%m-%d %H:%M')}  kill -> first step (report: detection + repair), "
          f"{args.runs} run(s) per mode")
    print(f"{'framework':15} {'mode':15} {'action':20} {'median':>8} {'range':>13} "
          f"{'rollback':>8}")
    failed = False
    with tempfile.TemporaryDirectory(prefix="elasticft-frameworks-") as tmp:
        for framework in args.frameworks.split(","):
            results: dict[str, list[dict[str, object]]] = {mode: [] for mode in MODES}
            for run in range(args.runs):
                for mode in MODES:
                    result = one_run(Path(tmp), framework, mode, args.crash_at_step, run)
                    if "error" in result:
                        failed = True
                        print(f"{framework:15} {mode:15} failed:\n{result['error']}")
                    else:
                        results[mode].append(result)
            medians = {}
            for mode in MODES:
                done = results[mode]
                if not done:
                    continue
                times = sorted(float(r["first_step_s"]) for r in done)  # type: ignore[arg-type]
                medians[mode] = statistics.median(times)
                actions = sorted({str(r["action"]) for r in done})
                rollbacks = sorted({str(r["rollback_steps"]) for r in done})
                print(f"{framework:15} {mode:15} {','.join(actions):20} {medians[mode]:>6.2f} s "
                      f"{times[0]:>5.2f}-{times[-1]:.2f} s {','.join(rollbacks):>8}")
            if medians.get("inprocess") and medians.get("restart"):
                print(f"{framework}: in process / restart = "
                      f"{medians['inprocess'] / medians['restart']:.2f}", end="")
                if medians.get("cold-framework"):
                    print(f"; in process / in process with the framework imported by the "
                          f"replacement = {medians['inprocess'] / medians['cold-framework']:.2f}",
                          end="")
                print()
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
