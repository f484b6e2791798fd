"""A model's lineage (run, checkpoint, config, data manifests, tokenizer, raw inputs, packages, base model) and which of its inputs changed since."""

from __future__ import annotations

import hashlib
import json
import os
from importlib import metadata
from typing import Iterator, Optional

import pyarrow.fs as pafs
import yaml

from raytrain import storage
from raytrain.ckpt import catalog
from raytrain.ckpt.layout import CONFIG, STATE
from raytrain.data.corpus import BUILTIN
from raytrain.data.manifest import MANIFEST
from raytrain.errors import UserError

LINEAGE = "lineage.json"  # in an exported model directory, beside raytrain_export.json
MODEL_AT = "_read_from"  # resolve(): the model directory a lineage was read from (never written)
VERSION = 1
PACKAGES = ("raytrain", "torch", "ray", "deepspeed", "transformers")
CHANGED = ("changed", "missing", "unreadable", "edited")  # verify() statuses: "not what the model was trained on"
_BLOCK = 1 << 20


# --- building --------------------------------------------------------------------------------------------


def build(ckpt_uri: str, tokenizer_uri: Optional[str] = None) -> dict:
    """The lineage of a complete checkpoint, as `raytrain export` writes it (`tokenizer_uri`: export's --tokenizer;
    default: the training data's)."""
    from raytrain.config import Config

    ckpt_uri = storage.absolute(ckpt_uri)
    info = catalog.verify(ckpt_uri)
    if not info.complete:
        raise UserError(f"checkpoint {ckpt_uri} is not complete ({info.reason}); pick one from `raytrain ckpt list`")
    config_bytes = storage.read_bytes(storage.join(ckpt_uri, CONFIG))
    cfg = Config.model_validate(yaml.safe_load(config_bytes))
    step = json.loads(storage.read_text(storage.join(ckpt_uri, STATE)))["step"]
    data, tokenizers = [], []
    for role, source, uri in splits_of(cfg.data):
        entry, tok = split_entry(role, source, uri)
        data.append(entry)
        tokenizers.append(tok)
    tok = tokenizer_uri or next((t for t in tokenizers if t), None)
    lin = {"version": VERSION, "run": {"name": cfg.run.name, "uri": ckpt_uri.rsplit("/", 1)[0]},
           "checkpoint": {"uri": ckpt_uri, "step": step},
           "config": {"sha256": hashlib.sha256(config_bytes).hexdigest(), "yaml": config_bytes.decode("utf-8")},
           "data": data, "tokenizer": file_entry(storage.absolute(tok)) if tok else None,
           "packages": package_versions(), "base": base_entry(cfg.model.init_from)}
    lin["id"] = lineage_id(lin)
    return lin


