"""The shipped IAM policies (cluster/iam/) under enforcement: an S3 server that checks every request against them,
one user per role holding exactly the shipped policy; and an IAM linter (parliament) over the files.

The server is a moto process of this module's own (the session `s3_server` stays without auth for the other
tests): set up without auth, then switched to enforce every request (INITIAL_NO_AUTH_ACTION_COUNT = 0, through
moto's reset-auth endpoint). What moto's enforcement cannot express is adapted in `for_moto`, each case named.
"""

from __future__ import annotations

import contextlib
import importlib.resources
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import types
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Optional
from urllib.parse import parse_qs

import pytest
import yaml

from raytrain import storage
from raytrain.cli import main
from tests.helpers import start_moto

ROOT = Path(__file__).resolve().parents[1]
IAM = ROOT / "cluster" / "iam"
BUCKET = "raytrain-iam"
POLICIES = {"head": "raytrain-head-policy.json", "worker": "raytrain-worker-s3-policy.json",
            "kuberay": "raytrain-kuberay-s3-policy.json"}
# The one finding above LOW that the autoscaler needs: the head passes the worker role to the instances it launches.
ACCEPTED = {"iam:passrole", "ec2:runinstances"}


def shipped(name: str, bucket: str = BUCKET) -> dict:
    return json.loads((IAM / POLICIES[name]).read_text().replace("YOUR-BUCKET", bucket))


def for_moto(policy: dict) -> dict:
    """The policy as moto 5.2 can enforce it. Two gaps, both in how moto authorises, not in the policy:
    - moto authorises HeadBucket as `s3:HeadBucket`, an action AWS does not have (AWS authorises HeadBucket by
      s3:ListBucket): wherever s3:ListBucket is granted, s3:HeadBucket is granted with it;
      (a ListBucket statement with a plain `StringLike` on `s3:prefix` does not allow HeadBucket on AWS, which
      sends no prefix; `...IfExists` does: so it is granted only where AWS would grant it);
    - moto passes no request context to conditions, so a condition on `s3:prefix` always fails (and moto then
      denies outright): the worker's ListBucket statement is enforced without its prefix condition, and the
      test checks every prefix raytrain listed against the condition's patterns instead (`listed_prefixes`).
    - moto evaluates no `aws:SecureTransport` condition (it takes a conditional Deny as unconditional, refusing
      everything): the TLS-only statement is left out here and checked over the documents instead
      (test_every_s3_policy_refuses_requests_without_tls).
    - nor the `s3:if-none-match` condition of the audit writes (it would deny every one): they are enforced without
      it, the server itself answers a conditional write that finds its object with 412, and the condition is checked
      over the documents (tests/test_audit_verify.py).
    Statements on other services (ec2, iam) never match an S3 request and are kept as they are."""
    out = json.loads(json.dumps(policy))
    out["Statement"] = [st for st in out["Statement"]
                        if "aws:SecureTransport" not in json.dumps(st.get("Condition", {}))]
    for st in out["Statement"]:
        if st.get("Condition", {}).get("Null", {}).pop("s3:if-none-match", None) is not None:
            st["Condition"] = {op: keys for op, keys in st["Condition"].items() if keys}
            if not st["Condition"]:
                del st["Condition"]
    for st in out["Statement"]:
        actions = [st["Action"]] if isinstance(st["Action"], str) else st["Action"]
        if "s3:ListBucket" in actions:
            if all(op.endswith("IfExists") for op, keys in st.get("Condition", {}).items() if "s3:prefix" in keys):
                st["Action"] = [*actions, "s3:HeadBucket"]
            cond = st.get("Condition", {})
            for op in list(cond):
                cond[op].pop("s3:prefix", None)
                if not cond[op]:
                    del cond[op]
            if not cond:
                st.pop("Condition", None)
    return out


def without(policy: dict, sid: str) -> dict:
    out = json.loads(json.dumps(policy))
    out["Statement"] = [st for st in out["Statement"] if st.get("Sid") != sid]
    assert len(out["Statement"]) == len(policy["Statement"]) - 1, sid
    return out


