"""Lightning's ``trainer.fit`` recovered in process under a real ``elasticft-run``, with DDP
(``InProcessDDPStrategy``), and with FSDP2 and with tensor parallel
(``InProcessModelParallelStrategy``, the survivor keeping its sharded module): rank 1 SIGKILLed
mid-training, rank 0 keeps its process, and the run ends with an uninterrupted run's steps and
parameters, bit for bit, and with its callback's own count of batches. Lightning's
``ModelCheckpoint`` decides on every rank alike after a roll-back (its state rolled back with
the step), with ``lightning.pytorch`` and with the standalone ``pytorch_lightning``;
``EarlyStopping`` on an epoch-mean loss, ``LearningRateMonitor`` and gradient accumulation are
exact, with a fault at a step's end and in the middle of Lightning's checkpoint write."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from elasticft.integrations.lightning import package_in_use
from tests.conftest import BIN, clean_job_env
from tests.integrations.jobs import assert_recovered_in_process, needs_modules, run_job

pytestmark = needs_modules("lightning", "lightning")

SCRIPT = "train_lightning_inprocess.py"


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., dict]:
    """An uninterrupted run per strategy, made once for the module's tests."""
    made: dict[tuple[str, ...], dict] = {}

    def reference(*strategy: str) -> dict:
        if strategy not in made:
            made[strategy] = run_job(tmp_path_factory.mktemp("reference"), SCRIPT, "reference",
                                     clean_job_env(), *strategy)
        return made[strategy]
    return reference


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", [(), ("--model-parallel",),
                                      ("--model-parallel", "--tensor-parallel")],
                         ids=["ddp", "fsdp2", "tensor-parallel"])
def test_a_killed_rank_costs_the_survivor_a_rollback_not_its_process(
        tmp_path: Path, job_env: dict[str, str], references: Callable[..., dict],
        strategy: tuple[str, ...]) -> None:
    reference = references(*strategy)
    run = run_job(tmp_path, SCRIPT, "fault", job_env, *strategy, "--crash-at-step", "4",
                  "--checkpoint-dir", str(tmp_path / "own"))
    assert_recovered_in_process(run, reference)
    if strategy:  # the sharded module kept: its mesh's groups made again, FSDP2 re-pointed
        fsdp2 = 0 if "--tensor-parallel" in strategy else 1
        assert f"1 meshes, {fsdp2} FSDP2 group references" in run["text"]
    assert "Lightning entry 2 resumes from step 3" in run["text"]
    # Lightning's own checkpoints are written through the recovery as without it.
    # (every 3 steps: 12 steps with 2 data-parallel ranks, 24 when both are tensor parallel)
    saved = sorted(int(p.name.split("step=")[1].removesuffix(".ckpt"))
                   for p in (tmp_path / "own").iterdir())
    assert saved == list(range(3, run["report"]["last_step"] + 1, 3)), saved


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_rank_killed_before_the_first_snapshot_rolls_the_survivor_back_to_the_start(
        tmp_path: Path, job_env: dict[str, str], references: Callable[..., dict]) -> None:
    """Killed at the start of its second batch, before the snapshot of its first step (taken
    there, after the callbacks): the survivor's model had taken the step, and only the start's
    snapshot (step 0) puts it back."""
    reference = references()
    run = run_job(tmp_path, SCRIPT, "fault", job_env, "--crash-at-step", "1")
    assert_recovered_in_process(run, reference)
    assert "resumed from step 0 in shared memory" in run["text"], run["text"][-5000:]
    assert "entry 2 resumes" not in run["text"]


CHECKPOINTED = ("--epochs", "4", "--checkpoint-every", "5", "--save-last", "--dropout", "0.25")
"""24 steps with dropout, ModelCheckpoint every 5 steps with save_last and save_top_k=-1."""


def checkpoint_steps(directory: Path) -> list[int]:
    """The steps of Lightning's checkpoints in ``directory`` (a step written again after a
    roll-back is named ``...-v1`` by Lightning, and counted once)."""
    return sorted({int(p.name.split("step=")[1].split("-")[0].removesuffix(".ckpt"))
                   for p in directory.glob("*step=*.ckpt")})


