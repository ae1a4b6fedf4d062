"""Warm template: import the heavy modules once, then fork a worker for every start of the node.

The agent starts ``python -u script.py args...`` (exactly the worker's command line) with this
directory first on PYTHONPATH and a socket in ``ELASTICFT_WARM_FD``. Python runs this file at
start-up, before the script: it imports the modules named in ``ELASTICFT_WARM_PRELOAD`` (torch),
tells the agent it is ready and becomes a fork server for every local rank of the node, serving
their requests one at a time. Each start request carries the worker's full environment (its
``LOCAL_RANK`` among it), its working directory and its stdout/stderr descriptors. The server
forks; the child starts its own session, makes itself what a freshly started worker would be at
this point of start-up (environment, sys.path, output streams, the ``sitecustomize`` it
shadowed, e.g. elasticft's diagnostics bootstrap) and returns, so that the interpreter goes on
to run the script as ``__main__``. The server stays, imports done, for the next start.

The fork is double: the server forks an intermediate process that forks the worker and exits at
once. The agent holds the child-subreaper flag while it waits for the reply, so the orphaned
worker is re-parented to the agent, which then watches, signals and reaps it as its own child;
the reply (the worker's pid) is sent only after the intermediate has been reaped and the worker
has started its session. The process the agent watches is therefore the worker, with its real
exit code, signals and traceback.

If anything is off (a preload failed, a different directory was asked for, an error here), the
forked child ``exec``s the worker's command with the requested environment instead: a normal
cold start in the same process. When the agent goes away (its end of the socket closes) the
server exits without running user code.

Standard library only: this runs before anything else and must not import elasticft.
"""

import os
import sys

_FD_ENV = "ELASTICFT_WARM_FD"
_PRELOAD_ENV = "ELASTICFT_WARM_PRELOAD"
_HERE = os.path.dirname(os.path.abspath(__file__))


def _without_here(path_list):
    return [p for p in path_list if os.path.abspath(p or os.curdir) != _HERE]


def _run_shadowed_sitecustomize():
    """Runs the ``sitecustomize`` this file shadows, as site.py would have at start-up."""
    import importlib.machinery
    import importlib.util

    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _without_here(sys.path))
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # site.py's own report for a broken sitecustomize
        sys.stderr.write(
            "Error in sitecustomize; set PYTHONVERBOSE for traceback:\n"
            f"{type(err).__name__}: {err}\n"
        )


