"""Where ``elasticft-run``'s arguments end and the script's begin, option by option.

Three tables over every option of the launcher (torchrun's and elasticft's, each of its names):

* after the script, the option in every form a script may be given it (its name, each of its
  prefixes, unique or ambiguous, ``--opt=value``, with ``--``) reaches the script verbatim;
* before the script, each form of a torchrun option parses as torch 2.13's own parser
  (``torch.distributed.run.get_args_parser()``) parses it, an error where torchrun errs;
* before the script, each form of an elasticft option sets that option, or is argparse's
  "ambiguous option" where it abbreviates several (and no single torchrun option).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser as torchrun_parser

from elasticft import command_line
from elasticft.options import DEST_PREFIX, boolean_flags
from elasticft.run import UsageError, build_parser
from elasticft.slurm import SlurmEnv, node_defaults

pytestmark = pytest.mark.timeout(120)


@functools.cache
def launcher() -> argparse.ArgumentParser:
    return build_parser()


@functools.cache
def torchrun() -> argparse.ArgumentParser:
    return torchrun_parser()


def option_strings() -> list[str]:
    """Every name of every option of elasticft-run, ``-h`` to ``--no-recovery-blacklist``."""
    return list(launcher()._option_string_actions)


def torchrun_option_strings() -> list[str]:
    return list(torchrun()._option_string_actions)


def elasticft_option_strings() -> list[str]:
    return [s for s, action in launcher()._option_string_actions.items()
            if action.dest.startswith(DEST_PREFIX)]


def prefixes(option: str) -> list[str]:
    """``--ckpt-dir``'s ``--c``, ``--ck``, ... ``--ckpt-di``; none for ``-m``."""
    return [option[:end] for end in range(3, len(option))] if option.startswith("--") else []


def script_words(option: str) -> list[list[str]]:
    """The words a training script may be given that look like ``option``: each case one run of
    words (the name alone, with a value, ``=value``, each prefix, after ``--``)."""
    cases = [[option], [option, "x"], [f"{option}=v"], ["--", option, "x"], [option, "--"]]
    if not option.startswith("--"):
        cases.append([f"{option}x"])  # a short option with its value attached: -r3
    for prefix in prefixes(option):
        cases += [[prefix], [prefix, "x"], [f"{prefix}=v"]]
    return cases


ENTRYPOINTS = [
    ["train.py"],
    ["-m", "pkg.train"],
    ["--module", "pkg.train"],
    ["--no-python", "./train"],
    ["--", "train.py"],
    ["--standalone", "--nproc-per-node", "2", "--warm-start", "train.py"],
]


@pytest.mark.parametrize("option", option_strings())
def test_every_form_of_an_option_after_the_script_reaches_the_script(option: str) -> None:
    for entrypoint in ENTRYPOINTS:
        script = entrypoint[-1]
        for words in script_words(option):
            args = command_line.parse_args(launcher(), [*entrypoint, *words])
            assert (args.training_script, args.training_script_args) == (script, words), \
                (entrypoint, words)


def test_torchrun_itself_fails_where_the_launcher_passes_the_words_on() -> None:
    """The defect this avoids: argparse reads ``--log`` after torchrun's script as an option."""
    with contextlib.redirect_stderr(io.StringIO()), pytest.raises(SystemExit):
        torchrun().parse_args(["train.py", "--log", "x"])
    args = command_line.parse_args(launcher(), ["train.py", "--log", "x", "--ckpt", "y"])
    assert args.training_script_args == ["--log", "x", "--ckpt", "y"]


def value_for(action: argparse.Action) -> str:
    """A value the option accepts."""
    if action.choices:
        return str(next(iter(action.choices)))
    return "2" if action.type in (int, float) else "v"


def torchrun_forms(option: str) -> list[list[str]]:
    """``option`` before the script, each way it can be written."""
    action = torchrun()._option_string_actions[option]
    names = [option, *prefixes(option)]
    if action.nargs == 0:
        return [[name] for name in names]
    value = value_for(action)
    return [form for name in names for form in ([name, value], [f"{name}={value}"])]


def torchrun_reading(argv: list[str]) -> argparse.Namespace | str:
    """torch's own parser's namespace for ``argv``; "help" where torchrun shows its help,
    "error" where it refuses ``argv``."""
    try:
        with contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            return torchrun().parse_args(argv)
    except SystemExit as stopped:
        return "help" if stopped.code == 0 else "error"


def launcher_reading(argv: list[str]) -> argparse.Namespace | str:
    """elasticft-run's namespace for ``argv``, "help" or "error" as :func:`torchrun_reading`."""
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return command_line.parse_args(launcher(), argv)
    except UsageError:
        return "error"
    except SystemExit as stopped:
        return "help" if stopped.code == 0 else "error"


@pytest.mark.parametrize("option", [s for s in torchrun_option_strings()
                                    if s not in ("-h", "--help")])
def test_a_torchrun_option_before_the_script_parses_as_under_torchrun(option: str) -> None:
    for form in torchrun_forms(option):
        argv = [*form, "train.py", "--log", "x"]
        expected = torchrun_reading([*form, "train.py"])
        args = launcher_reading(argv)
        if isinstance(expected, str) or isinstance(args, str):
            assert args == expected, form
            continue
        torchrun_view = {dest: getattr(args, dest) for dest in vars(expected)}
        assert torchrun_view == {**vars(expected), "training_script_args": ["--log", "x"]}, form


