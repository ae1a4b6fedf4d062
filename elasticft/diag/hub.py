"""The round leader's hub: a TCPStore its agent serves for the diagnostics exchange, and the
other nodes' connections to it, whose every call ends within a deadline.

:mod:`elasticft.diag.exchange` uses a hub as it would the round's store (``set``, ``check``,
``multi_get``); what this module adds is that no call to a stopped or vanished leader can hold
the exchange, and the counts of the calls made.
"""

from __future__ import annotations

import collections
import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = ["STORE_TIMEOUT", "Hub", "HubBusy", "HubUnavailable", "connect", "serve"]


class HubUnavailable(Exception):
    """A call to the leader's hub failed: the connection is given up."""


class HubBusy(HubUnavailable):
    """A call to the leader's hub got no answer in time; the connection is kept for it."""


class Hub:
    """The round leader's hub as one node uses it, counting the calls by kind.

    The leader uses its own TCPStore server directly. Any other node holds a connection whose
    calls run one at a time on a thread of its own, and waits for each at most ``timeout_s``:
    a TCPStore client waits without end for the answer of a stopped server (``check`` and
    ``multi_get`` outright; ``get`` after its own timeout, when it cancels the wait and waits
    for the cancel's answer). A call that has not answered in time leaves the hub *busy* until
    it does; nothing is sent after it meanwhile, so the connection stays in step and is kept
    (a server also stalls for seconds on its own: it looks up every new client's address in
    the DNS, one at a time). A call that fails gives the connection up.
    """

    def __init__(self, connect: Callable[[], Any], timeout_s: float | None) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        self._timeout_s = timeout_s
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._given_up = False
        self._pending: concurrent.futures.Future[Any] | None = None
        self._overdue = False
        if timeout_s is None:
            self._store = connect()
            return
        # A daemon thread, not an executor's: the interpreter joins those at exit, and one
        # stuck in a call to a vanished host would keep the agent from ever exiting.
        threading.Thread(target=self._serve_calls, daemon=True,
                         name="elasticft-diag-hub-client").start()
        self._pending = self._submit(lambda: setattr(self, "_store", connect()))

    @property
    def busy(self) -> bool:
        """Whether a call has had no answer in time and still has none."""
        return self._overdue and self._pending is not None and not self._pending.done()

    def _serve_calls(self) -> None:
        while (request := self._requests.get()) is not None:
            fn, future = request
            try:
                future.set_result(fn())
            except Exception as e:
                future.set_exception(e)

    def _submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._requests.put((fn, future))
        return future

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        if self._timeout_s is None:
            return fn()
        if self._given_up:
            raise HubUnavailable(f"{what}: the connection was given up")
        if self.busy:
            raise HubBusy(f"{what}: an earlier call has had no answer yet")
        deadline = time.monotonic() + self._timeout_s
        if self._pending is not None:  # connecting, or an overdue call that has answered
            self._settle(what, deadline)
        self._pending = self._submit(fn)
        return self._settle(what, deadline)

    def _settle(self, what: str, deadline: float) -> Any:
        assert self._pending is not None
        try:
            result = self._pending.result(timeout=max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            self._overdue = True
            raise HubBusy(f"{what}: no answer within {self._timeout_s:g} s") from None
        except Exception as e:
            self.close()
            raise HubUnavailable(f"{what}: {e}") from e
        self._pending, self._overdue = None, False
        return result

    def set(self, key: str, value: bytes) -> None:
        self.calls["set"] += 1
        self._call("writing", lambda: self._store.set(key, value))

    def check(self, keys: list[str]) -> bool:
        self.calls[f"check{len(keys)}"] += 1
        return bool(self._call("checking", lambda: self._store.check(keys)))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.calls[f"multi_get{len(keys)}"] += 1
        return list(self._call("reading", lambda: self._store.multi_get(keys)))

    def close(self) -> None:
        if self._timeout_s is not None and not self._given_up:
            self._given_up = True
            self._requests.put(None)


STORE_TIMEOUT = timedelta(seconds=60)
"""TCPStore's own limit on connecting and on waiting inside a call: long, because a call that
outlives it does not end there (it cancels, then waits for the cancel's answer) and then fails,
which gives the connection up; the exchange's deadlines are :class:`Hub`'s."""


def serve(host: str) -> tuple[Hub, str]:
    """A hub served by this agent, and its address."""
    from torch import distributed as dist  # the launcher checks torch's version before this

    server = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                           timeout=STORE_TIMEOUT)
    return Hub(lambda: server, None), f"{host}:{server.port}"


def connect(address: str, timeout_s: float) -> Hub:
    """A connection to the hub at ``host:port`` (made by the first call)."""
    from torch import distributed as dist

    host, _, port = address.rpartition(":")
    return Hub(lambda: dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                                      timeout=STORE_TIMEOUT), timeout_s)
