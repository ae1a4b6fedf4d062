"""The NCCL shim against the real libnccl, on CPU, loaded the way torch loads it.

libnccl.so.2 comes from PyPI's ``nvidia-nccl-cu13`` (the ``dev`` extra). A small library built
here with the system C compiler has it as DT_NEEDED, and Python loads that library with
``ctypes.CDLL(..., RTLD_LOCAL)``, as torch loads libtorch_cuda.so: NCCL sits in a local scope,
where ``dlsym(RTLD_NEXT)`` from the preloaded shim cannot see it. Every case runs in a fresh
process (``workers/nccl_calls.py``) with or without the shim in ``LD_PRELOAD``. Without a GPU,
NCCL's host-side checks answer (ncclInvalidArgument for a null communicator, an unhandled CUDA
error for creating a communicator): the shim must hand back the same codes in every setting.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from elasticft.diag.ring import FLAG_HOST_COMPLETION, Op, RingReader, RingWriter, ring_path
from elasticft.diag.workerenv import bootstrap_dir, shim_library
from elasticft.events import read_events
from elasticft.report.status import format_nccl_timings, nccl_timings
from tests.conftest import BIN, ROOT, TEST_NCCL_DIR

HERE = Path(__file__).parent
WORKER = HERE / "workers" / "nccl_calls.py"
SHIM_SOURCE = ROOT / "elasticft" / "diag" / "shim" / "entry.c"

NCCL_INVALID_ARGUMENT = 4
NCCL_INTERNAL_ERROR = 3

# Each case of real/nccl_user.c, and the record the shim writes for it (None: no record).
CASES: dict[str, Op | None] = {
    "group_start": None,
    "group_end": None,
    "all_reduce": Op.ALL_REDUCE,
    "all_reduce_null_buffer": Op.ALL_REDUCE,
    "all_reduce_bad_type": Op.ALL_REDUCE,
    "broadcast": Op.BROADCAST,
    "reduce": Op.REDUCE,
    "all_gather": Op.ALL_GATHER,
    "reduce_scatter": Op.REDUCE_SCATTER,
    "all_to_all": Op.ALL_TO_ALL,
    "send": Op.SEND,
    "recv": Op.RECV,
    "init_rank": Op.COMM_INIT,
    "init_rank_no_ranks": Op.COMM_INIT,
    "init_rank_config": Op.COMM_INIT,
    "init_rank_scalable": Op.COMM_INIT,
    "comm_split": Op.COMM_INIT,
    "comm_abort": Op.COMM_ABORT,
    "comm_destroy": Op.COMM_DESTROY,
}
# A collective inside a group (NCCL reports its error at the call and at ncclGroupEnd), then
# every case.
SEQUENCE = ["group_start", "all_reduce", "group_end", *CASES]

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs the system C compiler")


def nccl_lib_dir() -> Path:
    """The directory of libnccl.so.2: $ELASTICFT_TEST_NCCL_DIR, else the nvidia-nccl wheel's."""
    if TEST_NCCL_DIR:
        return Path(TEST_NCCL_DIR)
    try:
        import nvidia.nccl  # type: ignore[import-not-found]
    except ImportError:
        pytest.fail("the real libnccl is missing; install the test extra: pip install -e '.[dev]'")
    directory = Path(next(iter(nvidia.nccl.__path__))) / "lib"
    assert (directory / "libnccl.so.2").is_file(), f"no libnccl.so.2 in {directory}"
    return directory


def build_user_library(out: Path, nccl_dir: Path) -> Path:
    library = out / "libnccl_user.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-pthread", "-o", str(library),
                    str(HERE / "real" / "nccl_user.c"), f"-L{nccl_dir}", "-l:libnccl.so.2",
                    f"-Wl,-rpath,{nccl_dir}"], check=True)
    return library


@pytest.fixture(scope="module")
def user_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_user_library(tmp_path_factory.mktemp("nccl-user"), nccl_lib_dir())


@pytest.fixture(scope="module")
def shim() -> Path:
    library = shim_library()
    assert library is not None, "the shim was not built; run setup.py build_ext --inplace"
    return library


def calls_command(library: Path, cases: Sequence[str]) -> list[str]:
    return [sys.executable, str(WORKER), str(library), *cases]


def calls_env(shim: Path | None, ring_dir: Path | None = None, *, enabled: bool = True,
              **extra: str) -> dict[str, str]:
    # No device, on a GPU machine too: NCCL answers from its host-side checks, the same there.
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT),
           "RANK": "0", "CUDA_VISIBLE_DEVICES": "", **extra}
    if shim is not None:
        env["LD_PRELOAD"] = str(shim)
        env["ELASTICFT_DIAG_SHIM"] = "1" if enabled else "0"
    if ring_dir is not None:
        env["ELASTICFT_DIAG_RING_DIR"] = str(ring_dir)
    return env