@pytest.mark.parametrize("words", [["--he"], ["--help"], ["-h"], ["--h"]])
def test_help_before_the_script_is_the_launchers(words: list[str]) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as stopped:
        command_line.parse_args(launcher(), [*words, "train.py"])
    assert stopped.value.code == 0 and "elasticft options" in out.getvalue()


def elasticft_forms(option: str) -> list[tuple[list[str], str]]:
    """(words before the script, the value the option gets) for each way ``option`` is
    written."""
    action = launcher()._option_string_actions[option]
    names = [option, *prefixes(option)]
    if action.nargs == 0:  # --no-warm-start
        return [([name], action.const) for name in names]
    forms = [([f"{name}=v"], "v") for name in names]
    if option in boolean_flags():  # the flag alone, or with a true/false word
        forms += [([name], "true") for name in names] + [([name, "off"], "off") for name in names]
    else:
        forms += [([name, "v"], "v") for name in names]
    return forms


@pytest.mark.parametrize("option", elasticft_option_strings())
def test_an_elasticft_option_before_the_script_parses_by_its_names(option: str) -> None:
    actions = launcher()._option_string_actions
    dest = actions[option].dest
    for words, value in elasticft_forms(option):
        name = words[0].partition("=")[0]
        matches = [s for s in actions if s.startswith(name)]
        torchrun_matches = [s for s in torchrun_option_strings() if s.startswith(name)]
        argv = [*words, "train.py", "--ckpt", "x"]
        if name == option or len(matches) == 1:
            args = command_line.parse_args(launcher(), argv)
            assert getattr(args, dest) == value, words
            assert (args.training_script, args.training_script_args) == \
                ("train.py", ["--ckpt", "x"]), words
        elif name in actions:  # --diag-metrics, the whole name of another option
            args = command_line.parse_args(launcher(), argv)
            assert getattr(args, actions[name].dest) == value and not hasattr(args, dest)
        elif len(torchrun_matches) == 1:  # torchrun's reading wins, its error or help too
            expected = torchrun_reading([*words, "train.py"])
            args = launcher_reading(argv)
            if isinstance(expected, str) or isinstance(args, str):
                assert args == expected, words
            else:
                assert not hasattr(args, dest), words
        else:
            with pytest.raises(UsageError, match=f"ambiguous option: {name}"):
                command_line.parse_args(launcher(), argv)


@pytest.mark.parametrize(
    ("argv", "head", "given", "script_args"),
    [
        (["--nnod=2", "--re", "3", "t.py", "-r", "1"], ["--nnod=2", "--redirects", "3", "t.py"],
         ["--nnodes", "--redirects"], ["-r", "1"]),
        (["--warm", "t.py", "false"], ["--warm=true", "t.py"], ["--warm-start"], ["false"]),
        (["--warm-start", "off", "t.py"], ["--warm-start=off", "t.py"], ["--warm-start"], []),
        (["-mpkg", "t"], ["-mpkg", "t"], ["-m"], []),
        (["--node_r", "1", "--", "t.py", "--"], ["--node_r", "1", "--", "t.py"],
         ["--node_rank"], ["--"]),
        (["--nnodes"], ["--nnodes"], ["--nnodes"], []),
        (["--nnodes", "--standalone", "t.py"], ["--nnodes", "--standalone", "t.py"],
         ["--nnodes", "--standalone"], []),
        (["--unknown", "2", "t.py"], ["--unknown", "2"], [], ["t.py"]),
    ],
)
def test_split(argv: list[str], head: list[str], given: list[str], script_args: list[str]
               ) -> None:
    line = command_line.split(launcher(), argv)
    assert (line.head, line.given, line.script_args) == (head, given, script_args)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--log", "x", "t.py"], "ambiguous option: --log could match --log-dir"),
        (["--ckpt", "x", "t.py"], "ambiguous option: --ckpt could match --ckpt-enabled"),
        (["--rdzv-id", "--max", "t.py"], "ambiguous option: --max could match"),
        (["--nnodes", "--standalone", "t.py"], "argument --nnodes: expected one argument"),
        (["--nprocs-per-host", "2", "t.py"], "unrecognized arguments: --nprocs-per-host"),
        (["--standalone=1", "t.py"], "argument --standalone: ignored explicit argument '1'"),
        (["--nnodes", "2"], "the following arguments are required: training_script"),
    ],
)
def test_errors_before_the_script_are_argparses(argv: list[str], message: str) -> None:
    with pytest.raises(UsageError, match=message) as refused:
        command_line.parse_args(launcher(), [*argv, "--log", "x"] if "t.py" in argv else argv)
    assert str(refused.value).endswith("(see elasticft-run --help)")


def test_an_abbreviated_node_flag_counts_as_given_under_slurm() -> None:
    allocation = SlurmEnv.from_env({"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "gpu[1-4]",
                                    "SLURM_PROCID": "2", "SLURM_NODEID": "2"})
    assert allocation is not None
    line = command_line.split(launcher(), ["--nnod=2", "--node_r", "1", "t.py", "--nnodes", "9"])
    args = command_line.parse_args(launcher(), line)
    assert node_defaults(args, line.given, {}, allocation) == {"master_addr": "gpu1"}
    assert (args.nnodes, args.node_rank) == ("2", 1)


def test_the_script_path_itself_is_never_read_as_an_option(tmp_path: Path) -> None:
    script = tmp_path / "--ckpt.py"
    args = command_line.parse_args(launcher(), ["--", str(script), "--ckpt"])
    assert (args.training_script, args.training_script_args) == (str(script), ["--ckpt"])
