"""Options: one declaration gives flag, env and YAML; precedence and one-line errors."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from elasticft import options as option_reading
from elasticft.config import ConfigError


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "opts.yaml"
    path.write_text(text)
    return path


def test_defaults_when_nothing_given() -> None:
    options = option_reading.resolve({}, {})
    assert options.agent.restart_on_user_error == 0
    assert options.agent.capture_stderr is True


def test_precedence_cli_over_env_over_yaml(tmp_path: Path) -> None:
    yaml_file = write(tmp_path, "agent:\n  restart_on_user_error: 1\n  node_id: from-yaml\n")
    env = {"ELASTICFT_RESTART_ON_USER_ERROR": "2"}
    assert option_reading.resolve({}, {}, yaml_file).agent.restart_on_user_error == 1
    assert option_reading.resolve({}, env, yaml_file).agent.restart_on_user_error == 2
    chosen = option_reading.resolve({"restart_on_user_error": "3"}, env, yaml_file)
    assert chosen.agent.restart_on_user_error == 3
    assert chosen.agent.node_id == "from-yaml"


def test_config_file_from_env(tmp_path: Path) -> None:
    yaml_file = write(tmp_path, "agent:\n  restart_on_user_error: 4\n")
    options = option_reading.resolve({}, {"ELASTICFT_CONFIG": str(yaml_file)})
    assert options.agent.restart_on_user_error == 4


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("agent: [1, 2", "malformed YAML at line"),
        ("- a\n- b\n", "top level must be a mapping"),
        ("agnet:\n  node_id: x\n", "unknown section 'agnet'"),
        ("agent:\n  restart_on_user_eror: 1\n", "unknown option agent.restart_on_user_eror"),
        ("agent:\n  restart_on_user_error: many\n", "set it to a whole number"),
        ("agent:\n  restart_on_user_error: 1.5\n", "set it to a whole number"),
        ("agent:\n  capture_stderr: 3\n", "set it to true or false"),
        ("agent:\n  restart_on_user_error: -1\n", "below the minimum 0"),
    ],
)
def test_bad_yaml_is_one_line_naming_the_fix(tmp_path: Path, text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        option_reading.resolve({}, {}, write(tmp_path, text))
    message = str(err.value)
    assert fragment in message
    assert "\n" not in message


def test_bad_env_value_names_the_variable() -> None:
    with pytest.raises(ConfigError, match=r"ELASTICFT_CAPTURE_STDERR='maybe'.*true or false"):
        option_reading.resolve({}, {"ELASTICFT_CAPTURE_STDERR": "maybe"})


def test_missing_config_file_is_reported(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read it"):
        option_reading.resolve({}, {}, tmp_path / "absent.yaml")


def test_unknown_elasticft_env_is_rejected() -> None:
    with pytest.raises(ConfigError, match="unknown environment variable ELASTICFT_RESTARTS"):
        option_reading.check_unknown_env({"ELASTICFT_RESTARTS": "1"})
    option_reading.check_unknown_env({"ELASTICFT_NODE_ID": "a", "PATH": "/bin"})


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
