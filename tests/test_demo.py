"""README command 1's demo reads cleanly: nothing warns before the first step, the SIGKILL lands
right after the step it names, the recovery takes a few lines (the survivor's traceback is in its
worker log, not on the console), and the run recovers and reports.

It runs ``scripts/demo.py``, what ``scripts/demo.sh`` runs once ``.venv`` is set up.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]

MAX_RECOVERY_LINES = 5
"""Lines from the kill to the first step after it: the agent's failure, decision and stop, and
the script's resume."""
WARNING = re.compile(r"^(?:W\d{4} |E\d{4} |.*\bwarn(?:ing)?\b)", re.I)


def test_the_demo_warns_of_nothing_before_its_first_step_and_kills_where_it_says(
        tmp_path: Path, job_env: dict[str, str]) -> None:
    job_env.pop("LOGLEVEL")  # as from a shell: the demo picks its own level
    job_env.pop("OMP_NUM_THREADS", None)
    demo = subprocess.run([sys.executable, str(ROOT / "scripts" / "demo.py"), "--no-gpu",
                           "--out", str(tmp_path / "demo")], env=job_env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=450)
    lines = demo.stdout.splitlines()
    assert demo.returncode == 0, demo.stdout[-3000:]
    first_step = next(i for i, line in enumerate(lines) if line.startswith("step "))
    assert not [line for line in lines[:first_step] if WARNING.match(line)], lines[:first_step]

    announced = next(line for line in lines if line.startswith(">>> demo: SIGKILL"))
    step = int(re.search(r"after step (\d+)", announced).group(1))
    logged = [int(m.group(1)) for line in lines if (m := re.match(r"step (\d+) loss", line))]
    # Rank 0 logs no step past the one named until the restarted group resumes.
    before_restart = logged[:logged.index(step) + 1]
    after = logged[len(before_restart):]
    assert before_restart[-1] == step and after and after[0] <= step, (step, logged)

    kill = lines.index(announced)
    resumed = next(i for i, line in enumerate(lines) if i > kill and line.startswith("step "))
    between = lines[kill + 1:resumed]
    assert len(between) <= MAX_RECOVERY_LINES, "\n".join(between)
    assert not [line for line in between if "Traceback" in line], "\n".join(between)
    # The survivor's output goes to its log file, not the console (a traceback lands there when
    # its collective raised before the agent stopped it, which is a race, not asserted).
    assert list((tmp_path / "demo" / "run" / "logs").glob("*/attempt_0/0/stderr.log"))
    assert "elasticft report: run" in demo.stdout and "signal_crash" in demo.stdout
