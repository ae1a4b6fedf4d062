"""Warm start: workers are forked from one interpreter per node that has already imported torch.

On a small job most of a restart is Python start-up: ``import torch`` takes about 2.5 s here and
the first ``DistributedDataParallel`` pulls in ``torch._dynamo`` for another 2 s, per worker, on
every restart. The :class:`WarmPool` keeps one warm **template** interpreter per node (per
agent) that has done those imports once; every start of every local rank is a fork of it, in
milliseconds: torch is imported once per node, not once per local rank, and nothing is
re-imported after a failure to compete with the resumed training for the CPU.

How the template is started and how a worker is forked from it
(:mod:`elasticft.agent.warm_template` is the agent's client of it):

* It runs a worker's exact command line (``python -u script.py args...``, torchrun's form) in
  its own session, with the environment of the start that needed it, plus a bootstrap
  directory first on ``PYTHONPATH``. Python runs the bootstrap's ``sitecustomize`` at start-up
  (:mod:`elasticft.agent.warm_bootstrap`): it imports the preload modules, freezes what they
  made (``gc.freeze()``) and serves start requests on a socket, before the script has run.
* At each start, torch's ``SubprocessHandler`` asks for a process
  (:class:`WarmSubprocessHandler` overrides its ``_popen``); the pool sends that local rank's
  full environment, working directory and stdout/stderr descriptors (torch's log files, or the
  agent's own streams) over the socket. The template forks; the child applies them and
  returns from start-up, and runs the script as ``__main__``: ``sys.argv``, ``sys.path``, the
  traceback of an exception and the exit code are Python's own. The template serves the local
  ranks' requests one at a time, in turn (a fork each); a start that cannot have it within
  :data:`~elasticft.agent.warm_template.BUSY_TIMEOUT_S` starts cold.
* The child is forked through an intermediate process that exits at once, while the agent holds
  Linux's child-subreaper flag, so the worker becomes the agent's own child: the ``Popen`` torch
  watches, signals with ``killpg`` and reaps *is* the worker
  (:class:`elasticft.procs.AdoptedWorker`). There is no proxy process, so nothing can be
  orphaned by killing it.
* The template is used for a local rank only when nothing that start-up has already consumed
  differs: the same command, working directory and environment except the variables that are
  bound per attempt (ranks, world sizes, master address and port, ``TORCHELASTIC_*``,
  ``ELASTICFT_*``); so one template serves every local rank of a node. Otherwise, and on any
  error, the worker starts cold, exactly as torch would start it, and a new template is started
  in the background with the environment of that start. A template that dies is ended for
  every local rank: all start cold until its successor, a single new template, is ready.

Only binary entrypoints that are a Python interpreter are warm-started; ``--no-python``, NUMA
binding and function entrypoints (where ``--start-method`` applies) start cold. Nothing in the
template touches CUDA or starts a thread pool: importing torch does neither, so forking it is
as safe as a DataLoader's fork. On a machine with NVIDIA GPUs it forks, after each start, that
local rank's next worker early, which makes its CUDA context on the rank's device once the
running worker has exited (:mod:`elasticft.agent.warm_bootstrap._elasticft_warm_device`): a
restarted GPU worker finds CUDA initialised on its device, and no GPU memory is held while a
worker runs. A forked worker reseeds numpy's global generator, as a cold start would (Python's
``random`` reseeds itself on fork).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
from collections.abc import Mapping, Sequence
from subprocess import Popen
from typing import Any

from elasticft import torch_compat
from elasticft.agent import lifeline, warm_template
from elasticft.agent.console import gate_tracebacks
from elasticft.agent.preload import preload_for
from elasticft.agent.warm_template import (
    TemplateBusy,
    WarmInterpreter,
    bootstrap_dir,
    start_signals,
    startup_mismatch,
)
from elasticft.torch_compat import SubprocessContext, SubprocessHandler

__all__ = [
    "WarmInterpreter", "WarmPool", "WarmStartMixin", "WarmSubprocessContext",
    "WarmSubprocessHandler", "bootstrap_dir", "default_device_mode", "not_warm_startable",
    "start_signals", "startup_mismatch",
]

logger = logging.getLogger(__name__)

DEFAULT_PRELOAD = ("torch", "torch._dynamo", "elasticft.diag.autoinstall",
                   "elasticft.ckpt.checkpointer", "elasticft.inprocess.worker")
"""torch itself, what the first DistributedDataParallel or torch.compile imports, and
elasticft's worker side: the diagnostics bootstrap, the checkpointer (which imports
``torch.distributed.checkpoint``) and in-process recovery, 0.06-0.1 s of a replacement's
start-up otherwise. None of them reads the environment when imported (a template's start-up
environment may differ from a worker's in its per-attempt variables)."""
NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
_PYTHON_NAME = re.compile(r"python[0-9.]*$")


def default_device_mode(nvidia_control: str = "/dev/nvidiactl") -> str:
    """``auto`` (spares that prepare the GPU of a worker that used one) where the NVIDIA driver
    is, else ``off`` (no spares). The agent must not ask CUDA itself: that would initialise it."""
    return "auto" if os.path.exists(nvidia_control) else "off"


def not_warm_startable(argv: Sequence[str], python: str = sys.executable) -> str | None:
    """Why this worker command cannot start in a pre-started interpreter (None: it can).

    Only torchrun's own form, ``<python> -u [-m] target args...``: other interpreter options
    (-E, -I, -S...) could keep Python from running the bootstrap.
    """
    if len(argv) < 3:
        return f"command {list(argv)} is not '<python> -u script ...'"
    executable = argv[0]
    same = False
    with contextlib.suppress(OSError):
        same = os.path.samefile(executable, python)
    if not same and not _PYTHON_NAME.match(os.path.basename(executable)):
        return f"{executable} is not a Python interpreter"
    if argv[1] != "-u":
        return f"interpreter options {argv[1]!r} are not torchrun's '-u'"
    target = argv[3] if argv[2] == "-m" and len(argv) > 3 else argv[2]
    if target.startswith("-"):
        return f"interpreter option {target!r} is not supported in a warm start"
    return None


class _Spawning:
    """A template being started, and the local ranks that wait for it."""

    def __init__(self, argv: tuple[str, ...], env: dict[str, str], cwd: str, local_rank: int
                 ) -> None:
        self.launch = (argv, env, cwd)
        self.local_ranks = {local_rank}
        self.thread: threading.Thread | None = None


class WarmPool:
    """The node's warm template: one interpreter that has imported torch, from which every local
    rank's workers are forked (one per distinct start-up: local ranks whose command differs,
    ``${local_rank}`` in the arguments, get one each).

    Each local rank is bound to the template it forks from. A template that cannot serve a
    rank's start (another start-up environment) is unbound from that rank and ended once no rank
    uses it; one that died (or failed a start) is ended for every local rank at once: they all
    start cold, and the next :meth:`refill` starts a single new template for them.
    """

    def __init__(self, preload: Sequence[str] = DEFAULT_PRELOAD, device: str | None = None,
                 frameworks: bool = True) -> None:
        self.preload = tuple(preload)
        self.frameworks = frameworks
        """Whether a template also imports the frameworks its script imports at its top
        (:mod:`elasticft.agent.preload`)."""
        self.device = default_device_mode() if device is None else device
        self._lock = threading.Lock()
        self._interpreters: dict[int, WarmInterpreter] = {}
        self._spawning: list[_Spawning] = []
        self._closed = False
        self.spawned = 0
        """Templates this pool has started (each one imports the preload modules)."""

    def take(
        self, local_rank: int, argv: Sequence[str], env: Mapping[str, str], cwd: str
    ) -> WarmInterpreter | None:
        """The template of ``local_rank`` if it can fork this worker. One that died is ended for
        every local rank; one whose start-up differs is unbound from this one (the next
        :meth:`refill` binds it to a template that matches, or starts one)."""
        with self._lock:
            waiting = [s.thread for s in self._spawning if local_rank in s.local_ranks]
        for thread in waiting:
            if thread is not None:
                thread.join(timeout=60)  # starting the interpreter's process takes milliseconds
        with self._lock:
            warm = None if self._closed else self._interpreters.get(local_rank)
        if warm is None:
            return None
        reason = warm.mismatch(argv, env, cwd)
        if reason is None:
            return warm
        logger.info("local rank %d starts cold: warm template %d: %s", local_rank,
                    warm.proc.pid, reason)
        if warm.alive():
            self._unbind(local_rank, warm)
        else:
            self.drop(local_rank, warm)
        return None

    def _unbind(self, local_rank: int, warm: WarmInterpreter) -> None:
        with self._lock:
            if self._interpreters.get(local_rank) is warm:
                del self._interpreters[local_rank]
            unused = warm not in self._interpreters.values()
        if unused:
            warm.discard()

    def drop(self, local_rank: int, warm: WarmInterpreter) -> None:
        """Ends ``warm`` (it died, or failed to start a worker of ``local_rank``) and unbinds it
        from every local rank: they all start cold until a new template is ready."""
        with self._lock:
            ranks = sorted(r for r, w in self._interpreters.items() if w is warm)
            for rank in ranks:
                del self._interpreters[rank]
        if ranks:
            logger.warning("warm template %d ended (%s); local ranks %s start cold until a new "
                           "one is ready", warm.proc.pid,
                           "it exited" if not warm.alive() else "a start failed in it", ranks)
        warm.discard()

    def interpreters(self) -> dict[int, WarmInterpreter]:
        """Each local rank's template (the same object for every rank it serves)."""
        with self._lock:
            return dict(self._interpreters)

    def templates(self) -> list[WarmInterpreter]:
        """The distinct templates, normally one."""
        with self._lock:
            return list({id(w): w for w in self._interpreters.values()}.values())

    def prepare(
        self, local_rank: int, argv: Sequence[str], env: Mapping[str, str], cwd: str
    ) -> None:
        """Makes sure a template that can fork this worker exists or is being started."""
        if self.take(local_rank, argv, env, cwd) is None:
            self.refill(local_rank, argv, env, cwd)

    def refill(
        self, local_rank: int, argv: Sequence[str], env: Mapping[str, str], cwd: str
    ) -> None:
        """Binds ``local_rank`` to a template that can fork this worker: the node's running one,
        or one being started, else starts one (in the background)."""
        argv, env = tuple(str(a) for a in argv), dict(env)
        with self._lock:
            if self._closed or local_rank in self._interpreters:
                return
            for spawning in self._spawning:
                if local_rank in spawning.local_ranks:
                    return
            for warm in {id(w): w for w in self._interpreters.values()}.values():
                if warm.mismatch(argv, env, cwd) is None:
                    self._interpreters[local_rank] = warm
                    return
            for spawning in self._spawning:
                if warm_template.launch_mismatch(spawning.launch, argv, env, cwd) is None:
                    spawning.local_ranks.add(local_rank)
                    return
            spawning = _Spawning(argv, env, cwd, local_rank)
            spawning.thread = threading.Thread(
                target=self._spawn, args=(spawning,), name="elasticft-warm-template",
                daemon=True,
            )
            self._spawning.append(spawning)
        spawning.thread.start()

    def _spawn(self, spawning: _Spawning) -> None:
        try:
            argv, _, cwd = spawning.launch
            preload = (*self.preload, *(preload_for(argv, cwd) if self.frameworks else ()))
            warm = WarmInterpreter.spawn(*spawning.launch, preload, self.device)
        except Exception:  # the pool is an optimisation: never let it cost the run
            logger.warning("could not start a warm template for local ranks %s",
                           sorted(spawning.local_ranks), exc_info=True)
            with self._lock:
                if spawning in self._spawning:
                    self._spawning.remove(spawning)
            return
        with self._lock:
            if spawning in self._spawning:
                self._spawning.remove(spawning)
            closed = self._closed
            ranks = sorted(spawning.local_ranks)
            replaced = []
            if not closed:
                self.spawned += 1
                for rank in ranks:
                    replaced.append(self._interpreters.get(rank))
                    self._interpreters[rank] = warm
            in_use = list(self._interpreters.values())
        if closed:
            warm.discard()
            return
        logger.info("warm template %d started (imports %s) for local ranks %s", warm.proc.pid,
                    ",".join(preload), ranks)
        for old in {id(w): w for w in replaced if w is not None}.values():
            if old not in in_use:
                old.discard()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            threads, self._spawning = [s.thread for s in self._spawning], []
        for thread in threads:
            if thread is not None:
                thread.join(timeout=30)
        with self._lock:
            interpreters, self._interpreters = self._interpreters, {}
        for warm in {id(w): w for w in interpreters.values()}.values():
            warm.discard()


class WarmSubprocessHandler(SubprocessHandler):
    """torch's ``SubprocessHandler`` whose process comes from the pool when it can."""

    def __init__(self, pool: WarmPool | None, **kwargs: Any) -> None:
        self._pool = pool
        self.warm = False
        self.launch: tuple[tuple[str, ...], dict[str, str], str] | None = None
        super().__init__(**kwargs)

    def _popen(self, args: tuple, env: dict[str, str]) -> Popen:
        argv = tuple(str(a) for a in args)
        cwd = os.getcwd()
        if self._pool is not None and not_warm_startable(argv) is None:
            self.launch = (argv, dict(env), cwd)
            warm = self._pool.take(self.local_rank_id, argv, env, cwd)
            if warm is not None:
                # torch's handler passes these files (or its own inherited streams) to Popen.
                out = self._stdout.fileno() if self._stdout else sys.__stdout__.fileno()
                err = self._stderr.fileno() if self._stderr else sys.__stderr__.fileno()
                try:
                    proc = warm.start(argv, env, cwd, out, err)
                    self.warm = True
                    logger.info("local rank %d: worker %d forked from warm template %d",
                                self.local_rank_id, proc.pid, warm.proc.pid)
                    return proc
                except TemplateBusy:
                    logger.warning("warm template busy; local rank %d starts cold",
                                   self.local_rank_id)
                except OSError:
                    logger.warning("warm start of local rank %d failed; starting cold",
                                   self.local_rank_id, exc_info=True)
                    self._pool.drop(self.local_rank_id, warm)
        # torch's own start, the worker bound to this agent (elasticft.agent.lifeline).
        return Popen(args=args, env=env, stdout=self._stdout, stderr=self._stderr,
                     start_new_session=True, preexec_fn=lifeline.cold_preexec())


class WarmSubprocessContext(SubprocessContext):
    """torch's ``SubprocessContext`` with :class:`WarmSubprocessHandler` workers."""

    def __init__(self, pool: WarmPool | None, **kwargs: Any) -> None:
        self._pool = pool
        super().__init__(**kwargs)
        gate_tracebacks(self)  # a recovered failure's tracebacks stay in the worker logs

    def _start(self) -> None:
        if self.subprocess_handlers:
            raise ValueError("the worker processes were already started")
        if self._pool is not None and torch_compat.numa_options_of(self) is None:
            # The node's template does its imports once (the first start, or after a change of
            # environment) while every local rank waits for it; each worker is forked from it.
            cwd = os.getcwd()
            for local_rank in range(self.nprocs):
                argv = (self.entrypoint, *[str(a) for a in self.args[local_rank]])
                if not_warm_startable(argv) is None:
                    env = {**os.environ, **self.envs[local_rank]}
                    self._pool.prepare(local_rank, argv, env, cwd)
        self.subprocess_handlers = {
            local_rank: WarmSubprocessHandler(
                self._pool,
                **torch_compat.subprocess_handler_kwargs(
                    entrypoint=self.entrypoint,
                    args=self.args[local_rank],
                    env=self.envs[local_rank],
                    stdout=self.stdouts[local_rank],
                    stderr=self.stderrs[local_rank],
                    local_rank_id=local_rank,
                    numa_options=torch_compat.numa_options_of(self),
                ),
            )
            for local_rank in range(self.nprocs)
        }
        for local_rank, handler in self.subprocess_handlers.items():
            if self._pool is not None and handler.launch is not None:
                self._pool.refill(local_rank, *handler.launch)

    def warm_ranks(self) -> list[int]:
        return sorted(r for r, h in self.subprocess_handlers.items() if getattr(h, "warm", False))


class _WorkerEnvsReady(BaseException):
    """Carries the worker environments torch has computed out of its ``_start_workers``.

    A BaseException so that torch's metric decorator does not count it as a failure.
    """

    def __init__(self, envs: dict[int, dict[str, str]]) -> None:
        super().__init__("worker environments ready")
        self.envs = envs


class WarmStartMixin:
    """Mixed into the agent (before ``LocalElasticAgent``): starts workers through the pool.

    torch's ``LocalElasticAgent._start_workers`` computes every worker's environment (torch's
    variables, ``_set_local_rank_env``, OMP_NUM_THREADS) and then calls ``start_processes``. To
    keep that computation torch's own, the mixin runs it and takes the environments from the
    ``_setup_local_watchdog(envs)`` hook it calls just before starting processes; it then starts
    them with :class:`WarmSubprocessContext` instead of torch's ``SubprocessContext``.
    """

    warm_pool: WarmPool | None = None
    warm_ranks: tuple[int, ...] = ()
    """Local ranks of the latest start that began in a pre-started interpreter."""
    _capturing_worker_envs = False

    def worker_pythonpath(self, existing: str | None) -> str | None:
        """The workers' ``PYTHONPATH`` as the agent composes it (None: ``existing`` stands)."""
        raise NotImplementedError

    def startup_env(self) -> dict[str, str]:
        """Variables the agent adds to every worker's environment that its start-up may read
        (the NCCL settings of in-process recovery): the warm template starts with them."""
        raise NotImplementedError

    def prewarm(self, spec: Any) -> None:
        """Starts the node's warm template before the first rendezvous, so that its imports
        overlap the wait (all of it for a standby, whose workers then start as fast as a
        survivor's). The environment is the one the workers most likely get: this process's,
        plus what torch adds and the ``PYTHONPATH`` the collaborators declare; a worker whose
        environment differs starts cold, as before."""
        if (self.warm_pool is None or not isinstance(spec.entrypoint, str)
                or spec.numa_options is not None or torch_compat.warm_start_unavailable()):
            return
        # torch's LocalElasticAgent gives every worker TORCH_NCCL_ASYNC_ERROR_HANDLING (the
        # agent's, else 1); startup_env overrides it on a GPU node of a job under InProcess (its
        # script names it, or its workers armed: a later start that only then gets the
        # in-process settings starts cold once and refills the pool). Without it
        # here, every first start found a mismatch and imported torch again in a second
        # interpreter.
        env = {**os.environ, NCCL_ERROR_HANDLING: os.environ.get(NCCL_ERROR_HANDLING, "1"),
               **self.startup_env()}
        if (path := self.worker_pythonpath(os.environ.get("PYTHONPATH"))) is not None:
            env["PYTHONPATH"] = path
        for local_rank in range(spec.local_world_size):
            args = torch_compat.macros.substitute(list(spec.args), str(local_rank))
            argv = (spec.entrypoint, *[str(a) for a in args])
            if not_warm_startable(argv) is None:
                self.warm_pool.refill(local_rank, argv, env, os.getcwd())

    def _setup_local_watchdog(self, envs: dict[int, dict[str, str]]) -> None:
        if self._capturing_worker_envs:
            raise _WorkerEnvsReady(envs)
        super()._setup_local_watchdog(envs)  # type: ignore[misc]

    def _start_workers(self, worker_group: Any) -> dict[int, Any]:
        macros = torch_compat.macros
        self.warm_ranks = ()
        spec = worker_group.spec
        if self.warm_pool is not None and (missing := torch_compat.warm_start_unavailable()):
            torch_compat.degraded("warm start", f"torch lacks {missing}")
            self.warm_pool = None
        # Without a pool the workers start cold, through the same context: bound to the agent.
        if (
            torch_compat.warm_start_unavailable()
            or not isinstance(spec.entrypoint, str)
            or spec.numa_options is not None
        ):
            return super()._start_workers(worker_group)  # type: ignore[misc]
        self._capturing_worker_envs = True
        try:
            pids = super()._start_workers(worker_group)  # type: ignore[misc]
        except _WorkerEnvsReady as ready:
            envs = ready.envs
        else:
            logger.warning("torch started the workers without the watchdog hook; warm start off")
            self.warm_pool = None
            return pids
        finally:
            self._capturing_worker_envs = False
        super()._setup_local_watchdog(envs)  # type: ignore[misc]
        self._setup_healthcheck()  # type: ignore[attr-defined]
        args = {
            w.local_rank: tuple(macros.substitute(list(spec.args), str(w.local_rank)))
            for w in worker_group.workers
        }
        template = self._log_line_prefix_template  # type: ignore[attr-defined]
        prefixes = None
        if template:
            prefixes = {
                w.local_rank: torch_compat.log_line_prefix(
                    template, spec.role, w.global_rank, w.local_rank)
                for w in worker_group.workers
            }
        context = WarmSubprocessContext(
            self.warm_pool,
            **torch_compat.subprocess_context_kwargs(
                name=spec.role,
                entrypoint=spec.entrypoint,
                args=args,
                envs=envs,
                logs_specs=self._logs_specs,  # type: ignore[attr-defined]
                log_line_prefixes=prefixes,
                numa_options=None,
                duplicate_stdout_filters=getattr(spec, "duplicate_stdout_filters", None),
                duplicate_stderr_filters=getattr(spec, "duplicate_stderr_filters", None),
            ),
        )
        try:
            context.start()
        except Exception:  # a SIGTERM during the start too: stopped within --shutdown-timeout
            context.close(timeout=getattr(self, "_shutdown_timeout", 30))
            raise
        self._pcontext = context
        self.warm_ranks = tuple(context.warm_ranks())
        return context.pids()
