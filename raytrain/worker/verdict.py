"""The step's one all-reduce and what it decides: the mean loss, a preemption notice, "checkpoint now".

Every rank judges the same loss and takes the same action at the same step: a checkpoint and a rollback
are collective, so a rank that decided alone would hang the others. Each rank's flags (SIGTERM seen here,
drain notice seen here, rank 0's vote for an automatic checkpoint) ride on the loss all-reduce, so the
agreement costs no extra collective and no Ray call.

No host synchronisation on a steady step: unless the step must act on its own values now (a log, evaluation
or checkpoint step, the last step), its all-reduce is launched and its result copied to host memory behind
the step's kernels, and read at the next step, by when it has long landed. The host waits for nothing, so it
queues the next step's kernels while the accelerator still runs this one. The loss is then judged, and the
flags acted on, one step later: a rollback comes a step later (and discards that step too), a preemption's
checkpoint is the next step's, and a step that checkpoints reads its own loss before it saves. A host-memory
snapshot does not wait for its loss: it is taken at once and restorable only once the loop has judged that loss
(ckpt/host_snapshots.py `judged`), so no restore resumes from weights whose loss nobody read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from raytrain.data import content_checksum
from raytrain.worker.host_reads import landed


@dataclass(frozen=True)
class StepVerdict:
    losses: tuple[tuple[int, float], ...]  # (step, loss averaged over ranks) read at this step, oldest first
    preempted: Optional[str]  # why the run must checkpoint now for a preemption (None: no notice)
    checkpoint_now: bool  # the checkpoint cadence says this step saves
    content: Optional[int] = None  # the newest step's content checksum read (data/content_checksum.py)

    @property
    def loss(self) -> Optional[float]:
        """The newest loss read at this step (this step's when it was read now)."""
        return self.losses[-1][1] if self.losses else None


class _Reduction:
    """One step's all-reduce in flight and its copy to host memory."""

    def __init__(self, v: torch.Tensor, step: int, world: int, deciding: bool):
        self.step, self.world, self.deciding, self.event = step, world, deciding, None
        self.work = dist.all_reduce(v, async_op=True) if world > 1 else None
        self.v = v
        if v.device.type == "cuda":
            if self.work is not None:
                self.work.wait()  # the copy below is ordered after the all-reduce (no host wait)
            self.host = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
            self.host.copy_(v, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def read(self, late: bool) -> list[float]:
        """The values summed over ranks; late: read at a later step (landed by then: no host synchronisation)."""
        if self.event is not None:
            self.event.synchronize()  # this step's copy only, not the kernels queued since
            out = self.host
        else:
            if self.work is not None:
                self.work.wait()
            out = self.v
        return (landed(out) if late else out).tolist()


class _Alone:
    """One rank's values where there is no other rank on the host (nothing to reduce, nothing to copy): the loss
    tensor is kept and read when its step is judged."""

    def __init__(self, loss: torch.Tensor, values: list, step: int, deciding: bool):
        self.loss, self.values, self.step, self.deciding = loss, values, step, deciding

    def read(self, late: bool) -> list[float]:
        return [(landed(self.loss) if late else self.loss).item(), *self.values]


class StepAgreement:
    """Takes the step's vote: `agree(loss, step, now=...)` -> StepVerdict, the same on every rank."""

    def __init__(self, *, notice, cadence, rank: int, world: int, device: torch.device | str = "cpu",
                 snapshots=None, copies: int = 1, accumulation: int = 1):
        self.notice, self.cadence, self.rank, self.world = notice, cadence, rank, world
        self.ranks_x_micro = world * accumulation  # the loss each rank gives is its sum over its micro-batches
        self.copies = copies  # ranks holding the same rows (a tensor-parallel group): for the content checksum
        self.snapshots = snapshots  # the memory snapshot interval (ckpt/snapshot_interval.py): agreed once, here
        self.device = torch.device(device)  # where the flags are reduced: NCCL reduces device tensors only
        self.pending: Optional[_Reduction | _Alone] = None

    def agree(self, loss: torch.Tensor, step: int, now: bool = True, content: int = 0) -> StepVerdict:
        """Collective. [loss (this rank's sum over its micro-batches), content checksum share, SIGTERM, drain, rank 0
        wants a checkpoint, snapshot interval proposal, a grow's checkpoint requested], summed over ranks in float64 (the checksum shares, below
        2**32, add up exactly); the flags are sent only when a notice, an agreed cadence or the snapshot interval's
        agreement can set them. now=False: this step's result is read at the next call (module docstring)."""
        losses, want_now, checksum = [], False, None

        def take(r: _Reduction) -> None:
            nonlocal want_now, checksum
            out = r.read(late=r.step != step)
            losses.append((r.step, out[0] / self.ranks_x_micro))
            checksum = content_checksum.combine(round(out[1]), self.copies)
            if len(out) > 2:
                self.notice.heard(out[2] > 0, out[3] > 0, out[6] > 0)
                want_now = want_now or out[4] > 0
            if r.deciding:
                self.snapshots.agreed(r.step, out[5] / self.world)  # the mean of every rank's proposal

        if self.pending is not None:  # the previous step's, landed while this step ran
            take(self.pending)
            self.pending = None
        deciding = self.snapshots is not None and self.snapshots.deciding(step)
        values = [float(content)]
        if self._carry(deciding):
            sig, drain, grow = self.notice.flags(step)
            # (a vote read just now checkpoints this step: no second vote for the same checkpoint)
            want = self.cadence.agreed and self.rank == 0 and self.cadence.due(step) and not want_now
            values += [float(sig), float(drain), float(want), self.snapshots.proposal() if deciding else 0.0,
                       float(grow)]
        reduction = self._launch(loss.detach(), values, step, deciding)
        # A step that checkpoints (a vote or a notice read late says so) reads its own loss first: no checkpoint is
        # of weights whose loss nobody judged (a rollback to it would restore the bad step).
        if now or self.notice.pending is not None or (want_now if self.cadence.agreed else self.cadence.due(step)):
            take(reduction)
        else:
            self.pending = reduction
        due = want_now if self.cadence.agreed else self.cadence.due(step)
        return StepVerdict(losses=tuple(losses), preempted=self.notice.take(), checkpoint_now=due, content=checksum)

    def _launch(self, loss: torch.Tensor, values: list, step: int, deciding: bool):
        """The step's all-reduce of [loss, *values], started (nothing to start for a lone rank on the host)."""
        if self.world == 1 and self.device.type == "cpu":
            return _Alone(loss, values, step, deciding)
        if self.device.type == "cuda":
            # Host values enter by fill kernels (their arguments), not by a copy from pageable memory, which on
            # CUDA would wait for every kernel queued so far.
            v = torch.empty(1 + len(values), dtype=torch.float64, device=self.device)
            v[0].copy_(loss.reshape(()))
            for i, x in enumerate(values, 1):
                v[i].fill_(x)
        else:  # on the host each tensor op costs tens of microseconds between a step's kernels: two, not twelve
            v = torch.tensor([0.0, *values], dtype=torch.float64, device=self.device)
            v[0] = loss
        return _Reduction(v, step, self.world, deciding)

    def drop(self) -> None:
        """Forget a step in flight (a rollback discards its step); its all-reduce completes first."""
        if self.pending is not None:
            self.pending.read(late=True)
            self.pending = None

    def _carry(self, deciding: bool) -> bool:
        return self.notice.enabled or self.cadence.agreed or deciding
