"""One storage layer for every URI the tool touches: local paths and s3:// on any S3-compatible store.

S3 endpoint, region and credentials come only from the standard AWS settings (AWS_ENDPOINT_URL,
AWS_REGION, the credential provider chain); nothing here reads or prints secrets. A refused request (HTTP 403)
becomes one line naming the IAM action to grant, the URI and the shipped policy statement (`access_denied`).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import threading
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse

import pyarrow.fs as pafs

from raytrain.errors import UserError


def is_remote(uri: str) -> bool:
    return "://" in uri and not uri.startswith("file://")


# Encryption settings of every S3 client of every process (forwarded to Ray's workers: raytrain/ray_connect.py).
ALLOW_HTTP = "RAYTRAIN_S3_ALLOW_HTTP"  # 1: an http:// endpoint outside 127.0.0.0/8 is accepted (plain text on the wire)
SSE = "RAYTRAIN_S3_SSE"  # AES256 (SSE-S3) or aws:kms (SSE-KMS): asked for on every object raytrain writes itself
SSE_KMS_KEY_ID = "RAYTRAIN_S3_SSE_KMS_KEY_ID"  # with aws:kms: the key (default: the account's aws/s3 key)
SSE_MODES = ("AES256", "aws:kms")


def endpoint() -> Optional[tuple[str, str]]:
    """(scheme, host[:port]) of the configured S3 endpoint (AWS_ENDPOINT_URL(_S3)), None for AWS's own. An http://
    endpoint is refused unless it is on this machine (127.0.0.0/8, localhost) or RAYTRAIN_S3_ALLOW_HTTP=1: object
    traffic carries model weights and data."""
    url = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if not url:
        return None
    if "://" not in url:
        url = "https://" + url  # AWS tools assume https when no scheme is given
    parsed = urlparse(url)
    scheme, host = parsed.scheme or "https", parsed.netloc or parsed.path
    if scheme == "http" and not _loopback(parsed.hostname or "") and os.environ.get(ALLOW_HTTP) != "1":
        raise UserError(f"S3 endpoint {scheme}://{host} is plain http outside this machine: object traffic (weights, "
                        f"data) would cross the network unencrypted; use https://, or set {ALLOW_HTTP}=1 to accept it")
    return scheme, host


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def sse() -> dict:
    """boto3's server-side encryption arguments for raytrain's own writes ({} when RAYTRAIN_S3_SSE is unset)."""
    mode = os.environ.get(SSE, "")
    if not mode:
        return {}
    if mode not in SSE_MODES:
        raise UserError(f"{SSE}={mode!r}: use AES256 (SSE-S3) or aws:kms (SSE-KMS, with {SSE_KMS_KEY_ID})")
    out = {"ServerSideEncryption": mode}
    if mode == "aws:kms" and os.environ.get(SSE_KMS_KEY_ID):
        out["SSEKMSKeyId"] = os.environ[SSE_KMS_KEY_ID]
    return out


def _s3_filesystem() -> pafs.S3FileSystem:
    # pyarrow reads credentials from the AWS provider chain itself; we only pass the endpoint so
    # that http:// endpoints (a local S3-protocol server) get the right scheme.
    kwargs = {}
    ep = endpoint()
    if ep:
        kwargs["scheme"], kwargs["endpoint_override"] = ep
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        kwargs["region"] = region
    connect_s, request_s, attempts = _s3_limits()
    kwargs["connect_timeout"], kwargs["request_timeout"] = connect_s, request_s
    kwargs["retry_strategy"] = pafs.AwsStandardS3RetryStrategy(max_attempts=attempts)
    return pafs.S3FileSystem(**kwargs)


def _s3_limits() -> tuple[float, float, int]:
    """(connect timeout s, request timeout s, attempts) for every S3 client, pyarrow's and boto3's alike.

    Transient errors (throttling, resets) are retried with backoff; a dead endpoint still fails in
    seconds rather than minutes. Operators on slow links can raise them through RAYTRAIN_S3_* variables.
    """
    return (float(os.environ.get("RAYTRAIN_S3_CONNECT_TIMEOUT", 5)),
            float(os.environ.get("RAYTRAIN_S3_REQUEST_TIMEOUT", 30)),
            int(os.environ.get("RAYTRAIN_S3_MAX_ATTEMPTS", 5)))


def _s3_path(uri: str) -> str:
    path = uri[len("s3://"):].rstrip("/")
    bucket = path.split("/", 1)[0]
    if "@" in bucket or ":" in bucket:
        # Never echo the URI: it may carry an access key. Credentials come from the AWS chain only.
        raise UserError("s3 URIs must not contain credentials or ports (s3://bucket/prefix); set AWS_* "
                        "variables or use the AWS credential chain, and AWS_ENDPOINT_URL for the endpoint")
    if not bucket:
        raise UserError(f"{uri!r} names no bucket: use s3://bucket/prefix")
    return path


def resolve(uri: str) -> tuple[pafs.FileSystem, str]:
    """URI -> (pyarrow filesystem, path within it). Local paths become absolute."""
    if uri.startswith("s3://"):
        return _s3_filesystem(), _s3_path(uri)
    if uri.startswith("file://"):
        uri = uri[len("file://"):]
    if "://" in uri:
        raise UserError(f"unsupported storage URI {uri!r}: use a local path or s3://bucket/prefix")
    return pafs.LocalFileSystem(), str(Path(uri).expanduser().resolve())


def absolute(uri: str) -> str:
    """Normalise a URI so that it means the same thing on every node (local paths made absolute)."""
    if is_remote(uri):
        resolve(uri)  # validates (bucket present, no credentials in the URI)
        return uri.rstrip("/")
    return resolve(uri)[1]


def join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/")] + [p.strip("/") for p in parts if p])


def _fail(uri: str, err: Exception, what: str) -> UserError:
    denied = access_denied(uri, err)
    if denied is not None:
        return denied
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return UserError(f"cannot {what} {uri}: {first}")


# The IAM action each S3 API call needs: a refusal names the action to grant, not the call that was refused
# (pyarrow and boto3 name the call). HeadBucket and the List calls are authorised by s3:ListBucket on the bucket.
_S3_ACTIONS = {"PutObject": "s3:PutObject", "CreateMultipartUpload": "s3:PutObject", "UploadPart": "s3:PutObject",
               "CompleteMultipartUpload": "s3:PutObject", "CopyObject": "s3:PutObject", "GetObject": "s3:GetObject",
               "HeadObject": "s3:GetObject", "ListObjectsV2": "s3:ListBucket", "ListObjects": "s3:ListBucket",
               "HeadBucket": "s3:ListBucket", "DeleteObject": "s3:DeleteObject", "DeleteObjects": "s3:DeleteObject",
               "AbortMultipartUpload": "s3:AbortMultipartUpload", "ListParts": "s3:ListMultipartUploadParts",
               "GetBucketLocation": "s3:GetBucketLocation", "ListObjectVersions": "s3:ListBucketVersions"}
_BUCKET_ACTIONS = ("s3:ListBucket", "s3:GetBucketLocation", "s3:ListBucketVersions")
_DENIED = re.compile(r"ACCESS_DENIED|AccessDenied|\(403\)|Forbidden")
_OPERATION = re.compile(r"during (\w+) operation|calling the (\w+) operation")
# The shipped least-privilege policies (present in a source checkout, which `ray job submit --working-dir .` ships).
_POLICY_DIR = Path(__file__).resolve().parent.parent / "cluster" / "iam"


def access_denied(uri: str, err: BaseException) -> Optional[UserError]:
    """An S3 refusal (HTTP 403) as one line naming the IAM action, the URI and the policy statement to check; None
    for any other error. Every storage call translates its errors here, wherever it runs (driver or worker)."""
    text = str(err)
    if not uri.startswith("s3://") or not _DENIED.search(text):
        return None
    m = _OPERATION.search(text)
    call = (m.group(1) or m.group(2)) if m else ""
    action = _S3_ACTIONS.get(call, f"s3:{call}" if call else "the s3 action")
    bucket, _, key = uri[len("s3://"):].partition("/")
    arn = f"arn:aws:s3:::{bucket}" if action in _BUCKET_ACTIONS or not key else f"arn:aws:s3:::{bucket}/{key}"
    found = shipped_statements(action, arn, bucket)
    where = f"shipped: {', '.join(found)}" if found else "the shipped policies: cluster/iam/README.md"
    return UserError(f"access denied: {action} on {uri}: refused to these credentials; check the policy statement "
                     f"that allows {action} on {arn} ({where})")


def shipped_statements(action: str, arn: str, bucket: str) -> list[str]:
    """'file Sid' of each statement of the shipped policies that allows `action` on `arn` (YOUR-BUCKET read as
    `bucket`); conditions are not evaluated."""
    import fnmatch
    import json

    out = []
    for f in sorted(_POLICY_DIR.glob("*.json")) if _POLICY_DIR.is_dir() else []:
        try:
            statements = json.loads(f.read_text()).get("Statement", [])
        except (OSError, ValueError, AttributeError):
            continue
        for st in statements if isinstance(statements, list) else [statements]:
            actions = st.get("Action", [])
            resources = st.get("Resource", [])
            actions, resources = ([x] if isinstance(x, str) else x for x in (actions, resources))
            if st.get("Effect") == "Allow" and action in actions and any(
                    fnmatch.fnmatchcase(arn, r.replace("YOUR-BUCKET", bucket)) for r in resources):
                out.append(f"{f.name} {st.get('Sid', '(no Sid)')}")
    return out


def exists(uri: str) -> bool:
    fs, path = resolve(uri)
    try:
        return fs.get_file_info(path).type != pafs.FileType.NotFound
    except OSError as e:
        raise _fail(uri, e, "reach") from None


def size(uri: str) -> Optional[int]:
    """A file's size in bytes; None when there is none."""
    fs, path = resolve(uri)
    try:
        info = fs.get_file_info(path)
    except OSError as e:
        raise _fail(uri, e, "reach") from None
    return None if info.type == pafs.FileType.NotFound else info.size


