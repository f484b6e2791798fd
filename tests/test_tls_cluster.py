"""Ray's mutual TLS on the simulated cluster: `scripts/local_cluster.sh up --tls DIR` with certificates from
raytrain.tls.make (what scripts/tls_certs.sh makes).

One cluster for the module, on ports of its own: cluster/local-fake.yaml cut to two nodes, the head and one worker
node the autoscaler starts at once (every fake node gets the TLS settings from the head's `ray start` through the
autoscaler's process), each with one slot of a custom resource so that the run's two training workers land on
different nodes. A 2-worker run submitted to it gives the same losses as the same run without TLS; a process
without the cluster's certificates (or with another CA's) cannot join, one with them can; `env` prints the paths
clients need and no key appears in any output or log. Bad certificates stop `up` before anything starts: one line,
exit 2.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from raytrain import storage, tls
from tests.helpers import REFERENCE, free_port, tiny_overrides

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SCRIPT = str(ROOT / "scripts" / "local_cluster.sh")
# Short connect timeouts: a refused process gives up in ~10 s instead of retrying for minutes (measured: 9 s; one with
# the certificates joins in ~1 s). The subprocess timeout only catches a hang.
JOIN_ENV = {"RAY_gcs_server_port_wait_time_s": "1", "RAY_gcs_rpc_server_connect_timeout_s": "2",
            "RAY_gcs_rpc_server_reconnect_timeout_s": "4", "RAY_py_gcs_connect_timeout_s": "4"}
# What `local_cluster.sh env` exports beside the certificates: Ray's address lookup answers 127.0.0.1, the address the
# certificate is for (scripts/local_cluster.sh, `up`).
LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
JOIN = ("import ray; ray.init(address='127.0.0.1:{port}', log_to_driver=False); "
        "print('JOINED', sum(n['Alive'] for n in ray.nodes()), flush=True)")


def _env(port: int, dash: int, **extra: str) -> dict:
    """This machine's environment without any Ray address or TLS setting of its own, for this cluster's ports."""
    env = {k: v for k, v in os.environ.items() if k not in tls.RAY_TLS_ENV and k not in ("RAY_ADDRESS", *LOOPBACK)}
    env.update({"RAYTRAIN_CLUSTER_PORT": str(port), "RAYTRAIN_CLUSTER_DASHBOARD_PORT": str(dash),
                "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0", **extra})
    return env


def _state(dash: int, what: str) -> list[dict]:
    """Rows of the dashboard's state API (plain HTTP with the token: the jobs API is not Ray's gRPC)."""
    token = (Path.home() / ".ray" / "auth_token").read_text().strip()
    req = urllib.request.Request(f"http://127.0.0.1:{dash}/api/v0/{what}?detail=1&limit=1000",
                                 headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())["data"]["result"]["result"]


def _key_body(path: str) -> str:
    """The first line of a PEM key's base64 body: 64 random characters no log would hold by chance."""
    return [line for line in Path(path).read_text().splitlines() if line and not line.startswith("-----")][0]


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory):
    import yaml

    d = tmp_path_factory.mktemp("tls-cluster")
    certs = tls.make(str(d / "certs"))
    cfg = yaml.safe_load((ROOT / "cluster" / "local-fake.yaml").read_text())
    cfg["max_workers"] = 1
    cfg["available_node_types"] = {
        "ray.head.default": {"resources": {"CPU": 2, "tlsw": 1}, "node_config": {}, "max_workers": 0},
        "tlsw": {"resources": {"CPU": 1, "tlsw": 1}, "node_config": {}, "min_workers": 1, "max_workers": 1},
    }
    config = d / "two-nodes.yaml"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    port, dash = free_port(), free_port()
    env = _env(port, dash, RAYTRAIN_CLUSTER_CONFIG=str(config))
    t0 = time.monotonic()
    up = subprocess.run([SCRIPT, "up", "--tls", str(d / "certs")], env=env, capture_output=True, text=True,
                        timeout=300)
    try:
        assert up.returncode == 0, (up.stdout + up.stderr)[-3000:]
        while sum(n["state"] == "ALIVE" for n in _state(dash, "nodes")) < 2:
            # Liveness guard only: the worker node joins within seconds of `up`.
            assert time.monotonic() - t0 < 180, f"the worker node did not join: {_state(dash, 'nodes')}"
            time.sleep(1)
        print(f"[test] TLS cluster with 2 nodes up in {time.monotonic() - t0:.0f}s")
        yield {"port": port, "dash": dash, "env": env, "certs": certs, "up": up.stdout + up.stderr,
               "state": Path(f"/tmp/raytrain-cluster-{port}")}
    finally:
        subprocess.run([SCRIPT, "down"], env=env, capture_output=True, timeout=120)


