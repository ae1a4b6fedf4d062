"""What the warm template imports beyond torch: the training frameworks the script imports.

A worker's start-up is mostly imports. torch's are done once per node by the warm template
(:mod:`elasticft.agent.warmpool`); a framework's come on top, in every worker and in every
replacement: ``import lightning`` takes 7-8 s of CPU where ``transformers`` is installed
(torchmetrics imports it), ``from transformers import Trainer`` 3-4 s. The template imports them
too when the script does, so a replacement forked from it starts with them done.

Which ones: the modules of :data:`FRAMEWORKS` that the script imports at its top level (pure
reading of its source, :func:`framework_imports`), exactly as it names them, so that the worker's
``sys.modules`` holds what a cold start of the same command would (a script importing
``pytorch_lightning`` never finds ``lightning`` loaded beside it). An import inside a function,
or under a condition other than a test of the command line, is left to the worker. A framework
is on the list when its import neither starts a thread nor touches a device, and reads at import
nothing that differs between the template and a worker but the rank, which the bootstrap sets
again in the forked worker (``_per_attempt_fixups``: Lightning's and torchmetrics'
``rank_zero_only.rank``).
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from pathlib import Path

FRAMEWORKS = frozenset({
    "lightning", "pytorch_lightning", "lightning_fabric", "torchmetrics", "transformers",
    "accelerate", "elasticft.integrations",
})
"""Packages (or elasticft's subpackage) imported in the template when the script imports them."""

_INTERPRETER_OPTIONS_WITH_VALUE = frozenset({"-W", "-X", "-Q"})


def script_command(argv: Sequence[str]) -> list[str] | None:
    """What ``sys.argv`` is in the script a worker's command runs (``python [-u ...]
    script.py args``: ``[script.py, args...]``), or None for ``-m module``, ``-c code`` or no
    script (pure)."""
    for at in range(1, len(argv)):
        word = argv[at]
        if word in ("-m", "-c", "-"):
            return None
        if word.startswith("-") or argv[at - 1] in _INTERPRETER_OPTIONS_WITH_VALUE:
            continue
        return list(argv[at:])
    return None


def _is_framework(module: str) -> bool:
    return any(module == f or module.startswith(f + ".") for f in FRAMEWORKS)


def _argv_test(test: ast.expr, script_argv: Sequence[str]) -> bool | None:
    """The value of ``"--flag" in sys.argv`` (or ``not in``) for the script's ``sys.argv``;
    None for any other condition."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1
            and isinstance(test.ops[0], (ast.In, ast.NotIn))
            and isinstance(test.left, ast.Constant) and isinstance(test.left.value, str)):
        return None
    right = test.comparators[0]
    if not (isinstance(right, ast.Attribute) and right.attr == "argv"
            and isinstance(right.value, ast.Name) and right.value.id == "sys"):
        return None
    found = test.left.value in script_argv
    return found if isinstance(test.ops[0], ast.In) else not found


def framework_imports(source: str, script_argv: Sequence[str]) -> tuple[str, ...]:
    """The preload entries for a script's top-level imports of :data:`FRAMEWORKS` (pure):
    ``module`` for ``import module``, ``module:name`` for ``from module import name`` (a name
    may be a lazy attribute, as ``transformers.Trainer`` is). ``script_argv``: the script's
    ``sys.argv``, against which a top-level ``if "--flag" in sys.argv:`` is decided; a source
    that does not parse has none."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ()
    entries: list[str] = []

    def visit(statements: list[ast.stmt]) -> None:
        for statement in statements:
            if isinstance(statement, ast.Import):
                entries.extend(a.name for a in statement.names if _is_framework(a.name))
            elif (isinstance(statement, ast.ImportFrom) and statement.level == 0
                  and statement.module and _is_framework(statement.module)):
                entries.extend(f"{statement.module}:{a.name}" for a in statement.names
                               if a.name != "*")
            elif isinstance(statement, ast.If):
                taken = _argv_test(statement.test, script_argv)
                if taken is not None:
                    visit(statement.body if taken else statement.orelse)
            elif isinstance(statement, ast.Try):
                visit(statement.body)

    visit(tree.body)
    return tuple(dict.fromkeys(entries))


def preload_for(argv: Sequence[str], cwd: str) -> tuple[str, ...]:
    """The framework entries for a worker's command run in ``cwd`` (none when it names no
    readable script)."""
    script_argv = script_command(argv)
    if script_argv is None:
        return ()
    try:
        source = (Path(cwd) / script_argv[0]).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return ()
    return framework_imports(source, script_argv)