def read_range(uri: str, start: int, stop: int) -> bytes:
    """Bytes [start, stop) of a file (fewer at its end): one ranged read on S3."""
    fs, path = resolve(uri)
    try:
        with fs.open_input_file(path) as f:
            return f.read_at(max(0, min(stop, f.size()) - start), start)
    except FileNotFoundError:
        raise UserError(f"not found: {uri}") from None
    except OSError as e:
        raise _fail(uri, e, "read") from None


def read_bytes(uri: str) -> bytes:
    fs, path = resolve(uri)
    try:
        with fs.open_input_stream(path) as f:
            return f.read()
    except FileNotFoundError:
        raise UserError(f"not found: {uri}") from None
    except OSError as e:
        raise _fail(uri, e, "read") from None


class ReadCounter:
    """Bytes fetched from storage by this process's data reads (footers and metadata included)."""

    def __init__(self):
        self.bytes = 0
        self.opens = 0
        self._lock = threading.Lock()  # readers run on several threads

    def add(self, nbytes: int = 0, opens: int = 0) -> None:
        with self._lock:
            self.bytes += nbytes
            self.opens += opens


READS = ReadCounter()


class _CountedFile(io.RawIOBase):
    """A seekable binary file over a pyarrow input file that adds every byte it returns to a ReadCounter."""

    def __init__(self, f, counter: ReadCounter):
        super().__init__()
        self._f, self._counter = f, counter

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def read(self, n: int = -1) -> bytes:
        data = self._f.read() if n is None or n < 0 else self._f.read(n)
        self._counter.add(len(data))
        return data

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)

    def close(self) -> None:
        self._f.close()
        super().close()