def _losses(run_uri: str) -> dict[int, float]:
    recs = [json.loads(x) for x in storage.read_text(storage.join(run_uri, "metrics.jsonl")).splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


@pytest.mark.slow
def test_two_worker_run_on_the_tls_cluster_trains_to_the_losses_without_tls(tls_cluster, reference_run, tiny_data,
                                                                            tmp_path):
    """`ray job submit` (the jobs API: HTTP with the token) of a 2-worker run, one worker per node, so the in-memory
    snapshot copies to the peer rank, Ray's object transfers and every control message go between nodes over TLS
    (the gradients' all-reduce is gloo's own TCP, not Ray's: docs/CLUSTERS.md); the session's reference run, trained
    in this process's Ray (no TLS), has its losses."""
    c = tls_cluster
    t0 = time.monotonic()
    log = tmp_path / "job.log"
    with open(log, "w") as out:
        job = subprocess.run([str(BIN / "ray"), "job", "submit", f"--address=http://127.0.0.1:{c['dash']}", "--",
                              "raytrain", "train", "--config", "tiny",
                              *tiny_overrides(tiny_data, tmp_path / "tls", "tls", *REFERENCE,
                                              "scaling.resources_per_worker={tlsw: 1}")],
                             env=c["env"], stdout=out, stderr=subprocess.STDOUT, timeout=600)
    assert job.returncode == 0, log.read_text()[-3000:]
    got = _losses(storage.join(str(tmp_path / "tls"), "tls"))
    want = _losses(reference_run["run_uri"])
    print(f"[test] TLS run: {time.monotonic() - t0:.0f}s")
    assert sorted(got) == sorted(want) == list(range(1, 13)), (got, want)
    for step in want:
        assert got[step] == pytest.approx(want[step], abs=1e-5), step
    # One training worker per node: their traffic crossed between the two nodes.
    workers = {a["node_id"] for a in _state(c["dash"], "actors") if "RayTrainWorker" in (a.get("class_name") or "")}
    assert len(workers) == 2, workers


@pytest.mark.slow
def test_a_process_without_the_clusters_certificates_cannot_join(tls_cluster, tmp_path):
    """ray.init from a process with the token but no certificate (plain gRPC), and from one with another CA's
    certificate: neither joins. With the cluster's certificates (what `local_cluster.sh env` exports) it joins and
    sees both nodes. Short connect timeouts: a refused process gives up in seconds."""
    c = tls_cluster
    other = tls.make(str(tmp_path / "other-ca"))
    cmd = [sys.executable, "-c", JOIN.format(port=c["port"])]
    base = _env(c["port"], c["dash"], **JOIN_ENV, **LOOPBACK)
    tries = {"no certificate": base,
             "another CA": {**base, **tls.ray_env(str(tmp_path / "other-ca"))},
             "the cluster's": {**base, **tls.ray_env(os.path.dirname(c["certs"]["server.crt"]))}}
    assert other["ca.crt"] != c["certs"]["ca.crt"]
    procs = {name: subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name, env in tries.items()}
    outs = {}
    for name, p in procs.items():
        try:
            outs[name] = (p.communicate(timeout=60)[0], p.returncode)
        except subprocess.TimeoutExpired:
            p.kill()
            outs[name] = (p.communicate()[0], None)  # a hang is a refusal too, but a slow one
    for name in ("no certificate", "another CA"):
        text, rc = outs[name]
        assert "JOINED" not in text and rc != 0, (name, text[-2000:])
    text, rc = outs["the cluster's"]
    assert rc == 0 and "JOINED 2" in text, text[-2000:]


@pytest.mark.slow
def test_env_prints_the_tls_paths_and_no_key_reaches_any_output_or_log(tls_cluster):
    c = tls_cluster
    out = subprocess.run([SCRIPT, "env"], env=c["env"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    exports = dict(kv.split("=", 1) for line in out.stdout.splitlines() for kv in line.split()[1:])
    want = {**tls.ray_env(os.path.dirname(c["certs"]["server.crt"])), **LOOPBACK}
    assert {k: exports.get(k) for k in want} == want, out.stdout
    assert exports["RAY_ADDRESS"] == f"http://127.0.0.1:{c['dash']}"
    needles = {name: _key_body(c["certs"][name]) for name in ("server.key", "ca.key")}
    for name, needle in needles.items():
        assert needle not in out.stdout + c["up"], name
    logs = [p for p in c["state"].rglob("*") if p.is_file() and not p.is_symlink()]
    assert len(logs) > 10, logs  # Ray's session logs of both nodes (the training job ran before this test)
    for p in logs:
        try:
            data = p.read_bytes()
        except OSError:
            continue
        for name, needle in needles.items():
            assert needle.encode() not in data, f"{name} in {p}"


def _up(tmp_path: Path, certs_dir: Path) -> subprocess.CompletedProcess:
    port, dash = free_port(), free_port()
    out = subprocess.run([SCRIPT, "up", "--tls", str(certs_dir)], env=_env(port, dash), capture_output=True,
                         text=True, timeout=300)
    out.state = Path(f"/tmp/raytrain-cluster-{port}")  # type: ignore[attr-defined]
    if out.returncode == 0:  # it should not have started; stop it so that a failing test leaves nothing behind
        subprocess.run([SCRIPT, "down"], env=_env(port, dash), capture_output=True, timeout=120)
    return out


def _bad(kind: str, tmp_path: Path) -> Path:
    d = tmp_path / kind
    if kind == "missing":
        d.mkdir()
        return d
    now = datetime.datetime.now(datetime.timezone.utc)
    if kind == "expired":
        tls.make(str(d), days=1, not_before=now - datetime.timedelta(days=3))
        return d
    if kind == "not for 127.0.0.1":
        tls.make(str(d), hosts=("ray-head.internal",))
        return d
    paths = tls.make(str(d))
    if kind == "unreadable" and os.geteuid() == 0:  # root reads a file of mode 000: a directory in its place
        os.unlink(paths["server.key"])
        os.mkdir(paths["server.key"])
    elif kind == "unreadable":
        os.chmod(paths["server.key"], 0)
    elif kind == "mismatched key":
        other = tls.make(str(tmp_path / "other"))
        os.replace(other["server.key"], paths["server.key"])
    return d


@pytest.mark.parametrize("kind, says", [
    ("missing", r"certificate .*/server\.crt does not exist"),
    ("unreadable", r"key .*/server\.key cannot be read"),
    ("mismatched key", r"key .*/server\.key does not match the certificate"),
    ("expired", r"certificate .*/server\.crt expired on"),
    ("not for 127.0.0.1", r"certificate .*/server\.crt is not for 127\.0\.0\.1"),
])
def test_bad_certificates_stop_up_in_one_line_before_anything_starts(kind, says, tmp_path):
    import re

    out = _up(tmp_path, _bad(kind, tmp_path))
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, (out.returncode, out.stdout, out.stderr)
    assert lines[0].startswith("local_cluster.sh: ") and re.search(says, lines[0]), lines[0]
    assert "[cluster] starting" not in out.stdout and not out.state.exists(), out.stdout
