"""Cluster configs stay valid and pinned: every cluster/*.yaml against Ray's own launcher schema (shipped
in the ray wheel), the KubeRay manifests against the vendored CRDs' openAPIV3Schema, and every Ray /
DeepSpeed / torch version named in cluster/ equal to the pins in pyproject.toml. Fast: no cluster starts.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "cluster"
CRDS = CLUSTER / "kuberay" / "crds"
LAUNCHER_CONFIGS = sorted(CLUSTER.glob("*.yaml"))
KUBERAY = {"raycluster.yaml": "ray.io_rayclusters.yaml", "rayjob.yaml": "ray.io_rayjobs.yaml"}
# Every file in cluster/ that names versions: configs, manifests, the image recipe.
VERSIONED = LAUNCHER_CONFIGS + [CLUSTER / "kuberay" / n for n in KUBERAY] + [CLUSTER / "kuberay" / "Dockerfile"]


def _pins() -> dict[str, str]:
    """{'ray': '==2.60.0', 'deepspeed': '==0.19.8', 'torch': '>=2.13,<2.15'} from pyproject.toml."""
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    out = {}
    for dep in deps:
        m = re.match(r"^([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*(.*)$", dep)
        out[m.group(1).lower()] = m.group(3).replace(" ", "")
    return out


def _ray_schema() -> dict:
    import ray.autoscaler

    return json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())


@functools.lru_cache(maxsize=None)
def _crd_schema(crd_file: str, version: str) -> dict:
    # The CRDs are ~1 MB each: parse them once, with libyaml where present.
    crd = yaml.load((CRDS / crd_file).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            return v["schema"]["openAPIV3Schema"]
    raise AssertionError(f"{crd_file} has no version {version}")


def test_the_expected_configs_exist():
    names = {p.name for p in LAUNCHER_CONFIGS}
    assert {"aws-spot.yaml", "gcp-spot.yaml", "local-fake.yaml"} <= names, names
    for f in VERSIONED:
        assert f.is_file(), f


@pytest.mark.parametrize("path", LAUNCHER_CONFIGS, ids=lambda p: p.name)
def test_launcher_config_matches_rays_schema(path):
    cfg = yaml.safe_load(path.read_text())
    jsonschema.validate(cfg, _ray_schema())
    # What the schema cannot say but `ray up` needs: the head type exists, worker types have bounds.
    types = cfg["available_node_types"]
    assert cfg["head_node_type"] in types
    for name, t in types.items():
        if name != cfg["head_node_type"]:
            assert 0 <= t.get("min_workers", 0) <= t["max_workers"] <= cfg["max_workers"], name


@pytest.mark.parametrize("path", [p for p in LAUNCHER_CONFIGS if p.name != "local-fake.yaml"], ids=lambda p: p.name)
def test_cloud_configs_are_spot_clusters_with_closed_dashboard(path):
    text = path.read_text()
    cfg = yaml.safe_load(text)
    types = cfg["available_node_types"]
    head = types[cfg["head_node_type"]]
    workers = {n: t for n, t in types.items() if n != cfg["head_node_type"]}
    spot = [n for n, t in workers.items() if t["resources"].get("spot")]
    ondemand = [n for n, t in workers.items() if t["resources"].get("ondemand")]
    assert len(spot) >= 2 and len(ondemand) >= 1, (spot, ondemand)
    gpu_spot = [n for n in spot if workers[n]["resources"].get("GPU")]
    assert gpu_spot and all(workers[n]["min_workers"] == 0 for n in gpu_spot), "spot GPU workers scale from zero"
    # A CPU-only data node type (data.reader=ray's tasks go where the `data` resource is), always at least one.
    data = [t for t in workers.values() if t["resources"].get("data")]
    assert data and all(t["min_workers"] >= 1 and not t["resources"].get("GPU") for t in data), data
    assert "spot" not in json.dumps(head["node_config"]).lower().replace("spot-", ""), "the head is on-demand"
    assert cfg["idle_timeout_minutes"] > 0
    assert "--dashboard-host=0.0.0.0" not in text and "--dashboard-host=127.0.0.1" in text
    assert "RAY_AUTH_MODE=token" in text
    if cfg["provider"]["type"] == "aws":
        for n in spot:
            assert workers[n]["node_config"]["InstanceMarketOptions"]["MarketType"] == "spot"
        assert len({workers[n]["node_config"]["InstanceType"] for n in spot}) >= 2
        rules = cfg["provider"]["security_group"]["IpPermissions"]
        assert [(r["FromPort"], r["ToPort"]) for r in rules] == [(22, 22)], "only SSH is open"
        assert all(ip["CidrIp"] != "0.0.0.0/0" for r in rules for ip in r["IpRanges"])
        assert "IamInstanceProfile" in head["node_config"]
    else:
        for n in spot:
            assert workers[n]["node_config"]["scheduling"]["provisioningModel"] == "SPOT"


def _run_signing(cmd: str, tmp_path: Path, paths: dict[str, str], env: dict[str, str] | None = None) -> Path:
    """A node's certificate-signing command from a config, run here: the config's CA directory replaced by a CA made
    with raytrain.tls.make, its certificate directory by a temporary one. Returns that directory."""
    import os
    import subprocess
    import sys

    from raytrain import tls

    tls.make(str(tmp_path / "ca"))
    for old, new in ((paths["ca"], str(tmp_path / "ca")), (paths["out"], str(tmp_path / "node"))):
        assert old in cmd, (old, cmd)
        cmd = cmd.replace(old, new)
    run_env = {**os.environ, **(env or {}), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    out = subprocess.run(["/bin/sh", "-c", cmd], env=run_env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "PRIVATE KEY" not in out.stdout + out.stderr  # paths only
    node = tmp_path / "node"
    tls.check_pair(str(node / "server.crt"), str(node / "server.key"), "test", ca=str(node / "ca.crt"))
    return node


TLS_ENV_NAMES = ("RAY_USE_TLS", "RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT")


def _tls_env_ok(env: dict[str, str]) -> str:
    """The four RAY_* TLS variables, naming server.crt / server.key / ca.crt of one directory; returns it."""
    assert set(env) >= set(TLS_ENV_NAMES) and env["RAY_USE_TLS"] == "1", env
    d = env["RAY_TLS_SERVER_CERT"].rsplit("/", 1)[0]
    assert (env["RAY_TLS_SERVER_CERT"], env["RAY_TLS_SERVER_KEY"], env["RAY_TLS_CA_CERT"]) == (
        f"{d}/server.crt", f"{d}/server.key", f"{d}/ca.crt"), env
    return d


def _sh(cmd: str, env: dict[str, str]) -> str:
    import os
    import subprocess
    import sys

    run_env = {**os.environ, **env, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    out = subprocess.run(["/bin/sh", "-c", cmd], env=run_env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, (cmd, out.stdout + out.stderr)
    assert "PRIVATE KEY" not in out.stdout + out.stderr  # paths only
    return out.stdout


@pytest.mark.parametrize("path", [p for p in LAUNCHER_CONFIGS if p.name != "local-fake.yaml"], ids=lambda p: p.name)
def test_cloud_configs_keep_the_ca_key_on_the_head_and_workers_get_certificates_from_its_signer(path, tmp_path,
                                                                                                 s3_server):
    """Every process in every node's container has Ray's TLS settings (docker run options). Only the CA certificate
    goes to every node (file_mounts); the head reads the CA key from the cloud's secret store, signs its own
    certificate and starts the signer once (a second start finds it); a worker asks the signer for its certificate
    and never sees the CA key. The head's and a worker's commands, run here (the AWS secret on the S3 server's
    Secrets Manager; the GCP secret read is not run: the key is put where it would write it), give a worker a
    certificate the CA verifies, for this machine's address."""
    import os
    import shutil
    import signal

    import boto3

    from raytrain import tls
    from tests.helpers import free_port

    cfg = yaml.safe_load(path.read_text())
    env = dict(o.split(None, 1)[1].split("=", 1) for o in cfg["docker"]["run_options"] if o.startswith("--env "))
    cert_dir = _tls_env_ok(env)
    assert not [k for k in cfg["file_mounts"] if k.endswith(".key") or "key" in str(cfg["file_mounts"][k])]
    (ca_crt,) = [k for k in cfg["file_mounts"] if k.endswith("/ca.crt")]
    ca_dir = ca_crt.rsplit("/", 1)[0]
    head, worker = cfg["head_start_ray_commands"], cfg["worker_start_ray_commands"]
    for cmds in (cfg["setup_commands"], cfg["worker_setup_commands"], worker):
        assert not [c for c in cmds if "ca.key" in c or "fetch-key" in c or "tls node" in c], cmds
    at = {k: next(i for i, c in enumerate(head) if k in c) for k in ("fetch-key", "tls node", "--detach", "ray start")}
    assert at["fetch-key"] < at["tls node"] < at["--detach"] < at["ray start"], head
    assert next(i for i, c in enumerate(worker) if "tls_signer request" in c) < next(
        i for i, c in enumerate(worker) if "ray start" in c)

    laptop = tls.make(str(tmp_path / "laptop"))  # what scripts/tls_certs.sh makes
    port, token = free_port(), "cluster-token"
    run_env = {"RAY_AUTH_TOKEN": token, "AWS_DEFAULT_REGION": "us-west-2"}  # an EC2 head: its metadata's region

    def on(node: str, cmd: str) -> str:
        # (the signer's folder first: the certificates' folder is a prefix of its name)
        for old, new in (("/home/ray/tls-signer", f"{tmp_path}/{node}/signer"), (ca_dir, f"{tmp_path}/{node}/tls-ca"),
                         (cert_dir, f"{tmp_path}/{node}/tls"), ("8477", str(port)),
                         ("$RAY_HEAD_IP", "127.0.0.1")):
            cmd = cmd.replace(old, new)
        return cmd

    for node in ("head", "worker"):  # file_mounts: the CA certificate only
        os.makedirs(tmp_path / node / "tls-ca")
        shutil.copy(laptop["ca.crt"], tmp_path / node / "tls-ca" / "ca.crt")
    fetch = head[at["fetch-key"]]
    if "aws-secretsmanager://" in fetch:
        name = fetch.split("aws-secretsmanager://", 1)[1].split()[0]
        boto3.client("secretsmanager", region_name="us-west-2").create_secret(Name=name, SecretString=Path(laptop["ca.key"]).read_text())
        _sh(on("head", fetch), run_env)
    else:
        assert "gcp-secretmanager://projects/" in fetch and fetch.rstrip().endswith(f"{ca_dir}/ca.key"), fetch
        shutil.copy(laptop["ca.key"], tmp_path / "head" / "tls-ca" / "ca.key")
    assert (tmp_path / "head" / "tls-ca" / "ca.key").stat().st_mode & 0o777 == 0o600
    _sh(on("head", head[at["tls node"]]), run_env)
    pid_file = tmp_path / "head" / "signer" / "signer.pid"
    try:
        assert "started" in _sh(on("head", head[at["--detach"]]), run_env)
        assert "already running" in _sh(on("head", head[at["--detach"]]), run_env)  # `ray up` again: no second one
        request = next(c for c in worker if "tls_signer request" in c)
        _sh(on("worker", request), run_env)
    finally:  # (the test fails if the signer's pid file is not where the config says)
        os.kill(int(pid_file.read_text()), signal.SIGTERM)
    node = tmp_path / "worker" / "tls"
    tls.check_pair(str(node / "server.crt"), str(node / "server.key"), "test", ca=laptop["ca.crt"])
    assert tls.names_of(tls.load_certificate(str(node / "server.crt"), "test"))[0] == "127.0.0.1"
    assert (node / "server.key").stat().st_mode & 0o777 == 0o600
    assert not list((tmp_path / "worker").rglob("ca.key"))


