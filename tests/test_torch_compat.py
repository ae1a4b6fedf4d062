"""The installed torch against what elasticft assumes of its private launcher API, and each
choice elasticft makes between torch releases, exercised on real torch objects.

Run on other torch releases by scripts/compat.sh (the ``smoke`` marker): a release that changes
one of the pieces fails here, with the piece's name.
"""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes

from elasticft import run, torch_compat, torch_contracts
from elasticft.agent.agent import ElasticftAgent
from elasticft.config import ElasticftConfig
from elasticft.events import EventLog

pytestmark = pytest.mark.smoke


@pytest.mark.parametrize("api", sorted(torch_contracts.CONTRACTS))
def test_torch_still_has(api: str) -> None:
    try:
        ok = torch_contracts.CONTRACTS[api]()
    except Exception as e:  # the piece is gone or moved: say which one
        pytest.fail(f"torch {torch.__version__} changed {api}: {type(e).__name__}: {e}")
    assert ok, f"torch {torch.__version__} changed {api}; update elasticft/torch_compat.py"


def test_every_private_attribute_of_torch_s_agent_that_elasticft_uses_has_a_contract() -> None:
    """The agent and its warm start use the instance attributes torch's agent keeps: each name
    of one in the package is in CONTRACTS, so a torch that renames it fails there, by name."""
    import re

    import elasticft

    agent, _, _ = torch_contracts._fresh_agent()
    used: set[str] = set()
    for module in Path(elasticft.__file__).parent.rglob("*.py"):
        used |= set(re.findall(r"self\.(_\w+)", module.read_text())) & vars(agent).keys()
    assert {"_pcontext", "_worker_group", "_remaining_restarts", "_logs_specs"} <= used
    named = " ".join(torch_contracts.CONTRACTS)
    assert not [a for a in sorted(used) if f"LocalElasticAgent.{a} " not in named]


@pytest.mark.parametrize("attribute", ["_pcontext", "_worker_group", "_remaining_restarts",
                                       "_logs_specs", "_store"])
def test_an_agent_attribute_torch_drops_fails_its_contract(
        monkeypatch: pytest.MonkeyPatch, attribute: str) -> None:
    agent, _, _ = torch_contracts._fresh_agent()
    monkeypatch.delattr(agent, attribute)
    [contract] = [c for name, c in torch_contracts.CONTRACTS.items()
                  if name.startswith(f"LocalElasticAgent.{attribute} ")]
    assert not contract()


