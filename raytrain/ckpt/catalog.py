"""The checkpoint catalogue of a run: commit manifests, verification, discovery of the latest complete one,
tags and resume markers, retention.

A checkpoint directory counts only once its `manifest.json` exists and every file it lists is in
storage with the listed size. The manifest is written last, by rank 0, after every rank's upload has
returned, so a crash at any moment leaves either a complete checkpoint or one that is skipped.
Ray Train keeps its own registry too, but a worker that dies right after uploading can leave Ray
without the newest checkpoint; the manifest is what we trust.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from typing import Optional

import pyarrow.fs as pafs
import yaml

from raytrain import storage
from raytrain.rundir import METRICS, SUMMARY, RunDir
from raytrain.ckpt.layout import (CONFIG, MANIFEST, RESUME_MARKER, TAGS_DIR, dir_name, hash_bytes, parse_timestamp,
                                  step_of, timestamp)
from raytrain.errors import UserError

_TAG_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


def commit(ckpt_uri: str, step: int, files: dict[str, dict], extra: Optional[dict] = None) -> None:
    """Write the manifest: from this moment the checkpoint is complete."""
    manifest = {"step": step, "files": files, "committed": timestamp(), **(extra or {})}
    storage.write_text(storage.join(ckpt_uri, MANIFEST), json.dumps(manifest, indent=1, sort_keys=True))
    _advance_resume_marker(ckpt_uri.rstrip("/").rsplit("/", 1)[0], step)


def uncommit(ckpt_uri: str) -> None:
    """Remove a checkpoint's manifest (if any): from this moment it no longer counts."""
    storage.delete_file(storage.join(ckpt_uri, MANIFEST))


def read_manifest(ckpt_uri: str) -> dict:
    """A checkpoint's manifest (ValueError when it is not JSON)."""
    return json.loads(storage.read_text(storage.join(ckpt_uri, MANIFEST)))


@dataclass
class CheckpointInfo:
    uri: str
    step: int
    complete: bool
    reason: str = ""


def verify(ckpt_uri: str, deep: bool = False) -> CheckpointInfo:
    """Is this checkpoint complete? Sizes always; sha256 of every file when deep=True."""
    step = step_of(ckpt_uri)
    if not storage.exists(storage.join(ckpt_uri, MANIFEST)):
        return CheckpointInfo(ckpt_uri, step, False, "no manifest (never committed)")
    try:
        manifest = read_manifest(ckpt_uri)
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
        if deep and hash_bytes(storage.read_bytes(storage.join(ckpt_uri, rel))) != meta["sha256"]:
            return CheckpointInfo(ckpt_uri, step, False, f"{rel} checksum mismatch")
    return CheckpointInfo(ckpt_uri, int(manifest.get("step", step)), True)


def list_checkpoints(run_uri: str) -> list[str]:
    """Checkpoint directory URIs of a run, oldest first."""
    return [storage.join(run_uri, n) for n in storage.list_dir(run_uri) if step_of(n) >= 0]


def _val_ppl(run_uri: str) -> dict[int, float]:
    """{step: validation perplexity} from the run's metrics.jsonl."""
    return {r["step"]: r["val_ppl"] for r in RunDir(run_uri).read_jsonl(METRICS) if "val_ppl" in r and "step" in r}


def describe(run_uri: str, deep: bool = False) -> list[dict]:
    """One row per checkpoint: step, complete, reason, bytes, committed time, val_ppl at that step."""
    val_ppl = _val_ppl(run_uri)
    tagged: dict[str, list[str]] = {}
    for name, rec in tags(run_uri).items():
        tagged.setdefault(rec.get("checkpoint"), []).append(name)
    marker = read_resume_marker(run_uri)
    rows = []
    for uri in list_checkpoints(run_uri):
        info = verify(uri, deep=deep)
        manifest = read_manifest(uri) if info.complete else {}
        rows.append({"checkpoint": uri.rsplit("/", 1)[-1], "step": info.step, "complete": info.complete,
                     "reason": info.reason, "bytes": sum(f["size"] for f in manifest.get("files", {}).values()),
                     "committed": manifest.get("committed"), "val_ppl": val_ppl.get(info.step),
                     "tags": sorted(tagged.get(uri.rsplit("/", 1)[-1], [])),
                     "rollback_target": bool(marker and marker["step"] == info.step)})
    return rows


def _resumable(run_uri: str) -> list[str]:
    """The run's checkpoints, oldest first, capped at the resume marker's step if there is one."""
    marker = read_resume_marker(run_uri)
    uris = list_checkpoints(run_uri)
    return uris if marker is None else [u for u in uris if step_of(u) <= marker["step"]]


def latest_complete(run_uri: str, log=None, deep: bool = False) -> Optional[CheckpointInfo]:
    """The newest checkpoint that verifies (sizes; sha256 too when deep); incomplete or corrupt newer
    ones are skipped with a warning.

    A resume marker (`raytrain ckpt rollback`) caps the search at its step: checkpoints after it are
    kept but not used, by the driver and the workers alike, since both ask here.
    """
    for uri in reversed(_resumable(run_uri)):
        info = verify(uri, deep=deep)
        if info.complete:
            return info
        if log:
            log(f"warning: skipping incomplete checkpoint {uri}: {info.reason}")
    return None


