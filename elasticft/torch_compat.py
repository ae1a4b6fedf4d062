"""The one place elasticft touches torch's private or version-dependent launcher API.

elasticft extends torchrun from the inside: it subclasses torch's ``LocalElasticAgent``, its
worker process context and handler, implements torch's rendezvous handler interface (and reads
the round of torch's own dynamic handler under c10d), and it calls torchrun's
own argument parsing. None of that is a stable API, and it changes between torch releases (2.10
and 2.11 have no shutdown timeout in ``LaunchConfig``, the agent or its ``_shutdown``; 2.12 added
them).
Every other module imports these names from here, never from ``torch.distributed.elastic``,
``torch.distributed.run`` or ``torch.distributed.launcher`` directly.

Choices are made by looking at what the installed torch offers (a dataclass field, a parameter
in a signature, an attribute), never by its version number. Where an older torch has no
equivalent for something, elasticft does without it and says so once (:func:`degraded`); the
list is in docs/compat.md. :data:`elasticft.torch_contracts.CONTRACTS` names every private piece
elasticft relies on with a check of its shape; tests/test_torch_compat.py runs each, so a torch
that changes one fails there with the name of what changed, not somewhere deep in a run.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Mapping
from string import Template
from typing import Any

import torch
from torch.distributed import run as torch_run
from torch.distributed.elastic import events as torch_events
from torch.distributed.elastic import metrics
from torch.distributed.elastic.agent.server.api import (
    RunResult,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import (
    DefaultLogsSpecs,
    LogsSpecs,
    ProcessFailure,
    Std,
)
from torch.distributed.elastic.multiprocessing import api as multiprocessing_api
from torch.distributed.elastic.multiprocessing.api import SignalException, SubprocessContext
from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler
from torch.distributed.elastic.rendezvous import RendezvousParameters, dynamic_rendezvous
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.elastic.utils import macros
from torch.distributed.launcher.api import LaunchConfig

__all__ = [
    "DefaultLogsSpecs",
    "DynamicRendezvousHandler",
    "LaunchConfig",
    "LocalElasticAgent",
    "LogsSpecs",
    "ProcessFailure",
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousGracefulExitError",
    "RendezvousHandler",
    "RendezvousInfo",
    "RendezvousParameters",
    "RendezvousTimeout",
    "RendezvousTimeoutError",
    "RunResult",
    "SignalException",
    "Std",
    "SubprocessContext",
    "SubprocessHandler",
    "WorkerGroup",
    "WorkerSpec",
    "WorkerState",
    "macros",
    "metrics",
    "multiprocessing_api",
    "parse_rendezvous_endpoint",
    "rdzv_registry",
    "torch_events",
]

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
DEFAULT_SHUTDOWN_TIMEOUT_S = 30


def _parameters(function: Callable[..., Any]) -> Mapping[str, inspect.Parameter]:
    return inspect.signature(function).parameters


def _fields(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls))


def calling_method_name(depth: int = 2) -> str:
    """The name of the function ``depth`` frames up from here (0: this one), as torch's
    ``dynamic_rendezvous.get_method_name`` gives it, read from the frame itself.

    torch's names each rendezvous event by its caller with two ``inspect.stack()`` calls, each a
    walk of the whole stack that reads every frame's source lines: about 12 ms of the agent's CPU
    per event, 0.4 s of a 10-step job's 3.6 s, on every round and keep-alive. It takes its
    place in torch's module (:data:`TORCH_METHOD_NAME` keeps torch's own)."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # the stack is shallower than that
        return "no_method_name"


TORCH_METHOD_NAME: Callable[..., str] | None = getattr(dynamic_rendezvous, "get_method_name", None)
if callable(TORCH_METHOD_NAME):
    dynamic_rendezvous.get_method_name = calling_method_name


# ------------------------------------------------------------------------------------------------
# What the installed torch offers (read once, at import).

