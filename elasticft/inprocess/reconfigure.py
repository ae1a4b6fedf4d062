"""The regroup by torch's own reconfigure: the script's default group rebuilt in place.

torch 2.14 can make a group in a *reconfigure regime* (``init_process_group(...,
enable_reconfigure=True)``, gloo and NCCL): its backend connects only when
``ProcessGroup.reconfigure`` is called with every member's handle, and can be called again, with
a fresh uuid and another set of members, after a failure. The group object stays what the
script holds (``dist.is_initialized()`` never turns False, ``dist.group.WORLD`` is the same
object), and the rebuild itself costs milliseconds (gloo, 3 ranks on CPU: 1-3 ms, a shrink to 2
ranks 22 ms), where a new group through ``init_process_group`` costs a tenth of a second and
more.

How the in-process path uses it, where this torch has it (:func:`unsupported`, the feature, not
the version) and the job runs under ``InProcess`` (:data:`REGIME_ENV`, set by the agent):

* **At the script's ``init_process_group``** (:func:`install`, from the worker's bootstrap, before
  the script runs): the default group is made in the regime, its store wrapped in a
  :class:`SwitchableStore`, and connected at once (:func:`connect`: each rank's handle is put
  in that store, and the group reconfigured with the handles in rank order and a uuid the ranks
  agree on there). A default group with two backends (``"cpu:gloo,cuda:nccl"``, or no backend named)
  stays as torch makes it, and recovers as before.
* **At a failure**: every group is aborted as on the other path, but torch's table is not
  cleared: the script's other groups are destroyed (:func:`end_subgroups`), the default group
  kept. A gloo wait on a silent peer is released the same way (the shutdown of the group's
  connections, recorded here when the reconfigure makes them).
* **At the regroup** (:func:`regroup_in_place`): the store is switched to the generation's (the
  one a replacement's unchanged ``init_process_group()`` uses), the handles exchanged there and
  the group reconfigured with the generation's members, in their new rank order; torch's count
  of groups goes back to what it was after the default group's creation, so the groups the
  script and its meshes make again get the names a replacement's make.

The path each job takes is said once, at INFO, by every worker's first init.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import random
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from elasticft.diag import groupsockets

logger = logging.getLogger(__name__)

REGIME_ENV = "ELASTICFT_INPROCESS_RECONFIGURE"
"""``1``: this worker's job runs under ``InProcess``, so its default group is made in the
reconfigure regime where torch allows it. Set by the agent for a job whose entry script names
in-process recovery (``ElasticftAgent.startup_env``), the same for every start and node."""

STORE_PREFIX = "default_pg"
"""The prefix torch puts before an ``env://`` default group's keys: the regroup's store has the
same, so it meets a replacement's unchanged ``init_process_group()``."""

_KEY = "elasticft/reconfigure"

DEFAULT_TIMEOUT = timedelta(minutes=5)


def unsupported() -> str | None:
    """Why this torch cannot rebuild a group in place (None: it can): read from what it has."""
    if not callable(getattr(dist, "_reconfigure", None)):
        return "this torch has no dist._reconfigure"
    if not hasattr(dist.ProcessGroup, "supports_reconfigure"):
        return "torch's ProcessGroup has no supports_reconfigure"
    return None


def backend_refusal(backend: str) -> str | None:
    """Why a default group of ``backend`` (torch's normalised name: ``"gloo"``, ``"nccl"``,
    ``"cpu:gloo,cuda:nccl"``) stays out of the regime (None: it goes in). Pure."""
    name = backend.lower()
    if name in ("gloo", "nccl", "cpu:gloo", "cuda:nccl"):
        return None
    return f"a default group on {backend!r} (reconfigure takes one backend, gloo or nccl)"


