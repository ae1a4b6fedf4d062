"""Connecting to an etcd v3 cluster, and the key layout elasticft keeps in it.

Everything job-critical of a multi-node run lives in etcd, so no training node is a single point
of failure (torch's c10d rendezvous keeps it in one agent's TCPStore). The connection settings
come from ``--rdzv-endpoint`` and ``--rdzv-conf`` (see :class:`EtcdSettings`); the client is the
maintained ``etcd-sdk-python`` (module ``pyetcd``), over gRPC.

Keys, under a root prefix (``/elasticft`` unless ``prefix=`` says otherwise)::

    <root>/blacklist/<node_id>           JSON verdict; cluster-wide, survives every restart
    <root>/quarantine/<run_id>/<node_id>  JSON, one job's verdict on a lease (ends by itself)
    <root>/jobs/<run_id>/rdzv/round      the last completed rendezvous round (decimal)
    <root>/jobs/<run_id>/rdzv/closed     present once the job is closed (no more rounds)
    <root>/jobs/<run_id>/rdzv/r/<T>/join/<node>   a node's join of round T, on its lease
    <root>/jobs/<run_id>/rdzv/r/<T>/coordinator   who decides when T closes, on its lease
    <root>/jobs/<run_id>/rdzv/r/<T>/result        round T's participants, written once
    <root>/jobs/<run_id>/rdzv/r/<T>/restart       a participant of T came back to rendezvous
    <root>/jobs/<run_id>/store/<key>     the agents' c10d store (rank assignment, MASTER_ADDR)
    <root>/jobs/<run_id>/members/<node>  JSON, bound to the node's lease (gone when it dies)
    <root>/jobs/<run_id>/leader          JSON, bound to the leader's lease
    <root>/jobs/<run_id>/round           JSON, the latest completed round (written by its leader)

Connection failures surface as torch's :class:`RendezvousConnectionError` with one line naming
the endpoints, so the agent and the CLI can report them without a traceback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import random
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from elasticft.config import ConfigError
from elasticft.extras import require_etcd

logger = logging.getLogger(__name__)

DEFAULT_PORT = 2379
DEFAULT_ROOT = "/elasticft"
# A failed endpoint is retried this soon: pyetcd's default (300 s) would keep a restarted etcd
# out of use for five minutes.
ENDPOINT_RETRY_S = 0.5


class EtcdConfigError(ConfigError):
    """A connection setting is unusable; the message names the value and the fix."""

    def __init__(self, message: str) -> None:
        super().__init__(message, reason="bad_rdzv_conf")


def parse_endpoints(text: str) -> tuple[tuple[str, int], ...]:
    """``"h1:2379,h2:2379"`` (or ``;``-separated, as ``--rdzv-conf`` needs) -> host/port pairs."""
    endpoints = []
    for item in text.replace(";", ",").split(","):
        item = item.strip()
        if not item:
            continue
        for scheme in ("http://", "https://"):
            item = item.removeprefix(scheme)
        host, sep, port = item.rpartition(":")
        if not sep:
            host, port = item, str(DEFAULT_PORT)
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise EtcdConfigError(
                f"etcd endpoint {item!r} is not HOST:PORT; give e.g. --rdzv-endpoint "
                f"10.0.0.5:{DEFAULT_PORT}"
            )
        endpoints.append((host.strip("[]"), int(port)))
    if not endpoints:
        raise EtcdConfigError(
            f"no etcd endpoint given; pass --rdzv-endpoint HOST:PORT (e.g. 10.0.0.5:{DEFAULT_PORT})"
        )
    return tuple(endpoints)


@dataclasses.dataclass(frozen=True)
class EtcdSettings:
    """How to reach etcd: endpoints, TLS, user/password, RPC timeout and the key root."""

    endpoints: tuple[tuple[str, int], ...]
    root: str = DEFAULT_ROOT
    ca_cert: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    user: str | None = None
    password: str | None = None
    rpc_timeout_s: float = 5.0

    @property
    def endpoint_text(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in self.endpoints)

    @classmethod
    def from_conf(cls, endpoint: str, conf: Mapping[str, Any]) -> EtcdSettings:
        """Reads ``--rdzv-endpoint`` plus ``--rdzv-conf`` keys (values are strings).

        Keys: ``endpoints`` (more endpoints, ``;``-separated), ``prefix``, ``protocol``
        (http|https), ``ca_cert``, ``cert``, ``key``, ``user``, ``password``, ``password_file``,
        ``rpc_timeout`` (seconds).
        """
        text = ",".join(t for t in (endpoint, str(conf.get("endpoints") or "")) if t)
        endpoints = parse_endpoints(text)
        root = "/" + str(conf.get("prefix") or DEFAULT_ROOT).strip("/")
        protocol = str(conf.get("protocol") or "http").lower()
        if protocol not in ("http", "https"):
            raise EtcdConfigError(
                f"--rdzv-conf protocol={protocol!r} is not valid; use http or https"
            )
        paths = {}
        for name in ("ca_cert", "cert", "key", "password_file"):
            value = conf.get(name)
            if value:
                path = Path(str(value)).expanduser()
                if not path.is_file():
                    raise EtcdConfigError(
                        f"--rdzv-conf {name}={value} is not a readable file; give the path "
                        "of an existing file"
                    )
                paths[name] = path
            else:
                paths[name] = None
        if protocol == "https" and paths["ca_cert"] is None:
            raise EtcdConfigError(
                "--rdzv-conf protocol=https needs ca_cert=PATH (the CA that signed etcd's cert)"
            )
        if (paths["cert"] is None) != (paths["key"] is None):
            raise EtcdConfigError(
                "--rdzv-conf cert= and key= go together (client TLS certificate and its key)"
            )
        password = conf.get("password")
        if paths["password_file"] is not None:
            password = paths["password_file"].read_text().strip()
        user = conf.get("user")
        if (user is None) != (password is None):
            raise EtcdConfigError(
                "--rdzv-conf user= and password= (or password_file=) go together"
            )
        try:
            rpc_timeout = float(conf.get("rpc_timeout", 5.0))
        except ValueError:
            raise EtcdConfigError(
                f"--rdzv-conf rpc_timeout={conf.get('rpc_timeout')!r} is not a number of seconds"
            ) from None
        if rpc_timeout <= 0:
            raise EtcdConfigError(f"--rdzv-conf rpc_timeout={rpc_timeout} must be above 0")
        return cls(
            endpoints=endpoints,
            root=root,
            ca_cert=paths["ca_cert"],
            cert=paths["cert"],
            key=paths["key"],
            user=str(user) if user is not None else None,
            password=str(password) if password is not None else None,
            rpc_timeout_s=rpc_timeout,
        )

    def connect(self) -> Any:
        """A pyetcd client over all endpoints (failing over between them); authenticates now."""
        require_etcd()
        import grpc
        from pyetcd.client import Endpoint

        creds = None
        if self.ca_cert is not None:
            creds = grpc.ssl_channel_credentials(
                self.ca_cert.read_bytes(),
                self.key.read_bytes() if self.key else None,
                self.cert.read_bytes() if self.cert else None,
            )
        endpoints = [
            Endpoint(host, port, secure=creds is not None, creds=creds,
                     time_retry=ENDPOINT_RETRY_S)
            for host, port in self.endpoints
        ]
        with etcd_errors(self):
            client = _failover_client_class()(
                endpoints=endpoints,
                timeout=self.rpc_timeout_s,
                user=self.user,
                password=self.password,
                failover=True,
            )
        return client


@functools.cache
def _failover_client_class() -> type:
    """pyetcd's multi-endpoint client, made to stay off an endpoint that failed.

    pyetcd marks a failed endpoint and moves to another only when the failed one is asked for
    again within its retry pause (:data:`ENDPOINT_RETRY_S`); past the pause it uses the dead
    member again, since it is still the endpoint in use, so a node polling every second would
    fail every poll while one member of the cluster is down. Here the client moves to a working
    endpoint as soon as one fails, and goes back only when that one fails too.
    """
    from pyetcd.client import MultiEndpointEtcd3Client

    class StayOffFailedEndpoints(MultiEndpointEtcd3Client):  # type: ignore[misc]
        def _manage_grpc_errors(self, exc: Any) -> None:
            try:
                super()._manage_grpc_errors(exc)
            finally:
                current = self.endpoint_in_use
                if current is not None and current.is_failed():
                    working = [label for label, endpoint in self.endpoints.items()
                               if not endpoint.is_failed()]
                    if working:  # at random, as pyetcd picks the first: nodes spread out
                        self._current_endpoint_label = random.choice(working)

    return StayOffFailedEndpoints


@dataclasses.dataclass(frozen=True)
class Keys:
    """The key layout of one job (see the module docstring)."""

    root: str
    run_id: str

    @property
    def job(self) -> str:
        return f"{self.root}/jobs/{self.run_id}"

    @property
    def rdzv(self) -> str:
        return f"{self.job}/rdzv/"

    @property
    def last_round(self) -> str:
        return f"{self.rdzv}round"

    @property
    def closed(self) -> str:
        return f"{self.rdzv}closed"

    def round_keys(self, round_: int) -> str:
        """Every key of round ``round_`` (its joins, coordinator, result, restart)."""
        return f"{self.rdzv}r/{round_}/"

    def joins(self, round_: int) -> str:
        return f"{self.round_keys(round_)}join/"

    def join(self, round_: int, node_id: str) -> str:
        return f"{self.joins(round_)}{node_id}"

    def coordinator(self, round_: int) -> str:
        return f"{self.round_keys(round_)}coordinator"

    def result(self, round_: int) -> str:
        return f"{self.round_keys(round_)}result"

    def restart(self, round_: int) -> str:
        return f"{self.round_keys(round_)}restart"

    @property
    def store(self) -> str:
        return f"{self.job}/store/"

    def round_store(self, round_: int) -> str:
        """The prefix of round ``round_``'s workers' store within :attr:`store` (torch's name
        for it, so the keys read as they do under torch's own rendezvous)."""
        return f"torch.rendezvous.{self.run_id}.{round_}"

    def round_store_keys(self, round_: int) -> str:
        """Every key of round ``round_``'s workers' store (the trailing ``/`` keeps round 1
        from matching round 11)."""
        return f"{self.store}{self.round_store(round_)}/"

    @property
    def members(self) -> str:
        return f"{self.job}/members/"

    def member(self, node_id: str) -> str:
        return f"{self.members}{node_id}"

    @property
    def leader(self) -> str:
        return f"{self.job}/leader"

    @property
    def round(self) -> str:
        return f"{self.job}/round"

    @property
    def blacklist(self) -> str:
        return blacklist_prefix(self.root)

    @property
    def quarantine(self) -> str:
        return f"{quarantine_prefix(self.root)}{self.run_id}/"

    def quarantined(self, node_id: str) -> str:
        return f"{self.quarantine}{node_id}"


def blacklist_prefix(root: str) -> str:
    return f"{root}/blacklist/"


def quarantine_prefix(root: str) -> str:
    return f"{root}/quarantine/"


def describe_error(error: BaseException) -> str:
    """A short reason for an etcd/gRPC failure (gRPC's own text is a multi-line dump)."""
    import grpc

    if isinstance(error, grpc.RpcError) and hasattr(error, "code"):
        details = error.details() if hasattr(error, "details") else ""
        return f"{error.code().name}: {(details or '').splitlines()[0] if details else ''}"
    if type(error).__name__ in ("NoServerAvailableError", "ConnectionFailedError"):
        return "no endpoint answered"
    if type(error).__name__ == "ConnectionTimeoutError":
        return "timed out"
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def lease_lost(error: BaseException) -> bool:
    """Whether ``error`` (or its cause) is etcd saying that a lease no longer exists."""
    import grpc

    for e in (error, error.__cause__):
        if isinstance(e, grpc.RpcError) and hasattr(e, "code"):
            return bool(e.code() == grpc.StatusCode.NOT_FOUND)
    return False


def connection_error() -> type[Exception]:
    """torch's ``RendezvousConnectionError``, imported on first use: ``elasticft status`` and
    ``blacklist`` read etcd without torch. In an ``except`` clause Python looks the class up only
    once an exception reaches it, and an error raised here has imported it already."""
    from elasticft.torch_compat import RendezvousConnectionError

    return RendezvousConnectionError


@contextlib.contextmanager
def etcd_errors(settings: EtcdSettings, doing: str = "talking to") -> Iterator[None]:
    """Turns any client failure into a one-line :class:`RendezvousConnectionError`."""
    require_etcd()
    import grpc
    import pyetcd.exceptions

    try:
        yield
    except (pyetcd.exceptions.Etcd3Exception, grpc.RpcError, ValueError) as e:
        # pyetcd raises ValueError("Trying to use a failed node") while an endpoint cools down.
        raise connection_error()(
            f"etcd at {settings.endpoint_text} failed while {doing} it ({describe_error(e)}); "
            "check that etcd is running and --rdzv-endpoint/--rdzv-conf are right"
        ) from e


def range_request(client: Any, key: str, *, prefix: bool = False, **options: Any) -> Any:
    """A transaction operation reading ``key`` (or every key under it, with ``prefix``) with
    etcd's range options (``count_only``, ``keys_only``, ``limit``, ``sort_order``,
    ``sort_target``), which pyetcd's own transaction builder does not pass on."""
    from pyetcd import etcdrpc, utils

    if prefix:
        options["range_end"] = utils.prefix_range_end(utils.to_bytes(key))
    return etcdrpc.RequestOp(request_range=client._build_get_range_request(key, **options))


def put_request(client: Any, key: str, value: bytes, lease: Any = None) -> Any:
    """A transaction operation writing ``key`` (on ``lease`` if given)."""
    from pyetcd import etcdrpc

    return etcdrpc.RequestOp(request_put=client._build_put_request(key, value, lease))


def delete_request(client: Any, key: str, *, prefix: bool = False) -> Any:
    """A transaction operation deleting ``key`` (or every key under it, with ``prefix``)."""
    from pyetcd import etcdrpc, utils

    range_end = utils.prefix_range_end(utils.to_bytes(key)) if prefix else None
    return etcdrpc.RequestOp(
        request_delete_range=client._build_delete_request(key, range_end=range_end))


def raw_txn(
    client: Any, compare: list[Any], success: list[Any], failure: list[Any] | None = None
) -> tuple[bool, list[Any]]:
    """One etcd transaction of prebuilt operations (:func:`range_request`, :func:`put_request`,
    :func:`delete_request`; ``compare`` from ``client.transactions``): one round trip whatever
    their number. Returns whether the comparisons held and etcd's responses of the branch that
    ran (``.response_range.count`` / ``.kvs`` for reads). Failures go through pyetcd's own
    handling (endpoint failover, its exceptions)."""
    response = txn_response(client, compare, success, failure)
    return response.succeeded, list(response.responses)


def txn_response(
    client: Any, compare: list[Any], success: list[Any], failure: list[Any] | None = None
) -> Any:
    """:func:`raw_txn`'s whole answer (``.succeeded``, ``.responses``, ``.header.revision``)."""
    import grpc
    from pyetcd import etcdrpc

    try:
        return client.kvstub.Txn(
            etcdrpc.TxnRequest(compare=[c.build_message() for c in compare], success=success,
                               failure=failure or []),
            client.timeout, credentials=client.call_credentials, metadata=client.metadata)
    except grpc.RpcError as e:
        client._manage_grpc_errors(e)
        raise


def watch_once(client: Any, key: str, start_revision: int, timeout_s: float,
               on_call: Callable[[Any], None] | None = None, *, prefix: bool = False) -> bool:
    """Waits for the first change of ``key`` (of any key under it, with ``prefix``) at or after
    ``start_revision`` (True), or ``timeout_s`` (False); True also when etcd cancels the watch
    (the revision compacted). ``on_call`` gets the gRPC call as soon as it exists: cancelling it
    ends the wait (False).

    The watch has a stream of its own, closed on return: pyetcd's shared watcher keeps its
    stream open for the client's life, with a thread that wakes ten times a second, which at
    hundreds of agents in one process costs more than all their requests."""
    import grpc
    from pyetcd import etcdrpc, utils

    range_end = utils.prefix_range_end(utils.to_bytes(key)) if prefix else b""
    create = etcdrpc.WatchCreateRequest(key=utils.to_bytes(key), range_end=range_end,
                                        start_revision=start_revision)
    call = etcdrpc.WatchStub(client.channel).Watch(
        iter([etcdrpc.WatchRequest(create_request=create)]), timeout_s,
        credentials=client.call_credentials, metadata=client.metadata)
    try:
        if on_call is not None:
            on_call(call)
        for response in call:
            # An event, or the watch cancelled (its revision compacted): read the key again.
            if response.events or response.canceled:
                return True
    except grpc.RpcError as e:
        # The deadline ends the watch; when etcd sees it first, it says so as UNKNOWN.
        if e.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED) or (
                e.code() == grpc.StatusCode.UNKNOWN and "deadline exceeded" in str(e.details())):
            return False
        client._manage_grpc_errors(e)
        raise
    finally:
        call.cancel()
    return False


class LazyClient:
    """Connects on first use, so building a handler never talks to etcd (torch builds handlers
    before its error handling starts); an unreachable etcd then fails inside the rendezvous,
    where it is reported in one line."""

    def __init__(self, settings: EtcdSettings) -> None:
        self._settings = settings
        self._client: Any = None
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._connected(), name)

    def _connected(self) -> Any:
        with self._lock:
            if self._client is None:
                self._client = self._settings.connect()
            return self._client

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
