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


def rank_units(plan: SamplePlan, lanes: tuple[int, int], start_step: int,
               from_step: int = 0) -> Iterator[tuple[int, int, int]]:
    """(global step that first needs it, epoch, unit) for every unit lanes need from global batch start_step on, in
    the order a rank's reader fetches them (epoch by epoch, endless); from the epoch of from_step on."""
    L = plan.steps_per_epoch
    epoch, t0 = divmod(start_step, L)
    if from_step // L > epoch:  # epochs wholly before from_step: not walked
        epoch, t0 = from_step // L, 0
    while True:
        for first, _last, unit in plan.lane_units(epoch, lanes, t0):
            yield epoch * L + first, epoch, unit
        epoch, t0 = epoch + 1, 0


def items_between(plan: SamplePlan, world: int, start_step: int, lo: int, hi: int) -> list[dict]:
    """The pipeline's items for the units first needed at global steps [lo, hi) by ranks whose readers started at
    start_step: one per (epoch, unit), with the ranks that need it, ordered by that first need."""
    found: dict[tuple[int, int], dict] = {}
    for rank in range(world):
        for step, epoch, unit in rank_units(plan, lanes_of(plan.global_batch, rank, world), start_step, lo):
            if step >= hi:
                break
            if step < lo:
                continue
            item = found.setdefault((epoch, unit), {"epoch": epoch, "unit": unit, "step": step, "ranks": []})
            item["step"] = min(item["step"], step)
            item["ranks"].append(rank)
    return sorted(found.values(), key=lambda it: (it["step"], it["epoch"], it["unit"]))


def read_item(item: dict, *, header: dict, transform: Optional[dict]) -> dict:
    """A Ray Data task's work: one unit's rows (int32 bytes, `n` rows), transformed (data.transform), or why it
    cannot be read. The item names its shard; header is the split's description without its shard lists, so a
    task's arguments do not grow with the corpus."""
    from raytrain.data.reader import BadUnit, read_unit
    from raytrain.data.sample_plan import Unit
    from raytrain.data.transforms import Transform

    split = Split.from_dict({**header, "shard_uris": [item["uri"]], "shard_rows": [item["shard_rows"]]})
    try:
        rows = read_unit(split, Unit(0, item["start"], item["rows"]), dtype=np.int32)
        t = Transform.from_dict(transform)
        if t is not None:
            rows = t(rows, epoch=item["epoch"], unit=item["unit"], split=split)
        bad = ""
    except BadUnit as e:
        rows, bad = np.zeros((0, split.row_width), np.int32), f"{e.uri}\t{e.reason}"
    # Bytes, not a tensor column: a plain Arrow binary the rank reads back zero-copy whatever Ray's tensor types.
    return {"epoch": item["epoch"], "unit": item["unit"], "rows": np.ascontiguousarray(rows, np.int32).tobytes(),
            "n": rows.shape[0], "width": rows.shape[1], "bad": bad}


def _decoded(row: dict, key: tuple[int, int]) -> tuple[np.ndarray, str]:
    """read_item's output (Python values or Arrow scalars) as (rows, bad), after checking it is the unit `key`: a
    block taken out of order is an error, never another unit's rows trained in its place."""
    def py(v):
        return v.as_py() if hasattr(v, "as_py") else v

    got = (int(py(row["epoch"])), int(py(row["unit"])))
    if got != key:
        raise RuntimeError(f"data.reader=ray: the ingest pipeline delivered unit {got} where {key} was due; its output "
                           "order is not the items' order (RAYTRAIN_INTERNALS=stock takes the stock path)")
    raw = row["rows"].as_buffer() if hasattr(row["rows"], "as_buffer") else row["rows"]
    rows = np.frombuffer(raw, np.int32).reshape(int(py(row["n"])), int(py(row["width"])))
    return rows.copy(), str(py(row["bad"]))  # a copy: the block's pin in the object store ends here


