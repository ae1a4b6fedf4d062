"""DDP's gradient buckets carried over an in-process recovery, so that the DDP a training
function re-makes sums its gradients as the one before the failure did.

``DistributedDataParallel`` all-reduces its gradients in buckets: flat buffers that hold the
gradients one after the other. It starts with a guess of their layout (one bucket of every
gradient, in the order of the parameters) and, after its first iteration, lays them out again in
the order in which the gradients became ready in that iteration's backward (the *rebuild*, the
same layout on every rank: rank 0's). With 3 or more ranks the layout decides the order of each
element's sum: a ring all-reduce (gloo's, NCCL's) splits the buffer into one chunk per rank and
starts each chunk's sum at another rank, so an element sums the ranks' values in an order set by
its offset in the buffer. Floating-point addition is not associative: a gradient that moves in
the buffer changes in its last bits.

A training function under :meth:`elasticft.inprocess.worker.InProcess.run` wraps its module in
a new DDP on every entry (the old one is bound to the group that ended). Left to itself, that
DDP's first step, the step redone after the failure, would use the guess while the run before
the failure had long been on the rebuilt layout: the losses would differ from an uninterrupted
run's by a unit or two in the last place from that step on (with 2 ranks a sum of two is the
same in either order, and those runs are bit-exact anyway).

While :meth:`~elasticft.inprocess.worker.InProcess.run` is armed, :class:`BucketLayouts`
remembers each DDP's rebuilt layout (the rank's parameter indices per bucket and the buckets'
sizes, from DDP's own logging data, once its rebuild is logged) under the shapes of its
parameters. A DDP made in a later generation starts with that layout instead of the guess: its
ranks gather what each remembers for their parameters' shapes, in every generation (one small
all-gather per DDP made: a replacement, a new process, remembers nothing, nor does a standby's
new worker; the survivors hold the layout every rank had), and the first that has one gives it
to all. Its first step then sums as the uninterrupted run's step did, and its own
rebuild after that step, from the same backward order, lays the buckets out the same way again.
The script does nothing for it. A DDP whose rebuild was not yet logged when its generation ended
(a failure in its first three steps) leaves nothing to carry: the next one starts with torch's
guess, as without this module.

A restart ends every process, and with them what they remembered: a restart that follows an
in-process recovery (a second failure during it, the same fault again) would start every rank's
DDP with the guess again. So each layout is also written, once, to the node's run directory
(``ELASTICFT_RUN_DIR``, which outlives the attempts; one small JSON file per DDP signature), and
a rank that remembers none reads it from there before the ranks agree, in a restarted attempt
only: a new launch over the same run directory starts as an uninterrupted run starts.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

Signature = tuple[tuple[tuple[int, ...], str], ...]
"""The shapes and dtypes of a DDP's parameters, in its order: which DDP a layout was for."""
Layout = tuple[list[list[int]], list[int]]
"""The parameter indices of each bucket, and each bucket's size in bytes (DDP's own terms)."""


def signature_of(parameters: Sequence[Any]) -> Signature:
    return tuple((tuple(p.shape), str(p.dtype)) for p in parameters)


def rebuilt_layout(logging_data: dict[str, Any]) -> Layout | None:
    """The rebuilt layout DDP's logger reports (``'5 4 3, 2, 1 0'`` and ``'104, 256, 160'``),
    or None before its rebuild was logged."""
    indices = logging_data.get("rebuilt_per_bucket_param_indices")
    sizes = logging_data.get("rebuilt_bucket_sizes")
    if not indices or not sizes:
        return None
    return ([[int(i) for i in bucket.split()] for bucket in str(indices).split(",")],
            [int(size) for size in str(sizes).split(",")])


def encode(layout: Layout | None, count: int) -> list[int]:
    """``layout`` of ``count`` parameters as ``2 + 3 * count`` integers, the same length on
    every rank: whether there is one, the number of buckets, then (each padded to ``count``)
    the buckets' lengths, their sizes, and the parameter indices bucket after bucket."""
    if layout is None:
        return [0] * (2 + 3 * count)
    buckets, sizes = layout

    def padded(values: list[int]) -> list[int]:
        return values + [0] * (count - len(values))

    return [1, len(buckets), *padded([len(b) for b in buckets]), *padded(sizes),
            *padded([i for bucket in buckets for i in bucket])]


def decode(row: Sequence[int], count: int) -> Layout | None:
    """What :func:`encode` made."""
    if not row[0]:
        return None
    number = row[1]
    lengths, sizes = row[2:2 + number], row[2 + count:2 + count + number]
    indices = iter(row[2 + 2 * count:])
    return [[next(indices) for _ in range(length)] for length in lengths], list(sizes)


