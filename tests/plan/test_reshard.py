"""A DCP checkpoint saved from a TP2 mesh loads into a plain (TP1) model, optimizer included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    model(x).pow(2).mean().backward()
    optimizer.step()


def _save_tp2(rank: int, world: int, init: str, ckpt: str, full: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = parallelize_module(_model(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=False)
    _train_step(model, optimizer)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt)
    full_model, full_optim = get_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        torch.save({"model": full_model, "optim": full_optim}, full)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tp2_checkpoint_reshards_into_tp1_with_optimizer_state(tmp_path: Path) -> None:
    init = f"file://{tmp_path / 'rdzv'}"
    ckpt, full = str(tmp_path / "ckpt"), str(tmp_path / "full.pt")
    mp.spawn(_save_tp2, args=(2, init, ckpt, full), nprocs=2, join=True)

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv1'}", rank=0,
                            world_size=1)
    try:
        model = _model()
        for p in model.parameters():  # make sure loading, not the seed, sets the values
            p.data.zero_()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=False)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=ckpt)
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        want = torch.load(full, weights_only=True)
        got_model, got_optim = get_state_dict(model, optimizer)
    finally:
        dist.destroy_process_group()
    assert set(got_model) == set(want["model"])
    for name, value in want["model"].items():
        torch.testing.assert_close(got_model[name], value, rtol=0, atol=0)
    for name, per_param in want["optim"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(got_optim["state"][name][key], per_param[key],
                                       rtol=0, atol=0)
    assert any(float(v["exp_avg"].abs().sum()) > 0 for v in got_optim["state"].values())
