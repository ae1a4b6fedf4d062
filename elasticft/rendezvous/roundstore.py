"""How the agents of one rendezvous round talk for recovery: keys in the round's store.

Every agent of a round records its node and the last round it knew (the leader compares rounds
with them), and the just-in-time checkpoint across nodes is one request key, written once, and
one report key per node. A thread that waits on the store waits in short slices, or on a store
that can be interrupted, so an agent that exits is never held inside a store call.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from elasticft.addon.api import run_ending_errors

NODE_KEY = "elasticft/recovery/node/{}"
KNOWN_ROUND_KEY = "elasticft/recovery/known-round/{}"
"""The newest earlier round a node took part in, and that round's nodes (JSON)."""
JIT_REQUEST_KEY = "elasticft/recovery/jit/request"
JIT_DONE_KEY = "elasticft/recovery/jit/done/{}"
WATCH_WAKE_S = 1.0
"""A blocking store wait wakes this often to see whether its round (or the agent) is over: a
thread must not be inside a store call when the interpreter exits (the store's C++ side calls
back into Python, which crashes the exiting agent)."""
INTERRUPTIBLE_WAKE_S = 60.0
"""The JIT watcher's wait on a store that can end it on demand (the etcd store's
``interrupt_waits``): the watcher is interrupted when its round or the agent ends, so it need not
wake every second, which on etcd costs a request a second a node."""


def text(value: Any) -> str:
    return value.decode() if isinstance(value, (bytes, bytearray)) else str(value)


def own_connection(store: Any) -> Any:
    """A connection of its own for a thread that blocks on the store: a TCPStore client holds
    one lock per connection for a whole wait, which would stall the agent's own store calls.
    A store that cannot be cloned (the etcd store, whose client is thread-safe) is shared."""
    try:
        return store.clone()
    except Exception:
        return store


def interrupter(store: Any) -> Any:
    """The ``interrupt_waits`` of the store under ``store``'s prefixes, or None: only a store
    written in Python (the etcd store) can end a thread's wait on demand."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    interrupt = getattr(store, "interrupt_waits", None)
    return interrupt if callable(interrupt) else None


def wait_key(store: Any, key: str, deadline: float, closing: threading.Event) -> bool:
    """Waits for ``key`` until ``deadline``, in short slices so an exiting agent is not held."""
    while not closing.is_set():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        try:
            store.wait([key], timedelta(seconds=min(left, WATCH_WAKE_S)))
            return True
        except run_ending_errors():
            raise
        except Exception:
            if store.check([key]):
                return True
    return False
