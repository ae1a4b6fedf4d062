"""The warm device: the spare forked after each start prepares CUDA on its local rank's
device once its worker has exited (tests of elasticft.agent.warm_bootstrap
._elasticft_warm_device through the warm pool)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from elasticft.agent.warm_bootstrap import _elasticft_warm_device as warm_device
from elasticft.agent.warmpool import WarmInterpreter, default_device_mode
from tests.agent.test_warmpool import HERE, _is_subreaper, base_env, wait_until

SHOW_DEVICE = str(HERE / "workers" / "show_device.py")


@pytest.mark.parametrize(
    ("mode", "worker_used_cuda", "prepare"),
    [
        ("auto", True, True),      # a GPU worker exited: its successor gets the context
        ("auto", False, False),    # a CPU job on a GPU machine: no context it never asked for
        ("always", False, True),   # the seam: the mechanics on a CPU
        ("off", True, False),
    ],
)
def test_when_a_spare_prepares_the_device(mode: str, worker_used_cuda: bool,
                                          prepare: bool) -> None:
    assert warm_device.should_prepare(mode, worker_used_cuda) is prepare


@pytest.mark.parametrize(
    ("local_rank", "device_count", "index"),
    [
        (0, 8, 0),
        (3, 8, 3),
        (3, 1, 0),        # CUDA_VISIBLE_DEVICES set per rank: its only device
        (3, 2, None),     # no device of its own: prepare nothing
        (0, 0, None),     # no CUDA device
        (None, 8, None),  # LOCAL_RANK not a number
    ],
)
def test_the_device_a_local_rank_uses(local_rank: int | None, device_count: int,
                                      index: int | None) -> None:
    assert warm_device.device_index(local_rank, device_count) == index


def test_spares_only_where_the_nvidia_driver_is(tmp_path: Path) -> None:
    assert default_device_mode(str(tmp_path / "nvidiactl")) == "off"
    (tmp_path / "nvidiactl").touch()
    assert default_device_mode(str(tmp_path / "nvidiactl")) == "auto"


def restart_once(tmp_path: Path, device: str, mode: str = "cpu",
                 env: dict[str, str] | None = None) -> tuple[dict, dict]:
    """Starts a worker, SIGKILLs it, starts the next from the same interpreter; both states."""
    argv = [sys.executable, "-u", SHOW_DEVICE, str(tmp_path / "out"), mode]
    start_env = {**base_env(tmp_path), "LOCAL_RANK": "1", **(env or {})}
    warm = WarmInterpreter.spawn(argv, start_env, str(tmp_path), ("torch",), device)
    states = []
    try:
        for tag in ("first", "second"):
            proc = warm.start(argv, {**start_env, "SHOW_START_TAG": tag}, str(tmp_path), 1, 2)
            out = tmp_path / "out" / f"{tag}.json"
            wait_until(out.exists, 90, f"worker {tag}")
            assert psutil.Process(proc.pid).ppid() == os.getpid()  # the agent's own child
            if mode == "cuda":  # the spare looks for libcuda in the worker every 0.5 s
                time.sleep(1.5)
            os.kill(proc.pid, signal.SIGKILL)
            assert proc.wait(timeout=30) == -signal.SIGKILL
            states.append(json.loads(out.read_text()))
        assert warm.alive() and warm.starts == 2
    finally:
        warm.discard()
    assert _is_subreaper() is False
    return states[0], states[1]


@pytest.mark.timeout(180)
def test_the_spare_prepares_the_device_of_its_local_rank_after_the_worker_died(
        tmp_path: Path) -> None:
    first, second = restart_once(tmp_path, "always", env={"CUDA_VISIBLE_DEVICES": ""})
    assert first["prepared"] is None  # the first start had no spare
    assert second["pid"] != first["pid"]
    # The spare ran the preparation for local rank 1 in the process that became the worker; no
    # CUDA device here (CUDA_VISIBLE_DEVICES empty, on a GPU machine too), so it made nothing.
    assert second["prepared"] == {"local_rank": 1, "pid": second["pid"], "device": None,
                                  "skipped": "no CUDA device"}
    # What the script sees is a cold start's.
    for state in (first, second):
        assert state["local_rank"] == "1" and state["cuda_visible_devices"] == ""
        assert state["warm_device_env"] is None and state["session_leader"]
        assert not state["cuda_initialized"] and state["current_device"] is None


@pytest.mark.timeout(180)
def test_each_local_rank_of_the_template_has_its_own_spare(tmp_path: Path) -> None:
    """Two local ranks forked from one template, each killed and restarted: each restart is
    its own rank's spare, which prepared that rank's device (none here)."""
    argv = [sys.executable, "-u", SHOW_DEVICE, str(tmp_path / "out"), "cpu"]
    env = {**base_env(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    warm = WarmInterpreter.spawn(argv, env, str(tmp_path), ("torch",), "always")
    states: dict[str, dict] = {}
    try:
        for round_ in ("first", "second"):
            procs = {}
            for rank in (0, 1):
                tag = f"{round_}-{rank}"
                procs[tag] = warm.start(argv, {**env, "LOCAL_RANK": str(rank),
                                               "SHOW_START_TAG": tag}, str(tmp_path), 1, 2)
            for tag, proc in procs.items():
                out = tmp_path / "out" / f"{tag}.json"
                wait_until(out.exists, 90, f"worker {tag}")
                assert psutil.Process(proc.pid).ppid() == os.getpid()
                os.kill(proc.pid, signal.SIGKILL)
                assert proc.wait(timeout=30) == -signal.SIGKILL
                states[tag] = json.loads(out.read_text())
        assert warm.alive() and warm.starts == 4
    finally:
        warm.discard()
    for rank in (0, 1):
        assert states[f"first-{rank}"]["prepared"] is None
        second = states[f"second-{rank}"]
        assert second["prepared"] == {"local_rank": rank, "pid": second["pid"], "device": None,
                                      "skipped": "no CUDA device"}
        assert second["local_rank"] == str(rank) and second["session_leader"]
    assert _is_subreaper() is False


@pytest.mark.timeout(180)
def test_no_preparation_after_a_worker_that_never_used_cuda(tmp_path: Path) -> None:
    first, second = restart_once(tmp_path, "auto")
    assert first["prepared"] is None and second["prepared"] is None
    assert not second["cuda_initialized"] and second["session_leader"]


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.timeout(180)
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA device")
def test_a_restarted_gpu_worker_finds_its_context_made_and_its_device_unchanged(
        tmp_path: Path) -> None:
    first, second = restart_once(tmp_path, "auto", mode="cuda", env={"LOCAL_RANK": "0"})
    assert first["prepared"] is None and not first["cuda_initialized"]
    assert second["prepared"] == {"local_rank": 0, "pid": second["pid"], "device": 0}
    assert second["cuda_initialized"] and second["current_device"] == 0
    assert second["memory_allocated"] == 0  # nothing left allocated by the preparation
    assert second["local_rank"] == "0"
    assert second["cuda_visible_devices"] == first["cuda_visible_devices"]