LAUNCH_CONFIG_FIELDS = _fields(LaunchConfig)
WORKER_SPEC_FIELDS = _fields(WorkerSpec)
AGENT_TAKES_SHUTDOWN_TIMEOUT = "shutdown_timeout" in _parameters(LocalElasticAgent.__init__)
"""torch >= 2.12: the agent stores ``shutdown_timeout`` itself and uses it in ``run()``."""
AGENT_SHUTDOWN_TAKES_TIMEOUT = "timeout" in _parameters(LocalElasticAgent._shutdown)
"""torch >= 2.12: ``_shutdown(death_sig, timeout)``; before, always torch's built-in 30 s."""
PARSER_HAS_SHUTDOWN_TIMEOUT = any(
    "--shutdown-timeout" in action.option_strings for action in torch_run.get_args_parser()._actions
)

_said: set[str] = set()


def degraded(feature: str, detail: str) -> bool:
    """Logs, once per process, that ``feature`` is off on this torch and why. Returns True the
    first time (so callers can emit an event too)."""
    if feature in _said:
        return False
    _said.add(feature)
    logger.warning("torch %s: %s is not available (%s); see docs/compat.md",
                   torch.__version__, feature, detail)
    return True


# ------------------------------------------------------------------------------------------------
# torchrun's command line.

get_args_parser = torch_run.get_args_parser
parse_min_max_nnodes = torch_run.parse_min_max_nnodes
determine_local_world_size = torch_run.determine_local_world_size


def add_missing_launcher_flags(parser: Any) -> None:
    """Adds torchrun flags that a newer torch has and this one lacks, with the newer meaning.

    ``--shutdown-timeout`` (torch 2.12): elasticft applies it itself on any torch.
    """
    if PARSER_HAS_SHUTDOWN_TIMEOUT:
        return
    default = os.environ.get("PET_SHUTDOWN_TIMEOUT")
    parser.add_argument(
        "--shutdown-timeout", "--shutdown_timeout", type=int,
        default=int(default) if default and default.isdigit() else None,
        help="Seconds to wait for workers to exit after SIGTERM before SIGKILL (default: "
             f"${SHUTDOWN_TIMEOUT_ENV} or {DEFAULT_SHUTDOWN_TIMEOUT_S}).",
    )


def no_default_master_port(parser: Any, environ: Mapping[str, str] = os.environ) -> None:
    """``--master-port`` is None unless given (flag or ``PET_MASTER_PORT``), on every torch.

    torch 2.12 made it so; torch 2.10 and 2.11 default it to 29500, and a single-node launch
    that names no port then cannot be told from one that names 29500. It would stay on the
    static rendezvous, whose one TCP store every restart's workers share: the restarted workers
    read their peers' addresses of the attempt before (gloo: "connection refused"; NCCL: the old
    unique id) and never form their group."""
    for action in parser._actions:
        if action.dest == "master_port" and "PET_MASTER_PORT" not in environ:
            action.default = None


def config_from_args(args: Any) -> tuple[LaunchConfig, Any, list[str]]:
    """torchrun's ``config_from_args``; the config carries ``shutdown_timeout`` on every torch."""
    config, cmd, cmd_args = torch_run.config_from_args(args)
    if "shutdown_timeout" not in LAUNCH_CONFIG_FIELDS:
        value = getattr(args, "shutdown_timeout", None)
        if value is not None and value < 0:  # as torch's own LaunchConfig checks it
            raise ValueError(f"shutdown_timeout must be non-negative, got {value}")
        # An attribute on the instance: read back only through shutdown_timeout_of().
        config.shutdown_timeout = value  # type: ignore[attr-defined]
    return config, cmd, cmd_args


def shutdown_timeout_of(config: LaunchConfig) -> int:
    """Seconds between SIGTERM and SIGKILL for ``config``: its own value, else the variable."""
    value = getattr(config, "shutdown_timeout", None)
    if value is None:
        value = os.environ.get(SHUTDOWN_TIMEOUT_ENV, str(DEFAULT_SHUTDOWN_TIMEOUT_S))
    timeout = int(value)
    if timeout < 0:
        raise ValueError(f"shutdown_timeout must be non-negative, got {timeout}")
    return timeout


def default_logs_streams(specs: LogsSpecs | None) -> tuple[str, Any, Any, Any] | None:
    """(root log directory, redirects, tee, local ranks filter) of torch's own
    ``DefaultLogsSpecs`` (which keeps the last three private); None for any other kind."""
    if type(specs) is not DefaultLogsSpecs:
        return None
    return (specs.root_log_dir, specs._redirects, specs._tee,  # type: ignore[attr-defined]
            specs._local_ranks_filter)  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------------------------