def path_line(chosen: str = "auto") -> str:
    """The one line that says how this job's in-process recovery will rebuild its group, under
    ``--recovery-inprocess-regroup chosen``."""
    if chosen != "auto":
        return f"in-process regroup: a new group (--recovery-inprocess-regroup {chosen})"
    reason = unsupported()
    if reason is None:
        return ("in-process regroup: the default group rebuilt in place by torch's reconfigure "
                "(a default group with two backends: a new group)")
    return f"in-process regroup: a new group ({reason})"


def wanted(env: Mapping[str, str]) -> bool:
    """Whether this worker's job asked for the regime (its agent set :data:`REGIME_ENV`)."""
    return env.get(REGIME_ENV) == "1"


class SwitchableStore(dist.Store):
    """A store that forwards every call to ``target``, which the regroup replaces by the next
    generation's: the default group's backend keeps the store it was made with, and reconnects
    through it."""

    def __init__(self, target: dist.Store) -> None:
        super().__init__()
        self.target = target

    def set(self, key: str, value: Any) -> None:
        self.target.set(key, value)

    def get(self, key: str) -> bytes:
        return self.target.get(key)

    def add(self, key: str, amount: int) -> int:
        return self.target.add(key, amount)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self.target.compare_set(key, expected, desired)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self.target.wait(keys)
        else:
            self.target.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return self.target.check(keys)

    def delete_key(self, key: str) -> bool:
        return self.target.delete_key(key)

    def num_keys(self) -> int:
        return self.target.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.target.set_timeout(timeout)

    @property
    def timeout(self) -> timedelta:
        return self.target.timeout


@dataclasses.dataclass
class Regime:
    """The default group this process made in the regime, and what its regroup needs."""

    group: Any
    store: SwitchableStore
    group_count: int
    """torch's count of groups right after the default group was made."""
    name: str
    rebuild_s: float
    """The latest reconfigure's own seconds: every rank's handle in, to the group formed."""
    listeners: set[int]
    """The ports the group listens on (made with it, or by its first reconfigure)."""

    def joined_record(self) -> dict[str, float]:
        """What a worker's ``joined`` record says of the rebuild (the event's ``rebuild_s``)."""
        return {"rebuild_s": round(self.rebuild_s, 4)}


_regime: Regime | None = None


def active() -> Regime | None:
    """The default group in the regime, while it is torch's default group (None otherwise)."""
    if _regime is None or not dist.is_initialized():
        return None
    if dist.distributed_c10d._get_default_group() is not _regime.group:
        return None
    return _regime


def agreed_uuid(store: dist.Store) -> int:
    """The reconfigure's uuid, the same for every rank that asks ``store``: the first rank's
    random proposal. Each generation has a store of its own (as each attempt has), so a rebuild
    gets a fresh uuid, and the ranks need not agree on anything else beforehand: a node that
    joins with workers of its own knows the store, not the generation's number."""
    proposal = str(random.getrandbits(62) + 1)
    return int(store.compare_set(f"{_KEY}/uuid", "", proposal))


def connect(store: dist.Store, group: Any, rank: int, world_size: int,
            timeout: timedelta, name: str = "default",
            before: Mapping[int, groupsockets.TcpSocket] | None = None,
            own_listeners: set[int] | None = None) -> float:
    """Puts this rank's handle in ``store`` (a generation's own), waits for every rank's, and
    reconfigures ``group`` with them in rank order and the uuid the ranks agreed on there;
    returns the reconfigure's own seconds. The connections it makes are recorded under
    ``name`` for the gloo release (:mod:`elasticft.diag.groupsockets`): those new since
    ``before`` (default: the reconfigure's start), counting the ones accepted on the group's
    own listeners (``own_listeners``, ports)."""
    uuid = agreed_uuid(store)
    store.set(f"{_KEY}/{rank}", group.get_reconfigure_handle())
    keys = [f"{_KEY}/{r}" for r in range(world_size)]
    store.wait(keys, timeout)
    handles = [store.get(k).decode() for k in keys]
    options = dist.distributed_c10d.ReconfigureOptions()
    options.uuid = uuid
    options.handles = handles
    options.timeout = timeout
    if before is None:
        before = groupsockets.snapshot()
    started = time.perf_counter()
    group.reconfigure(options).wait()
    took = time.perf_counter() - started
    recording = groupsockets.installed()
    if recording is not None:
        recording.record(name, groupsockets.made_by_group(before, groupsockets.snapshot(),
                                                          own_listeners or ()))
    return took


