"""The check a node passes before it may join (or wait as a warm standby).

A standby must be ready to take over at once, so it imports torch and runs this check before it
parks in the rendezvous; a node that fails it is refused with the reason instead of joining and
failing later inside a collective. The default check is cheap (milliseconds): a small matmul
against a known result, and a usable gloo backend. Callers may inject their own (e.g. the
diagnostics' GPU/NCCL checks).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class HealthReport:
    ok: bool
    detail: str
    seconds: float


HealthCheck = Callable[[], HealthReport]


def basic_health_check() -> HealthReport:
    started = time.monotonic()
    try:
        import torch
        import torch.distributed as dist

        a = torch.arange(16, dtype=torch.float64).reshape(4, 4)
        product = a @ torch.eye(4, dtype=torch.float64) * 2
        if not torch.equal(product, a * 2):
            return HealthReport(False, "CPU matmul gave a wrong result", time.monotonic() - started)
        if not (dist.is_available() and dist.is_gloo_available()):
            return HealthReport(False, "torch.distributed with gloo is not available",
                                time.monotonic() - started)
    except Exception as e:  # a broken torch install is exactly what this check is for
        return HealthReport(False, f"{type(e).__name__}: {e}", time.monotonic() - started)
    return HealthReport(True, f"torch {torch.__version__}: matmul and gloo ok",
                        time.monotonic() - started)
