"""The checkpoint catalogue of a run: commit manifests, verification, discovery of the latest complete one,
tags and rollback markers, retention.

A checkpoint directory counts only once its `manifest.json` exists and every file it lists is in
storage with the listed size. The manifest is written last, by rank 0, after every rank's upload has
returned, so a crash at any moment leaves either a complete checkpoint or one that is skipped.
Ray Train keeps its own registry too, but a worker that dies right after uploading can leave Ray
without the newest checkpoint; the manifest is what we trust.
"""

from __future__ import annotations

import calendar
import hashlib
import json
import os
import re
import time
from dataclasses import dataclass
from typing import Optional

import pyarrow.fs as pafs
import yaml

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
    _advance_rollback(ckpt_uri.rstrip("/").rsplit("/", 1)[0], step)


def uncommit(ckpt_uri: str) -> None:
    """Remove a checkpoint's manifest (if any): from this moment it no longer counts."""
    storage.delete_file(storage.join(ckpt_uri, MANIFEST))


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
    tagged: dict[str, list[str]] = {}
    for name, rec in tags(run_uri).items():
        tagged.setdefault(rec.get("checkpoint"), []).append(name)
    marker = read_rollback(run_uri)
    rows = []
    for uri in list_checkpoints(run_uri):
        info = verify(uri, deep=deep)
        manifest = {}
        if info.complete:
            manifest = json.loads(storage.read_text(storage.join(uri, MANIFEST)))
        rows.append({"checkpoint": uri.rsplit("/", 1)[-1], "step": info.step, "complete": info.complete,
                     "reason": info.reason, "bytes": sum(f["size"] for f in manifest.get("files", {}).values()),
                     "committed": manifest.get("committed"), "val_ppl": val_ppl.get(info.step),
                     "tags": sorted(tagged.get(uri.rsplit("/", 1)[-1], [])),
                     "rollback_target": bool(marker and marker["step"] == info.step)})
    return rows


def latest_complete(run_uri: str, log=None, deep: bool = False) -> Optional[CheckpointInfo]:
    """The newest checkpoint that verifies (sizes; sha256 too when deep); incomplete or corrupt newer
    ones are skipped with a warning.

    A rollback marker (`raytrain ckpt rollback`) caps the search at its step: checkpoints after it are
    kept but not used, by the driver and the workers alike, since both ask here.
    """
    marker = read_rollback(run_uri)
    uris = list_checkpoints(run_uri)
    if marker is not None:
        uris = [u for u in uris if _step_of(u) <= marker["step"]]
    for uri in reversed(uris):
        info = verify(uri, deep=deep)
        if info.complete:
            return info
        if log:
            log(f"warning: skipping incomplete checkpoint {uri}: {info.reason}")
    return None


def complete_candidates(run_uri: str, log=None, limit: int = 8) -> list[tuple[str, dict]]:
    """Up to `limit` checkpoints to resume from, newest first, each (URI, manifest): committed, every file present
    with its size, capped by a rollback marker. Checksums are the reading ranks' job (raytrain.worker.checkpoint)."""
    marker = read_rollback(run_uri)
    uris = list_checkpoints(run_uri)
    if marker is not None:
        uris = [u for u in uris if _step_of(u) <= marker["step"]]
    out = []
    for uri in reversed(uris):
        info = verify(uri)
        if info.complete:
            out.append((uri, json.loads(storage.read_text(storage.join(uri, MANIFEST)))))
            if len(out) == limit:
                break
        elif log:
            log(f"warning: skipping incomplete checkpoint {uri}: {info.reason}")
    return out


# --- versions: tags and rollback ---------------------------------------------------------------------

