"""Options: one declaration gives flag, env and YAML; precedence and one-line errors."""

from __future__ import annotations

import argparse
import re
import signal
from datetime import timedelta
from pathlib import Path

import pytest

from elasticft import command_line
from elasticft import options as option_reading
from elasticft.config import (
    RUNS_DIR,
    ConfigError,
    DiagConfig,
    MetricsEndpoint,
    PinnedLayout,
    SlurmSignal,
    checkpoint_dir_default,
    run_dir_default,
)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "opts.yaml"
    path.write_text(text)
    return path


def test_defaults_when_nothing_given() -> None:
    options = option_reading.resolve({}, {})
    assert options.agent.restart_on_user_error == 0
    assert options.agent.capture_stderr is True
    assert options.slurm.slurm_signal == SlurmSignal(signal.SIGUSR1, timedelta(seconds=120))
    assert options.diag.diag_preflight == "on"
    assert options.diag.diag_metrics is None
    assert options.plan.layout is None


def test_precedence_cli_over_env_over_yaml(tmp_path: Path) -> None:
    yaml_file = write(tmp_path, "restart_on_user_error: 1\nnode_id: from-yaml\n")
    env = {"ELASTICFT_RESTART_ON_USER_ERROR": "2"}
    assert option_reading.resolve({}, {}, yaml_file).agent.restart_on_user_error == 1
    assert option_reading.resolve({}, env, yaml_file).agent.restart_on_user_error == 2
    chosen = option_reading.resolve({"restart_on_user_error": "3"}, env, yaml_file)
    assert chosen.agent.restart_on_user_error == 3
    assert chosen.agent.node_id == "from-yaml"