def open_counted(uri: str, counter: Optional[ReadCounter] = None) -> io.RawIOBase:
    """A random-access file whose reads count into `counter` (default: this process's READS). On S3 every
    read is a ranged GET, so callers read in large pieces."""
    counter = counter or READS
    fs, path = resolve(uri)
    try:
        f = fs.open_input_file(path)
    except FileNotFoundError:
        raise
    except OSError as e:
        _raise_if_denied(uri, e)
        raise
    counter.add(opens=1)
    return _CountedFile(f, counter)


def read_text(uri: str) -> str:
    return read_bytes(uri).decode("utf-8")


def read_line_range(uri: str, start: int, stop: int) -> tuple[bytes, int]:
    """(the lines that start in bytes [start, stop) of a file, whole; the offset of the first): splitting a file
    into byte ranges this way hands every line to exactly one range. On S3, a few ranged GETs."""
    fs, path = resolve(uri)
    try:
        with fs.open_input_file(path) as f:
            size = f.size()
            end = min(stop, size)
            lo = max(0, start - 1)  # the byte before the range says whether a line starts at `start`
            data = f.read_at(max(0, end - lo), lo)
            first = 0
            if start > 0:
                cut = data.find(b"\n")
                if cut < 0 or lo + cut + 1 >= end:
                    return b"", end  # no line starts in this range
                data, first = data[cut + 1:], lo + cut + 1
            tail = []
            while end < size and not (tail[-1] if tail else data).endswith(b"\n"):
                piece = f.read_at(min(1 << 20, size - end), end)  # the last line runs past `stop`
                cut = piece.find(b"\n")
                tail.append(piece if cut < 0 else piece[:cut + 1])
                end += len(tail[-1])
            return data + b"".join(tail), first
    except FileNotFoundError:
        raise UserError(f"not found: {uri}") from None
    except OSError as e:
        raise _fail(uri, e, "read") from None


