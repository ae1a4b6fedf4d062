"""Ordering and building the agent's add-ons from what each declares.

Each add-on (:class:`elasticft.addon.api.AddOn`) says which others it needs built first and
which others' hooks must run after its own. Two pure functions turn those declarations into a
build order and a hook order (stable: declaration order breaks ties), and :func:`build_add_ons`
builds the collaborators the agent is given, in hook order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from elasticft.addon.api import AddOn, AddOnContext, AgentCollaborator, Built, add_on_name


class AddOnOrderError(ValueError):
    """The add-ons' declarations name an unknown add-on or form a cycle."""


def _topological(names: Sequence[str], after: Mapping[str, set[str]], what: str) -> list[str]:
    """``names`` ordered so that each comes after every name in ``after[name]``; among those
    free to go next, the earliest declared goes first."""
    known = set(names)
    for name, earlier in after.items():
        unknown = sorted(earlier - known)
        if unknown:
            raise AddOnOrderError(f"add-on {name!r} {what} unknown add-on(s) {unknown}")
    ordered: list[str] = []
    placed: set[str] = set()
    while len(ordered) < len(names):
        ready = [n for n in names if n not in placed and after[n] <= placed]
        if not ready:
            left = [n for n in names if n not in placed]
            raise AddOnOrderError(f"add-ons {left} {what} each other in a cycle")
        ordered.append(ready[0])
        placed.add(ready[0])
    return ordered


def build_order(declared: Sequence[tuple[str, tuple[str | type[AddOn[Any]], ...]]]
                ) -> list[str]:
    """Names in an order that builds every add-on after those it needs (pure).

    ``declared``: (name, needs) per add-on, in declaration order; a need is an add-on's class
    or its name."""
    names = [name for name, _ in declared]
    return _topological(names, {name: {add_on_name(n) for n in needs} for name, needs in declared},
                        "needs")


def hook_order(declared: Sequence[tuple[str, tuple[str, ...]]]) -> list[str]:
    """Names in the order their hooks run: each before those it ``runs_before`` (pure).

    ``declared``: (name, runs_before) per add-on, in declaration order."""
    names = [name for name, _ in declared]
    after: dict[str, set[str]] = {name: set() for name in names}
    for name, later in declared:
        for other in later:
            if other not in after:
                raise AddOnOrderError(f"add-on {name!r} runs before unknown add-on {other!r}")
            after[other].add(name)
    return _topological(names, after, "run before")


def build_add_ons(add_ons: Sequence[AddOn[Any]], context: AddOnContext
                  ) -> list[AgentCollaborator]:
    """Builds every add-on after those it needs; returns the collaborators that are on, in hook
    order."""
    by_name = {add_on.name: add_on for add_on in add_ons}
    built: dict[str, AgentCollaborator | None] = {}
    for name in build_order([(a.name, a.needs) for a in add_ons]):
        needed = Built({(n := add_on_name(need)): built[n] for need in by_name[name].needs})
        built[name] = by_name[name].build(context, needed)
    return [collaborator for name in hook_order([(a.name, a.runs_before) for a in add_ons])
            if (collaborator := built[name]) is not None]
