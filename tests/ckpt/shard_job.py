"""Gloo ranks for the sharding table: every way users shard state, through every tier.

``python shard_job.py RANK WORLD INIT_FILE OWNER_PID DIR TASK...``, a task being ``table:ROW`` or
``reshard:ROW``, run in order.

* ``table``: for the row (:data:`ROWS`) trains 2 steps with a snapshot after each (step 2 also
  persisted to DIR/ROW/local and DIR/ROW/remote), takes the uninterrupted step 3, then restores
  a fresh model and optimizer (another seed) from each tier in turn (memory, local disk, peer,
  remote) and with ``load()`` + ``restore``, and takes step 3 again. Writes
  DIR/ROW/table-<rank>.json: per tier, whether the restored state and the step after it are
  bitwise the uninterrupted run's, the source, and the restored step. Rank 0 also writes the
  whole (gathered) state after step 2 to DIR/ROW/full.pt.
* ``reshard``: restores the row's durable checkpoint (written at another world size) into a
  fresh model at this one; writes whether the gathered state equals DIR/ROW/full.pt, and what
  a restore from a copy with one damaged shard gave, to DIR/ROW/reshard-<rank>.json.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

from elasticft.ckpt import Checkpointer, StateCapture, WorkerSettings, restore
from elasticft.ckpt.backup.peer import PeerClient, PeerServer, new_secret
from elasticft.ckpt.memory.shm import segment_prefix
from elasticft.ckpt.persisting import durable

STEPS = 2
TIERS = ("memory", "local", "peer", "remote", "load+restore")


def _layers() -> torch.nn.Sequential:
    # Uneven on purpose: 30 rows over 4 ranks are 8/8/8/6, a 5-element bias leaves a rank an
    # empty shard.
    return torch.nn.Sequential(torch.nn.Linear(16, 30), torch.nn.ReLU(), torch.nn.Linear(30, 5))


def _plain(world: int) -> torch.nn.Module:
    return _layers()


def _ddp(world: int) -> torch.nn.Module:
    # One parameter per bucket. A fresh DDP's first backward reduces gradients in buckets laid
    # out in parameter order, a running one's in the order it saw them ready; beyond 2 ranks
    # gloo's ring sums an element in an order that depends on its place in the bucket, so the
    # step after a restart would differ in the last bit from the uninterrupted one by DDP's
    # doing, not the checkpoint's.
    return DistributedDataParallel(_layers(), bucket_cap_mb=1e-6)


def _fsdp(reshard_after_forward: bool) -> Callable[[int], torch.nn.Module]:
    def build(world: int) -> torch.nn.Module:
        model = _layers()
        for layer in (model[0], model[2]):
            fully_shard(layer, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        return model
    return build


def _fsdp_tp(world: int) -> torch.nn.Module:
    """Data parallel (FSDP2) x tensor parallel: a (world/2, 2) mesh."""
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    model = _layers()
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def _hsdp(world: int) -> torch.nn.Module:
    """HSDP: FSDP2 over a (world/2, 2) mesh, replicated along the first dimension and sharded
    along the second."""
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    model = _layers()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


ROWS: dict[str, Callable[[int], torch.nn.Module]] = {
    "plain": _plain,
    "ddp": _ddp,
    "fsdp2": _fsdp(True),
    "fsdp2-no-reshard": _fsdp(False),
    "fsdp2-tp": _fsdp_tp,
    "hsdp": _hsdp,
}


def build(row: str, world: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = ROWS[row](world)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int,
               rank: int) -> float:
    batch = torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * step + rank))
    loss = model(batch).pow(2).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.item()


def local_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor this rank holds (local shards), by name, as private copies."""
    out = {}
    for name, value in model.state_dict().items():
        out[f"model.{name}"] = _local(value).clone()
    names = {id(p): n for n, p in model.named_parameters()}
    for param, state in optim.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"optim.{names[id(param)]}.{key}"] = _local(value).clone()
    return out


def full_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The whole tensors (DTensors gathered), by name: comparable across world sizes."""
    out = {}
    for name, value in model.state_dict().items():
        out[f"model.{name.removeprefix('module.')}"] = _full(value)
    names = {id(p): n.removeprefix("module.") for n, p in model.named_parameters()}
    for param, state in optim.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"optim.{names[id(param)]}.{key}"] = _full(value)
    return out


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value.detach()


def _full(value: torch.Tensor) -> torch.Tensor:
    return (value.full_tensor() if isinstance(value, DTensor) else value.detach()).clone()


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The names whose tensors differ (bitwise, dtype and shape included)."""
    if a.keys() != b.keys():
        return sorted(set(a) ^ set(b))
    return [k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
            or not torch.equal(a[k].reshape(-1).view(torch.uint8),
                               b[k].reshape(-1).view(torch.uint8))]


