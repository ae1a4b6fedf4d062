"""The NCCL shim's own logic where the real libnccl cannot take it on CPU: calls that succeed.

Without a GPU the real NCCL creates no communicator, so every collective fails its argument
check (tests/diag/test_shim_real_nccl.py covers return codes, scopes and faults against it).
Here a fake libnccl whose calls succeed and a fake CUDA runtime whose events complete after
FAKE_GPU_MS (tests/diag/fake) check what only a successful call reaches: the fields of each
record, communicator keys and counters, timing of calls in a group, GPU time from the events,
and the event pool recycled over many more calls than it has slots.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from elasticft.diag.ring import (
    FLAG_HOST_COMPLETION,
    FLAG_TIMED,
    Op,
    RingReader,
    ring_path,
)
from elasticft.diag.workerenv import shim_library

FAKE = Path(__file__).parent / "fake"
RANK = 3
UNIQUE_ID = b"elasticft-test-id".ljust(128, b"\0")

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs a C compiler")


def fnv1a(data: bytes) -> int:
    h = 1469598103934665603
    for byte in data:
        h = ((h ^ byte) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h or 1


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("fake-libs")
    nccl_dir = out / "nccl"
    nccl_dir.mkdir()
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", nccl_dir / "libnccl.so",
                    FAKE / "fake_nccl.c"], check=True)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", out / "libcudart.so",
                    FAKE / "fake_cudart.c"], check=True)
    subprocess.run(["gcc", "-o", out / "app", FAKE / "app.c", f"-L{nccl_dir}", "-lnccl",
                    f"-Wl,-rpath,{nccl_dir}"], check=True)
    shim = shim_library()
    assert shim is not None, "the shim was not built; run pip install -e ."
    return {"app": out / "app", "cudart": out / "libcudart.so", "shim": shim}


def run_app(built: dict[str, Path], ring_dir: Path, *, enabled: bool = True,
            cudart: str | None = None, calls: int = 3, gpu_ms: int = 20,
            **extra: str) -> str:
    env = {"PATH": "/usr/bin:/bin", "RANK": str(RANK), "LD_PRELOAD": str(built["shim"]),
           "ELASTICFT_DIAG_RING_DIR": str(ring_dir), "FAKE_GPU_MS": str(gpu_ms),
           "ELASTICFT_DIAG_CUDART": cudart or str(built["cudart"])}
    env.update(extra)
    if enabled:
        env["ELASTICFT_DIAG_SHIM"] = "1"
    done = subprocess.run([built["app"], str(calls)], env=env, capture_output=True, text=True,
                          timeout=60, check=True)
    return done.stdout.strip()


def records(ring_dir: Path):
    reader = RingReader(ring_path(ring_dir, RANK, "nccl"))
    header, recs = reader.poll()
    return header, recs


@pytest.mark.timeout(120)
def test_every_call_is_recorded_with_its_fields(built, tmp_path):
    output = run_app(built, tmp_path)
    assert output == ("init=0 allreduce=0 allreduce=0 allreduce=0 bad=5 bcast=0 gstart=0 "
                      "send=0 recv=0 gend=0 destroy=0")
    header, recs = records(tmp_path)
    assert header is not None and header.source == "nccl" and header.rank == RANK
    assert header.flags & 1, "CUDA timing should be available through the fake runtime"
    assert [r.seq for r in recs] == list(range(1, 10))
    ops = [Op(r.op) for r in recs]
    assert ops == [Op.COMM_INIT, Op.ALL_REDUCE, Op.ALL_REDUCE, Op.ALL_REDUCE, Op.ALL_REDUCE,
                   Op.BROADCAST, Op.SEND, Op.RECV, Op.COMM_DESTROY]
    key = fnv1a(UNIQUE_ID)
    assert all(r.comm == key for r in recs), "every record names the communicator by its id"
    init, *calls, _destroy = recs
    assert init.nbytes == 4 and init.peer == RANK  # nranks, rank
    assert [r.comm_seq for r in calls] == [1, 2, 3, 4, 5, 6, 7]
    assert [r.nbytes for r in calls[:3]] == [4000, 4004, 4008]
    assert calls[4].nbytes == 512 and calls[4].peer == 2  # bf16 broadcast from root 2
    assert calls[5].nbytes == 80 and calls[5].peer == 1  # int64 send to peer 1
    for r in recs:
        assert r.enqueue_ns > 0 and r.complete_ns >= r.enqueue_ns
    timed = [r for r in calls if r.flags & FLAG_TIMED]
    assert len(timed) == 6  # all but the failed call
    for r in timed:
        assert r.value == pytest.approx(20.0, abs=5.0)  # GPU ms from the events
        assert r.complete_ns - r.enqueue_ns >= 15e6
    bad = calls[3]
    assert (bad.flags >> 8) & 0xFF == 5 and bad.flags & FLAG_HOST_COMPLETION
    assert not bad.flags & FLAG_TIMED


@pytest.mark.timeout(120)
def test_the_event_pool_is_recycled_over_many_more_calls_than_slots(built, tmp_path):
    calls = 10_000  # the pool has 4,096 slots; each call's events must come back to it
    run_app(built, tmp_path, calls=calls, gpu_ms=1, FAKE_CALL_GAP_US="20")
    header, recs = records(tmp_path)
    total = calls + 6
    assert header is not None and header.head == total
    all_reduces = [r for r in recs if Op(r.op) is Op.ALL_REDUCE and (r.flags >> 8) == 0]
    assert len(all_reduces) > 4000
    # The ring keeps the newest calls, each over 4,096 calls after its slot's first use: a timed
    # one had its slot back from the polling thread. A call that finds its slot still armed (a
    # poller a loaded machine left behind by a whole pool) is completed at its return instead,
    # by design: every call is completed either way.
    assert any(r.flags & FLAG_TIMED for r in all_reduces)
    assert all(r.flags & (FLAG_TIMED | FLAG_HOST_COMPLETION) and r.complete_ns >= r.enqueue_ns
               for r in all_reduces)


@pytest.mark.timeout(120)
def test_a_split_communicator_is_keyed_by_its_parent_and_colour(built, tmp_path):
    output = run_app(built, tmp_path, calls=1, FAKE_SPLIT="1")
    assert "split=0 child_allreduce=0 child_allreduce=0 child_destroy=0" in output
    _header, recs = records(tmp_path)
    split, first, second, child_destroy = [r for r in recs if r.comm != fnv1a(UNIQUE_ID)]
    parent = fnv1a(UNIQUE_ID).to_bytes(8, "little")
    child_key = fnv1a(parent + (5).to_bytes(4, "little"))
    assert Op(split.op) is Op.COMM_INIT and split.comm == child_key
    assert [(Op(r.op), r.comm, r.comm_seq) for r in (first, second)] == [
        (Op.ALL_REDUCE, child_key, 1), (Op.ALL_REDUCE, child_key, 2)]
    assert Op(child_destroy.op) is Op.COMM_DESTROY and child_destroy.comm == child_key


@pytest.mark.timeout(120)
def test_the_ring_the_agent_holds_without_a_name_is_opened_by_its_path(built, tmp_path):
    from elasticft.diag.workerenv import WorkerFiles

    rings = tmp_path / "rings"
    rings.mkdir()
    files = WorkerFiles(rings, RANK, 64, status=False)
    try:
        assert files.files.nccl is not None
        # No ring directory: a ring created by name would fail the test below.
        run_app(built, tmp_path / "absent", ELASTICFT_DIAG_NCCL_RING=str(files.files.nccl))
        header, recs = RingReader(files.files.nccl).poll()
        assert header is not None and header.source == "nccl" and header.capacity == 64
        assert [Op(r.op) for r in recs][:2] == [Op.COMM_INIT, Op.ALL_REDUCE]
        assert list(rings.iterdir()) == [] and not (tmp_path / "absent").exists()
    finally:
        files.close()
