"""Building a checkpointable training state and applying one back.

:func:`capture` builds ``{"model", "optim", "extra", "rng"}`` with torch's
``torch.distributed.checkpoint.state_dict`` helpers, which strip DDP/FSDP wrapper prefixes and
key optimizer state by parameter name, so the state works for plain modules, DDP and FSDP2
(DTensor shards) alike and does not depend on the world size. :func:`restore` is the inverse.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def rng_state() -> dict[str, Any]:
    """This process's RNG states: torch CPU (and CUDA) as tensors, Python's as JSON."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "state": list(internal), "gauss": gauss},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "python" in state:
        py = state["python"]
        random.setstate((py["version"], tuple(py["state"]), py["gauss"]))


def capture(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: Mapping[str, Any] | None = None,
    *,
    rng: bool = True,
) -> dict[str, Any]:
    """The state to pass to ``Checkpointer.save``; tensors alias the live model (no copy)."""
    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
    else:
        model_sd, optim_sd = get_state_dict(model, []), None
    state: dict[str, Any] = {"model": model_sd, "extra": dict(extra or {})}
    if optim_sd is not None:
        state["optim"] = optim_sd
    if rng:
        state["rng"] = rng_state()
    return state


def restore(
    state: Mapping[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """Applies a loaded state to ``model`` and ``optimizer``; returns its extras."""
    set_state_dict(
        model,
        optimizer if optimizer is not None else [],
        model_state_dict=state["model"],
        optim_state_dict=state.get("optim", {}) if optimizer is not None else {},
    )
    if "rng" in state:
        set_rng_state(state["rng"])
    return dict(state.get("extra", {}))