def _receive(sock, max_fds=2):
    """One start request: (header dict, [stdout fd, stderr fd]) or None when the agent left."""
    import json
    import socket
    import struct

    head, fds, _, _ = socket.recv_fds(sock, 8, max_fds)
    while head and len(head) < 8:
        more = sock.recv(8 - len(head))
        if not more:
            break
        head += more
    if len(head) < 8:
        return None
    (size,) = struct.unpack("!Q", head)
    chunks, got = [], 0
    while got < size:
        chunk = sock.recv(min(size - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return json.loads(b"".join(chunks)), fds


def _captured(fd):
    """What the warm-up phase wrote to ``fd`` (a private temporary file), as bytes."""
    try:
        size = os.fstat(fd).st_size
        return os.pread(fd, size, 0) if size else b""
    except OSError:
        return b""


def _write_all(fd, data):
    while data:
        data = data[os.write(fd, data):]


def _exec_cold(request):
    os.execvpe(request["argv"][0], request["argv"], request["env"])


def _bind_to_agent(env):
    """Asks the kernel for SIGKILL when the agent dies (``elasticft.agent.lifeline``), once
    the worker is the agent's child: its first parent is the intermediate of the double fork
    (or of a spare), which exits at once. A worker whose agent is already gone exits."""
    import ctypes
    import signal
    import time

    try:
        agent = int(env.get("ELASTICFT_AGENT_PID", ""))
    except ValueError:
        return  # an agent that does not bind its workers
    first = os.getppid()
    deadline = time.monotonic() + 5.0
    while first != agent and os.getppid() == first and time.monotonic() < deadline:
        time.sleep(0.0005)
    libc = ctypes.CDLL(None, use_errno=True)
    bound = libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) == 0  # PR_SET_PDEATHSIG
    if bound and os.getppid() != agent:
        os._exit(1)  # re-parented elsewhere: the agent died during the start


def _start_signals(ignored):
    """The signal dispositions a cold start of the worker would have (``ignored``: signal name
    -> whether the agent ignores it): ignored, or the default (SIGINT: Python's handler)."""
    import signal

    for name, ignore in ignored.items():
        number = getattr(signal, name)
        if ignore:
            signal.signal(number, signal.SIG_IGN)
        elif number == signal.SIGINT:
            signal.signal(number, signal.default_int_handler)
        else:
            signal.signal(number, signal.SIG_DFL)


def _become_worker(request, fds, preload_error):
    _bind_to_agent(request["env"])
    _start_signals(request.get("signals", {}))
    out_fd, err_fd = fds
    warm_output = (_captured(1), _captured(2))
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    os.close(out_fd)
    os.close(err_fd)
    if preload_error is not None or os.getcwd() != request["cwd"]:
        _exec_cold(request)
    # Exactly the worker's environment. A variable a preloaded import set for itself is dropped:
    # the script may never import that module (torch._dynamo sets TORCHINDUCTOR_CACHE_DIR), and
    # torch sets such variables again where it uses them.
    os.environ.clear()
    os.environ.update(request["env"])
    _per_attempt_fixups(os.environ)
    sys.path[:] = _without_here(sys.path)
    sys.path_importer_cache.pop(_HERE, None)
    _write_all(1, warm_output[0])
    _write_all(2, warm_output[1])
    _run_shadowed_sitecustomize()


def _fork_worker(close_inherited, fds):
    """Forks the worker (twice, see above). Returns its pid (-1: it did not start) in the
    server, returns None in the worker, which then becomes the script; the intermediate exits.
    ``close_inherited()`` closes, in the worker, the server's socket and every descriptor it
    holds for other local ranks' spares."""
    import struct

    read_end, write_end = os.pipe()
    intermediate = os.fork()
    if intermediate == 0:
        worker = -1
        try:
            worker = os.fork()
        finally:
            if worker != 0:
                os._exit(0)  # the intermediate: its only job was to orphan the worker
        try:
            # Its own session, as torch starts workers: torch signals it with killpg.
            os.setsid()
            close_inherited()
            os.close(read_end)
            os.write(write_end, struct.pack("!q", os.getpid()))
            os.close(write_end)
        except BaseException:
            os._exit(127)  # the server reads no pid and the agent starts this worker cold
        return None
    os.close(write_end)
    for fd in fds:
        os.close(fd)
    os.waitpid(intermediate, 0)  # the worker is now re-parented to the agent
    with os.fdopen(read_end, "rb") as pipe:
        reply = pipe.read(8)
    return struct.unpack("!q", reply)[0] if len(reply) == 8 else -1


def _reseed_numpy():
    """A cold start seeds numpy's global generator from the OS; a fork would copy the server's."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _import(importlib, entry):
    """One preload entry: ``module``, or ``module:name`` for ``from module import name`` (the
    name may be a lazy attribute, which only reading it imports)."""
    module, _, name = entry.partition(":")
    imported = importlib.import_module(module)
    if name:
        try:
            getattr(imported, name)
        except AttributeError:
            importlib.import_module(f"{module}.{name}")


def _device_touched():
    """Whether an import made a CUDA context here, which no forked worker could use."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    return bool(cuda is not None and cuda.is_initialized())


def _first_rank(env, names):
    for name in names:
        if env.get(name) is not None:
            return int(env[name])
    return None


def _per_attempt_fixups(env):
    """What a preloaded framework read of the per-attempt variables at import, set again from
    the worker's own (see :mod:`elasticft.agent.preload`): Lightning's and torchmetrics'
    ``rank_zero_only.rank``, which both set, the first import winning, from the rank variables
    (Lightning: ``RANK``, ``LOCAL_RANK``, ``SLURM_PROCID``, ``JSM_NAMESPACE_RANK``;
    torchmetrics alone: ``LOCAL_RANK``)."""
    rank_zero = sys.modules.get("lightning_utilities.core.rank_zero")
    if rank_zero is None or not hasattr(rank_zero.rank_zero_only, "rank"):
        return
    lightning = any(name in sys.modules for name in (
        "lightning.fabric.utilities.rank_zero", "lightning_fabric.utilities.rank_zero"))
    if lightning:
        rank = _first_rank(env, ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"))
    else:
        rank = _first_rank(env, ("LOCAL_RANK",))
    rank_zero.rank_zero_only.rank = rank or 0


def _warm_device():
    """The spare-forking module (:mod:`_elasticft_warm_device`, beside this file) when the agent
    asked for device preparation, with ``mode`` set on it; else None."""
    try:
        import _elasticft_warm_device as device
    except ImportError:
        os.environ.pop("ELASTICFT_WARM_DEVICE", None)
        return None
    device.mode = device.mode_from_env(os.environ)
    return None if device.mode == "off" else device


def _closer(sock, spares):
    """What a process forked from the server closes: the server's socket and the descriptors
    of every waiting spare (a spare's intermediate exits only once all copies of its hold
    descriptor are closed)."""

    def close_inherited():
        sock.close()
        for spare in spares.values():
            spare.close_in_child()

    return close_inherited


def _main():
    fd = os.environ.pop(_FD_ENV, None)
    preload = [m for m in os.environ.pop(_PRELOAD_ENV, "").split(",") if m]
    if fd is None:  # not a warm interpreter: stay out of the way
        sys.path[:] = _without_here(sys.path)
        _run_shadowed_sitecustomize()
        return
    import contextlib
    import gc
    import importlib
    import socket
    import struct

    sock = socket.socket(fileno=int(fd))
    preload_error = None
    # No collection while importing: what the imports make is no garbage (it is frozen
    # below), and the collections their allocations set off are a seventh of their CPU.
    gc.disable()
    # On this thread, the one that forks every worker: libraries keep state per importing
    # thread (MKL's allocator does), and a worker forked after an import on another thread
    # spun in MKL's first matrix product.
    for entry in preload:
        try:
            _import(importlib, entry)
        except BaseException as err:  # the script will meet it again, in a cold start
            preload_error = err
            break
    if preload_error is None and _device_touched():
        preload_error = RuntimeError("a preloaded import initialised CUDA")
    # What the imports made is never garbage: frozen, it is out of every collection of the
    # workers forked from here, and of their last one at exit (a second of CPU each with
    # torch). Python's advice for a process that forks without exec; it also leaves those
    # pages shared with the workers.
    gc.freeze()
    gc.enable()
    device = _warm_device()
    # The agent may already have sent its request (it is buffered).
    with contextlib.suppress(OSError):
        sock.sendall(b"R")
    # The template serves every local rank of the node, one request at a time; with a device
    # mode, each local rank has its own spare, forked after that rank's latest start.
    spares = {}
    close_inherited = _closer(sock, spares)
    while True:
        try:
            received = _receive(sock)
        except OSError:
            received = None
        if received is None:
            os._exit(0)  # the agent is gone or discarded us; no user code has run
        request, fds = received
        local_rank = None
        if device is not None:
            local_rank = device.local_rank_from_env(request["env"])
        pid = -1
        spare = spares.pop(local_rank, None)
        if spare is not None:  # the rank's next worker is waiting, maybe with its device ready
            pid = spare.start(request, fds)
        try:
            if pid == -1:
                pid = _fork_worker(close_inherited, fds)
        except OSError:  # no fork: the agent starts this worker cold
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            pid = -1
        if pid is None:
            break
        try:
            sock.sendall(b"P" + struct.pack("!q", pid))
        except OSError:
            os._exit(0)
        if device is not None and pid > 0:
            spare = device.fork_spare(pid, close_inherited, local_rank, device.mode, _receive)
            if isinstance(spare, tuple):  # this process is the spare, asked to start
                request, fds = spare
                break
            if spare is not None:
                spares[local_rank] = spare
    try:
        _reseed_numpy()
        _become_worker(request, fds, preload_error)
    except BaseException:
        # Never half a worker: start over as a cold one in this same process.
        try:
            _exec_cold(request)
        finally:
            os._exit(127)  # exec failed, as it would have for the cold start


_main()
