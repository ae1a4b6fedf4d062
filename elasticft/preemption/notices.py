"""Preemption notices: where a machine's announced end comes from, as one kind of record.

A spot or preemptible machine is told before it is taken away, and so is a Kubernetes pod:

============  ================================================================  ==============
source        what announces the end                                            time given
============  ================================================================  ==============
aws           ``/latest/meta-data/spot/instance-action`` answers 200 with the   about 120 s
              action and its time (404 until then); IMDSv2's token first
aws           ``/latest/meta-data/events/recommendations/rebalance``: an        none (a risk)
(rebalance)   elevated risk of interruption, no deadline
gcp           ``/computeMetadata/v1/instance/preempted`` turns ``TRUE``          about 30 s
azure         Scheduled Events lists an event of type ``Preempt``; its           at least 30 s
              ``NotBefore`` is the time
kubernetes    SIGTERM to the launcher; SIGKILL follows after the pod's          the grace
              termination grace period                                          period
============  ================================================================  ==============

Each provider's answer is parsed by a pure function (``parse_*``) into a :class:`Notice`:
the provider, whether the machine goes away (``termination``) or is only at risk
(``rebalance``), and the deadline as wall-clock time. The endpoints are polled by
:class:`CloudWatcher`, one background thread per provider: a provider whose endpoint does not
answer its first, short probe is not polled again, and when none answers the agent says so in
one DEBUG line. Nothing here delays the launch, which never waits for a probe. With
``--preempt-notices auto`` an endpoint is asked only on its own cloud, as the machine's firmware
names it (:func:`clouds_of`, from ``/sys/class/dmi/id``): elsewhere no request leaves the
machine; a URL given to ``--preempt-notices`` is asked for every provider.
"""

from __future__ import annotations

import calendar
import contextlib
import dataclasses
import email.utils
import http.client
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Literal

logger = logging.getLogger(__name__)

Provider = Literal["aws", "gcp", "azure", "kubernetes"]
Kind = Literal["termination", "rebalance"]

GCP_LEAD_S = 30.0
"""Google Cloud's documented notice before a preempted (or spot) VM is stopped."""
AWS_TOKEN_TTL_S = 21600
AZURE_API = "api-version=2020-07-01"
AZURE_FIRST_CALL_S = 120.0
"""Azure starts its Scheduled Events service on the first call, which may take two minutes."""


@dataclasses.dataclass(frozen=True)
class Notice:
    """One announcement that this machine (or pod) is going away, or is at risk of it."""

    provider: Provider
    kind: Kind
    deadline: float | None
    """Wall-clock time (epoch seconds) the machine goes; None: no deadline given."""
    detail: str
    """The provider's own words (the action, the event id), for the event log."""
    from_node: str = ""
    """The node whose machine it announces, when that is another node of the job ("": this
    one's own)."""

    def seconds_left(self, now: float) -> float | None:
        return None if self.deadline is None else self.deadline - now


# ----------------------------------------------------------------------------------------------
# The providers' answers, parsed (pure).


def _iso_time(text: str) -> float | None:
    """``2017-09-18T08:22:00Z`` (AWS) as epoch seconds; None if it is not that."""
    try:
        return float(calendar.timegm(time.strptime(text.strip(), "%Y-%m-%dT%H:%M:%SZ")))
    except (ValueError, AttributeError):
        return None


def _json(body: str) -> object:
    try:
        return json.loads(body)
    except ValueError:
        return None


def parse_aws_instance_action(status: int, body: str, now: float) -> Notice | None:
    """AWS ``spot/instance-action``: 404 until the instance is to be interrupted, then 200 with
    ``{"action": "terminate"|"stop"|"hibernate", "time": "<UTC ISO 8601>"}``."""
    payload = _json(body) if status == 200 else None
    if not isinstance(payload, dict) or "action" not in payload:
        return None
    deadline = _iso_time(str(payload.get("time", "")))
    return Notice("aws", "termination", deadline if deadline is not None else now + 120.0,
                  f"spot instance-action {payload['action']} at {payload.get('time', '?')}")


