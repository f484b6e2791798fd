"""data.reader=ray: the sample plan decides which units each rank needs, Ray Data reads them, ranks get them by key.

From the run's data position, every rank's units in the order its reader first needs them (the plan's
`lane_units`, the same walk the direct reader makes) become items {epoch, unit, its rows' place, the ranks that
need it}, ordered by the step that first needs them. One Ray Data pipeline per worker-group start reads and
decodes them on the cluster's CPUs (on nodes with `data.ingest_resources`, e.g. CPU-only data nodes), order
preserved. An `IngestRouter` actor takes its output, puts each unit's rows in the object store once, and hands
the reference to every rank that needs it through a per-rank queue of `data.ingest_queue_units` units: a full
queue stops the router, which stops pulling the pipeline (backpressure). A rank's `UnitFeed` resolves its
reader's requests by key, so which rows a step trains on comes from the plan and the keys, never from Ray's
scheduling: the same batches and content checksums as the direct reader, through restarts and resizes (a
restart builds a new pipeline from the restored position). The training workers read no byte from storage.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Iterator, Optional

import numpy as np

from raytrain.data.manifest import Split
from raytrain.data.sample_plan import SamplePlan, lanes_of
from raytrain.errors import UserError

NAMESPACE = "raytrain"


def rank_units(plan: SamplePlan, lanes: tuple[int, int], start_step: int) -> Iterator[tuple[int, int, int]]:
    """(global step that first needs it, epoch, unit) for every unit lanes need from global batch start_step on, in
    the order a rank's reader fetches them (epoch by epoch, endless)."""
    L = plan.steps_per_epoch
    epoch, t0 = divmod(start_step, L)
    while True:
        for first, _last, unit in plan.lane_units(epoch, lanes, t0):
            yield epoch * L + first, epoch, unit
        epoch, t0 = epoch + 1, 0


def items_between(plan: SamplePlan, world: int, start_step: int, lo: int, hi: int) -> list[dict]:
    """The pipeline's items for the units first needed at global steps [lo, hi) by ranks whose readers started at
    start_step: one per (epoch, unit), with the ranks that need it, ordered by that first need."""
    found: dict[tuple[int, int], dict] = {}
    for rank in range(world):
        for step, epoch, unit in rank_units(plan, lanes_of(plan.global_batch, rank, world), start_step):
            if step >= hi:
                break
            if step < lo:
                continue
            item = found.setdefault((epoch, unit), {"epoch": epoch, "unit": unit, "step": step, "ranks": []})
            item["step"] = min(item["step"], step)
            item["ranks"].append(rank)
    return sorted(found.values(), key=lambda it: (it["step"], it["epoch"], it["unit"]))


def read_item(item: dict, *, split_dict: dict, units: list, transform: Optional[dict]) -> dict:
    """A Ray Data task's work: one unit's rows as int32, transformed (data.transform), or why it cannot be read."""
    from raytrain.data.reader import BadUnit, read_unit
    from raytrain.data.sample_plan import Unit
    from raytrain.data.transforms import Transform

    split = Split.from_dict(split_dict)
    try:
        rows = read_unit(split, Unit(*units[item["unit"]]), dtype=np.int32)
        t = Transform.from_dict(transform)
        if t is not None:
            rows = t(rows, epoch=item["epoch"], unit=item["unit"], split=split)
        return {"epoch": item["epoch"], "unit": item["unit"], "rows": rows, "bad": ""}
    except BadUnit as e:
        return {"epoch": item["epoch"], "unit": item["unit"], "rows": np.zeros((0, split.row_width), np.int32),
                "bad": f"{e.uri}\t{e.reason}"}