def test_config_file_from_env(tmp_path: Path) -> None:
    yaml_file = write(tmp_path, "restart_on_user_error: 4\n")
    options = option_reading.resolve({}, {"ELASTICFT_CONFIG": str(yaml_file)})
    assert options.agent.restart_on_user_error == 4


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("ckpt: [1, 2", "malformed YAML at line"),
        ("- a\n- b\n", "top level must be a mapping"),
        ("agnet:\n  node_id: x\n", "unknown key 'agnet'; top-level keys are"),
        ("restart_on_user_eror: 1\n", "unknown key 'restart_on_user_eror'"),
        ("ckpt:\n  dri: /x\n", "unknown key ckpt: {dri}; keys of 'ckpt' are dir,"),
        ("ckpt: 3\n", "section 'ckpt' must be a mapping"),
        ("restart_on_user_error: many\n", "set it to a whole number"),
        ("restart_on_user_error: 1.5\n", "set it to a whole number"),
        ("warm_start: 3\n", "set it to true or false"),
        ("restart_on_user_error: -1\n", "below the minimum 0"),
        # The former layout (section: {field_name}) names the new key.
        ("ckpt:\n  ckpt_dir: /x\n", "ckpt: {ckpt_dir} is an old-style key; write ckpt: {dir: "),
        ("agent:\n  run_dir: /x\n", "agent: {run_dir} is an old-style key; write run_dir: "),
        ("diag:\n  hang_initial_timeout_s: 9\n", "write hang: {initial_timeout_s: "),
        ("diag:\n  diag_enabled: false\n", "write diag: {enabled: "),
        # A former option says what replaced it, or why it is gone.
        ("plan:\n  layout_tp: 2\n", "no longer an option: replaced by --layout TP,PP,DP"),
        ("diag:\n  hang_multiple: 3\n", "tuning constant"),
        ("agent:\n  event_dir: /x\n", "events are written under --run-dir"),
    ],
)
def test_bad_yaml_is_one_line_naming_the_fix(tmp_path: Path, text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        option_reading.resolve({}, {}, write(tmp_path, text))
    message = str(err.value)
    assert fragment in message
    assert "\n" not in message


def test_keys_follow_one_rule(tmp_path: Path) -> None:
    yaml_file = write(tmp_path, 'run_dir: /r\nlayout: "2,*,*"\nckpt: {dir: /c}\n'
                                "hang: {initial_timeout_s: 900}\nslow: {action: restart}\n"
                                "diag: {enabled: false, preflight: off}\nslurm: {mode: on}\n")
    options = option_reading.resolve({}, {}, yaml_file)
    assert options.agent.run_dir == Path("/r")
    assert options.plan.layout == PinnedLayout(2, None, None)
    assert options.ckpt.ckpt_dir == Path("/c")
    assert options.diag.hang_initial_timeout_s == 900
    assert options.diag.slow_action == "restart"
    assert options.diag.diag_enabled is False
    assert options.diag.diag_preflight == "off"  # YAML reads a bare off as false
    assert options.slurm.slurm_mode == "on"
    keys = {spec.name: spec.yaml_key for spec in option_reading.option_specs()}
    assert keys["ckpt_dir"] == "ckpt.dir" and keys["run_dir"] == "run_dir"
    assert keys["hang_busy_ceiling_s"] == "hang.busy_ceiling_s" and keys["layout"] == "layout"


def test_bad_env_value_names_the_variable() -> None:
    with pytest.raises(ConfigError, match=r"ELASTICFT_WARM_START='maybe'.*true or false"):
        option_reading.resolve({}, {"ELASTICFT_WARM_START": "maybe"})


def test_missing_config_file_is_reported(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read it"):
        option_reading.resolve({}, {}, tmp_path / "absent.yaml")


def test_unknown_elasticft_env_is_rejected() -> None:
    with pytest.raises(ConfigError, match="unknown environment variable ELASTICFT_RESTARTS"):
        option_reading.check_unknown_env({"ELASTICFT_RESTARTS": "1"})
    option_reading.check_unknown_env({"ELASTICFT_NODE_ID": "a", "PATH": "/bin"})


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("ELASTICFT_WARM_STRAT", "unknown environment variable ELASTICFT_WARM_STRAT; did you mean "
                                 "ELASTICFT_WARM_START? Rename or unset it"),
        ("ELASTICFT_RUNDIR", "did you mean ELASTICFT_RUN_DIR?"),
        ("ELASTICFT_CKPT_DIRS", "did you mean ELASTICFT_CKPT_DIR?"),
        ("ELASTICFT_ZZZ", "unknown environment variable ELASTICFT_ZZZ; unset it "
                          "(elasticft-run --help names every option's variable)"),
    ],
)
def test_unknown_env_names_the_closest_known_variable(name: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)) as caught:
        option_reading.check_unknown_env({name: "1"})
    assert "\n" not in str(caught.value)