def run_all(runs: Sequence[tuple[list[str], dict[str, str]]]) -> list[dict[str, Any]]:
    """Runs the commands at once; each must print the worker's JSON line."""
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for cmd, env in runs]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, f"{proc.args}: exit {proc.returncode}\n{err}"
            results.append({**json.loads(out.strip().splitlines()[-1]), "stderr": err})
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def codes(result: dict[str, Any]) -> list[list[Any]]:
    return result["codes"]


@pytest.fixture(scope="module")
def three_ways(user_library: Path, shim: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> dict[str, Any]:
    """The sequence with no shim, with the shim disabled and with it enabled (one ring)."""
    rings = tmp_path_factory.mktemp("rings")
    command = calls_command(user_library, SEQUENCE)
    plain, disabled, enabled = run_all([
        (command, calls_env(None)),
        (command, calls_env(shim, rings, enabled=False)),
        (command, calls_env(shim, rings)),
    ])
    return {"plain": plain, "disabled": disabled, "enabled": enabled, "rings": rings}


def test_the_cases_cover_every_entry_point_the_shim_exports():
    exported = set(re.findall(r"^EXPORT ncclResult_t (nccl\w+)\(", SHIM_SOURCE.read_text(), re.M))
    called = set(re.findall(r"\b(nccl\w+)\(", (HERE / "real" / "nccl_user.c").read_text()))
    assert len(exported) >= 16 and exported <= called, exported - called


@pytest.mark.timeout(180)
def test_every_entry_point_returns_nccls_own_code(three_ways):
    plain = codes(three_ways["plain"])
    assert [name for name, _ in plain] == SEQUENCE
    by_case = dict(plain[3:])
    # What the real library answers on a machine without a GPU: its own checks, its own codes.
    assert by_case["group_start"] == 0 and by_case["group_end"] == 0
    assert by_case["all_reduce"] == NCCL_INVALID_ARGUMENT  # a null communicator
    assert by_case["comm_destroy"] == 0 and by_case["comm_abort"] == 0  # null: nothing to do
    assert by_case["init_rank"] not in (0, NCCL_INTERNAL_ERROR)  # no device
    assert plain[2] == ["group_end", NCCL_INVALID_ARGUMENT]  # the group's failed call
    assert codes(three_ways["disabled"]) == plain
    assert codes(three_ways["enabled"]) == plain


@pytest.mark.timeout(180)
def test_the_self_check_says_whether_calls_are_timed(three_ways):
    assert three_ways["plain"]["probe"]["loaded"] is False
    assert three_ways["plain"]["probe"]["message"] == (
        "NCCL timings inactive: the shim is not loaded in the worker (LD_PRELOAD)")
    disabled = three_ways["disabled"]["probe"]
    assert disabled["loaded"] and not disabled["active"]
    assert "disabled" in disabled["message"]
    enabled = three_ways["enabled"]["probe"]
    assert enabled["active"], enabled
    assert enabled["version"] >= 22800 and enabled["library"].endswith("libnccl.so.2")
    assert enabled["missing"] == []
    assert enabled["message"].startswith("NCCL timings active: NCCL 2.")


@pytest.mark.timeout(180)
def test_the_ring_records_each_call_with_nccls_result(three_ways):
    header, records = RingReader(ring_path(three_ways["rings"], 0, "nccl")).poll()
    assert header is not None and header.source == "nccl"
    expected = [(CASES[name], code) for name, code in codes(three_ways["plain"])
                if CASES[name] is not None]
    assert [(Op(r.op), (r.flags >> 8) & 0xFF) for r in records] == expected
    assert [r.seq for r in records] == list(range(1, len(expected) + 1))
    for record in records:
        assert record.complete_ns >= record.enqueue_ns > 0
        assert record.flags & FLAG_HOST_COMPLETION
    assert any((r.flags >> 8) == 0 for r in records), "some calls succeed (destroy, abort)"


def run_in_mount_namespace(command: list[str], env: dict[str, str], mount: str) -> list[str]:
    """The command in a new user and mount namespace, after ``mount`` (a shell line)."""
    script = f"{mount} && exec env {' '.join(f'{k}={v}' for k, v in env.items())} \"$@\""
    return ["unshare", "-rm", "sh", "-c", script, "sh", *command]


def mount_namespaces_work() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0


@pytest.mark.timeout(180)
def test_unusable_ring_directories_leave_nccl_untouched(user_library, shim, tmp_path):
    """Missing, read-only, or on a full file system: the shim steps aside, NCCL answers."""
    if not mount_namespaces_work():
        pytest.skip("needs unprivileged user and mount namespaces (unshare -rm) for the "
                    "read-only and full file systems")
    cases = [*SEQUENCE, "all_reduce*200"]  # 200 records span several pages of the ring
    command = calls_command(user_library, cases)
    read_only, full = tmp_path / "read-only", tmp_path / "full"
    read_only.mkdir()
    full.mkdir()
    runs = [
        (command, calls_env(None)),
        (command, calls_env(shim, tmp_path / "missing")),
        (run_in_mount_namespace(command, calls_env(shim, read_only),
                                f"mount -t tmpfs -o ro,size=64k tmpfs {read_only}"), {}),
        # One page: the ring's file can be sized but not backed.
        (run_in_mount_namespace(command, calls_env(shim, full),
                                f"mount -t tmpfs -o size=4k tmpfs {full}"), {}),
    ]
    plain, missing, ro, no_space = run_all(runs)
    for result in (missing, ro, no_space):
        assert codes(result) == codes(plain)
        assert not result["probe"]["active"]
    assert "No such file or directory" in missing["probe"]["reason"]
    assert "Read-only file system" in ro["probe"]["reason"]
    assert "No space left on device" in no_space["probe"]["reason"]
    assert not (tmp_path / "missing").exists()


@pytest.mark.timeout(180)
def test_a_wrapping_ring_and_no_cuda_runtime_leave_nccl_untouched(user_library, shim, tmp_path):
    RingWriter(ring_path(tmp_path, 0, "nccl"), 0, "nccl", capacity=8).close()  # a small ring
    command = calls_command(user_library, [*SEQUENCE, "all_reduce*50", "comm_destroy"])
    plain, wrapped = run_all([
        (command, calls_env(None)),
        (command, calls_env(shim, tmp_path, ELASTICFT_DIAG_CUDART="/nonexistent/libcudart.so")),
    ])
    assert codes(wrapped) == codes(plain)
    assert wrapped["probe"]["active"] and not wrapped["probe"]["cuda_events"]
    header, records = RingReader(ring_path(tmp_path, 0, "nccl")).poll()
    recorded = sum(CASES[name] is not None for name, _ in codes(plain))
    assert header is not None and header.capacity == 8 and header.head == recorded
    assert [r.seq for r in records] == list(range(recorded - 7, recorded + 1))
    assert Op(records[-1].op) is Op.COMM_DESTROY and (records[-2].flags >> 8) == 4


def without_symbol(library: Path, out: Path, symbol: str) -> Path:
    """A copy of ``library`` whose dynamic symbol table no longer names ``symbol``: its name in
    .dynstr is changed in place, so lookups by the old name miss and every other one works."""
    data = bytearray(library.read_bytes())
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def section(i: int) -> tuple[int, int, int]:
        name, _type, _flags, _addr, offset, size = struct.unpack_from("<IIQQQQ", data,
                                                                     shoff + i * shentsize)
        return name, offset, size

    _, names_at, _ = section(shstrndx)
    for i in range(shnum):
        name, offset, size = section(i)
        if data[names_at + name:].split(b"\0", 1)[0] == b".dynstr":
            # The linker shares tails: "pncclAlltoAll" also holds "ncclAlltoAll".
            start = data.find(symbol.encode() + b"\0", offset, offset + size)
            assert start >= 0, f"{symbol} is not in {library}"
            data[start + len(symbol) - 2] = ord("_")  # ncclAlltoAll -> ncclAlltoA_l
            break
    else:
        raise AssertionError(f"no .dynstr in {library}")
    out.mkdir(parents=True, exist_ok=True)
    copy = out / library.name
    copy.write_bytes(bytes(data))
    return copy


@pytest.mark.timeout(180)
def test_an_entry_point_missing_from_nccl_leaves_the_others_untouched(shim, tmp_path):
    nccl_dir = without_symbol(nccl_lib_dir() / "libnccl.so.2", tmp_path / "nccl", "ncclAlltoAll"
                              ).parent
    library = build_user_library(tmp_path, nccl_dir)
    others = [case for case in SEQUENCE if case != "all_to_all"]
    plain, enabled, called = run_all([
        (calls_command(library, others), calls_env(None)),
        (calls_command(library, others), calls_env(shim, tmp_path)),
        (calls_command(library, [*others, "all_to_all"]), calls_env(shim, tmp_path / "x",
                                                                    enabled=False)),
    ])
    assert codes(enabled) == codes(plain)
    assert enabled["probe"]["active"] and enabled["probe"]["missing"] == ["ncclAlltoAll"]
    # Without the shim the weak reference is null and the caller skips the call; with it the
    # reference binds to the shim, which has nothing to forward to: it answers
    # ncclInternalError, says why once on stderr, and the process goes on.
    assert codes(called)[:-1] == codes(plain)
    assert codes(called)[-1] == ["all_to_all", NCCL_INTERNAL_ERROR]
    assert "ncclAlltoAll is defined by no loaded library" in called["stderr"]
    unshimmed, = run_all([(calls_command(library, ["all_to_all"]), calls_env(None))])
    assert codes(unshimmed) == [["all_to_all", -1]]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_elasticft_run_reports_the_self_check_in_events_and_status(user_library, tmp_path,
                                                                   job_env):
    """The whole chain on CPU: the agent preloads the shim (--diag-nccl-shim on), the bootstrap
    checks it after `import torch`, the monitor writes it to the event log, status shows it.

    With NCCL: a cold start, where the script loads NCCL in a local scope before torch (torch
    with CUDA loads it as it is imported). Without: the default warm start, where torch (CPU
    only here) is imported before the script and the worker is forked."""
    worker = HERE / "workers" / "nccl_selfcheck.py"
    runs = {}
    for name, flags, args in (("with-nccl", ["--warm-start", "false"], [str(user_library)]),
                              ("without-nccl", [], [])):
        run_dir = tmp_path / name
        cmd = [str(BIN / "elasticft-run"), "--standalone", "--nproc-per-node", "1",
               "--monitor-interval", "0.1", "--run-dir", str(run_dir), "--diag-nccl-shim", "on",
               *flags, str(worker), *args]
        runs[name] = (run_dir, subprocess.Popen(cmd, env=job_env, stdout=subprocess.PIPE,
                                                stderr=subprocess.STDOUT, text=True))
    for _run_dir, proc in runs.values():
        out, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0, out[-3000:]
    reports = {name: [e for e in read_events(run_dir) if e["kind"] == "nccl_timings"]
               for name, (run_dir, _) in runs.items()}
    active, = reports["with-nccl"]
    assert active["active"] and active["rank"] == 0
    assert active["message"].startswith("NCCL timings active: NCCL 2.")
    inactive, = reports["without-nccl"]
    assert inactive["message"] == ("NCCL timings inactive: no NCCL library is loaded in the "
                                   "worker (torch without NCCL?)")
    # What `elasticft status --run-dir` prints (its other lines: test_status_detections.py).
    shown = format_nccl_timings(nccl_timings(runs["with-nccl"][0]))
    assert shown == f"{active['message']} ({active['node']}, rank 0)"


@pytest.mark.timeout(120)
def test_first_calls_from_many_threads_all_reach_nccl(user_library, shim, tmp_path):
    command = calls_command(user_library, ["group_pairs_in_threads", "all_reduce"])
    plain, enabled = run_all([(command, calls_env(None)), (command, calls_env(shim, tmp_path))])
    assert codes(plain) == codes(enabled) == [["group_pairs_in_threads", 0],
                                              ["all_reduce", NCCL_INVALID_ARGUMENT]]


@pytest.mark.timeout(120)
def test_with_the_shim_active_the_recorder_still_records_gloo_groups(user_library, shim,
                                                                     tmp_path):
    """The bootstrap's self-check gives the Python recorder a check that settles, on NCCL
    groups' calls, whether the shim times them (test_interception.py); other groups are
    recorded as before and count for nothing in it."""
    script = textwrap.dedent("""
        import ctypes, json, sys
        ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_LOCAL)  # NCCL in a local scope, as torch's
        import torch, torch.distributed as dist
        from elasticft.diag.recorder import installed
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        dist.all_reduce(torch.ones(10))
        print(json.dumps({"check": installed().nccl_check.verdict,
                          "world_on_nccl": installed().on_nccl(None)}), flush=True)
        dist.destroy_process_group()  # a process group torn down at exit can abort the process
    """)
    env = calls_env(shim, tmp_path)
    env["PYTHONPATH"] = f"{bootstrap_dir()}:{ROOT}"
    done = subprocess.run([sys.executable, "-c", script, str(user_library)], env=env,
                          capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    # The report is the last line: torch 2.10's gloo prints its connections to stdout first.
    report = done.stdout.strip().splitlines()[-1]
    assert json.loads(report) == {"check": "unverified", "world_on_nccl": False}
    status = json.loads((tmp_path / "rank-0.nccl.status").read_text())
    assert status["active"] and status["rank"] == 0
    _header, records = RingReader(ring_path(tmp_path, 0, "py")).poll()
    assert [Op(r.op) for r in records if r.op == Op.ALL_REDUCE] == [Op.ALL_REDUCE]