def test_a_patched_function_torch_no_longer_calls_by_name_fails_its_contract(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.checkpoint.state_dict as torch_state_dict

    [name] = [n for n in torch_contracts.CONTRACTS if "_init_optim_state" in n]
    assert torch_contracts.CONTRACTS[name]()
    monkeypatch.setattr(torch_compat.inspect, "getsource", lambda obj: "")
    monkeypatch.setattr(torch_state_dict, "_init_optim_state", lambda optim: None)
    assert not torch_contracts.CONTRACTS[name]()
    monkeypatch.delattr(torch_state_dict, "_init_optim_state")
    with pytest.raises(AttributeError):
        torch_contracts.CONTRACTS[name]()


@pytest.mark.parametrize(
    ("version", "refused"),
    [
        ("2.9.1", True),
        ("2.9.0+cu121", True),
        ("1.13.1", True),
        ("2.10.0", False),
        ("2.10.0+cu128", False),
        ("2.11.0a0+git1234", False),
        ("2.13.0+cpu", False),
        ("2.15.0", False),
        ("3.0.0.dev20270101", False),
        ("not-a-version", True),
    ],
)
def test_torch_version_range(version: str, refused: bool) -> None:
    problem = run.torch_version_problem(version)
    assert (problem is not None) == refused, problem
    if refused:
        assert "\n" not in problem and "2.10" in problem and version in problem


def test_below_the_range_elasticft_run_stops_before_anything(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import elasticft.launcher

    def must_not_launch(*args, **kwargs):
        raise AssertionError("launched on an unsupported torch")

    monkeypatch.setattr(run, "installed_torch_version", lambda: "2.9.1")
    monkeypatch.setattr(run, "build_parser", must_not_launch)
    monkeypatch.setattr(elasticft.launcher, "launch", must_not_launch)
    code = run.main(["--standalone", "--nproc-per-node", "1", str(tmp_path / "train.py")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.count("\n") == 0, err
    assert "torch 2.9.1" in err and "torch >= 2.10" in err


def test_the_version_check_needs_nothing_from_torch_s_launcher() -> None:
    """On a torch below the range the private API may not even import: elasticft-run must get
    to its version check without it."""
    code = ("import sys, elasticft.run; "
            "print(sorted(m for m in sys.modules if m.startswith(('torch', 'elasticft.torch_c'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_shutdown_timeout_reaches_the_launch_config_on_this_torch(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    monkeypatch.delenv(torch_compat.SHUTDOWN_TIMEOUT_ENV, raising=False)
    parser = run.build_parser()
    # A log directory of the test's own: torch's config would make a new /tmp/torchelastic_*.
    logs = ["--log-dir", str(tmp_path / "logs")]
    given = parser.parse_args(["--shutdown-timeout", "7", "--standalone", *logs, str(script)])
    config, _, _ = torch_compat.config_from_args(given)
    assert torch_compat.shutdown_timeout_of(config) == 7
    monkeypatch.setenv(torch_compat.SHUTDOWN_TIMEOUT_ENV, "9")
    default = run.build_parser().parse_args(["--standalone", *logs, str(script)])
    config, _, _ = torch_compat.config_from_args(default)
    assert torch_compat.shutdown_timeout_of(config) == 9


def test_a_negative_shutdown_timeout_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    code = run.main(["--shutdown-timeout", "-1", "--standalone", str(script)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "shutdown_timeout must be non-negative" in err[0], err


def test_a_torch_without_the_flag_gets_elasticft_s(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_compat, "PARSER_HAS_SHUTDOWN_TIMEOUT", False)
    parser = argparse.ArgumentParser()
    torch_compat.add_missing_launcher_flags(parser)
    assert parser.parse_args(["--shutdown_timeout", "4"]).shutdown_timeout == 4
    assert parser.parse_args([]).shutdown_timeout is None


@pytest.mark.parametrize(
    ("argv", "environ", "expected"),
    [
        ([], {}, None),  # torch 2.10/2.11's 29500 is no longer a port the user named
        (["--master-port", "29500"], {}, 29500),
        (["--master_port", "1234"], {}, 1234),
        ([], {"PET_MASTER_PORT": "4321"}, 4321),
    ],
)
def test_master_port_is_none_unless_given_on_every_torch(
    argv: list[str], environ: dict[str, str], expected: int | None,
) -> None:
    # torch 2.10 and 2.11's parser: the port defaults to 29500 (or PET_MASTER_PORT).
    parser = argparse.ArgumentParser()
    parser.add_argument("--master-port", "--master_port", type=int,
                        default=int(environ.get("PET_MASTER_PORT", 29500)))
    torch_compat.no_default_master_port(parser, environ)
    assert parser.parse_args(argv).master_port == expected


def test_this_torchs_launcher_names_no_port_unless_given() -> None:
    from elasticft import run

    assert run.build_parser().parse_args(["train.py"]).master_port is None


def test_worker_spec_drops_unset_options_and_refuses_set_ones_this_torch_lacks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lacking = torch_compat.WORKER_SPEC_FIELDS - {"virtual_local_rank"}
    monkeypatch.setattr(torch_compat, "WORKER_SPEC_FIELDS", lacking)
    common = dict(role="r", local_world_size=1, entrypoint="python", args=(),
                  rdzv_handler=None)
    spec = torch_compat.worker_spec(**common, virtual_local_rank=False)
    assert spec.role == "r"
    with pytest.raises(ValueError, match="virtual-local-rank needs a newer torch"):
        torch_compat.worker_spec(**common, virtual_local_rank=True)


def _agent(tmp_path: Path, shutdown_timeout: int) -> ElasticftAgent:
    spec = torch_compat.worker_spec(role="r", local_world_size=1, entrypoint=sys.executable,
                                    args=(), rdzv_handler=None)
    return ElasticftAgent(
        spec, DefaultLogsSpecs(log_dir=str(tmp_path / "logs")), options=ElasticftConfig(),
        events=EventLog(tmp_path, "n"), node_id="n", run_dir=tmp_path,
        shutdown_timeout=shutdown_timeout,
    )


# Where torch's _shutdown takes a timeout both ways are tested; elsewhere only elasticft's exists.
@pytest.mark.parametrize("torch_takes_timeout",
                         [False, *([True] if torch_compat.AGENT_SHUTDOWN_TAKES_TIMEOUT else [])])
@pytest.mark.timeout(60)
def test_shutdown_timeout_bounds_a_worker_that_ignores_sigterm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, torch_takes_timeout: bool
) -> None:
    """Both ways of applying the timeout (torch's ``_shutdown(timeout=)`` where it has one,
    elasticft closing the workers first where not) stop a worker that ignores SIGTERM after the
    agent's timeout, not after torch's built-in 30 s."""
    monkeypatch.setattr(torch_compat, "AGENT_SHUTDOWN_TAKES_TIMEOUT", torch_takes_timeout)
    agent = _agent(tmp_path, shutdown_timeout=1)
    ready = tmp_path / "ready"
    code = ("import signal, time, pathlib; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            f"pathlib.Path({str(ready)!r}).touch(); time.sleep(120)")
    agent._pcontext = start_processes(
        name="stubborn", entrypoint=sys.executable, args={0: ("-c", code)}, envs={0: {}},
        logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "pc"), redirects=Std.NONE),
    )
    worker = psutil.Process(agent._pcontext.pids()[0])
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert time.monotonic() < deadline, "the worker never started"
        time.sleep(0.05)
    context = agent._pcontext
    closed_with: list[float | None] = []
    close = context.close

    def close_and_note(death_sig: signal.Signals | None = None, timeout: float = 30) -> None:
        closed_with.append(timeout)
        close(death_sig, timeout)

    monkeypatch.setattr(context, "close", close_and_note)
    agent._shutdown()  # as torch's run() calls it on torch < 2.12: no timeout given
    assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE
    # The worker that ignored SIGTERM was killed after the agent's 1 s, not torch's 30 s.
    assert closed_with[0] == 1, closed_with


def test_survivor_hook_needs_all_its_parts(caplog: pytest.LogCaptureFixture,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    class Partial(torch_compat.SubprocessContext):
        def __init__(self) -> None:  # no torch state: _running_local_ranks is missing
            pass

    monkeypatch.setattr(torch_compat, "_said", set())
    with caplog.at_level(logging.WARNING, logger="elasticft.torch_compat"):
        assert not torch_compat.can_hook_survivor_stop(Partial())
        assert not torch_compat.can_hook_survivor_stop(Partial())
        assert not torch_compat.can_hook_survivor_stop(object())
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "_running_local_ranks" in warnings[0], warnings


def test_warm_start_says_what_torch_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    assert torch_compat.warm_start_unavailable() is None
    monkeypatch.setitem(torch_compat.WARM_START_NEEDS, "SubprocessHandler._gone", lambda: False)
    assert torch_compat.warm_start_unavailable() == "SubprocessHandler._gone"


def test_elasticft_run_help_works_on_this_torch() -> None:
    out = subprocess.run([sys.executable, "-m", "elasticft.run", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--shutdown-timeout" in out.stdout and "--rdzv-backend" in out.stdout


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_warm_started_workers_get_torch_s_log_line_prefix(tmp_path: Path) -> None:
    """elasticft-run forks workers itself (warm start) and expands the prefix template the way
    this torch's own launcher does, ``${hostname}`` included where torch knows it."""
    from tests.conftest import BIN, clean_job_env

    script = tmp_path / "hello.py"
    # One write per line: with PYTHONUNBUFFERED, print() writes the text and the newline apart,
    # and torch's log tailer, reading between them, prints the half line with a prefix of its
    # own (either launcher).
    script.write_text("import os, sys\nsys.stdout.write(f\"hello from {os.environ['RANK']}\\n\")\n")
    env = {**clean_job_env(),
           "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "<${hostname}|${role_name}|${rank}> "}
    lines = {}
    for tool in ("torchrun", "elasticft-run"):
        done = subprocess.run([str(BIN / tool), "--standalone", "--nproc-per-node", "2",
                               "--log-dir", str(tmp_path / f"logs-{tool}"),
                               "--tee", "3", str(script)], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=150)
        assert done.returncode == 0, done.stderr[-3000:]
        lines[tool] = sorted(line for line in done.stdout.splitlines() if "hello from" in line)
    assert len(lines["torchrun"]) == 2 and lines["torchrun"][0].startswith("<"), lines
    assert lines["elasticft-run"] == lines["torchrun"]


def test_the_rendezvous_events_name_the_method_as_torch_did() -> None:
    """torch_compat's frame read gives the name torch's inspect.stack() gave, at any depth."""
    assert torch_compat.TORCH_METHOD_NAME is not None

    def record(depth: int) -> tuple[str, str]:
        return (torch_compat.TORCH_METHOD_NAME(depth),
                torch_compat.calling_method_name(depth))

    def join_rendezvous(depth: int) -> tuple[str, str]:
        return record(depth)

    for depth in (0, 1, 2, 3):
        torchs, ours = join_rendezvous(depth)
        assert ours == torchs or (depth == 0 and (torchs, ours) == (
            "get_method_name", "calling_method_name")), depth
    assert join_rendezvous(2)[1] == "join_rendezvous"
    assert torch_compat.calling_method_name(10_000) == "no_method_name"
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    assert dynamic_rendezvous.get_method_name is torch_compat.calling_method_name