# The agent.

def agent_init_kwargs(shutdown_timeout: int) -> dict[str, Any]:
    """Keywords for ``LocalElasticAgent.__init__`` beyond those every supported torch takes."""
    return {"shutdown_timeout": shutdown_timeout} if AGENT_TAKES_SHUTDOWN_TIMEOUT else {}


def shutdown_agent(agent: Any, torch_shutdown: Callable[..., None], death_sig: signal.Signals,
                   timeout: int) -> None:
    """torch's ``agent._shutdown`` with a timeout between ``death_sig`` and SIGKILL, on any torch.

    Where torch's ``_shutdown`` takes no timeout, the workers are closed with it first (the
    process context takes one on every supported torch); torch's own shutdown then finds them
    gone and stops the rest (watchdog, health-check server).
    """
    if AGENT_SHUTDOWN_TAKES_TIMEOUT:
        torch_shutdown(death_sig, timeout=timeout)
        return
    context = getattr(agent, "_pcontext", None)
    if context is not None:
        context.close(death_sig, timeout)
    torch_shutdown(death_sig)


def worker_spec(**kwargs: Any) -> WorkerSpec:
    """A ``WorkerSpec``; an option this torch lacks is dropped when unset, and refused when set.

    A refusal is a :class:`ValueError` naming the option (a usage error for elasticft-run).
    """
    present = {k: v for k, v in kwargs.items() if k in WORKER_SPEC_FIELDS}
    for name in kwargs.keys() - present.keys():
        if kwargs[name] not in (None, False, [], (), ""):
            raise ValueError(f"{name.replace('_', '-')} needs a newer torch than "
                             f"{torch.__version__}")
    return WorkerSpec(**present)


# ------------------------------------------------------------------------------------------------
# Worker processes (warm start and the survivor hook).

SURVIVOR_HOOK_PARTS = ("_poll", "_running_local_ranks", "subprocess_handlers")


def can_hook_survivor_stop(context: Any) -> bool:
    """Whether ``context`` is torch's ``SubprocessContext`` with the parts the hook wraps.

    The hook (elasticft.agent.replace.notify_before_survivors_stopped) reads which local ranks are
    running and their processes, and wraps the poll that stops survivors.
    """
    if not isinstance(context, SubprocessContext):
        return False
    missing = [part for part in SURVIVOR_HOOK_PARTS if not hasattr(context, part)]
    if missing:
        degraded("acting on survivors before torch stops them",
                 f"SubprocessContext has no {', '.join(missing)}")
        return False
    return True


def running_local_ranks(context: Any) -> list[int]:
    return list(context._running_local_ranks)


def worker_exit_code(context: Any, local_rank: int) -> int | None:
    return context.subprocess_handlers[local_rank].proc.poll()


def worker_process(context: Any, local_rank: int) -> Any:
    """The ``Popen`` of a local rank's worker."""
    return context.subprocess_handlers[local_rank].proc


def wrap_poll(context: Any, wrapper: Callable[[Callable[[], Any]], Callable[[], Any]]) -> None:
    """Replaces ``context._poll`` by ``wrapper(original_poll)``."""
    context._poll = wrapper(context._poll)


REPLACE_WORKER_PARTS = ("subprocess_handlers", "envs", "args", "entrypoint", "stdouts",
                        "stderrs", "error_files", "_running_local_ranks", "_failures")
"""What replacing one worker of a running ``SubprocessContext`` reads and updates (in-process
recovery, :mod:`elasticft.inprocess.agent_side`)."""


def replace_worker_unavailable(context: Any) -> str | None:
    """Why one worker of ``context`` cannot be replaced while the others run (None: it can)."""
    if not isinstance(context, SubprocessContext):
        return f"the workers run in a {type(context).__name__}, not a SubprocessContext"
    missing = [part for part in REPLACE_WORKER_PARTS if not hasattr(context, part)]
    return f"SubprocessContext has no {', '.join(missing)}" if missing else None


