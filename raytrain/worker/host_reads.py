"""A probe of the step's host synchronisations: where raytrain's own code reads a tensor's value on the host.

Reading a value the device made in this step (`.item()`, `.tolist()`, `float(t)`, `.cpu()`, ...) makes the
host wait for the device to finish everything queued before it, so the host cannot queue the next step's
kernels in the meantime. raytrain reads step values only on steps that act on them (worker/verdict.py); a
value read a step later has landed already and is marked so (`landed`), and is not counted. Reads inside
DeepSpeed or torch are theirs, not counted (DeepSpeed's ZeRO step reads its gradient norm every step).
Used by tests and chaos drills through fault injection ({"count_host_reads": path}, raytrain/faults.py).
"""

from __future__ import annotations

import inspect
import json
import os
from typing import Optional

import torch
from torch.overrides import TorchFunctionMode

# (Not .numpy(): it refuses device tensors, so it never waits for a device; on CPU it is how host buffers such as
# a memory snapshot's are read.)
_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__float__, torch.Tensor.__int__,
          torch.Tensor.__bool__, torch.Tensor.__index__, torch.Tensor.cpu}
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_THIS = os.path.abspath(__file__)


def landed(t: torch.Tensor) -> torch.Tensor:
    """Marks a tensor whose value is already on the host, computed before this step: reading it waits for nothing."""
    t.raytrain_landed = True
    return t


class HostReads(TorchFunctionMode):
    """Within: every value read by a raytrain frame is recorded as "file:line" in `reads`."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _READS and args and isinstance(args[0], torch.Tensor) \
                and not getattr(args[0], "raytrain_landed", False):
            where = _raytrain_caller()
            if where is not None:
                self.reads.append(where)
        return func(*args, **(kwargs or {}))


def _raytrain_caller() -> Optional[str]:
    frame = inspect.currentframe()
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if name != _THIS and not name.startswith(_TORCH):
            if name.startswith(_PACKAGE):
                return f"{os.path.relpath(name, os.path.dirname(_PACKAGE))}:{frame.f_lineno}"
            return None  # DeepSpeed's, transformers', ...
        frame = frame.f_back
    return None


class StepProbe:
    """Counts each step's host reads (rank 0) and appends {"step", "acts", "reads"} lines to `path`."""

    def __init__(self, path: Optional[str], rank: int):
        self.path = path if rank == 0 else None
        self.mode: Optional[HostReads] = None
        self.step = 0

    def begin(self, step: int) -> None:
        if self.path is None:
            return
        self.end(acts=None)  # a step left early (a rollback): recorded without its verdict
        self.step, self.mode = step, HostReads()
        self.mode.__enter__()

    def end(self, *, acts: Optional[bool]) -> None:
        if self.mode is None:
            return
        self.mode.__exit__(None, None, None)
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": self.step, "acts": acts, "reads": self.mode.reads}) + "\n")
        self.mode = None
