"""Installs the diagnostics recorder and the automatic step records when ``torch`` is imported,
for scripts that never call :func:`elasticft.init`.

:func:`arm` runs at interpreter start (from the bootstrap ``sitecustomize``) and must stay cheap:
it only adds an import hook. When the script imports ``torch``, the hook lets the import finish
and then installs the recorder (:func:`elasticft.diag.recorder.install`) when the worker has
diagnostics rings (:class:`elasticft.diag.ring.RingFiles`), and the optimizer-step recorder
(:class:`elasticft.steps.AutoStepRecorder`) when it has a step log, and the recording of each
process group's sockets (:mod:`elasticft.diag.groupsockets`, which in-process recovery needs), so
it sees the script's own ``init_process_group``. A function entrypoint gets
its environment only once its process runs, after start-up: :class:`ArmedEntrypoint` arms it
there instead. Child processes (data
loader workers started with *spawn*) inherit the environment and so run the bootstrap too; the
owner pid, exported at install, keeps them from recording as if they were the rank.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType

from elasticft.diag import groupsockets
from elasticft.diag.recorder import OWNER_PID_ENV
from elasticft.diag.ring import RingFiles, RingUnavailable
from elasticft.steps import STEP_LOG_ENV, AutoStepRecorder, auto_step_path

AUTO_INSTALL_ENV = "ELASTICFT_DIAG_AUTO"
"""``0``: the bootstrap (there for step records) must not install the recorder in this worker.
Set by :func:`elasticft.diag.workerenv.diag_worker_env`; owned here, where it is read, because
this module runs at every worker's start-up and imports nothing it does not need."""

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


def wanted(env: Mapping[str, str], pid: int) -> tuple[bool, bool]:
    """(install the diagnostics recorder, install the step recorder) in process ``pid``."""
    owner = env.get(OWNER_PID_ENV)
    if owner and owner != str(pid):
        return False, False
    diag = (RingFiles.from_env(env, 0) is not None and env.get(AUTO_INSTALL_ENV, "1") != "0")
    return diag, bool(env.get(STEP_LOG_ENV))


def arm(env: Mapping[str, str]) -> bool:
    """Arranges for the recorders to be installed once torch is imported; True if armed."""
    diag, steps = wanted(env, os.getpid())
    if not (diag or steps):
        return False
    rank = int(env.get("RANK", "0"))
    files = RingFiles.from_env(env, rank) if diag else None
    step_log = Path(env[STEP_LOG_ENV]) if steps else None

    def install(_torch: ModuleType) -> None:
        # Every group's sockets, from the script's first group on: in-process recovery ends a
        # pending gloo wait through them (recording costs a look at /proc per group made).
        groupsockets.install()
        # After the recording's wrapper: the regime's reconfigure records its own connections.
        from elasticft.inprocess import reconfigure

        reconfigure.install()
        if files is not None:
            from elasticft.diag import recorder, shimcheck

            # torch has loaded NCCL and the script has made no NCCL call yet.
            shim = shimcheck.report(files.status, rank, env)
            try:
                # No Python ring: the agent could not reserve one, and said so.
                if files.py is not None:
                    installed = recorder.install(files.py, rank)
                    installed.nccl_check = shimcheck.interception_check(files.status, rank,
                                                                        shim)
            except RingUnavailable as e:
                # One line, and training goes on without this rank's Python recording.
                logger.warning("%s; rank %d records no Python diagnostics", e.strerror, rank)
        if step_log is not None:
            AutoStepRecorder(auto_step_path(step_log)).install()
            os.environ[OWNER_PID_ENV] = str(os.getpid())

    if "torch" in sys.modules:
        install(sys.modules["torch"])
    else:
        sys.meta_path.insert(0, _AfterImport("torch", install))
    return True


class ArmedEntrypoint:
    """A function entrypoint that arms the recorders first (torch sets a function worker's
    environment after its interpreter has started, so the bootstrap never sees it); then calls
    the function. Picklable when the function is, as torch's *spawn* needs."""

    def __init__(self, function: Callable[..., object]) -> None:
        self.function = function
        functools.update_wrapper(self, function)  # torch names the entrypoint by __qualname__

    def __call__(self, *args: object, **kwargs: object) -> object:
        try:
            arm(os.environ)
        except Exception:  # never stop the training function from running
            logger.warning("elasticft diagnostics could not be armed", exc_info=True)
        return self.function(*args, **kwargs)