def replace_worker(context: Any, local_rank: int, env: Mapping[str, str],
                   make_handler: Callable[..., Any]) -> Any:
    """Starts a new process for ``local_rank`` of a running ``SubprocessContext`` with ``env``
    (its old process has exited, or is still in the kernel's teardown); the other workers are
    not touched.

    ``make_handler(**kwargs)`` builds the ``SubprocessHandler`` (torch's, or the warm pool's)
    from :func:`subprocess_handler_kwargs`. The old worker's error file is removed (its
    failure was read) and its log files are kept beside the new ones, named by its pid.
    """
    old = context.subprocess_handlers[local_rank]
    for stream in (getattr(old, "_stdout", None), getattr(old, "_stderr", None)):
        if stream is not None:
            stream.close()
    for path in (context.stdouts.get(local_rank), context.stderrs.get(local_rank)):
        if path and os.path.exists(path):
            os.replace(path, f"{path}.{old.proc.pid}")
    error_file = context.error_files.get(local_rank)
    if error_file and os.path.exists(error_file):
        os.remove(error_file)
    context.envs[local_rank] = dict(env)
    handler = make_handler(**subprocess_handler_kwargs(
        entrypoint=context.entrypoint, args=context.args[local_rank], env=dict(env),
        stdout=context.stdouts.get(local_rank), stderr=context.stderrs.get(local_rank),
        local_rank_id=local_rank, numa_options=numa_options_of(context)))
    context.subprocess_handlers[local_rank] = handler
    context._failures.pop(local_rank, None)
    context._running_local_ranks.add(local_rank)
    return handler


WARM_START_NEEDS = {
    "SubprocessHandler._popen(args, env)": lambda: list(_parameters(SubprocessHandler._popen))
    == ["self", "args", "env"],
    "SubprocessHandler(entrypoint, args, env, stdout, stderr, local_rank_id, numa_options)":
        lambda: {"entrypoint", "args", "env", "stdout", "stderr", "local_rank_id"}
        <= set(_parameters(SubprocessHandler.__init__)),
    "SubprocessContext._start / subprocess_handlers": lambda: hasattr(SubprocessContext, "_start"),
    "LocalElasticAgent._setup_local_watchdog(envs)":
        lambda: "envs" in _parameters(LocalElasticAgent._setup_local_watchdog),
    "LocalElasticAgent._setup_healthcheck()":
        lambda: hasattr(LocalElasticAgent, "_setup_healthcheck"),
}


def warm_start_unavailable() -> str | None:
    """What this torch lacks for warm starts (None: everything is there)."""
    missing = [name for name, check in WARM_START_NEEDS.items() if not check()]
    return ", ".join(missing) or None


def subprocess_handler_kwargs(**kwargs: Any) -> dict[str, Any]:
    """Keywords for ``SubprocessHandler.__init__``; ``numa_options`` only where it exists."""
    accepted = _parameters(SubprocessHandler.__init__)
    if "numa_options" not in accepted and kwargs.get("numa_options") is None:
        kwargs.pop("numa_options", None)
    return kwargs


def subprocess_context_kwargs(**kwargs: Any) -> dict[str, Any]:
    """Keywords for ``SubprocessContext.__init__``, without unset ones this torch lacks."""
    accepted = _parameters(SubprocessContext.__init__)
    return {k: v for k, v in kwargs.items() if k in accepted or v not in (None, [], ())}


PREFIX_HAS_HOSTNAME = "hostname=" in inspect.getsource(LocalElasticAgent._start_workers)
"""torch >= 2.14: ``--log-line-prefix-template`` may name ``${hostname}`` too."""


def log_line_prefix(template: str, role: str, rank: int, local_rank: int) -> str:
    """A worker's log line prefix, expanded as this torch's own ``_start_workers`` does."""
    names: dict[str, Any] = {"role_name": role, "rank": rank, "local_rank": local_rank}
    if PREFIX_HAS_HOSTNAME:
        names["hostname"] = socket.gethostname()
    return Template(template).safe_substitute(**names)


def numa_options_of(context: Any) -> Any:
    return getattr(context, "_numa_options", None)


def replace_stderr_tail(context: Any, make: Callable[..., Any]) -> Any:
    """Replaces the ``TailLog`` copying a process context's teed stderr to the console by
    ``make(name, log_files, dst, log_line_prefixes)``, which it returns."""
    old = context._tail_logs[1]
    context._tail_logs[1] = make(old._name, old._log_files, old._dst, old._log_line_prefixes)
    return context._tail_logs[1]


