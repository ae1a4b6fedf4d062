"""The add-ons' build and hook orders, derived from what each declares."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import pytest

from elasticft.addon.api import AddOnContext, AgentCollaborator
from elasticft.agent.addons import AddOnOrderError, build_add_ons, build_order, hook_order
from elasticft.config import ElasticftConfig
from elasticft.launcher import default_add_ons

BUILD_CASES = [
    # (name, needs) in declaration order, the build order
    ([], []),
    ([("a", ()), ("b", ())], ["a", "b"]),
    ([("recovery", ("ckpt",)), ("ckpt", ())], ["ckpt", "recovery"]),
    ([("slurm", ("ckpt",)), ("recovery", ("ckpt",)), ("ckpt", ()), ("plan", ())],
     ["ckpt", "slurm", "recovery", "plan"]),
    ([("c", ("b",)), ("b", ("a",)), ("a", ())], ["a", "b", "c"]),
]


@pytest.mark.parametrize(("declared", "expected"), BUILD_CASES)
def test_build_order_puts_each_add_on_after_what_it_needs(declared, expected) -> None:
    assert build_order(declared) == expected


HOOK_CASES = [
    # (name, runs_before) in declaration order, the hook order
    ([("a", ()), ("b", ())], ["a", "b"]),
    ([("ckpt", ()), ("recovery", ("ckpt",))], ["recovery", "ckpt"]),
    ([("plan", ()), ("diag", ()), ("ckpt", ()), ("recovery", ("ckpt",)), ("slurm", ())],
     ["plan", "diag", "recovery", "ckpt", "slurm"]),
    ([("a", ("c",)), ("b", ()), ("c", ())], ["a", "b", "c"]),
]


@pytest.mark.parametrize(("declared", "expected"), HOOK_CASES)
def test_hook_order_runs_each_add_on_before_those_it_names(declared, expected) -> None:
    assert hook_order(declared) == expected


@pytest.mark.parametrize(("declared", "order", "message"), [
    ([("a", ("b",)), ("b", ("a",))], build_order, "cycle"),
    ([("a", ("missing",))], build_order, "unknown add-on"),
    ([("a", ("b",)), ("b", ("a",))], hook_order, "cycle"),
    ([("a", ("missing",))], hook_order, "unknown add-on 'missing'"),
])
def test_bad_declarations_are_one_line_errors(declared, order, message) -> None:
    with pytest.raises(AddOnOrderError, match=message):
        order(declared)


class _Seen(AgentCollaborator):
    def __init__(self, name: str, given: Mapping[str, AgentCollaborator | None]) -> None:
        self.name = name
        self.given = dict(given)


def _add_on(name_: str, needs_: tuple[str, ...] = (), before: tuple[str, ...] = (),
            on: bool = True) -> object:
    class Declared:
        name: ClassVar[str] = name_
        needs: ClassVar[tuple[str, ...]] = needs_
        runs_before: ClassVar[tuple[str, ...]] = before

        def build(self, context: AddOnContext, built: Mapping[str, AgentCollaborator | None]
                  ) -> AgentCollaborator | None:
            return _Seen(name_, built) if on else None

    return Declared()


def test_build_add_ons_passes_what_is_needed_and_leaves_out_what_is_off(tmp_path) -> None:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    from elasticft.torch_compat import LaunchConfig

    # A log dir of the test's own: without one torch makes a /tmp/torchelastic_* directory.
    launch = LaunchConfig(1, 1, 1, logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path)))
    context = AddOnContext(ElasticftConfig(), launch, {})
    built = build_add_ons([_add_on("slurm", ("ckpt",)), _add_on("recovery", ("ckpt",), ("ckpt",)),
                           _add_on("ckpt"), _add_on("metrics", on=False)], context)
    assert [c.name for c in built] == ["slurm", "recovery", "ckpt"]
    ckpt = built[2]
    assert built[0].given == {"ckpt": ckpt} and built[1].given == {"ckpt": ckpt}


def test_the_default_add_ons_declare_a_valid_order() -> None:
    add_ons = default_add_ons()
    assert build_order([(a.name, a.needs) for a in add_ons]).index("ckpt") < \
        build_order([(a.name, a.needs) for a in add_ons]).index("recovery")
    hooks = hook_order([(a.name, a.runs_before) for a in add_ons])
    assert hooks == ["plan", "steps", "diag", "recovery", "ckpt", "slurm", "preempt"]