class IngestRouter:
    """The run attempt's pipeline and the ranks' queues (a Ray actor, created by rank 0)."""

    def __init__(self, split_dict: dict, *, seed: int, global_batch: int, shuffle: bool, world: int, start_step: int,
                 end_step: int, queue_units: int, resources: dict, transform: Optional[dict] = None):
        self.split_dict, self.world, self.start_step, self.transform = split_dict, world, start_step, transform
        self.plan = SamplePlan.for_split(Split.from_dict(split_dict), seed, global_batch, shuffle)
        self.units = [(u.shard, u.start, u.rows) for u in self.plan.units]
        self.bound, self.resources = queue_units, resources
        self.queues = [deque() for _ in range(world)]
        self.cv = threading.Condition()
        self.planned_to = start_step  # items made for first needs before this step
        self.todo: deque = deque()
        self.error: Optional[str] = None
        self.units_out = 0
        self.extend(end_step)
        threading.Thread(target=self._pump, daemon=True, name="raytrain-ingest").start()

    def extend(self, end_step: int) -> None:
        """Units first needed before end_step too (a rollback moves the run's end further): another pipeline."""
        with self.cv:
            if end_step <= self.planned_to:
                return
            items = items_between(self.plan, self.world, self.start_step, self.planned_to, end_step)
            self.planned_to = end_step
            if items:
                self.todo.append(items)
                self.cv.notify_all()

    def _pump(self) -> None:
        import logging

        import ray
        import ray.data

        # This actor's log reaches the driver's console: no "execution finished" / "progress bars disabled" lines
        # per pipeline (Ray Data sets its loggers' levels when it is imported, so after that).
        for name in [n for n in logging.root.manager.loggerDict if n.startswith("ray.data")] + ["ray.data"]:
            logging.getLogger(name).setLevel(logging.WARNING)

        try:
            while True:
                with self.cv:
                    while not self.todo:
                        self.cv.wait()
                    items = self.todo.popleft()
                ctx = ray.data.DataContext.get_current()
                ctx.execution_options.preserve_order = True  # the items' order: each rank's units in need order
                ctx.enable_progress_bars = False  # workers' logs reach the driver's console: no bars there
                ctx.print_on_execution_start = False
                ds = ray.data.from_items(items, override_num_blocks=len(items)).map(
                    read_item, fn_kwargs={"split_dict": self.split_dict, "units": self.units,
                                          "transform": self.transform}, num_cpus=1,
                    resources=self.resources or None)
                ranks = {(it["epoch"], it["unit"]): it["ranks"] for it in items}
                for row in ds.iter_rows():
                    key = (int(row["epoch"]), int(row["unit"]))
                    ref = ray.put((np.asarray(row["rows"], dtype=np.int32), row["bad"]))
                    for rank in ranks[key]:
                        with self.cv:
                            while len(self.queues[rank]) >= self.bound:
                                self.cv.wait()
                            self.queues[rank].append((key, ref))
                            self.cv.notify_all()
                    self.units_out += 1
        except BaseException as e:  # noqa: BLE001 - handed to every rank
            with self.cv:
                self.error = f"{type(e).__name__}: {e}".splitlines()[0]
                self.cv.notify_all()

    def next(self, rank: int, timeout_s: float):
        """(key, [ref]) of this rank's next unit; None after timeout_s; raises the pipeline's error."""
        deadline = time.monotonic() + timeout_s
        with self.cv:
            while not self.queues[rank]:
                if self.error is not None:
                    raise RuntimeError(f"data.reader=ray: the ingest pipeline failed: {self.error}")
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cv.wait(left)
            key, ref = self.queues[rank].popleft()
            self.cv.notify_all()
        return key, [ref]  # in a list: the caller gets the reference, not the rows

    def stats(self) -> dict:
        with self.cv:
            return {"units_out": self.units_out, "queued": [len(q) for q in self.queues]}


class UnitFeed:
    """One rank's units from the router, by key: `future(key)` resolves when that unit arrives. At most
    `bound` units that arrived before the reader asked for them are held here; the rest wait in the router."""

    def __init__(self, router, rank: int, *, bound: int, poll_s: float = 5.0):
        self.router, self.rank, self.bound, self.poll_s = router, rank, bound, poll_s
        self.cv = threading.Condition()
        self.arrived: dict[tuple[int, int], object] = {}  # key -> (rows, bad) not yet asked for
        self.waiting: dict[tuple[int, int], Future] = {}
        self.error: Optional[BaseException] = None
        self.stop = False
        threading.Thread(target=self._pull, daemon=True, name=f"raytrain-feed-{rank}").start()

    def future(self, key: tuple[int, int]) -> Future:
        fut: Future = Future()
        with self.cv:
            if key in self.arrived:
                fut.set_result(self.arrived.pop(key))
            elif self.error is not None:
                fut.set_exception(self.error)
            else:
                self.waiting[key] = fut
            self.cv.notify_all()
        return fut

    def _pull(self) -> None:
        import ray

        try:
            while not self.stop:
                with self.cv:
                    while not self.stop and len(self.arrived) >= self.bound:
                        self.cv.wait(1.0)
                if self.stop:
                    return
                got = ray.get(self.router.next.remote(self.rank, self.poll_s))
                if got is None:
                    continue
                key, (ref,) = got
                value = ray.get(ref)
                with self.cv:
                    fut = self.waiting.pop(tuple(key), None)
                    if fut is not None:
                        fut.set_result(value)
                    else:
                        self.arrived[tuple(key)] = value
        except BaseException as e:  # noqa: BLE001 - handed to the reader through its futures
            with self.cv:
                self.error = e
                for fut in self.waiting.values():
                    fut.set_exception(e)
                self.waiting.clear()

    def close(self) -> None:
        with self.cv:
            self.stop = True
            self.cv.notify_all()


def task_resources(data_cfg) -> dict:
    """What each read task asks for besides 1 CPU: data.ingest_resources, or where data nodes exist, a sliver of
    their `data` resource (so the tasks run there and only there)."""
    import ray

    if data_cfg.ingest_resources is not None:
        return dict(data_cfg.ingest_resources)
    return {"data": 0.001} if ray.cluster_resources().get("data") else {}


def start(split: Split, *, seed: int, global_batch: int, rank: int, world: int, start_step: int, end_step: int,
          data_cfg, name: str, transform=None):
    """The attempt's router: created by rank 0 under `name` (the same on every rank, new for every attempt),
    found by the others. It lives as long as rank 0's process."""
    import ray

    actor = ray.remote(IngestRouter).options(name=name, namespace=NAMESPACE, num_cpus=0,
                                             max_concurrency=world + 8)
    if rank == 0:
        return actor.remote(split.to_dict(), seed=seed, global_batch=global_batch, shuffle=data_cfg.shuffle,
                            world=world, start_step=start_step, end_step=end_step,
                            queue_units=data_cfg.ingest_queue_units, resources=task_resources(data_cfg),
                            transform=transform.to_dict() if transform is not None else None)
    deadline = time.monotonic() + 120
    while True:
        try:
            return ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            if time.monotonic() > deadline:
                raise UserError(f"data.reader=ray: rank {rank} found no ingest router {name!r} in 120 s; rank 0 "
                                "did not start it (see its log)") from None
            time.sleep(0.2)