def count_lines(uri: str, stop: int) -> int:
    """Newlines in bytes [0, stop) of a file, read in pieces (for an error's line number in a later range)."""
    n = 0
    with open_counted(uri) as f:
        while stop > 0:
            piece = f.read(min(8 << 20, stop))
            if not piece:
                break
            n, stop = n + piece.count(b"\n"), stop - len(piece)
    return n


def write_bytes(uri: str, data: bytes) -> None:
    """Write a whole object. Local writes go through a temp file + rename so readers never see half."""
    fs, path = resolve(uri)
    try:
        if isinstance(fs, pafs.LocalFileSystem):
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            tmp = f"{path}.tmp-{os.getpid()}"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        elif sse():
            # pyarrow cannot ask for server-side encryption per object: boto3 can (still one atomic PUT).
            _put_s3(path, data, uri)
        else:
            # An S3 PUT is atomic: the object appears whole or not at all.
            with fs.open_output_stream(path) as f:
                f.write(data)
    except OSError as e:
        raise _fail(uri, e, "write") from None


_CLIENTS: dict = {}


def _client():
    # One client per process and settings: making one costs tens of milliseconds, and they are thread-safe.
    settings = (endpoint(), _s3_limits(), os.environ.get("AWS_ACCESS_KEY_ID"))
    client = _CLIENTS.get(settings)
    if client is None:
        client = _CLIENTS[settings] = _s3_client()
    return client


def _put_s3(path: str, data: bytes, uri: str) -> None:
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, _, key = path.partition("/")
    try:
        _client().put_object(Bucket=bucket, Key=key, Body=data, **sse())
    except (BotoCoreError, ClientError) as e:
        raise _fail(uri, e, "write") from None


def write_once(uri: str, data: bytes) -> bool:
    """Create an object that must not exist yet: True when written, False when one is there already (S3: a PUT with
    `If-None-Match: *` answered 412; local: a hard link that finds the name taken). Never replaces an object."""
    fs, path = resolve(uri)
    if isinstance(fs, pafs.LocalFileSystem):
        tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.link(tmp, path)  # atomic, and fails where the name exists: readers never see half
            return True
        except FileExistsError:
            return False
        except OSError as e:
            raise _fail(uri, e, "write") from None
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, _, key = path.partition("/")
    try:
        _client().put_object(Bucket=bucket, Key=key, Body=data, IfNoneMatch="*", **sse())
        return True
    except ClientError as e:
        if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 412:
            return False
        raise _fail(uri, e, "write") from None
    except BotoCoreError as e:
        raise _fail(uri, e, "write") from None


