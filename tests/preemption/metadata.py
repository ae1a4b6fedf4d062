"""A local metadata server that answers as one cloud provider's documented endpoint does.

It listens on 127.0.0.1 only, serves one request at a time in a loop that ends by itself
(``lifetime_s``, or :meth:`MetadataServer.close`), and announces a preemption once the test
calls :meth:`MetadataServer.preempt` (AWS also a rebalance recommendation, once it calls
:meth:`MetadataServer.rebalance`). Paths, headers and payloads are the providers' documented
ones:

* aws: IMDSv2 (``PUT /latest/api/token``, then the token in ``X-aws-ec2-metadata-token``; 401
  without it), ``/latest/meta-data/spot/instance-action`` (404, then
  ``{"action": "terminate", "time": "<UTC>"}``), the rebalance recommendation (404, then
  ``{"noticeTime": "<UTC>"}``);
* gcp: ``/computeMetadata/v1/instance/preempted`` with ``Metadata-Flavor: Google`` (403
  without it), answering ``FALSE`` then ``TRUE``;
* azure: ``Metadata: true`` required (400 without it), ``/metadata/instance/compute/name`` and
  ``/metadata/scheduledevents?api-version=2020-07-01`` with a ``Preempt`` event naming the VM.
"""

from __future__ import annotations

import email.utils
import http.server
import json
import threading
import time
import urllib.parse

TOKEN = "AQAEAtoken=="
VM_NAME = "spot-vm-0"


class MetadataServer:
    def __init__(self, provider: str, lead_s: float = 60.0, lifetime_s: float = 600.0) -> None:
        self.provider = provider
        self.lead_s = lead_s
        self.deadline: float | None = None
        """Wall-clock time the announced preemption takes the machine (None: none yet)."""
        self.rebalance_at: float | None = None
        """When AWS recommended a rebalance (None: it has not)."""
        self.requests: list[str] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_PUT(self) -> None:
                server.requests.append(f"PUT {self.path}")
                if (server.provider == "aws" and self.path == "/latest/api/token"
                        and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")):
                    self._send(200, TOKEN)
                else:
                    self._send(404, "Not Found")

            def do_GET(self) -> None:
                server.requests.append(f"GET {self.path}")
                status, body, headers = server.answer(self.path, self.headers)
                self._send(status, body, headers)

            def _send(self, status: int, body: str, headers: dict[str, str] | None = None
                      ) -> None:
                data = body.encode()
                self.send_response(status)
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
        self._server.timeout = 0.2
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._stop = threading.Event()
        self._end = time.monotonic() + lifetime_s
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set() and time.monotonic() < self._end:
            self._server.handle_request()
        self._server.server_close()

    def preempt(self) -> float:
        """Announces the preemption from now on; returns its deadline (wall clock)."""
        # AWS gives the time in whole seconds: the deadline is that second.
        self.deadline = float(int(time.time() + self.lead_s))
        return self.deadline

    def rebalance(self) -> None:
        """AWS: an elevated risk of interruption, no deadline."""
        self.rebalance_at = time.time()

    def replace_machine(self) -> None:
        """The relaunch runs on a machine nobody is preempting (yet)."""
        self.deadline = self.rebalance_at = None

    def answer(self, url: str, headers: object) -> tuple[int, str, dict[str, str]]:
        path, _, query = url.partition("?")
        get = headers.get  # type: ignore[attr-defined]
        if self.provider == "aws" and path.startswith("/latest/meta-data/"):
            if get("X-aws-ec2-metadata-token") != TOKEN:
                return 401, "Unauthorized", {}
            item = path.removeprefix("/latest/meta-data/")
            if item == "instance-id":
                return 200, "i-0123456789abcdef0", {}
            if item == "spot/instance-action" and self.deadline is not None:
                when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.deadline))
                return 200, json.dumps({"action": "terminate", "time": when}), {}
            if item == "events/recommendations/rebalance" and self.rebalance_at is not None:
                when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.rebalance_at))
                return 200, json.dumps({"noticeTime": when}), {}
            return 404, "Not Found", {}
        if self.provider == "gcp" and path == "/computeMetadata/v1/instance/preempted":
            if get("Metadata-Flavor") != "Google":
                return 403, "Missing Metadata-Flavor:Google header.", {}
            return 200, "TRUE" if self.deadline is not None else "FALSE", {
                "Metadata-Flavor": "Google", "Content-Type": "application/text"}
        if self.provider == "azure" and path.startswith("/metadata/"):
            if get("Metadata") != "true":
                return 400, json.dumps({"error": "Bad request. Required metadata header not "
                                        "specified"}), {}
            if path == "/metadata/instance/compute/name":
                return 200, VM_NAME, {}
            if path == "/metadata/scheduledevents" and \
                    urllib.parse.parse_qs(query).get("api-version") == ["2020-07-01"]:
                return 200, json.dumps(self.azure_document()), {"Content-Type":
                                                                "application/json"}
        return 404, "Not Found", {}

    def azure_document(self) -> dict:
        events = [] if self.deadline is None else [{
            "EventId": "602d9444-d2cd-49c7-8624-8643e7171297",
            "EventType": "Preempt",
            "ResourceType": "VirtualMachine",
            "Resources": [VM_NAME],
            "EventStatus": "Scheduled",
            "NotBefore": email.utils.formatdate(self.deadline, usegmt=True),
            "Description": "",
            "EventSource": "Platform",
            "DurationInSeconds": -1,
        }]
        return {"DocumentIncarnation": 2 if events else 1, "Events": events}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
