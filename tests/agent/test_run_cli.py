"""elasticft-run's answer to bad input: one line naming the problem and the fix, exit code 2,
and nothing started.

Each bad input goes to its own elasticft-run process in its own directory and environment. A few
run the installed console script (:data:`REAL_BINARY`); the others are forked from one
interpreter that imported torch once (``forked_cli.py``), which calls the same entry point the
way the script does: a refusal comes before anything starts, so nothing but the ~2 s torch
import differs, and that is paid once.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elasticft.ckpt.memory import shm
from tests.conftest import BIN, EXAMPLES, ROOT, clean_job_env

pytestmark = pytest.mark.slow  # the answers fixture: four interpreters that import torch
SCRIPT = str(EXAMPLES / "train_plain.py")

# name -> (arguments, with {dir} for its directory; extra environment; files written in
# its directory first)
BAD_INPUTS: dict[str, tuple[list[str], dict[str, str], dict[str, str]]] = {
    "unknown_flag": (["--standalone", "--nprocs-per-host", "2", SCRIPT], {}, {}),
    "malformed_yaml": (["--standalone", "--config", "{dir}/bad.yaml", SCRIPT], {},
                       {"bad.yaml": "ckpt: {keep: 1\n"}),
    "wrong_typed_yaml": (["--standalone", "--config", "{dir}/typed.yaml", SCRIPT], {},
                         {"typed.yaml": "restart_on_user_error: often\n"}),
    "bad_elasticft_env": (["--standalone", SCRIPT], {"ELASTICFT_RESTART_ON_USER_ERROR": "-3"},
                          {}),
    "bad_torchrun_env": (["--standalone", SCRIPT], {"PET_MAX_RESTARTS": "lots"}, {}),
    "removed_option_env": (["--standalone", SCRIPT], {"ELASTICFT_LAYOUT_TP": "2"}, {}),
    "old_style_yaml_key": (["--standalone", "--config", "{dir}/old.yaml", SCRIPT], {},
                           {"old.yaml": "ckpt:\n  ckpt_dir: /x\n"}),
    "bad_nproc": (["--standalone", "--nproc-per-node", "two", SCRIPT], {}, {}),
    "missing_script": (["--standalone", "no_such_train.py"], {}, {}),
    "zero_nproc": (["--standalone", "--nproc-per-node", "0", SCRIPT], {}, {}),
    "inverted_nnodes": (["--nnodes", "3:2", SCRIPT], {}, {}),
    "negative_restarts": (["--standalone", "--max-restarts", "-1", SCRIPT], {}, {}),
    "unwritable_run_dir": (["--standalone", "--run-dir", "/proc/elasticft-run", SCRIPT], {},
                           {}),
    "unwritable_ckpt_dir": (["--standalone", "--ckpt-dir", "/proc/elasticft-ckpt", SCRIPT], {},
                            {}),
    "help": (["--help"], {}, {}),
}


REAL_BINARY = {"unknown_flag", "bad_elasticft_env", "help"}
"""The cases that run the installed ``elasticft-run`` script itself, in a new interpreter."""
ANSWER_DEADLINE_S = 420.0


@pytest.fixture(scope="module")
def answers(tmp_path_factory: pytest.TempPathFactory
            ) -> dict[str, tuple[subprocess.CompletedProcess[str], Path]]:
    """Each bad input's finished elasticft-run, with the directory it ran in."""
    running: dict[str, tuple[subprocess.Popen[str], Path]] = {}
    # What a SIGKILLed agent leaves in shared memory, for a start to sweep: a bad input must
    # still answer in one line (the sweep comes after every usage error).
    gone = subprocess.Popen(["true"])
    gone.wait()
    leftover = shm.SHM_DIR / f"{shm.NAME_PREFIX}-{gone.pid}-cli-test-l0-s0"
    leftover.write_bytes(b"")
    forked: list[dict] = []
    streams = tmp_path_factory.mktemp("forked")  # the forked cases' stdout and stderr
    try:
        for name, (args, extra_env, files) in BAD_INPUTS.items():
            cwd = tmp_path_factory.mktemp(name)
            for file, text in files.items():
                (cwd / file).write_text(text)
            argv = [a.replace("{dir}", str(cwd)) for a in args]
            env = {**clean_job_env(), **extra_env}
            if name in REAL_BINARY:
                running[name] = (subprocess.Popen(
                    [str(BIN / "elasticft-run"), *argv], env=env, cwd=cwd,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), cwd)
            else:
                forked.append({"name": name, "argv": argv, "env": env, "cwd": str(cwd),
                               "stdout": str(streams / f"{name}.out"),
                               "stderr": str(streams / f"{name}.err")})
        cases = streams / "cases.json"
        cases.write_text(json.dumps(forked))
        running["forked"] = (subprocess.Popen(
            [sys.executable, "-m", "tests.agent.forked_cli", str(cases)], env=clean_job_env(),
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
            cases.parent)
        # One deadline for all: torch imports at once on two loaded cores take minutes.
        deadline = time.monotonic() + ANSWER_DEADLINE_S
        done = {}
        for name, (proc, cwd) in running.items():
            stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            done[name] = (subprocess.CompletedProcess(proc.args, proc.returncode, stdout,
                                                      stderr), cwd)
        parent = done.pop("forked")[0]
        assert parent.returncode == 0, parent.stderr[-3000:]
        codes = json.loads(Path(f"{cases}.codes").read_text())
        for case, code in zip(forked, codes, strict=True):
            done[case["name"]] = (subprocess.CompletedProcess(
                case["argv"], code, Path(case["stdout"]).read_text(),
                Path(case["stderr"]).read_text()), Path(case["cwd"]))
        return done
    finally:
        leftover.unlink(missing_ok=True)
        for proc, _ in running.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def assert_usage_error(answer: tuple[subprocess.CompletedProcess[str], Path], *fragments: str):
    result, cwd = answer
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("elasticft-run: error: ")
    for fragment in fragments:
        assert fragment in lines[0]
    assert result.stdout == ""
    assert not (cwd / "elasticft-runs").exists(), "nothing may start on bad input"


@pytest.mark.timeout(480)
def test_unknown_flag(answers) -> None:
    assert_usage_error(answers["unknown_flag"], "--nprocs-per-host", "--help")


@pytest.mark.timeout(480)
def test_malformed_yaml(answers) -> None:
    assert_usage_error(answers["malformed_yaml"], "bad.yaml", "malformed YAML", "line")


@pytest.mark.timeout(480)
def test_wrong_typed_yaml_value(answers) -> None:
    assert_usage_error(answers["wrong_typed_yaml"], "typed.yaml:restart_on_user_error", "'often'",
                       "whole number")


@pytest.mark.timeout(480)
def test_bad_elasticft_env_value(answers) -> None:
    assert_usage_error(answers["bad_elasticft_env"], "ELASTICFT_RESTART_ON_USER_ERROR",
                       "minimum")


@pytest.mark.timeout(480)
def test_a_removed_option_in_the_env_names_its_replacement(answers) -> None:
    assert_usage_error(answers["removed_option_env"], "ELASTICFT_LAYOUT_TP",
                       "replaced by --layout TP,PP,DP")


@pytest.mark.timeout(480)
def test_an_old_style_yaml_key_names_the_new_one(answers) -> None:
    assert_usage_error(answers["old_style_yaml_key"], "ckpt: {ckpt_dir}", "write ckpt: {dir: ")


@pytest.mark.timeout(480)
def test_bad_torchrun_env_value(answers) -> None:
    assert_usage_error(answers["bad_torchrun_env"], "--max-restarts", "'lots'")


@pytest.mark.timeout(480)
def test_bad_nproc_per_node(answers) -> None:
    assert_usage_error(answers["bad_nproc"], "two")


@pytest.mark.timeout(480)
def test_missing_script(answers) -> None:
    assert_usage_error(answers["missing_script"], "'no_such_train.py' not found", "Python file")


@pytest.mark.timeout(480)
def test_help_documents_every_option(answers) -> None:
    result, _ = answers["help"]
    assert result.returncode == 0
    for text in ("--nproc-per-node", "--rdzv-backend", "--restart-on-user-error",
                 "ELASTICFT_RESTART_ON_USER_ERROR", "--config"):
        assert text in result.stdout


@pytest.mark.timeout(480)
def test_zero_workers_per_node(answers) -> None:
    assert_usage_error(answers["zero_nproc"], "--nproc-per-node 0", "at least one worker")


@pytest.mark.timeout(480)
def test_torch_launch_checks_are_one_line_too(answers) -> None:
    # torch validates these with bare assertions; they must not surface as tracebacks.
    assert_usage_error(answers["inverted_nnodes"], "min_nodes=3, max_nodes=2", "--help")
    assert_usage_error(answers["negative_restarts"], "max_restarts must be >= 0", "--help")


@pytest.mark.timeout(480)
def test_unwritable_run_dir(answers) -> None:
    assert_usage_error(answers["unwritable_run_dir"], "/proc/elasticft-run", "--run-dir")


@pytest.mark.timeout(480)
def test_unwritable_checkpoint_dir(answers) -> None:
    # Otherwise training would run with every persist failing and nothing durable at the end.
    assert_usage_error(answers["unwritable_ckpt_dir"], "--ckpt-dir /proc/elasticft-ckpt",
                       "cannot write")
