"""How elasticft's options are read: flags, ``ELASTICFT_*`` variables and the YAML file.

The options themselves are declared in :mod:`elasticft.config`, one frozen dataclass per
subsystem. This module derives from those declarations the spec of every option
(:func:`option_specs`), adds them to a parser (:func:`add_options`), converts and checks values
from each source (:func:`convert`), and merges the sources with the precedence CLI flag >
``ELASTICFT_*`` env > YAML file > default (:func:`resolve`, :func:`from_namespace`). A value
that cannot be used raises :class:`~elasticft.optionvalues.ConfigError` in one line.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import types
import typing
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import yaml

from elasticft.config import (
    ENV_PREFIX,
    YAML_SECTIONS,
    ConfigError,
    ElasticftConfig,
    is_tuning,
)
from elasticft.removed_options import removed_option_message


@dataclasses.dataclass(frozen=True)
class OptionSpec:
    """One field of one section, with the names it is known by."""

    section: str
    name: str
    type: Any
    default: Any
    help: str
    minimum: float | None = None
    parse: Callable[[Any, str], Any] | None = None
    """Parser of a structured value (``--layout 2,*,*``); None: converted by type."""
    kind: str | None = None
    """How a structured value is written, for the help."""

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def yaml_path(self) -> tuple[str | None, str]:
        """(section, key): ``ckpt_dir`` is ``("ckpt", "dir")``, ``run_dir`` is
        ``(None, "run_dir")``."""
        return yaml_path_of(self.name)

    @property
    def yaml_key(self) -> str:
        """The YAML key as written in messages and docs: ``ckpt.dir``, ``run_dir``."""
        section, key = self.yaml_path
        return f"{section}.{key}" if section else key


def yaml_path_of(name: str) -> tuple[str | None, str]:
    """The one YAML rule: a name ``<section>_<key>`` with a section of
    :data:`~elasticft.config.YAML_SECTIONS` is ``<section>: {<key>: ...}``; any other name is a
    top-level key."""
    prefix, _, rest = name.partition("_")
    if prefix in YAML_SECTIONS and rest:
        return prefix, rest
    return None, name


def _section_types() -> dict[str, type]:
    hints = typing.get_type_hints(ElasticftConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(ElasticftConfig)}


def _specs(tuning: bool) -> list[OptionSpec]:
    specs = []
    for section, cls in _section_types().items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if is_tuning(f) != tuning:
                continue
            specs.append(
                OptionSpec(
                    section=section,
                    name=f.name,
                    type=hints[f.name],
                    default=f.default,
                    help=f.metadata.get("help", ""),
                    minimum=f.metadata.get("minimum"),
                    parse=f.metadata.get("parse"),
                    kind=f.metadata.get("kind"),
                )
            )
    return specs


def option_specs() -> list[OptionSpec]:
    """Every option (flag, env and YAML key) of every section, in declaration order."""
    return _specs(tuning=False)


def tuning_specs() -> list[OptionSpec]:
    """The tuning constants: dataclass fields the Python API sets, no flag, env or YAML reads."""
    return _specs(tuning=True)


def describe(spec: OptionSpec) -> str:
    """The kind of value an option takes, as the help and the docs show it."""
    if is_boolean(spec):
        return f"the flag alone, {negative_flag(spec)}, or true or false"
    return spec.kind or _describe(_strip_optional(spec.type)[0])


def _describe(tp: Any) -> str:
    if tp is bool:
        return "true or false"
    if tp is int:
        return "a whole number"
    if tp is float:
        return "a number"
    if tp is timedelta:
        return "a duration in seconds"
    if tp is Path:
        return "a path"
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(tp)))
    if typing.get_origin(tp) in (list, tuple):
        return "a comma-separated list"
    return "a string"


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


DEST_PREFIX = "elasticft_"
"""What the namespace attribute of every elasticft option starts with (``elasticft_ckpt_dir``),
and no torchrun option's does."""
TRUE_WORDS = {"1", "true", "yes", "on"}
FALSE_WORDS = {"0", "false", "no", "off"}


