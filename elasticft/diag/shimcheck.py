"""The NCCL shim's self-check: does this worker's NCCL traffic get timed, and if not, why.

The worker runs it once, right after ``import torch`` (which loads NCCL) and before the script
can make its first NCCL call (:mod:`elasticft.diag.autoinstall`, :func:`elasticft.init`). It asks
the preloaded shim (its exported ``elasticft_shim_probe``) whether it records, which library
defines NCCL and its version, and which of the shim's entry points that NCCL lacks, then writes
the answer next to the rank's rings as ``rank-<rank>.nccl.status`` (JSON). The agent's monitor
reads it, writes it to the event log (kind ``nccl_timings``) and logs one line; ``elasticft
status --run-dir`` shows the newest per node. A shim that is inactive changes nothing in NCCL's
behaviour; the agent keeps detecting with the Python recorder, heartbeats and process state.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

EVENT_KIND = "nccl_timings"
_PROBE = "elasticft_shim_probe"


@dataclasses.dataclass(frozen=True)
class ShimStatus:
    """What the shim found in this process."""

    loaded: bool
    recording: bool = False
    reason: str = ""
    version: int = 0
    library: str = ""
    missing: tuple[str, ...] = ()
    cuda_events: bool = False
    cudart: str = ""

    @property
    def active(self) -> bool:
        return self.loaded and self.recording and self.version > 0

    @property
    def why_inactive(self) -> str:
        if not self.loaded:
            return "the shim is not loaded in the worker (LD_PRELOAD)"
        if not self.recording:
            return self.reason or "the shim does not record"
        if self.version <= 0:
            return "no NCCL library is loaded in the worker (torch without NCCL?)"
        return ""

    def message(self) -> str:
        if not self.active:
            return f"NCCL timings inactive: {self.why_inactive}"
        timing = (f"GPU time from CUDA events ({self.cudart})" if self.cuda_events
                  else "host-side completion only (no usable CUDA runtime)")
        text = f"NCCL timings active: NCCL {version_text(self.version)} from {self.library}; "
        text += timing
        if self.missing:
            text += f"; not in this NCCL: {', '.join(self.missing)}"
        return text

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "active": self.active, "message": self.message()}


def version_text(code: int) -> str:
    """NCCL's version code as text (2.30.7 is 23007; before 2.9 it was 2708 for 2.7.8)."""
    if code >= 10000:
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"


def probe() -> ShimStatus:
    """Asks the shim loaded in this process (none: ``loaded=False``)."""
    try:
        function = getattr(ctypes.CDLL(None), _PROBE)
    except (OSError, AttributeError):
        return ShimStatus(loaded=False)
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    buffer = ctypes.create_string_buffer(8192)
    function(buffer, len(buffer))
    found = json.loads(buffer.value.decode(errors="replace"))
    return ShimStatus(loaded=True, recording=bool(found["recording"]), reason=found["reason"],
                      version=int(found["version"]), library=found["library"],
                      missing=tuple(found["missing"]), cuda_events=bool(found["cuda_events"]),
                      cudart=found["cudart"])


def status_path(ring_dir: Path, rank: int) -> Path:
    return Path(ring_dir) / f"rank-{rank}.nccl.status"


def expected(env: Mapping[str, str]) -> bool:
    """The agent injected the shim into this worker."""
    return env.get("ELASTICFT_DIAG_SHIM") is not None or "_nccl_shim" in env.get("LD_PRELOAD", "")


def report(ring_dir: Path, rank: int, env: Mapping[str, str]) -> ShimStatus | None:
    """Runs the self-check once per worker process and writes its status file (never raises)."""
    path = status_path(ring_dir, rank)
    try:
        if not expected(env) or path.exists():
            return None
        status = probe()
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({**status.to_json(), "pid": os.getpid(), "rank": rank}))
        os.replace(tmp, path)
        return status
    except Exception:  # diagnostics never stop a training script
        return None


def read_status(ring_dir: Path, rank: int) -> dict[str, Any] | None:
    """The status a worker wrote, or None while there is none (agent side)."""
    try:
        return json.loads(status_path(ring_dir, rank).read_text())
    except (OSError, ValueError):
        return None
