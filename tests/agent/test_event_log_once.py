"""One agent opens its event log once: every add-on writes through the log the launcher opened
(:class:`elasticft.addon.api.AddOnContext`), never through a file handle of its own.

The count comes from the launcher process itself: a Python audit hook, installed before
``elasticft-run``'s ``main`` runs, sees every ``open`` and ``os.open`` of the process and
records those that open an event-log file for writing. The run is a real one with a failure and a
restart, so that the checkpoint service, diagnostics and recovery all have events to write.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from elasticft.events import read_events
from tests.conftest import EXAMPLES, communicate_or_explain

COUNTING_LAUNCHER = """
import atexit, fnmatch, json, os, sys

opens = []
launcher = os.getpid()  # a process forked from it (a warm interpreter) reports nothing

def count(event, args):
    if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.fsdecode(args[0])
        flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
        if fnmatch.fnmatch(os.path.basename(path), "events-*.jsonl") and (
                flags & (os.O_WRONLY | os.O_RDWR)):
            opens.append(path)

def report():
    if os.getpid() != launcher:
        return
    with open(os.environ["COUNT_FILE"], "w") as f:
        json.dump(opens, f)

sys.addaudithook(count)
atexit.register(report)
from elasticft.run import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.timeout(300)
def test_one_agent_opens_its_event_log_once(tmp_path: Path, job_env: dict[str, str]) -> None:
    run_dir, count_file = tmp_path / "run", tmp_path / "opens.json"
    job_env["COUNT_FILE"] = str(count_file)
    proc = subprocess.Popen(
        [sys.executable, "-c", COUNTING_LAUNCHER, "--standalone", "--nproc-per-node", "2",
         "--max-restarts", "1", "--run-dir", str(run_dir),
         str(EXAMPLES / "train_elasticft.py"), "--steps", "8", "--crash-at-step", "3",
         "--crash-mode", "after-save"],
        env=job_env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    _, stderr = communicate_or_explain(proc, 240)
    assert proc.returncode == 0, stderr[-4000:]
    kinds = {event["kind"] for event in read_events(run_dir)}
    # The subsystems that write events did write them, into the one file.
    assert {"run_start", "failure", "decision", "restore", "run_end"} <= kinds, kinds
    opens = json.loads(count_file.read_text())
    assert len(opens) == 1, opens
