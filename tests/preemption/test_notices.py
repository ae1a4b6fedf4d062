"""Each provider's documented answers parsed into one notice (tables), and the watcher against a
local server answering as each provider does: it finds its provider, hands over one notice, and
says nothing but one DEBUG line where no endpoint answers."""

from __future__ import annotations

import calendar
import json
import logging
import socket
import threading
from pathlib import Path

import pytest

from elasticft.config import ConfigError, PreemptConfig, parse_notices
from elasticft.preemption.notices import (
    CloudWatcher,
    Notice,
    cloud_sources,
    clouds_of,
    in_kubernetes,
    parse_aws_instance_action,
    parse_aws_rebalance,
    parse_azure_scheduled_events,
    parse_gcp_preempted,
    read_dmi,
)
from tests.agent.test_launch import wait_until
from tests.preemption.metadata import MetadataServer

NOW = 1_700_000_000.0
AT = calendar.timegm((2023, 11, 14, 22, 15, 20, 0, 0, 0))  # 2023-11-14T22:15:20Z


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (404, "<?xml ...>Not Found", None),  # no interruption scheduled
        (200, json.dumps({"action": "terminate", "time": "2023-11-14T22:15:20Z"}),
         Notice("aws", "termination", AT, "spot instance-action terminate at "
                "2023-11-14T22:15:20Z")),
        (200, json.dumps({"action": "stop", "time": "2023-11-14T22:15:20Z"}),
         Notice("aws", "termination", AT, "spot instance-action stop at 2023-11-14T22:15:20Z")),
        (200, json.dumps({"action": "hibernate", "time": "not a time"}),
         Notice("aws", "termination", NOW + 120, "spot instance-action hibernate at not a time")),
        (200, "not json", None),
        (200, json.dumps(["terminate"]), None),
    ],
)
def test_aws_instance_action(status: int, body: str, expected: Notice | None) -> None:
    assert parse_aws_instance_action(status, body, NOW) == expected


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (404, "Not Found", None),
        (200, json.dumps({"noticeTime": "2023-11-14T22:15:20Z"}),
         Notice("aws", "rebalance", None, "rebalance recommendation at 2023-11-14T22:15:20Z")),
        (200, "{}", None),
    ],
)
def test_aws_rebalance_recommendation(status: int, body: str, expected: Notice | None) -> None:
    assert parse_aws_rebalance(status, body, NOW) == expected


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (200, "FALSE", None),
        (200, "TRUE", Notice("gcp", "termination", NOW + 30, "instance/preempted TRUE")),
        (200, "TRUE\n", Notice("gcp", "termination", NOW + 30, "instance/preempted TRUE")),
        (403, "TRUE", None),  # not an answer of the metadata server
    ],
)
def test_gcp_preempted(status: int, body: str, expected: Notice | None) -> None:
    assert parse_gcp_preempted(status, body, NOW) == expected


def _azure(*events: dict) -> str:
    return json.dumps({"DocumentIncarnation": 3, "Events": list(events)})


PREEMPT = {"EventId": "E1", "EventType": "Preempt", "ResourceType": "VirtualMachine",
           "Resources": ["vm-a"], "EventStatus": "Scheduled",
           "NotBefore": "Tue, 14 Nov 2023 22:15:20 GMT", "Description": "",
           "EventSource": "Platform", "DurationInSeconds": -1}


@pytest.mark.parametrize(
    ("body", "vm", "expected"),
    [
        (_azure(), "vm-a", None),
        (_azure(PREEMPT), "vm-a", Notice("azure", "termination", AT, "Preempt event E1 "
                                          "(Scheduled) not before Tue, 14 Nov 2023 22:15:20 GMT")),
        (_azure(PREEMPT), None, Notice("azure", "termination", AT, "Preempt event E1 "
                                        "(Scheduled) not before Tue, 14 Nov 2023 22:15:20 GMT")),
        (_azure(PREEMPT), "vm-b", None),  # another VM of the availability set
        (_azure({**PREEMPT, "EventType": "Reboot"}), "vm-a", None),
        (_azure({**PREEMPT, "EventStatus": "Started", "NotBefore": ""}), "vm-a",
         Notice("azure", "termination", NOW, "Preempt event E1 (Started) not before now")),
        ("not json", "vm-a", None),
    ],
)
def test_azure_scheduled_events(body: str, vm: str | None, expected: Notice | None) -> None:
    assert parse_azure_scheduled_events(200, body, NOW, vm) == expected


