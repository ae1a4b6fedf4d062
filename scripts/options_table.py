"""Writes docs/options.md, the reference of elasticft's options, from the config's option specs.

`python scripts/options_table.py` rewrites the page; `--print` prints it instead. A test
(tests/test_options_doc.py) fails when the page and the code disagree.
"""

from __future__ import annotations

import argparse
from datetime import timedelta
from pathlib import Path

from elasticft.config import ElasticftConfig
from elasticft.options import OptionSpec, option_specs, tuning_specs

PAGE = Path(__file__).resolve().parent.parent / "docs" / "options.md"
REGENERATE = "python scripts/options_table.py"

INTRO = f"""\
# Options

Every elasticft option can be set three ways: with a flag, with an `ELASTICFT_*` environment
variable (the flag's name upper-cased, `-` made `_`), or with a YAML key in `--config FILE.yaml`
(or `ELASTICFT_CONFIG`). One rule names the YAML key: a flag `--<section>-<key>` whose section
is plan, slurm, preempt, diag, hang, slow, ckpt or recovery is `<section>: {{<key>: value}}`
(written `ckpt.dir` below); any other option is a top-level key (`run_dir`, `layout`). When the
same option is set more than one way, the flag wins over the environment variable, which wins
over the YAML file, which wins over the default. A boolean (default `True` or `False` below) is
written as torchrun's flags are, `--warm-start` or `--no-warm-start`, or with a value,
`--warm-start false` (`true`/`false`, `1`/`0`, `yes`/`no`, `on`/`off`, as in the environment).
A bad value stops elasticft-run before anything starts: it prints one line naming the value and
how to fix it, and exits with code 2. An unknown `ELASTICFT_*` variable (the message names the
closest known one) or YAML key is also an error; one naming a former option says what replaced
it. Every torchrun flag keeps its meaning too ([launcher.md](launcher.md)); the etcd-v3
`--rdzv-conf` keys are in [rendezvous.md](rendezvous.md); what a preemption notice does, and
the `--preempt-*` options' sources and timings, are in [preemption.md](preemption.md).

```yaml
# elasticft.yaml
restart_on_user_error: 1
layout: "2,*,*"
hang:
  initial_timeout_s: 900
ckpt:
  remote_dir: /mnt/shared/ckpt
```

This page is generated from the code by `{REGENERATE}`; do not edit it by hand.
"""


TUNING_INTRO = """\
## Tuning constants (Python API only)

These fields of the config dataclasses keep defaults that suit every job; no flag, environment
variable or YAML key sets them. A custom agent built on the Python API, or a test, may change
them: `ElasticftConfig(diag=DiagConfig(hang_multiple=3))`.
"""


def _default(spec: OptionSpec) -> str:
    if spec.default is None:
        return "—"
    if isinstance(spec.default, timedelta):
        return f"`{spec.default.total_seconds():g}` s"
    return f"`{spec.default}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def table() -> str:
    rows = ["| flag | env | YAML | default | meaning |", "|---|---|---|---|---|"]
    for spec in option_specs():
        rows.append(f"| `{spec.flag}` | `{spec.env}` | `{spec.yaml_key}` | {_default(spec)} | "
                    f"{_cell(spec.help)} |")
    return "\n".join(rows)


def tuning_table() -> str:
    rows = ["| field | default | meaning |", "|---|---|---|"]
    for spec in tuning_specs():
        section = type(getattr(ElasticftConfig(), spec.section)).__name__
        rows.append(f"| `{section}.{spec.name}` | {_default(spec)} | {_cell(spec.help)} |")
    return "\n".join(rows)


def page() -> str:
    return f"{INTRO}\n{table()}\n\n{TUNING_INTRO}\n{tuning_table()}\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--print", action="store_true", help="print the page instead of writing it")
    args = parser.parse_args()
    if args.print:
        print(page(), end="")
    else:
        PAGE.write_text(page())
        print(f"wrote {PAGE}")


if __name__ == "__main__":
    main()