def complete_candidates(run_uri: str, log=None, limit: int = 8) -> list[tuple[str, dict]]:
    """Up to `limit` checkpoints to resume from, newest first, each (URI, manifest): committed, every file present
    with its size, capped by a resume marker. Checksums are the reading ranks' job (raytrain.ckpt.restore)."""
    out = []
    for uri in reversed(_resumable(run_uri)):
        info = verify(uri)
        if info.complete:
            out.append((uri, read_manifest(uri)))
            if len(out) == limit:
                break
        elif log:
            log(f"warning: skipping incomplete checkpoint {uri}: {info.reason}")
    return out


# --- versions: tags and the resume marker ------------------------------------------------------------


def _pick(run_uri: str, step: Optional[int]) -> CheckpointInfo:
    """The complete checkpoint at `step` (None: the newest complete one), or a UserError saying what exists."""
    if step is None:
        info = latest_complete(run_uri)
        if info is None:
            raise UserError(f"{run_uri} has no complete checkpoint")
        return info
    info = verify(storage.join(run_uri, dir_name(step)))
    if not info.complete:
        have = [step_of(u) for u in list_checkpoints(run_uri) if verify(u).complete]
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
    if not _TAG_NAME.match(name):
        raise UserError(f"tag {name!r}: use letters, digits, '.', '_' or '-' (e.g. v1.0)")
    turi = storage.join(run_uri, TAGS_DIR, name + ".json")
    if storage.exists(turi) and not force:
        old = json.loads(storage.read_text(turi))
        raise UserError(f"tag {name!r} already names {old.get('checkpoint')} in {run_uri}; pass --force to move it")
    info = _pick(run_uri, step)
    cfg_uri = storage.join(info.uri, CONFIG)
    config = yaml.safe_load(storage.read_text(cfg_uri)) if storage.exists(cfg_uri) else None
    rec = {"tag": name, "step": info.step, "checkpoint": info.uri.rsplit("/", 1)[-1], "config": config,
           "created": timestamp()}
    storage.write_text(turi, json.dumps(rec, indent=1))
    return rec


def read_resume_marker(run_uri: str) -> Optional[dict]:
    """The marker `raytrain ckpt rollback` wrote ({step, checkpoint, tag, created}), or None."""
    uri = storage.join(run_uri, RESUME_MARKER)
    if not storage.exists(uri):
        return None
    try:
        marker = json.loads(storage.read_text(uri))
        int(marker["step"])
        return marker
    except (ValueError, KeyError, TypeError):
        raise UserError(f"{uri} is damaged; delete it or run `raytrain ckpt rollback` again") from None


def set_resume_marker(run_uri: str, tag_name: Optional[str] = None, step: Optional[int] = None) -> dict:
    """Make the next resume of this run start from a tag or step (`raytrain ckpt rollback`); later checkpoints
    stay (unused) until the run trains past them and overwrites them."""
    if tag_name is not None:
        known = tags(run_uri)
        if tag_name not in known:
            raise UserError(f"no tag {tag_name!r} in {run_uri} (tags: {', '.join(sorted(known)) or 'none'})")
        step = int(known[tag_name]["step"])
    if step is None:
        raise UserError("rollback needs a tag name or --step N")
    info = _pick(run_uri, step)
    marker = {"step": info.step, "checkpoint": info.uri.rsplit("/", 1)[-1], "tag": tag_name, "created": timestamp()}
    storage.write_text(storage.join(run_uri, RESUME_MARKER), json.dumps(marker, indent=1))
    return marker


def clear_resume_marker(run_uri: str) -> None:
    """The run resumes from its newest complete checkpoint again."""
    storage.delete_file(storage.join(run_uri, RESUME_MARKER))


def _advance_resume_marker(run_uri: str, step: int) -> None:
    """After a commit at `step`: a rolled-back run that moved past its marker resumes from its own newest
    checkpoint from now on. The marker follows it while older-timeline checkpoints lie ahead, and goes
    once none does (they are overwritten as the run reaches their steps)."""
    marker = read_resume_marker(run_uri)
    if marker is None or step <= marker["step"]:
        return
    if any(step_of(u) > step for u in list_checkpoints(run_uri)):
        storage.write_text(storage.join(run_uri, RESUME_MARKER), json.dumps(
            {**marker, "step": step, "checkpoint": dir_name(step), "advanced": timestamp()}, indent=1))
    else:
        clear_resume_marker(run_uri)


# --- retention ---------------------------------------------------------------------------------------


def _final(run_uri: str) -> Optional[str]:
    """The checkpoint a finished run ended with (summary.json), if any."""
    ck = (RunDir(run_uri).read_json(SUMMARY) or {}).get("checkpoint")
    return ck.rstrip("/").rsplit("/", 1)[-1] if ck else None


def _age_s(uri: str, now: float) -> Optional[float]:
    try:
        return now - parse_timestamp(read_manifest(uri)["committed"])
    except (ValueError, KeyError):
        return None


def _never_deleted(run_uri: str, *, all_uris: list[str], complete: set, live: list[str], marker: Optional[dict],
                   protect: tuple[str, ...]) -> dict[str, str]:
    """{URI: why kept} for what no retention rule may delete: tagged, final, latest complete, the resume marker's
    target and everything after it, `protect`."""
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
    return kept


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
    marker = read_resume_marker(run_uri)
    cap = marker["step"] if marker else None
    live = [u for u in all_uris if u in complete and (cap is None or step_of(u) <= cap)]
    kept = _never_deleted(run_uri, all_uris=all_uris, complete=complete, live=live, marker=marker, protect=protect)
    if keep_last:
        for u in live[-keep_last:]:
            kept.setdefault(u, f"newest {keep_last}")
    if keep_every:
        for u in live:
            if step_of(u) % keep_every == 0:
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
    return sorted(doomed, key=step_of), kept


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
