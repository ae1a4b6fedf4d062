"""``elasticft-run``: torchrun's command line, elasticft's agent.

The parser is torch's own (``torch.distributed.run.get_args_parser``), so every torchrun flag and
``PET_*`` variable keeps its meaning; elasticft adds its options to it (:mod:`elasticft.config`).
``main(argv) -> parser -> options -> torch's config_from_args -> launch``. A mistake in the
command line, the environment or the YAML file is reported in one line with exit code 2, before
anything starts. So is a torch below the supported range (:data:`TORCH_MIN`): that check comes
first, before anything from torch's launcher is imported.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import logging
import os
import re
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from elasticft import command_line, home, logs, procs, slurm
from elasticft import options as elasticft_options
from elasticft.config import ConfigError, ElasticftConfig, require_writable_dir, run_dir_default

PROG = "elasticft-run"
USAGE_ERROR = 2
TORCH_MIN = (2, 10)
"""The oldest torch elasticft runs on (docs/compat.md); newer releases are accepted."""
TORCH_RANGE = f"torch >= {TORCH_MIN[0]}.{TORCH_MIN[1]} (tested 2.10 to 2.15)"


class UsageError(Exception):
    """A mistake in what the user gave us; printed as one line, exit code 2."""


def torch_version_problem(version: str) -> str | None:
    """Why elasticft cannot run on torch ``version`` (None: it can). Pure, for any version text."""
    found = re.match(r"(\d+)\.(\d+)", version.strip())
    if found is None:
        return f"cannot read the torch version {version!r}; elasticft needs {TORCH_RANGE}"
    major_minor = (int(found[1]), int(found[2]))
    if major_minor < TORCH_MIN:
        return (f"torch {version} is older than elasticft supports ({TORCH_RANGE}); "
                f"install a newer torch, e.g. pip install 'torch>={TORCH_MIN[0]}.{TORCH_MIN[1]}'")
    return None


def installed_torch_version() -> str:
    import torch

    return str(torch.__version__)


def build_parser() -> argparse.ArgumentParser:
    from elasticft import torch_compat

    parser = torch_compat.get_args_parser()
    torch_compat.add_missing_launcher_flags(parser)
    torch_compat.no_default_master_port(parser)
    parser.prog = PROG
    parser.description = (
        "Fault-tolerant drop-in for torchrun: same flags and PET_* variables, plus elasticft's "
        "options below (flags, ELASTICFT_* variables or --config FILE.yaml)."
    )
    elasticft_options.add_options(parser)

    def one_line_error(message: str) -> NoReturn:
        raise UsageError(f"{message} (see {PROG} --help)")

    parser.error = one_line_error  # type: ignore[method-assign]
    return parser


def _check_entrypoint(args: argparse.Namespace) -> None:
    script = args.training_script
    if args.no_python:
        if shutil.which(script) is None and not os.path.isfile(script):
            raise UsageError(f"program {script!r} not found; give an executable on PATH or a path")
        return
    if args.module:
        try:
            found = importlib.util.find_spec(script) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise UsageError(f"module {script!r} not found; check the name and PYTHONPATH")
        return
    if not os.path.isfile(script):
        raise UsageError(
            f"training script {script!r} not found; give the path of a Python file "
            "(or -m for a module)"
        )


def _apply_torchrun_defaults(args: argparse.Namespace) -> None:
    """torchrun's own fix-ups: --standalone and single-node static become local c10d.

    Unlike torchrun, such a launch keeps the user's --rdzv-id, and without one gets the id of
    what it launches instead of a random one: a relaunch is the same job, in the same run
    directory, and resumes from its checkpoints (:mod:`elasticft.home`)."""
    from elasticft.torch_compat import parse_min_max_nnodes

    single_node = args.standalone
    if not args.standalone and args.rdzv_backend == "static" and not args.rdzv_endpoint \
            and args.master_port is None:
        single_node = parse_min_max_nnodes(args.nnodes)[1] == 1
    if single_node:
        args.rdzv_backend = "c10d"
        args.rdzv_endpoint = "localhost:0"
        if str(args.rdzv_id or "").strip() in home.UNGIVEN_IDS:
            min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes)
            args.rdzv_id = home.launched_run_id(
                args.training_script, args.module, args.no_python, f"{min_nodes}:{max_nodes}",
                str(args.nproc_per_node))
    if args.master_port is None:
        args.master_port = 29500


def _logs_in_run_dir(args: argparse.Namespace, options: ElasticftConfig
                     ) -> tuple[ElasticftConfig, list[Path]]:
    """Without --log-dir, torch writes the workers' log files to a new /tmp/torchelastic_*
    directory that nobody removes; elasticft writes them to ``<run-dir>/logs`` instead, with the
    rest of the run's files. Returns the options and the directories this created (removed
    again if the command line turns out to be unusable)."""
    if args.log_dir:
        return options, []
    run_dir = run_dir_default(options.agent.run_dir, None, str(args.rdzv_id))
    logs = run_dir / "logs"
    created = []
    for path in (logs, *logs.parents):
        if path.exists():
            break
        created.append(path)
    try:
        require_writable_dir("--run-dir", run_dir, mode=0o700)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    args.log_dir = str(logs)
    options = dataclasses.replace(options, agent=dataclasses.replace(options.agent,
                                                                     run_dir=run_dir))
    return options, created


def _remove_empty(directories: Sequence[Path]) -> None:
    for directory in directories:  # deepest first
        with contextlib.suppress(OSError):
            directory.rmdir()


def _check_extras(args: argparse.Namespace, options: ElasticftConfig) -> None:
    """Every optional package the run will need is installed (one line naming the extra if not,
    before anything starts; never a traceback from deep inside, nor a feature quietly off)."""
    from elasticft import extras

    try:
        if args.rdzv_backend == "etcd-v3":
            extras.require_etcd()
        diag = options.diag
        if diag.diag_enabled and diag.hang_stacks:
            from elasticft.diag.stacks import py_spy_path

            if py_spy_path() is None:
                raise extras.MissingExtra("the stacks of hung workers", "py-spy", "diag",
                                          "or --diag-enabled false")
        if diag.diag_enabled:
            from elasticft.diag.health import gpu_devices_present

            if gpu_devices_present():
                extras.require(extras.NVML, "GPU health checks on this GPU node", "gpu",
                               "or --diag-enabled false")
    except extras.MissingExtra as e:
        raise UsageError(str(e)) from None


def _slurm_allocation(options: ElasticftConfig) -> slurm.SlurmEnv | None:
    """The Slurm allocation whose nodes fill the flags the user left out (see elasticft.slurm)."""
    try:
        allocation = slurm.detect(options.slurm, os.environ)
        return allocation
    except ConfigError as e:
        raise UsageError(str(e)) from None


def parse(argv: Sequence[str] | None) -> tuple[argparse.Namespace, ElasticftConfig]:
    """The launcher's arguments and elasticft's options; everything after the script is the
    script's, verbatim (:mod:`elasticft.command_line`)."""
    args, options, _ = _parse(argv)
    return args, options


