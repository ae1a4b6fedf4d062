"""The package's layers: no module imports one of a higher layer.

Every import counts, at module level or inside a function (elasticft defers many imports to keep
``import elasticft`` and the CLI light, but a deferred import is still a dependency), including
those under ``TYPE_CHECKING``. From the bottom up:

1. **base**: facilities that know no subsystem. The event log (``events``), process helpers
   (``procs``), the torch compatibility shim (``torch_compat``), files with no name
   (``unnamed``), JSON records written whole (``jsonfile``), optional-extra errors
   (``extras``), a package's lazy names (``lazy``), the
   options (``config``, ``options``, ``removed_options``) and where the launcher's own arguments end
   (``command_line``), the step records (``steps``: the format every worker
   writes and the report reads), a device's health (``devicehealth``: the known-answer, device
   and NVML checks that pre-flight, the rendezvous, the SDC decisions and the in-process rejoin
   share) and ``cli``: the ``elasticft`` dispatcher names its command
   modules as strings and imports only the chosen one, so what the layers see of it is
   ``CliError``, which every command raises.
2. **add-on interface** (``addon``): what an add-on of the agent implements and decides with
   (``addon.api``, ``addon.classify``, ``addon.policy``), and the one way an add-on saves
   before a deadline (``addon.savenow``). The subsystems plug into the agent
   through it, so it sits below them, in a package of its own, apart from the agent itself.
3. **subsystems**: checkpoints (``ckpt``), diagnostics (``diag``), the layout planner
   (``plan``), the etcd rendezvous (``rendezvous``), Slurm (``slurm``) and preemption notices
   (``preemption``). Each stands alone:
   none imports another (checked below), so each can be read, tested and changed by itself.
4. **in-process recovery** (``inprocess``): both halves of it in one package. The workers'
   half (``inprocess.worker``, the spare's ``inprocess.spare``, the groups, meshes, monitor and
   device check) re-enters the training function and rebinds the subsystems' worker APIs to a
   new rank; the agent's half (``inprocess.agent_side`` and the generations, spare keeper and
   agreement across nodes it holds) reaches the agent only through the ports it is handed
   (``inprocess.ports``), so it imports nothing of the agent. Above it, the **framework
   integrations** (``integrations``: Lightning, the Hugging Face Trainer) wrap a framework's
   entry point in it.
5. **orchestration**: the agent (``agent``, with its warm pool and the order of its add-ons)
   gathers the subsystems' worker environments and collaborators, plugs them in through the
   add-on interface and holds in-process recovery, implementing its ports; hierarchical
   recovery (``recovery``) coordinates checkpoints across a rendezvous. Neither imports the
   other.
6. **tools**: what reads a run, or acts on one, from outside: ``report`` (including
   ``elasticft status``) and ``chaos``.
7. **entry points**: ``launcher`` (builds the agent and its collaborators from the options),
   ``run`` (``elasticft-run``), ``worker`` (``elasticft.init``) and the package itself, whose
   lazy names reach all of them.

A module may import its own layer and the ones below. Each layer is named by its packages, so
the folders show the layers. A new module has to be placed here before its test passes.

No two modules import each other, directly or round a longer circle, inside a package or across
them: the same imports count (module level and deferred alike), so a circle cannot be hidden by
moving one of its imports into a function. A piece two modules both need lives in a module below
both.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "elasticft"
DEVELOPMENT_DOC = PACKAGE.parent / "docs" / "development.md"

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("elasticft.events", "elasticft.procs", "elasticft.torch_compat",
              "elasticft.torch_contracts", "elasticft.unnamed", "elasticft.extras",
              "elasticft.config", "elasticft.optionvalues", "elasticft.options",
              "elasticft.command_line",
              "elasticft.steps", "elasticft.logs", "elasticft.lazy", "elasticft.decision",
              "elasticft.jsonfile", "elasticft.devicehealth", "elasticft.cli",
              "elasticft.removed_options")),
    ("add-on interface", ("elasticft.addon",)),
    ("subsystems", ("elasticft.ckpt", "elasticft.diag", "elasticft.plan", "elasticft.rendezvous",
                    "elasticft.slurm", "elasticft.preemption")),
    ("in-process recovery", ("elasticft.inprocess",)),
    ("framework integrations", ("elasticft.integrations",)),
    ("orchestration", ("elasticft.agent", "elasticft.recovery")),
    ("tools", ("elasticft.report", "elasticft.chaos")),
    ("entry points", ("elasticft.launcher", "elasticft.run", "elasticft.worker", "elasticft")),
]
INDEPENDENT = {"subsystems", "orchestration"}
"""Layers whose packages must not import each other."""

KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {
    ("elasticft.diag.autoinstall", "elasticft.inprocess.reconfigure"):
        "the worker's hook after torch's import is the one moment before the script's first "
        "group is made: in-process recovery's reconfigure regime is installed there",
}
"""(importer, imported) pairs allowed to run up the layers, each with its reason."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path, modules: set[str]) -> set[str]:
    """The elasticft modules ``name`` imports anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                # `from elasticft import procs` imports the module elasticft.procs.
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in modules else base)
    return {m for m in found if m == "elasticft" or m.startswith("elasticft.")}


def layer_of(name: str) -> tuple[int, str, str]:
    """(layer index, layer name, the prefix that placed it): the longest matching prefix."""
    best = None
    for index, (layer, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and (
                    best is None or len(prefix) > len(best[2])):
                best = (index, layer, prefix)
    assert best is not None, f"{name} is in no layer; place it in LAYERS"
    return best


def unit_of(name: str) -> str:
    """The package (or top-level module) a module belongs to: elasticft.<unit>...."""
    return name.split(".")[1] if "." in name else name


@functools.cache
def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imports_of(name, path, set(modules)) for name, path in modules.items()}


def test_every_module_has_a_layer() -> None:
    for name in all_modules():
        layer_of(name)


def test_no_module_imports_a_higher_layer() -> None:
    upward = []
    for importer, imported in sorted(import_graph().items()):
        own = layer_of(importer)
        for target in sorted(imported):
            theirs = layer_of(target)
            if theirs[0] > own[0] and (importer, target) not in KNOWN_EXCEPTIONS:
                upward.append(f"{importer} ({own[1]}) imports {target} ({theirs[1]})")
    assert not upward, "\n".join(upward)


def test_the_packages_of_an_independent_layer_do_not_import_each_other() -> None:
    crossing = []
    for importer, imported in sorted(import_graph().items()):
        own = layer_of(importer)
        if own[1] not in INDEPENDENT:
            continue
        for target in sorted(imported):
            theirs = layer_of(target)
            if theirs[0] == own[0] and unit_of(target) != unit_of(importer) and (
                    importer, target) not in KNOWN_EXCEPTIONS:
                crossing.append(f"{importer} imports {target} (both {own[1]})")
    assert not crossing, "\n".join(crossing)


def circles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The import circles of ``graph`` (pure): each strongly connected set of two or more
    modules, sorted; a module naming itself is no circle. Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next((t for t in targets if t in graph), None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1:
                    found.append(sorted(members))
    return sorted(found)


@pytest.mark.parametrize(("graph", "expected"), [
    ({}, []),
    ({"a": {"b"}, "b": set()}, []),
    ({"a": {"a"}}, []),
    ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c", "a"}}, [["a", "b"], ["c", "d"]]),
    ({"a": {"b", "outside"}, "b": {"a"}}, [["a", "b"]]),
    ({"a": {"b", "c"}, "b": {"d"}, "c": {"d"}, "d": set()}, []),
])
def test_the_circle_finder(graph: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert circles(graph) == expected


def test_no_import_circle() -> None:
    found = circles(import_graph())
    assert not found, "import circles (move the shared piece into a module below both):\n" + (
        "\n".join(" <-> ".join(circle) for circle in found))


def test_known_exceptions_still_exist() -> None:
    graph = import_graph()
    stale = [pair for pair in KNOWN_EXCEPTIONS if pair[1] not in graph.get(pair[0], set())]
    assert not stale, f"no longer imported, remove from KNOWN_EXCEPTIONS: {stale}"


def test_the_import_reader_sees_deferred_and_relative_imports(tmp_path: Path) -> None:
    module = tmp_path / "example.py"
    module.write_text("from elasticft import procs\n"
                      "from . import unnamed\n"
                      "def later():\n    from elasticft.report import cli\n"
                      "    import elasticft.steps\n")
    modules = {"elasticft.procs", "elasticft.unnamed", "elasticft.report.cli", "elasticft.steps"}
    assert imports_of("elasticft.example", module, modules) == modules


def documented_layers(text: str) -> list[tuple[str, tuple[str, ...]]]:
    """The numbered layer list of docs/development.md (pure): each layer's name and the
    modules it names in backquotes, as ``elasticft.<name>`` (\"the package itself\":
    ``elasticft``)."""
    start = text.index("Modules sit in layers")
    layers: list[tuple[str, list[str]]] = []
    for line in text[start:].splitlines()[1:]:
        if numbered := re.match(r"\d+\. ([^:(]+?)(?: \([^)]*\))?: (.*)", line):
            layers.append((numbered[1], []))
            line = numbered[2]
        elif not layers or not line.startswith("   "):
            if layers:
                break
            continue
        layers[-1][1].extend(f"elasticft.{name}" for name in re.findall(r"`([\w.]+)`", line))
        if "the package itself" in line:
            layers[-1][1].append("elasticft")
    return [(name, tuple(modules)) for name, modules in layers]


def test_the_development_page_lists_these_layers() -> None:
    assert documented_layers(DEVELOPMENT_DOC.read_text()) == LAYERS
