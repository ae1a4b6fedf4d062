"""A framework example run under a real ``elasticft-run --standalone --nproc-per-node 2``
(gloo), with what the integration tests compare: each rank's processes, the final parameters
rank 0 wrote, the event log and the report's faults."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest
import torch

from elasticft.events import read_events
from tests.conftest import BIN, EXAMPLES, pids_by_rank


def needs_modules(extra: str, *modules: str) -> pytest.MarkDecorator:
    """Skips a test module whose framework is not installed, found without importing it: the
    frameworks take seconds to import, and every pytest process collects every file."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)}: "
                              f"pip install -e '.[{extra}]'")


def run_job(tmp: Path, script: str, name: str, env: dict[str, str], *extra: str) -> dict:
    params, pids = tmp / f"{name}.pt", tmp / f"{name}.pid"
    cmd = [str(BIN / "elasticft-run"), "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "3", "--run-dir", str(tmp / name), "--ckpt-persist-every", "0",
           "--monitor-interval", "0.1", str(EXAMPLES / script), "--params-out", str(params),
           "--pid-log", str(pids), *extra]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-5000:]
    report = subprocess.run([str(BIN / "elasticft"), "report", str(tmp / name), "--json"],
                            env=env, capture_output=True, text=True, timeout=60)
    assert report.returncode == 0, report.stderr[-3000:]
    return {"text": text, "pids": pids_by_rank(pids), "params": torch.load(params),
            "events": read_events(tmp / name), "report": json.loads(report.stdout),
            "steps": {rank: [int(line.split()[2]) for line in pids.read_text().splitlines()
                             if line.split()[0] == str(rank)] for rank in (0, 1)}}


def first_traceback(text: str) -> str:
    """The run's first traceback with what led to it (where a recovery went wrong; the run's
    end is a later attempt's), then the run's end."""
    at = text.find("Traceback (most recent call last)")
    head = text[max(0, at - 3000):at + 6000] if at >= 0 else ""
    return f"{head}\n[...]\n{text[-3000:]}"


def assert_recovered_in_process(run: dict, reference: dict, replaced: int = 1) -> None:
    """Rank ``replaced`` (1) was replaced in process, the other kept its process, the run took
    the reference's steps to the reference's parameters bit for bit, and the report counts the
    steps the survivor finished and did again: at most the one in flight (none when the
    interrupt refused its optimizer step before it finished). The report counts a step as done
    when the framework records it, the script's log when its callback runs: an interrupt landing
    between the two (a loaded machine) makes them differ by that step, so each is bounded on its
    own."""
    kinds = [e["kind"] for e in run["events"]]
    assert "restart" not in kinds, first_traceback(run["text"])
    assert kinds.count("recover_in_process") == 1, first_traceback(run["text"])
    survivor = 1 - replaced
    assert len(run["pids"][survivor]) == 1, run["pids"]
    assert len(run["pids"][replaced]) == 2, run["pids"]
    finished = [line for line in reference["text"].splitlines() if "finished" in line]
    assert finished and finished[0].split("finished")[1].split(";")[0] in run["text"]
    assert run["report"]["last_step"] == reference["report"]["last_step"]
    assert run["params"].keys() == reference["params"].keys()
    for key, value in reference["params"].items():
        assert torch.equal(run["params"][key], value), key
    (fault,) = run["report"]["faults"]
    done = run["steps"][survivor]
    redone = len(done) - len(set(done))
    assert fault["action"] == "recover_in_process", fault
    assert fault["rollback_steps"] <= 1 and redone <= 1, (fault, done)
