"""The Hugging Face Trainer's ``train()`` recovered in process (``elasticft.integrations.hf
.train``) under a real ``elasticft-run``: rank 1 SIGKILLed mid-training, rank 0 keeps its
process, and the run ends with an uninterrupted run's steps and parameters, bit for bit."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import clean_job_env
from tests.integrations.jobs import assert_recovered_in_process, needs_modules, run_job

pytestmark = needs_modules("hf", "transformers", "accelerate")

SCRIPT = "train_hf_inprocess.py"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_rank_costs_the_survivor_a_rollback_not_its_process(
        tmp_path: Path, job_env: dict[str, str]) -> None:
    reference = run_job(tmp_path, SCRIPT, "reference", job_env)
    run = run_job(tmp_path, SCRIPT, "fault", job_env, "--crash-at-step", "5", "--save-steps", "3",
                  "--output-dir", str(tmp_path / "own"))
    assert_recovered_in_process(run, reference)
    assert "Trainer entry 2 resumes from step 4" in run["text"]
    # The Trainer's own checkpoints are written through the recovery as without it.
    assert sorted(p.name for p in (tmp_path / "own").iterdir()) == [
        "checkpoint-12", "checkpoint-3", "checkpoint-6", "checkpoint-9"]


GPT2 = ("--model", "gpt2", "--epochs", "3", "--shuffle-from-torch-rng")
"""A one-layer GPT-2 at GPT2Config's default dropout: 18 steps of 6 per epoch, every one
drawing from torch's RNG, as does the order of each epoch (accelerate's unseeded sampler)."""


@pytest.fixture(scope="module")
def gpt2_reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """An uninterrupted run with ``GPT2``, shared by the tests that compare to it."""
    return run_job(tmp_path_factory.mktemp("gpt2"), SCRIPT, "reference", clean_job_env(), *GPT2)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_rank_killed_before_the_first_snapshot_rolls_the_survivor_back_to_the_start(
        tmp_path: Path, job_env: dict[str, str], gpt2_reference: dict) -> None:
    """Killed after its first optimizer step, before that step's snapshot: the survivor's model
    had taken the step, and only the start's snapshot (step 0) puts it back, with the RNG. The
    GPT-2's dropout and accelerate's unseeded sampler draw from it: the survivor's new data
    loader seeds its generator before the restore, which puts back the first epoch's too."""
    run = run_job(tmp_path, SCRIPT, "fault", job_env, *GPT2, "--crash-at-step", "1")
    assert_recovered_in_process(run, gpt2_reference)
    assert "resumed from step 0 in shared memory" in run["text"], run["text"][-5000:]
    assert "entry 2 resumes" not in run["text"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dropout_after_a_recovery_draws_what_an_uninterrupted_run_draws(
        tmp_path: Path, job_env: dict[str, str], gpt2_reference: dict) -> None:
    """Killed mid-epoch: the survivor and the replacement redo step 8 with the RNG the
    uninterrupted run had there, not the one the resumed data loader left (it draws its seeds
    while skipping the batches done) nor the replacement's freshly seeded one."""
    reference = gpt2_reference
    run = run_job(tmp_path, SCRIPT, "fault", job_env, *GPT2, "--crash-at-step", "8")
    assert_recovered_in_process(run, reference)
    assert "Trainer entry 2 resumes from step 7" in run["text"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_accumulation_warmup_callbacks_and_a_save_roll_back_exactly(
        tmp_path: Path, job_env: dict[str, str]) -> None:
    """Two batches per step, a warmup, a callback with its own state, an evaluation and the
    Trainer's checkpoints every 3 steps, the epoch's order drawn from a generator that advances
    every epoch (accelerate's unseeded sampler); rank 1 killed at the end of step 7, right
    after the evaluation and save of step 6, the last of an epoch: the run resumes at the next
    epoch's start from step 6 (its save done on every rank) and ends as the uninterrupted run,
    the callback's counts included."""
    extra = ("--grad-accum", "2", "--epochs", "4", "--warmup-steps", "4", "--count-steps",
             "--save-steps", "3", "--eval-steps", "3", "--shuffle-from-torch-rng")
    reference = run_job(tmp_path, SCRIPT, "reference", job_env, "--model", "gpt2", *extra,
                        "--output-dir", str(tmp_path / "own-reference"))
    run = run_job(tmp_path, SCRIPT, "fault", job_env, "--model", "gpt2", *extra,
                  "--crash-at-step", "7", "--output-dir", str(tmp_path / "own"))
    assert_recovered_in_process(run, reference)
    assert "Trainer entry 2 resumes from step 6" in run["text"]
    counts = counted(reference["text"])
    assert counts == ["rank 0 counted 12 step begins, 12 step ends",
                      "rank 1 counted 12 step begins, 12 step ends"], counts
    assert counted(run["text"]) == counts
    saved = {p.name: sorted(f.name for f in p.glob("rng_state_*.pth"))
             for p in (tmp_path / "own").iterdir()}
    assert saved == {f"checkpoint-{step}": ["rng_state_0.pth", "rng_state_1.pth"]
                     for step in (3, 6, 9, 12)}


def counted(text: str) -> list[str]:
    """Each rank's count of step begins and ends, wherever it is in the job's output: two
    workers share the output, and a print's text and its newline are two writes, so another
    worker's line can come between them."""
    return sorted(re.findall(r"rank \d+ counted \d+ step begins, \d+ step ends", text))