class IngestRouter:
    """The run attempt's pipeline and the ranks' queues (a Ray actor, created by rank 0 on its own node).

    The ranks' queues hold references: where Ray's RefBundles are reachable (internals gate), to the blocks the read
    tasks wrote, so rows go from the data node's object store to the ranks and never through this process."""

    def __init__(self, split_dict: dict, *, seed: int, global_batch: int, shuffle: bool, world: int, start_step: int,
                 end_step: int, queue_units: int, resources: dict, transform: Optional[dict] = None):
        self.split_dict, self.world, self.start_step, self.transform = split_dict, world, start_step, transform
        split = Split.from_dict(split_dict)
        self.plan = SamplePlan.for_split(split, seed, global_batch, shuffle)
        self.bound, self.resources = queue_units, resources
        self.unit_bytes = int(max(u.rows for u in self.plan.units)) * split.row_width * 4
        self.queues = [deque() for _ in range(world)]
        self.cv = threading.Condition()
        self.planned_to = start_step  # items made for first needs before this step
        self.todo: deque = deque()
        self.error: Optional[str] = None
        self.units_out = 0
        from raytrain.internals import ray as ray_internals
        from raytrain.internals.registry import gate

        # "blocks": the read tasks' blocks go to the ranks; "router": rows through this process (a reach's fallback)
        self.path = "blocks" if gate(ray_internals.DATA_REF_BUNDLES) else "router"
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

    def bound_bytes(self) -> int:
        """The most object-store bytes this attempt's ingest holds: queue_units units per rank queued, twice as many
        in Ray Data (its read tasks running, capped at that many, and their outputs waiting, its budget), and the
        one in the router's hand (rows through the router: the block it reads from and its copy too): a constant
        per rank (measured: tests/test_ingest.py)."""
        return (3 * self.bound * self.world + (1 if self.path == "blocks" else 3)) * self.unit_bytes

    def _dataset(self, items: list[dict]):
        import ray.data

        ctx = ray.data.DataContext.get_current()
        ctx.execution_options.preserve_order = True  # the items' order: each rank's units in need order
        ahead = self.bound * self.world  # read tasks at once, and units' bytes waiting in Ray Data
        ctx.execution_options.resource_limits = ray.data.ExecutionResources(object_store_memory=ahead * self.unit_bytes)
        ctx.enable_progress_bars = False  # workers' logs reach the driver's console: no bars there
        ctx.print_on_execution_start = False
        split = self.split_dict
        header = {k: v for k, v in split.items() if k not in ("shard_uris", "shard_rows")}
        addressed = [{**it, "uri": split["shard_uris"][u.shard], "shard_rows": split["shard_rows"][u.shard],
                      "start": u.start, "rows": u.rows} for it in items for u in [self.plan.units[it["unit"]]]]
        return ray.data.from_items(addressed, override_num_blocks=len(items)).map(
            read_item, fn_kwargs={"header": header, "transform": self.transform},
            # (a cap above the items count makes Ray Data warn on the console)
            num_cpus=1, concurrency=min(ahead, len(items)), resources=self.resources or None)

    def _outputs(self, items: list[dict]):
        """(item, reference, row in the referenced block or None for a (rows, bad) object) for every item in order."""
        import ray

        from raytrain.internals import ray as ray_internals
        from raytrain.internals.registry import fell_back

        ds = self._dataset(items)
        if self.path == "blocks":
            done = 0
            try:
                for ref, first, n in ray_internals.output_blocks(ds):
                    for k in range(n):
                        yield items[done], ref, first + k
                        done += 1
                return
            except Exception as e:  # noqa: BLE001 - the reach failed before any item left: take the stock path
                if done:
                    raise
                fell_back(ray_internals.DATA_REF_BUNDLES, e)
                self.path, ds = "router", self._dataset(items)
        # Block by block, none prefetched: the object store holds no more than the bound says.
        rows = (({c: batch.column(c)[i] for c in batch.column_names} for i in range(batch.num_rows))
                for batch in ds.iter_batches(batch_size=None, prefetch_batches=0, batch_format="pyarrow"))
        for item, row in zip(items, (r for block in rows for r in block)):
            yield item, ray.put(_decoded(row, (item["epoch"], item["unit"]))), None

    def _pump(self) -> None:
        import logging

        import ray.data  # noqa: F401 - sets its loggers' levels on import, so before the lines below

        # This actor's log reaches the driver's console: no "execution finished" / "progress bars disabled" lines
        # per pipeline.
        for name in [n for n in logging.root.manager.loggerDict if n.startswith("ray.data")] + ["ray.data"]:
            logging.getLogger(name).setLevel(logging.WARNING)

        try:
            while True:
                with self.cv:
                    while not self.todo:
                        self.cv.wait()
                    items = self.todo.popleft()
                for item, ref, row in self._outputs(items):
                    key = (item["epoch"], item["unit"])
                    for rank in item["ranks"]:
                        with self.cv:
                            while len(self.queues[rank]) >= self.bound:
                                self.cv.wait()
                            self.queues[rank].append((key, ref, row))
                            self.cv.notify_all()
                    self.units_out += 1
        except BaseException as e:  # noqa: BLE001 - handed to every rank
            with self.cv:
                self.error = f"{type(e).__name__}: {e}".splitlines()[0]
                self.cv.notify_all()

    def next(self, rank: int, timeout_s: float):
        """(key, [ref], row) of this rank's next unit; None after timeout_s; raises the pipeline's error."""
        deadline = time.monotonic() + timeout_s
        with self.cv:
            while not self.queues[rank]:
                if self.error is not None:
                    raise RuntimeError(f"data.reader=ray: the ingest pipeline failed: {self.error}")
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cv.wait(left)
            key, ref, row = self.queues[rank].popleft()
            self.cv.notify_all()
        return key, [ref], row  # in a list: the caller gets the reference, not the rows

    def stats(self) -> dict:
        with self.cv:
            return {"units_out": self.units_out, "queued": [len(q) for q in self.queues],
                    "bound_bytes": self.bound_bytes(), "unit_bytes": self.unit_bytes, "error": self.error,
                    "path": self.path}


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

        from raytrain.internals import ray as ray_internals

        try:
            while not self.stop:
                with self.cv:
                    # Held back while `bound` units wait unasked, unless the reader waits for one further on (a unit
                    # another rank needed first comes early in this rank's queue: it must not block the one due).
                    while not self.stop and len(self.arrived) >= self.bound and not self.waiting:
                        self.cv.wait(1.0)
                if self.stop:
                    return
                got = ray.get(self.router.next.remote(self.rank, self.poll_s))
                if got is None:
                    continue
                key, (ref,), row = got
                key = tuple(key)
                value = ray.get(ref) if row is None else _decoded(ray_internals.block_row(ray.get(ref), row), key)
                got = ref = None  # the block is not held here while this loop waits (the ingest's memory bound)
                with self.cv:
                    fut = self.waiting.pop(key, None)
                    if fut is not None:
                        fut.set_result(value)
                    else:
                        self.arrived[key] = value
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


def has_data_nodes() -> bool:
    """Whether the cluster has CPU-only data nodes (the `data` resource) to take data.reader=ray's read tasks."""
    import ray

    return bool(ray.cluster_resources().get("data"))


def task_resources(data_cfg) -> dict:
    """What each read task asks for besides 1 CPU: data.ingest_resources, or where data nodes exist, a sliver of
    their `data` resource (so the tasks run there and only there)."""
    if data_cfg.ingest_resources is not None:
        return dict(data_cfg.ingest_resources)
    return {"data": 0.001} if has_data_nodes() else {}


def start(split: Split, *, seed: int, global_batch: int, rank: int, world: int, start_step: int, end_step: int,
          data_cfg, name: str, transform=None):
    """The attempt's router: created by rank 0 under `name` (the same on every rank, new for every attempt),
    found by the others. It lives as long as rank 0's process."""
    import ray

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # On rank 0's node: the router holds the queues' references, and a data node lost mid-run must not take it along.
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    actor = ray.remote(IngestRouter).options(name=name, namespace=NAMESPACE, num_cpus=0, max_concurrency=world + 8,
                                             scheduling_strategy=here)
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
