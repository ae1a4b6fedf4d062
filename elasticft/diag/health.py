"""Node health: is this machine still fit to train on?

Each check returns :class:`HealthIssue` values; ``critical`` ones make the agent treat the node
as suspect (the policy may evict it), the rest are reported. Checks:

* GPUs through NVML (``nvidia-ml-py``) when it is installed and a driver is present: a GPU that
  vanished since the first check, uncorrectable ECC errors, pending retired pages, temperature,
  hardware slowdown (thermal or power brake) throttling;
* host memory pressure (psutil);
* free space of the run directory and checkpoint directories;
* reachability of peer addresses (a TCP connect with a short timeout).

:func:`preflight` runs before the first workers start: the directories must be writable, then the
same checks.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class HealthIssue:
    check: str
    message: str
    critical: bool

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
            with tempfile.NamedTemporaryFile(dir=directory, prefix=".elasticft-probe-"):
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
        issues = []
        try:
            ecc = nvml.nvmlDeviceGetTotalEccErrors(
                handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)
            if ecc > 0:
                issues.append(HealthIssue("gpu_ecc", f"GPU {index}: {ecc} uncorrectable ECC "
                                          "error(s) since boot", critical=True))
        except Exception:
            pass  # ECC not supported on this board
        try:
            if nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle):
                issues.append(HealthIssue("gpu_retired_pages", f"GPU {index}: retired pages "
                                          "pending (reset needed)", critical=True))
        except Exception:
            pass
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