@pytest.fixture(scope="module")
def checkpointed_reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """An uninterrupted run with ``CHECKPOINTED``, shared by the tests that compare to it."""
    tmp = tmp_path_factory.mktemp("checkpointed")
    run = run_job(tmp, SCRIPT, "reference", clean_job_env(), *CHECKPOINTED, "--checkpoint-dir",
                  str(tmp / "own"))
    assert checkpoint_steps(tmp / "own") == [5, 10, 15, 20], list((tmp / "own").iterdir())
    return {**run, "own": tmp / "own"}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("package", "crash"), [
    ("lightning.pytorch", 10), ("pytorch_lightning", 7),
], ids=["at-a-checkpoint-step", "pytorch_lightning-before-one"])
def test_model_checkpoint_every_5_steps_decides_alike_on_every_rank_after_a_rollback(
        tmp_path: Path, job_env: dict[str, str], checkpointed_reference: dict, crash: int,
        package: str) -> None:
    """Rank 1 killed at the end of step ``crash``, after its callbacks (at step 10: after
    ModelCheckpoint wrote step 10) and before its snapshot: the survivor and the replacement
    redo it from step ``crash - 1`` with the callbacks' states of that step (the survivor's
    ModelCheckpoint had saved step 10, the replacement's is new), so both save at step 10 (or
    both not) and at every later checkpoint step, where they waited in different collectives
    before. Dropout draws from the RNG the roll-back puts back. The standalone
    ``pytorch_lightning`` takes the same strategy, imported from the same place."""
    if importlib.util.find_spec(package.split(".")[0]) is None:
        pytest.skip(f"needs {package}")
    extra = ("--pytorch-lightning",) if package == "pytorch_lightning" else ()
    own = tmp_path / "own"
    run = run_job(tmp_path, SCRIPT, "fault", job_env, *CHECKPOINTED, *extra, "--crash-at-step",
                  str(crash), "--checkpoint-dir", str(own))
    assert_recovered_in_process(run, checkpointed_reference)  # the count of batches included
    assert f"Lightning entry 2 resumes from step {crash - 1}" in run["text"], run["text"][-5000:]
    assert checkpoint_steps(own) == [5, 10, 15, 20], list(own.iterdir())
    assert (own / "last.ckpt").exists()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_relaunch_resumed_mid_epoch_from_last_ckpt_redoes_a_step_of_that_epoch_exactly(
        tmp_path: Path, job_env: dict[str, str], checkpointed_reference: dict) -> None:
    """A relaunch with one more epoch and ``fit(ckpt_path="last")`` from the checkpointed run's
    ``last.ckpt`` (step 20, two batches into the fourth epoch): Lightning iterates that epoch's
    plain loader from its start while its counters go on from 2, so a step of that epoch redone
    in process (rank 1 killed at the end of step 22) must draw the iterator's second batch, not
    the epoch's fourth."""
    runs = {}
    for name, fault in (("reference", ()), ("fault", ("--crash-at-step", "22"))):
        own = tmp_path / name / "own"
        shutil.copytree(checkpointed_reference["own"], own)
        runs[name] = run_job(tmp_path / name, SCRIPT, name, clean_job_env() if not fault
                             else job_env, "--epochs", "5", *CHECKPOINTED[2:], "--resume-last",
                             "--checkpoint-dir", str(own), *fault)
    assert runs["reference"]["report"]["last_step"] == 30
    assert_recovered_in_process(runs["fault"], runs["reference"])
    assert "Lightning entry 2 resumes from step 21" in runs["fault"]["text"]


@pytest.mark.parametrize(("imported", "installed", "expected"), [
    ({"lightning.pytorch"}, {"lightning", "pytorch_lightning"}, "lightning.pytorch"),
    ({"pytorch_lightning"}, {"lightning", "pytorch_lightning"}, "pytorch_lightning"),
    ({"lightning.pytorch", "pytorch_lightning"}, {"lightning"}, "lightning.pytorch"),
    (set(), {"pytorch_lightning"}, "pytorch_lightning"),
    (set(), {"lightning", "pytorch_lightning"}, "lightning.pytorch"),
], ids=["unified", "standalone", "both-imported", "standalone-installed", "none-imported"])
def test_the_strategy_is_made_for_the_package_the_script_imported(
        imported: set[str], installed: set[str], expected: str) -> None:
    assert package_in_use(imported, installed.__contains__) == expected