class IamS3:
    """The enforcing server: its endpoint and, per user, the AWS variables that act as that user."""

    def __init__(self, users: dict[str, dict]):
        import boto3
        import requests

        self.log = tempfile.NamedTemporaryFile(prefix="moto-iam-", suffix=".log")
        self.proc, self.endpoint = start_moto(self.log.name)  # its request log: the prefixes listed
        setup = {"endpoint_url": self.endpoint, "region_name": "us-east-1", "aws_access_key_id": "setup",
                 "aws_secret_access_key": "setup"}
        boto3.client("s3", **setup).create_bucket(Bucket=BUCKET)
        iam = boto3.client("iam", **setup)
        self.env: dict[str, dict[str, str]] = {}
        for name, policy in {"admin": _allow_all_s3(), **users}.items():
            iam.create_user(UserName=name)
            iam.put_user_policy(UserName=name, PolicyName=name, PolicyDocument=json.dumps(policy))
            key = iam.create_access_key(UserName=name)["AccessKey"]
            self.env[name] = {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
                              "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"], "AWS_REGION": "us-east-1",
                              "AWS_EC2_METADATA_DISABLED": "true"}
        # From now on every request is authenticated and checked against its user's policy.
        requests.post(f"{self.endpoint}/moto-api/reset-auth", data=b"0", timeout=10).raise_for_status()

    @contextlib.contextmanager
    def acting_as(self, user: str):
        """This process's storage calls as `user` (boto3's default session caches credentials: a fresh one)."""
        import boto3

        old = {k: os.environ.get(k) for k in self.env[user]}
        old_session, boto3.DEFAULT_SESSION = boto3.DEFAULT_SESSION, None
        os.environ.update(self.env[user])
        try:
            yield
        finally:
            boto3.DEFAULT_SESSION = old_session
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def keys(self, prefix: str = "") -> list[str]:
        import boto3

        env = self.env["admin"]
        s3 = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                          aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
        pages = s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        return [o["Key"] for page in pages for o in page.get("Contents", [])]

    def listed_prefixes(self) -> list[Optional[str]]:
        """The `prefix` of every ListObjects request the server has answered (None: listed without one), from its
        request log: what the worker's `s3:prefix` condition would be asked about."""
        out = []
        for query in re.findall(rf'"GET /{BUCKET}/?\?(\S*) HTTP', Path(self.log.name).read_text()):
            q = parse_qs(query, keep_blank_values=True)
            if not set(q) & {"uploads", "location", "uploadId"}:
                out.append(q["prefix"][0] if "prefix" in q else None)
        return out

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self.log.close()


def _allow_all_s3() -> dict:
    return {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}


@pytest.fixture(scope="module")
def iam_s3():
    server = IamS3({"head": for_moto(shipped("head")), "worker": for_moto(shipped("worker")),
                    "kuberay": for_moto(shipped("kuberay")),
                    "head-no-data-writes": for_moto(without(shipped("head"), "DriverWritesPreparedData")),
                    "worker-no-run-writes": for_moto(without(shipped("worker"), "ReadWriteRunsCheckpointsAndRetention"))})
    yield server
    server.close()


def _parliament():
    """parliament 1.6.4 imports pkg_resources for two file paths, and setuptools >= 81 no longer ships it:
    a stand-in module answers them from importlib.resources (nothing installed, no setuptools pin)."""
    if "pkg_resources" not in sys.modules:
        try:
            import pkg_resources  # noqa: F401 - an older setuptools: use it
        except ImportError:
            shim = types.ModuleType("pkg_resources")
            shim.resource_filename = lambda pkg, name: str(importlib.resources.files(pkg) / name)
            sys.modules["pkg_resources"] = shim
    parliament = pytest.importorskip("parliament")
    parliament.override_config(str(importlib.resources.files("parliament") / "community_auditors" / "config_override.yaml"))
    return parliament