def lineage_id(lin: dict) -> str:
    """Short sha256 of the lineage's canonical JSON (without its id)."""
    canon = json.dumps({k: v for k, v in lin.items() if k not in ("id", MODEL_AT)}, sort_keys=True,
                       separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()[:16]


def splits_of(data_cfg) -> list[tuple[str, Optional[str], str]]:
    """(role, mixture source name or None, URI) of every split the config trains or validates on."""
    out = []
    if isinstance(data_cfg.train, list):
        for s in data_cfg.train:
            out.append(("train", s.name, s.path))
            if s.val:
                out.append(("val", s.name, s.val))
    elif data_cfg.train:
        out.append(("train", None, data_cfg.train))
    if data_cfg.val:
        out.append(("val", None, data_cfg.val))
    return [(role, name, storage.absolute(uri)) for role, name, uri in out]


def split_entry(role: str, source: Optional[str], uri: str) -> tuple[dict, Optional[str]]:
    """A split's record (its manifest's sha256 and the raw inputs the manifest lists; inputs None when it was
    prepared without provenance or cannot be read) and the URI of its tokenizer."""
    muri = storage.join(uri, MANIFEST)
    entry = {"role": role, "source": source, "uri": uri, "manifest": {"uri": muri, "bytes": None, "sha256": None},
             "inputs": None}
    try:
        raw = storage.read_bytes(muri)
        m = json.loads(raw)
    except (UserError, ValueError) as e:
        entry["note"] = f"manifest not readable: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        return entry, None
    entry["manifest"].update(bytes=len(raw), sha256=hashlib.sha256(raw).hexdigest())
    prov = m.get("provenance") if isinstance(m, dict) else None
    if isinstance(prov, dict) and isinstance(prov.get("inputs"), list):
        max_chars = (m.get("prepare") or {}).get("max_chars")
        entry["inputs"] = [_input(i, max_chars) for i in prov["inputs"] if isinstance(i, dict)]
    else:
        entry["note"] = "prepared without provenance: its raw inputs are unknown (prepare it again to record them)"
    tok = str(m.get("tokenizer", "../tokenizer.json"))  # relative to the split, as raytrain.data.manifest reads it
    tok_uri = storage.join(uri.rsplit("/", 1)[0], tok[3:]) if tok.startswith("../") else storage.join(uri, tok)
    return entry, tok_uri


def _input(rec: dict, max_chars: Optional[int]) -> dict:
    """A manifest's provenance input as the lineage keeps it; the built-in corpus with the size it was cut at."""
    out = {k: v for k, v in rec.items() if k in ("uri", "bytes", "sha256", "python", "max_chars")}
    if out.get("uri") in BUILTIN and "max_chars" not in out and max_chars is not None:
        out["max_chars"] = max_chars
    return out


def file_entry(uri: str) -> dict:
    """{uri, bytes, sha256} of a file as it is now (bytes and sha256 None when it cannot be read)."""
    got = digest(uri)
    return {"uri": uri, "bytes": got.get("bytes"), "sha256": got.get("sha256")}


def package_versions() -> dict[str, Optional[str]]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def base_entry(init_from: Optional[str]) -> Optional[dict]:
    """A fine-tune's base model (model.init_from) with its own lineage embedded when it has one; None otherwise."""
    if not init_from:
        return None
    uri = storage.absolute(init_from)
    lin = read(uri)
    return {"uri": uri, "id": lin.get("id") if lin else None, "lineage": lin}


# --- reading ---------------------------------------------------------------------------------------------


def write(model_dir: str, lin: dict) -> str:
    """lineage.json into a local model directory, once every other file of it is there: it lists their sizes and
    sha256 (`weights`: the weights, config and tokenizer as exported) and its id covers them, so a replaced weight
    file is found, and so is a lineage.json rewritten to match it (its id then differs from the export's audit
    record's). Sets lin's `weights` and `id`; returns the path."""
    # Not the export's own metadata (raytrain_export.json: when it was made): two exports of one checkpoint are one
    # model, with one id (`raytrain serve` exports a run's checkpoint itself and names the same lineage).
    skip = {LINEAGE, "raytrain_export.json"}
    lin["weights"] = {os.path.relpath(os.path.join(root, f), model_dir): digest(os.path.join(root, f))
                      for root, _, files in os.walk(model_dir) for f in sorted(files)
                      if os.path.relpath(os.path.join(root, f), model_dir) not in skip}
    lin["id"] = lineage_id(lin)
    path = os.path.join(model_dir, LINEAGE)
    with open(path, "w") as f:
        json.dump(lin, f, indent=1)
    return path


def read(model_uri: str) -> Optional[dict]:
    """A model directory's lineage.json (local or s3://); None when it has none. A torn one is a one-line error."""
    uri = storage.join(model_uri, LINEAGE)
    if not storage.exists(uri):
        return None
    try:
        lin = json.loads(storage.read_text(uri))
    except ValueError:
        raise UserError(f"{uri} is not valid JSON; export the model again with `raytrain export --force`") from None
    if not isinstance(lin, dict) or "id" not in lin:
        raise UserError(f"{uri} is not a raytrain lineage; export the model again with `raytrain export --force`")
    return lin


def model_id(model_uri: str) -> Optional[str]:
    """The lineage id of a model directory, None when it has none (or it cannot be read): for display only."""
    try:
        lin = read(model_uri)
    except UserError:
        return None
    return lin.get("id") if lin else None


def resolve(target: str) -> tuple[dict, str]:
    """(lineage, what it is) of an exported model directory, a checkpoint, a run directory (its newest complete
    checkpoint) or RUN@TAG; nothing is exported. One-line UserError for anything else. An exported model's lineage
    carries where it was read (`MODEL_AT`, not part of it) for the checks of its own files."""
    base, tag = target, None
    if "@" in target.rstrip("/").rsplit("/", 1)[-1]:
        base, tag = target.rsplit("@", 1)
    uri = storage.absolute(base)
    if not storage.exists(uri):
        raise UserError(f"{target}: not found; pass an exported model directory or a run directory")
    if tag is None:
        lin = read(uri)
        if lin is not None:
            return {**lin, MODEL_AT: uri}, f"model {uri}"
        if any(storage.exists(storage.join(uri, f)) for f in ("config.json", "adapter_config.json")):
            raise UserError(f"{uri} is a model exported without lineage (no {LINEAGE}); export its checkpoint again "
                            f"with `raytrain export --force`, or pass its run directory")
        if storage.exists(storage.join(uri, CONFIG)) and storage.exists(storage.join(uri, STATE)):
            return build(uri), f"checkpoint {uri}"
    if not catalog.list_checkpoints(uri):
        raise UserError(f"{target}: neither an exported model ({LINEAGE}) nor a run directory (checkpoint_*); pass "
                        f"the --out of `raytrain export` or a run directory")
    if tag is not None:
        known = catalog.tags(uri)
        if tag not in known:
            raise UserError(f"no tag {tag!r} in {uri} (tags: {', '.join(sorted(known)) or 'none'})")
        return build(storage.join(uri, known[tag]["checkpoint"])), f"run {uri} tag {tag}"
    info = catalog.latest_complete(uri)
    if info is None:
        raise UserError(f"{uri} has no complete checkpoint; see `raytrain ckpt list {uri}`")
    return build(info.uri), f"run {uri} (newest complete checkpoint)"


# --- checking --------------------------------------------------------------------------------------------


def digest(uri: str) -> dict:
    """{bytes, sha256} of a file now, streamed through storage (local or s3://); {"status": "missing"} or
    {"status": "unreadable", "detail": ...} when it cannot be hashed."""
    try:
        fs, path = storage.resolve(uri)
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            return {"status": "missing"}
        if info.type != pafs.FileType.File:
            return {"status": "unreadable", "detail": "not a file"}
        h, n = hashlib.sha256(), 0
        with fs.open_input_stream(path) as f:
            while True:
                block = f.read(_BLOCK)
                if not block:
                    break
                h.update(block)
                n += len(block)
        return {"bytes": n, "sha256": h.hexdigest()}
    except (OSError, UserError) as e:
        e = (storage.access_denied(uri, e) or e) if isinstance(e, OSError) else e
        return {"status": "unreadable", "detail": (str(e).strip().splitlines() or [type(e).__name__])[0]}


def _builtin_now(rec: dict) -> dict:
    """The built-in corpus as this Python builds it ({"status": "unknown"} when that cannot be told)."""
    try:
        from raytrain.data.provenance import builtin_digest
    except ImportError:
        return {"status": "unknown", "detail": "this raytrain cannot hash the built-in corpus"}
    if rec.get("max_chars") is None:
        return {"status": "unknown", "detail": "the size it was cut at is not recorded"}
    got = builtin_digest(rec["max_chars"])
    sha = got.get("sha256") if isinstance(got, dict) else got
    return {"sha256": sha, "python": got.get("python") if isinstance(got, dict) else None}


def recorded(lin: dict, where: str = "") -> Iterator[tuple[str, str, dict]]:
    """(kind, where, record) of everything the lineage vouches for, its base's chain included: kind is input,
    manifest, tokenizer or base; where names the run ("ft" or "ft > base run")."""
    where = f"{where} > {lin['run']['name']}" if where else lin["run"]["name"]
    for rel, rec in sorted((lin.get("weights") or {}).items()) if lin.get(MODEL_AT) else ():
        yield "weights", where, {**rec, "uri": storage.join(lin[MODEL_AT], rel)}
    for split in lin.get("data", []):
        if split["manifest"].get("sha256"):
            yield "manifest", where, split["manifest"]
        for rec in split.get("inputs") or []:
            yield "input", where, rec
    if lin.get("tokenizer") and lin["tokenizer"].get("sha256"):
        yield "tokenizer", where, lin["tokenizer"]
    base = lin.get("base")
    if base:
        yield "base", where, base
        if base.get("lineage"):
            yield from recorded(base["lineage"], where)


def unknown(lin: dict, where: str = "") -> list[dict]:
    """The splits (base chain included) whose raw inputs are not known, and bases without a lineage."""
    where = f"{where} > {lin['run']['name']}" if where else lin["run"]["name"]
    out = [{"where": where, "uri": s["uri"], "detail": s.get("note", "")} for s in lin.get("data", [])
           if s.get("inputs") is None]
    base = lin.get("base")
    if base and base.get("lineage"):
        out += unknown(base["lineage"], where)
    elif base:
        out.append({"where": where, "uri": base["uri"], "detail": f"base model without {LINEAGE}"})
    return out


def verify(lin: dict) -> list[dict]:
    """Every recorded input, manifest, tokenizer and base (recursively) with its status now: ok, changed, missing,
    unreadable or unknown; {kind, where, uri, status, was, now, detail}. Each URI is read once."""
    out, seen = [], {}
    for kind, where, rec in recorded(lin):
        key = (kind, rec.get("uri"))
        if key not in seen:
            seen[key] = _status(kind, rec)
        out.append({"kind": kind, "where": where, "uri": rec.get("uri"), **seen[key]})
    return out


def check(lin: dict) -> list[dict]:
    """What changed since the lineage was recorded (its base chain included): verify()'s records that are
    changed, missing or unreadable, one per URI, and an exported model's lineage.json edited (integrity)."""
    out, seen = integrity(lin), set()
    for r in verify(lin):
        if r["status"] in CHANGED and (r["kind"], r["uri"]) not in seen:
            seen.add((r["kind"], r["uri"]))
            out.append(r)
    return out


def integrity(lin: dict) -> list[dict]:
    """An exported model's lineage.json against itself (its id is the hash of its content) and against the export's
    audit record in its run (the lineage id written when it was exported): [{kind: lineage, status: edited, ...}]."""
    at = lin.get(MODEL_AT)
    if not at:
        return []
    uri, out = storage.join(at, LINEAGE), []
    bad = lambda detail: {"kind": "lineage", "where": lin["run"]["name"], "uri": uri, "status": "edited",  # noqa: E731
                          "was": None, "now": None, "detail": detail}
    if lineage_id(lin) != lin["id"]:
        out.append(bad(f"its id {lin['id']} is not the hash of its content ({lineage_id(lin)})"))
    from raytrain import audit

    exports = [r for r in audit.read(audit.run_root(lin["run"]["uri"])) + audit.read(
               audit.legacy_run_root(lin["run"]["uri"])) if r.get("kind") == "export"
               and storage.absolute(str(r.get("out", ""))).rstrip("/") == at.rstrip("/")]
    if exports and all(r.get("lineage") != lin["id"] for r in exports):
        out.append(bad(f"the export's audit record names lineage {exports[-1].get('lineage')}, {LINEAGE} "
                       f"{lin['id']}: it was rewritten after the export"))
    return out


def _status(kind: str, rec: dict) -> dict:
    if kind == "base":
        return _base_status(rec)
    was = {k: rec.get(k) for k in ("bytes", "sha256")}
    now = _builtin_now(rec) if rec.get("uri") in BUILTIN else digest(rec["uri"])
    if "status" in now:
        return {"status": now["status"], "was": was, "now": None, "detail": now.get("detail", "")}
    same = now["sha256"] == rec.get("sha256") and (now.get("bytes") is None or rec.get("bytes") is None
                                                    or now["bytes"] == rec["bytes"])
    detail = ""
    if not same and rec.get("uri") in BUILTIN:
        detail = (f"the built-in corpus of Python {now.get('python')} differs from that of Python {rec.get('python')}"
                  if now.get("python") != rec.get("python") else "the built-in corpus differs")
    return {"status": "ok" if same else "changed", "was": was, "now": now, "detail": detail}


def _base_status(rec: dict) -> dict:
    """A base model is unchanged while its lineage.json still has the id the fine-tune recorded."""
    was = {"id": rec.get("id")}
    if not storage.exists(rec["uri"]):
        return {"status": "missing", "was": was, "now": None, "detail": "the base model directory is gone"}
    if rec.get("id") is None:
        return {"status": "unknown", "was": was, "now": None, "detail": f"base model without {LINEAGE}"}
    try:
        lin = read(rec["uri"])
    except UserError as e:
        return {"status": "unreadable", "was": was, "now": None, "detail": str(e)}
    now = lin.get("id") if lin else None
    if now != rec["id"]:
        return {"status": "changed", "was": was, "now": {"id": now}, "detail": f"its {LINEAGE} now has id {now}"}
    # By content too: the base's files as its lineage (embedded when the fine-tune was exported) listed them.
    for rel, want in sorted(((rec.get("lineage") or {}).get("weights") or {}).items()):
        got = digest(storage.join(rec["uri"], rel))
        if got.get("sha256") != want.get("sha256"):
            return {"status": "changed", "was": was, "now": {"id": now}, "detail": f"its file {rel} "
                    + (f"is {got['status']}" if "status" in got else "has other content")}
    return {"status": "ok", "was": was, "now": {"id": now}, "detail": ""}
