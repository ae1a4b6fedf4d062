"""Turning a training state into a snapshot layout and back.

A state is a nested mapping (model and optimizer state dicts from
``torch.distributed.checkpoint.state_dict``, RNG states, JSON-able extras). It is flattened
with DCP's own ``DefaultSavePlanner`` so every item gets exactly the fully-qualified name,
global size and chunk offsets DCP would give it: a DTensor (FSDP2) contributes its local shard
with its place in the global tensor, a plain or DDP tensor the whole tensor. That is what lets
the durable tiers write a ``.metadata`` that ``dcp.load`` understands and reshards.

Tensors become byte ranges of the payload (64-byte aligned). Other leaves must be JSON values
(None, bool, int, float, str, lists, tuples and str-keyed dicts of those); tuples are tagged so
they come back as tuples. Nothing is pickled.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import math
from collections.abc import Mapping
from typing import Any

import torch

from elasticft.ckpt.api import SnapshotCorrupt, UnsupportedState

FORMAT_VERSION = 1
ALIGN = 64
_TUPLE_TAG = "__tuple__"
_FLOAT_TAG = "__float__"


def align_up(n: int, alignment: int = ALIGN) -> int:
    return (n + alignment - 1) // alignment * alignment


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise SnapshotCorrupt(f"unknown dtype {name!r} in a snapshot manifest")
    return dtype


# ----------------------------------------------------------------------------------------------
# JSON leaves.


def encode_json(value: Any, where: str) -> Any:
    """A JSON-safe form of a non-tensor leaf, or :class:`UnsupportedState` naming it."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {_FLOAT_TAG: repr(value)}
    if isinstance(value, tuple):
        return {_TUPLE_TAG: [encode_json(v, where) for v in value]}
    if isinstance(value, list):
        if all(type(v) is int for v in value):  # e.g. Python's RNG state, 625 ints every save
            return list(value)
        return [encode_json(v, where) for v in value]
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        if _TUPLE_TAG in value or _FLOAT_TAG in value:
            raise UnsupportedState(f"state key {where!r} uses a reserved key; rename it")
        return {k: encode_json(v, f"{where}.{k}") for k, v in value.items()}
    raise UnsupportedState(
        f"state item {where!r} is a {type(value).__name__}; a checkpoint holds tensors and "
        "JSON values only: convert it (e.g. to a tensor, list or dict of str keys)"
    )


def decode_json(value: Any) -> Any:
    if isinstance(value, list):
        return [decode_json(v) for v in value]
    if isinstance(value, dict):
        if _TUPLE_TAG in value:
            return tuple(decode_json(v) for v in value[_TUPLE_TAG])
        if _FLOAT_TAG in value:
            return float(value[_FLOAT_TAG])
        return {k: decode_json(v) for k, v in value.items()}
    return value


