"""The sharded modules a survivor keeps through a regroup (``inprocess.meshes``), on real torch
objects in a gloo world of one rank: FSDP2 over tensor parallel and HSDP, a step cut short,
the groups re-pointed, the shards kept in place, and what the checks refuse. Several ranks, a
SIGKILL and a replacement: tests/inprocess/test_inprocess_sharded.py."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from elasticft.inprocess.meshes import (
    KeptModules,
    RebindError,
    backend_spelling,
    device_meshes,
    dim_override,
    fsdp_modules,
)


def _init() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def _regroup() -> None:
    """What a survivor's recovery does to its default group: destroyed, made again."""
    dist.destroy_process_group()
    _init()


@pytest.fixture
def world() -> Iterator[None]:
    if dist.is_initialized():
        pytest.skip("this process already has a default group")
    _init()
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _model(kind: str = "fsdp-tp") -> tuple[nn.Module, torch.optim.Optimizer]:
    """FSDP2 over dp outside TP over tp on a (dp, tp) mesh; or HSDP: FSDP2 over a
    (replicate, shard) mesh, whose mesh infos also hold a replicate group."""
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    if kind == "fsdp-tp":
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()},
                           src_data_rank=None)
    shard_over = mesh["dp"] if kind == "fsdp-tp" else mesh
    fully_shard(model[0], mesh=shard_over)
    fully_shard(model, mesh=shard_over)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> float:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
    loss = model(x).pow(2).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.item()


def _unsharded(model: nn.Module) -> list[str]:
    """The parameters FSDP2 has unsharded: a plain tensor, or a TP DTensor on the tp mesh
    alone, where a sharded one lies on the (dp, tp) or (replicate, shard) mesh."""
    return [name for name, p in model.named_parameters()
            if not isinstance(p, DTensor) or p.device_mesh.ndim != 2]


def _groups(model: nn.Module) -> list[Any]:
    state = fsdp_modules([model])[0]._get_fsdp_state()
    return [state._fsdp_param_groups[0].mesh_info.shard_process_group]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("kind", "references"), [("fsdp-tp", 2), ("hsdp", 4)])
def test_fsdp2_is_pointed_at_the_new_groups_and_trains_on_bit_exact(
        world: None, kind: str, references: int) -> None:
    model, optim = _model(kind)
    twin, twin_optim = _model(kind)  # never regrouped: what the kept model must match
    kept = KeptModules.arm([model])
    assert len(device_meshes([model])) == 1 and len(fsdp_modules([model])) == 2
    assert [_step(model, optim, s) for s in (1, 2)] == [_step(twin, twin_optim, s)
                                                        for s in (1, 2)]
    shards = {name: p.to_local().data_ptr() for name, p in model.named_parameters()}
    moments = [s["exp_avg"].to_local().data_ptr() for s in optim.state.values()]
    model(torch.randn(4, 8))  # a step cut short: the root's parameters are left unsharded
    assert _unsharded(model)
    old = _groups(model)

    _regroup()
    assert kept.rebind() == f"1 meshes, {references} FSDP2 group references"

    live = dist.distributed_c10d._get_default_group()
    assert _groups(model) == [live] and old != [live]
    if kind == "hsdp":
        state = fsdp_modules([model])[0]._get_fsdp_state()
        assert state._fsdp_param_groups[0].mesh_info.replicate_process_group is live
    assert not _unsharded(model)  # FSDP2's reset put the sharded parameters back
    assert {name: p.to_local().data_ptr() for name, p in model.named_parameters()} == shards
    assert [s["exp_avg"].to_local().data_ptr() for s in optim.state.values()] == moments
    assert [_step(model, optim, s) for s in (3, 4)] == [_step(twin, twin_optim, s)
                                                        for s in (3, 4)]


@pytest.mark.timeout(120)
def test_a_group_made_outside_the_meshes_in_the_set_up_refuses_the_rebind(world: None
                                                                         ) -> None:
    model, _ = _model()
    dist.new_group([0])  # a replacement's set-up makes it; the survivor cannot know of it
    kept = KeptModules.arm([model])
    _regroup()
    with pytest.raises(RebindError, match="the set-up made 2 process groups and the kept "
                       "modules' device meshes 1: make other groups inside the training"):
        kept.rebind()


@pytest.mark.timeout(120)
def test_a_group_fsdp2_keeps_where_the_rebind_does_not_look_is_named(world: None) -> None:
    model, _ = _model()
    state = fsdp_modules([model])[0]._get_fsdp_state()
    # What a torch that keeps a group in a new place looks like to the rebind.
    state._fsdp_param_groups[0].comm_ctx.some_group = dist.distributed_c10d._get_default_group()
    kept = KeptModules.arm([model])
    _regroup()
    with pytest.raises(RebindError, match=r"old generation at "
                       r"param_group\[0\]\.comm_ctx\.some_group"):
        kept.rebind()


