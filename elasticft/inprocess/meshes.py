"""A survivor's sharded modules across a regroup: FSDP2 (``fully_shard``) and tensor parallel
(DTensor) modules keep their parameters, their local shards and the optimizer state; what is
bound to the old groups is pointed at the new generation's.

**Why the modules can stay.** A DTensor, a ``DeviceMesh`` and the functional collectives do not
hold process groups: a mesh keeps the *names* of its groups and resolves them in c10d's
registry at each use. torch names a group by a counter (``"0"`` for the default group, then
``"1"``, ``"2"``... per ``new_group`` call, on every rank, member or not) and resets the counter
when the default group is destroyed, so groups made again in the same order get the same names.
A replacement runs the script's set-up from its start: its ``init_device_mesh`` makes the
groups 1..n in that order. The survivors, right after their regroup, make them again in the
same order (:meth:`KeptModules.rebind`: each of the kept modules' meshes replays the creation
of its groups, oldest mesh first). Every name then resolves to this generation's group, on
every rank, and everything that looks groups up by name follows by itself. Each dimension's
group is made again with the backend it was made with (``init_device_mesh``'s
``backend_override``, which a mesh does not keep): read from its live group when recovery arms
(:func:`dim_override`), since a dimension made with a backend of its own and replayed with the
default group's takes another path in torch (the default group itself, or ``split_group``
instead of ``new_group``) and gets other names. Its ``pg_options`` are not carried: the options
object torch keeps on an NCCL group also holds the communicator it was split from
(``split_from``), the old generation's, and the script's own options cannot be told from it
without a GPU to check; a dimension made with options of its own is made again without them.

**What holds a group itself** is re-pointed, by name: FSDP2's mesh infos (the shard, the
reduce-scatter and the replicate groups of every parameter group and parameter) and a root
mesh's cache of its groups (``_pg_registry``, read under ``torch.compile``). Afterwards every
process group reachable from the FSDP2 state is checked to be the live group of its name, so a
torch that keeps one somewhere new fails here, by attribute, and the job restarts, rather than a
later collective on a dead group. The torch internals named here are in
:data:`elasticft.torch_contracts.CONTRACTS`.

**A step cut short** leaves FSDP2's per-iteration state (parameters unsharded, a training
state, an all-gather result) where the failure left it; ``FSDPModule.reset_iter_state`` on each
root puts it back to idle with the sharded parameters registered, and the restore that follows
overwrites the shards in place.

**What the checks refuse** (:class:`RebindError`, the job then restarts): a set-up that made
groups the meshes do not account for (``new_group`` before ``InProcess.run``), or a replay whose
names differ from the old ones; a reshape also refuses a flattened mesh (``_flatten``), which a
regroup into the same world makes again after its root's groups.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch.distributed as dist
from torch import nn

logger = logging.getLogger(__name__)

GROUP_FIELDS = ("shard_process_group", "reduce_scatter_process_group",
                "replicate_process_group")
"""The fields of FSDP2's mesh infos (``FSDPMeshInfo``, ``DDPMeshInfo``, ``HSDPMeshInfo``) that
hold a process group itself."""


BackendOverride = tuple[str | None, Any]
"""One dimension's ``(backend, pg_options)``, as ``DeviceMesh._init_process_groups`` takes it."""


def backend_spelling(config: str, expand: Callable[[str], str]) -> str:
    """The backend string that makes a group of this configuration (pure): the backend's name
    where that name alone expands to exactly this configuration (``"nccl"``, ``"gloo"``: what a
    script passes, which torch's ``split_group`` path compares by name), else the configuration
    itself (``"cpu:gloo"``). ``expand``: a name's configuration (torch's ``BackendConfig``)."""
    names = {part.split(":", 1)[-1] for part in config.split(",") if part}
    if len(names) == 1:
        (name,) = names
        if expand(name) == config:
            return name
    return config