# ------------------------------------------------------------------------------------------------
# Rendezvous and checkpoint internals.

def agent_hosts_worker_store(handler: Any, nodes: int | None) -> bool:
    """Whether elasticft's agent hosts the workers' ``env://`` store each round, not the
    rendezvous handler. The handler hosts one where it shares its own (``use_agent_store``),
    except torch's static rendezvous of one node: one store for every round, which its workers
    of every attempt would meet in (the other handlers make a store, or a prefix, a round;
    across nodes a static rendezvous cannot restart together at all: a node that restarts meets
    no new round of the others). Where it shares none (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``,
    elasticft's default) it only names a free port for the workers' rank 0 to bind, which any
    process of the machine can take meanwhile (``EADDRINUSE``)."""
    if not getattr(handler, "use_agent_store", False):
        return True
    return bool(handler.get_backend() == "static") and nodes == 1


def workers_share_one_store(worker_group: Any) -> bool:
    """Whether every round's workers meet in the rendezvous handler's one shared store
    (``share_tcp_store``), which keeps the old rounds' keys, rather than in a store of the
    round's own (:func:`agent_hosts_worker_store`)."""
    return not agent_hosts_worker_store(worker_group.spec.rdzv_handler,
                                        worker_group.group_world_size)


def rendezvous_round(handler: Any, default: int) -> int:
    """The round ``handler`` last completed (``default`` if it has none).

    elasticft's etcd-v3 handler says so itself (``round``, -1 before its first); torch's
    dynamic handler (c10d) keeps it in its private state.
    """
    own = getattr(handler, "round", None)
    if isinstance(own, int) and not isinstance(own, bool):
        return own if own >= 0 else default
    state = getattr(getattr(handler, "_state_holder", None), "state", None)
    return getattr(state, "round", default)


def stop_rendezvous_heartbeats(handler: Any) -> bool:
    """This node leaves the rendezvous without closing it for everyone: elasticft's etcd-v3
    handler withdraws its records (``leave()``); torch's dynamic handler stops its keep-alives,
    so the others drop the node after the keep-alive timeout."""
    leave = getattr(handler, "leave", None)
    stop = leave if callable(leave) else getattr(handler, "_stop_heartbeats", None)
    if not callable(stop):
        return False
    stop()
    return True


def bootstrap_store_info(
    rank: int, store: Any, local_addr: str | None, server_port: int | None = None
) -> RendezvousStoreInfo:
    """The workers' ``MASTER_ADDR``/``MASTER_PORT`` for a round, agreed through ``store`` (rank
    0 publishes its address and a free port, or ``server_port``), as torch's own handlers do."""
    return RendezvousStoreInfo.build(rank, store, local_addr=local_addr, server_port=server_port)


def serve_store(addr: str) -> Any:
    """A TCPStore server of this process on a port the system picks, bound from the start (a
    port only chosen, to be bound later, can be taken meanwhile), for any number of clients."""
    return torch.distributed.TCPStore(addr, 0, is_master=True, multi_tenant=True,
                                      wait_for_workers=False)


def host_worker_store(rank: int, addr: str, store: Any) -> tuple[RendezvousStoreInfo, Any]:
    """A round's store for the workers: node rank 0 starts it (:func:`serve_store`) and
    publishes its address through ``store`` (:func:`bootstrap_store_info`), the others read
    it; returns the address and the store started here (None elsewhere)."""
    hosted = serve_store(addr) if rank == 0 else None
    info = bootstrap_store_info(rank, store, addr, hosted.port if hosted else None)
    return info, hosted


def dcp_storage_info(relative_path: str, offset: int, length: int) -> Any:
    """DCP's per-item storage record (``_StorageInfo``) for a byte range of one file."""
    return __getattr__("dcp_filesystem")._StorageInfo(relative_path, offset, length)


def __getattr__(name: str) -> Any:
    """``dcp_filesystem`` (torch's DCP file storage) on first use: importing it pulls in
    ``torch.distributed.checkpoint`` and ``torch.distributed.tensor``, over a second of CPU that
    an agent, which only reads DCP records when it persists a checkpoint, needs at no launch."""
    if name == "dcp_filesystem":
        from torch.distributed.checkpoint import filesystem

        return filesystem
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