@pytest.mark.parametrize(("env", "inside"), [({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, True),
                                             ({"KUBERNETES_SERVICE_HOST": ""}, False), ({}, False)])
def test_kubernetes_is_known_by_its_service_variable(env: dict[str, str], inside: bool) -> None:
    assert in_kubernetes(env) is inside


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_one_server_url_stands_for_every_provider() -> None:
    assert PreemptConfig(preempt_notices="http://10.1.2.3:8080").urls() == \
        ("http://10.1.2.3:8080",) * 3
    assert PreemptConfig().urls()[1] == "http://metadata.google.internal"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("provider", ["aws", "gcp", "azure"])
def test_the_watcher_finds_its_provider_and_hands_over_one_notice(provider: str) -> None:
    server = MetadataServer(provider, lead_s=90)
    got: list[Notice] = []
    watcher = CloudWatcher(cloud_sources(server.url, server.url, server.url), got.append,
                           poll_s=0.1, probe_timeout_s=1.0)
    try:
        watcher.start()
        wait_until(lambda: watcher.watching == [provider], 30, f"{provider} found")
        deadline = server.preempt()
        wait_until(lambda: got, 30, "a notice")
        wait_until(lambda: len(server.requests) > 20, 30, "more polls")
    finally:
        watcher.close()
        server.close()
    assert [(n.provider, n.kind) for n in got] == [(provider, "termination")]  # once only
    assert got[0].deadline is not None
    # Google Cloud gives no time, only "about 30 s": counted from when it was seen.
    assert abs(got[0].deadline - deadline) < 1 if provider != "gcp" else \
        got[0].deadline < deadline
    if provider == "azure":  # only this VM's events count: its name was asked first
        assert any("/metadata/instance/compute/name" in r for r in server.requests)


@pytest.mark.timeout(60)
def test_no_endpoint_answering_costs_one_debug_line(caplog: pytest.LogCaptureFixture) -> None:
    url = _closed_port_url()
    caplog.set_level(logging.DEBUG, logger="elasticft.preemption")
    watcher = CloudWatcher(cloud_sources(url, url, url), lambda n: None, poll_s=0.1,
                           probe_timeout_s=0.5)
    watcher.start()
    wait_until(lambda: not any(t.name.startswith("elasticft-preempt")
                               for t in threading.enumerate()), 30, "the probes to give up")
    watcher.close()
    lines = [r for r in caplog.records if r.name.startswith("elasticft.preemption")]
    assert [r.levelno for r in lines] == [logging.DEBUG], [r.getMessage() for r in lines]
    assert "no cloud metadata endpoint answered" in lines[0].getMessage()
    assert watcher.watching == []


@pytest.mark.parametrize(("value", "parsed"), [
    ("auto", "auto"), ("off", "off"), (False, "off"),  # YAML's bare off
    ("http://10.0.0.1:8080/", "http://10.0.0.1:8080"), ("https://meta.example", "https://meta.example"),
])
def test_the_notices_option(value: object, parsed: str) -> None:
    assert parse_notices(value) == parsed


def test_a_bad_notices_value_names_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"--preempt-notices='sometimes' is not valid; give "
                       r"auto, off or a metadata server's URL"):
        parse_notices("sometimes")


@pytest.mark.parametrize(("dmi", "clouds"), [
    ({"sys_vendor": "Amazon EC2", "product_name": "p5.48xlarge"}, ("aws",)),
    ({"sys_vendor": "Xen", "bios_vendor": "Amazon EC2"}, ("aws",)),  # an older Xen instance
    ({"sys_vendor": "Google", "product_name": "Google Compute Engine"}, ("gcp",)),
    ({"sys_vendor": "Microsoft Corporation", "product_name": "Virtual Machine",
      "chassis_asset_tag": "7783-7084-3265-9085-8269-3286-77"}, ("azure",)),
    ({"sys_vendor": "Microsoft Corporation", "product_name": "Virtual Machine"}, ()),  # Hyper-V
    ({"sys_vendor": "Dell Inc.", "product_name": "PowerEdge XE9680"}, ()),
    ({"sys_vendor": "QEMU", "product_name": "Standard PC"}, ()),
    ({}, ()),  # no DMI (a container without /sys/class/dmi)
], ids=["aws-nitro", "aws-xen", "gcp", "azure", "hyper-v", "bare-metal", "qemu", "none"])
def test_a_metadata_endpoint_is_asked_only_on_its_own_cloud(
        dmi: dict[str, str], clouds: tuple[str, ...]) -> None:
    assert clouds_of(dmi) == clouds


def test_the_dmi_fields_are_read_from_files_and_missing_ones_left_out(tmp_path: Path) -> None:
    (tmp_path / "sys_vendor").write_text("Amazon EC2\n")
    assert read_dmi(tmp_path) == {"sys_vendor": "Amazon EC2"}
    assert cloud_sources("http://a", "http://g", "http://z", providers=("aws",))[0].provider \
        == "aws"