def test_linter_finds_nothing_above_low_but_the_documented_pair():
    parliament = _parliament()
    levels = ["MUTE", "INFO", "LOW", "MEDIUM", "HIGH", "CRITICAL"]
    above_low = []
    for f in sorted(IAM.glob("*.json")):
        policy = parliament.analyze_policy_string(f.read_text(), str(f), include_community_auditors=True)
        assert policy.findings is not None
        for finding in map(parliament.enhance_finding, policy.findings):
            actions = {a.lower() for a in (finding.location or {}).get("actions", [])}
            if levels.index(finding.severity) > levels.index("LOW") and not (actions and actions <= ACCEPTED):
                above_low.append((f.name, finding.severity, finding.issue, finding.detail))
            if actions and actions <= ACCEPTED:
                assert f.name == POLICIES["head"], finding.issue  # only the head may launch with the worker role
    assert not above_low
    assert "iam:PassRole" in (IAM / "README.md").read_text()


def test_every_s3_policy_refuses_requests_without_tls():
    """Each shipped policy denies every S3 action on the bucket and its objects over plain HTTP (moto cannot enforce
    the condition: checked here, on the documents), and that statement is the only Deny."""
    for name in POLICIES:
        policy = shipped(name)
        denies = [st for st in policy["Statement"] if st["Effect"] == "Deny"]
        assert len(denies) == 1, name
        (st,) = denies
        assert st["Action"] == ["s3:*"] and st["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}, name
        assert set(st["Resource"]) == {f"arn:aws:s3:::{BUCKET}", f"arn:aws:s3:::{BUCKET}/*"}, name
        assert st not in for_moto(policy)["Statement"]


def _statements(policy: dict, action: str) -> list[dict]:
    return [st for st in policy["Statement"]
            if action in ([st["Action"]] if isinstance(st["Action"], str) else st["Action"])]


def test_policies_scope_what_the_issue_named():
    for name in ("head", "worker", "kuberay"):
        (loc,) = _statements(shipped(name), "s3:GetBucketLocation")
        assert loc["Action"] == ["s3:GetBucketLocation"] and "Condition" not in loc  # a statement of its own
    cluster = yaml.safe_load((ROOT / "cluster" / "aws-spot.yaml").read_text())["cluster_name"]
    for action in ("ec2:TerminateInstances", "ec2:StopInstances", "ec2:StartInstances"):
        (st,) = _statements(shipped("head"), action)
        assert st["Condition"] == {"StringEquals": {"ec2:ResourceTag/ray-cluster-name": cluster}}
        assert st["Resource"].endswith(":instance/*")
    (write,) = _statements(shipped("worker"), "s3:PutObject")[:1]
    assert write["Resource"] == f"arn:aws:s3:::{BUCKET}/data/*"  # prepare's Ray workers write the shards
    # KubeRay pods (driver and workers) share one service account: the head's S3 statements, no EC2.
    assert [st for st in shipped("head")["Statement"] if st["Action"][0].startswith("s3:")] == shipped("kuberay")["Statement"]
    sa = yaml.safe_load((ROOT / "cluster" / "kuberay" / "serviceaccount.yaml").read_text())
    assert sa["kind"] == "ServiceAccount" and sa["metadata"]["name"] == "raytrain"
    assert "eks.amazonaws.com/role-arn" in sa["metadata"]["annotations"]


@pytest.mark.parametrize("error, action, arn", [
    ("When initiating multiple part upload for key 'k' in bucket 'b': AWS Error ACCESS_DENIED during "
     "CreateMultipartUpload operation: Access Denied", "s3:PutObject", "arn:aws:s3:::raytrain-iam/runs/x/k"),
    ("When listing objects under key 'x' in bucket 'b': AWS Error ACCESS_DENIED during ListObjectsV2 operation: "
     "Access Denied", "s3:ListBucket", "arn:aws:s3:::raytrain-iam"),
    ("An error occurred (403) when calling the HeadObject operation: Forbidden", "s3:GetObject",
     "arn:aws:s3:::raytrain-iam/runs/x/k"),
], ids=["multipart", "list", "boto3-head"])
def test_refusals_name_the_action_to_grant(error, action, arn):
    msg = str(storage.access_denied(f"s3://{BUCKET}/runs/x/k", OSError(error)))
    assert msg.startswith(f"access denied: {action} on s3://{BUCKET}/runs/x/k: ") and f"allows {action} on {arn} " in msg
    assert storage.access_denied("s3://b/k", OSError("AWS Error NETWORK_CONNECTION during GetObject")) is None
    assert storage.access_denied("/local/path", PermissionError("Access Denied")) is None


def test_train_names_a_refusal_of_ray_trains_own_storage_calls():
    from raytrain.trainer import failure_line

    ray_error = RuntimeError("The actor died because of an error raised in its creation task\n  File x\nOSError: When "
                             "testing for existence of bucket 'b': AWS Error ACCESS_DENIED during HeadBucket operation: "
                             "No response body.")
    line = failure_line(ray_error, f"s3://{BUCKET}/runs/r")
    assert line.startswith(f"access denied: s3:ListBucket on s3://{BUCKET}/runs/r: ") and len(line.splitlines()) == 1
    assert failure_line(RuntimeError("boom"), f"s3://{BUCKET}/runs/r") is None


def test_prepare_in_process_under_the_head_and_kuberay_roles(iam_s3, corpus_dir, capsys):
    for user in ("head", "kuberay"):
        out = f"s3://{BUCKET}/data/{user}"
        with iam_s3.acting_as(user):
            assert main(["prepare", f"inputs=[{corpus_dir}]", f"out={out}", "vocab_size=300", "seq_len=32",
                         "shard_rows=64", "near_dup_threshold=1.0", "val_fraction=0.1", "engine=local"]) == 0
            assert storage.exists(f"{out}/train/manifest.json") and storage.exists(f"{out}/val/manifest.json")
            # and nothing outside the prefixes the policy names
            with pytest.raises(Exception, match="access denied: s3:PutObject on s3://raytrain-iam/elsewhere"):
                storage.write_text(f"s3://{BUCKET}/elsewhere/x", "no")


def test_a_missing_statement_fails_in_one_line_and_writes_nothing(iam_s3, corpus_dir, capsys):
    out = f"s3://{BUCKET}/data/denied"
    capsys.readouterr()
    with iam_s3.acting_as("head-no-data-writes"):
        assert main(["prepare", f"inputs=[{corpus_dir}]", f"out={out}", "vocab_size=300", "seq_len=32",
                     "shard_rows=64", "near_dup_threshold=1.0", "engine=local"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    # the first call prepare makes under data/ (deleting an earlier manifest: pyarrow looks it up first)
    assert re.match(r"raytrain: error: access denied: s3:(GetObject|DeleteObject) on s3://raytrain-iam/data/denied/"
                    r"train/manifest.json: ", err), err
    # names the statement to check, in each shipped policy that has it
    assert "raytrain-head-policy.json DriverWritesPreparedData" in err, err
    assert iam_s3.keys("data/denied") == []  # no manifest, no shard, no tokenizer


class _Engine:
    """What CheckpointWriter needs of a DeepSpeed engine: it writes its files into the staging directory."""

    def save_checkpoint(self, path: str, tag: str) -> None:
        os.makedirs(os.path.join(path, tag), exist_ok=True)
        with open(os.path.join(path, tag, "model_states.pt"), "wb") as f:
            f.write(b"weights")


def test_a_worker_without_its_runs_statement_commits_no_checkpoint(iam_s3, tmp_path):
    """The checkpoint writer of a rank whose role lacks the runs/ statement: one line, and no checkpoint at all."""
    from raytrain.ckpt.state import TrainState
    from raytrain.ckpt.writer import CheckpointWriter
    from raytrain.config import load_config

    cfg = load_config("tiny", ["checkpoint.upload=sync", "checkpoint.on_upload_failure=stop", "checkpoint.upload_retries=0",
                               f"checkpoint.local_dir={tmp_path}"]).checkpoint
    run = f"s3://{BUCKET}/runs/denied"
    with iam_s3.acting_as("worker-no-run-writes"):
        # What rank 0 of a run with nothing committed tries before its first step (worker/loop.py): the same refusal,
        # before any training rather than at the first checkpoint.
        with pytest.raises(Exception) as e:
            storage.check_writable(run)
        assert str(e.value).count("\n") == 0 and "ReadWriteRunsCheckpointsAndRetention" in str(e.value), e.value
        writer = CheckpointWriter(cfg, run_uri=run, rank=0, world=1)
        with pytest.raises(Exception) as e:
            writer.save(_Engine(), TrainState(step=2, global_batch=8), "run: {}\n")
    msg = str(e.value)
    assert len(msg.splitlines()) == 1, msg
    assert re.match(rf"access denied: s3:\w+ on {run}/checkpoint_00000002", msg), msg
    assert "raytrain-worker-s3-policy.json ReadWriteRunsCheckpointsAndRetention" in msg, msg
    assert iam_s3.keys("runs/denied") == []  # no manifest, no part of the checkpoint


@pytest.mark.slow
def test_every_command_runs_with_the_driver_as_head_and_the_workers_as_worker(iam_s3, corpus_dir, tmp_path):
    """prepare (engine=ray: workers write the shards), train with checkpoints, a resume, eval, export, ckpt list /
    verify / tag / prune and serve (the replica's class, loading from s3://, answering), in one job on a 2-node local cluster of its own (a head without CPUs for tasks, a worker node); no credential
    is written."""
    result = tmp_path / "result.json"
    env = {**os.environ, **iam_s3.env["head"], "IAM_WORKER_ENV": json.dumps(iam_s3.env["worker"]),
           "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0", "RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}
    env.pop("RAY_ADDRESS", None)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, str(ROOT / "tests" / "iam_job.py"), str(corpus_dir), BUCKET, str(result)],
                       env=env, capture_output=True, text=True, timeout=600)
    log = p.stdout + p.stderr
    assert p.returncode == 0 and result.exists(), log[-4000:]
    r = json.loads(result.read_text())
    assert r["driver_key"] == iam_s3.env["head"]["AWS_ACCESS_KEY_ID"]
    assert r["worker_key"] == iam_s3.env["worker"]["AWS_ACCESS_KEY_ID"]
    assert r["nodes"] == 2 and not r["task_on_head"]  # every task ran on the worker node, with the worker role
    for command in ("prepare", "train", "resume", "eval", "export", "ckpt list", "ckpt verify", "ckpt tag", "ckpt prune"):
        assert r[command] == 0, (command, log[-4000:])
    version, params, tokens = r["serve"].split()  # the replica loaded v1 from s3:// and answered a request
    assert version == "v1" and int(params) > 0 and 1 <= int(tokens) <= 3
    keys = iam_s3.keys()
    assert "data/synthetic/train/manifest.json" in keys
    assert "runs/iam/checkpoint_00000006/manifest.json" in keys and "runs/iam/summary.json" in keys
    assert "runs/iam/checkpoint_00000002/manifest.json" in keys  # tagged: prune kept it
    assert "runs/iam/checkpoint_00000004/manifest.json" not in keys  # pruned
    restores = storage_text(iam_s3, "runs/iam/restores.jsonl")
    assert '"checkpoint": "checkpoint_00000004"' in restores
    assert any(k.startswith("runs/iam/exports/manual/") for k in keys)
    # moto cannot evaluate the worker's s3:prefix condition: every prefix listed (by any role) must satisfy it
    (cond,) = [st["Condition"]["StringLikeIfExists"]["s3:prefix"] for st in _statements(shipped("worker"), "s3:ListBucket")]
    listed = iam_s3.listed_prefixes()
    assert listed and all(p is None or any(fnmatchcase(p, c) for c in cond) for p in listed), sorted(set(listed))
    # the audit records (the driver's as head, rank 0's as worker) under audit/, none under runs/, chained and whole
    # (read after the listings above were checked: the head lists audit/ to read them)
    assert any(k.startswith("audit/runs/iam/audit/") for k in keys)
    assert not any(k.startswith("runs/iam/audit/") for k in keys)
    with iam_s3.acting_as("head"):
        from raytrain import audit

        verdict = audit.verify(f"s3://{BUCKET}/runs/iam")
        kinds = {r["kind"] for r in audit.read(audit.run_root(f"s3://{BUCKET}/runs/iam"))}
    assert verdict.ok and {"submit", "resume", "export"} <= kinds, (verdict, kinds)
    print(f"iam job {time.monotonic() - t0:.1f} s ({r['seconds']}), load {open('/proc/loadavg').read().split()[0]}")
    try:
        _no_credentials_anywhere(iam_s3, keys, log, Path(r["temp_dir"]))
    finally:
        shutil.rmtree(r["temp_dir"], ignore_errors=True)


def storage_text(iam_s3: IamS3, key: str) -> str:
    with iam_s3.acting_as("admin"):
        return storage.read_text(f"s3://{BUCKET}/{key}")


def _no_credentials_anywhere(iam_s3: IamS3, keys: list[str], log: str, ray_dir: Path) -> None:
    """Neither role's secret (nor its key id) in any object the job wrote, its output or its Ray logs."""
    with iam_s3.acting_as("admin"):
        blobs = {k: storage.read_bytes(f"s3://{BUCKET}/{k}") for k in keys if not k.endswith("/")}  # not dir markers
    for path in ray_dir.rglob("*"):
        if path.is_file() and "logs" in path.parts:
            blobs[str(path)] = path.read_bytes()
    blobs["job output"] = log.encode()
    for user in ("head", "worker"):
        for secret in (iam_s3.env[user]["AWS_SECRET_ACCESS_KEY"], iam_s3.env[user]["AWS_ACCESS_KEY_ID"]):
            hits = [name for name, data in blobs.items() if secret.encode() in data]
            assert not hits, (user, hits)


def test_the_bucket_policy_binds_every_principal_to_tls_the_encryption_and_audit_writes_once():
    """The bucket's own policy (what role policies cannot do: bind every principal): plain HTTP refused, uploads asking
    for another encryption refused (those without the header get the bucket default), audit records never replaced."""
    policy = json.loads((IAM / "raytrain-bucket-policy.json").read_text().replace("YOUR-BUCKET", BUCKET))
    by = {st["Sid"]: st for st in policy["Statement"]}
    assert all(st["Effect"] == "Deny" and st["Principal"] == "*" for st in by.values())
    tls = by["DenyRequestsWithoutTLS"]
    assert tls["Action"] == "s3:*" and tls["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}
    assert set(tls["Resource"]) == {f"arn:aws:s3:::{BUCKET}", f"arn:aws:s3:::{BUCKET}/*"}
    sse = by["DenyUploadsWithOtherEncryption"]
    assert sse["Condition"] == {"StringNotEqualsIfExists": {"s3:x-amz-server-side-encryption": "YOUR-SSE"}}
    audit = by["DenyAuditOverwrites"]
    assert audit["Resource"] == f"arn:aws:s3:::{BUCKET}/audit/*"
    assert audit["Condition"] == {"Null": {"s3:if-none-match": "true"}}
    assert "raytrain-bucket-policy.json" in (IAM / "README.md").read_text()


def test_the_gpu_recipes_example_paths_are_ones_the_shipped_worker_policy_allows():
    """The GPU recipe's prepare example and data / run paths: the worker role may read the inputs (prepare's ray
    engine reads them on workers) and the prepared data, and write the run."""
    from raytrain.config import RECIPES_DIR

    text = (RECIPES_DIR / "gpt2-124m.yaml").read_text()
    bucket = "CHANGE-ME"
    paths = re.findall(r"s3://CHANGE-ME/([\w/*.-]+)", text)
    assert any(p.startswith("data/raw/") for p in paths) and any(p == "runs" for p in paths), paths
    worker = "raytrain-worker-s3-policy.json"
    for p in paths:
        key = p.replace("*", "part-0") + ("/x" if p == "runs" else "")
        actions = ("s3:GetObject", "s3:PutObject") if p.startswith(("runs", "data/corpus")) else ("s3:GetObject",)
        for action in actions:
            found = storage.shipped_statements(action, f"arn:aws:s3:::{bucket}/{key}", bucket)
            assert any(f.startswith(worker) for f in found), (p, action, found)
