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
    from raytrain.console import say

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
            # Parallel extraction of the partitions: the conversion runs once per checkpoint, on one process.
            to_universal(os.path.join(src.path, ENGINE_TAG), os.path.join(out, UNIVERSAL_TAG),
                         workers=max(1, (os.cpu_count() or 2) // 2))
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


def to_universal(engine_dir: str, out_dir: str, *, workers: int = 1) -> None:
    """DeepSpeed's universal-checkpoint converter on a saved engine directory, through its command line (its public
    interface): any world size can load the result, and AutoTP slices come out merged. The one place it is run."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", engine_dir,
           "--output_folder", out_dir, "--num_extract_workers", str(workers), "--num_merge_workers", str(workers),
           "--inject_missing_state"]  # our ZeRO-1/2 saves carry no universal info
    # Its output lists every tensor: kept only for an error.
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"DeepSpeed's universal conversion of {engine_dir} failed (exit {done.returncode}): "
                           + " | ".join(tail))