@pytest.mark.timeout(120)
def test_a_flattened_mesh_is_made_again_after_its_roots_groups_and_refuses_a_reshape(
        world: None) -> None:
    model, _ = _model()
    mesh = fsdp_modules([model])[0]._get_fsdp_state()._fsdp_param_groups[0].mesh_info.mesh
    # flattened after the set-up's groups, as torchtitan's loss_mesh
    flat = mesh._get_root_mesh()["dp", "tp"]._flatten("dp_tp")
    kept = KeptModules.arm([model])
    old = flat.get_group()

    _regroup()
    kept.rebind()  # raises RebindError if a replayed group's name is not the old one
    group = flat.get_group()
    assert group is not old
    assert dist.distributed_c10d._resolve_process_group(group.group_name) is group
    with pytest.raises(RebindError, match=r"flattened device mesh \(dp_tp\)"):
        kept.reshape({"dp": 1, "tp": 1})


EXPANDS = {"nccl": "cuda:nccl", "gloo": "cpu:gloo,cuda:gloo"}
"""What torch's ``BackendConfig`` makes of a backend's name."""


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("config", "default", "is_default", "spans_world", "expected"), [
    # the dimension is the default group: torch reuses it when given no override
    ("cuda:nccl", "cuda:nccl", True, True, (None, None)),
    # a dimension with the default group's backend, made by new_group or split_group
    ("cuda:nccl", "cuda:nccl", False, False, (None, None)),
    ("cpu:gloo,cuda:gloo", "cpu:gloo,cuda:gloo", False, False, (None, None)),
    # a backend of its own, spelled as a script spells it (split_group compares names)
    ("cpu:gloo,cuda:gloo", "cpu:gloo,cuda:nccl", False, False, ("gloo", None)),
    ("cuda:nccl", "cpu:gloo,cuda:nccl", False, False, ("nccl", None)),
    ("cpu:gloo", "cpu:gloo,cuda:gloo", False, True, ("cpu:gloo", None)),
    # over the whole world but not the default group: an override made it
    ("cuda:nccl", "cuda:nccl", False, True, ("nccl", None)),
])
def test_a_mesh_dimensions_backend_is_made_again_as_the_set_up_made_it(
        config: str, default: str, is_default: bool, spans_world: bool,
        expected: tuple) -> None:
    assert dim_override(config, default, is_default=is_default, spans_world=spans_world,
                        expand=EXPANDS.__getitem__) == expected


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("config", "spelled"), [
    ("cuda:nccl", "nccl"), ("cpu:gloo,cuda:gloo", "gloo"), ("cpu:gloo", "cpu:gloo"),
    ("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl"),
])
def test_a_backend_is_spelled_as_a_script_passes_it(config: str, spelled: str) -> None:
    assert backend_spelling(config, EXPANDS.__getitem__) == spelled


@pytest.mark.timeout(120)
def test_a_dimension_with_a_backend_of_its_own_keeps_it_through_the_rebind(world: None) -> None:
    """``init_device_mesh(backend_override={"tp": "cpu:gloo"})`` beside a ``"gloo"`` default
    group: replayed with the default group's backend, the world-spanning ``tp`` dimension would
    be the default group itself (the names ``["0", "0"]``, refused); kept, it is a group of its
    own again, with its own backend."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"),
                            backend_override={"tp": "cpu:gloo"})
    model = nn.Linear(2, 2)
    model.weight = nn.Parameter(distribute_tensor(model.weight.data, mesh,
                                                  [Replicate(), Replicate()]))
    kept = KeptModules.arm([model])
    names = list(mesh._dim_group_names)
    _regroup()
    kept.rebind()
    assert list(mesh._dim_group_names) == names
    configs = [str(dist.get_backend_config(dist.distributed_c10d._resolve_process_group(n)))
               for n in names]
    assert configs == [str(dist.get_backend_config()), "cpu:gloo"]


@pytest.mark.timeout(60)
def test_a_parameter_a_graph_or_a_weak_reference_still_holds_is_named(world: None) -> None:
    """A tensor parallel module whose step was cut short between its forward and backward: the
    graph holds its DTensor weights, and the move a framework's re-entry makes (``.to()``) fails
    to swap them; the release names them first. Once the graph is gone, nothing is named."""
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()},
                       src_data_rank=None)
    kept = KeptModules.arm([model])
    assert kept.held_elsewhere() == []
    loss = model(torch.randn(4, 8)).pow(2).mean()  # the step cut short before its backward
    assert [name.split()[0] for name in kept.held_elsewhere()] == ["2.weight"]  # for dx
    with pytest.raises(RuntimeError, match="Couldn't swap"):
        model.to("cpu")
    del loss
    assert kept.held_elsewhere() == []
    model.to("cpu")
    reference = weakref.ref(model[0].weight)
    assert kept.held_elsewhere() == ["0.weight (a weak reference)"]
    del reference
    assert kept.held_elsewhere() == []
