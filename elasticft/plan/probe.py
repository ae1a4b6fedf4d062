"""A short probe of this machine's compute speed, for planning with measured numbers.

It times square matrix products on the device workers will use (the first CUDA GPU when there
is one, else the CPU) and returns the hardware description with ``peak_tflops`` set to the
achieved rate and ``compute_efficiency`` 1. Communication speeds stay as given: measuring
links needs the job's peers, which the planner does not have yet.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from elasticft.plan.api import Hardware

logger = logging.getLogger(__name__)


def measure_matmul_tflops(size: int = 1024, seconds: float = 0.5) -> float:
    """Achieved TFLOP/s of ``size`` x ``size`` products, run for about ``seconds``."""
    import torch

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    torch.mm(a, b)  # warm-up: kernel selection, allocation
    if cuda:
        torch.cuda.synchronize()
    runs = 0
    started = time.perf_counter()
    while True:
        torch.mm(a, b)
        runs += 1
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - started
        if elapsed >= seconds:
            break
    return 2.0 * size**3 * runs / elapsed / 1e12


def probed(hardware: Hardware, size: int = 1024, seconds: float = 0.5) -> Hardware:
    """``hardware`` with its compute speed replaced by a measurement on this machine."""
    tflops = measure_matmul_tflops(size, seconds)
    logger.info("compute probe: %.3f TFLOP/s (was %.3f nominal x %.2f)", tflops,
                hardware.peak_tflops, hardware.compute_efficiency)
    return dataclasses.replace(hardware, peak_tflops=tflops, compute_efficiency=1.0)
