"""The README's CPU quick start works as written, in order: its launch trains long enough for its
``elasticft chaos kill`` from another shell to land mid-run, the run recovers once and finishes,
its report explains the fault, and a second launch in the same directory resumes.

The commands are read from the README, not copied here, and run from a directory that holds the
example script at the path the README gives, so they write where the README says.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from elasticft.events import read_events
from tests.conftest import BIN, ROOT
from tests.report.test_report_real_run import StepWatcher
from tests.test_docs import FENCE, README

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def cpu_quick_start() -> list[list[str]]:
    """The README's "Quick start: CPU" commands, in order, as argument lists."""
    section = re.search(r"^## Quick start: CPU.*?(?=^## )", README.read_text(), re.S | re.M)
    assert section is not None, "README.md has no 'Quick start: CPU' section"
    block = FENCE.search(section.group(0))
    assert block is not None
    joined = re.sub(r"\\\n\s*", " ", block.group(1))
    return [shlex.split(line, comments=True) for line in joined.splitlines() if line.strip()]


def program(argv: list[str]) -> list[str]:
    """``argv`` with its program from this interpreter's environment."""
    return [str(BIN / argv[0]), *argv[1:]]


def test_the_cpu_quick_start_runs_in_order_with_a_kill_in_the_middle(
        tmp_path: Path, job_env: dict[str, str]) -> None:
    launch, kill, report = cpu_quick_start()
    assert launch[0] == "elasticft-run" and kill[:3] == ["elasticft", "chaos", "kill"] \
        and report[:2] == ["elasticft", "report"]
    script = next(word for word in launch if word.endswith(".py"))
    (tmp_path / script).parent.mkdir(parents=True)
    shutil.copy(ROOT / script, tmp_path / script)
    run_dir = tmp_path / launch[launch.index("--run-dir") + 1]
    steps = int(launch[launch.index("--steps") + 1])

    log = tmp_path / "stderr.txt"
    with log.open("w") as stderr:
        job = subprocess.Popen(program(launch), cwd=tmp_path, env=job_env, text=True,
                               stdout=subprocess.PIPE, stderr=stderr, start_new_session=True)
    watcher = StepWatcher(job)
    watcher.wait_for(lambda lines: any(line.startswith("step 10 ") for line in lines), 300,
                     "step 10")
    killed = subprocess.run(program(kill), cwd=tmp_path, env=job_env, text=True,
                            capture_output=True, timeout=60)
    assert killed.returncode == 0 and killed.stdout.startswith("sent SIGKILL to rank 1"), \
        killed.stderr
    try:
        job.wait(300)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        raise AssertionError(f"the run did not end: {log.read_text()[-3000:]}") from None
    assert job.returncode == 0, log.read_text()[-3000:]
    watcher.thread.join(10)
    assert any(line == f"finished {steps} steps on 2 workers" for _, line in watcher.lines)

    events = read_events(run_dir)
    failures = [e for e in events if e["kind"] == "failure"]
    assert [e["kind"] for e in events].count("restart") == 1, [e["kind"] for e in events]
    assert failures and {e["signal"] for e in failures} == {"SIGKILL"}, failures
    assert [e["state"] for e in events if e["kind"] == "run_end"] == ["succeeded"]

    text = subprocess.run(program(report), cwd=tmp_path, env=job_env, text=True,
                          capture_output=True, timeout=120)
    assert text.returncode == 0, text.stderr
    assert "TOR" in text.stdout and "signal_crash" in text.stdout, text.stdout
    as_json = subprocess.run(program([*report, "--json"]), cwd=tmp_path, env=job_env, text=True,
                             capture_output=True, timeout=120)
    assert json.loads(as_json.stdout)["failures"] == 1, as_json.stdout

    again = subprocess.run(program(launch), cwd=tmp_path, env=job_env, text=True,
                           capture_output=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from step {steps}" in again.stdout, again.stdout[-2000:]


def test_the_in_process_quick_start_keeps_the_survivor_in_its_process(
        tmp_path: Path, job_env: dict[str, str]) -> None:
    """The quick start's in-process command: its output says what the README says it does."""
    section = re.search(r"^## Quick start: CPU.*?(?=^## )", README.read_text(), re.S | re.M)
    assert section is not None
    blocks = FENCE.findall(section.group(0))
    assert len(blocks) == 2, "the CPU quick start has the restart block and the in-process one"
    (launch,) = [shlex.split(line) for line in blocks[1].splitlines() if line.strip()]
    script = next(word for word in launch if word.endswith(".py"))
    shutil.copytree(ROOT / Path(script).parent, tmp_path / Path(script).parent)
    out = subprocess.run(program(launch), cwd=tmp_path, env=job_env, text=True,
                         capture_output=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "rank 0 rejoined in generation 1" in text, text[-3000:]
    assert "1 in-process recoveries in this process" in text, text[-3000:]
