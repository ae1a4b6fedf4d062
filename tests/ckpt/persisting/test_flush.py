"""End to end under elasticft-run, ~0.5 GB of state: the flush on failure is not in front of the
restart and waits for the restarted workers' restore and first step, and a slow persister (its
copies slowed by the test seam) never costs a snapshot."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from elasticft.ckpt.persisting import durable
from elasticft.ckpt.persisting.agentpersist import COPY_DELAY_ENV
from tests.conftest import BIN, EXAMPLES
from tests.tuned_run import tuned_run

STEPS = 12
CRASH_AT = 6
# 2 workers x 6 blocks of 512 wide: ~19M parameters each, ~0.45 GB with AdamW's state.
MODEL = ("--dim", "512", "--layers", "6")


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for path in sorted(run_dir.rglob("events-*.jsonl"))
            for line in path.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_decision_does_not_wait_for_the_flush_and_no_snapshot_is_skipped(
    tmp_path: Path, job_env
) -> None:
    # Every persist holds its slots 2 s longer (a write of gigabytes would): the flush holds a
    # slot of each worker while the restarted workers save the next steps.
    env = dict(job_env, **{COPY_DELAY_ENV: "2"})
    run_dir = tmp_path / "run"
    cmd = [str(BIN / "elasticft-run"), "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "2", "--run-dir", str(run_dir), "--ckpt-persist-every", "0",
           "--monitor-interval", "0.2",
           str(EXAMPLES / "train_elasticft.py"), "--steps", str(STEPS), *MODEL,
           "--crash-at-step", str(CRASH_AT), "--fault-rank", "1", "--crash-mode", "after-save"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400, cwd=tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert f"resumed from step {CRASH_AT} (source=memory)" in text, text[-4000:]

    # The policy decided at once; the flush waited for the restarted workers' first step, then
    # wrote the newest step every worker held by then (the crash's, or one saved since).
    decided = text.index("decision: restart_in_place")
    # Both releases come after the restarted workers' first step: whichever the agent saw first.
    released = re.search(f"the flush of step {CRASH_AT} starts: the restarted workers "
                         r"(took their first step|saved step \d+)", text)
    assert released is not None, text[-4000:]
    flushed = re.search(r"took step (\d+) out of shared memory in \S+ s \(flush\)", text)
    assert flushed is not None, text[-4000:]
    step = int(flushed.group(1))
    assert decided < released.start() < flushed.start(), text[-4000:]
    assert step >= CRASH_AT
    assert text.index(f"flushed the step {step} snapshot to disk") > flushed.start()

    kinds = [(e["kind"], e.get("cause")) for e in _events(run_dir)]
    assert kinds.index(("decision", None)) < kinds.index(("checkpoint", "flush")), kinds
    assert step in durable.committed_steps(run_dir / "ckpt")

    # The restarted workers saved every step while the flush held a slot of each.
    assert "skipped" not in text, text[-4000:]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_with_two_slots_a_skipped_snapshot_is_warned_counted_and_reported(
    tmp_path: Path, job_env
) -> None:
    # Two slots: while the persister holds one (its copies slowed as above), a save that finds
    # the other holding the newest snapshot has nowhere to go.
    env = dict(job_env, **{COPY_DELAY_ENV: "2"})
    run_dir = tmp_path / "run"
    # Each persist holds a slot for 2 s at least, longer than a step: from the third step or so
    # on, some saves find no free slot (8 steps: several chances on a loaded host too).
    cmd = [*tuned_run({"ckpt_memory_slots": 2}), "--standalone", "--nproc-per-node", "2",
           "--run-dir", str(run_dir), "--ckpt-persist-every", "1",
           "--monitor-interval", "0.2",
           str(EXAMPLES / "train_elasticft.py"), "--steps", "8", *MODEL]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400, cwd=tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    warned = text.count("skipped: no free memory slot")
    assert warned >= 1, text[-4000:]
    skipped = [e for e in _events(run_dir) if e["kind"] == "snapshot_skipped"]
    assert len(skipped) == warned  # every warning of every worker, counted once
    assert all("ckpt_memory_slots" in e["reason"] for e in skipped)

    status = subprocess.run([str(BIN / "elasticft"), "status", "--run-dir", str(run_dir)],
                            env=job_env, capture_output=True, text=True, timeout=60)
    assert f"snapshots skipped: {warned}" in status.stdout, status.stdout + status.stderr
    report = subprocess.run([str(BIN / "elasticft"), "report", str(run_dir)],
                            env=job_env, capture_output=True, text=True, timeout=60)
    assert f"snapshots skipped: {warned}" in report.stdout, report.stdout + report.stderr
