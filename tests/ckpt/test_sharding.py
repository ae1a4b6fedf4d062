"""Every way users shard state restores, through every tier, bit for bit: the sharding table.

Rows are the ways a model's state is laid out over ranks (:data:`shard_job.ROWS`): a plain
module on every rank, DDP, FSDP2 (``fully_shard`` on each layer and on the root) with and
without ``reshard_after_forward``, FSDP2 over a 2-D mesh, data parallel x tensor parallel
through ``parallelize_module``, and HSDP (FSDP2 replicated along one mesh dimension, sharded
along the other). Columns are the tiers a restore can come from: shared memory,
local disk, the backup peer, the remote directory, and ``load()`` followed by ``restore``.

Real gloo ranks (:mod:`tests.ckpt.shard_job`) train each row 2 steps with a snapshot after each
and take the uninterrupted step 3; a fresh model and optimizer (another seed) then restore from
each tier and take step 3 again. Per cell: the restored tensors (local shards, parameters and
AdamW state) equal the saved ones bitwise, the RNG state is back, and the loss and the whole
state after step 3 equal the uninterrupted run's. The rows run on 2 ranks, the 2-D rows on 4
(2 x 2 meshes). Each row's durable checkpoint is then restored at another world size (2 -> 1,
4 -> 2), resharded by ``dcp.load``, and its gathered state must equal the saved one. Last,
the example trained with FSDP2 under ``elasticft-run`` survives a SIGKILL with every loss equal
to an uninterrupted run's, and that run relaunched on fewer workers resumes resharded.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest

from elasticft.ckpt.memory import shm
from tests.ckpt.shard_job import ROWS, TIERS
from tests.forked import killed, start_forked

ROOT = Path(__file__).resolve().parents[2]
JOB = Path(__file__).with_name("shard_job.py")
WORLD = {"plain": 2, "ddp": 2, "fsdp2": 2, "fsdp2-no-reshard": 2, "fsdp2-tp": 4, "hsdp": 4}
"""The world size each row is trained at (the 2-D rows need a 2 x 2 mesh)."""
SHARD_JOB_IMPORTS = ("tests.ckpt.shard_job",)
"""What the ranks import, imported once before they are forked (the job's own module: its
imports are the heavy part)."""
SHARDED = {"fsdp2", "fsdp2-no-reshard", "fsdp2-tp", "hsdp"}


def _launch(world: int, tmp: Path, tasks: list[str], env: dict[str, str]) -> None:
    """``world`` ranks of :mod:`tests.ckpt.shard_job` doing ``tasks``, forked from one
    interpreter (:mod:`tests.forked`)."""
    init = tmp / f"init-{uuid.uuid4().hex[:8]}"
    env = dict(env, PYTHONPATH=str(ROOT))
    ranks = [(env, [str(JOB), str(rank), str(world), str(init), str(os.getpid()), str(tmp),
                    *tasks]) for rank in range(world)]
    with killed(start_forked(ranks, SHARD_JOB_IMPORTS, env, ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)) as job:
        out = job.communicate(timeout=400)[0]
    assert job.returncode == 0, out[-6000:]


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tests.conftest import clean_job_env

    tmp = tmp_path_factory.mktemp("sharding")
    env = clean_job_env()
    try:
        four = [row for row in ROWS if WORLD[row] == 4]
        two = [row for row in ROWS if WORLD[row] == 2]
        _launch(4, tmp, [f"table:{row}" for row in four], env)
        _launch(2, tmp, [f"table:{row}" for row in two] + [f"reshard:{row}" for row in four],
                env)
        _launch(1, tmp, [f"reshard:{row}" for row in two], env)
        yield tmp
    finally:
        for path in shm.SHM_DIR.glob(f"elasticft-ckpt-{os.getpid()}-tbl-*"):
            path.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def fsdp2_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """An uninterrupted run of examples/train_elasticft.py --fsdp2 on 2 workers, made once for
    the module, one step longer than the crashed run: a step's loss does not depend on
    ``--steps`` (no schedule looks at the total), so its first N steps are the losses of any
    uninterrupted N-step run of the same script, and its last one is what the crashed run's
    relaunch on fewer workers takes next."""
    from tests.ckpt.test_recovery import STEPS, _run
    from tests.conftest import clean_job_env

    _, losses = _run(tmp_path_factory.mktemp("fsdp2-reference"), "reference", clean_job_env(),
                     "--fsdp2", "--steps", str(STEPS + 1))
    return losses


@pytest.fixture(scope="module")
def fsdp2_crashed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, dict[int, str]]:
    """examples/train_elasticft.py with --fsdp2 (fully_shard on each block and the root), a
    snapshot every step, rank 1 SIGKILLed after its save of step 6 on 2 gloo workers, run once
    for the module: its run directory (its last step persisted when it ended), its output and
    its losses. One test checks the recovery, the other relaunches the run on fewer workers."""
    from tests.ckpt.test_recovery import _run
    from tests.conftest import clean_job_env

    tmp = tmp_path_factory.mktemp("fsdp2-crash")
    text, losses = _run(tmp, "crash", clean_job_env(), "--fsdp2", "--crash-at-step", "6",
                        "--fault-rank", "1", "--crash-mode", "after-save")
    return tmp / "crash", text, losses


def _cells(table: Path, row: str, name: str) -> list[dict[str, Any]]:
    return [json.loads((table / row / f"{name}-{rank}.json").read_text())
            for rank in range(WORLD[row])]


@pytest.mark.timeout(30)
def test_every_row_has_a_world_size() -> None:
    assert set(WORLD) == set(ROWS)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("row", list(ROWS))
def test_a_restore_from_every_tier_is_bit_exact_and_steps_on_as_if_uninterrupted(
    table: Path, row: str, tier: str
) -> None:
    for rank, cells in enumerate(_cells(table, row, "table")):
        cell = cells[tier]
        where = f"{row}/{tier} rank {rank}"
        source = "memory" if tier == "load+restore" else tier
        assert (cell["step"], cell["extra"], cell["source"]) == (2, {"step": 2}, source), where
        assert cell["restored_differs"] == [], where
        assert cell["rng"], where
        assert cell["loss_equal"], where
        assert cell["next_differs"] == [], where


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("row", list(ROWS))
def test_whole_tensors_restore_into_each_ranks_shard(table: Path, row: str) -> None:
    for rank, cells in enumerate(_cells(table, row, "table")):
        assert cells["whole-model"] == [], f"{row} rank {rank}"


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("row", list(ROWS))
def test_a_durable_checkpoint_reshards_into_another_world_size(table: Path, row: str) -> None:
    world = WORLD[row] // 2
    results = [json.loads((table / row / f"reshard-{rank}.json").read_text())
               for rank in range(world)]
    for rank, result in enumerate(results):
        # A copy with one shard damaged is refused (no older step there): nothing restored.
        assert result == {"restored": [2, {"step": 2}], "source": "reshard", "differs": [],
                          "damaged": None}, f"{row} rank {rank} at world size {world}"


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("row", list(ROWS))
def test_a_sharded_snapshot_into_an_unsharded_model_is_one_error_naming_the_tensor(
    table: Path, row: str
) -> None:
    for cells in _cells(table, row, "table"):
        error = cells["into-unsharded"]
        if row not in SHARDED:
            assert error is None
            continue
        assert error is not None and error.startswith("elasticft.ckpt.api.StateMismatch: ")
        assert "checkpoint item 'model.0.weight' is a shard of shape [" in error, error
        assert "the model is not sharded" in error, error


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_an_fsdp2_worker_sigkilled_under_elasticft_run_resumes_with_identical_losses(
    fsdp2_crashed: tuple[Path, str, dict[int, str]], fsdp2_reference: dict[int, str]
) -> None:
    from tests.ckpt.test_recovery import STEPS

    _, text, resumed = fsdp2_crashed
    assert "signal SIGKILL" in text
    assert "resumed from step 6 (source=memory)" in text, text[-4000:]
    assert sorted(fsdp2_reference) == list(range(1, STEPS + 2))
    # bitwise (losses logged with repr)
    assert resumed == {step: fsdp2_reference[step] for step in range(1, STEPS + 1)}


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_an_fsdp2_job_relaunched_on_fewer_workers_resumes_from_its_checkpoint_resharded(
    tmp_path: Path, job_env: dict[str, str], fsdp2_crashed: tuple[Path, str, dict[int, str]],
    fsdp2_reference: dict[int, str]
) -> None:
    """The crashed run (10 steps on 2 workers, its last step persisted when it ended) launched
    again in its run directory on 1 worker for one more step: it resumes from step 10, resharded
    by dcp.load, and its first loss (rank 0's batch through the restored parameters) is an
    uninterrupted 2-worker run's step 11 loss, bit for bit."""
    from tests.ckpt.test_recovery import STEPS
    from tests.conftest import BIN, EXAMPLES

    run_dir, _, _ = fsdp2_crashed
    log = tmp_path / "relaunch.loss"
    cmd = [str(BIN / "elasticft-run"), "--standalone", "--nproc-per-node", "1", "--run-dir",
           str(run_dir), str(EXAMPLES / "train_elasticft.py"), "--fsdp2", "--steps",
           str(STEPS + 1), "--loss-log", str(log)]
    out = subprocess.run(cmd, env=job_env, capture_output=True, text=True, timeout=200,
                         cwd=tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert f"resumed from step {STEPS} (source=reshard)" in text, text[-4000:]
    losses = dict(line.split() for line in log.read_text().splitlines())
    assert losses == {str(STEPS + 1): fsdp2_reference[STEPS + 1]}
