"""Storage layer: local and s3:// URIs through one interface; bad URIs are one-line errors without secrets."""

import pytest

from raytrain import storage
from raytrain.errors import UserError


def test_local_roundtrip_and_listing(tmp_path):
    uri = str(tmp_path / "a" / "b.txt")
    storage.write_text(uri, "hello")
    assert storage.read_text(uri) == "hello" and storage.exists(uri)
    assert storage.list_dir(str(tmp_path / "a")) == ["b.txt"]
    assert storage.list_dir(str(tmp_path / "missing")) == []
    with pytest.raises(UserError, match="not found"):
        storage.read_text(str(tmp_path / "nope"))


def test_s3_roundtrip_on_local_server(s3_server):
    uri = "s3://raytrain-test/storage-test/x.json"
    storage.write_text(uri, '{"a": 1}')
    assert storage.read_text(uri) == '{"a": 1}'
    assert storage.list_dir("s3://raytrain-test/storage-test") == ["x.json"]
    storage.check_writable("s3://raytrain-test/storage-test/run")


def test_credentials_in_uri_are_refused_without_echo():
    with pytest.raises(UserError) as e:
        storage.absolute("s3://AKIAXXXX:SECRETKEY@bucket/prefix")
    assert "SECRETKEY" not in str(e.value) and "credential" in str(e.value)


def test_uri_without_bucket():
    with pytest.raises(UserError, match="names no bucket"):
        storage.absolute("s3://")


def test_unsupported_scheme():
    with pytest.raises(UserError, match="unsupported storage URI"):
        storage.resolve("gs://bucket/x")


def test_endpoint_without_scheme_means_https(monkeypatch):
    import pyarrow.fs as pafs

    monkeypatch.setenv("AWS_ENDPOINT_URL", "minio.internal:9000")
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)  # it would win over AWS_ENDPOINT_URL
    real, seen = pafs.S3FileSystem, {}
    # The filesystem is built for real; what it was built with is recorded (pyarrow does not show its endpoint).
    monkeypatch.setattr(pafs, "S3FileSystem", lambda **kw: seen.update(kw) or real(**kw))
    fs = storage._s3_filesystem()
    assert isinstance(fs, real)
    assert (seen.get("endpoint_override"), seen.get("scheme")) == ("minio.internal:9000", "https"), seen


def test_plain_http_endpoint_off_this_machine_is_refused(monkeypatch):
    """Object traffic carries weights and data: an http:// endpoint outside 127.0.0.0/8 is one line unless allowed
    (nothing is contacted: the endpoint is refused before any request)."""
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv(storage.ALLOW_HTTP, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://objects.example.invalid:9000")
    with pytest.raises(UserError, match=r"plain http outside this machine.*RAYTRAIN_S3_ALLOW_HTTP=1") as e:
        storage.exists("s3://bucket/x")
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="plain http"):
        storage._s3_client()  # boto3's uploads are held to the same rule
    monkeypatch.setenv(storage.ALLOW_HTTP, "1")
    assert storage.endpoint() == ("http", "objects.example.invalid:9000")
    for local in ("http://127.0.0.1:9000", "http://localhost:9000", "http://127.8.9.10", "https://objects.example.invalid"):
        monkeypatch.delenv(storage.ALLOW_HTTP)
        monkeypatch.setenv("AWS_ENDPOINT_URL", local)
        assert storage.endpoint()[1] == local.split("://")[1]
        monkeypatch.setenv(storage.ALLOW_HTTP, "1")


def test_objects_written_with_sse_carry_the_encryption_header(s3_server, monkeypatch, tmp_path):
    """storage.sse (RAYTRAIN_S3_SSE): every object raytrain writes itself, one by one or a directory at once, is
    stored with the server-side encryption asked for, as the S3 server reports it back; a bad mode is one line."""
    import boto3

    client = boto3.client("s3")

    def encryption(key: str) -> tuple:
        head = client.head_object(Bucket="raytrain-test", Key=key)
        return head.get("ServerSideEncryption"), head.get("SSEKMSKeyId")

    storage.write_text("s3://raytrain-test/sse/plain.txt", "x")
    assert encryption("sse/plain.txt") == (None, None)
    monkeypatch.setenv(storage.SSE, "AES256")
    storage.write_text("s3://raytrain-test/sse/one.txt", "x")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.bin").write_bytes(b"a" * 1000)
    storage.upload_dir(str(tmp_path / "d"), "s3://raytrain-test/sse/dir")
    assert encryption("sse/one.txt") == encryption("sse/dir/a.bin") == ("AES256", None)
    monkeypatch.setenv(storage.SSE, "aws:kms")
    monkeypatch.setenv(storage.SSE_KMS_KEY_ID, "alias/raytrain-test")
    storage.write_text("s3://raytrain-test/sse/kms.txt", "x")
    got = encryption("sse/kms.txt")
    assert got[0] == "aws:kms" and got[1].endswith("alias/raytrain-test"), got
    assert storage.read_text("s3://raytrain-test/sse/kms.txt") == "x"
    monkeypatch.setenv(storage.SSE, "rot13")
    with pytest.raises(UserError, match="use AES256 .* or aws:kms"):
        storage.write_text("s3://raytrain-test/sse/bad.txt", "x")


def test_storage_section_sets_the_environment_every_process_inherits(monkeypatch):
    from raytrain.config import load_config
    from raytrain.ray_connect import FORWARDED_ENV

    for var in (storage.SSE, storage.SSE_KMS_KEY_ID, storage.ALLOW_HTTP):
        monkeypatch.delenv(var, raising=False)
        assert var in FORWARDED_ENV
    load_config("tiny", ["storage.sse=aws:kms", "storage.kms_key_id=k-1"]).storage.apply()
    assert (storage.sse()["ServerSideEncryption"], storage.sse()["SSEKMSKeyId"]) == ("aws:kms", "k-1")
    with pytest.raises(Exception, match="storage.sse"):
        load_config("tiny", ["storage.sse=DES"])
