"""What elasticft assumes about torch's private API, each piece named with a check of its shape.

:mod:`elasticft.torch_compat` is the one place elasticft touches torch's private or
version-dependent API; this module holds :data:`CONTRACTS`, one entry per private piece that
place (or a subsystem, through it) relies on, with a check that is True on a torch that has it.
tests/test_torch_compat.py runs each, and ``bench/gpu_check.sh`` runs the GPU ones on a GPU, so a
torch that changes one fails there with the name of what changed, not somewhere deep in a run.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import os
import signal
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from elasticft import torch_compat
from elasticft.torch_compat import (
    AGENT_TAKES_SHUTDOWN_TIMEOUT,
    LAUNCH_CONFIG_FIELDS,
    REPLACE_WORKER_PARTS,
    WORKER_SPEC_FIELDS,
    DefaultLogsSpecs,
    DynamicRendezvousHandler,
    LocalElasticAgent,
    LogsSpecs,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
    RendezvousTimeout,
    SignalException,
    Std,
    SubprocessContext,
    WorkerGroup,
    WorkerSpec,
    _parameters,
    dcp_filesystem,
    default_logs_streams,
    macros,
    multiprocessing_api,
    replace_stderr_tail,
    torch_run,
    warm_start_unavailable,
)


def _has(obj: Any, *names: str) -> bool:
    return all(hasattr(obj, name) for name in names)


@functools.cache
def _fresh_agent() -> tuple[LocalElasticAgent, WorkerSpec, LogsSpecs]:
    """A ``LocalElasticAgent`` as constructed, never started, with its spec and logs specs:
    what its private attributes hold before the first rendezvous."""
    spec = WorkerSpec(role="contract", local_world_size=1, rdzv_handler=None,  # type: ignore[arg-type]
                      entrypoint="python", args=(), max_restarts=3)
    logs_specs = DefaultLogsSpecs(os.devnull)
    agent = LocalElasticAgent(spec, logs_specs=logs_specs, log_line_prefix_template="[${rank}]")
    return agent, spec, logs_specs


def _agent_keeps(name: str, expected: Callable[[Any, WorkerSpec, LogsSpecs], bool]) -> bool:
    """A fresh agent has the instance attribute ``name``, and ``expected(value, spec, logs)``."""
    agent, spec, logs_specs = _fresh_agent()
    return name in vars(agent) and expected(vars(agent)[name], spec, logs_specs)


def _called_by_name(module: str, function: str, parameters: list[str]) -> bool:
    """``module`` has ``function(*parameters)`` and calls it through its globals (so that
    replacing the module's attribute replaces the calls)."""
    found = importlib.import_module(module)
    return (list(_parameters(getattr(found, function))) == parameters
            and f"{function}({', '.join(parameters)})" in inspect.getsource(found))


def _reads(cls: type, attribute: str, *methods: str) -> bool:
    """Each of ``cls``'s ``methods`` reads ``self.<attribute>``."""
    return all(f"self.{attribute}" in inspect.getsource(getattr(cls, m)) for m in methods)


def _ddp_buckets_carried() -> bool:
    """DDP's bucket set-up as inprocess/ddp_buckets.py wraps it (the logger's keys, which live
    in C++, are read by a real DDP in tests/inprocess/test_ddp_buckets.py)."""
    from torch.nn.parallel import DistributedDataParallel

    set_up = inspect.getsource(DistributedDataParallel._ddp_init_helper)
    return (list(_parameters(DistributedDataParallel._ddp_init_helper))[:2]
            == ["self", "parameters"]
            and "dist._compute_bucket_assignment_by_size(" in set_up
            and "list(reversed(bucket_indices))" in set_up
            and "list(reversed(per_bucket_size_limits))" in set_up
            and callable(getattr(DistributedDataParallel, "_get_ddp_logging_data", None)))


def _dcp_init_step() -> bool:
    """``get_state_dict`` steps a fresh optimizer once, lr 0, zero grads (steps.is_init_step)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = torch.nn.Linear(1, 1)
    optim, seen = torch.optim.AdamW(model.parameters(), lr=0.5), []
    optim.register_step_pre_hook(lambda o, *_: seen.append((o.param_groups[0]["lr"], all(
        p.grad is not None and not p.grad.any() for p in model.parameters()))))
    get_state_dict(model, optim)
    return seen == [(0.0, True)] and optim.param_groups[0]["lr"] == 0.5


def _mesh_remade_by_name() -> bool:
    """inprocess/meshes.py: a mesh keeps its groups' names and resolves them at each use, so
    groups made again in the same order (torch resets its counter with the default group)
    are found again; a root mesh caches its groups in ``_pg_registry``."""
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.device_mesh import DeviceMesh

    return (list(_parameters(DeviceMesh._init_process_groups))
            == ["layout", "rank_map", "mesh_dim_names", "backend_override"]
            and _reads(DeviceMesh, "_dim_group_names", "get_group")
            and _reads(DeviceMesh, "_layout", "__init__")
            and _reads(DeviceMesh, "_rank_map", "__init__")
            and _reads(DeviceMesh, "_mesh_dim_names", "__init__")
            and _reads(DeviceMesh, "_pg_registry", "__init__")
            and _reads(DeviceMesh, "_flatten_mapping", "__init__")
            and callable(getattr(DeviceMesh, "_get_root_mesh", None))
            and "_world.group_count = 0" in inspect.getsource(c10d.destroy_process_group)
            and "str(_world.group_count)" in inspect.getsource(c10d._process_group_name)
            and callable(getattr(c10d, "_resolve_process_group", None)))


def _fsdp_groups_repointable() -> bool:
    """inprocess/meshes.py: where FSDP2 keeps process groups itself (its mesh infos), how its
    parameter groups and parameters reach them, and its reset after an aborted step."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fsdp_common, _fsdp_param, _fsdp_state
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    def sets(cls: type, *fields: str) -> bool:
        source = inspect.getsource(cls.__post_init__)
        return all(f"self.{field} = " in source or f"self.{field}: " in source
                   for field in fields)

    return (callable(getattr(FSDPModule, "_get_fsdp_state", None))
            and callable(getattr(FSDPModule, "reset_iter_state", None))
            and _reads(_fsdp_state.FSDPState, "_fsdp_param_groups", "__init__")
            and _reads(_fsdp_state.FSDPState, "_is_root", "__init__")
            and _reads(FSDPParamGroup, "mesh_info", "__init__")
            and _reads(FSDPParamGroup, "post_forward_mesh_info", "__init__")
            and _reads(_fsdp_param.FSDPParam, "mesh_info", "_init_sharded_param")
            and _reads(_fsdp_param.FSDPParam, "post_forward_mesh_info", "__init__")
            and _reads(FSDPParamGroup, "fsdp_params", "__init__")
            and sets(_fsdp_common.FSDPMeshInfo, "shard_process_group",
                     "reduce_scatter_process_group")
            and sets(_fsdp_common.DDPMeshInfo, "replicate_process_group")
            and "mesh" in {f.name for f in dataclasses.fields(_fsdp_common.FSDPMeshInfo)})


CONTRACTS: dict[str, Callable[[], bool]] = {
    "torch.distributed.run.get_args_parser() -> argparse parser":
        lambda: hasattr(torch_run.get_args_parser(), "parse_args"),
    "torch.distributed.run.config_from_args(args)":
        lambda: list(_parameters(torch_run.config_from_args)) == ["args"],
    "torch.distributed.run.determine_local_world_size(nproc_per_node)":
        lambda: torch_run.determine_local_world_size("2") == 2,
    "torch.distributed.run.parse_min_max_nnodes(nnodes)":
        lambda: tuple(torch_run.parse_min_max_nnodes("1:3")) == (1, 3),
    "LaunchConfig fields elasticft reads": lambda: {
        "min_nodes", "max_nodes", "nproc_per_node", "logs_specs", "run_id", "role",
        "rdzv_endpoint", "rdzv_backend", "rdzv_configs", "max_restarts", "monitor_interval",
        "start_method", "log_line_prefix_template", "metrics_cfg", "local_addr",
        "event_log_handler", "signals_to_handle"} <= LAUNCH_CONFIG_FIELDS,
    "WorkerSpec(role, local_world_size, entrypoint, args, rdzv_handler, ...)": lambda: {
        "role", "local_world_size", "entrypoint", "args", "rdzv_handler", "max_restarts",
        "monitor_interval", "master_addr", "master_port", "local_addr"} <= WORKER_SPEC_FIELDS,
    "DefaultLogsSpecs(log_dir, redirects, tee, local_ranks_filter) keeps them as _redirects, "
    "_tee, _local_ranks_filter": lambda: default_logs_streams(DefaultLogsSpecs(
        os.devnull, Std.OUT, Std.ERR, {1})) == (os.devnull, Std.OUT, Std.ERR, {1}),
    "LocalElasticAgent(spec, logs_specs, start_method, exit_barrier_timeout, "
    "log_line_prefix_template)": lambda: {
        "spec", "logs_specs", "start_method", "exit_barrier_timeout",
        "log_line_prefix_template"} <= set(_parameters(LocalElasticAgent.__init__)),
    "LocalElasticAgent hooks elasticft overrides or calls": lambda: _has(
        LocalElasticAgent, "_rendezvous", "_set_local_rank_env", "_start_workers",
        "_stop_workers", "_monitor_workers", "_invoke_run", "_initialize_workers",
        "_restart_workers", "_exit_barrier", "_shutdown", "get_event_succeeded"),
    # The agent's own state, read and written by elasticft's agent (agent/agent.py) and its
    # warm start (agent/warmpool.py), which takes over the process context torch would make.
    "LocalElasticAgent._worker_group (a WorkerGroup of the agent's spec)": lambda: _agent_keeps(
        "_worker_group", lambda group, spec, _: isinstance(group, WorkerGroup)
        and group.spec is spec),
    "LocalElasticAgent._remaining_restarts (spec.max_restarts, counted down by the run loop)":
        lambda: _agent_keeps("_remaining_restarts", lambda left, spec, _: left == spec.max_restarts)
        and _reads(LocalElasticAgent, "_remaining_restarts", "_invoke_run"),
    "LocalElasticAgent._pcontext (None until _start_workers sets the workers' process context, "
    "which _monitor_workers and _shutdown use)": lambda: _agent_keeps(
        "_pcontext", lambda context, *_: context is None)
        and _reads(LocalElasticAgent, "_pcontext", "_start_workers", "_monitor_workers",
                   "_shutdown"),
    "LocalElasticAgent._logs_specs (the LogsSpecs it was given)": lambda: _agent_keeps(
        "_logs_specs", lambda kept, _, logs_specs: kept is logs_specs),
    "LocalElasticAgent._log_line_prefix_template (the template it was given)":
        lambda: _agent_keeps("_log_line_prefix_template", lambda kept, *_: kept == "[${rank}]"),
    "LocalElasticAgent._store (the round's store, set by _rendezvous)": lambda: _agent_keeps(
        "_store", lambda store, *_: store is None) and _reads(LocalElasticAgent, "_store",
                                                              "_rendezvous"),
    "LocalElasticAgent._shutdown_timeout (kept where the agent takes one; elasticft sets it on "
    "every torch)": lambda: not AGENT_TAKES_SHUTDOWN_TIMEOUT or _agent_keeps(
        "_shutdown_timeout", lambda timeout, *_: isinstance(timeout, int)),
    "LocalElasticAgent._set_local_rank_env(worker_env, local_rank, spec)":
        lambda: list(_parameters(LocalElasticAgent._set_local_rank_env))
        == ["self", "worker_env", "local_rank", "spec"],
    "LocalElasticAgent._shutdown(death_sig[, timeout])":
        lambda: list(_parameters(LocalElasticAgent._shutdown))[:2] == ["self", "death_sig"],
    "SubprocessContext.close(death_sig, timeout)":
        lambda: list(_parameters(SubprocessContext.close))[:3] == ["self", "death_sig", "timeout"],
    "PContext._tail_logs[1] is TailLog(name, tee_stderrs, sys.stderr, prefixes), kept as _name, "
    "_log_files, _dst, _log_line_prefixes": lambda: "TailLog(name, logs_dest.tee_stderrs, "
        "sys.stderr" in inspect.getsource(multiprocessing_api.PContext.__init__)
        and replace_stderr_tail(SimpleNamespace(_tail_logs=[0, multiprocessing_api.TailLog(
            "n", {}, None, {})]), lambda *a: a) == ("n", {}, None, {}),
    "SubprocessContext survivor hook (_poll, _running_local_ranks, subprocess_handlers)":
        lambda: "_poll" in vars(SubprocessContext) and "_running_local_ranks" in (
            inspect.getsource(SubprocessContext._start) + inspect.getsource(
                SubprocessContext._poll)),
    "LocalElasticAgent._start_workers expands log_line_prefix_template (role_name, rank, ...)":
        lambda: "safe_substitute" in inspect.getsource(LocalElasticAgent._start_workers),
    "warm start (SubprocessHandler._popen, _setup_local_watchdog, ...)":
        lambda: warm_start_unavailable() is None,
    "SubprocessContext parts replacing one worker (in-process recovery)": lambda: all(
        part in inspect.getsource(SubprocessContext) + inspect.getsource(
            torch.distributed.elastic.multiprocessing.api.PContext)
        for part in REPLACE_WORKER_PARTS),
    "torch.distributed.distributed_c10d._abort_process_group(group)": lambda: list(
        _parameters(torch.distributed.distributed_c10d._abort_process_group)) == ["group"],
    # inprocess/groups.py: the default group's abort ends every group and clears torch's table,
    # after which the recovery reads nothing of it (ArmedGroup, destroy_registered).
    "_abort_process_group(WORLD) clears the table (_update_default_pg(None), pg_map.clear())":
        lambda: all(part in inspect.getsource(
            torch.distributed.distributed_c10d._abort_process_group)
            for part in ("_update_default_pg(None)", "pg_map.clear()")),
    # inprocess/groups.py: every group ended from the monitor thread; the script's settings.
    "_get_default_group(), ProcessGroup.abort(), _get_backend(d).options._timeout, "
    "bound_device_id": lambda: _has(torch.distributed.distributed_c10d, "_get_default_group")
        and _has(torch.distributed.ProcessGroup, "abort", "_get_backend", "bound_device_id")
        and hasattr(torch.distributed.ProcessGroupGloo._Options, "_timeout"),
    # inprocess/meshes.py: the sharded modules a survivor keeps through a regroup.
    "DeviceMesh._init_process_groups(layout, rank_map, mesh_dim_names, backend_override), "
    "_dim_group_names, _layout, _rank_map, _mesh_dim_names, _pg_registry, _flatten_mapping, "
    "_get_root_mesh(); _world.group_count reset by destroy_process_group; "
    "_resolve_process_group(name)": _mesh_remade_by_name,
    "FSDPModule._get_fsdp_state(), reset_iter_state(); FSDPState._fsdp_param_groups, _is_root; "
    "FSDPParamGroup.fsdp_params; mesh_info and post_forward_mesh_info of a parameter group and "
    "a parameter; FSDPMeshInfo.shard_process_group, reduce_scatter_process_group; "
    "DDPMeshInfo.replicate_process_group": _fsdp_groups_repointable,
    # torch_compat.calling_method_name takes its place: torch's reads the stack with inspect.
    "dynamic_rendezvous.get_method_name(depth=2) names the caller's caller":
        lambda: torch_compat.TORCH_METHOD_NAME is not None
        and list(_parameters(torch_compat.TORCH_METHOD_NAME)) == ["depth"]
        and "get_method_name()" in inspect.getsource(
            torch_compat.dynamic_rendezvous.DynamicRendezvousHandler._record),
    "SignalException.sigval": lambda: SignalException("x", signal.SIGTERM).sigval
        == signal.SIGTERM,
    "RendezvousHandler abstract methods (the etcd-v3 handler implements them)":
        lambda: set(RendezvousHandler.__abstractmethods__) <= {
            "get_backend", "next_rendezvous", "is_closed", "set_closed", "num_nodes_waiting",
            "get_run_id", "shutdown"},
    "RendezvousHandler.use_agent_store (a property)":
        lambda: isinstance(inspect.getattr_static(RendezvousHandler, "use_agent_store"),
                           property),
    "RendezvousStoreInfo.build(rank, store, local_addr, server_port)":
        lambda: list(_parameters(RendezvousStoreInfo.build))[:4]
        == ["rank", "store", "local_addr", "server_port"],
    "RendezvousInfo(store, rank, world_size, bootstrap_store_info)":
        lambda: list(_parameters(RendezvousInfo.__init__))[1:5]
        == ["store", "rank", "world_size", "bootstrap_store_info"],
    "DynamicRendezvousHandler internals for c10d (_stop_heartbeats, _state_holder)":
        lambda: hasattr(DynamicRendezvousHandler, "_stop_heartbeats") and "_state_holder"
        in inspect.getsource(DynamicRendezvousHandler.__init__),
    "RendezvousTimeout(join, last_call, close, heartbeat)":
        lambda: list(_parameters(RendezvousTimeout.__init__))[1:5]
        == ["join", "last_call", "close", "heartbeat"],
    "torch.distributed.elastic.utils.macros.substitute(args, local_rank)":
        lambda: macros.substitute([macros.local_rank], "3") == ["3"],
    # Read by the worker's recorder (diag/recorder.py), which cannot afford importing this
    # module in every worker: it re-decides its wrapping after each process group is created;
    # wrapped by diag/groupsockets.py, which records the connections each group makes.
    "torch.distributed.distributed_c10d._new_process_group_helper and _world.pg_map":
        lambda: callable(getattr(torch.distributed.distributed_c10d,
                                 "_new_process_group_helper", None))
        and hasattr(torch.distributed.distributed_c10d._world, "pg_map"),
    # Read when a framework's in-process recovery arms (integrations/fit.py): collectives run
    # on the default group before the entry; a backend without the count reads as unknown.
    "torch.distributed.distributed_c10d._get_default_group()._get_sequence_number_for_group":
        lambda: callable(getattr(torch.distributed.distributed_c10d, "_get_default_group", None))
        and hasattr(torch.distributed.ProcessGroup, "_get_sequence_number_for_group"),
    # Replaced for the duration of a save or restore by ckpt/restoring/state.py
    # (optimizer_state_as_is): the state-dict helpers must look it up as a module global when they
    # call it.
    "torch.distributed.checkpoint.state_dict._init_optim_state(optim), called by name":
        lambda: _called_by_name("torch.distributed.checkpoint.state_dict", "_init_optim_state",
                                ["optim"]),
    "torch.distributed.checkpoint.filesystem._StorageInfo(relative_path, offset, length)":
        lambda: [f.name for f in dataclasses.fields(dcp_filesystem._StorageInfo)][:3]
        == ["relative_path", "offset", "length"],
    "Tensor._version counts in-place writes (elasticft.steps.must_read)": lambda: (
        (t := torch.zeros(1))._version + 1 == t.add_(1)._version),
    "DCP get_state_dict's optimizer init step (lr 0, zero grads)": _dcp_init_step,
    # inprocess/ddp_buckets.py: a DDP re-made after an in-process recovery starts with the
    # rebuilt buckets its predecessor's logger reported.
    "DistributedDataParallel._ddp_init_helper(parameters, ...) hands the Reducer "
    "reversed(dist._compute_bucket_assignment_by_size(...)), called by name; "
    "_get_ddp_logging_data()":
        _ddp_buckets_carried,
}
"""What elasticft assumes about torch's private API, by name; each check is True on a torch that
has it (tests/test_torch_compat.py)."""
