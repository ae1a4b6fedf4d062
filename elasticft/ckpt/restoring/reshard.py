"""Restoring a durable checkpoint written at another world size: resharding by ``dcp.load``.

Every tier serves a rank its own snapshot, which fits only the same rank of a job of the same
world size. After an elastic job shrank or grew, no rank has one; without this a restart began
from scratch. The durable tiers hold more than per-rank snapshots: each committed step has DCP's
``.metadata`` (every tensor's global shape and where each shard lies), so ``dcp.load`` can read
any part of any tensor. A restore then creates the optimizer state the checkpoint holds, in the
live parameters' layout (a DTensor's shard for FSDP2 and tensor parallel, the whole tensor
otherwise), lets ``dcp.load`` fill the model and optimizer tensors in place, and takes the
optimizer's hyperparameters and the extras from rank 0's manifest. RNG states are per rank and
not carried over to another world size. ``dcp.load`` checks no checksums, so the ranks first
re-read every shard of the step between them (:func:`verify_share`); a damaged step gives way
to an older one. Deduplicated checkpoints (each replica stored once) load
the same way.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp

from elasticft.ckpt.api import CheckpointError
from elasticft.ckpt.persisting import durable
from elasticft.ckpt.restoring.shards import is_dtensor, local_of
from elasticft.ckpt.snapshot import decode_json, set_path

logger = logging.getLogger(__name__)


def other_world_steps(roots: list[Path], world_size: int) -> dict[int, Path]:
    """Committed steps written at another world size, with the first of ``roots`` holding each.
    Only steps with every rank's shard count (a node's local directory of a multi-node job holds
    its own ranks' only)."""
    found: dict[int, Path] = {}
    for root in roots:
        for step, info in durable.committed_steps(root).items():
            written = info.get("world_size")
            if written != world_size and set(info.get("ranks", ())) == set(range(written or 0)):
                found.setdefault(step, durable.step_dir(root, step))
    return found


def verify_share(directory: Path, rank: int, world_size: int) -> bool:
    """Whether the shards this rank checks (every ``world_size``-th from ``rank``) read back
    with their checksums: ``dcp.load`` checks none, so each rank checks its share first."""
    info = durable.commit_info(directory) or {}
    for shard in sorted(info.get("ranks", ()))[rank::world_size]:
        try:
            durable.read_rank_shard(directory, shard)
        except (OSError, CheckpointError) as e:
            logger.warning("%s: rank %d's shard is unusable for resharding: %s", directory,
                           shard, e)
            return False
    return True


def restore_resharded(directory: Path, live: Any) -> dict[str, Any]:
    """Loads the committed step in ``directory`` into ``live`` (a
    :class:`~elasticft.ckpt.restoring.state.LiveState`) at this world size; returns its extras.
    Collective: every rank calls it with the same step."""
    from elasticft.ckpt.restoring.state import capture, restore

    manifest = durable.read_rank_manifest(directory, 0)
    live.prepare({"items": _optimizer_items(manifest, live.params_by_fqn())})
    state = capture(live.model, live.optimizer, rng=False)
    tensors: dict[str, Any] = {"model": state["model"]}
    if "optim" in state and state["optim"].get("state"):
        tensors["optim"] = {"state": state["optim"]["state"]}
    dcp.load(tensors, checkpoint_id=str(directory))
    state["model"] = tensors["model"]
    if "optim" in tensors:
        state["optim"]["state"] = tensors["optim"]["state"]
    extras: dict[str, Any] = {}
    for item in manifest["items"]:
        path = tuple(item["path"])
        if item["kind"] != "json":
            continue
        if path[0] == "extra":
            set_path(extras, path[1:], decode_json(item["value"]))
        elif "optim" in state and path[:2] == ("optim", "param_groups") and path[3] != "params":
            set_path(state, path, decode_json(item["value"]))
    restore(state, live.model, live.optimizer, placed=True)
    return extras


def _optimizer_items(manifest: dict[str, Any], params: dict[str, Any]) -> list[dict[str, Any]]:
    """The checkpoint's optimizer-state items, with the shape each takes at this world size:
    a shard of a parameter's shape in the parameter's layout, anything else whole."""
    items = []
    for item in manifest["items"]:
        path = item["path"]
        if path[:2] != ["optim", "state"]:
            continue
        if item["kind"] == "tensor":
            shape = list(item["global_size"])
            param = params.get(path[2])
            if param is not None and is_dtensor(param) and shape == list(param.shape) \
                    and path[3] != "step":
                shape = list(local_of(param).shape)
            item = dict(item, shape=shape)
        items.append(item)
    return items
