"""On every node: the cloud's reclaim or maintenance notice, read from the instance metadata (AWS IMDSv2, GCP; Azure
detected only), drains this node's Ray with reason PREEMPTION and a deadline, once per notice.

`python -m raytrain.notice_watcher [--detach PID_FILE]`, started by the cluster configs on every node: Ray's
autoscaler drains only idle nodes, and nothing in Ray reads a cloud's notice, so without it every reclaim of a VM
cluster is one without notice. The drain is Ray's own (`ray drain-node`, with the node's Ray token and TLS settings:
no cloud credentials); Ray Train then checkpoints at the next step and the run restarts on the nodes that stay
(docs/FAULT_TOLERANCE.md). An endpoint that is unreachable, slow or garbled gives one line and polling goes on; it
never drains. The deadline is clamped: a past or skewed one still leaves MIN_NOTICE_S for the checkpoint.
"""

from __future__ import annotations

import datetime
import email.utils
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable, Optional

AWS = "http://169.254.169.254"
GCP = "http://metadata.google.internal"
AZURE = "http://169.254.169.254"
URL_ENV = "RAYTRAIN_METADATA_URL"  # another endpoint (drills and tests: a fake one on 127.0.0.1)
MIN_NOTICE_S = 10.0  # a deadline in the past, or a clock ahead of the cloud's: still this long for the checkpoint
GCP_NOTICE_S = 30.0  # GCP's preemption notice; its metadata names no deadline (first seen + this)
GCP_MAINTENANCE_S = 60.0  # a TERMINATE_ON_HOST_MAINTENANCE event: GCP's advance notice is at least this
TOKEN_TTL_S = 21600  # IMDSv2 tokens: the longest AWS allows; renewed a minute before they expire or on a 401
TIMEOUT_S = 2.0  # connect and read: a dropped hop (a container without the metadata route) shows as a timeout


@dataclass(frozen=True)
class Notice:
    """What the cloud announced: `key` tells one notice from the next (a drain is sent once per key)."""

    key: str
    kind: str  # spot | maintenance | rebalance | preempt
    deadline: float  # unix seconds
    detail: str


class Unreadable(Exception):
    """The endpoint did not answer, or answered something that is not what the cloud sends (the message says)."""


def _http(url: str, *, method: str = "GET", headers: Optional[dict] = None, timeout: float = TIMEOUT_S,
          data: Optional[bytes] = None, etag: Optional[list] = None) -> tuple[int, str]:
    """(status, body) of one request; 401 and 404 are answers (AWS: a stale token, no notice), every other failure
    is Unreadable. `etag`: a list the response's ETag is appended to."""
    req = urllib.request.Request(url, method=method, headers=headers or {}, data=data)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            if etag is not None:
                etag.append(r.headers.get("ETag", ""))
            return r.status, r.read(1 << 16).decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        if e.code in (401, 404):
            return e.code, ""
        raise Unreadable(f"{method} {url}: HTTP {e.code}") from None
    except (urllib.error.URLError, OSError) as e:
        raise Unreadable(f"{method} {url}: {getattr(e, 'reason', e)}") from None


