"""The one checkpoint path: every piece of resumable state is saved and restored here.

A checkpoint directory holds:
    engine/ + latest            DeepSpeed engine state (model, optimizer, LR scheduler), all ranks' shards
    rng/rank_NNNNN.pt           each rank's Python / NumPy / torch RNG state
    raytrain_state.json         step, samples_seen (the data position), tokens_seen, world size
    config.yaml                 the resolved config of the run that wrote it
Each rank writes its part to a local directory and hands it to `ray.train.report`, which uploads all
ranks' parts into one directory in storage and registers the checkpoint only when every rank's
upload is done (Ray Train persists that registry, so a resubmitted run resumes from it).
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


def save(engine, state: TrainState, config_yaml: str, rank: int, metrics: dict) -> str:
    """Collective: every rank must call it at the same step. Returns the checkpoint's directory name."""
    import ray.train

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
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d), checkpoint_dir_name=name)
    return name


def restore(engine, checkpoint, rank: int, world_size: int) -> Optional[TrainState]:
    """Load engine, RNG and counters from a Ray checkpoint. Collective across ranks."""
    from raytrain.errors import UserError

    with checkpoint.as_directory() as d:
        with open(os.path.join(d, STATE)) as f:
            state = TrainState(**json.load(f))
        if state.world_size != world_size:
            raise UserError(
                f"checkpoint {checkpoint.path} was written by {state.world_size} workers, this run has {world_size}; "
                f"resume with scaling.num_workers={state.world_size}"
            )
        path, _ = engine.load_checkpoint(d, tag=ENGINE_TAG)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load the engine state in {checkpoint.path}")
        rng_file = os.path.join(d, "rng", f"rank_{rank:05d}.pt")
        if os.path.exists(rng_file):
            _set_rng_state(torch.load(rng_file, weights_only=False))
    state.world_size = world_size
    return state
