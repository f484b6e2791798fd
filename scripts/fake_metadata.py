"""A fake cloud instance-metadata endpoint on 127.0.0.1 (AWS IMDSv2, GCP, Azure), for the notice watcher's tests and
the chaos drill's reclaim notices (`RAYTRAIN_METADATA_URL` points a watcher at it)."""

from __future__ import annotations

import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse


class FakeMetadata:
    """One fake metadata endpoint; `cloud` picks the protocol, the attributes what it says."""

    def __init__(self, cloud: str):
        self.cloud = cloud
        self.market = "spot"
        self.action = None  # AWS: {"action", "time"}; GCP: "TRUE"; Azure: list of events
        self.maintenance = None
        self.body_override = None  # garbage for every notice read
        self.delay_s = 0.0
        self.token_ttl_s = 3600.0
        self.tokens: dict[str, float] = {}
        self.unauthorized = 0  # reads refused for a missing or expired token
        self.changed = threading.Condition()
        fake = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code: int, body: str = "", **headers):
                data = body.encode()
                self.send_response(code)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PUT(self):
                if fake.cloud != "aws" or self.path != "/latest/api/token":
                    return self._send(404)
                tok = uuid.uuid4().hex
                fake.tokens[tok] = time.time() + min(float(self.headers["X-aws-ec2-metadata-token-ttl-seconds"]),
                                                     fake.token_ttl_s)
                self._send(200, tok)

            def do_GET(self):
                time.sleep(fake.delay_s)
                u = urlparse(self.path)
                getattr(fake, f"_{fake.cloud}")(self, u.path, parse_qs(u.query))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def set(self, **kw) -> None:
        with self.changed:
            for k, v in kw.items():
                setattr(self, k, v)
            self.changed.notify_all()

    def _aws(self, h, path, q):
        tok = h.headers.get("X-aws-ec2-metadata-token")
        if tok not in self.tokens or self.tokens[tok] < time.time():
            self.unauthorized += 1
            return h._send(401)
        if path == "/latest/meta-data/instance-life-cycle":
            return h._send(200, self.market)
        if path == "/latest/meta-data/spot/instance-action":
            if self.body_override is not None:
                return h._send(200, self.body_override)
            return h._send(200, json.dumps(self.action)) if self.action else h._send(404)
        if path == "/latest/meta-data/events/maintenance/scheduled":
            return h._send(200, json.dumps(self.maintenance or []))
        if path == "/latest/meta-data/events/recommendations/rebalance":
            return h._send(404)
        h._send(404)

    def _gcp(self, h, path, q):
        if h.headers.get("Metadata-Flavor") != "Google":
            return h._send(403)
        if path.endswith("/instance/scheduling/provisioning-model"):
            return h._send(200, "SPOT" if self.market == "spot" else "STANDARD")
        if path.endswith("/instance/scheduling/preemptible"):
            return h._send(200, "TRUE" if self.market == "spot" else "FALSE")
        if path.endswith("/instance/maintenance-event"):
            return h._send(200, self.maintenance or "NONE")
        if path.endswith("/instance/preempted"):
            value = lambda: self.action or "FALSE"  # noqa: E731
            if q.get("wait_for_change") == ["true"]:
                with self.changed:
                    if q.get("last_etag", [""])[0] == f"e-{value()}":  # unchanged since that version: wait
                        self.changed.wait(float(q.get("timeout_sec", ["30"])[0]))
            return h._send(200, value(), ETag=f"e-{value()}")
        h._send(404)

    def _azure(self, h, path, q):
        if h.headers.get("Metadata") != "true":
            return h._send(400)
        if path == "/metadata/instance/compute":
            return h._send(200, json.dumps({"priority": "Spot" if self.market == "spot" else "Regular"}))
        if path == "/metadata/instance/compute/name":
            return h._send(200, "vm-7")
        if path == "/metadata/scheduledevents":
            return h._send(200, json.dumps({"DocumentIncarnation": 1, "Events": self.action or []}))
        h._send(404)

    def close(self):
        self.httpd.shutdown()
