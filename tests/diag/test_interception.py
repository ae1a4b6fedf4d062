"""Whether torch's NCCL calls reach the shim, settled from the calls themselves.

The self-check finds the shim and NCCL; it cannot see whether torch calls NCCL through the
dynamic linker. The verdict is a pure function of the shim's record counter (a table here); the
worker-side tests run the real shim, the real libnccl loaded as torch loads it and the real
bootstrap, with only the seam "is this process group on NCCL" forced (a CPU has no NCCL group).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from elasticft.addon.api import GroupInfo, WorkerInfo
from elasticft.config import DiagConfig
from elasticft.diag import shimcheck
from elasticft.diag.monitor import DiagMonitor
from elasticft.diag.recorder import PYTHON, SETTLING, SHIM, who_times, wrappers_needed
from elasticft.diag.ring import Op, RingFiles, RingReader, ring_path
from elasticft.diag.shimcheck import (
    BYPASS_AFTER_CALLS,
    BYPASS_REASON,
    BYPASSED,
    THROUGH_SHIM,
    UNVERIFIED,
    InterceptionCheck,
    ShimStatus,
    interception,
)
from elasticft.diag.workerenv import bootstrap_dir
from elasticft.events import read_events
from tests.conftest import ROOT
from tests.diag.test_shim_real_nccl import calls_env, shim, user_library  # noqa: F401

N = BYPASS_AFTER_CALLS


@pytest.mark.parametrize(
    ("records_now", "records_at_check", "nccl_calls", "verdict"),
    [
        (0, 0, 0, UNVERIFIED),          # nothing issued yet
        (0, 0, 1, UNVERIFIED),          # one call may have been deferred (a coalesced group)
        (0, 0, N - 1, UNVERIFIED),
        (0, 0, N, BYPASSED),            # N collectives and the shim saw none of them
        (3, 3, N + 5, BYPASSED),        # records from before the check do not count
        (1, 0, 1, THROUGH_SHIM),        # the first call moved the counter
        (1, 0, N + 5, THROUGH_SHIM),    # any record at all settles it, however late
        (4, 3, 0, THROUGH_SHIM),        # a communicator made before the first collective
    ],
)
def test_verdict(records_now: int, records_at_check: int, nccl_calls: int, verdict: str) -> None:
    assert interception(records_now, records_at_check, nccl_calls) == verdict


@pytest.mark.parametrize(
    ("backend", "verdict", "timer"),
    [
        ("gloo", None, PYTHON),                 # no shim in this worker
        ("gloo", THROUGH_SHIM, PYTHON),         # the shim never sees gloo
        ("nccl", None, PYTHON),                 # no active shim: Python times NCCL too
        ("nccl", UNVERIFIED, SETTLING),         # timed, and the call feeds the check
        ("nccl", BYPASSED, PYTHON),             # torch's calls do not reach the shim
        ("nccl", THROUGH_SHIM, SHIM),
        ("cpu:gloo,cuda:nccl", THROUGH_SHIM, PYTHON),  # a call may run on its gloo half
        (None, THROUGH_SHIM, PYTHON),           # backend unknown
    ],
)
def test_who_times_a_collective(backend: str | None, verdict: str | None, timer: str) -> None:
    assert who_times(backend, verdict) == timer


@pytest.mark.parametrize(
    ("backends", "verdict", "creation_seen", "needed"),
    [
        (["nccl"], THROUGH_SHIM, True, False),           # the wrappers go
        (["nccl", "nccl"], THROUGH_SHIM, True, False),
        (["nccl"], THROUGH_SHIM, False, True),           # a later gloo group would be missed
        (["nccl", "gloo"], THROUGH_SHIM, True, True),    # gloo keeps its Python timing
        (["nccl"], UNVERIFIED, True, True),
        (["nccl"], BYPASSED, True, True),
        (["nccl"], None, True, True),
        (["gloo"], None, True, True),
        ([], THROUGH_SHIM, True, False),                 # no group: a new one re-decides
    ],
)
def test_wrappers_needed(backends: list[str], verdict: str | None, creation_seen: bool,
                         needed: bool) -> None:
    assert wrappers_needed(backends, verdict, creation_seen) == needed


def test_a_counter_moved_by_calls_from_cpp_settles_without_a_call() -> None:
    counter = [2]
    check = InterceptionCheck(lambda: counter[0], lambda: None)
    assert check.peek() == UNVERIFIED
    counter[0] = 3  # communicator creation, DDP's broadcast of the parameters
    assert check.peek() == THROUGH_SHIM


def test_the_check_settles_once_and_reports_a_bypass_once() -> None:
    counter = [5]
    bypasses: list[int] = []
    check = InterceptionCheck(lambda: counter[0], lambda: bypasses.append(1))
    for _ in range(N - 1):
        check.after_nccl_call()
    assert check.verdict == UNVERIFIED and bypasses == []
    check.after_nccl_call()
    assert check.verdict == BYPASSED and bypasses == [1]
    counter[0] = 6  # a late record changes nothing: the Python wrappers already time NCCL
    check.after_nccl_call()
    assert check.verdict == BYPASSED and bypasses == [1]

    through = InterceptionCheck(lambda: counter[0], lambda: bypasses.append(2))
    counter[0] += 1
    through.after_nccl_call()
    assert through.verdict == THROUGH_SHIM and bypasses == [1]


WORKER = textwrap.dedent("""
    import ctypes, json, sys
    library = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_LOCAL)  # NCCL in a local scope
    import torch, torch.distributed as dist
    from elasticft.diag.recorder import installed
    recorder = installed()
    mode, calls = sys.argv[2], int(sys.argv[3])
    # The world group stands for an NCCL group; any other group is what it is (gloo).
    recorder.backend_of = lambda pg: "nccl" if pg is dist.group.WORLD else dist.get_backend(pg)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    side = dist.new_group([0], backend="gloo") if mode == "mixed" else None
    if mode != "bypass":
        library.all_reduce()  # a real NCCL call through the shim, as torch's own would be
    for _ in range(calls):
        dist.all_reduce(torch.ones(4))
    report = {"verdict": recorder.nccl_check.verdict,
              "wrapped": recorder.collectives_wrapped,
              "public_is_original": dist.all_reduce is recorder._originals["all_reduce"]}
    if mode == "late_gloo":  # a gloo group made once the wrappers are gone brings them back
        side = dist.new_group([0], backend="gloo")
        report["wrapped_after_gloo_group"] = recorder.collectives_wrapped
    if side is not None:
        dist.all_reduce(torch.ones(4), group=side)
        dist.all_reduce(torch.ones(4), dist.ReduceOp.SUM, side)  # the group by position
        dist.all_reduce(torch.ones(4))  # the world group: still the shim's
    print(json.dumps(report), flush=True)
    dist.destroy_process_group()  # a process group torn down at exit can abort the process
