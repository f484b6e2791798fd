"""The cloud notice watcher (raytrain/notice_watcher.py) against fake metadata servers on 127.0.0.1 that speak as
AWS (IMDSv2 only: no read without a valid token, tokens that expire), GCP (Metadata-Flavor, wait-for-change with an
ETag) and Azure (Scheduled Events): a notice drains once, with the cloud's deadline (clamped when past); trouble at
the endpoint is one line and never a drain; the detached start leaves exactly one watcher."""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from raytrain import notice_watcher as nw

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from fake_metadata import FakeMetadata as Fake  # noqa: E402 - the drills' fake endpoint, scripts/ on the path


@pytest.fixture
def fake(request):
    f = Fake(request.param)
    yield f
    f.close()


def _watch(md, **kw):
    drains, lines = [], []
    w = nw.Watcher(md, drain=lambda s, msg: drains.append((s, msg)) or True, log=lines.append, **kw)
    return w, drains, lines


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.mark.parametrize("fake", ["aws"], indirect=True)
def test_aws_spot_notice_drains_once_with_its_deadline_and_tokens_are_renewed(fake):
    md = nw.detect(fake.url)
    assert isinstance(md, nw.Aws)
    w, drains, lines = _watch(md)
    assert w.poll() == [] and drains == []
    fake.set(action={"action": "terminate", "time": _iso(time.time() + 120)})
    (n,) = w.poll()
    assert n.kind == "spot" and len(drains) == 1 and 115 <= drains[0][0] <= 121, drains
    assert "instance-action terminate" in drains[0][1]
    assert w.poll() == [] and len(drains) == 1  # once per notice
    # A token the endpoint expired: refused once, a new one taken, the read goes on.
    fake.set(token_ttl_s=0.5, action=None)
    md._token = None
    w.poll()
    time.sleep(1.0)
    before = fake.unauthorized
    assert w.poll() == [] and fake.unauthorized == before + 1 and not [x for x in lines if "unreadable" in x]


@pytest.mark.parametrize("fake", ["aws"], indirect=True)
def test_a_past_deadline_is_clamped_and_an_on_demand_node_drains_for_maintenance_as_set(fake):
    md = nw.Aws(fake.url)
    w, drains, lines = _watch(md)
    fake.set(action={"action": "stop", "time": _iso(time.time() - 30)})
    w.poll()
    assert drains[0][0] == nw.MIN_NOTICE_S and "clamped" in lines[-1], (drains, lines)
    fake.set(market="on-demand", action=None, maintenance=[
        {"Code": "system-reboot", "EventId": "instance-event-1", "State": "active",
         "NotBefore": datetime.datetime.fromtimestamp(time.time() + 600, datetime.timezone.utc)
         .strftime("%d %b %Y %H:%M:%S GMT")}])
    w, drains, _ = _watch(nw.Aws(fake.url))
    (n,) = w.poll()
    assert n.kind == "maintenance" and 590 <= drains[0][0] <= 601 and not w.spot
    w, drains, _ = _watch(nw.Aws(fake.url), maintenance=False)
    assert w.poll() == [] and drains == []


@pytest.mark.parametrize("fake", ["aws"], indirect=True)
def test_garbage_slowness_and_no_answer_are_one_line_each_and_never_a_drain(fake):
    w, drains, lines = _watch(nw.Aws(fake.url))
    fake.set(body_override="<html>oops</html>")
    for _ in range(3):
        assert w.poll() == []
    assert drains == [] and len([x for x in lines if "unreadable" in x]) == 1, lines
    fake.set(body_override=None, delay_s=nw.TIMEOUT_S + 1)
    t0 = time.monotonic()
    assert w.poll() == [] and time.monotonic() - t0 < 3 * nw.TIMEOUT_S + 2  # a timeout, not a hang
    assert drains == [] and "unreadable" in lines[-1]
    w, drains, lines = _watch(nw.Aws("http://127.0.0.1:1"))
    assert w.poll() == [] and w.poll() == [] and drains == [] and len(lines) == 1, lines
    assert nw.detect("http://127.0.0.1:1") is None