def dim_override(config: str, default_config: str, *, is_default: bool, spans_world: bool,
                 expand: Callable[[str], str]) -> BackendOverride:
    """The ``backend_override`` that makes one mesh dimension's group again as the set-up made
    it (pure; no ``pg_options``: see the module). ``config``: the group's backend
    configuration; ``default_config``: the default group's; ``is_default``: the dimension's
    group is the default group (a dimension over the whole world with no override of its own);
    ``spans_world``: it holds every rank, where torch reuses the default group unless an
    override is given. A backend is named where the set-up's differs from the default group's,
    or where torch would otherwise reuse the default group."""
    if is_default or (config == default_config and not spans_world):
        return (None, None)
    return (backend_spelling(config, expand), None)


def _expand(name: str) -> str:
    return str(dist.distributed_c10d.BackendConfig(dist.Backend(name)))


def _overrides(mesh: Any) -> tuple[BackendOverride, ...]:
    """Each dimension's ``backend_override`` of ``mesh``, read from its live groups."""
    default = dist.distributed_c10d._get_default_group()
    default_config = str(dist.get_backend_config(default))
    found = []
    for dim, name in enumerate(mesh._dim_group_names):
        if name is None:  # torch made no group for the dimension
            found.append((None, None))
            continue
        group = _resolve(name)
        found.append(dim_override(
            str(dist.get_backend_config(group)), default_config, is_default=group is default,
            spans_world=mesh._layout[dim].numel() == dist.get_world_size(), expand=_expand))
    return tuple(found)


def mesh_overrides(meshes: Iterable[Any]) -> dict[int, tuple[BackendOverride, ...]]:
    """``id(mesh)`` → its dimensions' overrides, for the root meshes and those flattened from
    them."""
    return {id(made): _overrides(made)
            for mesh in meshes for made in (mesh, *mesh._flatten_mapping.values())}


class RebindError(RuntimeError):
    """The kept modules cannot be pointed at the new generation's groups; the job restarts."""


def _group_count() -> int:
    return int(dist.distributed_c10d._world.group_count)


def _resolve(name: str) -> Any:
    return dist.distributed_c10d._resolve_process_group(name)


def _order(name: str) -> int:
    """Where a group's name puts it in the order of creation (hashed names: first)."""
    return int(name) if str(name).isdigit() else -1