""")


def run_worker(library: Path, shim_path: Path, ring_dir: Path, mode: str, calls: int) -> dict:
    env = calls_env(shim_path, ring_dir)
    env["PYTHONPATH"] = f"{bootstrap_dir()}:{ROOT}"
    done = subprocess.run([sys.executable, "-c", WORKER, str(library), mode, str(calls)],
                          env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    # The report is the last line: torch 2.10's gloo prints its connections to stdout first.
    return json.loads(done.stdout.strip().splitlines()[-1])


def python_all_reduces(ring_dir: Path) -> int:
    _header, records = RingReader(ring_path(ring_dir, 0, "py")).poll()
    return sum(1 for r in records if r.op == Op.ALL_REDUCE)


@pytest.mark.timeout(120)
def test_calls_that_bypass_the_shim_are_timed_in_python_and_the_status_says_so(
        user_library, shim, tmp_path):  # noqa: F811
    calls = N + 2
    report = run_worker(user_library, shim, tmp_path, "bypass", calls)
    assert report == {"verdict": BYPASSED, "wrapped": True,
                      "public_is_original": False}
    assert python_all_reduces(tmp_path) == calls  # every collective, before and after
    status = shimcheck.read_status(RingFiles.in_dir(tmp_path, 0).status)
    assert status is not None and not status["active"] and status["loaded"]
    assert status["message"] == f"NCCL timings inactive: {BYPASS_REASON}"
    assert status["version"] > 0  # what the probe found is kept


@pytest.mark.timeout(120)
def test_calls_that_reach_the_shim_are_left_to_it(user_library, shim, tmp_path):  # noqa: F811
    report = run_worker(user_library, shim, tmp_path, "through", N + 2)
    # Every group is left to the shim: torch's own functions are back in torch.distributed.
    assert report == {"verdict": THROUGH_SHIM, "wrapped": False,
                      "public_is_original": True}
    # Only the collective that settled it was timed in Python; the shim recorded NCCL's call.
    assert python_all_reduces(tmp_path) == 1
    _header, records = RingReader(ring_path(tmp_path, 0, "nccl")).poll()
    assert [Op(r.op) for r in records] == [Op.ALL_REDUCE]
    status = shimcheck.read_status(RingFiles.in_dir(tmp_path, 0).status)
    assert status is not None and status["active"]


def python_all_reduce_comms(ring_dir: Path) -> list[int]:
    _header, records = RingReader(ring_path(ring_dir, 0, "py")).poll()
    return [r.comm for r in records if r.op == Op.ALL_REDUCE]


@pytest.mark.timeout(120)
def test_with_a_gloo_group_too_nccl_calls_are_left_to_the_shim_and_gloo_calls_timed(
        user_library, shim, tmp_path):  # noqa: F811
    report = run_worker(user_library, shim, tmp_path, "mixed", 3)
    assert report == {"verdict": THROUGH_SHIM, "wrapped": True,
                      "public_is_original": False}
    comms = python_all_reduce_comms(tmp_path)
    # The settling world call, then the two gloo calls (keyword and positional group); the
    # world calls around them are not timed in Python.
    assert len(comms) == 3 and comms[1] == comms[2] != comms[0]


@pytest.mark.timeout(120)
def test_a_gloo_group_created_after_the_wrappers_left_brings_them_back(
        user_library, shim, tmp_path):  # noqa: F811
    report = run_worker(user_library, shim, tmp_path, "late_gloo", 2)
    assert report["public_is_original"] and not report["wrapped"]
    assert report["wrapped_after_gloo_group"]
    comms = python_all_reduce_comms(tmp_path)
    assert len(comms) == 3 and comms[1] == comms[2] != comms[0]


def test_the_monitor_reports_a_status_the_worker_rewrites(tmp_path: Path) -> None:
    config = DiagConfig(diag_preflight="off", diag_check_interval_s=0.0, health_interval_s=3600)
    monitor = DiagMonitor(config, base_env={}, event_dir=tmp_path / "events",
                          nccl_shim=tmp_path / "shim.so")
    group = GroupInfo("run", "node0", tmp_path, 0, 0, 1, 0, (WorkerInfo(0, 0, 1),))
    env = monitor.worker_env(group, group.workers[0])
    status = Path(env["ELASTICFT_DIAG_NCCL_STATUS"])  # a file with no name, rewritten in place
    monitor.on_workers_started(group)
    try:
        found = ShimStatus(loaded=True, recording=True, version=23007, library="libnccl.so.2")
        shimcheck.write_status(status, 0, found)
        monitor.check(group)
        monitor.check(group)  # unchanged: not reported again
        shimcheck.write_status(status, 0, ShimStatus(
            loaded=True, recording=False, reason=BYPASS_REASON, version=23007,
            library="libnccl.so.2"))
        monitor.check(group)
    finally:
        monitor.on_workers_stopped(group)
        monitor.close()
    reported = [e for e in read_events(tmp_path / "events") if e["kind"] == shimcheck.EVENT_KIND]
    assert [e["active"] for e in reported] == [True, False]
    assert reported[1]["message"] == f"NCCL timings inactive: {BYPASS_REASON}"


@pytest.mark.timeout(120)
def test_an_nccl_inside_another_library_is_found_but_its_calls_bypass_the_shim(
        shim, tmp_path):  # noqa: F811
    """Why the check exists: what the probe says is true, and still the shim records nothing."""
    library = tmp_path / "libframework.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-Wl,-Bsymbolic", "-o", str(library),
                    str(Path(__file__).parent / "fake" / "nccl_inside.c")], check=True)
    script = textwrap.dedent("""
        import ctypes, json, sys
        from elasticft.diag import shimcheck
        library = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_LOCAL)
        codes = [library.framework_all_reduce() for _ in range(3)]
        print(json.dumps({"codes": codes, "probe": shimcheck.probe().to_json(),
                          "records": shimcheck.records_counter()()}))
    """)
    done = subprocess.run([sys.executable, "-c", script, str(library)],
                          env=calls_env(shim, tmp_path), capture_output=True, text=True,
                          timeout=100)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["codes"] == [0, 0, 0]
    assert result["probe"]["active"] and result["probe"]["library"] == str(library)
    assert result["records"] == 0
