"""Which GPU each process of a node uses while its workers recover in process, by tables: a new
spare goes on a GPU no worker uses (after a spare took a rank, the one that rank's dead worker
freed), a replacement only on the GPU its environment names when that one is free and did not
fault, and which failures name a fault of the GPU. End to end under a real ``elasticft-run``
(gloo) whose workers are told of two GPUs (``CUDA_VISIBLE_DEVICES``, which torch's CPU build
ignores): a survivor whose device fails its health check gets no replacement on that GPU, and
the policy restarts the workers instead, with the reason in the event log."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticft.addon.classify import device_fault
from elasticft.inprocess.placement import (
    GpuUse,
    replacement_gpu,
    restarted,
    spare_gpu,
    taken,
)
from elasticft.inprocess.spare_keeper import SpareMove, next_move
from tests.inprocess.test_inprocess import STEPS, _run

THREE = ("0", "1", "2")


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("use", "gpu"), [
    (GpuUse.start([], [0, 1]), ""),  # a CPU node: nothing to choose
    (GpuUse.start(["0", "1"], [0, 1]), None),  # every GPU runs a rank: no spare
    (GpuUse.start(THREE, [0, 1]), "2"),  # the GPU no worker uses
    (GpuUse.start(["4", "5", "6", "7"], [0, 1]), "6"),  # CUDA_VISIBLE_DEVICES=4,5,6,7
    (GpuUse.start(["0"], [0]), None),
    # the spare on GPU 2 took local rank 1: GPU 1, freed by rank 1's dead worker, is next
    (taken(GpuUse(THREE, {0: "0", 1: "1"}, spare="2"), 1), "1"),
    # ... never GPU 2, which rank 1 now uses
    (GpuUse(THREE, {0: "0", 1: "2"}), "1"),
    # a GPU that faulted gets no spare
    (GpuUse(THREE, {0: "0", 1: "1"}, faulty=frozenset({"2"})), None),
    (GpuUse(("0", "1", "2", "3"), {0: "0", 1: "1"}, faulty=frozenset({"2"})), "3"),
], ids=["cpu", "full", "free", "visible", "one", "freed-by-the-taken-rank", "not-in-use",
        "faulty", "past-a-faulty"])
def test_a_spare_goes_on_a_gpu_no_worker_uses(use: GpuUse, gpu: str | None) -> None:
    chosen, why = spare_gpu(use)
    assert chosen == gpu and why
    move = next_move(enabled=True, running=False, failed=0, armed=True, recovering=False,
                     warm_ready=None, placeable=chosen is not None)
    assert move is (SpareMove.START if chosen is not None else SpareMove.OFF)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("use", "local_rank", "fault", "gpu", "stop_spare", "why"), [
    (GpuUse.start([], [0, 1]), 1, True, "", False, "no GPU"),  # CPU: always a replacement
    (GpuUse.start(THREE, [0, 1]), 1, False, "1", False, "freed by its dead worker"),
    # its worker died of a device fault: no replacement on that GPU
    (GpuUse.start(THREE, [0, 1]), 1, True, None, False, "failed"),
    (GpuUse(THREE, {0: "0", 1: "1"}, faulty=frozenset({"1"})), 1, False, None, False,
     "failed"),
    # a spare took local rank 1 (GPU 2) and faulted there: rank 1's replacement goes on GPU 1
    (GpuUse(THREE, {0: "0", 1: "2"}), 1, True, "1", False, "which no process uses"),
    # ... where the next spare, still in its set-up, gives it up
    (GpuUse(THREE, {0: "0", 1: "2"}, spare="1"), 1, False, "1", True, "given up by the spare"),
    # local rank 1 runs on GPU 0 (a spare placed there took it): local rank 0's replacement,
    # whose environment names GPU 0, has no GPU to start on
    (GpuUse(THREE, {0: "2", 1: "0"}), 0, False, None, False, "runs local rank 1"),
    (GpuUse.start(["0"], [0, 1]), 1, False, None, False, "no GPU of its own"),
], ids=["cpu", "freed", "device-fault", "faulty-before", "spare-faulted", "spare-yields",
        "held-by-another-rank", "more-ranks-than-gpus"])
def test_a_replacement_starts_only_on_a_free_gpu_that_did_not_fault(
        use: GpuUse, local_rank: int, fault: bool, gpu: str | None, stop_spare: bool,
        why: str) -> None:
    where = replacement_gpu(use, local_rank, fault)
    assert (where.gpu, where.stop_spare) == (gpu, stop_spare)
    assert why in where.reason


@pytest.mark.timeout(30)
def test_the_node_state_follows_a_take_and_a_restart() -> None:
    use = GpuUse(THREE, {0: "0", 1: "1"}, spare="2")
    use = taken(use, 1)
    assert (dict(use.workers), use.spare) == ({0: "0", 1: "2"}, None)
    assert spare_gpu(use)[0] == "1"
    use = restarted(use, 0, device_fault=True)  # rank 0 died of a fault, its replacement on 0
    assert use.faulty == {"0"} and use.workers[0] == "0"
    assert spare_gpu(use)[0] == "1"
    assert restarted(GpuUse.start([], [0]), 0, True) == GpuUse.start([], [0])
    # the spare took a rank whose worker died of a device fault: no spare goes on that GPU
    use = taken(GpuUse(THREE, {0: "0", 1: "1"}, spare="2"), 1, device_fault=True)
    assert use.faulty == {"1"} and spare_gpu(use)[0] is None


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("text", "fault"), [
    ("RuntimeError CUDA error: an illegal memory access was encountered", True),
    ("RuntimeError CUDA error: uncorrectable ECC error encountered", True),
    ("its device failed the health check: injected: the device is lost", True),
    ("NVRM: Xid 79, GPU has fallen off the bus", True),
    # not the GPU's fault: a peer's death, running out of memory, a bug
    ("DistBackendError NCCL error: remote process exited or there was a network error", False),
    ("OutOfMemoryError CUDA out of memory. Tried to allocate 2.00 GiB", False),
    ("signal SIGKILL", False),
    ("ValueError bad batch", False),
])
def test_which_failures_name_a_fault_of_the_gpu(text: str, fault: bool) -> None:
    assert device_fault(text) is fault


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_survivor_whose_gpu_failed_gets_no_replacement_on_it_and_the_workers_restart(
        tmp_path: Path, job_env: dict[str, str], inprocess_reference: dict[int, str]) -> None:
    run = _run(tmp_path, "faulty", {**job_env, "CUDA_VISIBLE_DEVICES": "0,1"},
               "--fault-rank", "1", "--infra-error-at-step", "6", "--sick-device",
               # a bound only (the sick device makes rank 1 leave at once), kept clear of a
               # loaded machine's teardown, which would make it a rank that overran instead
               launch=("--recovery-inprocess-teardown-limit-s", "10"))
    events = run["events"]
    unplaced_events = [e for e in events if e["kind"] == "replacement_unplaced"]
    assert len(unplaced_events) == 1, run["text"][-8000:]
    (unplaced,) = unplaced_events
    assert unplaced["rank"] == 1 and "GPU 1" in unplaced["reason"], unplaced
    assert "died of a device fault" in unplaced["reason"], unplaced
    assert not [e for e in events if e["kind"] == "survivor_replaced"], run["text"][-5000:]
    assert [e["kind"] for e in events].count("restart") == 1, run["text"][-5000:]
    assert run["losses"] == {s: v for s, v in inprocess_reference.items() if s <= STEPS}