def fsdp_modules(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """Every module under ``modules`` that ``fully_shard`` was applied to, each once."""
    from torch.distributed.fsdp import FSDPModule

    seen: dict[int, nn.Module] = {}
    for module in modules:
        for sub in module.modules():
            if isinstance(sub, FSDPModule):
                seen.setdefault(id(sub), sub)
    return list(seen.values())


def _mesh_infos(fsdp_module: nn.Module) -> list[Any]:
    """The distinct mesh infos of one FSDP2 module's parameter groups and parameters."""
    state = fsdp_module._get_fsdp_state()  # type: ignore[operator]
    infos: dict[int, Any] = {}
    for param_group in state._fsdp_param_groups:
        holders = [param_group, *param_group.fsdp_params]
        for holder in holders:
            for info in (holder.mesh_info, holder.post_forward_mesh_info):
                if info is not None:
                    infos.setdefault(id(info), info)
    return list(infos.values())


def device_meshes(modules: Iterable[nn.Module]) -> list[Any]:
    """The root meshes of the modules' DTensors and FSDP2 states, oldest first."""
    from torch.distributed.tensor import DTensor

    modules = list(modules)
    roots: dict[int, Any] = {}
    for module in modules:
        for tensor in [*module.parameters(), *module.buffers()]:
            if isinstance(tensor, DTensor):
                root = tensor.device_mesh._get_root_mesh()
                roots.setdefault(id(root), root)
    for fsdp_module in fsdp_modules(modules):
        for info in _mesh_infos(fsdp_module):
            root = info.mesh._get_root_mesh()
            roots.setdefault(id(root), root)
    return sorted(roots.values(),
                  key=lambda mesh: min((_order(n) for n in mesh._dim_group_names), default=-1))


@dataclasses.dataclass
class KeptModules:
    """The modules a survivor keeps through its recoveries, as seen when recovery armed."""

    modules: tuple[nn.Module, ...]
    set_up_groups: int
    """torch's group counter when recovery armed: how many named groups the set-up made."""
    overrides: dict[int, tuple[BackendOverride, ...]] = dataclasses.field(default_factory=dict)
    """``id(mesh)`` → each dimension's ``(backend, None)`` as the set-up made its group
    (:func:`mesh_overrides`); a mesh not here is made with the default group's."""

    @classmethod
    def arm(cls, modules: Sequence[nn.Module]) -> KeptModules:
        """Records how many groups the set-up made, and with which backends."""
        return cls(tuple(modules), _group_count(),
                   mesh_overrides(device_meshes(modules)))

    def rebind(self) -> str:
        """After the regroup: the meshes' groups made again, FSDP2 pointed at them, its
        iteration state reset. Returns a summary for the log; raises :class:`RebindError`."""
        for module in fsdp_modules(self.modules):
            state = module._get_fsdp_state()  # type: ignore[operator]
            if state._is_root:
                module.reset_iter_state()  # type: ignore[operator]
        meshes = device_meshes(self.modules)
        for mesh in meshes:
            # The root's groups, then those of the meshes flattened from it, in the order the
            # set-up flattened them (``_flatten`` makes one group each, after the root's).
            for made in (mesh, *mesh._flatten_mapping.values()):
                names = made.__class__._init_process_groups(
                    made._layout, made._rank_map, made._mesh_dim_names,
                    self.overrides.get(id(made), ((None, None),) * len(made._layout)))
                if list(names) != list(made._dim_group_names):
                    raise RebindError(
                        f"the device mesh {made.mesh_dim_names or ''} made again has the "
                        f"groups {list(names)}, not {list(made._dim_group_names)}: the set-up "
                        "made its groups in another order")
            mesh._pg_registry = {name: _resolve(name) for name in mesh._pg_registry}
        if _group_count() != self.set_up_groups:
            raise RebindError(
                f"the set-up made {self.set_up_groups} process groups and the kept modules' "
                f"device meshes {_group_count()}: make other groups inside the training "
                "function")
        repointed = 0
        for module in fsdp_modules(self.modules):
            for info in _mesh_infos(module):
                for field in GROUP_FIELDS:
                    group = getattr(info, field, None)
                    if group is not None:
                        setattr(info, field, _resolve(group.group_name))
                        repointed += 1
            stale = list(_stale_groups(module))
            if stale:
                raise RebindError(f"FSDP2 still holds a group of the old generation at "
                                  f"{', '.join(stale)}; update elasticft.inprocess.meshes")
        return f"{len(meshes)} meshes, {repointed} FSDP2 group references"


    def held_elsewhere(self) -> list[str]:
        """The kept modules' tensor-subclass parameters (DTensors) that something besides the
        module still holds: a weak reference, or a reference from C++ (an autograd graph, a
        pending collective). A move of the module (``.to()``, ``.cpu()``: a framework's
        re-entry makes one) swaps such a parameter in place, which torch refuses while another
        holds it; the number after the name is torch's count of holders (the module's, and an
        autograd gradient accumulator's, are expected)."""
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass

        held = []
        for module in self.modules:
            for name, parameter in module.named_parameters():
                if not is_traceable_wrapper_subclass(parameter):
                    continue
                if weakref.getweakrefs(parameter):
                    held.append(f"{name} (a weak reference)")
                elif (count := parameter._use_count()) > 2:
                    held.append(f"{name} ({count})")
        return held

    def sharded_over(self) -> list[str]:
        """The mesh dimensions FSDP2 shards the kept modules' state over (``"fsdp"`` for a mesh
        without names): a reshape that changes one of them cannot keep the shards."""
        dims: set[str] = set()
        for module in fsdp_modules(self.modules):
            for info in _mesh_infos(module):
                dims.update(info.mesh.mesh_dim_names or ("fsdp",))
        return sorted(dims)

    def reshape(self, sizes: Mapping[str, int]) -> str:
        """After a regroup into another world (:mod:`elasticft.inprocess.reshape`): each kept
        device mesh becomes the mesh of the new shape, in place. Its dimensions are named after
        the layout's (``pp``, ``dp``, ``tp``) and ``sizes`` gives their new sizes. The new root
        mesh is made as the script's ``init_device_mesh`` makes it (same groups, same order, as
        a process started in the new world would), and every mesh object the modules' DTensors
        hold (the root, and the submeshes such as ``mesh["tp"]`` the tensor parallel plan was
        given) takes on the new mesh's state, so the parameters, their local shards and the
        optimizer state stay where they are. Raises :class:`RebindError`."""
        from torch.distributed.device_mesh import init_device_mesh

        roots = device_meshes(self.modules)
        if flattened := [name for root in roots for name in root._flatten_mapping]:
            raise RebindError(f"a flattened device mesh ({', '.join(sorted(flattened))}) does "
                              "not take a new shape in place: a reshape restarts the job")
        if fsdp_modules(self.modules):
            raise RebindError("FSDP2 shards the kept modules over their mesh: a new world cuts "
                              "every shard again, which only a restart does")
        held = _held_meshes(self.modules)
        for root in roots:
            names = tuple(root.mesh_dim_names or ())
            unknown = [n for n in names if n not in sizes]
            if not names or unknown:
                raise RebindError(f"the device mesh {names or '(unnamed)'} has dimensions that "
                                  f"are not the layout's ({', '.join(sorted(sizes))}): name them "
                                  "after it to keep the modules through a reshape")
            new_root = init_device_mesh(root.device_type, tuple(sizes[n] for n in names),
                                        mesh_dim_names=names)
            for mesh in held:
                if mesh is not root and mesh._get_root_mesh() is root:
                    dims = tuple(mesh.mesh_dim_names or ())
                    _become(mesh, new_root[dims if len(dims) > 1 else dims[0]], root)
            _become(root, new_root, None)
        self.set_up_groups = _group_count()
        # The new meshes' groups are the default group's backend (a dimension's own backend is
        # not carried into a new shape): the next rebind makes them so.
        self.overrides = mesh_overrides(roots)
        shape = ", ".join(f"{n} {sizes[n]}" for n in sorted(sizes))
        return f"{len(roots)} meshes reshaped to {shape}"


def _held_meshes(modules: Iterable[nn.Module]) -> list[Any]:
    """Every device mesh object the modules' DTensors hold (submeshes included), each once."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, Any] = {}
    for module in modules:
        for tensor in [*module.parameters(), *module.buffers()]:
            if isinstance(tensor, DTensor):
                seen.setdefault(id(tensor.device_mesh), tensor.device_mesh)
    return list(seen.values())


def _become(mesh: Any, new: Any, root: Any) -> None:
    """``mesh`` takes on the state of ``new`` in place (its holders keep the object); a submesh
    keeps pointing at its own root object (``root``), which takes on the new root's state."""
    state = dict(vars(new))
    vars(mesh).clear()
    vars(mesh).update(state)
    if root is not None:
        mesh._root_mesh = root


def _stale_groups(fsdp_module: nn.Module) -> Iterator[str]:
    """Where the FSDP2 state of ``fsdp_module`` holds a process group that is not the live one
    of its name (one level into each object of the state)."""
    state = fsdp_module._get_fsdp_state()  # type: ignore[operator]
    objects: list[tuple[str, Any]] = [("state", state)]
    for i, param_group in enumerate(state._fsdp_param_groups):
        objects.append((f"param_group[{i}]", param_group))
        objects += [(f"param_group[{i}].fsdp_params[{j}]", p)
                    for j, p in enumerate(param_group.fsdp_params)]
    objects += [(f"mesh_info[{i}]", info) for i, info in enumerate(_mesh_infos(fsdp_module))]
    for where, obj in objects:
        for name, value in vars(obj).items():
            inner = vars(value).items() if hasattr(value, "__dict__") and not isinstance(
                value, (nn.Module, dist.ProcessGroup)) else ()
            for attr, found in [(name, value), *((f"{name}.{k}", v) for k, v in inner)]:
                if isinstance(found, dist.ProcessGroup) and not _live(found):
                    yield f"{where}.{attr}"


def _live(group: Any) -> bool:
    """Whether ``group`` is the group c10d's registry holds under its name."""
    try:
        return _resolve(group.group_name) is group
    except (RuntimeError, ValueError, KeyError):
        return False