def convert(spec: OptionSpec, value: Any, source: str) -> Any:
    """Turns a raw value (a string from CLI/env, or a YAML scalar) into the field's type."""
    tp, optional = _strip_optional(spec.type)
    if spec.parse is not None:
        if optional and (value is None or str(value).strip().lower() in ("", "none")):
            return None
        return spec.parse(value, source)
    fix = f"set it to {_describe(tp)}"

    def bad(why: str = "") -> ConfigError:
        detail = f" ({why})" if why else ""
        return ConfigError(f"{source}={value!r} is not valid{detail}; {fix}", reason="bad_option")

    if value is None or (optional and isinstance(value, str) and value.lower() in ("", "none")):
        if optional:
            return None
        raise bad("a value is required")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in TRUE_WORDS | FALSE_WORDS:
            return value.lower() in TRUE_WORDS
        raise bad()
    if tp in (int, float, timedelta):
        if isinstance(value, bool):
            raise bad()
        try:
            number = int(value) if tp is int else float(value)
        except (TypeError, ValueError):
            raise bad() from None
        if tp is int and isinstance(value, float) and not value.is_integer():
            raise bad()
        if spec.minimum is not None and number < spec.minimum:
            raise ConfigError(
                f"{source}={value!r} is below the minimum {spec.minimum:g}; "
                f"set it to {spec.minimum:g} or more",
                reason="out_of_range",
            )
        return timedelta(seconds=number) if tp is timedelta else number
    if typing.get_origin(tp) is Literal:
        choices = typing.get_args(tp)
        if isinstance(value, bool) and "on" in choices and "off" in choices:
            value = "on" if value else "off"  # YAML 1.1 reads a bare on/off as a boolean
        if value not in choices:
            raise bad()
        return value
    if typing.get_origin(tp) in (list, tuple):
        items = value if isinstance(value, list) else [v for v in str(value).split(",") if v]
        (item_tp, *_) = typing.get_args(tp) or (str,)
        try:
            return tuple(item_tp(v) for v in items)
        except (TypeError, ValueError):
            raise bad() from None
    if tp is Path:
        if not isinstance(value, str | Path):
            raise bad()
        return Path(value).expanduser()
    if tp is str:
        if not isinstance(value, str | int | float):
            raise bad()
        return str(value)
    raise AssertionError(f"unsupported option type {tp!r} for {spec.yaml_key}")