def test_a_model_checkpoint_is_rolled_back_with_its_decision(tmp_path: Path) -> None:
    """What a snapshot takes of a ModelCheckpoint that wrote step 10 puts a new one (the
    replacement's) in the same state, its decision to skip step 10 included."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from elasticft.integrations.lightning import callback_states, load_callback_states

    def checkpoint() -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=5, save_top_k=-1,
                               save_last=True)

    wrote = checkpoint()
    wrote._last_global_step_saved, wrote._last_checkpoint_saved = 10, str(tmp_path / "a.ckpt")
    wrote.best_model_path = wrote.last_model_path = str(tmp_path / "last.ckpt")
    new = checkpoint()
    load_callback_states([new], callback_states([wrote]))
    assert new.state_dict() == wrote.state_dict()
    assert new._last_global_step_saved == 10
    assert new._last_checkpoint_saved == str(tmp_path / "a.ckpt")


def test_the_epochs_logged_values_are_put_back_before_their_next_update() -> None:
    """A mean, a max and a sum logged for the epoch: taken at a step, changed by the steps
    after it, put back into the survivor's collection (whose first log of the entry resets
    them, as Lightning does at a resume) and into a new, empty one (the replacement's); the next
    update of each lands on the taken value in both."""
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

    from elasticft.integrations.lightning import logged_results, put_back_logged_results

    def log(results: _ResultCollection, value: float) -> None:
        results.log("training_step", "mean", torch.tensor(value), on_step=False, on_epoch=True,
                    batch_size=4)
        results.log("training_step", "max", torch.tensor(value), on_step=False, on_epoch=True,
                    reduce_fx="max", batch_size=4)
        results.log("training_step", "sum", torch.tensor(value), on_step=False, on_epoch=True,
                    reduce_fx="sum", batch_size=4)

    def computed(results: _ResultCollection) -> dict[str, float]:
        return {k: float(v.compute()) for k, v in results.items()}

    survivor = _ResultCollection(training=True)
    for value in (0.5, 2.0, 1.0):
        log(survivor, value)
    taken = logged_results(survivor)
    for value in (3.0, 4.0):  # the steps a failure rolls back
        log(survivor, value)
    put_back_logged_results(survivor, taken)
    survivor.reset(metrics=False, fx="training_step")  # Lightning, at the entry's first log
    log(survivor, 1.5)
    replacement = _ResultCollection(training=True)
    put_back_logged_results(replacement, taken)
    log(replacement, 1.5)
    uninterrupted = _ResultCollection(training=True)
    for value in (0.5, 2.0, 1.0, 1.5):
        log(uninterrupted, value)
    assert computed(survivor) == computed(replacement) == computed(uninterrupted) == {
        "training_step.mean": 1.25, "training_step.max": 2.0, "training_step.sum": 5.0}
    assert "update_metrics" not in vars(replacement)  # Lightning's own method again


CALLBACKS = ("--epochs", "6", "--checkpoint-every", "2", "--save-last", "--dropout", "0.25",
             "--early-stopping", "--lr-monitor", "--accumulate", "2")
"""EarlyStopping on the epoch's mean loss (it ends the run at step 9 of 18), a
LearningRateMonitor with a CSV logger, 2 batches per optimizer step, ModelCheckpoint every 2."""


@pytest.fixture(scope="module")
def callbacks_reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("callbacks")
    return run_job(tmp, SCRIPT, "reference", clean_job_env(), *CALLBACKS, "--checkpoint-dir",
                   str(tmp / "own"), "--log-dir", str(tmp / "csv"))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_early_stopping_lr_monitor_and_accumulation_are_rolled_back_with_the_step(
        tmp_path: Path, job_env: dict[str, str], callbacks_reference: dict) -> None:
    """Rank 0 killed half-way through Lightning's write of step 4's checkpoint: the
    epoch-mean loss EarlyStopping reads covers the batches before the restored step (they were
    dropped from it, and the run stopped at another step), and an accumulated step is
    snapshotted at its first batch only (a snapshot of its second batch lost the first one's
    gradients). bench/conformance.py has the fault at a step's end too."""
    run = run_job(tmp_path, SCRIPT, "fault", job_env, *CALLBACKS, "--fault-rank", "0",
                  "--crash-at-step", "4", "--crash-in-checkpoint-write", "--checkpoint-dir",
                  str(tmp_path / "own"), "--log-dir", str(tmp_path / "csv"))
    assert_recovered_in_process(run, callbacks_reference, replaced=0)


@pytest.mark.timeout(180)
def test_a_worker_forked_with_lightning_imported_holds_its_own_rank(tmp_path: Path,
                                                                    job_env: dict[str, str]
                                                                    ) -> None:
    # The warm template imports Lightning for a script that imports it at its top; the rank
    # Lightning read from the template's environment is set again in each forked worker.
    out = subprocess.run(
        [str(BIN / "elasticft-run"), "--standalone", "--nproc-per-node", "2", "--run-dir",
         str(tmp_path / "run"), str(Path(__file__).parent / "workers" / "lightning_rank.py")],
        env=job_env, capture_output=True, text=True, timeout=150, cwd=tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    started = [line for line in text.splitlines() if "warm template" in line and "started" in line]
    assert started and "lightning" in started[0], text[-3000:]
    assert sum("forked from warm template" in line for line in text.splitlines()) == 2, text
    assert sorted(line[line.index("RANK"):] for line in text.splitlines()
                  if "rank_zero_only.rank" in line) == [
        "RANK 0 rank_zero_only.rank 0", "RANK 1 rank_zero_only.rank 1"], text[-3000:]