def boolean_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc-per-node")
    parser.add_argument("--standalone", action="store_true")
    parser.add_argument("script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    option_reading.add_options(parser)
    return parser


@pytest.mark.parametrize(
    ("argv", "warm_start", "script_args"),
    [
        ([], True, []),
        (["--warm-start"], True, []),
        (["--no-warm-start"], False, []),
        (["--warm-start", "false"], False, []),
        (["--warm-start", "False"], False, []),
        (["--warm-start=false"], False, []),
        (["--warm-start", "true"], True, []),
        (["--warm-start", "0"], False, []),
        (["--no-warm-start", "--nproc-per-node", "2"], False, []),
        (["--standalone", "--warm-start", "--nproc-per-node", "2"], True, []),
        # the script's own arguments are the script's, even when they look like ours
        ([], True, ["--warm-start", "false"]),
        (["--no-warm-start"], False, ["--warm-start", "true"]),
    ],
)
def test_a_boolean_is_written_as_torchrun_users_write_flags(
        argv: list[str], warm_start: bool, script_args: list[str]) -> None:
    """``--warm-start``, ``--no-warm-start`` and ``--warm-start false`` all work, and a bare
    boolean flag before the script never takes the script as its value."""
    parser = boolean_parser()
    args = command_line.parse_args(parser, [*argv, "train.py", *script_args])
    assert args.script == "train.py" and args.script_args == script_args
    assert option_reading.from_namespace(args, {}).agent.warm_start is warm_start


def test_a_boolean_flag_with_a_word_that_is_no_boolean_names_the_fix() -> None:
    parser = boolean_parser()
    args = parser.parse_args(["--warm-start=maybe", "train.py"])
    with pytest.raises(ConfigError, match=r"--warm-start='maybe' is not valid.*true or false"):
        option_reading.from_namespace(args, {})


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("ELASTICFT_LAYOUT_TP", "replaced by --layout TP,PP,DP"),
        ("ELASTICFT_CKPT_LAYOUT", "replaced by --layout TP,PP,DP"),
        ("ELASTICFT_SLURM_SIGNAL_LEAD_TIME", "replaced by --slurm-signal SIG@SECONDS"),
        ("ELASTICFT_DIAG_PREFLIGHT_ALLREDUCE", "replaced by --diag-preflight allreduce"),
        ("ELASTICFT_DIAG_METRICS_PORT", "replaced by --diag-metrics [HOST:]PORT"),
        ("ELASTICFT_CAPTURE_STDERR", "stderr is captured, unless"),
        ("ELASTICFT_HANG_MULTIPLE", "tuning constant, settable only through the Python API "
                                    "(DiagConfig.hang_multiple)"),
    ],
)
def test_a_former_option_in_the_env_names_its_replacement(name: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        option_reading.check_unknown_env({name: "1"})
    assert str(err.value).startswith(f"{name} is no longer an option: ")
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_tuning_constants_have_no_flag_env_or_yaml_key() -> None:
    option_names = {spec.name for spec in option_reading.option_specs()}
    tuning_names = {spec.name for spec in option_reading.tuning_specs()}
    assert "hang_multiple" in tuning_names and not option_names & tuning_names
    assert "ELASTICFT_HANG_MULTIPLE" not in option_reading.known_env_names()
    # The Python API still sets them.
    assert DiagConfig(hang_multiple=3).hang_multiple == 3


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2,4,8", PinnedLayout(2, 4, 8)),
        ("2,*,*", PinnedLayout(2, None, None)),
        ("*, 4 ,*", PinnedLayout(None, 4, None)),
        ("*,*,*", PinnedLayout()),
    ],
)
def test_layout_parses(text: str, expected: PinnedLayout) -> None:
    assert PinnedLayout.parse(text) == expected
    assert PinnedLayout.parse(str(expected)) == expected


def test_a_complete_layout_places_backups() -> None:
    assert PinnedLayout(2, 4, 8).complete() == (2, 4, 8)
    assert PinnedLayout(2, None, 8).complete() is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("USR1", SlurmSignal(signal.SIGUSR1, timedelta(seconds=60))),  # sbatch's default lead
        ("USR1@120", SlurmSignal(signal.SIGUSR1, timedelta(seconds=120))),
        ("B:USR2@300", SlurmSignal(signal.SIGUSR2, timedelta(seconds=300), batch_only=True)),
        ("sigterm@30", SlurmSignal(signal.SIGTERM, timedelta(seconds=30))),
        ("10@90", SlurmSignal(signal.SIGUSR1, timedelta(seconds=90))),
    ],
)
def test_slurm_signal_parses_sbatch_syntax(text: str, expected: SlurmSignal) -> None:
    assert SlurmSignal.parse(text) == expected
    assert SlurmSignal.parse(str(expected)) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("9100", MetricsEndpoint("127.0.0.1", 9100)),
        ("0.0.0.0:9100", MetricsEndpoint("0.0.0.0", 9100)),
        ("[::1]:9100", MetricsEndpoint("::1", 9100)),
        ("off", None),
    ],
)
def test_diag_metrics_parses_host_and_port(text: str, expected: MetricsEndpoint | None) -> None:
    assert MetricsEndpoint.parse(text) == expected


