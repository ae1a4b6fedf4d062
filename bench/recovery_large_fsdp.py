"""The sharded modes of bench/recovery_large.py: FSDP2 (``--fsdp``) and tensor parallel
(``--tp``), the worker's MLP sharded over all ranks, and torchrun's checkpoints of it.

:func:`build` makes the model on the meta device and applies ``fully_shard`` to each layer and
to the root over the whole world, then makes and initialises only this rank's shards,
torchtitan's way (no collective: a replacement's set-up meets none). :func:`build_tp` does the
same with ``parallelize_module`` over a 1-D mesh of the ranks: the layers split by column and
by row in turn, so each pair of layers meets in one all-reduce (Megatron's MLP). Under torchrun
either sharded model is checkpointed the way a torchrun user does (:class:`DcpFiles`):
torch.distributed.checkpoint of ``get_state_dict(model, optimizer)`` into a directory per step,
committed by rank 0 after every rank has written its part; a restart loads the newest committed
step into its fresh shards. Under elasticft the worker's documented API
(``Checkpointer``/``StateCapture``) snapshots the shards themselves.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

COMMITTED = "COMMITTED"


def build(width: int, layers: int, device: str) -> Any:
    """The MLP of ``layers`` square layers, sharded the way large FSDP2 models are built
    (torchtitan's): on the meta device, ``fully_shard`` on each layer and on the root, then
    only this rank's shards made (``to_empty``) and initialised. No rank holds the whole
    model at any time, and no collective is made (a replacement's set-up meets none)."""
    import math

    import torch
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False)
                                      for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(int(os.environ.get("RANK", "0")))
    bound = 1 / math.sqrt(width)  # nn.Linear's own range
    with torch.no_grad():
        for param in model.parameters():
            param.to_local().uniform_(-bound, bound, generator=generator)
    return model


def build_tp(width: int, layers: int, device: str) -> Any:
    """The MLP of ``layers`` square layers (an even number), tensor parallel over all ranks:
    built on the meta device, the even layers ``ColwiseParallel`` and the odd ones
    ``RowwiseParallel`` over a 1-D mesh of the world, then only this rank's shards made and
    initialised (``src_data_rank=None``: no rank sends its weights, no collective is made)."""
    import math

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False)
                                      for _ in range(layers + layers % 2)])
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    plan = {str(index): ColwiseParallel() if index % 2 == 0 else RowwiseParallel()
            for index in range(len(model))}
    parallelize_module(model, mesh, plan, src_data_rank=None)
    model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(int(os.environ.get("RANK", "0")))
    bound = 1 / math.sqrt(width)  # nn.Linear's own range
    with torch.no_grad():
        for param in model.parameters():
            param.to_local().uniform_(-bound, bound, generator=generator)
    return model


class DcpFiles:
    """torch.distributed.checkpoint directories ``<directory>/step_<N>``, the newest two kept;
    a step counts once rank 0 has written its ``COMMITTED`` file."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def _committed(self) -> list[Path]:
        return sorted(p.parent for p in self.directory.glob(f"step_*/{COMMITTED}"))

    def resume(self, model: Any, optim: Any, device: str) -> int:
        """Loads the newest committed step into the live shards (DCP reads each rank's part);
        returns it, 0 where there is none."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        committed = self._committed()
        if not committed:
            return 0
        model_state, optim_state = get_state_dict(model, optim)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=committed[-1])
        set_state_dict(model, optim, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        return int(json.loads((committed[-1] / COMMITTED).read_text())["step"])

    def save(self, step: int, model: Any, optim: Any) -> None:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(model, optim)
        path = self.directory / f"step_{step:06d}"
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
        dist.barrier()
        if dist.get_rank() == 0:
            (path / COMMITTED).write_text(json.dumps({"step": step}))
            for old in self._committed()[:-2]:  # the newest two stay
                shutil.rmtree(old, ignore_errors=True)
