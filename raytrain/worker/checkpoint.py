"""The one checkpoint path: every piece of resumable state is saved and restored here.

A checkpoint directory holds:
    engine/ + latest            DeepSpeed engine state (model, optimizer, LR scheduler), all ranks' shards
    rng/rank_NNNNN.pt           each rank's Python / NumPy / torch RNG state
    raytrain_state.json         step, samples_seen (the data position), tokens_seen, world size
    config.yaml                 the resolved config of the run that wrote it
    manifest.json               written last: every file with size and sha256 (see raytrain.checkpoints)
Each rank writes its part to a local directory, hashes it, and hands it to `ray.train.report`, which
uploads all ranks' parts into one directory in storage. When every rank's upload has returned, rank 0
writes the manifest: the checkpoint is committed. Resume always takes the newest committed one.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np
import torch

ENGINE_TAG = "engine"
STATE = "raytrain_state.json"
CONFIG = "config.yaml"


@dataclass
class TrainState:
    step: int = 0  # optimizer steps completed
    samples_seen: int = 0  # position in the global sample stream
    tokens_seen: int = 0
    world_size: int = 1
    restarts: int = 0
    global_batch: int = 0  # sequences per step when saved; a resized resume keeps it


def dir_name(step: int) -> str:
    return f"checkpoint_{step:08d}"


def _rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _set_rng_state(s: dict) -> None:
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    if s.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def save(engine, state: TrainState, config_yaml: str, rank: int, metrics: dict, run_uri: str, keep_last: int,
         keep_every: int = 0) -> str:
    """Collective: every rank must call it at the same step. Returns the checkpoint's directory name."""
    import ray.train
    import torch.distributed as dist

    from raytrain import checkpoints, storage

    with tempfile.TemporaryDirectory(prefix="raytrain-ckpt-") as d:
        engine.save_checkpoint(d, tag=ENGINE_TAG)
        os.makedirs(os.path.join(d, "rng"), exist_ok=True)
        torch.save(_rng_state(), os.path.join(d, "rng", f"rank_{rank:05d}.pt"))
        if rank == 0:
            with open(os.path.join(d, STATE), "w") as f:
                json.dump(asdict(state), f)
            with open(os.path.join(d, CONFIG), "w") as f:
                f.write(config_yaml)
        name = dir_name(state.step)
        files = checkpoints.hash_local_files(d)
        if rank == 0:
            # A directory of this name can exist from an earlier attempt; its old manifest must not
            # vouch for the files about to be overwritten.
            checkpoints.uncommit(storage.join(run_uri, name))
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d), checkpoint_dir_name=name)
    # Each rank's report returns after its own upload; gathering afterwards is the barrier that
    # proves all uploads are done before the manifest makes the checkpoint count.
    gathered = [None] * dist.get_world_size() if dist.is_initialized() else [files]
    if dist.is_initialized():
        dist.all_gather_object(gathered, files)
    if rank == 0:
        merged = {k: v for per_rank in gathered for k, v in per_rank.items()}
        uri = storage.join(run_uri, name)
        checkpoints.commit(uri, state.step, merged, {"world_size": state.world_size,
                                                     "global_batch": state.global_batch})
        checkpoints.prune(run_uri, keep_last, protect=(uri,), keep_every=keep_every)
    return name


def find_resume_point(run_uri: str, rank: int):
    """Rank 0 picks the newest committed checkpoint and every rank gets the same answer."""
    import torch.distributed as dist

    from raytrain import checkpoints
    from raytrain.worker.runlog import say

    choice = [None]
    if rank == 0:
        info = checkpoints.latest_complete(run_uri, log=say)
        choice[0] = info.uri if info else None
    if dist.is_initialized():
        dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return None
    import ray.train

    from raytrain import storage

    fs, path = storage.resolve(choice[0])
    return ray.train.Checkpoint(path=path, filesystem=fs)


def peek_state(checkpoint) -> TrainState:
    """Only the counters of a checkpoint (a few bytes), read before the engine is built."""
    with checkpoint.filesystem.open_input_stream(f"{checkpoint.path}/{STATE}") as f:
        return TrainState(**json.loads(f.read()))


def _to_universal(ckpt_dir: str, out_dir: str) -> str:
    """Convert the saved engine state to DeepSpeed's universal format (any world size can load it)."""
    import argparse
    import contextlib
    import io

    from deepspeed.checkpoint import ds_to_universal

    target = os.path.join(out_dir, ENGINE_TAG + "_universal")
    args = argparse.Namespace(input_folder=os.path.join(ckpt_dir, ENGINE_TAG), output_folder=target,
                              num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                              inject_missing_state=True)  # our ZeRO-1/2 saves carry no universal info
    with contextlib.redirect_stdout(io.StringIO()):  # the converter prints every tensor
        ds_to_universal.main(args)
    return os.path.basename(target)


def restore(engine, checkpoint, rank: int, world_size: int) -> TrainState:
    """Load engine, RNG and counters from a checkpoint. Collective across ranks.

    Written by another number of workers: the engine state is converted to DeepSpeed's universal
    checkpoint format and loaded from there (the engine must be built with `load_universal`).
    """
    with checkpoint.as_directory() as d:
        with open(os.path.join(d, STATE)) as f:
            state = TrainState(**json.load(f))
        if state.world_size != world_size:
            with tempfile.TemporaryDirectory(prefix="raytrain-universal-") as u:
                tag = _to_universal(d, u)
                path, _ = engine.load_checkpoint(u, tag=tag)
        else:
            path, _ = engine.load_checkpoint(d, tag=ENGINE_TAG)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load the engine state in {checkpoint.path}")
        # RNG streams belong to ranks; after a resize, ranks without a saved stream keep their seed.
        rng_file = os.path.join(d, "rng", f"rank_{rank:05d}.pt")
        if os.path.exists(rng_file):
            _set_rng_state(torch.load(rng_file, weights_only=False))
    state.world_size = world_size
    return state
