"""The worker-side recorder for gloo and CPU training: collectives, DDP buckets, steps, losses.

It writes the same ring records as the NCCL shim (:mod:`elasticft.diag.ring`), from Python:

* **collectives**: the public ``torch.distributed`` collective functions are replaced by thin
  wrappers that record enqueue and completion (the ``Work`` future's callback for
  ``async_op=True``) and call the original unchanged. Who times a collective is a pure function
  of its group's backend and the NCCL interception verdict (:func:`who_times`): once the NCCL
  shim is seen to time torch's NCCL calls, NCCL groups are left to it, and when every process
  group is then left to the shim the original functions are put back, so that a collective
  costs what it costs under the shim alone (:func:`wrappers_needed`; a group created later,
  gloo for instance, puts the wrappers back);
* **DDP buckets**: a communication hook doing exactly what DDP's default all-reduce hook does
  (divide, all-reduce, same future), timed per bucket. DDP's reducer calls collectives from C++,
  so this is the only way to see them. Gradients are bit-identical to the default hook;
* **steps**: a global optimizer step post-hook (``register_optimizer_step_post_hook``) marks each
  optimizer step;
* **losses**: :meth:`Recorder.report_loss`, called through :func:`elasticft.init`'s handle;
* **heartbeat**: a daemon thread stamps the ring header every 100 ms. gloo releases the GIL while
  it waits, so a worker blocked in a collective keeps beating; a stopped or wedged process does not.

Completion callbacks run on gloo's threads, so every write takes the recorder's lock. Nothing here
may raise into the training script: recording errors are logged once and dropped.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from elasticft.diag.ring import FLAG_HOST_COMPLETION, FLAG_TIMED, Op, RingWriter
from elasticft.diag.shimcheck import BYPASSED, THROUGH_SHIM, UNVERIFIED, InterceptionCheck

logger = logging.getLogger(__name__)

# Plain ints: IntEnum members cost an attribute lookup and a conversion per record.
_STEP = int(Op.STEP)
_LOSS = int(Op.LOSS)
_SEQUENCES = (list, tuple)

OWNER_PID_ENV = "ELASTICFT_DIAG_OWNER_PID"

# Public torch.distributed collectives and the op each is recorded as.
WRAPPED_COLLECTIVES: dict[str, Op] = {
    "all_reduce": Op.ALL_REDUCE,
    "broadcast": Op.BROADCAST,
    "reduce": Op.REDUCE,
    "all_gather": Op.ALL_GATHER,
    "all_gather_into_tensor": Op.ALL_GATHER,
    "reduce_scatter": Op.REDUCE_SCATTER,
    "reduce_scatter_tensor": Op.REDUCE_SCATTER,
    "all_to_all": Op.ALL_TO_ALL,
    "all_to_all_single": Op.ALL_TO_ALL,
    "barrier": Op.BARRIER,
    "gather": Op.GATHER,
    "scatter": Op.SCATTER,
    "send": Op.SEND,
    "recv": Op.RECV,
}


PYTHON, SETTLING, SHIM = "python", "settling", "shim"
"""Who times a collective: the Python wrapper; the Python wrapper, which also feeds the NCCL
interception check; the NCCL shim alone (the wrapper calls the original at once, or is gone)."""


def who_times(backend: str | None, verdict: str | None) -> str:
    """Who times a collective on a group of ``backend`` given the NCCL interception verdict
    (None: no active shim in this worker). Only a pure ``nccl`` group can be left to the shim:
    a multi-device group (``cpu:gloo,cuda:nccl``) may run on gloo (pure)."""
    if backend != "nccl" or verdict is None or verdict == BYPASSED:
        return PYTHON
    if verdict == THROUGH_SHIM:
        return SHIM
    return SETTLING


def wrappers_needed(backends: Iterable[str | None], verdict: str | None,
                    creation_seen: bool) -> bool:
    """Whether the public collectives must stay wrapped: some process group is not left to the
    shim, or groups created later could not be seen (then one may be gloo) (pure)."""
    if not creation_seen:
        return True
    return any(who_times(backend, verdict) != SHIM for backend in backends)


def _group_position(function: Callable[..., Any]) -> int:
    """Index of the ``group`` parameter when passed positionally (-1: keyword only / none)."""
    try:
        names = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return -1
    return names.index("group") if "group" in names else -1


def _nbytes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    tensor = args[0] if args else kwargs.get("tensor")
    if isinstance(tensor, _SEQUENCES):
        tensor = tensor[0] if tensor else None
    try:
        return int(tensor.nbytes)  # type: ignore[union-attr]
    except Exception:
        return 0


class _PerGroup:
    """A value cached per process group that does not keep the group alive.

    A group still referenced after ``destroy_process_group`` is destroyed during interpreter
    teardown instead, where gloo aborts the process now and then ("terminate called without an
    active exception", 3 exits in 100 on torch 2.13): training that ended well would exit -6.
    An entry dies with its group, so a later group at the same address is a new entry."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref[Any], Any]] = {}

    def get(self, pg: Any) -> Any:
        entry = self._entries.get(id(pg))
        return entry[1] if entry is not None and entry[0]() is pg else None

    def put(self, pg: Any, value: Any) -> None:
        key = id(pg)
        try:
            ref = weakref.ref(pg, lambda _dead: self._entries.pop(key, None))
        except TypeError:
            return  # not weakly referable: computed again on each call
        self._entries[key] = (ref, value)


class Recorder:
    """Writes one worker's progress ring; create with :meth:`open` or inject a writer."""

    def __init__(
        self,
        writer: RingWriter,
        rank: int,
        *,
        clock_ns: Callable[[], int] = time.monotonic_ns,
        heartbeat_interval_s: float = 0.1,
    ) -> None:
        self.writer = writer
        self.rank = rank
        self._clock_ns = clock_ns
        self._lock = threading.Lock()
        self._comm_keys = _PerGroup()
        self._comm_seqs: dict[int, int] = {}
        self._steps = 0
        self._last_step_ns = clock_ns()
        self._stop = threading.Event()
        self._heartbeat_interval_s = heartbeat_interval_s
        self._heartbeat: threading.Thread | None = None
        self._originals: dict[str, Callable[..., Any]] = {}
        self._hook_handles: list[Any] = []
        self._ddp_seen: weakref.WeakSet[Any] = weakref.WeakSet()
        """The DDP models already looked at (weakly: a DDP made after another was freed may
        get its ``id``)."""
        self._autoattach: Any = None
        """While armed: the handle that puts ``DistributedDataParallel.__init__`` back (a DDP
        made while armed gets a forward pre-hook of its own that attaches the bucket hook)."""
        self._autoattach_installed = False
        """Whether :meth:`install_ddp_autoattach` ran (re-arming is for such a recorder only)."""
        self._failed_once = False
        self.nccl_check: InterceptionCheck | None = None
        """Set when the NCCL shim's self-check found it active. Once it has seen torch's NCCL
        calls reach the shim (which times them on the GPU), the Python wrappers leave NCCL
        groups alone (microseconds a call); until then, and if they never do, they time them."""
        self._nccl_groups = _PerGroup()
        self._dist: Any = None
        self._wrappers: dict[str, Callable[..., Any]] = {}
        self._creation_seen = False
        self.collectives_wrapped = False
        """The public collectives are this recorder's wrappers right now."""

    @classmethod
    def open(cls, ring: Path, rank: int) -> Recorder:
        """A recorder writing to the Python ring file ``ring``
        (:class:`elasticft.diag.ring.RingFiles` ``.py``)."""
        return cls(RingWriter(ring, rank, "py"), rank)

    # -- low level ----------------------------------------------------------------------------

    def start_heartbeat(self) -> None:
        if self._heartbeat is None:
            self.writer.heartbeat(self._clock_ns())
            self._heartbeat = threading.Thread(
                target=self._beat, name="elasticft-diag-heartbeat", daemon=True
            )
            self._heartbeat.start()

    def _beat(self) -> None:
        stop = self._stop
        while not stop.wait(self._heartbeat_interval_s):
            with self._lock:
                self.writer.heartbeat(self._clock_ns())

    def _dropped(self) -> None:
        if not self._failed_once:
            self._failed_once = True
            logger.warning("elasticft diagnostics: a record was dropped", exc_info=True)

    def comm_key(self, group: Any) -> int:
        """A number identical on every member of ``group`` (its name and ranks, hashed)."""
        if group is not None:  # the per-collective path: no import, no world lookup
            cached = self._comm_keys.get(group)
            if cached is not None:
                return cached
        try:
            import torch.distributed as dist

            pg = group if group is not None else dist.group.WORLD
        except Exception:
            return 0
        cached = self._comm_keys.get(pg)
        if cached is not None:
            return cached
        try:
            name = getattr(pg, "group_name", "")
            ranks = dist.get_process_group_ranks(pg)
            digest = hashlib.blake2b(f"{name}|{ranks}".encode(), digest_size=8).digest()
            key = int.from_bytes(digest, "little") or 1
        except Exception:
            return 0
        self._comm_keys.put(pg, key)
        return key

    def begin(self, op: int, comm: int = 0, nbytes: int = 0, peer: int = -1) -> int:
        try:
            with self._lock:
                seqs = self._comm_seqs
                seqs[comm] = comm_seq = seqs.get(comm, 0) + 1
                return self.writer.publish(op, comm, nbytes, self._clock_ns(), 0, 0.0, peer,
                                           FLAG_TIMED, comm_seq)
        except Exception:
            self._dropped()
            return 0

    def end(self, seq: int) -> None:
        if seq:
            try:
                with self._lock:
                    self.writer.complete(seq, self._clock_ns())
            except Exception:
                self._dropped()

    def mark_step(self) -> None:
        try:
            with self._lock:
                now = self._clock_ns()
                self._steps += 1
                self.writer.publish(_STEP, 0, 0, self._last_step_ns, now, float(self._steps),
                                    -1, FLAG_HOST_COMPLETION, 0)
                self.writer.mark_step(self._steps, now)
                self._last_step_ns = now
        except Exception:
            self._dropped()

    def report_loss(self, loss: Any, step: int | None = None) -> None:
        """Records a loss value (a float or a one-element tensor) for the NaN/spike detectors."""
        try:
            value = float(loss.detach().item() if hasattr(loss, "detach") else loss)
            with self._lock:
                now = self._clock_ns()
                self.writer.publish(_LOSS, 0, 0, now, now, value,
                                    self._steps if step is None else step, 0, 0)
        except Exception:
            self._dropped()

    # -- torch integration --------------------------------------------------------------------

    def wrap_collectives(self, dist_module: Any) -> None:
        """Replaces the public collectives of ``torch.distributed`` by recording wrappers."""
        self._dist = dist_module
        for name, op in WRAPPED_COLLECTIVES.items():
            original = self._originals.get(name) or getattr(dist_module, name, None)
            if original is None:
                continue
            self._originals[name] = original
            if name not in self._wrappers:
                self._wrappers[name] = self._wrapper(original, op)
            setattr(dist_module, name, self._wrappers[name])
        self.collectives_wrapped = True

    def unwrap_collectives(self, dist_module: Any) -> None:
        """Puts the original collectives back (a wrapper another patch replaced stays replaced)."""
        for name, original in self._originals.items():
            if getattr(dist_module, name, None) is self._wrappers.get(name):
                setattr(dist_module, name, original)
        self.collectives_wrapped = False

    def watch_group_creation(self, dist_module: Any) -> bool:
        """Re-decides the wrapping after every process group torch creates (True: seen).

        ``init_process_group`` and ``new_group`` (and the device meshes built on it) create
        their groups through ``distributed_c10d._new_process_group_helper``; without it, or
        without torch's group map, the wrappers are never all taken away."""
        c10d = getattr(dist_module, "distributed_c10d", None)
        helper = getattr(c10d, "_new_process_group_helper", None)
        if helper is None or getattr(getattr(c10d, "_world", None), "pg_map", None) is None:
            return False
        if getattr(helper, "__elasticft_original__", None) is None:
            recorder = self

            @functools.wraps(helper)
            def new_process_group_helper(*args: Any, **kwargs: Any) -> Any:
                result = helper(*args, **kwargs)
                recorder.decide_wrapping()
                return result

            new_process_group_helper.__elasticft_original__ = helper  # type: ignore[attr-defined]
            c10d._new_process_group_helper = new_process_group_helper
        self._creation_seen = True
        return True

    def group_backends(self) -> list[str | None]:
        """The backend of every process group this process has (torch's group map)."""
        try:
            groups = list(self._dist.distributed_c10d._world.pg_map)
        except Exception:
            return [None]  # unknown: the wrappers stay
        return [self.backend_of(pg) for pg in groups]

    def decide_wrapping(self) -> None:
        """Wraps or unwraps the collectives as :func:`wrappers_needed` says (never raises)."""
        if self._dist is None or not self._originals:
            return
        try:
            check = self.nccl_check
            needed = wrappers_needed(self.group_backends(),
                                     check.verdict if check is not None else None,
                                     self._creation_seen)
            if needed and not self.collectives_wrapped:
                self.wrap_collectives(self._dist)
            elif not needed and self.collectives_wrapped:
                self.unwrap_collectives(self._dist)
                logger.debug("every process group is timed by the NCCL shim; "
                             "the Python collective wrappers are off")
        except Exception:
            self._dropped()

    def _wrapper(self, original: Callable[..., Any], op: Op) -> Callable[..., Any]:
        recorder = self
        op_number = int(op)
        group_at = _group_position(original)

        @functools.wraps(original)
        def collective(*args: Any, **kwargs: Any) -> Any:
            if "group" in kwargs:
                group = kwargs["group"]
            else:
                group = args[group_at] if 0 <= group_at < len(args) else None
            check = recorder.nccl_check
            settling = False
            if check is not None and recorder.on_nccl(group):
                verdict = check.verdict
                if verdict == THROUGH_SHIM:
                    return original(*args, **kwargs)
                settling = verdict == UNVERIFIED
            peer = kwargs.get("dst", kwargs.get("src", -1))
            seq = recorder.begin(op_number, recorder.comm_key(group), _nbytes(args, kwargs),
                                 peer if isinstance(peer, int) else -1)
            try:
                result = original(*args, **kwargs)
            except BaseException:
                recorder.end(seq)
                raise
            recorder._complete_when_done(seq, result)
            if settling:
                recorder._settle(check)
            return result

        collective.__elasticft_original__ = original  # type: ignore[attr-defined]
        return collective

    def _settle(self, check: InterceptionCheck) -> None:
        try:
            check.after_nccl_call()
        except Exception:
            self._dropped()
        if check.verdict == THROUGH_SHIM:
            self.decide_wrapping()

    def backend_of(self, pg: Any) -> str | None:
        """The backend of process group ``pg`` as ``dist.get_backend`` names it (None: none)."""
        import torch.distributed as dist

        return None if pg is None else str(dist.get_backend(pg))

    def on_nccl(self, group: Any) -> bool:
        """``group`` (None: the default group) runs on NCCL; cached per process group."""
        try:
            import torch.distributed as dist

            pg = group if group is not None else dist.group.WORLD
            cached = self._nccl_groups.get(pg)
            if cached is None:
                cached = self.backend_of(pg) == "nccl"
                self._nccl_groups.put(pg, cached)
            return cached
        except Exception:
            return False

    def _complete_when_done(self, seq: int, result: Any) -> None:
        if result is None or not hasattr(result, "get_future"):
            self.end(seq)
            return
        try:
            result.get_future().then(lambda _f: self.end(seq))
        except Exception:
            self.end(seq)

    def ddp_comm_hook(self, process_group: Any) -> Callable[[Any, Any], Any]:
        """A DDP comm hook equal to DDP's default all-reduce, bit for bit, timed per bucket."""
        import torch.distributed as dist

        all_reduce = self._originals.get("all_reduce", dist.all_reduce)
        group = process_group if process_group is not None else dist.group.WORLD
        key = self.comm_key(group)
        recorder = self
        bucket_op = int(Op.DDP_BUCKET)
        inverse = 1.0 / group.size()

        def timed_allreduce_hook(state: Any, bucket: Any) -> Any:
            tensor = bucket.buffer()
            seq = recorder.begin(bucket_op, key, tensor.nbytes, bucket.index())
            # DDP's own path multiplies each gradient by the inverse of the world size (its
            # reducer's ``mul_out``): so does this, for the same bits. A division differs from it
            # in the last bit where the size is no power of two, and a job whose DDPs mix the
            # two (a re-made DDP, a new rank's) sums differently from one that does not.
            tensor.mul_(inverse)
            fut = all_reduce(tensor, group=group, async_op=True).get_future()

            def done(f: Any) -> Any:
                recorder.end(seq)
                return f.value()[0]

            return fut.then(done)

        # DDP checks the hook's annotations as objects; this module's are strings (PEP 563).
        import torch

        timed_allreduce_hook.__annotations__ = {
            "state": object, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]
        }
        return timed_allreduce_hook

    def attach_ddp(self, model: Any) -> bool:
        """Registers the timed hook on a DDP model unless it already has a comm hook, or its
        group is on NCCL and the shim is seen to time NCCL (DDP's own C++ hook stays)."""
        if model in self._ddp_seen:
            return False
        self._ddp_seen.add(model)
        if getattr(model, "_comm_hooks", None):
            logger.info("DDP model already has a comm hook; its buckets are not timed")
            return False
        check = self.nccl_check
        if (check is not None and self.on_nccl(getattr(model, "process_group", None))
                and check.peek() == THROUGH_SHIM):
            self.decide_wrapping()
            return False
        model.register_comm_hook(None, self.ddp_comm_hook(getattr(model, "process_group", None)))
        return True

    def install_step_hook(self) -> Any:
        """Marks every optimizer step; returns the hook's handle (``.remove()`` undoes it)."""
        from torch.optim.optimizer import register_optimizer_step_post_hook

        handle = register_optimizer_step_post_hook(self._on_step)
        self._hook_handles.append(handle)
        return handle

    def _on_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.mark_step()

    def install_ddp_autoattach(self) -> None:
        """Attaches the bucket hook to every DDP model at its first forward (unmodified scripts).

        Each DDP model made while this is armed gets a forward pre-hook of its own, which
        attaches at its first forward (after the script's own ``register_comm_hook``, if any)
        and removes itself. A global module hook would do the same for every module call, and
        ``torch.compile`` warns at every call of a compiled module while one exists. Disarmed
        at the next optimizer step: every DDP model is normally made by then. A DDP made later
        (the one an in-process recovery's re-entry makes) needs it again:
        :meth:`rearm_ddp_autoattach`.
        """
        from torch.optim.optimizer import register_optimizer_step_post_hook

        def disarm_after_the_step(optimizer: Any, args: Any, kwargs: Any) -> None:
            if self._autoattach is not None:
                self._autoattach.remove()
                self._autoattach = None

        self._autoattach_installed = True
        self.rearm_ddp_autoattach()
        self._hook_handles.append(register_optimizer_step_post_hook(disarm_after_the_step))

    def rearm_ddp_autoattach(self) -> None:
        """Attaches the bucket hook to the DDP models made before the next optimizer step
        (after an in-process recovery: the DDPs its re-entry makes), at their first forward, so
        that their buckets are timed as the first ones were; nothing for a recorder installed
        without it."""
        from torch.nn.parallel import DistributedDataParallel

        if self._autoattach is not None or not self._autoattach_installed:
            return
        recorder = self
        made = DistributedDataParallel.__init__

        def init_then_watch(ddp: Any, *args: Any, **kwargs: Any) -> None:
            made(ddp, *args, **kwargs)
            handle: Any = None

            def on_first_forward(module: Any, forward_args: Any) -> None:
                handle.remove()
                if module not in recorder._ddp_seen:
                    try:
                        recorder.attach_ddp(module)
                    except Exception:
                        logger.warning("could not time DDP buckets", exc_info=True)

            handle = ddp.register_forward_pre_hook(on_first_forward)

        DistributedDataParallel.__init__ = init_then_watch  # type: ignore[method-assign]
        self._autoattach = _PutBack(DistributedDataParallel, "__init__", made)
        self._hook_handles.append(self._autoattach)

    def close(self) -> None:
        self._stop.set()
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()


