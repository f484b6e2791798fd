"""Resized resumes: a checkpoint's DeepSpeed universal form (any world size can load it), converted once and kept
beside the checkpoint in storage."""

from __future__ import annotations

import json
import os
import tempfile
import time

from raytrain import storage
from raytrain.rundir import RunDir
from raytrain.ckpt.layout import CONVERSIONS, ENGINE_TAG, MANIFEST, UNIVERSAL, UNIVERSAL_TAG, hash_local_files
from raytrain.ckpt.node_cache import make_local, release


def ensure_universal(run_uri: str, uri: str, files: dict, *, root: str, deep: bool, from_world: int,
                     to_world: int) -> dict:
    """{"files": manifest of <checkpoint>/universal} - converted now if no earlier resize did it - or
    {"bad": [...]} when the checkpoint's partitions fail verification. One process runs it (rank 0)."""
    from raytrain.worker.runlog import say

    muri = storage.join(uri, UNIVERSAL, MANIFEST)
    if storage.exists(muri):
        return {"files": json.loads(storage.read_text(muri))["files"]}
    t0 = time.perf_counter()
    engine_files = sorted(k for k in files if k.startswith(ENGINE_TAG + "/"))
    src = make_local(uri, files, engine_files, root=root, deep=deep, key=uri + "#convert")
    try:
        if src.bad:
            return {"bad": src.bad}
        os.makedirs(root, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="universal-", dir=root) as out:
            _to_universal(src.path, out)
            ufiles = hash_local_files(out)
            storage.upload_dir(out, storage.join(uri, UNIVERSAL))
        # Written last, like a checkpoint's manifest: a conversion cut short is redone, never half-used.
        storage.write_text(muri, json.dumps({"files": ufiles, "from_world": from_world}, indent=1))
    finally:
        release(src.staged)
    secs = time.perf_counter() - t0
    name = uri.rsplit("/", 1)[-1]
    say(f"universal conversion of {name} (written by {from_world} workers, resumed on {to_world}): {secs:.1f}s, "
        f"kept in {name}/{UNIVERSAL} for later resizes")
    RunDir(run_uri).append_jsonl(CONVERSIONS, {"checkpoint": name, "from_world": from_world,
                                                       "to_world": to_world, "s": round(secs, 3),
                                                       "time": round(time.time(), 3)})
    return {"files": ufiles}


def universal_files(files: dict, universal: dict) -> dict:
    """What ranks read on a resized resume: the checkpoint's files with the universal form in place of the
    engine's partitions."""
    return {**{k: v for k, v in files.items() if not k.startswith(ENGINE_TAG + "/")},
            **{f"{UNIVERSAL}/{k}": v for k, v in universal.items()}}


def _to_universal(ckpt_dir: str, out_dir: str) -> str:
    """Convert the saved engine state to DeepSpeed's universal format (any world size can load it)."""
    import argparse
    import contextlib
    import io

    from deepspeed.checkpoint import ds_to_universal

    target = os.path.join(out_dir, UNIVERSAL_TAG)
    # Parallel extraction of the partitions: the conversion runs once per checkpoint, on one process.
    workers = max(1, (os.cpu_count() or 2) // 2)
    args = argparse.Namespace(input_folder=os.path.join(ckpt_dir, ENGINE_TAG), output_folder=target,
                              num_extract_workers=workers, num_merge_workers=workers, keep_temp_folder=False,
                              strict=True, inject_missing_state=True)  # our ZeRO-1/2 saves carry no universal info
    with contextlib.redirect_stdout(io.StringIO()):  # the converter prints every tensor
        ds_to_universal.main(args)
    return os.path.basename(target)