class BucketLayouts:
    """The rebuilt bucket layouts of the DDPs made while in-process recovery is armed, by
    :data:`Signature`, given to the DDPs of later generations (:meth:`arm`)."""

    def __init__(self, directory: Path | None = None, read_kept: bool = False) -> None:
        self.rebuilt: dict[Signature, Layout] = {}
        self.directory = directory
        """Where the layouts are written for the processes of a later attempt (None: not)."""
        self.read_kept = read_kept
        """Whether this process is such a later attempt's, which reads them."""

    @classmethod
    def of_this_node(cls) -> BucketLayouts:
        """Layouts kept in the run directory the agent gives its workers, if it gives one,
        and read back in an attempt after the first (``ELASTICFT_ATTEMPT``)."""
        run_dir = os.environ.get("ELASTICFT_RUN_DIR")
        return cls(Path(run_dir) / "ddp-layouts" if run_dir else None,
                   read_kept=os.environ.get("ELASTICFT_ATTEMPT", "0") != "0")

    def _path(self, signature: Signature) -> Path | None:
        if self.directory is None:
            return None
        return self.directory / f"{hashlib.sha1(repr(signature).encode()).hexdigest()}.json"

    def _keep(self, signature: Signature, layout: Layout) -> None:
        """Writes ``layout`` for a later attempt's processes (atomically; every rank may)."""
        path = self._path(signature)
        if path is None or path.exists():
            return
        with contextlib.suppress(OSError):  # then a restart starts with torch's guess
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary = path.with_suffix(f".{os.getpid()}.tmp")
            temporary.write_text(json.dumps([repr(signature), layout[0], layout[1]]))
            temporary.replace(path)

    def _kept(self, signature: Signature) -> Layout | None:
        """The layout a process of an earlier attempt wrote for ``signature``, if any."""
        path = self._path(signature)
        if path is None or not self.read_kept:
            return None
        try:
            written, indices, sizes = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return (indices, sizes) if written == repr(signature) else None

    def arm(self, on_made: Callable[[Any, Sequence[Any]], None] | None = None
            ) -> Callable[[], None]:
        """Wraps DDP's bucket set-up so that it starts with a carried layout and remembers its
        rebuilt one, until the returned function is called. ``on_made(ddp, parameters)`` hears
        of each DDP made meanwhile, with the parameters it synchronises."""
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        set_up = DistributedDataParallel._ddp_init_helper
        assign = dist._compute_bucket_assignment_by_size
        layouts = self

        @functools.wraps(set_up)
        def carried_set_up(ddp: Any, parameters: Sequence[Any], *args: Any,
                           **kwargs: Any) -> Any:
            carried = layouts.agreed(parameters, ddp.process_group)
            if carried is not None:  # DDP reverses the buckets it is given: hand them reversed
                dist._compute_bucket_assignment_by_size = lambda *_a, **_k: (
                    carried[0][::-1], carried[1][::-1])
            try:
                made = set_up(ddp, parameters, *args, **kwargs)
            finally:
                dist._compute_bucket_assignment_by_size = assign
            layouts.remember_when_rebuilt(ddp, signature_of(parameters))
            if on_made is not None:
                on_made(ddp, parameters)
            return made

        DistributedDataParallel._ddp_init_helper = carried_set_up  # type: ignore[method-assign]

        def undo() -> None:
            DistributedDataParallel._ddp_init_helper = set_up  # type: ignore[method-assign]

        return undo

    def agreed(self, parameters: Sequence[Any], group: Any) -> Layout | None:
        """The layout the first rank of ``group`` that remembers one for ``parameters`` has.
        Every rank gathers, in every generation: a rank cannot tell from its own generation
        whether another remembers one (a standby's new workers start in the first). The
        layouts travel as tensors on the parameters' device, as DDP's own checks do."""
        import torch
        import torch.distributed as dist

        count = len(parameters)
        device = parameters[0].device if count else torch.device("cpu")
        signature = signature_of(parameters)
        remembered = self.rebuilt.get(signature) or self._kept(signature)
        mine = torch.tensor(encode(remembered, count), dtype=torch.int64, device=device)
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(everyone, mine, group=group)
        return next((layout for row in torch.stack(everyone).tolist()
                     if (layout := decode(row, count)) is not None), None)

    def remember_when_rebuilt(self, ddp: Any, signature: Signature) -> None:
        """Reads ``ddp``'s rebuilt layout at the first forward after its rebuild was logged."""
        if getattr(ddp, "find_unused_parameters", False) and not getattr(ddp, "static_graph",
                                                                         False):
            return  # a DDP that never rebuilds: its guess is its layout in every generation
        remembered = weakref.ref(self)

        def read(module: Any, _inputs: Any) -> None:
            layouts = remembered()
            layout = rebuilt_layout(module._get_ddp_logging_data())
            if layouts is None or layout is not None:
                hook.remove()
            if layouts is not None and layout is not None:
                layouts.rebuilt[signature] = layout
                layouts._keep(signature, layout)

        hook = ddp.register_forward_pre_hook(read)
