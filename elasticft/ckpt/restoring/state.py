"""Building a checkpointable training state and applying one back.

:func:`capture` builds ``{"model", "optim", "extra", "rng"}`` with torch's
``torch.distributed.checkpoint.state_dict`` helpers, which strip DDP/FSDP wrapper prefixes and
key optimizer state by parameter name, so the state works for plain modules, DDP, FSDP2 and
tensor parallelism alike (a DTensor stays a DTensor; a save stores its local shard).
:func:`restore` is the inverse. :class:`LiveState` restores a snapshot by copying straight into
the live tensors, a DTensor's shard into its local tensor (:mod:`elasticft.ckpt.restoring.shards`).
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed.checkpoint.state_dict as torch_state_dict
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from elasticft.ckpt.hostcopy import copy_bytes
from elasticft.ckpt.memory.device import restore_copy
from elasticft.ckpt.restoring.loaders import resume_loaders, snapshot_entry, watch
from elasticft.ckpt.restoring.shards import into_live, is_dtensor, like_param, local_of, storage_key
from elasticft.ckpt.snapshot import (
    decode_json,
    dtype_from_name,
    set_path,
    stored_here,
    tensor_view,
    unflatten,
    walk_leaves,
)


def rng_state() -> dict[str, Any]:
    """This process's RNG states: torch CPU (and CUDA), Python's and numpy's global Mersenne
    Twisters. Their words go as tensors (a checkpoint copies tensors; 625 ints as JSON cost the
    save a walk and an encoding every step), the rest (versions, positions, Gaussian carries)
    as JSON values."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "state": _python_words(internal), "gauss": gauss},
    }
    if _cuda_rng_in_use():
        state["cuda"] = torch.cuda.get_rng_state()
    if (numpy := _numpy_state()) is not None:
        words, rest = numpy
        state["numpy"] = {"state": words, **rest}  # numpy made the array for this call
    return state


