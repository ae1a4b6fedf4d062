"""Warm device: the next worker of a local rank waits with its CUDA context already made.

A CUDA context cannot cross a fork, so the warm template (``sitecustomize`` here) must never
touch CUDA: it forks every worker of every local rank. What it can do is fork the *next* worker
early. After each start it forks a **spare** for that start's local rank (its ``LOCAL_RANK``): a
process that is already that local rank's next worker, waiting; each local rank has its own.
The spare watches the worker just started (a pidfd). While that worker runs, the spare holds no
GPU memory. Once it has exited (a crash, a kill after a hang, a stop for a restart), and only if
it had CUDA loaded (``libcuda`` in its memory map), the spare creates the CUDA context on the
local rank's device and a cuBLAS handle, the seconds of a GPU worker's start that need no
rendezvous, while the agent is still deciding and rendezvousing. The next start request of that
local rank goes to its spare, which becomes the worker exactly as a freshly forked one would.

What the script sees is what a cold start shows, except that ``torch.cuda.is_initialized()`` is
already true: the environment is the request's, the current device is torch's default (the
context is made inside ``torch.cuda.device(i)``, which puts the previous device back without
making a context there), and no tensor is left allocated.

``ELASTICFT_WARM_DEVICE`` (set by the agent's pool) chooses: ``auto`` prepares as above; ``always``
also prepares after a worker that never loaded CUDA (so the mechanics can be tested on a CPU,
where the preparation itself finds no CUDA and does nothing); unset or ``off``: no spare at all.
:data:`PREPARED` tells the worker what its spare did (tests read it).

Standard library only until the preparation itself, which imports torch (already imported).
"""

import contextlib
import json
import os
import select
import socket
import struct

MODE_ENV = "ELASTICFT_WARM_DEVICE"
MODES = ("off", "auto", "always")
_CHECK_EVERY_S = 0.5
"""How often the spare looks whether the running worker has loaded CUDA (once it has, never)."""

PREPARED = None
"""In a worker that was a spare: what it prepared (a dict), else None."""


def should_prepare(mode, worker_used_cuda):
    """Whether a spare whose worker has exited makes the CUDA context (pure)."""
    if mode == "always":
        return True
    return mode == "auto" and bool(worker_used_cuda)


def device_index(local_rank, device_count):
    """The CUDA device a local rank's worker uses: ``LOCAL_RANK`` among the visible devices, or
    the only one (a launcher that sets CUDA_VISIBLE_DEVICES per rank); None: no device (pure)."""
    if device_count <= 0 or local_rank is None or local_rank < 0:
        return None
    if local_rank < device_count:
        return local_rank
    return 0 if device_count == 1 else None


def used_cuda(pid):
    """Whether process ``pid`` has the CUDA driver library mapped (False once it is gone)."""
    try:
        with open(f"/proc/{pid}/maps", "rb") as maps:
            return b"libcuda.so" in maps.read()
    except OSError:
        return False


def prepare_device(local_rank):
    """Makes the CUDA context and a cuBLAS handle on the local rank's device, leaving torch's
    current device as it was; returns what it did."""
    import torch

    done = {"local_rank": local_rank, "pid": os.getpid(), "device": None}
    if not torch.cuda.is_available():
        done["skipped"] = "no CUDA device"
        return done
    index = device_index(local_rank, torch.cuda.device_count())
    if index is None:
        done["skipped"] = f"local rank {local_rank} has no device among the visible ones"
        return done
    with torch.cuda.device(index):
        # The context, the cuBLAS handle and its GEMM kernels: what the first step needs.
        x = torch.ones(8, 8, device=index)
        (x @ x).sum().item()
        del x
    torch.cuda.empty_cache()
    done["device"] = index
    return done


