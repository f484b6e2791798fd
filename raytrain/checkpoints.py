"""The checkpoint catalogue of a run: commit manifests, verification, discovery of the latest complete one, retention.

A checkpoint directory counts only once its `manifest.json` exists and every file it lists is in
storage with the listed size. The manifest is written last, by rank 0, after every rank's upload has
returned, so a crash at any moment leaves either a complete checkpoint or one that is skipped.
Ray Train keeps its own registry too, but a worker that dies right after uploading can leave Ray
without the newest checkpoint; the manifest is what we trust.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass
from typing import Optional

import pyarrow.fs as pafs

from raytrain import storage

MANIFEST = "manifest.json"
_NAME = re.compile(r"^checkpoint_(\d{8})$")


def hash_local_files(root: str) -> dict[str, dict]:
    """{relative path: {size, sha256}} for every file under a local directory."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            out[os.path.relpath(path, root)] = {"size": os.path.getsize(path), "sha256": h.hexdigest()}
    return out


def commit(ckpt_uri: str, step: int, files: dict[str, dict], extra: Optional[dict] = None) -> None:
    """Write the manifest: from this moment the checkpoint is complete."""
    manifest = {"step": step, "files": files, "committed": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                **(extra or {})}
    storage.write_text(storage.join(ckpt_uri, MANIFEST), json.dumps(manifest, indent=1, sort_keys=True))


def uncommit(ckpt_uri: str) -> None:
    """Remove a checkpoint's manifest (if any): from this moment it no longer counts."""
    fs, path = storage.resolve(storage.join(ckpt_uri, MANIFEST))
    try:
        fs.delete_file(path)
    except (FileNotFoundError, OSError):
        pass


def _step_of(uri: str) -> int:
    m = _NAME.match(uri.rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m else -1


@dataclass
class CheckpointInfo:
    uri: str
    step: int
    complete: bool
    reason: str = ""


def verify(ckpt_uri: str, deep: bool = False) -> CheckpointInfo:
    """Is this checkpoint complete? Sizes always; sha256 of every file when deep=True."""
    step = _step_of(ckpt_uri)
    murl = storage.join(ckpt_uri, MANIFEST)
    if not storage.exists(murl):
        return CheckpointInfo(ckpt_uri, step, False, "no manifest (never committed)")
    try:
        manifest = json.loads(storage.read_text(murl))
        files = manifest["files"]
    except (ValueError, KeyError) as e:
        return CheckpointInfo(ckpt_uri, step, False, f"unreadable manifest ({e})")
    fs, base = storage.resolve(ckpt_uri)
    present = {os.path.relpath(i.path, base): i.size
               for i in fs.get_file_info(pafs.FileSelector(base, recursive=True)) if i.type == pafs.FileType.File}
    for rel, meta in files.items():
        if rel not in present:
            return CheckpointInfo(ckpt_uri, step, False, f"missing {rel}")
        if present[rel] != meta["size"]:
            return CheckpointInfo(ckpt_uri, step, False, f"{rel} has {present[rel]} bytes, manifest says {meta['size']}")
        if deep:
            digest = hashlib.sha256(storage.read_bytes(storage.join(ckpt_uri, rel))).hexdigest()
            if digest != meta["sha256"]:
                return CheckpointInfo(ckpt_uri, step, False, f"{rel} checksum mismatch")
    return CheckpointInfo(ckpt_uri, int(manifest.get("step", step)), True)


def list_checkpoints(run_uri: str) -> list[str]:
    """Checkpoint directory URIs of a run, oldest first."""
    return [storage.join(run_uri, n) for n in storage.list_dir(run_uri) if _NAME.match(n)]


def describe(run_uri: str, deep: bool = False) -> list[dict]:
    """One row per checkpoint: step, complete, reason, bytes, committed time, val_ppl at that step."""
    val_ppl = {}
    murl = storage.join(run_uri, "metrics.jsonl")
    if storage.exists(murl):
        for line in storage.read_text(murl).splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if "val_ppl" in rec:
                val_ppl[rec["step"]] = rec["val_ppl"]
    rows = []
    for uri in list_checkpoints(run_uri):
        info = verify(uri, deep=deep)
        manifest = {}
        if info.complete:
            manifest = json.loads(storage.read_text(storage.join(uri, MANIFEST)))
        rows.append({"checkpoint": uri.rsplit("/", 1)[-1], "step": info.step, "complete": info.complete,
                     "reason": info.reason, "bytes": sum(f["size"] for f in manifest.get("files", {}).values()),
                     "committed": manifest.get("committed"), "val_ppl": val_ppl.get(info.step)})
    return rows


def latest_complete(run_uri: str, log=None) -> Optional[CheckpointInfo]:
    """The newest checkpoint that verifies; incomplete newer ones are skipped with a warning."""
    for uri in reversed(list_checkpoints(run_uri)):
        info = verify(uri)
        if info.complete:
            return info
        if log:
            log(f"warning: skipping incomplete checkpoint {uri}: {info.reason}")
    return None


def prune(run_uri: str, keep_last: int, protect: tuple[str, ...] = (), keep_every: int = 0) -> list[str]:
    """Delete complete checkpoints beyond the newest `keep_last` (except every `keep_every`-th step), and
    incomplete ones older than the newest complete one (nothing can resume from them); never a
    protected one. Returns deleted URIs."""
    all_uris = list_checkpoints(run_uri)
    complete = [u for u in all_uris if verify(u).complete]
    doomed = complete[:-keep_last] if keep_last > 0 else []
    if keep_every:
        doomed = [u for u in doomed if _step_of(u) % keep_every]
    if complete:
        newest = all_uris.index(complete[-1])
        doomed += [u for u in all_uris[:newest] if u not in complete]
    doomed = [u for u in doomed if u not in protect]
    for uri in doomed:
        uncommit(uri)  # manifest first: a half-deleted checkpoint must never look complete
        fs, path = storage.resolve(uri)
        try:
            fs.delete_dir(path)
        except OSError:
            pass
    return doomed
