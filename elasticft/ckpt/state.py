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


class StateCapture:
    """:func:`capture` for one model and optimizer, for calling every step.

    torch's state-dict helpers take tens of milliseconds on a model with hundreds of tensors, on
    the training thread. Their result aliases the live parameters, buffers and optimizer state,
    so it stays right as long as those are the same tensor objects: this keeps it and only
    refreshes the optimizer's hyperparameters (a scheduler changes ``lr``), the extras and the
    RNG states. Any change of the tensor objects (the first optimizer step, a reload) rebuilds.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 *, rng: bool = True) -> None:
        self.model = model
        self.optimizer = optimizer
        self.rng = rng
        self._key: tuple[int, ...] | None = None
        self._dicts: tuple[dict[str, Any], dict[str, Any] | None] | None = None

    def _identity(self) -> tuple[int, ...]:
        ids = [id(t) for t in self.model.parameters()]
        ids += [id(t) for t in self.model.buffers()]
        if self.optimizer is not None:
            for per_param in self.optimizer.state.values():
                ids += [id(v) for v in per_param.values() if isinstance(v, torch.Tensor)]
                ids.append(len(per_param))
            ids.append(len(self.optimizer.param_groups))
        return tuple(ids)

    def __call__(self, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        key = self._identity()
        if self._dicts is None or key != self._key:
            state = capture(self.model, self.optimizer, rng=False)
            self._dicts = (state["model"], state.get("optim"))
            self._key = key
        model_sd, optim_sd = self._dicts
        if optim_sd is not None and self.optimizer is not None:
            for saved, live in zip(optim_sd["param_groups"], self.optimizer.param_groups,
                                   strict=True):
                saved.update({k: v for k, v in live.items() if k != "params"})
        out: dict[str, Any] = {"model": model_sd, "extra": dict(extra or {})}
        if optim_sd is not None:
            out["optim"] = optim_sd
        if self.rng:
            out["rng"] = rng_state()
        return out


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