@pytest.mark.parametrize(
    ("flag", "value", "fix"),
    [
        ("--layout", "2,4", "give --layout TP,PP,DP"),
        ("--layout", "2,x,*", "with * for a dimension left to the planner"),
        ("--layout", "0,*,*", "three whole numbers >= 1"),
        ("--slurm-signal", "USR9@120", "give sbatch's [B:]SIG[@SECONDS]"),
        ("--slurm-signal", "USR1@soon", "give sbatch's [B:]SIG[@SECONDS]"),
        ("--slurm-signal", "USR1@0", "give sbatch's [B:]SIG[@SECONDS]"),
        ("--diag-metrics", "99999", "a port from 1 to 65535"),
        ("--diag-metrics", "host:", "give [HOST:]PORT"),
        ("--diag-metrics", ":9100", "give [HOST:]PORT"),
        ("--diag-preflight", "maybe", "one of off, on, allreduce"),
        ("--diag-preflight", "true", "one of off, on, allreduce"),
    ],
)
def test_bad_structured_values_are_one_line_naming_value_and_fix(
        flag: str, value: str, fix: str) -> None:
    parser = argparse.ArgumentParser()
    option_reading.add_options(parser)
    args = parser.parse_args([flag, value])
    with pytest.raises(ConfigError) as err:
        option_reading.from_namespace(args, {})
    message = str(err.value)
    assert f"{flag}={value!r}" in message and fix in message and "\n" not in message


def test_structured_values_parse_from_flags_and_env() -> None:
    parser = argparse.ArgumentParser()
    option_reading.add_options(parser)
    args = parser.parse_args(["--layout", "2,*,*", "--slurm-signal", "B:USR1@300",
                              "--diag-preflight", "allreduce"])
    options = option_reading.from_namespace(args, {"ELASTICFT_DIAG_METRICS": "0.0.0.0:9100"})
    assert options.plan.layout == PinnedLayout(2, None, None)
    assert options.slurm.slurm_signal.lead_time == timedelta(seconds=300)
    assert options.diag.diag_preflight == "allreduce"
    assert options.diag.diag_metrics == MetricsEndpoint("0.0.0.0", 9100)


def test_every_option_has_flag_env_and_help() -> None:
    specs = option_reading.option_specs()
    names = [s.name for s in specs]
    assert len(names) == len(set(names)), "option names must be unique across sections"
    parser = argparse.ArgumentParser()
    option_reading.add_options(parser)
    text = parser.format_help()
    for spec in specs:
        assert spec.help, spec.name
        assert spec.flag in text
        assert spec.env in text


def test_flags_parse_through_namespace() -> None:
    parser = argparse.ArgumentParser()
    option_reading.add_options(parser)
    args = parser.parse_args(["--restart-on-user-error", "2", "--node-id", "n7"])
    options = option_reading.from_namespace(args, {})
    assert options.agent.restart_on_user_error == 2
    assert options.agent.node_id == "n7"


@pytest.mark.parametrize(
    ("run_dir", "log_dir", "expected"),
    [
        (Path("/r"), "/logs", Path("/r")),  # --run-dir wins
        (None, "/logs", Path("/logs/job1")),  # the user's --log-dir
        (None, "/tmp/torchelastic_abc", RUNS_DIR / "job1"),  # torch's own, never a run's home
        (None, None, RUNS_DIR / "job1"),
    ],
)
def test_one_rule_for_the_run_directory(run_dir: Path | None, log_dir: str | None,
                                        expected: Path) -> None:
    assert run_dir_default(run_dir, log_dir, "job1") == expected


def test_one_rule_for_the_checkpoint_directory() -> None:
    assert checkpoint_dir_default(None, Path("/r")) == Path("/r/ckpt")
    assert checkpoint_dir_default(Path("/c"), Path("/r")) == Path("/c")
