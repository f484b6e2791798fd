"""The step's one all-reduce and what it decides: the mean loss, a preemption notice, "checkpoint now".

Every rank judges the same loss and takes the same action at the same step: a checkpoint and a rollback
are collective, so a rank that decided alone would hang the others. Each rank's flags (SIGTERM seen here,
drain notice seen here, rank 0's vote for an automatic checkpoint) ride on the loss all-reduce, so the
agreement costs no extra collective and no Ray call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class StepVerdict:
    loss: float  # the step's loss, averaged over ranks
    preempted: Optional[str]  # why the run must checkpoint now for a preemption (None: no notice)
    checkpoint_now: bool  # the checkpoint cadence says this step saves


class StepAgreement:
    """Takes the step's vote: `agree(loss, step)` -> StepVerdict, the same on every rank."""

    def __init__(self, *, notice, cadence, rank: int, world: int, device: torch.device | str = "cpu",
                 snapshots=None):
        self.notice, self.cadence, self.rank, self.world = notice, cadence, rank, world
        self.snapshots = snapshots  # the memory snapshot interval (ckpt/snapshot_interval.py): agreed once, here
        self.device = torch.device(device)  # where the flags are reduced: NCCL reduces device tensors only

    def agree(self, loss: torch.Tensor, step: int) -> StepVerdict:
        """Collective. [loss, SIGTERM, drain, rank 0 wants a checkpoint, snapshot interval proposal], summed over
        ranks; the flags are sent only when a notice, an agreed cadence or the snapshot interval's agreement can
        set them."""
        deciding = self.snapshots is not None and self.snapshots.deciding(step)
        carry = self.notice.enabled or self.cadence.agreed or deciding
        v = loss.detach().float().reshape(1).to(self.device)
        if carry:
            sig, drain = self.notice.flags(step)
            want = self.cadence.agreed and self.rank == 0 and self.cadence.due(step)
            proposal = self.snapshots.proposal() if deciding else 0.0
            v = torch.cat([v, torch.tensor([float(sig), float(drain), float(want), proposal], device=v.device)])
        if self.world > 1:
            dist.all_reduce(v)
            v = v / self.world
        out = v.tolist()
        if carry:
            self.notice.heard(out[1] > 0, out[2] > 0)
        if deciding:
            self.snapshots.agreed(step, out[4])  # the mean of every rank's proposal
        due = out[3] > 0 if self.cadence.agreed else self.cadence.due(step)
        return StepVerdict(loss=out[0], preempted=self.notice.take(), checkpoint_now=due)
