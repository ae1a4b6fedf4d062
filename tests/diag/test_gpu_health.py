"""The node checks' GPU findings (``GpuHealth``): NVML's faults decided by the shared verdict
(:func:`elasticft.devicehealth.nvml_problems`) are critical, temperature and throttling are
reported. NVML's answers are data: the few pynvml calls the check makes, for two GPUs."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from elasticft.diag.health import GpuHealth, HealthIssue, HealthLimits


class NotSupported(Exception):
    value = 3


def nvml_of(*gpus: dict[str, Any]) -> SimpleNamespace:
    def answer(name: str) -> Callable[..., Any]:
        def call(handle: int, *_: Any) -> Any:
            value = gpus[handle][name]
            if isinstance(value, Exception):
                raise value
            return value
        return call

    return SimpleNamespace(
        NVML_ERROR_NOT_SUPPORTED=3, NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1, NVML_VOLATILE_ECC=0,
        NVML_TEMPERATURE_GPU=0, nvmlDeviceGetCount=lambda: len(gpus),
        nvmlDeviceGetHandleByIndex=lambda index: index,
        nvmlDeviceGetRetiredPagesPendingStatus=answer("pages"),
        nvmlDeviceGetRemappedRows=answer("rows"), nvmlDeviceGetTotalEccErrors=answer("ecc"),
        nvmlDeviceGetTemperature=answer("temp"),
        nvmlDeviceGetCurrentClocksThrottleReasons=answer("throttle"),
        nvmlDeviceGetFieldValues=lambda handle, ids: [SimpleNamespace(
            nvmlReturn=0, value=SimpleNamespace(uiVal=gpus[handle]["action"]))])


def test_nvml_faults_are_critical_and_the_rest_reported() -> None:
    healthy = dict(pages=NotSupported(), rows=(0, 0, 0, 0), ecc=0, temp=60, throttle=0,
                   action=0)
    sick = dict(pages=NotSupported(), rows=(0, 1, 1, 0), ecc=2, temp=95, throttle=0x40,
                action=1)
    gpus = GpuHealth()
    gpus._nvml, gpus._initial_count = nvml_of(healthy, sick), 2
    assert gpus.check(HealthLimits()) == [
        HealthIssue("gpu_recovery_action", "GPU 1: the driver asks for a GPU reset (NVML "
                    "recovery action 1)", critical=True),
        HealthIssue("gpu_row_remap", "GPU 1: a row remapping is pending (it needs a reset)",
                    critical=True),
        HealthIssue("gpu_ecc", "GPU 1: 2 uncorrectable ECC error(s) since the driver loaded",
                    critical=True),
        HealthIssue("gpu_temperature", "GPU 1: 95 C (limit 92 C)", critical=False),
        HealthIssue("gpu_throttle", "GPU 1: hardware slowdown (throttle reasons 0x40)",
                    critical=False),
    ]