def _python_words(internal: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(internal, dtype=torch.int64)


def _numpy_state() -> tuple[torch.Tensor, dict[str, Any]] | None:
    """numpy's global RNG (``np.random.seed``, ``np.random.normal``...): its 624 key words as a
    tensor that views numpy's copy of them (uint32 read as int32, no conversion), and its
    position and Gaussian carry; None where numpy is not imported (torch imports it where it is
    installed), or its global generator is not a Mersenne Twister."""
    numpy = sys.modules.get("numpy")
    if numpy is None:
        return None
    state = numpy.random.get_state(legacy=True)
    if not isinstance(state, tuple) or state[0] != "MT19937":
        return None
    _, keys, pos, has_gauss, gauss = state
    words = torch.from_numpy(keys.view(numpy.int32))
    return words, {"pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss)}


def _set_numpy_state(state: Mapping[str, Any]) -> None:
    try:
        import numpy
    except ImportError:  # a snapshot of a process that had numpy, restored in one without
        return
    words = state["state"]
    keys = (words.numpy() if isinstance(words, torch.Tensor)
            else numpy.asarray(words, dtype=numpy.int32)).view(numpy.uint32)
    numpy.random.set_state(("MT19937", keys, state["pos"], state["has_gauss"], state["gauss"]))


def _cuda_rng_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Puts back what :func:`rng_state` took; a generator the snapshot does not hold (numpy's,
    in snapshots of earlier versions) is left as it is. The data loaders' entries of a
    :class:`StateCapture` arm its loaders (:mod:`elasticft.ckpt.restoring.loaders`)."""
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
    if "numpy" in state:
        _set_numpy_state(state["numpy"])
    resume_loaders(state)


def capture(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: Mapping[str, Any] | None = None,
    *,
    rng: bool = True,
) -> dict[str, Any]:
    """The state to pass to ``Checkpointer.save``; tensors alias the live model (no copy).

    An optimizer that has no state yet is saved as it is (its hyperparameters only).
    """
    if optimizer is not None:
        with optimizer_state_as_is():
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

    ``loaders``: the data loaders whose iterator the loop makes again at the restored step
    (skipping the epoch's first batches). Each snapshot holds the RNG states their current
    iterator drew from, and a restore has the iterator made again draw the same (the workers'
    seeds, a shuffle from torch's RNG) without moving torch's RNG
    (:mod:`elasticft.ckpt.restoring.loaders`). Part of the RNG states: nothing with ``rng=False``.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 *, rng: bool = True, loaders: Iterable[Any] = ()) -> None:
        self.model = model
        self.optimizer = optimizer
        self.rng = rng
        self._loaders = watch(loaders) if rng else []
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
        words are converted only when they changed: most training steps never use ``random``;
        numpy's are a view of the copy ``get_state`` makes, copied into their buffer.
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
        if (numpy := _numpy_state()) is not None:
            words, rest = numpy
            state["numpy"] = {"state": self._stable("numpy", words), **rest}
        for n, draws in enumerate(self._loaders):
            state[f"loader {n}"] = snapshot_entry(draws, self._stable, f"loader {n}")
        return state

    def _stable(self, name: str, value: torch.Tensor) -> torch.Tensor:
        buffer = self._rng_buffers.get(name)
        if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
            self._rng_buffers[name] = buffer = value.clone()
        else:
            buffer.copy_(value)
        return buffer


@contextlib.contextmanager
def optimizer_state_as_is() -> Iterator[None]:
    """torch's state-dict helpers, without their creation of missing optimizer state.

    ``get_state_dict``/``set_state_dict`` create the state of an optimizer that has none by
    running ``step()`` with zero gradients and lr 0. That changes the run being saved (Adam's
    ``step`` count advances, so the next real update differs), fails for LBFGS (its step needs
    a closure) and SparseAdam (dense gradients), and in a fresh process costs a whole
    optimizer step over freshly allocated memory before a restore. A snapshot says which state
    exists; :class:`LiveState` creates exactly that, and an optimizer without state is saved
    and restored as such.
    """
    original = getattr(torch_state_dict, "_init_optim_state", None)
    if original is None:  # a torch without the helper: nothing to suppress
        yield
        return
    torch_state_dict._init_optim_state = _leave_optimizer_state  # type: ignore[attr-defined]
    try:
        yield
    finally:
        torch_state_dict._init_optim_state = original  # type: ignore[attr-defined]


def _leave_optimizer_state(optim: torch.optim.Optimizer) -> None:
    return None


def restore(
    state: Mapping[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    placed: bool = False,
) -> dict[str, Any]:
    """Applies a loaded state to ``model`` and ``optimizer``; returns its extras.

    A sharded model's (FSDP2, tensor parallel) tensors may come as this rank's local shards
    (what :meth:`Checkpointer.load` returns) or as whole tensors: each is put into the live
    DTensor of its name. A tensor that fits neither raises
    :class:`~elasticft.ckpt.api.StateMismatch` naming it. ``placed``: that was done already.
    """
    if not placed:
        state = {**state, "model": dict(state["model"])}
        if "optim" in state:
            state["optim"] = _copied_tree(state["optim"])
        LiveState(model, optimizer).into_live(state)
    optim_sd = dict(state.get("optim", {})) if optimizer is not None else {}
    if optim_sd and "state" not in optim_sd:
        # An optimizer without state (plain SGD) is saved with an empty "state", which a
        # snapshot cannot hold (it stores leaves); torch takes a dict without one for its
        # flattened form and fails on it.
        optim_sd["state"] = {}
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        with optimizer_state_as_is():
            # Not strict: an optimizer keeps state for the parameters it chooses (LBFGS for
            # its first only, any optimizer none for a parameter that never had a gradient).
            set_optimizer_state_dict(model, optimizer, optim_sd,
                                     options=StateDictOptions(strict=False))
    if "rng" in state:
        set_rng_state(state["rng"])
    forget_gradients(model, optimizer)
    return dict(state.get("extra", {}))


def forget_gradients(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Sets the gradients of ``model``'s and ``optimizer``'s parameters to None.

    A snapshot holds no gradients: the step it puts back is a step boundary, where a process
    that restores it fresh (a replacement, a restart) has none. A survivor of in-process
    recovery still holds those of the step its failure cut short (the backward was done or
    under way, the update was not), and a loop that zeroes them only after its step (nanoGPT's
    ``step(); zero_grad()``) or accumulates micro-batches under DDP's ``no_sync`` would add
    them to the redone step's. So every restore leaves the gradients as a fresh process has
    them, whatever the script does next."""
    drop_gradients(model.parameters())
    if optimizer is not None:
        drop_gradients(param for group in optimizer.param_groups for param in group["params"])


def drop_gradients(params: Iterable[torch.Tensor]) -> None:
    """Sets each parameter's gradient to None (see :func:`forget_gradients`)."""
    for param in params:
        param.grad = None


def _copied_tree(value: Any) -> Any:
    """The dicts and lists of a state copied (its leaves shared), to be changed in place."""
    if isinstance(value, Mapping):
        return {k: _copied_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copied_tree(v) for v in value]
    return value


class LiveState:
    """The live tensors of a model and optimizer by DCP name, for restoring in place.

    Restoring with torch's ``set_state_dict`` hands the optimizer the loaded tensors
    themselves: loaded from shared memory without a copy, the optimizer state would then live
    in the snapshot's memory and the next steps would overwrite a complete snapshot. Copying
    each item into the tensor training already uses avoids that and any intermediate
    allocation; :meth:`apply` falls back to ``set_state_dict`` on private copies when the
    snapshot does not fit the live state item for item.

    In a fresh process the optimizer has no state yet. :meth:`prepare` creates exactly the
    state the snapshot holds (uninitialized tensors of its dtypes and shapes, on the devices
    torch's ``load_state_dict`` would put them, and its other values), so the copy has
    somewhere to land without a throwaway optimizer step.
    """

    _SIDE = ("extra", "rng")
    """Top-level keys restored on the side (RNG, extras), not into the model or optimizer."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self.model = model
        self.optimizer = optimizer
        self._tensors: dict[str, torch.Tensor] | None = None
        self._whole: dict[str, torch.Tensor] | None = None
        self._params: dict[str, torch.Tensor] | None = None

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every live tensor by DCP name (model and optimizer state); a DTensor's local shard."""
        if self._tensors is None:
            self._tensors = {fqn: local_of(value) for fqn, value in self.whole.items()}
        return self._tensors

    @property
    def whole(self) -> dict[str, torch.Tensor]:
        """Every live tensor by DCP name as the state dict holds it (DTensors as DTensors)."""
        if self._whole is None:
            live = capture(self.model, self.optimizer, rng=False)
            self._whole = {".".join(map(str, path)): value.detach()
                           for path, value in walk_leaves(live)
                           if isinstance(value, torch.Tensor)}
        return self._whole

    def params_by_fqn(self) -> dict[str, torch.Tensor]:
        """The optimizer's parameters by DCP name (plain parameters and DTensors)."""
        if self._params is None:
            self._params = {}
            if self.optimizer is not None:
                owned = {storage_key(p): p
                         for group in self.optimizer.param_groups for p in group["params"]}
                for fqn, value in get_model_state_dict(self.model).items():
                    if isinstance(value, torch.Tensor):
                        param = owned.get(storage_key(value))
                        if param is not None:
                            self._params[fqn] = param
        return self._params

    def prepare(self, manifest: Mapping[str, Any]) -> None:
        """Creates the optimizer state the snapshot holds, if the optimizer has none yet."""
        optimizer = self.optimizer
        if optimizer is None or optimizer.state or self._whole is not None:
            return
        items = [i for i in manifest["items"] if i["path"][:2] == ["optim", "state"]]
        params = self.params_by_fqn()
        if not items or any(i["path"][2] not in params for i in items):
            return  # nothing to create, or not plain parameters: torch's own path
        index = {id(p): n for n, p in enumerate(
            p for group in optimizer.param_groups for p in group["params"])}
        state: dict[int, dict[str, Any]] = {}
        for item in items:
            param = params[item["path"][2]]
            rest = tuple(item["path"][3:])
            if item["kind"] == "tensor":
                # "step" stays on the host unless fused/capturable (load_state_dict's policy
                # moves it then); everything else goes where the parameter is, a shard of a
                # sharded parameter's shape in its DTensor spec.
                device = torch.device("cpu") if rest[0] == "step" else param.device
                value: Any = None if rest[0] == "step" else like_param(param, item)
                if value is None:
                    value = torch.empty(tuple(item["shape"]),
                                        dtype=dtype_from_name(item["dtype"]), device=device)
            else:
                value = decode_json(item["value"])
            set_path(state.setdefault(index[id(param)], {}), rest, value)
        groups = optimizer.state_dict()["param_groups"]
        optimizer.load_state_dict({"state": state, "param_groups": groups})

    def into_live(self, state: dict[str, Any],
                  items: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        """Makes each model and optimizer tensor of ``state`` fit torch's ``set_state_dict``
        for the live tensor of its name (:func:`~elasticft.ckpt.restoring.shards.into_live`: a local
        shard becomes a DTensor of the live spec); raises
        :class:`~elasticft.ckpt.api.StateMismatch` for one that does not fit. ``items``: the
        snapshot's manifest items by name, whose recorded layout is checked."""
        params = self.params_by_fqn()
        for path, value in walk_leaves({k: state[k] for k in ("model", "optim") if k in state}):
            if not isinstance(value, torch.Tensor):
                continue
            fqn = ".".join(map(str, path))
            live = self.whole.get(fqn)
            if live is None and path[:2] == ("optim", "state") and len(path) > 3:
                param = params.get(str(path[2]))
                # State the fresh optimizer does not have yet: the parameter's spec, when it
                # is of the parameter's shape (a step count or other scalar stays as it is).
                if param is not None and is_dtensor(param) and path[3] != "step":
                    item = (items or {}).get(fqn)
                    saved = item.get("global_size") if item is not None else list(value.shape)
                    live = param.detach() if list(saved) == list(param.shape) or \
                        list(value.shape) == list(local_of(param).shape) else None
            # Plain optimizer state is left to torch, which takes it as it is (an optimizer's
            # state may legitimately change shape, LBFGS's history for one).
            if live is not None and (path[0] == "model" or is_dtensor(live)):
                set_path(state, path, into_live(fqn, value, live, (items or {}).get(fqn)))

    def target(self, item: Mapping[str, Any]) -> torch.Tensor | None:
        """The live tensor a snapshot item is copied into, if it fits exactly."""
        live = self.tensors.get(item["fqn"])
        # A CUDA tensor is copied into from host memory directly: no host copy in between.
        if (live is None or not live.is_contiguous() or live.device.type not in ("cpu", "cuda")
                or str(live.dtype).removeprefix("torch.") != item["dtype"]
                or list(live.shape) != list(item["shape"])):
            return None
        return live

    def _value_fits(self, path: list[Any]) -> bool:
        """A non-tensor item: a param group's hyperparameter, or a parameter's state value."""
        if self.optimizer is None or path[0] != "optim":
            return False
        if path[1] == "param_groups":
            return len(path) == 4 and int(path[2]) < len(self.optimizer.param_groups)
        return path[1] == "state" and len(path) >= 4 and path[2] in self.params_by_fqn()

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
            elif not self._value_fits(path):
                return False
        return covered == set(self.tensors)

    def apply(self, manifest: Mapping[str, Any], payload: Any,
              replicas: Mapping[str, torch.Tensor],
              copy: Any = None) -> dict[str, Any]:
        """Restores the snapshot; returns its extras. ``replicas``: items another rank
        stores, already reassembled (into the live tensors when the snapshot fits).
        ``copy(pairs)`` copies (live tensor, snapshot view) pairs (default:
        :func:`~elasticft.ckpt.memory.device.restore_copy`: every core for host tensors, pinned
        buffers on a stream of its own for CUDA ones)."""
        self.prepare(manifest)
        if not self.fits(manifest):
            state = unflatten(manifest, payload, copy=True, replicas=replicas)
            self.into_live(state, {i["fqn"]: i for i in manifest["items"]})
            return restore(state, self.model, self.optimizer, placed=True)
        side = []
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for item in manifest["items"]:
            path = item["path"]
            if path[0] in self._SIDE:
                side.append(item)
            elif item["kind"] == "tensor":
                if stored_here(item):
                    pairs.append((self.tensors[item["fqn"]], tensor_view(payload, item)))
                elif replicas[item["fqn"]] is not self.tensors[item["fqn"]]:
                    copy_bytes(self.tensors[item["fqn"]], replicas[item["fqn"]])
            elif path[1] == "param_groups":
                if path[3] != "params":
                    assert self.optimizer is not None
                    self.optimizer.param_groups[int(path[2])][path[3]] = \
                        decode_json(item["value"])
            else:
                assert self.optimizer is not None
                param = self.params_by_fqn()[path[2]]
                set_path(self.optimizer.state[param], tuple(path[3:]),
                         decode_json(item["value"]))
        (copy or restore_copy)(pairs)
        rest = unflatten({"items": side}, payload, copy=True)
        if "rng" in rest:
            set_rng_state(rest["rng"])
        forget_gradients(self.model, self.optimizer)  # as restore() does
        return dict(rest.get("extra", {}))