def table(row: str, rank: int, world: int, owner: int, root: Path) -> None:
    home = root / row
    prefix = segment_prefix(owner, f"tbl-{row}", rank)
    settings = WorkerSettings(local_rank=rank, shm_slots=prefix, local_dir=home / "local",
                              remote_dir=home / "remote", persist_every=STEPS,
                              owner_pid=owner)
    model, optim = build(row, world, 0)
    with Checkpointer(settings, optimizers=[optim]) as ckpt:
        capture = StateCapture(model, optim)
        for step in range(1, STEPS + 1):
            train_step(model, optim, step, rank)
            assert ckpt.save(step, capture(extra={"step": step})).wait(60).status == "memory"
    _wait_committed(home / "local", home / "remote")
    saved = local_state(model, optim)
    full = full_state(model, optim)
    if rank == 0:
        torch.save(full, home / "full.pt")
    rng = torch.get_rng_state()
    expected_loss = train_step(model, optim, STEPS + 1, rank)
    expected = local_state(model, optim)

    # The peer tier: this rank's shard of the step, held by a backup server (the agent's role).
    secret = new_secret()
    server = PeerServer(home / f"peer-{rank}", secret, "127.0.0.1")
    PeerClient(server.address, secret).put_from_dir(durable.step_dir(home / "local", STEPS), rank)
    only = {
        "memory": WorkerSettings(local_rank=rank, shm_slots=prefix, owner_pid=owner),
        "local": WorkerSettings(local_rank=rank, local_dir=home / "local"),
        "peer": WorkerSettings(local_rank=rank, peer_addr=server.address, secret=secret),
        "remote": WorkerSettings(local_rank=rank, remote_dir=home / "remote"),
        "load+restore": WorkerSettings(local_rank=rank, shm_slots=prefix, owner_pid=owner),
    }
    results: dict[str, Any] = {}
    for tier in TIERS:
        fresh, fresh_optim = build(row, world, 1)
        torch.manual_seed(12345)  # the RNG state must come back from the snapshot too
        with Checkpointer(only[tier], optimizers=[fresh_optim]) as ckpt:
            if tier == "load+restore":
                loaded = ckpt.load()
                assert loaded is not None
                step, extra = loaded[0], restore(loaded[1], fresh, fresh_optim)
            else:
                restored = ckpt.restore(fresh, fresh_optim)
                assert restored is not None
                step, extra = restored
            source = ckpt.last_source
        restored_state = local_state(fresh, fresh_optim)
        rng_ok = torch.equal(torch.get_rng_state(), rng)
        loss = train_step(fresh, fresh_optim, STEPS + 1, rank)
        results[tier] = {"step": step, "extra": extra, "source": source,
                         "restored_differs": same(restored_state, saved), "rng": rng_ok,
                         "loss_equal": loss == expected_loss,
                         "next_differs": same(local_state(fresh, fresh_optim), expected)}
    server.close()
    # Whole tensors (an export's) into the model: each rank keeps its own shard of each.
    whole, _ = build(row, world, 1)
    restore({"model": {k.removeprefix("model."): v for k, v in full.items()
                       if k.startswith("model.")}}, whole)
    results["whole-model"] = same(
        {k: v for k, v in local_state(whole, torch.optim.SGD(whole.parameters())).items()},
        {k: v for k, v in saved.items() if k.startswith("model.")})
    # The same snapshot into a model that is not sharded: one error naming the tensor.
    plain = _layers()
    with Checkpointer(only["memory"], optimizers=[]) as ckpt:
        try:
            ckpt.restore(plain)
            results["into-unsharded"] = None
        except Exception as e:  # what was raised is the result
            results["into-unsharded"] = f"{type(e).__module__}.{type(e).__name__}: {e}"
    (home / f"table-{rank}.json").write_text(json.dumps(results))


def reshard(row: str, rank: int, world: int, root: Path) -> None:
    home = root / row
    model, optim = build(row, world, 1)
    settings = WorkerSettings(local_rank=rank, local_dir=home / "local")
    with Checkpointer(settings, optimizers=[optim]) as ckpt:
        restored = ckpt.restore(model, optim)
        source = ckpt.last_source
    expected = torch.load(home / "full.pt", weights_only=True)
    result: dict[str, Any] = {"restored": list(restored) if restored else None,
                              "source": source, "differs": same(full_state(model, optim),
                                                                expected)}
    # A byte flipped in one shard: dcp.load would read it unchecked, the restore refuses it.
    damaged = home / "damaged"
    if rank == 0:
        shutil.copytree(home / "local", damaged)
        shard = durable.step_dir(damaged, STEPS) / durable.shard_name(1)
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    dist.barrier()
    model, optim = build(row, world, 1)
    with Checkpointer(WorkerSettings(local_rank=rank, local_dir=damaged),
                      optimizers=[optim]) as ckpt:
        result["damaged"] = ckpt.restore(model, optim)
    (home / f"reshard-{rank}.json").write_text(json.dumps(result))


def _wait_committed(*roots: Path) -> None:
    import time

    deadline = time.monotonic() + 120
    while not all(STEPS in durable.committed_steps(r) for r in roots):
        assert time.monotonic() < deadline, "step not committed"
        time.sleep(0.05)


def main() -> None:
    rank_s, world_s, init_file, owner_s, root_s, *tasks = sys.argv[1:]
    rank, world = int(rank_s), int(world_s)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    for task in tasks:
        mode, row = task.split(":")
        if mode == "table":
            table(row, rank, world, int(owner_s), Path(root_s))
        else:
            reshard(row, rank, world, Path(root_s))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