def read_yaml(path: Path) -> dict[str, Any]:
    """Reads a ``--config`` file into raw values by option name.

    Keys follow :func:`yaml_path_of`: ``ckpt: {dir: /x}``, ``hang: {initial_timeout_s: 900}``,
    top-level ``run_dir: /x``. A former option or an old-style key (``ckpt: {ckpt_dir: ...}``)
    is a one-line error naming what to write instead.
    """
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(
            f"--config {path}: cannot read it ({e.strerror}); give the path of a YAML file",
            reason="config_unreadable",
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or "not valid YAML"
        raise ConfigError(
            f"--config {path}: malformed YAML{where}: {problem}; fix the file's syntax",
            reason="config_malformed",
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"--config {path}: the top level must be a mapping of option or section "
            f"({', '.join(YAML_SECTIONS)}) to value; got {type(data).__name__}",
            reason="config_malformed",
        )
    by_path = {spec.yaml_path: spec for spec in option_specs()}
    old_sections = set(_section_types())  # the former layout: section: {field_name: ...}
    values: dict[str, Any] = {}
    for top, top_value in data.items():
        top = str(top)
        if top in YAML_SECTIONS or top in old_sections:
            if not isinstance(top_value, dict):
                raise ConfigError(
                    f"--config {path}: section {top!r} must be a mapping of key: value",
                    reason="config_malformed",
                )
            entries = [(top, str(key), value) for key, value in top_value.items()]
        else:
            entries = [(None, top, top_value)]
        for section, key, value in entries:
            # A former section that is no YAML section now ("agent") holds only old-style keys.
            current = section is None or section in YAML_SECTIONS
            spec = by_path.get((section, key)) if current else None
            if spec is None:
                raise ConfigError(_unknown_yaml_key(path, section, key, by_path),
                                  reason="config_unknown_key")
            values[spec.name] = value
    return values


def _unknown_yaml_key(path: Path, section: str | None, key: str,
                      by_path: Mapping[tuple[str | None, str], OptionSpec]) -> str:
    """The one line for a YAML key that is no option: what it became, or the keys there are."""
    where = f"{section}: {{{key}}}" if section else key
    names = {spec.name: spec for spec in by_path.values()}
    for name in dict.fromkeys((key, f"{section}_{key}" if section else key)):
        if name in names:
            new_section, new_key = names[name].yaml_path
            new = f"{new_section}: {{{new_key}: ...}}" if new_section else f"{new_key}: ..."
            return f"--config {path}: {where} is an old-style key; write {new}"
        removed = removed_option_message(name)
        if removed is not None:
            return f"--config {path}: {where} is no longer an option: {removed}"
    if section is None:
        known = sorted({p[1] for p in by_path if p[0] is None} | set(YAML_SECTIONS))
        return (f"--config {path}: unknown key {key!r}; top-level keys are "
                f"{', '.join(known)}")
    known = sorted(p[1] for p in by_path if p[0] == section)
    return (f"--config {path}: unknown key {where}; keys of {section!r} are "
            f"{', '.join(known) or 'none (an old section)'}")


def add_options(parser: argparse.ArgumentParser) -> None:
    """Adds ``--config`` and one flag per option to a (torchrun) parser.

    Flags default to ``argparse.SUPPRESS`` so :func:`resolve` can tell "given" from "absent".
    """
    group = parser.add_argument_group(
        "elasticft options",
        "Each also reads ELASTICFT_<NAME> from the environment and a key of the --config file "
        "(--ckpt-dir is ckpt: {dir: ...}, --run-dir the top-level run_dir). Precedence: flag > "
        "env > YAML > default.",
    )
    group.add_argument(
        "--config",
        dest=DEST_PREFIX + "config",
        default=argparse.SUPPRESS,
        metavar="FILE.yaml",
        help="YAML file of elasticft options (env: ELASTICFT_CONFIG).",
    )
    for spec in option_specs():
        default = "none" if spec.default is None else spec.default
        boolean = is_boolean(spec)
        group.add_argument(
            spec.flag,
            dest=DEST_PREFIX + spec.name,
            default=argparse.SUPPRESS,
            metavar=spec.name.upper(),
            # A boolean is written --warm-start, --no-warm-start or --warm-start false.
            **({"nargs": "?", "const": "true"} if boolean else {}),
            # argparse %-formats help text: a literal % in an option's help must be doubled.
            help=f"{spec.help} [{describe(spec)}; "
            f"env {spec.env}; YAML {spec.yaml_key}; default {default}]".replace("%", "%%"),
        )
        if boolean:
            group.add_argument(negative_flag(spec), dest=DEST_PREFIX + spec.name,
                               action="store_const", const="false", default=argparse.SUPPRESS,
                               help=f"the same as {spec.flag} false")


def is_boolean(spec: OptionSpec) -> bool:
    return _strip_optional(spec.type)[0] is bool and spec.parse is None


def negative_flag(spec: OptionSpec) -> str:
    """``--no-warm-start`` for ``--warm-start``."""
    return "--no-" + spec.flag.removeprefix("--")


@functools.cache
def boolean_flags() -> frozenset[str]:
    """The flags of the boolean options (``--warm-start``; its ``--no-warm-start`` aside)."""
    return frozenset(spec.flag for spec in option_specs() if is_boolean(spec))


def resolve(
    cli: Mapping[str, Any], env: Mapping[str, str], yaml_path: Path | None = None
) -> ElasticftConfig:
    """Builds the config from CLI values (by option name), the environment and a YAML file."""
    if yaml_path is None and env.get(ENV_PREFIX + "CONFIG"):
        yaml_path = Path(env[ENV_PREFIX + "CONFIG"])
    from_yaml = read_yaml(yaml_path) if yaml_path is not None else {}
    values: dict[str, dict[str, Any]] = {s: {} for s in _section_types()}
    for spec in option_specs():
        if spec.name in cli:
            value = convert(spec, cli[spec.name], spec.flag)
        elif spec.env in env:
            value = convert(spec, env[spec.env], spec.env)
        elif spec.name in from_yaml:
            value = convert(spec, from_yaml[spec.name], f"{yaml_path}:{spec.yaml_key}")
        else:
            continue
        values[spec.section][spec.name] = value
    sections = {name: cls(**values[name]) for name, cls in _section_types().items()}
    return ElasticftConfig(**sections)


def from_namespace(args: argparse.Namespace, env: Mapping[str, str]) -> ElasticftConfig:
    """Resolves the config from a namespace parsed by a parser that went through add_options."""
    cli = {
        spec.name: getattr(args, DEST_PREFIX + spec.name)
        for spec in option_specs()
        if hasattr(args, DEST_PREFIX + spec.name)
    }
    path = getattr(args, DEST_PREFIX + "config", None)
    return resolve(cli, env, Path(path) if path else None)


def known_env_names() -> set[str]:
    return {spec.env for spec in option_specs()} | {ENV_PREFIX + "CONFIG"}


def check_unknown_env(env: Mapping[str, str], extra_names: set[str] = frozenset()) -> None:
    """A misspelt ``ELASTICFT_*`` variable is an error, not something silently ignored.

    ``extra_names`` are variables elasticft itself sets for workers (they are not options).
    """
    known = known_env_names() | set(extra_names)
    for name in env:
        if name.startswith(ENV_PREFIX) and name not in known:
            removed = removed_option_message(name.removeprefix(ENV_PREFIX).lower())
            if removed is not None:
                raise ConfigError(f"{name} is no longer an option: {removed}; unset it",
                                  reason="removed_env")
            raise ConfigError(unknown_env_message(name, known_env_names()), reason="unknown_env")


def unknown_env_message(name: str, known: set[str]) -> str:
    """The one line for an unknown ``ELASTICFT_*`` variable: the closest known name if one is
    close, else where the known ones are listed."""
    # Compared without the prefix every candidate shares, which would make any name "close".
    stems = {k.removeprefix(ENV_PREFIX): k for k in known}
    close = difflib.get_close_matches(name.removeprefix(ENV_PREFIX), sorted(stems), n=1,
                                      cutoff=0.7)
    fix = f"did you mean {stems[close[0]]}? Rename or unset it" if close else \
        "unset it (elasticft-run --help names every option's variable)"
    return f"unknown environment variable {name}; {fix}"