@pytest.mark.parametrize("fake", ["gcp"], indirect=True)
def test_gcp_preemption_is_seen_within_about_a_second_by_waiting_for_the_change(fake):
    md = nw.detect(fake.url)
    assert isinstance(md, nw.Gcp)
    md.wait_s = 20
    w, drains, _ = _watch(md)
    got = {}

    def look():
        t0 = time.monotonic()
        got["notices"], got["s"] = w.poll(), time.monotonic() - t0

    t = threading.Thread(target=look)
    t.start()
    time.sleep(1.0)
    t_notice = time.time()
    fake.set(action="TRUE")
    t.join(timeout=30)
    assert [n.kind for n in got["notices"]] == ["preempt"] and 1.0 <= got["s"] < 5.0, got  # woken by the change, not its 20 s timeout
    assert drains[0][0] == pytest.approx(nw.GCP_NOTICE_S - (time.time() - t_notice), abs=1.5)
    assert w.poll() == [] and len(drains) == 1


@pytest.mark.parametrize("fake", ["azure"], indirect=True)
def test_azure_preempt_events_for_this_vm_only(fake):
    md = nw.detect(fake.url)
    assert isinstance(md, nw.Azure)
    w, drains, _ = _watch(md)
    when = datetime.datetime.fromtimestamp(time.time() + 30, datetime.timezone.utc).strftime("%a, %d %b %Y %H:%M:%S GMT")
    fake.set(action=[{"EventId": "A", "EventType": "Preempt", "Resources": ["vm-3"], "NotBefore": when}])
    assert w.poll() == [] and drains == []  # another VM's
    fake.set(action=[{"EventId": "B", "EventType": "Preempt", "Resources": ["vm-7"], "NotBefore": when}])
    assert [n.kind for n in w.poll()] == ["preempt"] and 25 <= drains[0][0] <= 31