def object_versions(uri: str) -> Optional[list[dict]]:
    """Every version of every object under a directory URI (S3 ListObjectVersions): {key (relative to uri),
    version_id, latest, deleted (a delete marker), time}, a key's versions newest first, then its delete markers;
    None on a local filesystem. An unversioned bucket answers each object once, version id "null"."""
    if not uri.startswith("s3://"):
        return None
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, _, prefix = _s3_path(uri).partition("/")
    prefix = prefix + "/" if prefix else ""
    out = []
    try:
        for page in _client().get_paginator("list_object_versions").paginate(Bucket=bucket, Prefix=prefix):
            for marker, items in ((False, page.get("Versions", [])), (True, page.get("DeleteMarkers", []))):
                out += [{"key": v["Key"][len(prefix):], "version_id": v.get("VersionId") or "null",
                         "latest": bool(v.get("IsLatest")), "deleted": marker, "time": v.get("LastModified")}
                        for v in items]
    except (BotoCoreError, ClientError) as e:
        raise _fail(uri, e, "list the object versions under") from None
    return out


def read_version(uri: str, version_id: str) -> bytes:
    """One version of an S3 object (s3:GetObjectVersion)."""
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, _, key = _s3_path(uri).partition("/")
    try:
        return _client().get_object(Bucket=bucket, Key=key, VersionId=version_id)["Body"].read()
    except (BotoCoreError, ClientError) as e:
        raise _fail(uri, e, f"read version {version_id} of") from None


def write_text(uri: str, text: str) -> None:
    write_bytes(uri, text.encode("utf-8"))


def append_text(uri: str, text: str, *, durable: bool = False) -> None:
    """Add lines at the end of a local file (O(the new lines), not a rewrite of the whole file); `durable`: on disk
    before returning. Object storage has no append: callers write the whole object there (write_bytes). A reader
    may see the last line half-written, as after a kill: line readers skip it (rundir.parse_jsonl)."""
    fs, path = resolve(uri)
    if not isinstance(fs, pafs.LocalFileSystem):
        raise ValueError(f"{uri}: object storage has no append; write the whole object")
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            if durable:
                os.fsync(f.fileno())
    except OSError as e:
        raise _fail(uri, e, "write") from None


def list_dir(uri: str) -> list[str]:
    """Names (not paths) directly under a directory URI; empty if it does not exist."""
    fs, path = resolve(uri)
    try:
        infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True, recursive=False))
    except OSError as e:
        raise _fail(uri, e, "list") from None
    return sorted(i.base_name for i in infos)


def upload_file(local_path: str, uri: str) -> None:
    write_bytes(uri, Path(local_path).read_bytes())


# Bytes per read/write when copying trees. On S3 every read of a remote file is one ranged GET: pyarrow's
# default (1 MiB) made a checkpoint restore 100 GETs per 100 MB and ran at 0.2-0.3 of boto3's rate
# against a local S3 server; 16 MiB reads matched it (docs/BENCHMARKS.md, checkpoint part).
_CHUNK = 16 << 20


def _s3_client():
    """boto3 for bulk uploads, with the same timeouts and retries as the pyarrow filesystem. boto3 reads
    AWS_ENDPOINT_URL(_S3), the region and credentials from the standard AWS settings itself (checked here as the
    pyarrow filesystem checks them: no plain http:// outside this machine)."""
    import boto3
    from botocore.config import Config as BotoConfig

    endpoint()
    connect_s, request_s, attempts = _s3_limits()
    return boto3.client("s3", config=BotoConfig(connect_timeout=connect_s, read_timeout=request_s,
                                                retries={"max_attempts": attempts, "mode": "standard"},
                                                max_pool_connections=32))


