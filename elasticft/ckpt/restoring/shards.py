"""Putting a stored local shard back where it came from: into the live DTensor of the same
name, on the same mesh, with the same placements.

A DTensor (a parameter under FSDP2's ``fully_shard``, a tensor-parallel weight, their optimizer
state) is saved as this rank's *local shard*, with the global shape and the shard's offsets in
it that DCP gives it, and the mesh shape and placements (``S(0)``, ``R``) it had
(:func:`~elasticft.ckpt.snapshot.sharding_of`). A restore at the same world size and sharding
copies each shard into the live DTensor's local tensor. Where torch's ``set_state_dict`` does the
work instead (a snapshot that does not match the live state item for item, a state returned
by ``load()``), the plain local tensors are first wrapped as DTensors of the live tensors'
spec (:func:`into_live`): handed over plain, torch would take a shard for the whole tensor
("size mismatch ... [256, 256] from checkpoint, [512, 256] in current model").

Nothing here reshards. A snapshot whose global shape, shard offsets or placements differ from
the live tensor's raises :class:`~elasticft.ckpt.api.StateMismatch` naming the tensor, both
layouts and the likely cause; a durable checkpoint is resharded by ``dcp.load``
(:func:`elasticft.ckpt.restoring.state.reshard_from_disk`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from elasticft.ckpt.api import StateMismatch
from elasticft.ckpt.snapshot import dtype_from_name, sharding_of


def is_dtensor(value: Any) -> bool:
    return isinstance(value, DTensor)


def local_of(value: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard, a plain tensor itself."""
    return value.to_local() if isinstance(value, DTensor) else value


def storage_key(value: torch.Tensor) -> tuple[Any, ...]:
    """Equal for two views of the same local memory (a parameter and its ``detach()``)."""
    local = local_of(value)
    return (local.untyped_storage().data_ptr(), local.storage_offset(), local.dtype,
            tuple(local.shape), tuple(value.shape))


def _describe(shape: Any, global_size: Any, sharding: Mapping[str, Any] | None) -> str:
    if sharding is None:
        return f"a whole tensor of shape {list(shape)}"
    return (f"a shard of shape {list(shape)} of a {list(global_size)} tensor "
            f"(placements {sharding['placements']} on a mesh of {sharding['mesh']})")


def mismatch(fqn: str, item: Mapping[str, Any], live: torch.Tensor) -> StateMismatch | None:
    """Why the snapshot item ``item`` cannot be restored into ``live`` (None: it can)."""
    saved_global = list(item.get("global_size", item["shape"]))
    saved_sharding = item.get("sharding")
    if list(live.shape) != saved_global:
        cause = "the checkpoint is of another model (or of another configuration of it)"
    elif is_dtensor(live):
        assert isinstance(live, DTensor)
        # Same global shape, mesh and placements at the same rank: the same shard.
        if (list(local_of(live).shape) == list(item["shape"])
                and saved_sharding in (None, sharding_of(live))):
            return None
        cause = ("the model is sharded differently than when it was saved (another mesh or "
                 "placement): shard it as it was saved, or read the durable checkpoint with "
                 "dcp.load, which reshards (elasticft ckpt export gives a plain DCP directory)")
    elif list(item["shape"]) != saved_global:
        cause = ("the checkpoint holds a shard (saved under FSDP2 or tensor parallelism) and the "
                 "model is not sharded: shard the model as it was when saved before restoring")
    else:
        return None
    live_sharding = sharding_of(live)
    return StateMismatch(
        f"checkpoint item {fqn!r} is {_describe(item['shape'], saved_global, saved_sharding)}; "
        f"the live one is {_describe(local_of(live).shape, live.shape, live_sharding)}: "
        f"{cause}")


def into_live(fqn: str, value: torch.Tensor, live: torch.Tensor,
              item: Mapping[str, Any] | None = None) -> torch.Tensor:
    """``value`` in the form torch's ``set_state_dict`` needs for ``live``.

    For a DTensor: a local shard (``value``'s shape is the live local shape) becomes a DTensor
    of the live spec, a whole tensor is sliced to this rank's shard (no communication). With the
    snapshot ``item`` the shard's layout is checked first; anything else raises
    :class:`StateMismatch`.
    """
    if item is not None:
        error = mismatch(fqn, item, live)
        if error is not None:
            raise error
    if not is_dtensor(live) or is_dtensor(value):
        if item is None and tuple(value.shape) != tuple(live.shape):
            raise _shape_error(fqn, value, live)
        return value
    assert isinstance(live, DTensor)
    if tuple(value.shape) == tuple(local_of(live).shape) and (
            item is not None or tuple(value.shape) != tuple(live.shape)):
        return DTensor.from_local(value, live.device_mesh, live.placements, run_check=False,
                                  shape=live.shape, stride=live.stride())
    if tuple(value.shape) == tuple(live.shape):
        return distribute_tensor(value, live.device_mesh, live.placements, src_data_rank=None)
    raise _shape_error(fqn, value, live)


def _shape_error(fqn: str, value: torch.Tensor, live: torch.Tensor) -> StateMismatch:
    return StateMismatch(
        f"checkpoint item {fqn!r} has shape {list(value.shape)}; the live one is "
        f"{_describe(local_of(live).shape, live.shape, sharding_of(live))}: the checkpoint is "
        "of another model, or was saved with another sharding or world size")


def like_param(param: torch.Tensor, item: Mapping[str, Any]) -> torch.Tensor | None:
    """Uninitialized optimizer state for ``item`` in the DTensor spec of ``param``, when the
    item is a shard of a tensor of the parameter's shape (Adam's moments); None otherwise."""
    if not is_dtensor(param) or list(item.get("global_size", ())) != list(param.shape):
        return None
    value = torch.empty_like(param, dtype=dtype_from_name(item["dtype"]))
    return value if list(local_of(value).shape) == list(item["shape"]) else None
