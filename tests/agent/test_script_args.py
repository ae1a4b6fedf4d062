"""A training script gets the arguments after it verbatim, whatever they look like, under a real
``elasticft-run`` and under ``elasticft.launch``.

Its arguments are, for every option of the launcher, each form of :func:`script_words` (the
option's name, each of its prefixes, unique or ambiguous, ``--opt=value``, with ``--``). One
launch carries a whole family of options (torchrun's, then elasticft's by section), each with
another way of naming what to run (a script, ``-m`` module, ``--no-python``, ``--``), and
options before it written as torchrun users abbreviate them; ``ELASTICFT_*``, ``PET_*`` and a
``--config`` file are set too and never reach the script. The launches run at once (two cores load
torch for two of them at a time instead of one after the other).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elasticft.options import DEST_PREFIX, option_specs
from tests.agent.test_command_line import launcher, script_words
from tests.conftest import BIN, ROOT, clean_job_env

pytestmark = pytest.mark.slow
PRINT_ARGV = Path(__file__).parent / "workers" / "print_argv.py"
MODULE = "tests.agent.workers.print_argv"
DEADLINE_S = 420.0
SECTION_OF = {DEST_PREFIX + spec.name: spec.section for spec in option_specs()}


def family_of(option: str) -> str:
    dest = launcher()._option_string_actions[option].dest
    if not dest.startswith(DEST_PREFIX):
        return "torchrun"
    return SECTION_OF.get(dest, "agent")  # --config


def family_words(family: str) -> list[str]:
    """The script arguments of one launch: every form of every option of ``family``."""
    words: list[str] = []
    seen: set[tuple[str, ...]] = set()
    for option in launcher()._option_string_actions:
        if family_of(option) != family:
            continue
        for case in script_words(option):
            if tuple(case) not in seen:
                seen.add(tuple(case))
                words += case
    return words


# family -> how the launch names what it runs (the script's arguments follow)
ENTRYPOINTS: dict[str, list[str]] = {
    "torchrun": [str(PRINT_ARGV)],
    "agent": ["-m", MODULE],
    "ckpt": ["--module", MODULE],
    "diag": ["--no-python", sys.executable, "-u", str(PRINT_ARGV)],
    "plan": ["--", str(PRINT_ARGV)],
    "recovery": [str(PRINT_ARGV)],
    "slurm": ["--no-p", sys.executable, str(PRINT_ARGV)],
    "preempt": ["--no-python", sys.executable, str(PRINT_ARGV)],
}
# Before the script, as torchrun users write them: abbreviations torchrun accepts, =value forms.
LAUNCHER_OPTIONS = ["--stand", "--nproc-per=1", "--max-r", "0", "--monitor-i", "0.2", "--no-warm"]
API = "elasticft.launch"


def launch_command(family: str, run_dir: Path, out: Path) -> list[str]:
    if family == API:
        code = f"""
import sys
from torch.distributed.launcher.api import LaunchConfig
from elasticft import ElasticftConfig, launch
from elasticft.config import AgentConfig

config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1, run_id="args",
                      rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0)
options = ElasticftConfig(agent=AgentConfig(run_dir={str(run_dir)!r}))
result = launch(config, sys.executable, ["-u", {str(PRINT_ARGV)!r}, *sys.argv[1:]], options)
print(result.summary(), file=sys.stderr)
sys.exit(result.exit_code)
"""
        return [sys.executable, "-c", code, *expected_words(family)]
    config = out.parent / "config.yaml"
    config.write_text("ckpt:\n  keep: 2\n")
    return [str(BIN / "elasticft-run"), *LAUNCHER_OPTIONS, "--run-dir", str(run_dir),
            "--config", str(config), *ENTRYPOINTS[family], *family_words(family)]


def expected_words(family: str) -> list[str]:
    if family == API:  # everything at once
        return [word for name in ENTRYPOINTS for word in family_words(name)]
    return family_words(family)


@pytest.fixture(scope="module")
def received(tmp_path_factory: pytest.TempPathFactory
             ) -> dict[str, tuple[subprocess.CompletedProcess[str], list[str] | None]]:
    """Each launch, finished, with the arguments its script received (None: it never ran)."""
    running: dict[str, tuple[subprocess.Popen[str], Path]] = {}
    env = {**clean_job_env(), "PYTHONPATH": str(ROOT), "ELASTICFT_CKPT_PERSIST_EVERY": "5",
           "PET_MONITOR_INTERVAL": "0.2"}
    try:
        for family in [*ENTRYPOINTS, API]:
            cwd = tmp_path_factory.mktemp(family.replace(".", "_"))
            out = cwd / "argv.json"
            running[family] = (subprocess.Popen(
                launch_command(family, cwd / "run", out), env={**env, "ARGV_OUT": str(out)},
                cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), out)
        deadline = time.monotonic() + DEADLINE_S
        done = {}
        for family, (proc, out) in running.items():
            stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            done[family] = (subprocess.CompletedProcess(proc.args, proc.returncode, stdout,
                                                        stderr),
                            json.loads(out.read_text()) if out.exists() else None)
        return done
    finally:
        for proc, _ in running.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.timeout(480)
@pytest.mark.parametrize("family", [*ENTRYPOINTS, API])
def test_the_script_receives_its_arguments_verbatim(family: str, received) -> None:
    result, argv = received[family]
    assert result.returncode == 0, result.stderr[-5000:]
    expected = expected_words(family)
    assert argv is not None, result.stderr[-5000:]
    pairs = enumerate(zip(argv, expected, strict=False))
    first_difference = next((i for i, (got, want) in pairs if got != want),
                            min(len(argv), len(expected)))
    assert argv == expected, (f"from word {first_difference}: got "
                              f"{argv[first_difference:first_difference + 6]}, expected "
                              f"{expected[first_difference:first_difference + 6]}")


def test_every_option_of_the_launcher_is_in_a_family() -> None:
    families = {family_of(option) for option in launcher()._option_string_actions}
    assert families == set(ENTRYPOINTS)
    assert {"--ckpt", "--plan", "--log", "--max", "--hang", "--diag", "--recovery", "--slurm",
            "--preempt", "--rdzv", "--nproc"} <= {
                word for name in ENTRYPOINTS for word in family_words(name)}