# ----------------------------------------------------------------------------------------------
# Layout.


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One tensor item: where it goes in the payload and where it sits in the global tensor."""

    fqn: str
    path: tuple[str | int, ...]
    tensor: torch.Tensor
    """The live local tensor (contiguous view of what is saved)."""
    global_size: tuple[int, ...]
    chunk_offsets: tuple[int, ...]
    offset: int = 0
    """Byte offset in the payload (in the owner's payload for an item another rank stores)."""
    replica_of: int | None = None
    """For replicated state: the rank whose snapshot stores this item (None: stored here)."""
    sharding: Mapping[str, Any] | None = None
    """For a DTensor's local shard: its mesh shape and placements (:func:`sharding_of`)."""

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def to_json(self) -> dict[str, Any]:
        item: dict[str, Any] = {
            "fqn": self.fqn,
            "path": list(self.path),
            "kind": "tensor",
            "dtype": dtype_name(self.tensor.dtype),
            "shape": list(self.tensor.shape),
            "global_size": list(self.global_size),
            "chunk_offsets": list(self.chunk_offsets),
            "nbytes": self.nbytes,
        }
        if self.sharding is not None:
            item["sharding"] = dict(self.sharding)
        if self.replica_of is None:
            item["offset"] = self.offset
        else:
            # A distinct key: code that reads "offset" from this rank's payload must not find one.
            item["replica_of"] = self.replica_of
            item["replica_offset"] = self.offset
        return item


@dataclasses.dataclass(frozen=True)
class Layout:
    """A flattened state: tensor entries placed in a payload, and JSON leaves."""

    tensors: tuple[TensorEntry, ...]
    values: tuple[dict[str, Any], ...]
    payload_bytes: int
    tensors_json: str = ""
    """The tensor items' JSON, computed once per placement (the manifest is rebuilt per save)."""
    replica_regions: tuple[int, ...] = ()
    """Deduplicated layouts: bytes at the start of each rank's payload that hold its share of
    the replicated items (empty: nothing deduplicated)."""
    values_json: str = ""
    """The value items' JSON when the flattener already encoded it (else encoded here)."""
    guarded_items: tuple[int, ...] = ()
    """Indices of the tensor items only ``optimizer.step()`` changes (parameters and optimizer
    state): what data-parallel replicas hold bit-identical, fingerprinted by the agent
    (:mod:`elasticft.ckpt.integrity.fingerprint`)."""

    def manifest_bytes(self, step: int, rank: int, world_size: int) -> bytes:
        """``manifest_bytes(self.manifest(...))`` without re-encoding the tensor items."""
        tensors = self.tensors_json or _items_json([t.to_json() for t in self.tensors])
        values = self.values_json or _items_json(list(self.values))
        items = ",".join(part for part in (tensors, values) if part)
        regions = (f'"replica_regions":{list(self.replica_regions)},'
                   if self.replica_regions else "")
        guarded = f'"guarded":{list(self.guarded_items)},' if self.guarded_items else ""
        return (
            f'{{"format":{FORMAT_VERSION},"step":{int(step)},"rank":{int(rank)},'
            f'"world_size":{int(world_size)},"payload_bytes":{self.payload_bytes},'
            f'{regions}{guarded}"items":[{items}]}}'
        ).encode()

    def manifest(self, step: int, rank: int, world_size: int) -> dict[str, Any]:
        manifest: dict[str, Any] = {
            "format": FORMAT_VERSION,
            "step": step,
            "rank": rank,
            "world_size": world_size,
            "payload_bytes": self.payload_bytes,
            "items": [t.to_json() for t in self.tensors] + list(self.values),
        }
        if self.replica_regions:
            manifest["replica_regions"] = list(self.replica_regions)
        if self.guarded_items:
            manifest["guarded"] = list(self.guarded_items)
        return manifest

    def signature(self) -> tuple[Any, ...]:
        """Equal for two layouts whose tensors fit the same payload places."""
        return tuple((t.fqn, t.tensor.dtype, tuple(t.tensor.shape)) for t in self.tensors)


def flatten(state: Mapping[str, Any]) -> Layout:
    """Lays ``state`` out as DCP would name it; tensors keep aliasing the live state."""
    if not isinstance(state, Mapping):
        raise UnsupportedState(f"state must be a dict, got {type(state).__name__}")
    # Here, not at import: the agent reads snapshots through this module and never plans one,
    # and torch.distributed.checkpoint costs it over a second of CPU at every launch.
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    planner = DefaultSavePlanner()
    planner.set_up_planner(dict(state), storage_meta=None, is_coordinator=False)
    plan = planner.create_local_plan()
    mappings: Mapping[str, tuple[str | int, ...]] = getattr(planner, "mappings", {}) or {}
    tensors: list[TensorEntry] = []
    values: list[dict[str, Any]] = []
    offset = 0
    seen: set[str] = set()
    for item in plan.items:
        fqn = item.index.fqn
        if fqn in seen:
            raise UnsupportedState(f"state item {fqn!r} has more than one local shard; unsupported")
        seen.add(fqn)
        path = tuple(mappings.get(fqn, (fqn,)))
        obj = planner.lookup_object(item.index)
        if item.type == WriteItemType.BYTE_IO:
            values.append(
                {"fqn": fqn, "path": list(path), "kind": "json", "value": encode_json(obj, fqn)}
            )
            continue
        source = planner.state_dict.get(fqn)
        tensor = obj.detach()
        if tensor.device.type not in ("cpu", "cuda"):
            # Another accelerator: a host copy now. CUDA tensors stay live; the checkpointer
            # copies them off the training stream (elasticft.ckpt.memory.device).
            tensor = tensor.cpu()
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        assert item.tensor_data is not None
        entry = TensorEntry(
            fqn=fqn,
            path=path,
            tensor=tensor,
            global_size=tuple(item.tensor_data.size),
            chunk_offsets=tuple(item.tensor_data.chunk.offsets),
            offset=offset,
            sharding=sharding_of(source),
        )
        tensors.append(entry)
        offset = align_up(offset + entry.nbytes)
    return Layout(tuple(tensors), tuple(values), offset,
                  _items_json([t.to_json() for t in tensors]))


def sharding_of(value: Any) -> dict[str, Any] | None:
    """How a DTensor is laid out over its mesh, as the manifest records it; None for a plain
    tensor. Placements are torch's short forms (``S(0)`` sharded on dim 0, ``R`` replicated),
    compared as text when a snapshot is restored into a live DTensor."""
    mesh = getattr(value, "device_mesh", None)
    placements = getattr(value, "placements", None)
    if mesh is None or placements is None:
        return None
    return {"mesh": list(mesh.shape), "placements": [str(p) for p in placements]}


@dataclasses.dataclass(frozen=True)
class ReplicaPlacement:
    """Where every tensor of a deduplicated layout goes, computed once per layout."""

    offsets: tuple[int, ...]
    owners: tuple[int | None, ...]
    payload_bytes: int
    regions: tuple[int, ...]
    tensors_json: str


def place_replicas(layout: Layout, replicated: tuple[bool, ...], rank: int,
                   world_size: int) -> ReplicaPlacement:
    """Splits the replicated tensors of ``layout`` into ``world_size`` shares by bytes.

    Every data-parallel rank holds the same replicated tensors, so one copy across the ranks
    suffices. The partition is deterministic (layout order, contiguous runs of about
    ``1/world_size`` of the bytes each), so every rank computes the same owners without talking
    to the others. A rank's payload starts with its own share (its *replica region*, which it
    sends whole when a rank that lost its copy reassembles), followed by the items that are
    not replicated. Items owned by another rank record their offset in the owner's payload.
    """
    sizes = [e.nbytes if rep else 0 for e, rep in zip(layout.tensors, replicated, strict=True)]
    total = sum(sizes)
    owners: list[int | None] = []
    seen = 0
    for e, rep in zip(layout.tensors, replicated, strict=True):
        if rep and total:
            # The share that holds the item's first byte: contiguous runs of ~total/world bytes.
            owners.append(min(world_size - 1, seen * world_size // total))
            seen += e.nbytes
        else:
            owners.append(None)
    region_ends = [0] * world_size
    offsets: list[int] = []
    for e, owner in zip(layout.tensors, owners, strict=True):
        if owner is None:
            offsets.append(-1)
            continue
        offsets.append(region_ends[owner])
        region_ends[owner] = align_up(region_ends[owner] + e.nbytes)
    end = region_ends[rank]
    for i, (e, owner) in enumerate(zip(layout.tensors, owners, strict=True)):
        if owner is None:
            offsets[i] = end
            end = align_up(end + e.nbytes)
    entries = [
        dataclasses.replace(e, offset=off, replica_of=None if owner in (None, rank) else owner)
        for e, off, owner in zip(layout.tensors, offsets, owners, strict=True)
    ]
    return ReplicaPlacement(tuple(offsets), tuple(owners), end, tuple(region_ends),
                            _items_json([e.to_json() for e in entries]))


def deduplicated(layout: Layout, placement: ReplicaPlacement, rank: int) -> Layout:
    """``layout`` with the placement of :func:`place_replicas` applied."""
    entries = tuple(
        dataclasses.replace(e, offset=off, replica_of=None if owner in (None, rank) else owner)
        for e, off, owner in zip(layout.tensors, placement.offsets, placement.owners,
                                 strict=True)
    )
    return Layout(entries, layout.values, placement.payload_bytes, placement.tensors_json,
                  placement.regions, layout.values_json)


def _items_json(items: list[dict[str, Any]]) -> str:
    return json.dumps(items, separators=(",", ":"), allow_nan=False)[1:-1]


_SCALAR_TYPES = frozenset({int, float, str, bool, type(None)})
_LEAF_TYPES = _SCALAR_TYPES | {torch.Tensor, torch.nn.Parameter}
_DICT_TYPES = frozenset({dict, collections.OrderedDict})


def _memoizable(value: Any) -> bool:
    """A scalar, or a list of ints only: values whose JSON text equality can tell cheaply."""
    if type(value) in _SCALAR_TYPES:
        return True
    return type(value) is list and all(type(v) is int for v in value)


def _same_json(old: Any, new: Any) -> bool:
    # Types first: 1, 1.0 and True are equal in Python but not in JSON. Two lists reaching
    # here hold ints only (see _memoizable).
    return type(old) is type(new) and old == new


def walk_leaves(state: Mapping[str, Any]) -> list[tuple[tuple[str | int, ...], Any]]:
    """Leaves in DCP's traversal order and granularity (``traverse_state_dict``'s rules)."""
    leaves: list[tuple[tuple[str | int, ...], Any]] = []

    def terminal(value: Any) -> bool:
        if isinstance(value, Mapping):
            return False
        if not isinstance(value, list):
            return True
        for entry in value:
            if type(entry) in _SCALAR_TYPES:  # the common case (an RNG state): no checks
                continue
            if isinstance(entry, torch.Tensor):
                return False
            if isinstance(entry, Mapping | list) and not terminal(entry):
                return False
        return True

    def visit(path: tuple[str | int, ...], value: Any) -> None:
        kind = type(value)
        # Exact-type checks first: most leaves are plain tensors and scalars, most inner nodes
        # plain dicts, and the ABC isinstance checks cost more than the rest of the walk.
        if kind in _LEAF_TYPES:
            leaves.append((path, value))
        elif kind in _DICT_TYPES or isinstance(value, Mapping):
            for k, v in value.items():
                visit((*path, str(k)), v)
        elif terminal(value):
            leaves.append((path, value))
        elif isinstance(value, list | tuple):
            for i, v in enumerate(value):
                visit((*path, i), v)

    for key, value in state.items():
        visit((str(key),), value)
    return leaves


class Flattener:
    """:func:`flatten` with the layout reused while the state keeps its structure.

    DCP's planner costs tens of milliseconds per call on a large state; the training thread pays
    it on every save. The first call runs the planner and checks that a plain walk finds the same
    items; later calls walk the state (well under a millisecond) and reuse the placement when
    names, shapes and dtypes are unchanged. States with DTensors always go through the planner.
    When the state holds the very same tensor objects as last time (what
    :class:`~elasticft.ckpt.restoring.state.StateCapture` returns on every step), even the entries
    are reused and only the JSON values are encoded again: the save is then a walk and a compare.
    """

    def __init__(self) -> None:
        self._layout: Layout | None = None
        self._signature: tuple[Any, ...] | None = None
        self._sources: list[tuple[torch.Tensor, torch.Size, torch.dtype]] = []
        """The tensor leaves (walk order) that the cached entries hold, object for object."""
        self._paths: list[tuple[str | int, ...]] = []
        self._fragments: dict[str, tuple[Any, str]] = {}
        """Value items' JSON by fqn, with the value it encodes (see :meth:`_values_json`)."""

    def __call__(self, state: Mapping[str, Any]) -> Layout:
        leaves = walk_leaves(state)
        cached = self._layout
        if cached is not None and self._same_tensors(leaves):
            return self._revalue(cached, leaves)
        signature = tuple(
            (path, v.dtype, tuple(v.shape)) if isinstance(v, torch.Tensor) else (path, None, None)
            for path, v in leaves
        )
        if cached is not None and signature == self._signature:
            layout = self._reuse(cached, leaves)
            self._remember_sources(layout, leaves)
            return layout
        layout = flatten(state)
        plain = all(
            type(v) is torch.Tensor or not isinstance(v, torch.Tensor) for _, v in leaves
        )
        fqns = [".".join(map(str, path)) for path, _ in leaves]
        if plain and sorted(fqns) == sorted(
            [t.fqn for t in layout.tensors] + [v["fqn"] for v in layout.values]
        ):
            self._layout, self._signature = layout, signature
        else:
            self._layout, self._signature = None, None
        self._sources, self._paths = [], []
        return layout

    def _same_tensors(self, leaves: list[tuple[tuple[str | int, ...], Any]]) -> bool:
        """Whether ``leaves`` are the cached entries' tensors, unchanged in shape and dtype."""
        sources = self._sources
        if not sources or len(leaves) != len(self._paths):
            return False
        tensors = [v for _, v in leaves if isinstance(v, torch.Tensor)]
        if len(tensors) != len(sources):
            return False
        for tensor, (source, shape, dtype) in zip(tensors, sources, strict=True):
            # The same object can still be given other storage (set_), hence shape and dtype.
            if (tensor is not source or tensor.shape != shape or tensor.dtype != dtype
                    or not tensor.is_contiguous()):
                return False
        return [path for path, _ in leaves] == self._paths

    def _remember_sources(self, layout: Layout,
                          leaves: list[tuple[tuple[str | int, ...], Any]]) -> None:
        self._layout = layout
        by_path = dict(leaves)
        if all(entry.tensor is by_path[entry.path] for entry in layout.tensors):
            self._sources = [(v, v.shape, v.dtype) for _, v in leaves
                             if isinstance(v, torch.Tensor)]
            self._paths = [path for path, _ in leaves]
        else:
            self._sources, self._paths = [], []

    def _revalue(self, cached: Layout,
                 leaves: list[tuple[tuple[str | int, ...], Any]]) -> Layout:
        by_path = {path: v for path, v in leaves if not isinstance(v, torch.Tensor)}
        values = tuple(
            dict(v, value=encode_json(by_path[tuple(v["path"])], v["fqn"])) for v in cached.values
        )
        return Layout(cached.tensors, values, cached.payload_bytes, cached.tensors_json,
                      values_json=self._values_json(values))

    def _values_json(self, values: tuple[dict[str, Any], ...]) -> str:
        """The value items' JSON, reusing the text of each item whose value did not change
        since the last save. Python's RNG state (625 ints) is most of a small model's manifest
        and changes only when ``random`` is used; the optimizer's hyperparameters rarely do."""
        fragments: dict[str, tuple[Any, str]] = {}
        parts = []
        for item in values:
            value = item["value"]
            if _memoizable(value):
                known = self._fragments.get(item["fqn"])
                text = known[1] if known is not None and _same_json(known[0], value) \
                    else _items_json([item])
                fragments[item["fqn"]] = (value, text)
            else:
                text = _items_json([item])
            parts.append(text)
        self._fragments = fragments
        return ",".join(parts)

    @staticmethod
    def _reuse(cached: Layout, leaves: list[tuple[tuple[str | int, ...], Any]]) -> Layout:
        by_path = dict(leaves)
        tensors = []
        for entry in cached.tensors:
            tensor = by_path[entry.path]
            if tensor.requires_grad:
                tensor = tensor.detach()
            if not tensor.is_contiguous():
                tensor = tensor.contiguous()
            tensors.append(dataclasses.replace(entry, tensor=tensor))
        values = tuple(
            dict(v, value=encode_json(by_path[tuple(v["path"])], v["fqn"])) for v in cached.values
        )
        return Layout(tuple(tensors), values, cached.payload_bytes, cached.tensors_json)


# ----------------------------------------------------------------------------------------------
# Reading back.


def tensor_view(payload: Any, item: Mapping[str, Any]) -> torch.Tensor:
    """The tensor of a manifest item, aliasing ``payload`` (no copy)."""
    dtype = dtype_from_name(item["dtype"])
    shape = tuple(item["shape"])
    numel = math.prod(shape)
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    try:
        flat = torch.frombuffer(payload, dtype=dtype, count=numel, offset=int(item["offset"]))
    except (ValueError, RuntimeError) as e:
        raise SnapshotCorrupt(f"item {item['fqn']!r} lies outside the payload: {e}") from None
    return flat.view(shape)


def set_path(root: dict[str, Any], path: tuple[str | int, ...], value: Any) -> None:
    """Puts ``value`` at ``path``, creating dicts (str keys) and lists (int keys) on the way."""
    node: Any = root
    for key, nxt in itertools.pairwise(path):
        empty: Any = [] if isinstance(nxt, int) else {}
        if isinstance(node, list):
            assert isinstance(key, int)
            while len(node) <= key:
                node.append(None)
            if node[key] is None:
                node[key] = empty
            node = node[key]
        else:
            node = node.setdefault(key, empty)
    last = path[-1]
    if isinstance(node, list):
        assert isinstance(last, int)
        while len(node) <= last:
            node.append(None)
        node[last] = value
    else:
        node[last] = value


def stored_here(item: Mapping[str, Any]) -> bool:
    """False for a replicated item whose bytes another rank's snapshot holds."""
    return item.get("replica_of") is None


def unflatten(snapshot_manifest: Mapping[str, Any], payload: Any, *, copy: bool,
              replicas: Mapping[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """The nested state of a snapshot; with ``copy`` the tensors own their memory.

    ``replicas`` supplies the items another rank stores (see :func:`place_replicas`).
    """
    state: dict[str, Any] = {}
    for item in snapshot_manifest["items"]:
        path = tuple(item["path"])
        if item["kind"] == "tensor" and not stored_here(item):
            if replicas is None or item["fqn"] not in replicas:
                raise SnapshotCorrupt(f"item {item['fqn']!r} is stored by rank "
                                      f"{item['replica_of']} and was not reassembled")
            set_path(state, path, replicas[item["fqn"]])
        elif item["kind"] == "tensor":
            tensor = tensor_view(payload, item)
            set_path(state, path, tensor.clone() if copy else tensor)
        else:
            set_path(state, path, decode_json(item["value"]))
    return state


def manifest_bytes(manifest: Mapping[str, Any]) -> bytes:
    return json.dumps(manifest, separators=(",", ":"), allow_nan=False).encode()
