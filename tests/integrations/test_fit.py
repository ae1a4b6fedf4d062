"""The rules a framework's entry must keep for in-process recovery, checked when it arms
(pure, a table), and the one line a user without the framework's extra gets."""

from __future__ import annotations

import importlib
import sys

import pytest

from elasticft.extras import MissingExtra
from elasticft.integrations.fit import EntryFacts, entry_problems

ARMED = EntryFacts(launched=True, group_initialized=True, backend="gloo", groups=1,
                   collectives=0, framework="Lightning")


@pytest.mark.parametrize(("facts", "expected"), [
    (ARMED, []),
    (EntryFacts(launched=False, group_initialized=False), []),  # no elasticft-run: called once
    (EntryFacts(launched=True, group_initialized=False, framework="Lightning"),
     ["needs the process group made before the training entry"]),
    (EntryFacts(True, True, "mpi", 1, 0, "Lightning"), ["backend 'mpi' cannot be regrouped"]),
    (EntryFacts(True, True, "nccl", 3, 0, "Lightning"),
     ["2 process group(s) besides the default one exist before Lightning's entry"]),
    (EntryFacts(True, True, "gloo", 1, 2, "Lightning"),
     ["2 collective(s) ran on the default group before Lightning's entry"]),
    (EntryFacts(True, True, "gloo", 1, None, "Lightning"), []),  # a backend that does not count
    (EntryFacts(True, True, "ucc", 2, 1, "Lightning"),
     ["backend 'ucc'", "1 process group(s)", "1 collective(s)"]),
    # torchtitan's device meshes: their groups are counted by KeptModules when it arms
    (EntryFacts(True, True, "nccl", 4, 0, "torchtitan", kept_meshes=True), []),
], ids=["armed", "not-launched", "no-group", "backend", "groups", "collectives",
        "uncounted", "all-three", "kept-meshes"])
def test_entry_problems(facts: EntryFacts, expected: list[str]) -> None:
    problems = entry_problems(facts)
    assert len(problems) == len(expected), problems
    for problem, words in zip(problems, expected, strict=True):
        assert words in problem and "\n" not in problem


@pytest.mark.parametrize(("module", "package", "extra", "feature"), [
    ("elasticft.integrations.lightning", "lightning", "lightning", "Lightning"),
    ("elasticft.integrations.hf", "transformers", "hf", "the Hugging Face Trainer"),
])
def test_a_missing_framework_is_one_line_naming_the_extra(
        monkeypatch: pytest.MonkeyPatch, module: str, package: str, extra: str,
        feature: str) -> None:
    monkeypatch.setitem(sys.modules, package, None)  # import fails as if not installed
    if package == "lightning":  # the standalone pytorch_lightning would serve instead
        monkeypatch.setitem(sys.modules, "pytorch_lightning", None)
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(MissingExtra) as raised:
        importlib.import_module(module)
    assert str(raised.value) == (f"in-process recovery for {feature} needs {package}: "
                                 f"pip install 'elasticft[{extra}]'")