def _upload_dir_s3(local_dir: str, path: str) -> None:
    # boto3's transfer manager, not pyarrow: pyarrow's AWS SDK sends every part as an aws-chunked body with a
    # trailing checksum that some S3-protocol servers (moto among them) decode slowly; boto3's plain signed
    # parts went 1.7-2x faster to the same server. Files in parallel, each multipart in 16 MiB parts.
    from concurrent.futures import ThreadPoolExecutor

    from boto3.s3.transfer import TransferConfig

    bucket, _, prefix = path.partition("/")
    client = _s3_client()
    cfg = TransferConfig(multipart_threshold=_CHUNK, multipart_chunksize=_CHUNK, max_concurrency=8)
    files = [p for p in Path(local_dir).rglob("*") if p.is_file()]

    def put(p: Path) -> None:
        key = f"{prefix}/{p.relative_to(local_dir).as_posix()}" if prefix else p.relative_to(local_dir).as_posix()
        client.upload_file(str(p), bucket, key, Config=cfg, ExtraArgs=sse() or None)

    with ThreadPoolExecutor(max_workers=max(1, min(8, len(files)))) as pool:
        for f in [pool.submit(put, p) for p in files]:
            f.result()


def upload_dir(local_dir: str, uri: str) -> None:
    """Copy a local directory tree under `uri` (multipart and parallel on S3)."""
    fs, path = resolve(uri)
    if isinstance(fs, pafs.S3FileSystem):
        from boto3.exceptions import Boto3Error
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return _upload_dir_s3(local_dir, path)
        except (Boto3Error, BotoCoreError, ClientError) as e:
            raise _fail(uri, e, "upload to") from None
    try:
        if isinstance(fs, pafs.LocalFileSystem):
            fs.create_dir(path, recursive=True)
        pafs.copy_files(local_dir, path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs,
                        use_threads=True, chunk_size=_CHUNK)
    except OSError as e:
        raise _fail(uri, e, "upload to") from None


def delete_file(uri: str) -> None:
    """Remove one object or file; a missing one is fine, a refused one is not (it would stay and vouch)."""
    fs, path = resolve(uri)
    try:
        fs.delete_file(path)
    except (FileNotFoundError, OSError) as e:
        _raise_if_denied(uri, e)


def delete_dir(uri: str) -> None:
    """Remove a directory tree; a missing one is fine, a refused one is not."""
    fs, path = resolve(uri)
    try:
        fs.delete_dir(path)
    except (FileNotFoundError, OSError) as e:
        _raise_if_denied(uri, e)


def _raise_if_denied(uri: str, err: BaseException) -> None:
    denied = access_denied(uri, err)
    if denied is not None:
        raise denied from None


def download_dir(uri: str, local_dir: str) -> str:
    """Copy every file under a directory URI into a local directory (files in parallel); returns the local directory."""
    fs, path = resolve(uri)
    if not exists(uri):
        raise UserError(f"not found: {uri}")
    try:
        Path(local_dir).mkdir(parents=True, exist_ok=True)
        pafs.copy_files(path, local_dir, source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem(),
                        use_threads=True, chunk_size=_CHUNK)
    except OSError as e:
        raise _fail(uri, e, "download") from None
    return local_dir


def make_dirs(uri: str) -> None:
    fs, path = resolve(uri)
    try:
        fs.create_dir(path, recursive=True)
    except OSError as e:
        raise _fail(uri, e, "create") from None


def check_writable(uri: str) -> None:
    """Probe that the storage is reachable and writable before any training starts."""
    probe = join(uri, ".raytrain-write-probe")
    write_bytes(probe, b"ok")
    delete_file(probe)


def ray_storage(uri: str) -> tuple[str, Optional[pafs.FileSystem]]:
    """(storage_path, storage_filesystem) for Ray Train's RunConfig."""
    if uri.startswith("s3://"):
        return _s3_path(uri), _s3_filesystem()
    return resolve(uri)[1], None
