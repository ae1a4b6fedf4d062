"""What a worker's environment needs for diagnostics, and where the pieces live.

The agent hands every worker the directory of its progress rings; for unmodified scripts the
bootstrap directory first on ``PYTHONPATH`` (its ``sitecustomize`` installs the recorder after
``import torch``); and on GPU nodes the NCCL shim first in ``LD_PRELOAD``. The user's own
entries are kept after ours, never replaced.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path

from elasticft import procs
from elasticft.diag.recorder import OWNER_PID_ENV, RING_DIR_ENV

SHIM_ENV = "ELASTICFT_DIAG_SHIM"
CUDART_ENV = "ELASTICFT_DIAG_CUDART"
AUTO_INSTALL_ENV = "ELASTICFT_DIAG_AUTO"
"""``0``: the bootstrap (there for step records) must not install the recorder in this worker."""
WORKER_ENV_NAMES = frozenset({RING_DIR_ENV, SHIM_ENV, OWNER_PID_ENV, CUDART_ENV, AUTO_INSTALL_ENV})
"""Variables diagnostics adds to (or reads in) workers."""

_PACKAGE_DIR = Path(__file__).resolve().parent


def shim_library() -> Path | None:
    """The built NCCL shim shipped in the package, if the build produced it."""
    return next(iter(sorted(_PACKAGE_DIR.glob("_nccl_shim*.so"))), None)


def bootstrap_dir() -> Path:
    return _PACKAGE_DIR / "bootstrap"


def _prepend(value: str, existing: str | None, sep: str) -> str:
    parts = [p for p in (existing or "").split(sep) if p]
    if value in parts:
        return sep.join(parts)
    return sep.join([value, *parts])


def bootstrap_pythonpath(base_env: Mapping[str, str]) -> str:
    """``PYTHONPATH`` with the bootstrap directory first (the user's entries kept after it)."""
    return _prepend(str(bootstrap_dir()), base_env.get("PYTHONPATH"), os.pathsep)


def diag_worker_env(
    ring_dir: Path,
    *,
    auto_install: bool,
    shim: Path | None,
    base_env: Mapping[str, str],
) -> dict[str, str]:
    """The variables a worker needs for diagnostics (pure: no I/O).

    ``LD_PRELOAD`` and ``PYTHONPATH`` are extended, never replaced, and not duplicated.
    """
    env = {RING_DIR_ENV: str(ring_dir)}
    if auto_install:
        env["PYTHONPATH"] = bootstrap_pythonpath(base_env)
    else:
        # The bootstrap may still be there for the step records (elasticft.report.steps).
        env[AUTO_INSTALL_ENV] = "0"
    if shim is not None:
        env[SHIM_ENV] = "1"
        # The dynamic linker accepts spaces or colons; keep the user's entries after ours.
        existing = " ".join((base_env.get("LD_PRELOAD") or "").replace(":", " ").split())
        env["LD_PRELOAD"] = _prepend(str(shim), existing.replace(" ", ":"), ":")
    return env


def default_ring_base() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def ring_dir(base: Path, agent_pid: int, tag: str) -> Path:
    """An agent's directory of progress rings: named after its user and process, so that a
    later agent can tell whether the owner still runs (:func:`sweep_dead_ring_dirs`)."""
    return base / f"elasticft-{os.getuid()}-{agent_pid}-{tag}"


def sweep_dead_ring_dirs(base: Path) -> list[Path]:
    """Removes this user's ring directories whose agent is gone: an agent killed with SIGKILL
    never closes its monitor, and its rings (hundreds of KB per rank) would stay in memory.
    A directory another user owns is left alone, whatever its name says."""
    pattern = re.compile(rf"^elasticft-{os.getuid()}-(\d+)-[0-9a-f]+$")
    removed = []
    for path in base.glob(f"elasticft-{os.getuid()}-*"):
        match = pattern.match(path.name)
        if match is None or not procs.gone(int(match.group(1))):
            continue
        try:
            info = path.lstat()
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed

