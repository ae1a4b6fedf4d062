"""Building a checkpointable training state and applying one back.

:func:`capture` builds ``{"model", "optim", "extra", "rng"}`` with torch's
``torch.distributed.checkpoint.state_dict`` helpers, which strip DDP/FSDP wrapper prefixes and
key optimizer state by parameter name, so the state works for plain modules, DDP and FSDP2
(DTensor shards) alike and does not depend on the world size. :func:`restore` is the inverse.
:class:`LiveState` restores a snapshot by copying straight into the live tensors.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from elasticft.ckpt.snapshot import (
    copy_bytes,
    decode_json,
    stored_here,
    tensor_view,
    unflatten,
    walk_leaves,
)


def rng_state() -> dict[str, Any]:
    """This process's RNG states: torch CPU (and CUDA) and Python's Mersenne Twister words as
    tensors (a checkpoint copies tensors; 625 ints as JSON cost the save a walk and an encoding
    every step), Python's version and Gaussian carry as JSON values."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "state": _python_words(internal), "gauss": gauss},
    }
    if _cuda_rng_in_use():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _python_words(internal: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(internal, dtype=torch.int64)


def _cuda_rng_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def set_rng_state(state: Mapping[str, Any]) -> None:
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "python" in state:
        py = state["python"]
        words = py["state"]  # a tensor; a list of ints in snapshots of earlier versions
        if isinstance(words, torch.Tensor):
            words = words.tolist()
        random.setstate((py["version"], tuple(words), py["gauss"]))


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
        model_sd, optim_sd = get_model_state_dict(model), None
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
        self._rng_buffers: dict[str, torch.Tensor] = {}
        self._python_words_seen: tuple[int, ...] = ()
        self._modules = list(model.modules())

    def _identity(self) -> tuple[int, ...]:
        # Each module's own parameters, buffers and children, read from its dicts: a third of
        # the cost of model.parameters(), and any change anywhere in the tree (a parameter
        # replaced, a submodule added or swapped) changes one of these dicts.
        ids: list[int] = []
        for module in self._modules:
            ids += map(id, module._parameters.values())
            ids += map(id, module._buffers.values())
            ids += map(id, module._modules.values())
        if self.optimizer is not None:
            for per_param in self.optimizer.state.values():
                ids += [id(v) for v in per_param.values() if isinstance(v, torch.Tensor)]
                ids.append(len(per_param))
            ids.append(len(self.optimizer.param_groups))
        return tuple(ids)

    def __call__(self, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        key = self._identity()
        if self._dicts is None or key != self._key:
            self._modules = list(self.model.modules())
            key = self._identity()
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
            out["rng"] = self._stable_rng_state()
        return out

    def _stable_rng_state(self) -> dict[str, Any]:
        """:func:`rng_state` with its tensors copied into the same tensor objects every call.

        ``torch.get_rng_state()`` returns a new tensor each time; a new object would make every
        save take the checkpointer's slower path for a changed state (a walk and a re-placement
        instead of a compare). The save copies these small tensors before it returns. Python's
        words are converted only when they changed: most training steps never use ``random``.
        """
        version, internal, gauss = random.getstate()
        if internal != self._python_words_seen:
            self._python_words_seen = internal
            self._stable("python", _python_words(internal))
        state: dict[str, Any] = {
            "torch": self._stable("torch", torch.get_rng_state()),
            "python": {"version": version, "state": self._rng_buffers["python"], "gauss": gauss},
        }
        if _cuda_rng_in_use():
            state["cuda"] = self._stable("cuda", torch.cuda.get_rng_state())
        return state

    def _stable(self, name: str, value: torch.Tensor) -> torch.Tensor:
        buffer = self._rng_buffers.get(name)
        if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
            self._rng_buffers[name] = buffer = value.clone()
        else:
            buffer.copy_(value)
        return buffer


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


class LiveState:
    """The live tensors of a model and optimizer by DCP name, for restoring in place.

    Restoring with torch's ``set_state_dict`` hands the optimizer the loaded tensors
    themselves: loaded from shared memory without a copy, the optimizer state would then live
    in the snapshot's memory and the next steps would overwrite a complete snapshot. Copying
    each item into the tensor training already uses avoids that and any intermediate
    allocation; :meth:`apply` falls back to ``set_state_dict`` on private copies when the
    snapshot does not fit the live state item for item.
    """

    _SIDE = ("extra", "rng")
    """Top-level keys restored on the side (RNG, extras), not into the model or optimizer."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self.model = model
        self.optimizer = optimizer
        # get_state_dict also creates the optimizer's state if it has none yet.
        live = capture(model, optimizer, rng=False)
        self.tensors: dict[str, torch.Tensor] = {}
        for path, value in walk_leaves(live):
            if isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                self.tensors[".".join(map(str, path))] = local.detach()

    def target(self, item: Mapping[str, Any]) -> torch.Tensor | None:
        """The live tensor a snapshot item is copied into, if it fits exactly."""
        live = self.tensors.get(item["fqn"])
        # A CUDA tensor is copied into from host memory directly: no host copy in between.
        if (live is None or not live.is_contiguous() or live.device.type not in ("cpu", "cuda")
                or str(live.dtype).removeprefix("torch.") != item["dtype"]
                or list(live.shape) != list(item["shape"])):
            return None
        return live

    def fits(self, manifest: Mapping[str, Any]) -> bool:
        """True when every item maps onto a live tensor or a restorable value, and back."""
        covered = set()
        for item in manifest["items"]:
            path = item["path"]
            if path[0] in self._SIDE:
                continue
            if item["kind"] == "tensor":
                if self.target(item) is None:
                    return False
                covered.add(item["fqn"])
            elif not (self.optimizer is not None and len(path) == 4 and path[0] == "optim"
                      and path[1] == "param_groups"
                      and int(path[2]) < len(self.optimizer.param_groups)):
                return False
        return covered == set(self.tensors)

    def apply(self, manifest: Mapping[str, Any], payload: Any,
              replicas: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """Restores the snapshot; returns its extras. ``replicas``: items another rank
        stores, already reassembled (into the live tensors when the snapshot fits)."""
        if not self.fits(manifest):
            state = unflatten(manifest, payload, copy=True, replicas=replicas)
            return restore(state, self.model, self.optimizer)
        side = []
        for item in manifest["items"]:
            path = item["path"]
            if path[0] in self._SIDE:
                side.append(item)
            elif item["kind"] == "tensor":
                if stored_here(item):
                    target = self.tensors[item["fqn"]]
                    copy_bytes(target, tensor_view(payload, item))
                elif replicas[item["fqn"]] is not self.tensors[item["fqn"]]:
                    copy_bytes(self.tensors[item["fqn"]], replicas[item["fqn"]])
            elif path[3] != "params":
                assert self.optimizer is not None
                self.optimizer.param_groups[int(path[2])][path[3]] = decode_json(item["value"])
        rest = unflatten({"items": side}, payload, copy=True)
        if "rng" in rest:
            set_rng_state(rest["rng"])
        return dict(rest.get("extra", {}))
