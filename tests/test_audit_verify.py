"""Audit records their writers cannot erase (raytrain/audit.py, cluster/iam/): segments hash-chained and anchored,
`raytrain audit verify` naming a deleted or edited one (exit 1), passing an intact run (exit 0), one line for bad
input (exit 2); under the enforcing S3 server the roles that write them can neither delete nor overwrite them, a retry
answered 412 counts as written, and with S3 Object Lock (compliance mode) a deleted or overwritten segment's original
version is found and named."""

from __future__ import annotations

import json
import re
from fnmatch import fnmatchcase
from pathlib import Path

import boto3
import pytest
from botocore.exceptions import ClientError

from raytrain import audit, storage
from raytrain.audit import AuditWriter, anchor_name, run_event, run_root, segment_name
from raytrain.cli import main
from tests.test_iam import POLICIES, IamS3, for_moto, shipped

LOCKED = "raytrain-audit-locked"


def _verify(capsys, target: str) -> tuple[int, list[str]]:
    capsys.readouterr()
    rc = main(["audit", "verify", target])
    captured = capsys.readouterr()
    return rc, (captured.out + captured.err).strip().splitlines()


def _write(root: str, src: str, n: int, every: int = 3) -> AuditWriter:
    """A writer's n records in segments of `every` (each flushed as written), closed: its last segment anchored."""
    w = AuditWriter(root, every=1 << 20, seconds=3600)
    for i in range(n):
        w.record("event", src=src, i=i)
        if i % every == every - 1:
            assert w.flush()
    assert w.close()
    return w


def _local_run(tmp_path: Path) -> tuple[str, AuditWriter, AuditWriter]:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("run: {}\n")
    root = run_root(str(run))
    return str(run), _write(root, "a", 10), _write(root, "b", 3)


def test_an_intact_run_passes_and_a_deleted_or_edited_segment_is_named(tmp_path, capsys):
    run, a, b = _local_run(tmp_path)
    run_event(run, "resume", step=4)  # this process's run writer: open until exit (its last segment unanchored)
    rc, out = _verify(capsys, run)
    assert rc == 0 and len(out) == 1 and out[0].startswith("intact: "), out
    assert "3 writers, 6 segments, 14 records" in out[0] and "14 records (1 of the writers not closed: " in out[0], out
    assert [r["i"] for r in audit.read(run_root(run)) if r.get("src") == "a"] == list(range(10))  # headers skipped

    seg = Path(a.uri) / segment_name(1)
    data = seg.read_bytes()
    seg.write_bytes(data.replace(b'"i": 4', b'"i": 40'))  # edited in place
    rc, out = _verify(capsys, run)
    assert rc == 1 and out[0] == f"EDITED {seg}: its sha256 is not the one segment 2 names", out
    assert out[-1].startswith("NOT intact: ") and "1 problem;" in out[-1], out

    seg.unlink()  # deleted
    rc, out = _verify(capsys, run)
    assert rc == 1 and out[0].startswith(f"MISSING {seg}: segment 1 of writer {a.id} is gone"), out

    seg.write_bytes(data)
    last = Path(a.uri) / segment_name(3)  # the last one: nothing after it names it, its anchor does
    last.write_bytes(last.read_bytes().replace(b'"i": 9', b'"i": 90'))
    rc, out = _verify(capsys, run)
    assert rc == 1 and out[0].startswith(f"EDITED {last}: its sha256 is not the one its last anchor"), out
    last.unlink()
    rc, out = _verify(capsys, run)
    assert rc == 1 and out[0].startswith(f"MISSING {last}: "), out

    only = Path(b.uri) / segment_name(0)  # the first one: its anchor names it
    only.write_bytes(only.read_bytes().replace(b'"src": "b"', b'"src": "B"'))
    rc, out = _verify(capsys, run)
    assert f"EDITED {only}: its sha256 is not the one its first anchor" in "\n".join(out), out
    assert len(out) == 3, out