def parse_aws_rebalance(status: int, body: str, now: float) -> Notice | None:
    """AWS ``events/recommendations/rebalance``: 404, or 200 with ``{"noticeTime": ...}``: the
    instance is at elevated risk of interruption; no deadline."""
    payload = _json(body) if status == 200 else None
    if not isinstance(payload, dict) or "noticeTime" not in payload:
        return None
    return Notice("aws", "rebalance", None,
                  f"rebalance recommendation at {payload['noticeTime']}")


def parse_gcp_preempted(status: int, body: str, now: float) -> Notice | None:
    """Google Cloud ``instance/preempted``: ``FALSE``, then ``TRUE`` about 30 s before the VM is
    stopped (the deadline is counted from when it was seen)."""
    if status != 200 or body.strip().upper() != "TRUE":
        return None
    return Notice("gcp", "termination", now + GCP_LEAD_S, "instance/preempted TRUE")


def parse_azure_scheduled_events(status: int, body: str, now: float,
                                 vm_name: str | None = None) -> Notice | None:
    """Azure Scheduled Events: ``{"DocumentIncarnation": n, "Events": [...]}``; an event with
    ``EventType`` ``Preempt`` naming this VM in ``Resources`` (any VM when its name is not
    known) ends it at ``NotBefore`` (RFC 1123; empty once the event has started: now)."""
    payload = _json(body) if status == 200 else None
    events = payload.get("Events") if isinstance(payload, dict) else None
    for event in events if isinstance(events, list) else []:
        if not isinstance(event, dict) or event.get("EventType") != "Preempt":
            continue
        resources = event.get("Resources") or []
        if vm_name and isinstance(resources, list) and resources and vm_name not in resources:
            continue
        deadline = now
        with contextlib.suppress(KeyError, TypeError, ValueError):
            deadline = email.utils.parsedate_to_datetime(str(event["NotBefore"])).timestamp()
        return Notice("azure", "termination", deadline,
                      f"Preempt event {event.get('EventId', '?')} "
                      f"({event.get('EventStatus', '?')}) not before "
                      f"{event.get('NotBefore') or 'now'}")
    return None


# ----------------------------------------------------------------------------------------------
# Kubernetes.


def in_kubernetes(env: Mapping[str, str]) -> bool:
    """Whether this process runs in a Kubernetes pod (the variable every pod is given)."""
    return bool(env.get("KUBERNETES_SERVICE_HOST"))


# ----------------------------------------------------------------------------------------------
# Talking to the metadata endpoints.


UNREACHABLE = (OSError, http.client.HTTPException)
"""What a request to an endpoint that is not there, or not HTTP, raises."""


@dataclasses.dataclass(frozen=True)
class Answer:
    status: int
    body: str
    headers: Mapping[str, str]


def request(method: str, url: str, headers: Mapping[str, str], timeout: float) -> Answer:
    """One request; an HTTP error status is an answer, an endpoint that is not there (or does
    not speak HTTP) raises one of :data:`UNREACHABLE`."""
    prepared = urllib.request.Request(url, method=method, headers=dict(headers))
    # Metadata endpoints are link-local: never through a proxy the environment names.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(prepared, timeout=timeout) as response:
            return Answer(response.status, response.read(65536).decode(errors="replace"),
                          dict(response.headers))
    except urllib.error.HTTPError as e:
        return Answer(e.code, e.read(65536).decode(errors="replace"), dict(e.headers or {}))


class Source:
    """One provider's endpoint: a first probe (is this that cloud?), then polls."""

    provider: Provider

    def probe(self, timeout: float) -> bool:
        raise NotImplementedError

    def poll(self, now: float, timeout: float) -> Notice | None:
        raise NotImplementedError


