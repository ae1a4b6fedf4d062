"""Every public name the docs showed users where it used to live still imports from there, with a
``DeprecationWarning`` that names its new home."""

from __future__ import annotations

import importlib

import pytest

MOVED = [
    ("elasticft.recovery.inprocess", "InProcess", "elasticft.inprocess.worker"),
    ("elasticft.recovery.inprocess", "run", "elasticft.inprocess.worker"),
    ("elasticft.recovery.inprocess", "peer_failure", "elasticft.inprocess.worker"),
    ("elasticft.recovery.inprocess", "RecoveryTimeout", "elasticft.inprocess.worker"),
    ("elasticft.recovery.inprocess", "LEAVE_EXIT_CODE", "elasticft.inprocess.worker"),
    ("elasticft.recovery.interrupt", "PeerInterrupted", "elasticft.inprocess.interrupt"),
    ("elasticft.recovery.interrupt", "Monitor", "elasticft.inprocess.interrupt"),
    ("elasticft.recovery.groups", "GroupOps", "elasticft.inprocess.groups"),
    ("elasticft.recovery.meshes", "KeptModules", "elasticft.inprocess.meshes"),
    ("elasticft.recovery.meshes", "RebindError", "elasticft.inprocess.meshes"),
    ("elasticft.recovery.spare", "take_rank", "elasticft.inprocess.spare"),
    ("elasticft.recovery.spare", "is_spare", "elasticft.inprocess.spare"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("old", "name", "new"), MOVED, ids=[f"{o}.{n}" for o, n, _ in MOVED])
def test_a_moved_name_still_imports_from_where_users_found_it(old: str, name: str,
                                                              new: str) -> None:
    with pytest.warns(DeprecationWarning, match=f"{old}.{name} moved to {new}.{name}"):
        found = getattr(importlib.import_module(old), name)
    assert found is getattr(importlib.import_module(new), name)


@pytest.mark.timeout(60)
def test_a_name_that_never_lived_there_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'Nothing'"):
        importlib.import_module("elasticft.recovery.inprocess").Nothing  # noqa: B018
