"""Installs the diagnostics recorder when ``torch`` is imported, for scripts that never call
:func:`elasticft.init`.

:func:`arm` runs at interpreter start (from the bootstrap ``sitecustomize``) and must stay cheap:
it only adds an import hook. When the script imports ``torch``, the hook lets the import finish
and then installs the recorder (:func:`elasticft.diag.recorder.install`). Child processes (data
loader workers started with *spawn*) inherit the environment and so run the bootstrap too; the
recorder's owner pid, exported at install, keeps them from recording as if they were the rank.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType

from elasticft.diag.recorder import OWNER_PID_ENV, RING_DIR_ENV

logger = logging.getLogger(__name__)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``callback(module)`` right after ``name`` has been imported, then removes itself."""

    def __init__(self, name: str, callback: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.callback = callback
        self._searching = False

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name or self._searching:
            return None
        self._searching = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._searching = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        loader = spec.loader
        exec_module = loader.exec_module
        finder = self

        def exec_then_callback(module: ModuleType) -> None:
            exec_module(module)
            if finder in sys.meta_path:
                sys.meta_path.remove(finder)
            try:
                finder.callback(module)
            except Exception:
                logger.warning("elasticft diagnostics could not be installed", exc_info=True)

        loader.exec_module = exec_then_callback  # type: ignore[method-assign]
        return spec


def should_install(env: Mapping[str, str], pid: int) -> bool:
    owner = env.get(OWNER_PID_ENV)
    return bool(env.get(RING_DIR_ENV)) and (not owner or owner == str(pid))


def arm(env: Mapping[str, str]) -> bool:
    """Arranges for the recorder to be installed once torch is imported; True if armed."""
    if not should_install(env, os.getpid()):
        return False
    directory = Path(env[RING_DIR_ENV])
    rank = int(env.get("RANK", "0"))

    def install(_torch: ModuleType) -> None:
        from elasticft.diag import recorder, shimcheck

        # torch has loaded NCCL and the script has made no NCCL call yet.
        shim = shimcheck.report(directory, rank, env)
        installed = recorder.install(directory, rank)
        installed.nccl_timed_by_shim = shim is not None and shim.active

    if "torch" in sys.modules:
        install(sys.modules["torch"])
    else:
        sys.meta_path.insert(0, _AfterImport("torch", install))
    return True