TAGS_DIR = "tags"
ROLLBACK = "resume_from.json"
_TAG_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _pick(run_uri: str, step: Optional[int]) -> CheckpointInfo:
    """The complete checkpoint at `step` (None: the newest complete one), or a UserError saying what exists."""
    from raytrain.errors import UserError

    if step is None:
        info = latest_complete(run_uri)
        if info is None:
            raise UserError(f"{run_uri} has no complete checkpoint")
        return info
    uri = storage.join(run_uri, f"checkpoint_{step:08d}")
    info = verify(uri)
    if not info.complete:
        have = [_step_of(u) for u in list_checkpoints(run_uri) if verify(u).complete]
        raise UserError(f"no complete checkpoint at step {step} in {run_uri} ({info.reason}); complete steps: {have}")
    return info


def tags(run_uri: str) -> dict[str, dict]:
    """{tag name: {tag, step, checkpoint, config, created}} of a run."""
    out = {}
    base = storage.join(run_uri, TAGS_DIR)
    for name in storage.list_dir(base):
        if name.endswith(".json"):
            try:
                out[name[:-5]] = json.loads(storage.read_text(storage.join(base, name)))
            except ValueError:
                continue
    return out


def tag(run_uri: str, name: str, step: Optional[int] = None, force: bool = False) -> dict:
    """Name a complete checkpoint (e.g. v1.0). The tag file carries the checkpoint's resolved config, so
    the version is self-describing; tagged checkpoints are never pruned."""
    from raytrain.errors import UserError

    if not _TAG_NAME.match(name):
        raise UserError(f"tag {name!r}: use letters, digits, '.', '_' or '-' (e.g. v1.0)")
    turi = storage.join(run_uri, TAGS_DIR, name + ".json")
    if storage.exists(turi) and not force:
        old = json.loads(storage.read_text(turi))
        raise UserError(f"tag {name!r} already names {old.get('checkpoint')} in {run_uri}; pass --force to move it")
    info = _pick(run_uri, step)
    cfg_uri = storage.join(info.uri, "config.yaml")
    config = yaml.safe_load(storage.read_text(cfg_uri)) if storage.exists(cfg_uri) else None
    rec = {"tag": name, "step": info.step, "checkpoint": info.uri.rsplit("/", 1)[-1], "config": config,
           "created": _now()}
    storage.write_text(turi, json.dumps(rec, indent=1))
    return rec


def read_rollback(run_uri: str) -> Optional[dict]:
    uri = storage.join(run_uri, ROLLBACK)
    if not storage.exists(uri):
        return None
    try:
        marker = json.loads(storage.read_text(uri))
        int(marker["step"])
        return marker
    except (ValueError, KeyError, TypeError):
        from raytrain.errors import UserError

        raise UserError(f"{uri} is damaged; delete it or run `raytrain ckpt rollback` again") from None


def rollback(run_uri: str, tag_name: Optional[str] = None, step: Optional[int] = None) -> dict:
    """Make the next resume of this run start from a tag or step; later checkpoints stay (unused) until
    the run trains past them and overwrites them."""
    from raytrain.errors import UserError

    if tag_name is not None:
        known = tags(run_uri)
        if tag_name not in known:
            raise UserError(f"no tag {tag_name!r} in {run_uri} (tags: {', '.join(sorted(known)) or 'none'})")
        step = int(known[tag_name]["step"])
    if step is None:
        raise UserError("rollback needs a tag name or --step N")
    info = _pick(run_uri, step)
    marker = {"step": info.step, "checkpoint": info.uri.rsplit("/", 1)[-1], "tag": tag_name, "created": _now()}
    storage.write_text(storage.join(run_uri, ROLLBACK), json.dumps(marker, indent=1))
    return marker


def clear_rollback(run_uri: str) -> None:
    storage.delete_file(storage.join(run_uri, ROLLBACK))


def _advance_rollback(run_uri: str, step: int) -> None:
    """After a commit at `step`: a rolled-back run that moved past its marker resumes from its own newest
    checkpoint from now on. The marker follows it while older-timeline checkpoints lie ahead, and goes
    once none does (they are overwritten as the run reaches their steps)."""
    marker = read_rollback(run_uri)
    if marker is None or step <= marker["step"]:
        return
    if any(_step_of(u) > step for u in list_checkpoints(run_uri)):
        storage.write_text(storage.join(run_uri, ROLLBACK), json.dumps(
            {**marker, "step": step, "checkpoint": f"checkpoint_{step:08d}", "advanced": _now()}, indent=1))
    else:
        clear_rollback(run_uri)


