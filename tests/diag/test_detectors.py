"""Pure detector rules, with made-up facts."""

from __future__ import annotations

import math
from pathlib import Path

from elasticft.diag import detectors as d
from elasticft.diag.ring import RingFiles
from elasticft.diag.workerenv import SHIM_ENV, bootstrap_dir, diag_worker_env


def test_busy_time_and_slow_rank():
    assert d.busy_time(0, 10**9, [(2 * 10**8, 5 * 10**8), (4 * 10**8, 6 * 10**8)]) == 0.6
    slow = d.find_slow({0: 0.1, 1: 0.1, 2: 0.35, 3: 0.11}, ratio=2, min_excess_s=0.02)
    assert [s.rank for s in slow] == [2]
    assert d.find_slow({0: 0.1, 1: 0.12}, ratio=2, min_excess_s=0.02) == []


def test_loss_nan_and_spike():
    assert d.check_loss([1.0, math.nan], 5).kind == "nan"
    assert d.check_loss([1.0, math.inf], 5).kind == "nan"
    assert d.check_loss([1.0] * 6 + [6.0], 5).kind == "spike"
    assert d.check_loss([1.0] * 6 + [4.0], 5) is None
    assert d.check_loss([1.0, 9.0], 5) is None  # too little history


def test_worker_env_extends_paths_without_duplicates():
    shim = Path("/x/_nccl_shim.so")
    files = RingFiles(Path("/proc/1/fd/3"), Path("/proc/1/fd/4"), None)
    env = diag_worker_env(files, auto_install=True, shim=shim,
                          base_env={"PYTHONPATH": "/a:/b", "LD_PRELOAD": "/lib/x.so /lib/y.so"})
    assert env["PYTHONPATH"] == f"{bootstrap_dir()}:/a:/b"
    assert env["LD_PRELOAD"] == f"{shim}:/lib/x.so:/lib/y.so"
    assert env[SHIM_ENV] == "1"
    again = diag_worker_env(files, auto_install=True, shim=shim, base_env=env)
    assert again["LD_PRELOAD"] == env["LD_PRELOAD"]
    plain = diag_worker_env(files, auto_install=False, shim=None, base_env={})
    assert plain == {"ELASTICFT_DIAG_RING_DIR": "", "ELASTICFT_DIAG_PY_RING": "/proc/1/fd/3",
                     "ELASTICFT_DIAG_NCCL_RING": "/proc/1/fd/4", "ELASTICFT_DIAG_AUTO": "0"}
    assert RingFiles.from_env(plain, 0) == files
    # The agent could reserve no ring: the worker creates none by name, whatever it inherits.
    assert RingFiles.from_env({**plain, "ELASTICFT_DIAG_PY_RING": "",
                               "ELASTICFT_DIAG_NCCL_RING": ""}, 0) is None
    by_hand = RingFiles.from_env({"ELASTICFT_DIAG_RING_DIR": "/r"}, 2)
    assert by_hand == RingFiles.in_dir(Path("/r"), 2)
    assert RingFiles.from_env({"RANK": "0"}, 0) is None
