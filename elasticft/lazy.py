"""Lazy exports: a package names what its submodules define without importing them up front.

``import elasticft`` runs in every worker and ``import elasticft.ckpt`` in every training script,
so neither may pull in the launcher, torch's elastic agent or the checkpoint engine just to offer
their names. A package lists each name it exports with the module that defines it, and
:func:`lazy_getattr` makes the module-level ``__getattr__`` (PEP 562) that imports that module
on the name's first use.

A public name that moved keeps working where users found it: :func:`moved_getattr` makes the old
module's ``__getattr__``, which gives the name from its new home with a ``DeprecationWarning``
that says where that is.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """The ``__getattr__`` of ``package``: ``homes`` maps each name to its defining module."""

    def __getattr__(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(homes[name]), name)

    return __getattr__


def moved_getattr(old: str, new: str, names: frozenset[str] | set[str]) -> Callable[[str], Any]:
    """The ``__getattr__`` of module ``old``, whose ``names`` now live in module ``new``."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        warnings.warn(f"{old}.{name} moved to {new}.{name}; import it from {new}",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(new), name)

    return __getattr__
