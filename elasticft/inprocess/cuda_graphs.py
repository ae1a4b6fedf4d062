"""CUDA graphs that captured a process group's communicators: dropped by a survivor as soon
as its training call failed, before it waits for the abort of its groups.

Since NCCL 2.26, ``ncclCommAbort`` returns only once every CUDA graph that captured the
communicator is destroyed. The monitor aborts the groups from its own thread while the main
thread may still be inside the training call (:mod:`elasticft.inprocess.interrupt`); the main
thread, once out, waits until that end is over before it tears down and regroups. Were the
graphs dropped only at the next entry (after the regroup), the abort would wait for the main
thread and the main thread for the abort: the survivor would overrun its teardown limit and be
replaced, a restart reported as in process. So the main thread drops them first, the moment it
is out (:meth:`elasticft.inprocess.worker.InProcess.run`); the next entry captures new ones on
the new group, as a first step does.

What is dropped: torch.compile's CUDA graph trees (``mode="reduce-overhead"``), where inductor's
are loaded and CUDA is initialized; and whatever the script or an integration registered with
:func:`drop_on_failure` (torchtitan's own teardown; a script's ``torch.cuda.CUDAGraph``, its
``reset``). A dropper that raises is logged and the others still run.
"""

from __future__ import annotations

import itertools
import logging
import sys
from collections.abc import Callable, Mapping
from typing import Any

logger = logging.getLogger(__name__)

_droppers: dict[int, tuple[str, Callable[[], Any]]] = {}
_keys = itertools.count()

COMPILE_TREES = "torch._inductor.cudagraph_trees"
"""torch.compile's CUDA graph trees (``reset_cudagraph_trees`` frees every graph they hold)."""


def drop_on_failure(drop: Callable[[], Any], name: str | None = None) -> Callable[[], None]:
    """Registers ``drop`` (it destroys CUDA graphs that captured a process group's
    communicators), called by a survivor as soon as its training call failed. Returns what
    unregisters it."""
    key = next(_keys)
    _droppers[key] = (name or getattr(drop, "__qualname__", repr(drop)), drop)

    def unregister() -> None:
        _droppers.pop(key, None)
    return unregister


def drop_all(modules: Mapping[str, Any] | None = None) -> list[str]:
    """Runs every registered dropper, then torch.compile's reset where its graph trees are
    loaded and CUDA is initialized; returns the names of those that ran (for the log)."""
    loaded = sys.modules if modules is None else modules
    ran: list[str] = []
    for name, drop in list(_droppers.values()):
        try:
            drop()
            ran.append(name)
        except Exception as e:  # the other graphs must still go
            logger.warning("dropping CUDA graphs with %s failed: %s", name, e)
    trees = loaded.get(COMPILE_TREES)
    torch = loaded.get("torch")
    if trees is not None and torch is not None and torch.cuda.is_initialized():
        try:
            trees.reset_cudagraph_trees()
            ran.append("torch.compile's CUDA graph trees")
        except Exception as e:
            logger.warning("resetting torch.compile's CUDA graph trees failed: %s", e)
    return ran
