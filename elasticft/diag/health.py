"""Node health: is this machine still fit to train on?

Each check returns :class:`HealthIssue` values; ``critical`` ones make the agent treat the node
as suspect (the policy may evict it), the rest are reported. Checks:

* GPUs through NVML (``nvidia-ml-py``) when it is installed and a driver is present: a GPU that
  vanished since the first check; the faults :func:`elasticft.devicehealth.nvml_problems`
  decides for every check of a GPU (uncorrectable ECC errors since the driver loaded, retired
  pages or a row remapping pending, a failed remapping, a recovery action the driver asks
  for); temperature and hardware slowdown (thermal or power brake) throttling, reported;
* host memory pressure (psutil);
* free space of the run directory and checkpoint directories;
* reachability of peer addresses (a TCP connect with a short timeout).

:func:`preflight` runs before the first workers start: the directories must be writable, then the
same checks. :func:`allreduce_probe` (``--diag-preflight allreduce``) adds a gloo all-reduce among
as many processes as the node has worker slots: a wrong sum or a process that cannot join is a
critical issue; the bus bandwidth is reported.
"""

from __future__ import annotations

import dataclasses
import datetime
import glob
import json
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from elasticft.devicehealth import nvml_problems, read_nvml

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class HealthIssue:
    """One check's finding about this node."""

    check: str
    message: str
    critical: bool
    """The agent treats the node as suspect (the policy may evict it); else only reported."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class HealthLimits:
    min_free_gb: float = 1.0
    max_memory_percent: float = 98.0
    max_gpu_temp_c: float = 92.0


def check_memory(limits: HealthLimits) -> list[HealthIssue]:
    import psutil

    used = psutil.virtual_memory().percent
    if used > limits.max_memory_percent:
        return [HealthIssue("memory", f"host memory {used:.1f}% used (limit "
                            f"{limits.max_memory_percent:g}%)", critical=True)]
    return []


def check_disks(dirs: Iterable[Path], limits: HealthLimits) -> list[HealthIssue]:
    issues = []
    for directory in dirs:
        target = Path(directory)
        while not target.exists() and target != target.parent:
            target = target.parent
        try:
            free_gb = shutil.disk_usage(target).free / 1e9
        except OSError as e:
            issues.append(HealthIssue("disk", f"{directory}: {e.strerror}", critical=True))
            continue
        if free_gb < limits.min_free_gb:
            issues.append(HealthIssue("disk", f"{directory}: {free_gb:.2f} GB free (minimum "
                                      f"{limits.min_free_gb:g} GB)", critical=True))
    return issues


def check_writable(dirs: Iterable[Path]) -> list[HealthIssue]:
    issues = []
    for directory in dirs:
        try:
            Path(directory).mkdir(parents=True, exist_ok=True)
            # A file with no name (O_TMPFILE): a SIGKILL during the probe leaves nothing there.
            with tempfile.TemporaryFile(dir=directory):
                pass
        except OSError as e:
            issues.append(HealthIssue("writable", f"{directory} is not writable ({e.strerror}); "
                                      "fix its permissions or choose another directory",
                                      critical=True))
    return issues


def check_peers(addresses: Sequence[tuple[str, int]], timeout_s: float = 1.0) -> list[HealthIssue]:
    issues = []
    for host, port in addresses:
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                pass
        except OSError as e:
            issues.append(HealthIssue("peer", f"cannot reach {host}:{port} ({e})", critical=False))
    return issues


class GpuHealth:
    """NVML-based GPU checks; inert when nvidia-ml-py or the driver is missing."""

    # NVML throttle reasons that mean the hardware is braking (not just idle or power capping).
    _HW_SLOWDOWN = 0x8 | 0x40 | 0x80  # HW slowdown, HW thermal, HW power brake

    def __init__(self) -> None:
        self._nvml: Any = None
        self._initial_count: int | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._initial_count = pynvml.nvmlDeviceGetCount()
        except Exception:
            self._nvml = None

    @property
    def available(self) -> bool:
        return self._nvml is not None and bool(self._initial_count)

    def check(self, limits: HealthLimits) -> list[HealthIssue]:
        if not self.available:
            return []
        nvml = self._nvml
        issues = []
        try:
            count = nvml.nvmlDeviceGetCount()
        except Exception as e:
            return [HealthIssue("gpu", f"NVML stopped answering: {e}", critical=True)]
        if self._initial_count is not None and count < self._initial_count:
            issues.append(HealthIssue("gpu", f"{self._initial_count - count} GPU(s) vanished "
                                      f"({count} of {self._initial_count} left)", critical=True))
        for index in range(count):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
            except Exception as e:
                issues.append(HealthIssue("gpu", f"GPU {index} unreachable: {e}", critical=True))
                continue
            issues.extend(self._device(nvml, index, handle, limits))
        return issues

    def _device(self, nvml: Any, index: int, handle: Any, limits: HealthLimits
                ) -> list[HealthIssue]:
        # The faults that make a GPU unfit, decided where the in-process rejoin decides them
        # (no baseline: uncorrectable ECC errors count since the driver loaded).
        issues = [HealthIssue(kind, f"GPU {index}: {reason}", critical=True)
                  for kind, reason in nvml_problems(read_nvml(nvml, handle))]
        try:
            temp = nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)
            if temp > limits.max_gpu_temp_c:
                issues.append(HealthIssue("gpu_temperature", f"GPU {index}: {temp} C (limit "
                                          f"{limits.max_gpu_temp_c:g} C)", critical=False))
        except Exception:
            pass
        try:
            reasons = nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle)
            if reasons & self._HW_SLOWDOWN:
                issues.append(HealthIssue("gpu_throttle", f"GPU {index}: hardware slowdown "
                                          f"(throttle reasons 0x{reasons:x})", critical=False))
        except Exception:
            pass
        return issues


GPU_DEVICE_GLOB = "/dev/nvidia[0-9]*"
"""The device files of NVIDIA GPUs (a node with any has GPUs, whether NVML can be loaded)."""


def gpu_devices_present() -> bool:
    return bool(glob.glob(GPU_DEVICE_GLOB))


def gpu_present() -> bool:
    """An NVIDIA GPU is visible on this node (decides where the NCCL shim is injected)."""
    return os.path.exists("/dev/nvidia0") or GpuHealth().available


def node_health(dirs: Sequence[Path], limits: HealthLimits, gpus: GpuHealth | None,
                peers: Sequence[tuple[str, int]] = ()) -> list[HealthIssue]:
    issues = check_memory(limits) + check_disks(dirs, limits)
    if gpus is not None:
        issues += gpus.check(limits)
    return issues + check_peers(peers)


def preflight(dirs: Sequence[Path], limits: HealthLimits, gpus: GpuHealth | None
              ) -> list[HealthIssue]:
    return check_writable(dirs) + node_health(dirs, limits, gpus)


# -- the pre-flight all-reduce ------------------------------------------------------------------
#
# Before the first start, as many short-lived processes as the node has worker slots join a gloo
# group through a TCP store this (agent) process hosts on loopback, check that an all-reduce
# adds correctly, and time a few all-reduces of a larger buffer. Each prints one JSON line.
# Processes, not threads: a process group per thread is not how workers will run, and a probe
# that wedges must be killable.

PROBE_CHECK_ELEMENTS = 1 << 16


@dataclasses.dataclass(frozen=True)
class AllReduceProbe:
    """What the all-reduce probe measured; ``issues`` are critical when the probe failed."""

    world: int
    ok: bool
    nbytes: int
    seconds: float
    busbw_gbps: float | None
    issues: tuple[HealthIssue, ...]

    def to_json(self) -> dict[str, Any]:
        return {"world": self.world, "ok": self.ok, "bytes": self.nbytes,
                "seconds": round(self.seconds, 3),
                "busbw_gbps": None if self.busbw_gbps is None else round(self.busbw_gbps, 3),
                "issues": [i.to_json() for i in self.issues]}


def allreduce_probe(world: int, *, nbytes: int = 8 << 20, iterations: int = 5,
                    timeout_s: float = 120.0, fault_rank: int = -1, fault: str = ""
                    ) -> AllReduceProbe:
    """Runs the gloo all-reduce sanity check and bandwidth test among ``world`` processes.

    ``fault_rank``/``fault`` inject a failure for tests: ``"sum"`` makes that rank contribute a
    wrong value, ``"exit"`` makes it exit before joining.
    """
    import subprocess
    import sys
    import time

    from torch.distributed import TCPStore

    started = time.monotonic()
    store = TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=timeout_s))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICFT_", "TORCHELASTIC_"))}
    env["OMP_NUM_THREADS"] = "1"
    procs = []
    for rank in range(world):
        cmd = [sys.executable, "-m", "elasticft.diag.health", "--allreduce-probe",
               str(store.port), str(rank), str(world), str(nbytes), str(iterations),
               str(timeout_s), fault if rank == fault_rank else ""]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    issues: list[HealthIssue] = []
    results: dict[int, dict[str, Any]] = {}
    deadline = started + timeout_s + 30
    # Wait for all; once one fails, the others can only time out waiting for it: stop them.
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes) or any(codes):
            break
        time.sleep(0.1)
    failed = [r for r, p in enumerate(procs) if p.poll() is not None and p.returncode]
    for rank, proc in enumerate(procs):
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
            why = (f"stopped: rank(s) {failed} failed" if failed else
                   f"did not finish within {timeout_s:g} s")
            issues.append(HealthIssue("allreduce", f"all-reduce probe rank {rank} of {world} "
                                      f"{why}", critical=True))
            continue
        out, err = proc.communicate()
        line = next((ln for ln in reversed(out.splitlines()) if ln.startswith("{")), None)
        if proc.returncode != 0 or line is None:
            tail = " | ".join(err.strip().splitlines()[-2:]) or "no output"
            issues.append(HealthIssue("allreduce", f"all-reduce probe rank {rank} of {world} "
                                      f"failed (exit {proc.returncode}): {tail}", critical=True))
            continue
        results[rank] = json.loads(line)
    del store
    wrong = sorted(r for r, res in results.items() if not res["sum_ok"])
    if wrong:
        issues.append(HealthIssue("allreduce", f"all-reduce among {world} local processes gave "
                                  f"a wrong sum on rank(s) {wrong}: this node's memory or CPU is "
                                  "not computing correctly", critical=True))
    busbw = min((res["busbw_gbps"] for res in results.values()), default=None)
    return AllReduceProbe(world, not issues, nbytes, time.monotonic() - started,
                          busbw if len(results) == world else None, tuple(issues))


def _probe_main(port: int, rank: int, world: int, nbytes: int, iterations: int,
                timeout_s: float, fault: str) -> None:
    """One probe process (``python -m elasticft.diag.health --allreduce-probe ...``)."""
    import time

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if fault == "exit":
        raise SystemExit(3)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        # Sanity: rank r contributes r + 1 everywhere; the sum is world * (world + 1) / 2.
        check = torch.full((PROBE_CHECK_ELEMENTS,), float(rank + 1))
        if fault == "sum":
            check[PROBE_CHECK_ELEMENTS // 2] += 1.0
        dist.all_reduce(check)
        sum_ok = bool(torch.all(check == world * (world + 1) / 2).item())
        data = torch.ones(max(1, nbytes // 4))
        dist.all_reduce(data)  # warm-up: connections and buffers
        dist.barrier()
        began = time.perf_counter()
        for _ in range(iterations):
            dist.all_reduce(data)
        seconds = (time.perf_counter() - began) / iterations
        # Bus bandwidth, as NCCL's tests define it: what each link carries in a ring all-reduce.
        busbw = 2 * (world - 1) / world * data.nbytes / seconds / 1e9 if world > 1 else 0.0
        print(json.dumps({"rank": rank, "sum_ok": sum_ok, "seconds_per_op": seconds,
                          "busbw_gbps": busbw}), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    import sys

    if len(sys.argv) == 9 and sys.argv[1] == "--allreduce-probe":
        _probe_main(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]),
                    int(sys.argv[6]), float(sys.argv[7]), sys.argv[8])
    else:
        raise SystemExit("usage: python -m elasticft.diag.health --allreduce-probe PORT RANK "
                         "WORLD BYTES ITERATIONS TIMEOUT_S FAULT")
