"""What a worker's environment needs for diagnostics, and where the pieces live.

The agent hands every worker its progress rings and shim status file (:class:`WorkerFiles`:
files with no name, which the worker opens as ``/proc/<agent pid>/fd/<n>``); for unmodified
scripts the bootstrap directory first on ``PYTHONPATH`` (its ``sitecustomize`` installs the
recorder after ``import torch``); and on GPU nodes the NCCL shim first in ``LD_PRELOAD``. The
user's own entries are kept after ours, never replaced.

Older versions kept the rings in a named directory per agent (``elasticft-<uid>-<pid>-<tag>``),
which an agent killed with SIGKILL left behind; every start still sweeps those
(:func:`sweep_dead_ring_dirs`).
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
from elasticft.addon.api import prepend_paths
from elasticft.diag.autoinstall import AUTO_INSTALL_ENV
from elasticft.diag.recorder import OWNER_PID_ENV
from elasticft.diag.ring import (
    FILE_ENV_NAMES,
    RING_DIR_ENV,
    RingFiles,
    create_anonymous_ring,
)
from elasticft.diag.shimcheck import SHIM_ENV
from elasticft.unnamed import anonymous_file, path_of

CUDART_ENV = "ELASTICFT_DIAG_CUDART"
WORKER_ENV = frozenset({RING_DIR_ENV, *FILE_ENV_NAMES, SHIM_ENV, OWNER_PID_ENV, CUDART_ENV,
                        AUTO_INSTALL_ENV})
"""Variables diagnostics adds to (or reads in) workers (listed in the agent's
WORKER_ENV_NAMES)."""

_PACKAGE_DIR = Path(__file__).resolve().parent


def shim_library() -> Path | None:
    """The built NCCL shim shipped in the package, if the build produced it."""
    return next(iter(sorted(_PACKAGE_DIR.glob("_nccl_shim*.so"))), None)


def bootstrap_dir() -> Path:
    return _PACKAGE_DIR / "bootstrap"


def bootstrap_pythonpath(base_env: Mapping[str, str]) -> str:
    """``PYTHONPATH`` with the bootstrap directory first (the user's entries kept after it)."""
    return prepend_paths([bootstrap_dir()], base_env.get("PYTHONPATH"))


def diag_worker_env(
    files: RingFiles,
    *,
    auto_install: bool,
    shim: Path | None,
    base_env: Mapping[str, str],
) -> dict[str, str]:
    """The variables a worker needs for diagnostics (pure: no I/O).

    ``LD_PRELOAD`` and ``PYTHONPATH`` are extended, never replaced, and not duplicated.
    """
    # Empty, not inherited: the launcher's ring directory (DiagConfig.diag_ring_dir) travels in
    # a variable of this name, and a worker given a directory would create named rings there
    # (a worker run by hand).
    env = {RING_DIR_ENV: "", **files.to_env()}
    if auto_install:
        env["PYTHONPATH"] = bootstrap_pythonpath(base_env)
    else:
        # The bootstrap may still be there for the step records (elasticft.steps).
        env[AUTO_INSTALL_ENV] = "0"
    if shim is not None:
        env[SHIM_ENV] = "1"
        # The dynamic linker accepts spaces or colons; keep the user's entries after ours.
        existing = " ".join((base_env.get("LD_PRELOAD") or "").replace(":", " ").split())
        env["LD_PRELOAD"] = prepend_paths([shim], existing.replace(" ", ":"), ":")
    return env


def default_ring_base() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class WorkerFiles:
    """One worker's rings and shim status file as the agent holds them: open descriptors of
    files that have no name (:func:`elasticft.unnamed.anonymous_file`, in ``base``'s file
    system). The worker and the agent's own readers open them as ``/proc/<agent pid>/fd/<n>``
    (same user); the memory goes with the last descriptor or mapping, so neither a finished nor
    a SIGKILLed run leaves anything to remove. A ring whose pages cannot be reserved is left
    out (one warning line): that producer records nothing."""

    def __init__(self, base: Path, rank: int, capacity: int, *, status: bool) -> None:
        self._fds: dict[str, int] = {}
        try:
            for source in ("py", "nccl"):
                fd = create_anonymous_ring(base, rank, source, capacity)
                if fd is not None:
                    self._fds[source] = fd
            if status:
                self._fds["status"] = anonymous_file(base)
        except BaseException:
            self.close()
            raise
        path = {k: path_of(fd) for k, fd in self._fds.items()}
        self.files = RingFiles(path.get("py"), path.get("nccl"), path.get("status"))

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}


def sweep_dead_ring_dirs(base: Path) -> list[Path]:
    """Removes this user's ring directories, as older versions named them, whose agent is gone:
    an agent killed with SIGKILL never closed its monitor, and its rings (hundreds of KB per
    rank) would stay in memory. A directory another user owns is left alone, whatever its name
    says."""
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