class Aws:
    """EC2 instance metadata, IMDSv2 only (a session token for every read)."""

    cloud = "aws"

    def __init__(self, base: str = AWS, clock: Callable[[], float] = time.time):
        self.base, self.clock = base.rstrip("/"), clock
        self._token: Optional[tuple[str, float]] = None

    def _get(self, path: str) -> tuple[int, str]:
        for _ in range(2):  # a token the endpoint no longer takes (401): one new one, then give up
            status, body = _http(f"{self.base}{path}", headers={"X-aws-ec2-metadata-token": self.token()})
            if status != 401:
                return status, body
            self._token = None
        raise Unreadable(f"GET {self.base}{path}: HTTP 401 with a new token")

    def token(self) -> str:
        if self._token is None or self.clock() > self._token[1] - 60:
            status, body = _http(f"{self.base}/latest/api/token", method="PUT", data=b"",
                                 headers={"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)})
            if status != 200 or not body.strip():
                raise Unreadable(f"PUT {self.base}/latest/api/token: HTTP {status}")
            self._token = (body.strip(), self.clock() + TOKEN_TTL_S)
        return self._token[0]

    def market(self) -> str:
        status, body = self._get("/latest/meta-data/instance-life-cycle")
        return "spot" if status == 200 and body.strip() == "spot" else "on-demand"

    def notices(self, *, spot: bool, rebalance: bool, maintenance: bool) -> list[Notice]:
        out = []
        if spot:
            status, body = self._get("/latest/meta-data/spot/instance-action")
            if status == 200:  # {"action": "terminate" | "stop" | "hibernate", "time": "2026-12-07T16:30:00Z"}
                got = _json(body, dict, "spot/instance-action")
                when = _iso(got.get("time"), "spot/instance-action time")
                out.append(Notice(f"spot {got.get('action')} {got.get('time')}", "spot", when,
                                  f"AWS spot instance-action {got.get('action')} at {got.get('time')}"))
        if rebalance:
            status, body = self._get("/latest/meta-data/events/recommendations/rebalance")
            if status == 200:  # {"noticeTime": "..."}: no deadline; the reclaim may follow in minutes, or never
                got = _json(body, dict, "rebalance")
                out.append(Notice(f"rebalance {got.get('noticeTime')}", "rebalance", self.clock() + 120.0,
                                  f"AWS rebalance recommendation of {got.get('noticeTime')}"))
        if maintenance:
            status, body = self._get("/latest/meta-data/events/maintenance/scheduled")
            if status == 200 and body.strip():
                for ev in _json(body, list, "events/maintenance/scheduled"):
                    if isinstance(ev, dict) and ev.get("State", "active") == "active":
                        when = _http_date(ev.get("NotBefore"), "maintenance NotBefore")
                        out.append(Notice(f"maintenance {ev.get('EventId')}", "maintenance", when,
                                          f"AWS scheduled {ev.get('Code')} {ev.get('EventId')} not before "
                                          f"{ev.get('NotBefore')}"))
        return out


class Gcp:
    """Compute Engine metadata (`Metadata-Flavor: Google`); a preemption is read with wait-for-change."""

    cloud = "gcp"

    def __init__(self, base: str = GCP, clock: Callable[[], float] = time.time, wait_s: float = 30.0):
        self.base, self.clock, self.wait_s = base.rstrip("/"), clock, wait_s
        self._seen: dict[str, float] = {}  # notice key -> when first seen (the deadline counts from there)
        self._maintenance_etag = ""

    def _get(self, path: str, timeout: float = TIMEOUT_S, etag: Optional[list] = None) -> str:
        status, body = _http(f"{self.base}/computeMetadata/v1/{path}", headers={"Metadata-Flavor": "Google"},
                             timeout=timeout, etag=etag)
        if status != 200:
            raise Unreadable(f"GET {path}: HTTP {status}")
        return body.strip()

    def market(self) -> str:
        model = self._get("instance/scheduling/provisioning-model").upper()
        return "spot" if model == "SPOT" or self._get("instance/scheduling/preemptible").upper() == "TRUE" else "on-demand"

    def notices(self, *, spot: bool, rebalance: bool, maintenance: bool) -> list[Notice]:
        out = []
        if spot:
            # The value now, then a wait for it to change from that version (its ETag: a change in between is not
            # missed), up to wait_s: the notice arrives within about a second of GCP's.
            tag: list = []
            got = self._get("instance/preempted", etag=tag)
            if got.upper() == "FALSE":
                got = self._get(f"instance/preempted?wait_for_change=true&timeout_sec={int(self.wait_s)}"
                                + (f"&last_etag={tag[0]}" if tag and tag[0] else ""), timeout=self.wait_s + TIMEOUT_S)
            if got.upper() not in ("TRUE", "FALSE"):
                raise Unreadable(f"instance/preempted: {got[:60]!r} (TRUE or FALSE expected)")
            if got.upper() == "TRUE":
                first = self._seen.setdefault("preempted", self.clock())
                out.append(Notice("preempted", "preempt", first + GCP_NOTICE_S, "GCP preemption"))
        if maintenance:
            got = self._get("instance/maintenance-event")
            if got.upper().startswith("TERMINATE"):
                first = self._seen.setdefault(got, self.clock())
                out.append(Notice(f"maintenance {got}", "maintenance", first + GCP_MAINTENANCE_S,
                                  f"GCP {got}"))
        return out


class Azure:
    """Azure Scheduled Events (`Metadata: true`): detected only (no Azure cluster config ships)."""

    cloud = "azure"
    API = "2020-07-01"

    def __init__(self, base: str = AZURE, clock: Callable[[], float] = time.time):
        self.base, self.clock = base.rstrip("/"), clock

    def _get(self, path: str) -> str:
        status, body = _http(f"{self.base}/metadata/{path}", headers={"Metadata": "true"})
        if status != 200:
            raise Unreadable(f"GET {path}: HTTP {status}")
        return body

    def market(self) -> str:
        got = _json(self._get("instance/compute?api-version=2021-02-01"), dict, "instance/compute")
        return "spot" if str(got.get("priority", "")).lower() == "spot" else "on-demand"

    def notices(self, *, spot: bool, rebalance: bool, maintenance: bool) -> list[Notice]:
        me = self._get("instance/compute/name?api-version=2021-02-01&format=text").strip()
        got = _json(self._get(f"scheduledevents?api-version={self.API}"), dict, "scheduledevents")
        out = []
        for ev in got.get("Events") or []:
            if not isinstance(ev, dict) or me not in (ev.get("Resources") or []):
                continue  # another VM's event
            kind = {"Preempt": "preempt", "Terminate": "maintenance", "Reboot": "maintenance",
                    "Redeploy": "maintenance"}.get(ev.get("EventType"))
            if kind == "preempt" and spot or kind == "maintenance" and maintenance:
                when = _http_date(ev.get("NotBefore"), "NotBefore") if ev.get("NotBefore") else self.clock() + 30.0
                out.append(Notice(f"{ev.get('EventType')} {ev.get('EventId')}", kind, when,
                                  f"Azure {ev.get('EventType')} {ev.get('EventId')} not before {ev.get('NotBefore')}"))
        return out


def _json(body: str, kind: type, what: str):
    try:
        got = json.loads(body)
    except ValueError:
        raise Unreadable(f"{what}: not JSON ({body[:60]!r})") from None
    if not isinstance(got, kind):
        raise Unreadable(f"{what}: a JSON {kind.__name__} expected ({body[:60]!r})")
    return got


def _iso(value, what: str) -> float:
    try:
        return datetime.datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise Unreadable(f"{what}: {value!r} is not a time") from None


def _http_date(value, what: str) -> float:
    try:
        return email.utils.parsedate_to_datetime(str(value)).timestamp()
    except (TypeError, ValueError):
        raise Unreadable(f"{what}: {value!r} is not a time") from None


def detect(base: Optional[str] = None, only: Optional[str] = None) -> Optional[object]:
    """This node's cloud from its metadata endpoint (AWS, GCP, Azure, asked in that order; `only`: that cloud's
    alone), or None."""
    for cls, default in ((Aws, AWS), (Gcp, GCP), (Azure, AZURE)):
        if only is not None and cls.cloud != only:
            continue
        md = cls(base or default)
        try:
            md.market()
            return md
        except Unreadable:
            continue
    return None


NODE_PID_FILE = "/home/ray/notice-watcher/watcher.pid"  # where the VM configs start a node's own watcher


def cloud_hint(root: str = "/sys") -> Optional[str]:
    """The cloud this machine's firmware names (its DMI strings, as cloud-init reads them): aws, gcp, azure or None,
    without a network request - off a cloud, nothing is asked of a link-local metadata address."""
    def read(path: str) -> str:
        try:
            with open(os.path.join(root, path)) as f:
                return f.read().strip()
        except OSError:
            return ""

    vendor, product, bios = (read(f"class/dmi/id/{k}") for k in ("sys_vendor", "product_name", "bios_vendor"))
    if "Amazon" in vendor or "Amazon" in bios or read("hypervisor/uuid").lower().startswith("ec2"):
        return "aws"
    if "Google" in vendor or product == "Google Compute Engine":
        return "gcp"
    if vendor == "Microsoft Corporation" and product == "Virtual Machine":
        return "azure"
    return None


def detect_here() -> Optional[object]:
    """This node's metadata endpoint for the in-run watcher: RAYTRAIN_METADATA_URL's (drills, tests), else that of the
    cloud the firmware names, if it answers; None anywhere else."""
    url = os.environ.get(URL_ENV)
    if url:
        return detect(url)
    cloud = cloud_hint()
    return None if cloud is None else detect(only=cloud)


def node_watcher_running(pid_file: str = NODE_PID_FILE) -> bool:
    """Whether this node's own watcher (started by the VM configs) is alive: the pid in its file runs this module (a
    pid the system gave to another process since does not count)."""
    try:
        pid = int(open(pid_file).read().strip())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"raytrain.notice_watcher" in f.read().split(b"\0")
    except (OSError, ValueError):
        return False


def drain_command(deadline_s: float, message: str, address: Optional[str], node_id: Optional[str] = None) -> list[str]:
    """`ray drain-node` of this node (or `node_id`: several Ray nodes on one machine, as in drills) with reason
    PREEMPTION and the seconds left (at least 1)."""
    cmd = [os.path.join(os.path.dirname(sys.executable), "ray"), "drain-node", "--reason",
           "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", message,
           "--deadline-remaining-seconds", str(max(1, int(deadline_s)))]
    return cmd + (["--address", address] if address else []) + (["--node-id", node_id] if node_id else [])


def ray_drain(deadline_s: float, message: str, address: Optional[str], node_id: Optional[str] = None) -> bool:
    """Ray's drain of this node (`ray drain-node`, the node's own Ray settings: token, TLS) with reason PREEMPTION;
    whether Ray accepted it."""
    cmd = drain_command(deadline_s, message, address, node_id)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        print(f"[raytrain] notice watcher: ray drain-node failed: {(out.stderr or out.stdout).strip()[-300:]}",
              flush=True)
    return out.returncode == 0


class Watcher:
    """Polls `md` every `interval_s` and drains once per notice (`drain(remaining_s, message)`). Rebalance
    recommendations drain only with rebalance=True (a drained node cannot be taken back); maintenance events with
    maintenance=True (on-demand nodes are watched for them only)."""

    def __init__(self, md, *, drain: Callable[[float, str], bool], interval_s: float = 5.0, rebalance: bool = False,
                 maintenance: bool = True, clock: Callable[[], float] = time.time, log: Callable[[str], None] = print):
        self.md, self.drain, self.interval_s, self.clock, self.log = md, drain, interval_s, clock, log
        self.rebalance, self.maintenance = rebalance, maintenance
        self.spot: Optional[bool] = None
        self.drained: set[str] = set()
        self._said: Optional[str] = None

    def poll(self) -> list[Notice]:
        """One look: the notices drained now (each once); never raises for the endpoint."""
        try:
            if self.spot is None:
                self.spot = self.md.market() == "spot"
                self.log(f"[raytrain] notice watcher: {self.md.cloud} {'spot' if self.spot else 'on-demand'} node; "
                         f"watching {'reclaim notices' if self.spot else 'maintenance events'}")
            got = self.md.notices(spot=self.spot, rebalance=self.rebalance and bool(self.spot),
                                  maintenance=self.maintenance)
        except Unreadable as e:
            if str(e) != self._said:  # one line per kind of trouble, not one per poll
                self._said = str(e)
                self.log(f"[raytrain] notice watcher: metadata unreadable ({e}); still watching")
            return []
        self._said = None
        done = []
        for n in got:
            if n.key in self.drained:
                continue
            remaining = n.deadline - self.clock()
            clamped = max(remaining, MIN_NOTICE_S)
            self.log(f"[raytrain] notice watcher: {n.detail}: draining this node, {clamped:.0f} s to go"
                     + ("" if clamped == remaining else f" (the notice said {remaining:.0f} s: clamped)"))
            if self.drain(clamped, f"raytrain notice watcher: {n.detail}"):
                self.drained.add(n.key)
                done.append(n)
        return done

    def run(self, stop: Callable[[], bool] = lambda: False) -> None:
        while not stop():
            t0 = self.clock()
            self.poll()
            time.sleep(max(0.0, self.interval_s - (self.clock() - t0)))


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m raytrain.notice_watcher", description=__doc__.splitlines()[0])
    p.add_argument("--address", default=os.environ.get("RAY_ADDRESS"), help="this cluster's GCS (HEAD:6379)")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between looks (GCP waits for a change)")
    p.add_argument("--rebalance", choices=("ignore", "drain"), default="ignore",
                   help="AWS rebalance recommendations: drain is irreversible (the node takes no new work)")
    p.add_argument("--maintenance", choices=("drain", "ignore"), default="drain")
    p.add_argument("--node-id", help="the Ray node to drain (default: this machine's; drills run several on one)")
    p.add_argument("--detach", metavar="PID_FILE", help="run in a session of its own, once (the log beside it)")
    a = p.parse_args(argv)
    md = detect(os.environ.get(URL_ENV))
    if md is None:  # not a cloud VM (or one whose metadata this node cannot reach): a start line must not fail
        print("[raytrain] notice watcher: no cloud metadata endpoint answers (not AWS, GCP or Azure): nothing to "
              "watch", flush=True)
        return 0
    if a.detach:
        from raytrain.daemon import start_once

        i = argv.index("--detach")
        child = [sys.executable, "-m", "raytrain.notice_watcher", *argv[:i], *argv[i + 2:]]
        pid, started = start_once(child, pid_file=a.detach, log_file=a.detach + ".log", ready=_after(1.0))
        print(f"notice watcher {'started' if started else 'already running'} (pid {pid}, {md.cloud})", flush=True)
        return 0
    Watcher(md, drain=lambda s, msg: ray_drain(s, msg, a.address, a.node_id), interval_s=a.interval,
            rebalance=a.rebalance == "drain", maintenance=a.maintenance == "drain").run()
    return 0


def _after(seconds: float) -> Callable[[], bool]:
    """start_once's readiness for a process that serves nothing: still alive `seconds` after its start."""
    t0 = time.monotonic()
    return lambda: time.monotonic() - t0 >= seconds


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