def _final(run_uri: str) -> Optional[str]:
    """The checkpoint a finished run ended with (summary.json), if any."""
    suri = storage.join(run_uri, "summary.json")
    try:
        ck = json.loads(storage.read_text(suri)).get("checkpoint") if storage.exists(suri) else None
    except ValueError:
        return None
    return ck.rstrip("/").rsplit("/", 1)[-1] if ck else None


def _age_s(uri: str, now: float) -> Optional[float]:
    try:
        committed = json.loads(storage.read_text(storage.join(uri, MANIFEST)))["committed"]
        return now - calendar.timegm(time.strptime(committed, "%Y-%m-%dT%H:%M:%SZ"))
    except (ValueError, KeyError):
        return None


def retention_plan(run_uri: str, keep_last: Optional[int] = None, keep_every: int = 0,
                   older_than_s: Optional[float] = None, protect: tuple[str, ...] = (),
                   now: Optional[float] = None) -> tuple[list[str], dict[str, str]]:
    """(URIs to delete, {URI: why kept}). A complete checkpoint goes only when it is outside every keep rule:
    not among the newest `keep_last`, not a multiple of `keep_every`, not younger than `older_than_s`.
    Never deleted: tagged, the run's final, the latest complete, the rollback target, anything after the
    rollback target (kept, unused), anything in `protect`. Incomplete checkpoints older than the latest
    complete one are deleted (nothing can resume from them)."""
    now = time.time() if now is None else now
    all_uris = list_checkpoints(run_uri)
    complete = {u for u in all_uris if verify(u).complete}
    marker = read_rollback(run_uri)
    cap = marker["step"] if marker else None
    live = [u for u in all_uris if u in complete and (cap is None or _step_of(u) <= cap)]
    kept: dict[str, str] = {}
    for name, rec in tags(run_uri).items():
        kept.setdefault(storage.join(run_uri, rec.get("checkpoint", "")), f"tagged {name}")
    final = _final(run_uri)
    if final:
        kept.setdefault(storage.join(run_uri, final), "final")
    if live:
        kept.setdefault(live[-1], "latest complete")
    if marker:
        kept.setdefault(storage.join(run_uri, marker["checkpoint"]), "rollback target")
    for u in protect:
        kept.setdefault(u, "protected")
    for u in all_uris:
        if u in complete and u not in live:
            kept.setdefault(u, "after the rollback target (unused)")
    if keep_last:
        for u in live[-keep_last:]:
            kept.setdefault(u, f"newest {keep_last}")
    if keep_every:
        for u in live:
            if _step_of(u) % keep_every == 0:
                kept.setdefault(u, f"step multiple of {keep_every}")
    if older_than_s is not None:
        for u in live:
            age = _age_s(u, now)
            if age is None or age < older_than_s:
                kept.setdefault(u, "younger than the age limit")
    doomed = [u for u in live if u not in kept] if (keep_last or older_than_s is not None) else []
    if live:
        newest = all_uris.index(live[-1])
        doomed += [u for u in all_uris[:newest] if u not in complete and u not in kept]
    return sorted(doomed, key=_step_of), kept


def prune(run_uri: str, keep_last: Optional[int], protect: tuple[str, ...] = (), keep_every: int = 0,
          older_than_s: Optional[float] = None, dry_run: bool = False) -> list[str]:
    """Apply `retention_plan` (see there for what is never deleted). Returns the deleted (or, dry run,
    the would-be deleted) URIs."""
    doomed, _ = retention_plan(run_uri, keep_last, keep_every, older_than_s, protect)
    if dry_run:
        return doomed
    for uri in doomed:
        uncommit(uri)  # manifest first: a half-deleted checkpoint must never look complete
        fs, path = storage.resolve(uri)
        try:
            fs.delete_dir(path)
        except OSError:
            pass
    return doomed
