"""What a checkpoint carries besides the engine: the training counters (TrainState) and each rank's RNG streams."""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, fields
from typing import Optional


@dataclass
class TrainState:
    step: int = 0  # optimizer steps completed
    samples_seen: int = 0  # position in the global sample stream
    tokens_seen: int = 0
    world_size: int = 1
    restarts: int = 0
    global_batch: int = 0  # sequences per step when saved; a resized resume keeps it
    preemptions: int = 0  # preemptions survived
    lora_base: Optional[dict] = None  # LoRA runs: the frozen base's identity and sha256 (raytrain/lora.py)
    dtype: Optional[str] = None  # the precision the run trains in (precision.dtype resolved): an export's default

    @classmethod
    def from_dict(cls, d: dict) -> "TrainState":
        """The counters of a state file; keys this version does not know (a newer or older writer's) are ignored,
        and counters the file lacks (older checkpoints) start at their defaults."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def from_json(cls, text) -> "TrainState":
        """The counters of a state file's text (see from_dict)."""
        return cls.from_dict(json.loads(text))

    def to_json(self) -> str:
        """The state file's text."""
        return json.dumps(asdict(self))


def rng_state() -> dict:
    """This process's Python / NumPy / torch RNG state (and its own accelerator's)."""
    import numpy as np
    import torch

    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            # This worker's own device only: the GPUs a process sees differ from node to node and after a
            # resize, so a per-visible-GPU list would not fit (or would seed the wrong device) on resume.
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def set_rng_state(s: dict) -> None:
    """Put back what `rng_state` returned."""
    import numpy as np
    import torch

    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    if s.get("cuda") is not None and torch.cuda.is_available():
        cuda = s["cuda"]
        torch.cuda.set_rng_state(cuda if torch.is_tensor(cuda) else cuda[0])  # [0]: a list from older checkpoints