class Spare:
    """The server's handle on a spare: hands it the next start request."""

    def __init__(self, intermediate, hold_fd, channel):
        self.intermediate = intermediate
        self._hold_fd = hold_fd
        self._channel = channel

    def start(self, request, fds):
        """Gives the spare the request and the worker's descriptors; returns its pid, or -1
        (it is gone: the caller forks a worker the usual way). Closes ``fds`` only on success."""
        payload = json.dumps(request).encode()
        try:
            socket.send_fds(self._channel, [struct.pack("!Q", len(payload))], fds)
            self._channel.sendall(payload)
        except OSError:
            self.discard()
            return -1
        # The intermediate exits, so the spare is re-parented to the agent (it holds the
        # child-subreaper flag while it waits for the reply).
        os.close(self._hold_fd)
        self._hold_fd = -1
        os.waitpid(self.intermediate, 0)
        reply = b""
        while len(reply) < 8:
            chunk = self._channel.recv(8 - len(reply))
            if not chunk:
                break
            reply += chunk
        self._channel.close()
        if len(reply) < 8:
            return -1
        for fd in fds:
            os.close(fd)
        return struct.unpack("!q", reply)[0]

    def close_in_child(self):
        """In a process forked from the server: closes this spare's descriptors, without
        ending the spare (only the server's copies decide when it is released)."""
        with contextlib.suppress(OSError):
            self._channel.close()
        if self._hold_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._hold_fd)

    def discard(self):
        """Ends the spare (its intermediate exits and the spare sees its channel close)."""
        self._channel.close()
        if self._hold_fd >= 0:
            os.close(self._hold_fd)
            self._hold_fd = -1
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.intermediate, 0)


def fork_spare(worker_pid, close_inherited, local_rank, mode, receive):
    """Forks the spare of ``local_rank`` for its worker ``worker_pid`` (through an intermediate
    that waits); ``close_inherited()`` closes, in the intermediate, the server's socket and the
    descriptors of the other local ranks' spares.

    In the server: a :class:`Spare` (None when the worker cannot be watched). In the spare,
    once it is asked to start: the request and the worker's descriptors, the spare then being
    in a session of its own, its pid sent. ``receive(sock, max_fds)`` reads one start request
    (the bootstrap's own reader)."""
    try:
        watched = os.pidfd_open(worker_pid)
    except (AttributeError, OSError):
        return None
    server_end, spare_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    hold_read, hold_write = os.pipe()
    intermediate = os.fork()
    if intermediate != 0:
        os.close(watched)
        os.close(hold_read)
        spare_end.close()
        return Spare(intermediate, hold_write, server_end)
    spare = -1
    try:
        server_end.close()
        os.close(hold_write)
        close_inherited()
        spare = os.fork()
    finally:
        if spare != 0:
            if spare > 0:
                with contextlib.suppress(OSError):
                    os.read(hold_read, 1)  # until the server closes it (or exits)
            os._exit(0)
    os.close(hold_read)
    try:
        return _wait_as_spare(spare_end, watched, worker_pid, local_rank, mode, receive)
    except BaseException:
        os._exit(0)  # never half a worker: the server forks one the usual way


def _wait_as_spare(channel, watched, worker_pid, local_rank, mode, receive):
    global PREPARED
    used = False
    while True:
        waiting = [channel] if watched is None else [channel, watched]
        readable, _, _ = select.select(waiting, [], [], _CHECK_EVERY_S)
        if watched is not None and not used:
            used = used_cuda(worker_pid)
        # The worker's end first: the agent asks for the next worker only after reaping it.
        if watched is not None and watched in readable:
            os.close(watched)
            watched = None
            if should_prepare(mode, used):
                try:
                    PREPARED = prepare_device(local_rank)
                except Exception as err:  # the worker meets it again in its own start-up
                    PREPARED = {"local_rank": local_rank, "error": f"{type(err).__name__}: {err}"}
        if channel in readable:
            break
    if watched is not None:
        os.close(watched)
    received = receive(channel, 16)
    if received is None:
        os._exit(0)  # the server is gone
    request, fds = received
    # Its own session, as torch starts workers; then its pid, for the agent.
    os.setsid()
    channel.sendall(struct.pack("!q", os.getpid()))
    channel.close()
    return request, list(fds)


def mode_from_env(environ):
    """The mode the agent asked for (removed from ``environ``); ``off`` if unknown."""
    mode = environ.pop(MODE_ENV, "off")
    return mode if mode in MODES else "off"


def local_rank_from_env(environ):
    try:
        return int(environ.get("LOCAL_RANK", "0"))
    except ValueError:
        return None
