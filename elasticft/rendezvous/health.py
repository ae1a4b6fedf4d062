"""The check a node passes before it may join (or wait as a warm standby).

A standby must be ready to take over at once, so it imports torch and runs this check before it
parks in the rendezvous; a node that fails it is refused with the reason instead of joining and
failing later inside a collective. The default check is cheap (milliseconds): the known-answer
matmul of :mod:`elasticft.devicehealth`, and a usable gloo backend. Callers may inject their
own (e.g. the diagnostics' GPU/NCCL checks); every check answers with the one verdict shape,
:class:`elasticft.devicehealth.HealthVerdict` (``HealthReport`` here).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from elasticft.devicehealth import HealthVerdict

HealthReport = HealthVerdict
"""What a node's admission check answers (the shared verdict: ``ok``, ``detail``...)."""

HealthCheck = Callable[[], HealthVerdict]


def basic_health_check() -> HealthVerdict:
    started = time.monotonic()
    try:
        import torch
        import torch.distributed as dist

        from elasticft.devicehealth import known_answer

        computed = known_answer()
        if not computed.ok:
            return HealthVerdict(False, computed.detail, time.monotonic() - started,
                                 computed.evidence)
        if not (dist.is_available() and dist.is_gloo_available()):
            return HealthVerdict(False, "torch.distributed with gloo is not available",
                                 time.monotonic() - started, computed.evidence)
    except Exception as e:  # a broken torch install is exactly what this check is for
        return HealthVerdict(False, f"{type(e).__name__}: {e}", time.monotonic() - started)
    return HealthVerdict(True, f"torch {torch.__version__}: matmul and gloo ok",
                         time.monotonic() - started, computed.evidence)