@pytest.mark.parametrize("manifest", sorted(KUBERAY), ids=str)
def test_kuberay_only_the_head_pod_holds_the_ca_key_and_worker_pods_get_certificates_from_its_signer(manifest,
                                                                                                   tmp_path):
    """Every pod (head and each worker group) and the autoscaler sidecar run Ray with TLS, the pod's certificate in an
    in-memory volume the Ray container mounts read-only. Only the head pod mounts the CA key's Secret (its init
    container and the signer); worker pods mount the CA certificate only and ask the signer. The head's init command,
    the signer's and a worker's, run here: the head's certificate names the head service exactly (no wildcard), and
    the worker gets one from the signer."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time

    from raytrain import tls
    from tests.helpers import free_port

    doc = yaml.safe_load((CLUSTER / "kuberay" / manifest).read_text())
    spec = doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]
    auto = spec["autoscalerOptions"]
    cert_dir = _tls_env_ok({e["name"]: e["value"] for e in auto["env"]})
    assert any(m["mountPath"] == cert_dir and m["readOnly"] for m in auto["volumeMounts"])
    token_secret = spec["authOptions"]["secretName"]
    inits = {}
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        head = group is spec["headGroupSpec"]
        pod = group["template"]["spec"]
        vols = {v["name"]: v for v in pod["volumes"]}
        secrets = {n for n, v in vols.items() if "secret" in v}
        assert bool(secrets) == head, (head, secrets)  # the CA key's Secret: the head pod's only
        (init,) = pod["initContainers"]
        ray_container = pod["containers"][0]
        assert _tls_env_ok({e["name"]: e["value"] for e in ray_container["env"]}) == cert_dir
        (mount,) = [m for m in ray_container["volumeMounts"] if m["mountPath"] == cert_dir]
        assert mount["readOnly"] and vols[mount["name"]]["emptyDir"]["medium"] == "Memory"
        assert not [m for m in ray_container.get("volumeMounts", []) if m["name"] in secrets]
        init_mounts = {m["mountPath"]: m["name"] for m in init["volumeMounts"]}
        assert init_mounts[cert_dir] == mount["name"], init_mounts
        inits.setdefault("head" if head else "worker", []).append(init)
        if head:
            (signer,) = [c for c in pod["containers"] if "raytrain.tls_signer" in c.get("command", [])]
            assert {"containerPort": 8477, "name": "tls-signer"} in ray_container["ports"]  # the head service's
        else:
            assert "tls_signer request" in init["command"][-1] and "configMap" in vols[
                [n for p, n in init_mounts.items() if p != cert_dir][0]]
            assert {"name": "RAY_AUTH_TOKEN", "valueFrom": {"secretKeyRef": {"name": token_secret, "key": "auth_token"}}} in init["env"]
    assert all(i == inits["worker"][0] for i in inits["worker"])
    (head_init,) = inits["head"]
    pod_env = {"POD_IP": "127.0.0.1", "POD_NAMESPACE": "ml", "RAY_CLUSTER": "raytrain", "RAY_AUTH_TOKEN": "t0ken"}
    ca_dir = [p for p in (m["mountPath"] for m in head_init["volumeMounts"]) if p != cert_dir][0]
    laptop = tls.make(str(tmp_path / "laptop"))
    (tmp_path / "head-ca").mkdir()
    for f in ("ca.crt", "ca.key"):
        (tmp_path / "head-ca" / f).write_bytes(Path(laptop[f]).read_bytes())

    def on(node: str, cmd: str) -> str:
        return cmd.replace(ca_dir, str(tmp_path / "head-ca")).replace(cert_dir, str(tmp_path / node / "tls"))

    _sh(on("head", head_init["command"][-1]), pod_env)
    head_crt = str(tmp_path / "head" / "tls" / "server.crt")
    tls.check_hosts(head_crt, ["127.0.0.1", "raytrain-head-svc", "raytrain-head-svc.ml.svc",
                               "raytrain-head-svc.ml.svc.cluster.local"], "test")
    with pytest.raises(tls.UserError, match="is not for another-pod.ml.svc"):  # no wildcard: exact names only
        tls.check_hosts(head_crt, ["another-pod.ml.svc"], "test")
    port = free_port()
    argv = [on("head", a) for a in signer["command"]]
    argv[argv.index("8477")] = str(port)
    assert argv[:3] == ["python", "-m", "raytrain.tls_signer"]
    proc = subprocess.Popen([sys.executable, *argv[1:]], env={**os.environ, **pod_env}, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "the signer did not start"
                time.sleep(0.2)
        worker_cmd = inits["worker"][0]["command"][-1]
        url_host = "$RAY_CLUSTER-head-svc.$POD_NAMESPACE.svc"  # raytrain-head-svc.ml.svc: named in the head's certificate
        assert url_host in worker_cmd
        (tmp_path / "worker-ca").mkdir()
        (tmp_path / "worker-ca" / "ca.crt").write_bytes(Path(laptop["ca.crt"]).read_bytes())
        worker_ca = [m["mountPath"] for m in inits["worker"][0]["volumeMounts"] if m["mountPath"] != cert_dir][0]
        cmd = on("worker", worker_cmd.replace(worker_ca, str(tmp_path / "worker-ca")).replace(url_host, "127.0.0.1")
                 .replace(":8477", f":{port}"))
        _sh(cmd, pod_env)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    node = tmp_path / "worker" / "tls"
    tls.check_pair(str(node / "server.crt"), str(node / "server.key"), "test", ca=laptop["ca.crt"])
    assert not list((tmp_path / "worker").rglob("ca.key"))


def test_local_fake_config_has_a_spot_type_that_scales_from_zero():
    cfg = yaml.safe_load((CLUSTER / "local-fake.yaml").read_text())
    assert cfg["provider"]["type"] == "fake_multinode"
    assert cfg["head_node_type"] == "ray.head.default"  # the name the fake provider gives its head
    spot = cfg["available_node_types"]["spot"]
    assert spot["min_workers"] == 0 and spot["max_workers"] >= 2 and spot["resources"]["spot"] == 1
    assert "spot" not in cfg["available_node_types"]["ray.head.default"]["resources"]
    data = cfg["available_node_types"]["data"]
    assert data["min_workers"] >= 1 and data["resources"]["data"] > 0 and "spot" not in data["resources"]


def test_iam_policies_are_least_privilege():
    worker = json.loads((CLUSTER / "iam" / "raytrain-worker-s3-policy.json").read_text())
    head = json.loads((CLUSTER / "iam" / "raytrain-head-policy.json").read_text())
    for doc in (worker, head):
        for st in doc["Statement"]:
            actions = st["Action"] if isinstance(st["Action"], list) else [st["Action"]]
            if st["Effect"] == "Deny":  # a wildcard takes away: the TLS-only rule covers every S3 action
                assert st["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}, st
                continue
            assert not any(a.endswith("*") for a in actions), st  # no s3:* / ec2:* wildcards granted
    for st in worker["Statement"]:
        assert all(a.startswith("s3:") for a in st["Action"]), st
        res = st["Resource"] if isinstance(st["Resource"], list) else [st["Resource"]]
        assert all(r.startswith("arn:aws:s3:::YOUR-BUCKET") for r in res), st
    passrole = [st for st in head["Statement"] if "iam:PassRole" in st["Action"]]
    assert passrole and all("*" not in r for st in passrole for r in st["Resource"])


@pytest.mark.parametrize("manifest", sorted(KUBERAY), ids=str)
def test_kuberay_manifest_matches_crd(manifest):
    doc = yaml.safe_load((CLUSTER / "kuberay" / manifest).read_text())
    api, version = doc["apiVersion"].split("/")
    assert api == "ray.io"
    jsonschema.validate(doc, _crd_schema(KUBERAY[manifest], version))
    spec = doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]
    assert spec["enableInTreeAutoscaling"] is True and spec["authOptions"]["mode"] == "token"
    spot_groups = [g for g in spec["workerGroupSpecs"] if g.get("resources", {}).get("spot")]
    data_groups = [g for g in spot_groups if g["resources"].get("data")]
    assert spot_groups and all(g["minReplicas"] == 0 for g in spot_groups if g not in data_groups)
    # the data pods (RayCluster and RayJob): CPU only, at least one
    assert data_groups and all(g["minReplicas"] >= 1 and "nvidia.com/gpu" not in json.dumps(g) for g in data_groups)
    for g in spot_groups:
        pod = g["template"]["spec"]
        assert pod["nodeSelector"]["cloud.google.com/gke-spot"] == "true"
        assert any(t["key"] == "cloud.google.com/gke-spot" for t in pod["tolerations"])
    if doc["kind"] == "RayJob":
        assert doc["spec"]["entrypoint"].startswith("raytrain train ")


def test_kuberay_validation_catches_a_bad_manifest():
    doc = yaml.safe_load((CLUSTER / "kuberay" / "raycluster.yaml").read_text())
    doc["spec"]["workerGroupSpecs"][0]["minReplicas"] = "zero"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, _crd_schema("ray.io_rayclusters.yaml", "v1"))


def test_vendored_crds_match_the_shared_copies():
    shared = ROOT.parent / "shared" / "schemas" / "kuberay"
    if not shared.is_dir():
        pytest.skip(f"{shared} is not here (a clean clone); the vendored CRDs are used as they are")
    for name in KUBERAY.values():
        assert (CRDS / name).read_bytes() == (shared / name).read_bytes(), name


def _versions_named(text: str) -> dict[str, set[str]]:
    """Every version of ray / deepspeed / torch a config, manifest or Dockerfile names."""
    found: dict[str, set[str]] = {"ray": set(), "deepspeed": set(), "torch": set()}
    for m in re.finditer(r"rayproject/ray:(\d+\.\d+\.\d+)", text):
        found["ray"].add("==" + m.group(1))
    for m in re.finditer(r"rayVersion:\s*\"?(\d+\.\d+\.\d+)", text):
        found["ray"].add("==" + m.group(1))
    for m in re.finditer(r"-ray(\d+\.\d+\.\d+)\b", text):  # our image tags: raytrain:0.1.0-ray2.60.0
        found["ray"].add("==" + m.group(1))
    for m in re.finditer(r"[\"'\s](ray|deepspeed|torch)(\[[^\]]*\])?((?:[=<>!~]=?[\w.]+,?)+)", text):
        found[m.group(1)].add(m.group(3))
    return found


@pytest.mark.parametrize("path", VERSIONED, ids=lambda p: p.name)
def test_versions_equal_pyproject_pins(path):
    pins = _pins()
    named = _versions_named(path.read_text())
    for pkg, versions in named.items():
        for v in versions:
            assert v == pins[pkg], f"{path.name} names {pkg}{v} but pyproject.toml pins {pkg}{pins[pkg]}"
    if path.name != "local-fake.yaml":  # the fake cluster runs this machine's own .venv
        assert named["ray"], f"{path.name} names no Ray version"


def test_version_check_catches_drift():
    pins = _pins()
    assert pins["ray"].startswith("==")
    drifted = _versions_named('image: rayproject/ray:2.9.3-py311-gpu\n pip install "ray[default]==2.9.3" "deepspeed==0.14.0"')
    assert drifted["ray"] == {"==2.9.3"} != {pins["ray"]}
    assert drifted["deepspeed"] == {"==0.14.0"}


@pytest.mark.parametrize("manifest", sorted(KUBERAY), ids=str)
def test_kuberay_drain_timeout_is_below_every_pods_grace_period(manifest):
    """A pod's SIGTERM drains its Ray node for RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S (Ray's default 30 s): below the
    pod's terminationGracePeriodSeconds (Kubernetes' default 30 s) with a margin, or the SIGKILL comes first."""
    doc = yaml.safe_load((CLUSTER / "kuberay" / manifest).read_text())
    spec = doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        pod = group["template"]["spec"]
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        drain = float(env.get("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", 30))
        assert drain + 3 <= pod.get("terminationGracePeriodSeconds", 30), (group.get("groupName", "head"), drain)
