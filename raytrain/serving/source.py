"""The MODEL of `raytrain serve` -> an exported model directory and a version name (driver side).

MODEL is an exported model directory (local or s3://), a run directory (its newest complete checkpoint)
or `RUN@TAG` (a tagged version, see `raytrain ckpt tag`). Checkpoints are exported on the fly into
`<run>/exports/<checkpoint>/`, next to the run, so every node of a cluster can read them and a second
`raytrain serve` of the same checkpoint reuses the export.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Optional

from raytrain import storage
from raytrain.errors import UserError

WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


@dataclass
class ServedModel:
    uri: str      # an exported Hugging Face model directory (local path or s3://)
    version: str  # the name every response carries (a tag, the directory's name, or step-N)


def check_model_dir(uri: str) -> None:
    """A one-line UserError unless `uri` holds what serving loads: config, weights and a tokenizer."""
    if not storage.exists(storage.join(uri, "config.json")):
        raise UserError(f"{uri} is not a model directory (no config.json); export one with `raytrain export`")
    if not any(storage.exists(storage.join(uri, w)) for w in WEIGHTS):
        raise UserError(f"{uri} is incomplete: no weights ({' / '.join(WEIGHTS)}); export it again with "
                        f"`raytrain export --force`")
    if not storage.exists(storage.join(uri, "tokenizer.json")):
        raise UserError(f"{uri} is incomplete: no tokenizer.json; export it again with `raytrain export --force`")


def _export_checkpoint(ckpt_uri: str, run_uri: str, log: Callable[[str], None]) -> str:
    from raytrain.export import EXPORT_META, export

    out = storage.join(run_uri, "exports", ckpt_uri.rstrip("/").rsplit("/", 1)[-1])
    meta_uri = storage.join(out, EXPORT_META)
    if storage.exists(meta_uri):
        try:
            same = json.loads(storage.read_text(meta_uri)).get("source_checkpoint") == ckpt_uri
        except ValueError:
            same = False
        if same:
            check_model_dir(out)
            log(f"[raytrain] serving the export of {ckpt_uri} made earlier: {out}")
            return out
    export(ckpt_uri, out, force=True, log=log)
    return out


def resolve(model: str, version: Optional[str] = None, log: Callable[[str], None] = print) -> ServedModel:
    """What to serve for MODEL (see the module docstring); `version` overrides the derived name."""
    from raytrain.ckpt import catalog
    from raytrain.ckpt.layout import MANIFEST

    base, tag = model, None
    if "@" in model.rstrip("/").rsplit("/", 1)[-1]:
        base, tag = model.rsplit("@", 1)
    uri = storage.absolute(base)
    if tag is None and storage.exists(storage.join(uri, "adapter_config.json")):  # `raytrain export --adapter`
        from raytrain import lora

        merged = lora.merged_dir(uri, log)
        check_model_dir(merged)
        return ServedModel(merged, version or uri.rstrip("/").rsplit("/", 1)[-1])
    if tag is None and storage.exists(storage.join(uri, "config.json")):
        check_model_dir(uri)
        return ServedModel(uri, version or uri.rstrip("/").rsplit("/", 1)[-1])
    if tag is None and storage.exists(storage.join(uri, MANIFEST)):  # a checkpoint directory itself
        info = catalog.verify(uri)
        if not info.complete:
            raise UserError(f"checkpoint {uri} is not complete ({info.reason}); pick one from `raytrain ckpt list`")
        return ServedModel(_export_checkpoint(uri, uri.rstrip("/").rsplit("/", 1)[0], log), version or f"step-{info.step}")
    ckpts = catalog.list_checkpoints(uri) if storage.exists(uri) else []
    if not ckpts:
        raise UserError(f"{model}: neither a model directory (no config.json) nor a run directory (no checkpoint_*); "
                        f"pass an exported model, a run or RUN@TAG")
    if tag is not None:
        known = catalog.tags(uri)
        if tag not in known:
            raise UserError(f"no tag {tag!r} in {uri} (tags: {', '.join(sorted(known)) or 'none'}); "
                            f"tag one with `raytrain ckpt tag {uri} {tag}`")
        info = catalog.verify(storage.join(uri, known[tag]["checkpoint"]))
        if not info.complete:
            raise UserError(f"tag {tag!r} names {info.uri}, which is not complete ({info.reason})")
        return ServedModel(_export_checkpoint(info.uri, uri, log), version or tag)
    info = catalog.latest_complete(uri, log=log)
    if info is None:
        raise UserError(f"{uri} has no complete checkpoint to serve; see `raytrain ckpt list {uri}`")
    return ServedModel(_export_checkpoint(info.uri, uri, log), version or f"step-{info.step}")