def test_a_missing_run_is_one_line_and_exit_2(tmp_path, capsys):
    rc, out = _verify(capsys, str(tmp_path / "no-such-run"))
    assert rc == 2 and len(out) == 1 and out[0].startswith("raytrain: error: not found: "), out
    (tmp_path / "empty").mkdir()  # there, but nothing was ever recorded for it
    rc, out = _verify(capsys, str(tmp_path / "empty"))
    assert rc == 1 and out == [f"NOT verified: model {tmp_path / 'empty'}: audit records {tmp_path / 'empty'}.audit: "
                               "no chained audit records"], out


def test_records_written_before_chaining_are_counted_not_vouched_for(tmp_path, capsys):
    root = tmp_path / "model.audit"
    old = root / "host-1-deadbeef"
    old.mkdir(parents=True)
    (old / segment_name(0)).write_text(json.dumps({"time": 1.0, "kind": "deploy"}) + "\n")
    rc, out = _verify(capsys, str(tmp_path / "model"))
    assert rc == 1 and "1 segment written before audit records were chained" in out[0], out
    assert [r["kind"] for r in audit.read(str(root))] == ["deploy"]
    _write(str(root), "new", 2)
    rc, out = _verify(capsys, str(tmp_path / "model"))
    assert rc == 0 and "1 writer, 1 segment, 2 records" in out[0] and "1 segment written before" in out[0], out


def test_serve_proves_it_can_write_with_a_record_not_a_deleted_probe(tmp_path, capsys):
    from raytrain.serving.run import audit_root

    root = audit_root(None, str(tmp_path / "model"))
    assert root == str(tmp_path / "model.audit")
    recs = audit.read(root)
    assert [(r["kind"], r["by"]) for r in recs] == [("audit_check", "raytrain serve")]
    assert _verify(capsys, root)[0] == 0  # written as a closed writer: segment, first and last anchor
    assert audit.serve_root("s3://b/runs/r/exports/m") == "s3://b/audit/runs/r/exports/m.audit"
    assert run_root("s3://b/runs/r") == "s3://b/audit/runs/r/audit" and run_root("s3://b/audit/x") == "s3://b/audit/x/audit"


# --- the shipped policies: audit records are created, never deleted or replaced, by every role ----------------


def test_every_role_may_only_create_audit_records():
    """Statements on `audit/*`: PutObject only with `If-None-Match` (the `s3:if-none-match` condition: no overwrite;
    moto cannot evaluate it, so it is checked here), reads of objects and versions for the head (and KubeRay); no
    role may delete an object or version there, shorten a retention or bypass it."""
    never = {"s3:DeleteObject", "s3:DeleteObjectVersion", "s3:PutObjectRetention", "s3:BypassGovernanceRetention",
             "s3:PutObjectLegalHold", "s3:PutBucketVersioning", "s3:PutBucketObjectLockConfiguration", "s3:*"}
    for name in POLICIES:
        on_audit = [st for st in shipped(name)["Statement"] if st["Effect"] == "Allow"
                    and any(fnmatchcase("arn:aws:s3:::raytrain-iam/audit/x/y", r)
                            for r in ([st["Resource"]] if isinstance(st["Resource"], str) else st["Resource"]))]
        actions = {a for st in on_audit for a in st["Action"] if a.startswith("s3:")}  # (EC2's are on "*")
        assert not actions & never, (name, actions & never)
        (put,) = [st for st in on_audit if "s3:PutObject" in st["Action"]]
        assert put["Action"] == ["s3:PutObject"] and put["Condition"] == {"Null": {"s3:if-none-match": "false"}}
        assert put["Resource"] == "arn:aws:s3:::raytrain-iam/audit/*"
        assert "Condition" not in [st for st in for_moto(shipped(name))["Statement"] if st["Sid"] == put["Sid"]][0]
        assert actions <= {"s3:PutObject", "s3:GetObject", "s3:GetObjectVersion"}, (name, actions)
    assert {a for st in shipped("worker")["Statement"] if "audit" in json.dumps(st["Resource"])
            for a in st["Action"]} == {"s3:PutObject"}  # workers (rank 0, the router) only write


# --- under the enforcing S3 server, on a bucket with Object Lock in compliance mode ------------------------------


