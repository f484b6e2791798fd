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
