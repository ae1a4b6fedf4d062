"""Prints the Markdown table of elasticft's options (flag, env, YAML key, default, meaning).

The README's option reference is this script's output; a test keeps the two in step.
"""

from __future__ import annotations

from datetime import timedelta

from elasticft.config import option_specs


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


if __name__ == "__main__":
    print(table())
