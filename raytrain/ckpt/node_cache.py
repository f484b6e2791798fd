"""A node's local copies of checkpoint files for restore: staging directories shared by the node's ranks, each file
fetched once per node and checked as it streams in, removed when the last user is done or its processes are gone."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Optional

from raytrain import storage
from raytrain.ckpt.layout import hash_file, new_hash

_READ_BLOCK = 16 << 20  # the size of storage's own transfer chunks


def default_local_dir() -> str:
    """The node's largest local disk (instance NVMe where mounted), not the root volume's /tmp."""
    candidates = ["/opt/dlami/nvme", "/mnt/local_ssd", "/local_disk0", "/mnt", os.path.expanduser("~/.cache")]
    best, free = os.path.join(tempfile.gettempdir()), -1
    for c in candidates:
        if os.path.isdir(c) and os.access(c, os.W_OK):
            f = shutil.disk_usage(c).free
            if f > free:
                best, free = c, f
    return os.path.join(best, "raytrain")


def local_root(local_dir: Optional[str]) -> str:
    """The node-local directory for staging (`checkpoint.local_dir`, or the default)."""
    return os.path.expanduser(local_dir) if local_dir else default_local_dir()


def node_id() -> str:
    """This worker's Ray node: its full id. Not Ray Train's node rank, which numbers nodes by IP address (all
    nodes of a simulated cluster share 127.0.0.1), nor a prefix of the id (fake nodes' ids share a long one)."""
    try:
        import ray

        node = ray.get_runtime_context().get_node_id()
        if node:
            return node
    except Exception:  # noqa: BLE001 - outside Ray: one process, one node
        pass
    import socket

    return socket.gethostname()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def remove_stale(root: str) -> None:
    """Delete restore and save staging left by killed processes on this node (their pids are gone)."""
    from filelock import FileLock

    os.makedirs(root, exist_ok=True)
    with FileLock(os.path.join(root, ".lock")):
        rdir = os.path.join(root, "restore")
        for name in os.listdir(rdir) if os.path.isdir(rdir) else []:
            users = os.path.join(rdir, name, ".users")
            pids = [int(p) for p in os.listdir(users) if p.isdigit()] if os.path.isdir(users) else []
            if not any(_alive(p) for p in pids):
                shutil.rmtree(os.path.join(rdir, name), ignore_errors=True)
        sdir = os.path.join(root, "staging")
        for name in os.listdir(sdir) if os.path.isdir(sdir) else []:
            pid = name.split("-", 1)[0]
            if pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(os.path.join(sdir, name), ignore_errors=True)


def stage(root: str, key: str) -> str:
    """This node's staging directory for `key` (a checkpoint URI), with this process registered as a user."""
    from filelock import FileLock

    d = os.path.join(root, "restore", f"{node_id()}-{hashlib.sha1(key.encode()).hexdigest()[:16]}")
    with FileLock(os.path.join(root, ".lock")):
        os.makedirs(os.path.join(d, ".users"), exist_ok=True)
        open(os.path.join(d, ".users", str(os.getpid())), "w").close()
    return d


def release(staged: Optional[str]) -> None:
    """This process is done with a staging directory: the last user on the node removes it."""
    from filelock import FileLock

    if not staged:
        return
    root = os.path.dirname(os.path.dirname(staged))
    with FileLock(os.path.join(root, ".lock")):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(staged, ".users", str(os.getpid())))
        users = os.path.join(staged, ".users")
        if not os.path.isdir(users) or not os.listdir(users):
            shutil.rmtree(staged, ignore_errors=True)


def fetch(uri: str, rel: str, meta: dict, staged: str, deep: bool) -> tuple[bool, int]:
    """One file into the node's staging directory, once per node (the first rank to need it downloads it, hashing
    as it streams; the others reuse its verdict). (good, bytes this rank downloaded)."""
    from filelock import FileLock

    key = hashlib.sha1(rel.encode()).hexdigest()[:20]
    marks = os.path.join(staged, ".verdict")
    os.makedirs(marks, exist_ok=True)
    with FileLock(os.path.join(marks, key + ".lock")):
        for verdict in ("ok", "bad"):
            if os.path.exists(os.path.join(marks, f"{key}.{verdict}")):
                return verdict == "ok", 0
        dest = os.path.join(staged, rel)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        fs, path = storage.resolve(storage.join(uri, rel))
        h, n = new_hash(), 0
        try:
            with fs.open_input_stream(path) as src, open(dest + ".part", "wb") as out:
                while True:
                    block = src.read(_READ_BLOCK)
                    if not block:
                        break
                    h.update(block)
                    out.write(block)
                    n += len(block)
            good = n == meta["size"] and (not deep or h.hexdigest() == meta["sha256"])
        except OSError:
            good = False
        if good:
            os.replace(dest + ".part", dest)
        open(os.path.join(marks, f"{key}.{'ok' if good else 'bad'}"), "w").close()
        return good, n


@dataclass
class Local:
    """Checkpoint files made readable on this node."""

    path: str  # the local directory that holds them (the checkpoint itself when storage is local)
    staged: Optional[str] = None  # this node's staging directory, to `release` when done (remote storage)
    bad: list[str] = field(default_factory=list)  # files that failed their size / sha256 check
    nbytes: int = 0  # bytes this rank downloaded


def make_local(uri: str, files: dict, rels: list[str], *, root: str, deep: bool, key: Optional[str] = None) -> Local:
    """The files `rels` of the checkpoint at `uri` (manifest entries `files`), verified: fetched into the node's
    staging directory `key` (default: the URI) from remote storage, checked in place on local storage."""
    if storage.is_remote(uri):
        out = Local("", stage(root, key or uri))
        out.path = out.staged
        for rel in rels:
            good, n = fetch(uri, rel, files[rel], out.staged, deep)
            out.nbytes += n
            if not good:
                out.bad.append(rel)
        return out
    out = Local(storage.resolve(uri)[1])
    if deep:
        out.bad = [rel for rel in rels if hash_file(os.path.join(out.path, rel)) != files[rel]["sha256"]]
    return out
