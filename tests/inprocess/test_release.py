"""What a survivor's recovery drops of the call that failed (``inprocess.worker._release``):
the frames of every exception the failure carries, so nothing of the step cut short (its
autograd graph, which holds the parameters) outlives it."""

from __future__ import annotations

import builtins
import gc
import weakref

import pytest

from elasticft.inprocess.worker import _release, exceptions_carried

GROUPS = getattr(builtins, "ExceptionGroup", None)  # Python 3.11 on
NEEDS_GROUPS = pytest.mark.skipif(GROUPS is None, reason="exception groups: Python 3.11 on")


class _Held:
    """What a failed call's frame holds (a step's tensors, its graph)."""


def _fails(error: BaseException, held: list[weakref.ref[_Held]]) -> None:
    local = _Held()
    held.append(weakref.ref(local))
    raise error


def _raised(make: str, held: list[weakref.ref[_Held]]) -> BaseException:
    """An exception made as ``make`` says, each exception in it raised from a frame of its own
    that holds a :class:`_Held`."""
    try:
        if make == "plain":
            _fails(RuntimeError("collective failed"), held)
        elif make == "handled":  # a second failure while the first is handled
            try:
                _fails(RuntimeError("collective failed"), held)
            except RuntimeError:
                _fails(ValueError("in the handler"), held)
        elif make == "from-another":  # raised from an exception other than the one handled
            stored = _raised("plain", held)
            try:
                _fails(KeyError("handled"), held)
            except KeyError:
                try:
                    raise RuntimeError("wrapped") from stored
                except RuntimeError as wrapped:
                    _fails(wrapped, held)
        elif make == "group":
            assert GROUPS is not None
            raise GROUPS("two ranks", [_raised("plain", held), _raised("plain", held)])
    except BaseException as error:
        return error
    raise AssertionError(make)


@pytest.mark.parametrize(("make", "carried"), [
    ("plain", ["RuntimeError"]),
    ("handled", ["RuntimeError", "ValueError"]),
    ("from-another", ["KeyError", "RuntimeError", "RuntimeError"]),
    pytest.param("group", ["ExceptionGroup", "RuntimeError", "RuntimeError"], marks=NEEDS_GROUPS),
])
def test_every_exception_a_failure_carries_is_found_once(make: str, carried: list[str]) -> None:
    error = _raised(make, [])
    found = exceptions_carried(error)
    assert sorted(type(e).__name__ for e in found) == sorted(carried)
    assert len({id(e) for e in found}) == len(found)


class _Carrying(Exception):
    """A library's error with an ``exceptions`` attribute of its own (not a group's)."""

    exceptions = ("retries", 3)


def test_an_exceptions_attribute_that_is_not_a_groups_is_left_alone() -> None:
    try:
        raise _Carrying("not a group")
    except _Carrying as error:
        assert exceptions_carried(error) == [error]


@pytest.mark.parametrize("make", ["plain", "handled", "from-another",
                                  pytest.param("group", marks=NEEDS_GROUPS)])
def test_the_release_frees_what_every_carried_exceptions_frames_held(make: str) -> None:
    held: list[weakref.ref[_Held]] = []
    error = _raised(make, held)
    gc.collect()
    assert all(ref() is not None for ref in held)
    _release(error)
    assert [ref() for ref in held] == [None] * len(held)