def new_listeners(before: Mapping[int, groupsockets.TcpSocket]) -> set[int]:
    """The ports of the listening sockets made since ``before`` (a group's own)."""
    old = {s.inode for s in before.values()}
    return {s.local_port for s in groupsockets.snapshot().values()
            if s.listening and s.inode not in old}


def install(c10d: Any = None, env: Mapping[str, str] = os.environ) -> bool:
    """Wraps torch's ``_new_process_group_helper`` so that the script's default group is made
    in the regime and connected (True: wrapped, now or before). Nothing when the job did not
    ask for it or this torch cannot (said at INFO)."""
    if not wanted(env):
        return False
    reason = unsupported()
    if reason is not None:
        logger.info("in-process regroup by a new group: %s", reason)
        return False
    c10d = c10d if c10d is not None else dist.distributed_c10d
    helper = c10d._new_process_group_helper
    if getattr(helper, "__elasticft_reconfigure__", False):
        return True

    @functools.wraps(helper)
    def new_process_group_helper(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("group_desc") != "default_pg" or len(args) < 6:
            return helper(*args, **kwargs)
        world_size, rank, _, backend, store, name = args[:6]
        refusal = backend_refusal(str(backend))
        if refusal is not None or store is None:
            # The agent said the job's group would be rebuilt in place: this worker's is not.
            logger.warning("in-process regroup by a new group: %s", refusal or "no store")
            return helper(*args, **kwargs)
        switchable = SwitchableStore(store)
        # Before the group exists: its listener and what it accepts are the group's.
        before = groupsockets.snapshot()
        made = helper(world_size, rank, args[2], backend, switchable, name, *args[6:],
                      **{**kwargs, "enable_reconfigure": True})
        group = made[0]
        timeout = kwargs.get("timeout") or DEFAULT_TIMEOUT
        took = connect(switchable, group, rank, world_size, timeout, str(name), before=before)
        global _regime
        _regime = Regime(group, switchable, c10d._world.group_count, str(name), took,
                         new_listeners(before))
        logger.info("in-process regroup by torch's reconfigure (%s, rank %d of %d, connected in "
                    "%.3f s)", backend, rank, world_size, took)
        return made

    new_process_group_helper.__elasticft_reconfigure__ = True  # type: ignore[attr-defined]
    c10d._new_process_group_helper = new_process_group_helper
    return True


def end_subgroups(regime: Regime) -> int:
    """Destroys every group of torch's table but the default one (aborted before), and sets
    torch's count of groups back; returns how many were destroyed."""
    c10d = dist.distributed_c10d
    others = [g for g in list(c10d._world.pg_map) if g is not regime.group]
    for group in others:
        try:
            dist.destroy_process_group(group)
        except Exception as e:  # an aborted group's destruction must not stop the regroup
            logger.warning("destroying an ended process group failed: %s", e)
    c10d._world.group_count = regime.group_count
    return len(others)


def regroup_in_place(regime: Regime, store: dist.Store, rank: int, world_size: int,
                     timeout_s: float) -> float:
    """Rebuilds the default group with the generation's members (``world_size`` of them), this
    process as ``rank``: its store switched to the generation's (``store``), the handles
    exchanged there; returns the reconfigure's own seconds."""
    regime.store.target = dist.PrefixStore(STORE_PREFIX, store)
    took = connect(regime.store, regime.group, rank, world_size, timedelta(seconds=timeout_s),
                   regime.name, own_listeners=regime.listeners)
    c10d = dist.distributed_c10d
    # torch's own map of the default group's ranks, which it writes only at init.
    c10d._world.pg_group_ranks[regime.group] = {i: i for i in range(world_size)}
    regime.rebuild_s = took
    return took