class _PutBack:
    """Puts a class attribute back on :meth:`remove` (once), like a hook's handle."""

    def __init__(self, owner: type, name: str, original: Any) -> None:
        self.owner, self.name, self.original = owner, name, original

    def remove(self) -> None:
        if self.original is not None:
            setattr(self.owner, self.name, self.original)
            self.original = None


# One recorder per worker process: torch's optimizer and module hooks it registers are themselves
# process-global, so a second recorder would double every record.
_installed: Recorder | None = None


def installed() -> Recorder | None:
    return _installed


def install(
    ring: Path,
    rank: int,
    *,
    wrap_collectives: bool = True,
    step_hook: bool = True,
    ddp_autoattach: bool = True,
) -> Recorder:
    """Installs the recorder, writing to the Python ring file ``ring``, in this process
    (idempotent); ``torch`` must be importable."""
    global _installed
    if _installed is not None:
        return _installed
    import torch.distributed as dist

    recorder = Recorder.open(ring, rank)
    if wrap_collectives and dist.is_available():
        recorder.wrap_collectives(dist)
        recorder.watch_group_creation(dist)
    if step_hook:
        recorder.install_step_hook()
    if ddp_autoattach and dist.is_available():
        recorder.install_ddp_autoattach()
    recorder.start_heartbeat()
    os.environ[OWNER_PID_ENV] = str(os.getpid())
    _installed = recorder
    return recorder