@pytest.mark.parametrize("fake", ["aws"], indirect=True)
def test_the_detached_start_leaves_one_watcher_that_outlives_its_shell(fake, tmp_path):
    pid_file = tmp_path / "watcher.pid"
    env = {**os.environ, nw.URL_ENV: fake.url}
    cmd = f"{sys.executable} -m raytrain.notice_watcher --interval 1 --detach {pid_file}"
    outs = [subprocess.run(["/bin/sh", "-c", cmd], env=env, capture_output=True, text=True, timeout=60)
            for _ in range(2)]
    assert [o.returncode for o in outs] == [0, 0], outs
    assert "started" in outs[0].stdout and "already running" in outs[1].stdout, outs
    pid = int(pid_file.read_text())
    try:
        mine = [p for p in os.listdir("/proc") if p.isdigit()
                and b"raytrain.notice_watcher" in open(f"/proc/{p}/cmdline", "rb").read()
                and str(pid_file).encode() not in open(f"/proc/{p}/cmdline", "rb").read()
                and fake.url.encode() in open(f"/proc/{p}/environ", "rb").read()]
        assert mine == [str(pid)] and os.getsid(pid) == pid  # exactly one, in a session of its own
        time.sleep(1.5)
        assert "aws spot node; watching reclaim notices" in (tmp_path / "watcher.pid.log").read_text()
    finally:
        os.kill(pid, signal.SIGTERM)
    # Not a cloud VM: nothing started, and the start line succeeds.
    out = subprocess.run(["/bin/sh", "-c", cmd.replace(str(pid_file), str(tmp_path / "none.pid"))],
                         env={**env, nw.URL_ENV: "http://127.0.0.1:1"}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "nothing to watch" in out.stdout and not (tmp_path / "none.pid").exists()


@pytest.mark.parametrize("config", ["aws-spot.yaml", "gcp-spot.yaml"])
@pytest.mark.parametrize("fake", ["aws"], indirect=True)
def test_each_vm_config_starts_one_watcher_on_every_worker_after_ray(fake, config, tmp_path):
    """The rendered start line of the config's workers, run here twice (a second `ray up`): one watcher."""
    from pathlib import Path

    import yaml

    cfg = yaml.safe_load((Path(__file__).resolve().parents[1] / "cluster" / config).read_text())
    cmds = cfg["worker_start_ray_commands"]
    (line,) = [c for c in cmds if "raytrain.notice_watcher" in c]
    assert cmds.index(line) > next(i for i, c in enumerate(cmds) if "ray start" in c) and "--detach" in line
    line = line.replace("/home/ray/notice-watcher", str(tmp_path)).replace("$RAY_HEAD_IP", "127.0.0.1")
    env = {**os.environ, nw.URL_ENV: fake.url, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    outs = [subprocess.run(["/bin/sh", "-c", line], env=env, capture_output=True, text=True, timeout=60)
            for _ in range(2)]
    pid = int((tmp_path / "watcher.pid").read_text())
    try:
        assert [o.returncode for o in outs] == [0, 0] and "already running" in outs[1].stdout, outs
        assert f"pid {pid}" in outs[0].stdout and f"pid {pid}" in outs[1].stdout
        # The in-run fallback (checkpoint.watch_notices) finds it where the configs put it, and stays off.
        assert f"--detach {nw.NODE_PID_FILE}" in " ".join((c for c in cmds if "raytrain.notice_watcher" in c))
        assert nw.node_watcher_running(str(tmp_path / "watcher.pid"))
    finally:
        os.kill(pid, signal.SIGTERM)


def test_the_drain_is_rays_own_command_for_this_node_or_the_one_named():
    """`ray drain-node` with reason PREEMPTION and the seconds left (never 0): the options Ray 2.60's command takes."""
    cmd = nw.drain_command(0.4, "AWS spot", "127.0.0.1:6379")
    assert cmd[1:] == ["drain-node", "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "AWS spot",
                       "--deadline-remaining-seconds", "1", "--address", "127.0.0.1:6379"]
    assert nw.drain_command(95.7, "m", None, "abc")[-2:] == ["--node-id", "abc"]
    help_ = subprocess.run([cmd[0], "drain-node", "--help"], capture_output=True, text=True, timeout=60).stdout
    for opt in ("--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "--deadline-remaining-seconds",
                "--address", "--node-id"):
        assert opt in help_, opt


@pytest.mark.parametrize("fake", ["aws"], indirect=True)
def test_the_in_run_fallback_asks_no_metadata_endpoint_off_a_cloud(fake, tmp_path, monkeypatch):
    """The fallback a run's local rank 0 starts (raytrain/worker/node_notices.py) looks for an endpoint only where the
    firmware names a cloud (DMI, no request) or RAYTRAIN_METADATA_URL is set: off a cloud it asks nothing of a
    link-local address. A pid file whose process is not a watcher does not count as the node's own watcher."""
    def dmi(name: str, **files) -> str:
        for key, value in files.items():
            path = tmp_path / name / ("hypervisor/uuid" if key == "uuid" else f"class/dmi/id/{key}")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(value + "\n")
        return str(tmp_path / name)

    assert nw.cloud_hint(dmi("a", sys_vendor="Amazon EC2", product_name="g5.xlarge")) == "aws"
    assert nw.cloud_hint(dmi("x", uuid="ec2e1916-9099-7caf-fd21-012345abcdef")) == "aws"  # older Xen instances
    assert nw.cloud_hint(dmi("g", sys_vendor="Google", product_name="Google Compute Engine")) == "gcp"
    assert nw.cloud_hint(dmi("z", sys_vendor="Microsoft Corporation", product_name="Virtual Machine")) == "azure"
    assert nw.cloud_hint(dmi("q", sys_vendor="QEMU", product_name="Standard PC")) is None
    assert nw.cloud_hint(str(tmp_path / "nothing")) is None
    monkeypatch.delenv(nw.URL_ENV, raising=False)
    monkeypatch.setattr(nw, "cloud_hint", lambda root="/sys": None)
    monkeypatch.setattr(nw, "_http", lambda *a, **k: pytest.fail(f"a metadata request off a cloud: {a}"))
    assert nw.detect_here() is None
    monkeypatch.undo()
    monkeypatch.setenv(nw.URL_ENV, fake.url)
    assert nw.detect_here().cloud == "aws"
    (tmp_path / "pid").write_text(str(os.getpid()))  # alive, but pytest, not a watcher
    assert not nw.node_watcher_running(str(tmp_path / "pid")) and not nw.node_watcher_running(str(tmp_path / "no"))
