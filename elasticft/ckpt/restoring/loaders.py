"""A data loader's draws at each epoch's start, so that the iterator a resume makes again draws
what the epoch's first one drew.

A ``DataLoader`` draws from an RNG each time it makes an iterator: the base seed of its worker
processes (from its own generator, or from torch's global RNG when it has none; each worker
seeds torch, numpy and Python from it, so every random augmentation drawn in a worker follows
from that one draw) and, for a sampler that shuffles from torch's RNG (``RandomSampler`` without
a generator), the epoch's order. A loop resumed at step ``s`` makes the epoch's iterator again and
skips its first batches, where an uninterrupted run made that iterator once, at the epoch's
start, and has drawn nothing since: the resumed workers would get other seeds (other
augmentations), and torch's RNG would be one draw further (other dropout masks) than the
snapshot of step ``s`` has it.

:class:`LoaderDraws` keeps, for one loader, the RNG states its current iterator drew from (torch's
and the loader's and samplers' generators, taken as each iterator is made) and whether that
iterator is part-way through its epoch. :class:`~elasticft.ckpt.restoring.state.StateCapture`
puts both in every snapshot (``StateCapture(model, optim, loaders=[loader])``); a restore arms
the loader, so that the next iterator it makes draws from the epoch start's states and leaves
torch's RNG as the restored step has it. A snapshot taken at an epoch's end (its iterator spent)
arms nothing: the next iterator is the next epoch's, made from the step's states as in an
uninterrupted run.

Not reproduced: a loader with ``persistent_workers`` keeps its worker processes, and their RNGs,
from epoch to epoch, which no resume can put back (a warning says so once); randomness drawn in
the training process while the skipped batches are read (``num_workers=0`` and a dataset that
draws) comes from the training's own RNG, and is drawn again by the skip.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

logger = logging.getLogger(__name__)

_armed: list[LoaderDraws] = []
"""The loaders of the newest ``StateCapture`` given any, in its order: the ones a restore arms."""


def loader_generators(loader: Any) -> list[torch.Generator]:
    """The generators of a data loader (torch's, or ``accelerate``'s ``DataLoaderShard``), its
    sampler and batch sampler and those they wrap, each once, in the order the same loader
    made again lists them."""
    found: dict[int, torch.Generator] = {}
    batches = getattr(loader, "batch_sampler", None)
    inner = getattr(batches, "batch_sampler", None)
    for owner in (loader, getattr(loader, "sampler", None), batches,
                  getattr(batches, "sampler", None), inner, getattr(inner, "sampler", None)):
        for name in ("generator", "synchronized_generator"):
            generator = getattr(owner, name, None)
            if isinstance(generator, torch.Generator):
                found.setdefault(id(generator), generator)
    return list(found.values())


class LoaderDraws:
    """One ``DataLoader``'s iterator making, watched: the RNG states each iterator drew from,
    and the states a restore wants its next one to draw from (see the module's text)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self._make = loader._get_iterator  # the class's, bound to this loader
        self.start = self._states()
        """torch's RNG state, then each generator's, as the current iterator was made."""
        self._iterator: Callable[[], Any] = lambda: None
        self._pending: list[torch.Tensor] | None = None
        # An instance attribute over DataLoader's method: __iter__ calls self._get_iterator().
        loader._get_iterator = self._make_iterator
        if getattr(loader, "persistent_workers", False) and loader.num_workers > 0:
            logger.warning(
                "elasticft: a DataLoader with persistent_workers=True keeps its workers' RNGs "
                "from epoch to epoch, which a resume cannot put back: augmentation drawn in its "
                "workers differs after a recovery (persistent_workers=False reproduces it)")

    @classmethod
    def of(cls, loader: Any) -> LoaderDraws:
        """The loader's watcher, made at its first call."""
        draws = loader.__dict__.get("_elasticft_draws")
        if draws is None:
            draws = cls(loader)
            loader.__dict__["_elasticft_draws"] = draws
        return draws

    def _states(self) -> list[torch.Tensor]:
        return [torch.get_rng_state(), *(g.get_state() for g in loader_generators(self.loader))]

    def _set_states(self, states: list[torch.Tensor]) -> None:
        torch.set_rng_state(states[0])
        for generator, state in zip(loader_generators(self.loader), states[1:], strict=True):
            generator.set_state(state)

    def mid_epoch(self) -> bool:
        """Whether the current iterator has batches left (a resume makes it again); an
        iterator of unknown length (an iterable dataset) counts as having some."""
        iterator = self._iterator()
        if iterator is None:
            return False
        try:
            return iterator._num_yielded < len(iterator)
        except TypeError:
            return True

    def generator_states(self) -> list[torch.Tensor]:
        return [g.get_state() for g in loader_generators(self.loader)]

    def resume(self, entry: Mapping[str, Any]) -> None:
        """Puts the generators where the snapshot has them and, when the snapshot's iterator
        was part-way through its epoch, arms the next iterator to draw from the epoch start's
        states."""
        generators = loader_generators(self.loader)
        count = len(generators)
        saved = sum(1 for key in entry if key.startswith("generator "))
        if saved != count:
            raise ValueError(
                f"a snapshot holds {saved} generator(s) for a data loader that has {count}: "
                "give StateCapture the same loaders, made the same way, as the run that saved it")
        for n, generator in enumerate(generators):
            generator.set_state(entry[f"generator {n}"])
        self._pending = None
        if entry.get("mid epoch"):
            self._pending = [entry["start torch"],
                             *(entry[f"start generator {n}"] for n in range(count))]

    def _make_iterator(self) -> Any:
        pending, self._pending = self._pending, None
        if pending is None:
            self.start = self._states()
            iterator = self._make()
        else:
            resumed = torch.get_rng_state()
            self._set_states(pending)
            self.start = pending
            iterator = self._make()
            if self.loader.num_workers > 0:
                # its workers were started, and a sampler's order drawn, by its first requests
                torch.set_rng_state(resumed)
            else:
                _put_back_after_first_index(iterator, resumed)
        self._iterator = weakref.ref(iterator)
        return iterator


def _put_back_after_first_index(iterator: Any, rng: torch.Tensor) -> None:
    """torch's RNG set to ``rng`` once ``iterator`` has drawn its first indices: a sampler
    without a generator (``RandomSampler``) draws the epoch's order from torch's RNG there, not
    when the iterator is made."""
    next_index = iterator._next_index

    def first_index() -> Any:
        del iterator._next_index  # the class's again
        try:
            return next_index()
        finally:
            torch.set_rng_state(rng)

    iterator._next_index = first_index


def watch(loaders: Any) -> list[LoaderDraws]:
    """The watchers of ``loaders``, which become the ones a restore arms."""
    draws = [LoaderDraws.of(loader) for loader in loaders]
    if draws:
        _armed[:] = draws
    return draws


def snapshot_entry(draws: LoaderDraws,
                   stable: Callable[[str, torch.Tensor], torch.Tensor], name: str
                   ) -> dict[str, Any]:
    """The snapshot's entry for one loader; ``stable`` copies a tensor into a buffer kept from
    call to call (see ``StateCapture``)."""
    entry: dict[str, Any] = {"mid epoch": draws.mid_epoch(),
                             "start torch": stable(f"{name} start torch", draws.start[0])}
    for n, state in enumerate(draws.start[1:]):
        entry[f"start generator {n}"] = stable(f"{name} start generator {n}", state)
    for n, state in enumerate(draws.generator_states()):
        entry[f"generator {n}"] = stable(f"{name} generator {n}", state)
    return entry


def resume_loaders(rng: Mapping[str, Any]) -> None:
    """Arms the watched loaders with a snapshot's entries (``loader 0``, ``loader 1``...); a
    snapshot without them (no loaders given when it was saved) arms none."""
    entries = [rng[key] for key in sorted((k for k in rng if k.startswith("loader ")),
                                          key=lambda k: int(k.split()[1]))]
    if not entries:
        return
    if len(entries) != len(_armed):
        raise ValueError(
            f"a snapshot holds the draws of {len(entries)} data loader(s), and this process's "
            f"StateCapture watches {len(_armed)}: give it the same loaders as the run that "
            "saved it")
    for draws, entry in zip(_armed, entries, strict=True):
        draws.resume(entry)