@pytest.fixture(scope="module")
def locked_s3():
    """The enforcing server (tests/test_iam.py) with a bucket made as production should be: versioned, S3 Object
    Lock in compliance mode by default; one user per role holding exactly its shipped policy for that bucket."""
    server = IamS3({name: for_moto(shipped(name, LOCKED)) for name in ("head", "worker", "kuberay")})
    env = server.env["admin"]
    s3 = boto3.client("s3", endpoint_url=server.endpoint, region_name="us-east-1",
                      aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
    s3.create_bucket(Bucket=LOCKED, ObjectLockEnabledForBucket=True)
    s3.put_object_lock_configuration(Bucket=LOCKED, ObjectLockConfiguration={
        "ObjectLockEnabled": "Enabled", "Rule": {"DefaultRetention": {"Mode": "COMPLIANCE", "Days": 1}}})
    server.admin = s3
    yield server
    server.close()


def _s3_run(locked_s3, name: str) -> str:
    run = f"s3://{LOCKED}/runs/{name}"
    with locked_s3.acting_as("head"):
        storage.write_text(f"{run}/config.yaml", "run: {}\n")
    return run


def test_the_roles_that_write_audit_records_cannot_delete_or_overwrite_them(locked_s3, capsys):
    run = _s3_run(locked_s3, "deny")
    for role in ("worker", "head", "kuberay"):
        with locked_s3.acting_as(role):
            w = _write(run_root(run), role, 4)
            seg = storage.join(w.uri, segment_name(0))
            assert seg.startswith(f"s3://{LOCKED}/audit/runs/deny/audit/")
            key = seg[len(f"s3://{LOCKED}/"):]
            client = boto3.client("s3")  # the role's own credentials, the S3 calls themselves
            with pytest.raises(ClientError, match=r"DeleteObject operation: Access Denied"):
                client.delete_object(Bucket=LOCKED, Key=key)
            with pytest.raises(ClientError, match=r"PreconditionFailed"):  # If-None-Match: * finds it: 412
                client.put_object(Bucket=LOCKED, Key=key, Body=b"other bytes\n", IfNoneMatch="*")
            assert storage.write_once(seg, b"other bytes\n") is False  # the writers' own call: nothing replaced
            (version,) = locked_s3.admin.list_object_versions(Bucket=LOCKED, Prefix=key)["Versions"]
            with pytest.raises(ClientError, match=r"DeleteObject operation: Access Denied"):  # nor a version of it
                client.delete_object(Bucket=LOCKED, Key=key, VersionId=version["VersionId"])
            with pytest.raises(Exception, match=r"access denied: s3:\w+ on "):
                storage.delete_file(seg)
            if role == "worker":  # the workers (rank 0, the router) write records and read none
                with pytest.raises(Exception, match=r"access denied: s3:GetObject on "):
                    storage.read_bytes(seg)
    assert storage_bytes(locked_s3, seg).startswith(b'{"time"')
    with locked_s3.acting_as("head"):
        rc, out = _verify(capsys, run)
    assert rc == 0 and "3 writers, 6 segments, 12 records" in out[0] and "every object version read" in out[0], out


def storage_bytes(locked_s3, uri: str) -> bytes:
    with locked_s3.acting_as("admin"):
        return storage.read_bytes(uri)


def test_a_retry_answered_412_counts_as_written(locked_s3, monkeypatch, capsys):
    """The PUT landed but its answer was lost: the retry of the same bytes under the same name gets 412 (the
    object is there) and the writer goes on, the chain intact."""
    run = _s3_run(locked_s3, "retry")
    real, answers = storage.write_once, []

    def lost_answer(uri, data):
        answers.append(real(uri, data))
        if len(answers) == 1:
            raise OSError("Connection reset by peer (the answer was lost)")
        return answers[-1]

    with locked_s3.acting_as("worker"):
        w = AuditWriter(run_root(run), every=1 << 20, seconds=3600)
        monkeypatch.setattr(storage, "write_once", lost_answer)
        w.record("resume", step=4)
        assert not w.flush() and "cannot write a segment" in capsys.readouterr().err
        w.record("resize", step=4)
        assert w.close()
        monkeypatch.undo()
    assert answers[:2] == [True, False]  # written, then 412 on the retry: counted as written
    with locked_s3.acting_as("head"):
        rc, out = _verify(capsys, run)
        assert [r["kind"] for r in audit.read(run_root(run))] == ["resume", "resize"]
    assert rc == 0 and "1 writer, 2 segments, 2 records" in out[0], out


def test_object_lock_keeps_the_original_of_a_deleted_or_overwritten_segment(locked_s3, capsys):
    """Someone who may delete (not a role that writes audit records) deletes one segment and overwrites another:
    `verify` fails naming both, each with the original version the lock kept; the original cannot be removed."""
    run = _s3_run(locked_s3, "lock")
    with locked_s3.acting_as("worker"):
        a, b = _write(run_root(run), "a", 9), _write(run_root(run), "b", 6)
    with locked_s3.acting_as("head"):
        assert _verify(capsys, run)[0] == 0
    prefix = f"audit/runs/lock/audit/{a.id}/"
    admin = locked_s3.admin
    gone = admin.list_object_versions(Bucket=LOCKED, Prefix=prefix + segment_name(1))["Versions"][0]["VersionId"]
    marker = admin.delete_object(Bucket=LOCKED, Key=prefix + segment_name(1))["VersionId"]
    with pytest.raises(ClientError, match="AccessDenied"):  # compliance mode: not even an administrator
        admin.delete_object(Bucket=LOCKED, Key=prefix + segment_name(1), VersionId=gone)
    edited = f"audit/runs/lock/audit/{b.id}/{segment_name(0)}"
    first = admin.list_object_versions(Bucket=LOCKED, Prefix=edited)["Versions"][0]["VersionId"]
    admin.put_object(Bucket=LOCKED, Key=edited, Body=b'{"kind": "nothing happened"}\n')
    with locked_s3.acting_as("head"):
        rc, out = _verify(capsys, run)
    seg = f"s3://{LOCKED}/{prefix}{segment_name(1)}"
    assert rc == 1 and len(out) == 3, out
    deleted, overwritten = sorted(out[:2])
    assert deleted.startswith(f"DELETED {seg}: a delete marker ({marker}) hides it; its original version {gone} was "
                              "found (3 records, "), out
    assert overwritten.startswith(f"EDITED s3://{LOCKED}/{edited}: overwritten after it was written (2 versions); "
                                  f"its original version {first} was found (3 records, "), out
    assert out[2].startswith("NOT intact: run ") and "2 problems" in out[2], out
    assert "2 writers, 5 segments, 15 records" in out[2], out  # the chain checked over the originals: all there
    anchors = admin.list_objects_v2(Bucket=LOCKED, Prefix=f"audit/runs/lock/audit/{audit.ANCHORS}/")["Contents"]
    assert {o["Key"].split("/", 4)[-1] for o in anchors} == {
        anchor_name(a.id, "first", 0), anchor_name(a.id, "last", 2), anchor_name(b.id, "first", 0),
        anchor_name(b.id, "last", 1)}


def test_an_unversioned_bucket_shows_a_deletion_as_a_gap_and_old_records_are_read(s3_server, capsys):
    run = "s3://raytrain-test/runs/audit-gap"
    storage.write_text(f"{run}/config.yaml", "run: {}\n")
    w = _write(run_root(run), "a", 9)
    # records of the same run written before they moved under audit/: read where they are, counted, not vouched for
    storage.write_text(f"{run}/audit/host-1-deadbeef/{segment_name(0)}", json.dumps({"time": 1, "kind": "submit"}) + "\n")
    rc, out = _verify(capsys, run)
    assert rc == 0 and "the bucket keeps no object versions" in out[0], out
    assert f"1 segment written before audit records were chained and sealed (under {run}/audit)" in out[0], out
    storage.delete_file(storage.join(w.uri, segment_name(1)))
    rc, out = _verify(capsys, run)
    assert rc == 1 and out[0].startswith(f"MISSING {w.uri}/{segment_name(1)}: "), out