class AwsSource(Source):
    provider: Provider = "aws"

    def __init__(self, base_url: str) -> None:
        self.base = base_url.rstrip("/")
        self._token: str | None = None
        self._rebalance_seen = False

    def _fetch_token(self, timeout: float) -> bool:
        answer = request("PUT", f"{self.base}/latest/api/token",
                      {"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL_S)}, timeout)
        self._token = answer.body.strip() if answer.status == 200 else None
        return self._token is not None

    def probe(self, timeout: float) -> bool:
        if self._fetch_token(timeout):
            return True
        # IMDSv1 only: no token, the metadata answers plain GETs.
        plain = request("GET", f"{self.base}/latest/meta-data/instance-id", {}, timeout)
        return plain.status == 200

    def _get(self, path: str, timeout: float) -> Answer:
        headers = {"X-aws-ec2-metadata-token": self._token} if self._token else {}
        answer = request("GET", f"{self.base}/latest/meta-data/{path}", headers, timeout)
        if answer.status == 401 and self._fetch_token(timeout):  # the token expired
            answer = request("GET", f"{self.base}/latest/meta-data/{path}",
                          {"X-aws-ec2-metadata-token": self._token or ""}, timeout)
        return answer

    def poll(self, now: float, timeout: float) -> Notice | None:
        answer = self._get("spot/instance-action", timeout)
        notice = parse_aws_instance_action(answer.status, answer.body, now)
        if notice is None and not self._rebalance_seen:
            answer = self._get("events/recommendations/rebalance", timeout)
            notice = parse_aws_rebalance(answer.status, answer.body, now)
            self._rebalance_seen = notice is not None
        return notice


class GcpSource(Source):
    provider: Provider = "gcp"
    HEADERS: Mapping[str, str] = {"Metadata-Flavor": "Google"}

    def __init__(self, base_url: str) -> None:
        self.url = base_url.rstrip("/") + "/computeMetadata/v1/instance/preempted"

    def probe(self, timeout: float) -> bool:
        answer = request("GET", self.url, self.HEADERS, timeout)
        flavor = {k.lower(): v for k, v in answer.headers.items()}.get("metadata-flavor")
        return answer.status == 200 and flavor == "Google"

    def poll(self, now: float, timeout: float) -> Notice | None:
        answer = request("GET", self.url, self.HEADERS, timeout)
        return parse_gcp_preempted(answer.status, answer.body, now)


class AzureSource(Source):
    provider: Provider = "azure"
    HEADERS: Mapping[str, str] = {"Metadata": "true"}

    def __init__(self, base_url: str) -> None:
        self.base = base_url.rstrip("/")
        self.vm_name: str | None = None

    def probe(self, timeout: float) -> bool:
        name = request("GET", f"{self.base}/metadata/instance/compute/name?"
                    "api-version=2021-02-01&format=text", self.HEADERS, timeout)
        if name.status != 200:
            return False
        self.vm_name = name.body.strip() or None
        # The first call starts Azure's Scheduled Events service (up to two minutes).
        first = request("GET", f"{self.base}/metadata/scheduledevents?{AZURE_API}", self.HEADERS,
                     max(timeout, AZURE_FIRST_CALL_S))
        return first.status == 200

    def poll(self, now: float, timeout: float) -> Notice | None:
        answer = request("GET", f"{self.base}/metadata/scheduledevents?{AZURE_API}", self.HEADERS,
                      timeout)
        return parse_azure_scheduled_events(answer.status, answer.body, now, self.vm_name)


def cloud_sources(aws_url: str, gcp_url: str, azure_url: str,
                  providers: Sequence[Provider] = ("aws", "gcp", "azure")) -> list[Source]:
    """The sources of ``providers``, each at its base URL."""
    every = [AwsSource(aws_url), GcpSource(gcp_url), AzureSource(azure_url)]
    return [source for source in every if source.provider in providers]


DMI_DIR = Path("/sys/class/dmi/id")
"""Where Linux shows the firmware's description of the machine (SMBIOS, readable by anyone)."""
DMI_FIELDS = ("sys_vendor", "bios_vendor", "board_vendor", "product_name", "chassis_asset_tag")
AZURE_ASSET_TAG = "7783-7084-3265-9085-8269-3286-77"
"""The chassis asset tag of every Azure virtual machine."""


def clouds_of(dmi: Mapping[str, str]) -> tuple[Provider, ...]:
    """The clouds whose virtual machines these DMI fields describe (pure).

    A metadata endpoint is asked only on its own cloud: elsewhere its link-local address (or
    name) leads nowhere, and a probe of it would be traffic to an address no one here owns.
    """
    said = " ".join(dmi.get(field, "") for field in DMI_FIELDS).lower()
    found: list[Provider] = []
    if "amazon" in said:  # "Amazon EC2" on Nitro machines, "Amazon" in the BIOS of older ones
        found.append("aws")
    if "google" in said:  # "Google", "Google Compute Engine"
        found.append("gcp")
    if dmi.get("chassis_asset_tag", "").strip() == AZURE_ASSET_TAG:
        found.append("azure")
    return tuple(found)


def read_dmi(directory: Path = DMI_DIR) -> dict[str, str]:
    """The DMI fields :func:`clouds_of` reads (missing ones left out)."""
    found = {}
    for field in DMI_FIELDS:
        with contextlib.suppress(OSError):
            found[field] = (directory / field).read_text(errors="replace").strip()
    return found


class CloudWatcher:
    """Polls every source that answered its probe, each on a daemon thread of its own, and
    hands each new notice to ``on_notice`` (called on that thread: record, do not act)."""

    def __init__(self, sources: Sequence[Source], on_notice: Callable[[Notice], None], *,
                 poll_s: float, probe_timeout_s: float,
                 clock: Callable[[], float] = time.time) -> None:
        self._sources = list(sources)
        self._on_notice = on_notice
        self._poll_s = poll_s
        self._probe_timeout_s = probe_timeout_s
        self._clock = clock
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._silent: dict[str, str] = {}
        self.watching: list[str] = []
        """Providers whose endpoint answered (for the start's log line and tests)."""
        self._threads = [
            threading.Thread(target=self._run, args=(source,), daemon=True,
                             name=f"elasticft-preempt-{source.provider}")
            for source in self._sources]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def _run(self, source: Source) -> None:
        try:
            answered = source.probe(self._probe_timeout_s)
            why = "" if answered else "not this provider's answer"
        except UNREACHABLE as e:
            answered, why = False, f"{type(e).__name__}: {getattr(e, 'reason', e)}"
        if not answered:
            self._give_up(source.provider, why)
            return
        with self._lock:
            self.watching.append(source.provider)
        logger.info("watching %s's metadata for preemption notices (every %g s)",
                    source.provider, self._poll_s)
        seen: set[tuple[str, str]] = set()
        failures = 0
        while not self._stop.is_set():
            try:
                notice = source.poll(self._clock(), max(self._probe_timeout_s, 2.0))
                failures = 0
            except UNREACHABLE as e:
                failures += 1
                if failures == 3:  # a blip is normal; three in a row are worth a line
                    logger.warning("%s's metadata does not answer (%s); still polling",
                                   source.provider, e)
                notice = None
            if notice is not None and (notice.kind, notice.detail) not in seen:
                seen.add((notice.kind, notice.detail))
                self._on_notice(notice)
            self._stop.wait(self._poll_s)

    def _give_up(self, provider: str, why: str) -> None:
        with self._lock:
            self._silent[provider] = why
            everyone = len(self._silent) == len(self._sources)
            silent = dict(self._silent)
        if everyone:
            # The usual case off the clouds: one DEBUG line, nothing else.
            logger.debug("no cloud metadata endpoint answered; not watching for preemption "
                         "notices (%s)", "; ".join(f"{p}: {w}" for p, w in silent.items()))

    def close(self) -> None:
        """Stops the polls. Never waits: a thread may still be in a probe or a request (its
        timeout bounds it), and being daemon threads they end with the process."""
        self._stop.set()
