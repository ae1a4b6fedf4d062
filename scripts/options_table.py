"""Writes docs/options.md, the reference of elasticft's options, from the config's option specs.

`python scripts/options_table.py` rewrites the page; `--print` prints it instead. A test
(tests/test_options_doc.py) fails when the page and the code disagree.
"""

from __future__ import annotations

import argparse
from datetime import timedelta
from pathlib import Path

from elasticft.options import option_specs

PAGE = Path(__file__).resolve().parent.parent / "docs" / "options.md"
REGENERATE = "python scripts/options_table.py"

INTRO = f"""\
# Options

Every elasticft option can be set three ways: with a flag, with an `ELASTICFT_*` environment
variable, or with a YAML key in `--config FILE.yaml` (or `ELASTICFT_CONFIG`). When the same
option is set more than one way, the flag wins over the environment variable, which wins over
the YAML file, which wins over the default. A bad value stops elasticft-run before anything
starts: it prints one line naming the value and how to fix it, and exits with code 2. An
unknown `ELASTICFT_*` variable is also an error. Every torchrun flag keeps its meaning too
([launcher.md](launcher.md)); the etcd-v3 `--rdzv-conf` keys are in
[rendezvous.md](rendezvous.md).

```yaml
# elasticft.yaml
agent:
  restart_on_user_error: 1
diag:
  hang_collective_floor_s: 10
ckpt:
  ckpt_remote_dir: /mnt/shared/ckpt
```

This page is generated from the code by `{REGENERATE}`; do not edit it by hand.
"""


def table() -> str:
    rows = ["| flag | env | YAML | default | meaning |", "|---|---|---|---|---|"]
    for spec in option_specs():
        if spec.default is None:
            default = "—"
        elif isinstance(spec.default, timedelta):
            default = f"`{spec.default.total_seconds():g}` s"
        else:
            default = f"`{spec.default}`"
        meaning = spec.help.replace("|", "\\|")
        rows.append(f"| `{spec.flag}` | `{spec.env}` | `{spec.yaml_key}` | {default} | {meaning} |")
    return "\n".join(rows)


def page() -> str:
    return f"{INTRO}\n{table()}\n"


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