def _parse(argv: Sequence[str] | None
           ) -> tuple[argparse.Namespace, ElasticftConfig, list[str]]:
    """:func:`parse`, and the option strings given before the script."""
    from elasticft.agent.agent import WORKER_ENV_NAMES

    parser = build_parser()
    line = command_line.split(parser, sys.argv[1:] if argv is None else argv)
    args = command_line.parse_args(parser, line)
    try:
        options = elasticft_options.from_namespace(args, os.environ)
        elasticft_options.check_unknown_env(os.environ, set(WORKER_ENV_NAMES))
    except ConfigError as e:
        raise UsageError(str(e)) from None
    if not args.training_script:
        raise UsageError("no training script given; usage: elasticft-run [options] script.py ...")
    _check_entrypoint(args)
    return args, options, line.given


def _torch_launch_config(args: argparse.Namespace) -> tuple[Any, Any, list[str]]:
    """torch's LaunchConfig, command and arguments for ``args``; a usage error if unusable."""
    from elasticft.torch_compat import config_from_args, determine_local_world_size

    try:
        workers_per_node = determine_local_world_size(args.nproc_per_node)
    except ValueError as e:
        raise UsageError(f"--nproc-per-node: {e}; use a number, cpu, gpu or auto") from None
    if workers_per_node < 1:
        raise UsageError(f"--nproc-per-node {args.nproc_per_node}: a node needs at least "
                         "one worker")
    try:
        return config_from_args(args)
    except (ValueError, RuntimeError, AssertionError) as e:
        # torch checks --nnodes, --max-restarts and the like with bare assertions.
        message = str(e).splitlines()[0] if str(e) else "inconsistent launch options"
        raise UsageError(f"{message}; see elasticft-run --help") from None


def main(argv: Sequence[str] | None = None, *,
         tune: Callable[[ElasticftConfig], ElasticftConfig] | None = None) -> int:
    """``elasticft-run``. ``tune`` lets a launcher built on this one (a custom agent, a test)
    set tuning constants, which no flag, variable or YAML key reaches, on the parsed options."""
    # Before torch is imported (seconds, a minute from a shared file system): a Slurm
    # time-limit signal that comes meanwhile is kept for the handler, not the end of the job.
    slurm.hold_time_limit_signals(os.environ)
    try:
        return _main(argv, tune)
    finally:
        slurm.release_held_signals()  # nothing took the hold over (no Slurm add-on)


def _main(argv: Sequence[str] | None,
          tune: Callable[[ElasticftConfig], ElasticftConfig] | None) -> int:
    if argv is None:  # the console script
        procs.skip_final_collection()
    logs.configure(os.environ.get("LOGLEVEL", "INFO"))
    # Parsing imports torch's launcher and the agent's modules: seconds of CPU, no garbage.
    with procs.no_collection_while_importing():
        problem = torch_version_problem(installed_torch_version())
        if problem is not None:
            print(f"{PROG}: error: {problem}", file=sys.stderr)
            return USAGE_ERROR
        created: list[Path] = []
        try:
            args, options, given = _parse(argv)
            if tune is not None:
                options = tune(options)
            allocation = _slurm_allocation(options)
            if allocation is not None:
                slurm.node_defaults(args, given, os.environ, allocation)
            _apply_torchrun_defaults(args)
            if allocation is not None:
                slurm.run_id_default(args, given, os.environ, allocation)
            _check_extras(args, options)
            options, created = _logs_in_run_dir(args, options)
            torch_run_logger = logging.getLogger("torch.distributed.run")
            level = torch_run_logger.level
            # Its INFO lines ("Using nproc_per_node=...") would precede our one-line errors.
            torch_run_logger.setLevel(logging.WARNING)
            try:
                launch_config, cmd, cmd_args = _torch_launch_config(args)
            finally:
                torch_run_logger.setLevel(level)
        except UsageError as e:
            print(f"{PROG}: error: {e}", file=sys.stderr)
            _remove_empty(created)
            return USAGE_ERROR

        from elasticft.launcher import launch

    try:
        # launch() builds the default add-ons, as it does for any caller of the Python API.
        result = launch(launch_config, cmd, cmd_args, options)
    except ConfigError as e:  # an option an add-on cannot use, a bad --rdzv-conf value...
        print(f"{PROG}: error: {e}", file=sys.stderr)
        _remove_empty(created)
        return USAGE_ERROR
    print(result.summary(), file=sys.stderr)
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
