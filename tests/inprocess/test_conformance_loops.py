"""In-process recovery of plain training loops as users write them, a conformance matrix: a
loop pattern of bench/conformance_loop.py under a real ``elasticft-run --standalone
--nproc-per-node 2`` (gloo), rank 1 SIGKILLed at a fault point; rank 0 keeps its process, a
replacement takes rank 1, and both ranks' losses and parameters (a hash of their bytes) after
every step are those of an uninterrupted run of the same pattern, bit for bit.

The patterns are the script's flags, combined so that few runs cover them all: every pattern
at once (zero_grad after the step, 2 micro-batches under no_sync, clipping, a LambdaLR warm-up,
dropout, augmentation from torch's, numpy's and Python's RNGs, a DataLoader with worker
processes over a shuffling DistributedSampler, bf16 autocast, an EMA outside the optimizer) at
five fault points and a second failure right after the recovery, and zero_grad before the
backward under torch.compile.
Each pattern's uninterrupted run is made once, by the first cell that needs it. The causes one
at a time are tested without processes: tests/ckpt/restoring/test_state.py (numpy's RNG, the
gradients a restore drops) and tests/inprocess/test_inprocess_decisions.py (those a re-entry
drops). bench/conformance.py runs every pattern alone and together, at every fault point."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from elasticft.events import read_events
from tests.conftest import BIN, ROOT, pids_by_rank

SCRIPT = ROOT / "bench" / "conformance_loop.py"
STEPS = 16
CRASH_AT = 7

PATTERNS = {
    # nanoGPT's order (zero_grad after the step), 2 micro-batches under no_sync, clipping, a
    # LambdaLR warm-up, dropout, augmentation from torch's, numpy's and Python's RNGs, a
    # DataLoader (no generator of its own) with 2 worker processes over a shuffling
    # DistributedSampler, augmentation drawn in those workers, the forward under CPU autocast
    # to bfloat16, and an EMA of the weights outside the optimizer
    "all": ("--zero-grad", "after", "--accum", "2", "--clip", "--warmup", "--dropout",
            "--augment", "--loader", "--loader-workers", "2", "--worker-augment", "--autocast",
            "--ema"),
    # zero_grad before the backward, one batch per step, the model under torch.compile
    "zero-grad-before+compile": ("--zero-grad", "before", "--clip", "--warmup", "--dropout",
                                 "--augment", "--loader", "--compile"),
}


def _run(tmp: Path, name: str, env: dict[str, str], *flags: str) -> dict:
    losses, pids = tmp / f"{name}.loss", tmp / f"{name}.pid"
    cmd = [str(BIN / "elasticft-run"), "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "3", "--run-dir", str(tmp / name), "--ckpt-persist-every", "0",
           "--monitor-interval", "0.1", str(SCRIPT), "--steps", str(STEPS),
           "--loss-log", str(losses), "--pid-log", str(pids), *flags]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=tmp)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-5000:]
    by_step: dict[tuple[int, int], str] = {}
    for line in losses.read_text().splitlines():
        rank, step, loss = line.split()
        by_step[int(rank), int(step)] = loss  # a step redone keeps its last try
    return {"text": text, "losses": by_step, "pids": pids_by_rank(pids),
            "events": read_events(tmp / name)}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """``uninterrupted[pattern]``: the losses of an uninterrupted run of the pattern, each made
    once in this module, when a cell first needs it."""
    from tests.conftest import clean_job_env

    class Lazy(dict):
        def __missing__(self, pattern: str) -> dict[tuple[int, int], str]:
            run = _run(tmp_path_factory.mktemp(f"reference-{pattern}"), "reference",
                       clean_job_env(), *PATTERNS[pattern])
            assert sorted(run["losses"]) == [(r, s) for r in (0, 1)
                                             for s in range(1, STEPS + 1)]
            self[pattern] = run["losses"]
            return self[pattern]

    return Lazy()


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("pattern", "mode"), [
    ("all", "after-save"),  # the others wait in the next step's all-reduce
    ("all", "right-after-save"),
    ("all", "before-save"),  # the step is redone
    ("all", "mid-step"),  # in the last micro-batch: the others hold the first one's gradients
    ("all", "in-optimizer-step"),  # the survivor is interrupted inside its optimizer.step()
    ("zero-grad-before+compile", "after-save"),
])
def test_a_plain_loop_recovered_in_process_has_an_uninterrupted_runs_losses(
        tmp_path: Path, job_env: dict[str, str], uninterrupted: dict[str, dict], pattern: str,
        mode: str) -> None:
    run = _run(tmp_path, "fault", job_env, *PATTERNS[pattern], "--fault-rank", "1",
               "--crash-at-step", str(CRASH_AT), "--crash-mode", mode)
    kinds = [e["kind"] for e in run["events"]]
    assert "restart" not in kinds and kinds.count("recover_in_process") == 1, run["text"][-5000:]
    assert len(run["pids"][0]) == 1, run["pids"]  # rank 0 kept its process
    assert len(run["pids"][1]) == 2, run["pids"]  # rank 1 was replaced
    reference = uninterrupted[pattern]
    differing = {key: (run["losses"].get(key), loss) for key, loss in reference.items()
                 if run["losses"].get(key) != loss}
    assert not differing, f"(rank, step): (after the recovery, uninterrupted) {differing}"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_second_failure_right_after_the_recovery_falls_back_to_a_restart_and_stays_exact(
        tmp_path: Path, job_env: dict[str, str], uninterrupted: dict[str, dict]) -> None:
    """Rank 1 killed after step 7's save, then its replacement killed in its first step: the
    second failure cuts the in-process recovery short, and the agent restarts every rank from
    the newest step instead of trying in process again; the losses are still the
    uninterrupted run's."""
    run = _run(tmp_path, "fault", job_env, *PATTERNS["all"], "--fault-rank", "1",
               "--crash-at-step", str(CRASH_AT), "--crash-mode", "twice")
    decisions = [e for e in run["events"] if e["kind"] == "decision"]
    assert [d["action"] for d in decisions] == ["recover_in_process", "restart_in_place"], \
        run["text"][-5000:]
    assert decisions[1]["in_process_failed_at"] is not None, decisions[1]
    assert len(run["pids"][1]) >= 2, run["pids"]
    reference = uninterrupted["all"]
    differing = {key: (run["losses"].get(key), loss) for key, loss in reference.items()
                 if run["losses"].get(key) != loss}
    assert not differing, f"(rank, step): (after the recovery, uninterrupted) {differing}"
