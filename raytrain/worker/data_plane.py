"""The training loop's data plane: this rank's rows of each global batch, by the sample plan, and its counters.

The data position is one integer, the run's `samples_seen` (raytrain/ckpt/state.py), passed to every call; the plan is keyed by the global batch index
samples_seen // global_batch, so a restore is just that number and a resize changes only which lanes
a rank reads, never which samples a global batch holds.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from raytrain.data import content_checksum
from raytrain.data.manifest import Split
from raytrain.data.mixed_reader import MixedReader
from raytrain.data.mixture import MixturePlan
from raytrain.data.sample_plan import SamplePlan
from raytrain.data.transforms import Transform
from raytrain.data.reader import PlannedReader


class DataPlane:
    """This rank's lanes of every global batch from `position` on (`data.*` settings), read ahead."""

    def __init__(self, data_cfg, *, split: Split, seed: int, global_batch: int, rank: int, size: int, position: int,
                 steps_left: int, device="cpu", mixture: Optional[dict] = None):
        self.split, self.global_batch, self.dp_size = split, global_batch, size
        self.router = self.feed = None  # data.reader=ray: the ingest router and this rank's feed from it
        # The data position itself is the run's (TrainState.samples_seen), passed in each time; this is only how far
        # this rank's reader has handed out batches (ahead of it by one batch between `take` and the step's count).
        self._next = position // global_batch
        self.device = device
        opts = {"stall_timeout_s": data_cfg.stall_timeout_s, "on_bad_shard": data_cfg.on_bad_shard,
                "end_step": position // global_batch + steps_left}
        if mixture:  # several sources (raytrain/data/mixture.py): same position, same lanes, one reader each
            self.plan = MixturePlan.from_dict(mixture, seed=seed, global_batch=global_batch, shuffle=data_cfg.shuffle)
            self.lanes = self.plan.lanes_of(rank, size)
            self.reader = MixedReader(self.plan, self.lanes, position // global_batch, **opts)
        else:
            self.plan = SamplePlan.for_split(split, seed, global_batch, data_cfg.shuffle)
            self.lanes = self.plan.lanes_of(rank, size)
            transform = Transform(data_cfg.transform, data_cfg.transform_args, seed) if data_cfg.transform else None
            if data_cfg.reader == "ray":
                self._ingest(data_cfg, split=split, seed=seed, rank=rank, size=size, start=position // global_batch,
                             end=opts["end_step"], transform=transform)
            self.reader = PlannedReader(split, self.plan, self.lanes, position // global_batch, feed=self.feed,
                                        transform=transform, **opts)
        self._step = None
        self._rows = None

    def _ingest(self, data_cfg, *, split: Split, seed: int, rank: int, size: int, start: int, end: int,
                transform) -> None:
        """data.reader=ray: this attempt's ingest router (rank 0 starts it; its name reaches the other ranks on one
        broadcast) and this rank's feed from it (raytrain/data/ingest.py)."""
        import uuid

        from raytrain.data import ingest

        name = [f"raytrain-ingest-{uuid.uuid4().hex}" if rank == 0 else None]
        if size > 1:
            dist.broadcast_object_list(name, src=0, device=self.device if self.device.type == "cuda" else None)
        self.router = ingest.start(split, seed=seed, global_batch=self.global_batch, rank=rank, world=size,
                                   start_step=start, end_step=end, data_cfg=data_cfg, name=name[0],
                                   transform=transform)
        self._rank = rank
        self.feed = ingest.UnitFeed(self.router, rank, bound=data_cfg.ingest_queue_units)

    def epoch(self, position: int) -> int:
        """Whole passes over the training data at data position `position` (a mixture: over all its sources'
        sequences together)."""
        if isinstance(self.plan, MixturePlan):
            return int(position // int(self.plan.num_samples.sum()))
        return position // self.global_batch // self.plan.steps_per_epoch

    @property
    def skipped(self) -> list[str]:
        return self.reader.skipped

    def take(self, position: int) -> np.ndarray:
        """This rank's rows of the global batch at data position `position` (samples of the global stream before
        it): [global_batch / data-parallel size, seq_len + 1] int32. Batches before it not yet taken are passed
        over unread by training (a rollback's skipped window)."""
        want = position // self.global_batch
        if want < self._next:
            raise ValueError(f"data position {position} is behind this rank's reader (batch {self._next})")
        while self._next < want:
            self.reader.take(self._next)
            self._next += 1
        rows, self._step = self.reader.take(want)
        self._next = want + 1
        self._rows = rows
        return rows

    def content_share(self) -> int:
        """This rank's share of the checksum of the batch just taken (data/content_checksum.py): asked for on the
        steps that log it only."""
        return content_checksum.share(self._rows, self.lanes[0]) if self._rows is not None else 0

    def run_until(self, position: int, steps_left: int) -> None:
        """The run needs `steps_left` more batches from data position `position` (after a rollback: more)."""
        end = position // self.global_batch + steps_left
        if self.router is not None and self._rank == 0:  # every rank has the same end: one asks
            self.router.extend.remote(end)
        self.reader.extend_to(end)

    def fingerprint(self) -> int:
        """Of the sample ids of the whole global batch just taken, from the plan alone: equal across world sizes."""
        if isinstance(self.plan, SamplePlan) and self._step.lanes == (0, self.global_batch):
            return self._step.fingerprint()  # this rank's rows are the whole batch: the plan's work is done already
        return self.plan.step(self._step.step).fingerprint()

    def stats(self, world: int, elapsed_s: float, position: int) -> dict:
        """Cluster-wide data counters since this attempt started (collective: every rank calls it at the same
        step; two fixed-size all-reduces). Per worker: the mean over workers, and the worst one."""
        c = self.reader.counters()
        keys = ("rows_read", "bytes_fetched", "rows_trained", "units_opened", "data_wait_s")
        total = torch.tensor([float(c[k]) for k in keys], dtype=torch.float64)
        worst = torch.tensor([float(c[k]) for k in keys] + [c["skipped_shards"], self.reader.cached_units],
                             dtype=torch.float64)
        if world > 1:
            total, worst = total.to(self.device), worst.to(self.device)
            dist.all_reduce(total)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # a shard two ranks skipped is still one shard
            total, worst = total.cpu(), worst.cpu()
        t, w = dict(zip(keys, total.tolist())), worst.tolist()
        return {"data_rows_read_per_worker": t["rows_read"] / world, "data_rows_read_max": w[0],
                "data_bytes_fetched_per_worker": t["bytes_fetched"] / world, "data_bytes_fetched_max": w[1],
                "data_rows_trained_per_worker": t["rows_trained"] / world,
                "data_units_opened_per_worker": t["units_opened"] / world,
                "read_amplification": t["rows_read"] / t["rows_trained"] if t["rows_trained"] else None,
                "data_wait_frac_mean": t["data_wait_s"] / world / elapsed_s if elapsed_s > 0 else None,
                "data_wait_frac_max": w[4] / elapsed_s if elapsed_s > 0 else None,
                "data_skipped_shards": int(w[5]), "data_cached_units_max": int(w[6]), **self.mixture_stats(position)}

    def mixture_stats(self, position: int) -> dict:
        """Per source at data position `position`, from the plan alone (the same on every rank): tokens trained,
        realised share of the slots so far, passes over its data; {} without a mixture."""
        if not isinstance(self.plan, MixturePlan):
            return {}
        n = self.plan.counts(0, position // self.global_batch)
        total = max(1, int(n.sum()))
        out: dict = {}
        for name, c, rows in zip(self.plan.names, n.tolist(), self.plan.num_samples.tolist()):
            out[f"tokens_seen/{name}"] = c * self.split.seq_len
            out[f"share/{name}"] = c / total
            out[f"epochs/{name}"] = c / rows
        return out

    def close(self) -> None:
        self.reader.close()
        if self.feed is not None:
            self.feed.close()
        if self.router is not None and self._rank == 0:
            import ray

            ray.kill(self.router)  # the other ranks are done with it: every rank closes after the last step
