"""The host-memory checkpoint tier, each rank's side: capture its state after the optimizer step, restore it at start.

Each node of a run has one detached actor (raytrain/ckpt/snapshot_actor.py) that owns the run's shared-memory files on
that node: two generations per rank (raytrain/ckpt/snapshot.py lays them out). Right after the optimizer step
each rank copies its own resumable state - what a storage checkpoint holds for that rank: its ZeRO partition of the fp32 weights and optimizer state, the LR
scheduler, the engine's and the run's counters (data position included) and its RNG streams - straight into the
older generation; no actor call is on that path. The files outlive the worker processes, so a restarted worker group
restores from them (raytrain/ckpt/restore.py agrees on the step) instead of from storage; a rank whose node has
none (the node was lost, or the rank landed elsewhere) fetches its newest generation from another node's actor
(its own files or the peer copy it received).

A snapshot is taken right after the step, and on a steady step that is before the step's loss is read (a step late,
without a host synchronisation: raytrain/worker/verdict.py). Such a generation is committed unjudged and marked
judged (`judged`) when the loop has read its loss and found it healthy; only then is it offered to a peer, and a
restore takes only judged generations (raytrain/ckpt/restore.py): a NaN step killed before its verdict resumes from
the snapshot before it, never from its own weights.

Bytes per rank: fp32 weights + Adam m and v of its partition = 12 x params / data-parallel ranks (16-bit weights are
rebuilt from fp32 on restore, never copied), times two generations.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict
from typing import Optional

from raytrain.ckpt import snapshot
from raytrain.ckpt.restore import refusal
from raytrain.ckpt.snapshot_actor import NAMESPACE, actor_name, node_actor, run_actors
from raytrain.ckpt.snapshot_interval import SnapshotInterval
from raytrain.ckpt.state import TrainState, rng_state, set_rng_state
from raytrain.internals.deepspeed import (engine_counters_settable, is_zero_optimizer, set_engine_counters, zero_check,
                                         zero_load, zero_reshard, zero_reshard_possible, zero_reshard_sources,
                                         zero_state)

FORMAT = 1  # the state dict's shape inside a snapshot; a restore refuses other versions


def engine_kind(engine) -> Optional[str]:
    """How a snapshot captures this engine: 'zero' (a ZeRO optimizer's own partition), 'plain' (module + torch
    optimizer: ZeRO-0 in fp32), or None (an optimizer the memory tier does not handle, or ZeRO internals of another
    DeepSpeed version: raytrain/internals/deepspeed.py)."""
    import torch

    opt = engine.optimizer
    if not engine_counters_settable():
        return None
    if is_zero_optimizer(opt):
        return "zero"
    if isinstance(opt, torch.optim.Optimizer) and type(opt).__module__.startswith("torch."):
        return "plain"
    return None


def capture(engine, state: TrainState, kind: str, committed: Optional[int], run_records: dict) -> dict:
    """This rank's resumable state (references to the live tensors: copy before the next step); `run_records`: rank
    0's records a restore would otherwise read from storage (the metrics not yet there, the run's attempt count)."""
    sd = {"format": FORMAT, "kind": kind, "train_state": asdict(state), "rng": rng_state(), "committed": committed,
          "run_records": run_records,
          "engine": {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
                     "skipped_steps": engine.skipped_steps},
          "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None}
    if kind == "zero":
        sd["optimizer"] = zero_state(engine.optimizer)
    else:
        sd["module"] = engine.module.state_dict()
        sd["optimizer"] = engine.optimizer.state_dict()
    return sd


def check(engine, sd: dict, faults=None) -> Optional[str]:
    """Why this rank cannot apply its snapshot to this engine (None: it can). Local, no collective: its answer is
    this rank's vote (raytrain/ckpt/restore.py agrees before `apply`, so no rank waits in a collective)."""
    try:
        if faults is not None:
            faults.memory_apply()  # a drill: a rank that cannot apply its snapshot
        if sd.get("format") != FORMAT:
            return f"snapshot format {sd.get('format')} (this version reads {FORMAT})"
        if sd.get("kind") == "zero":
            return zero_check(engine.optimizer, sd.get("optimizer"))
        if engine_kind(engine) != sd.get("kind"):
            return f"the snapshot was taken of a {sd.get('kind')!r} engine, this one is {engine_kind(engine)!r}"
    except Exception as e:  # noqa: BLE001 - any failure here is a "no" vote, never a rank left out of a collective
        return refusal(e)
    return None


def apply(engine, sd: dict) -> TrainState:
    """Put a captured state back into a freshly built engine of the same layout, after every rank's `check` said
    yes (collective under ZeRO: the 16-bit weights are all-gathered from the restored fp32 partitions)."""
    if sd["kind"] == "zero":
        zero_load(engine.optimizer, sd["optimizer"])
    else:
        engine.module.load_state_dict(sd["module"])
        engine.optimizer.load_state_dict(sd["optimizer"])
    if sd["lr_scheduler"] is not None and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(sd["lr_scheduler"])
    set_engine_counters(engine, sd["engine"])
    if sd["rng"] is not None:  # (None: a rank new at this size keeps its seed)
        set_rng_state(sd["rng"])
    return TrainState.from_dict(sd["train_state"])


def resizable(ds_cfg) -> bool:
    """Whether this engine's state can be cut from another size's snapshots (decided before it is built, so that a
    restore never picks a point it cannot apply): ZeRO-0/1/2 without tensor parallelism or offload, DeepSpeed's
    internals as written for."""
    return (ds_cfg.zero_stage < 3 and ds_cfg.tensor_parallel_size == 1 and ds_cfg.offload_optimizer == "none"
            and zero_reshard_possible())


def reshard_sources(engine, rank: int, from_world: int) -> Optional[list[int]]:
    """The old ranks (of `from_world`) whose snapshots this rank reads to restore at this size: for ZeRO-1/2 those
    whose partitions overlap its new one, plus its own old rank's (RNG streams belong to ranks); for a plain engine
    (every rank holds everything) one. None: this engine cannot be restored across sizes from memory."""
    kind = engine_kind(engine)
    if kind == "plain":
        return [rank % from_world]
    need = zero_reshard_sources(engine.optimizer, from_world) if kind == "zero" else None
    if need is None:
        return None
    return sorted(set(need) | ({rank} if rank < from_world else set()))


def resharded(engine, states: dict[int, dict], *, rank: int, from_world: int) -> dict:
    """A captured state for this rank at this size (what `capture` would hold), from old ranks' captured states:
    counters and schedule from any (they are the same on every rank), RNG from its own old rank (a rank new at
    this size keeps its seed, as a resized storage restore does), the ZeRO-1/2 partition re-cut."""
    first = states[min(states)]
    out = {**first, "rng": states[rank]["rng"] if rank in states else None,
           "run_records": states.get(0, first).get("run_records")}
    if first["kind"] == "zero":
        out["optimizer"] = zero_reshard(engine.optimizer, {k: s["optimizer"] for k, s in states.items()}, from_world)
    return out


class _HostWrite:
    """A generation being written by the host copier (a Future of snapshot.write_mapped, which commits it), with
    snapshot.PendingWrite's `finish` and `wait`."""

    def __init__(self, future):
        self.future = future

    def finish(self) -> None:
        self.future.result()

    def wait(self) -> None:
        self.future.exception()  # its failure does not matter to a caller that invalidates the generation


class MemoryTier:
    """One rank's snapshots in its node's shared memory: `snapshot` after the optimizer step, `candidates` and
    `load` at start-up. Off (every method a no-op) when checkpoint.memory is false or the budget does not fit."""

    def __init__(self, ckpt_cfg, *, run_uri: str, rank: int, world: int, enabled: bool = True,
                 drills=None):
        self.c, self.run_uri, self.rank, self.world = ckpt_cfg, run_uri, rank, world
        self.enabled = bool(ckpt_cfg.memory) and enabled
        # How often (raytrain/ckpt/snapshot_interval.py); `auto` only where snapshots are taken at all.
        self.interval = SnapshotInterval(ckpt_cfg.memory_every_n_steps if self.enabled else 1,
                                         target=ckpt_cfg.memory_cost_target, ckpt_every=ckpt_cfg.every_n_steps,
                                         mtbf_s=ckpt_cfg.mtbf_s)
        # Drills (raytrain/faults.py Faults, or None): each snapshot stalls this much longer; this rank's snapshot
        # must be fetched from another node, and no node sends it.
        self.drill_delay_s = drills.snapshot_delay_s if drills is not None else 0.0
        self.drill_fetch_fails = drills is not None and drills.fetch_fails
        self._took = False  # the previous call took a snapshot (its stall is measured at the next call)
        self.last_stall_s: Optional[float] = None
        self.bytes = 0  # one generation of this rank
        self._gen = 0  # the generation the next snapshot overwrites
        self._paths: dict[int, str] = {}
        self._sizes: dict[int, int] = {}  # bytes of each generation's file this rank has asked for
        self.actor = None  # this node's NodeMemory: looked up at start-up, created (not waited for) when missing
        self._said = False
        self._pending = None  # (the copy in flight: PendingWrite or Future, its tensors, path, step, gen, judged)
        self._judged: Optional[int] = None  # the newest step whose loss the loop read and found healthy
        self._told: Optional[int] = None  # the newest committed checkpoint told to this node's actor
        self._unjudged: Optional[tuple[int, str, int]] = None  # (gen, path, step): committed, its loss not read yet
        self._copier = None  # the thread that copies host tensors (CPU training), made on first use
        self._launch_s = 0.0
        self._stream = None  # the CUDA side stream of the copies
        self._maps: dict[int, snapshot.Mapping] = {}  # each generation mapped once (page-locked for GPU copies)

    def holdings(self) -> dict:
        """What this node's actor holds of the run for this world size, every rank's (headers only): this rank's
        record for the restore's agreement ({"actor": name, "held": [[rank, step, samples, committed, path, judged,
        world]]}): every size's, for an elastic run that changed size."""
        if not self.enabled:
            return {"actor": None, "held": []}
        import ray

        name = self.node_actor_name()
        try:
            self.actor = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:  # none on this node yet (a fresh start, or a new node): it starts while we build
            self.actor = node_actor(self.run_uri, self.c)
            return {"actor": name, "held": []}
        return {"actor": name, **ray.get(self.actor.holdings.remote(FORMAT))}

    def note_committed(self, step: Optional[int]) -> None:
        """A storage checkpoint is committed at `step`: this node's actor keeps the newest (no wait)."""
        if not self.enabled or self.actor is None or step is None or (self._told is not None and step <= self._told):
            return
        self._told = step
        # Rank 0's actor passes it on to the run's other node actors: one rank's, so that a commit costs
        # O(nodes) small calls, not O(ranks x nodes).
        self.actor.note_committed.remote(step, self.rank == 0)

    def load(self, step: int, holders: list[tuple[str, str]], mine: str) -> dict:
        """This rank's state at `step` from `holders` ([(actor, path)]): from this node's file when this node
        (`mine`) holds it, else fetched from another node's actor into this node's generation 0. Copied out and
        checked again; a failure invalidates it and raises (the restore makes it this rank's reason in its vote)."""
        # (the drill: as if this node had lost the rank's files, so that the fetch below is what fails)
        local = None if self.drill_fetch_fails else next((path for actor, path in holders if actor == mine), None)
        if local is not None:
            own = re.search(r"-r\d+-g([01])$", local)  # one of this rank's generations (else a peer copy held here)
            gen = int(own.group(1)) if own else None
            path = local
        else:
            data = self._fetch(step, holders)
            path = self._path(0, len(data)) if data else None
            if path is None:
                raise RuntimeError(f"no node sent this rank's memory snapshot of step {step} within "
                                   f"checkpoint.memory_fetch_timeout_s={self.c.memory_fetch_timeout_s:g}")
            snapshot.place(path, data)
            gen = 0
        h = snapshot.read_header(path)
        snap = snapshot.load(path, h) if h and h.get("step") == step and h.get("rank") == self.rank else None
        if snap is None:
            snapshot.invalidate(path)
            raise RuntimeError(f"the memory snapshot in {path} changed or broke while it was read")
        if gen is not None:
            self._paths[gen] = path
        self._gen = 0 if gen is None else 1 - gen  # the next snapshot keeps this one
        return snap.state

    def load_resized(self, engine, point) -> tuple[dict, int]:
        """(this rank's state at point.step cut for this world from the snapshots of the point.from_world ranks before
        that overlap it, bytes fetched from other nodes): only those are read, from this node's files where it holds
        them, else fetched. Raises where it cannot (the restore's vote then sends every rank to storage)."""
        want = reshard_sources(engine, self.rank, point.from_world)
        if want is None:
            raise RuntimeError(f"this engine's state cannot be cut from another size's memory snapshots "
                               f"({engine_kind(engine) or 'optimizer'} not supported): restoring from storage")
        states, fetched = {}, 0
        for k in want:
            local = next((path for actor, path in point.holders[k] if actor == self.node_actor_name()), None)
            snap = None
            if local is not None and not self.drill_fetch_fails:
                h = snapshot.read_header(local)
                snap = snapshot.load(local, h) if h and h.get("step") == point.step and h.get("rank") == k else None
            if snap is None:
                data = self._fetch(point.step, point.holders[k], rank=k, world=point.from_world)
                snap = snapshot.load_bytes(data) if data else None
                fetched += len(data or b"")
            if snap is None or snap.step != point.step:
                raise RuntimeError(f"the memory snapshot of rank {k} of {point.from_world} at step {point.step} "
                                   "could not be read")
            states[k] = snap.state
        return resharded(engine, states, rank=self.rank, from_world=point.from_world), fetched

    def node_actor_name(self) -> str:
        import ray

        return actor_name(self.run_uri, ray.get_runtime_context().get_node_id())

    def _fetch(self, step: int, holders: list[tuple[str, str]], *, rank: Optional[int] = None,
               world: Optional[int] = None) -> Optional[bytes]:
        """A rank's generation (this rank's in this world by default) at `step` from the first of `holders`'
        actors that sends it (None: none did)."""
        import ray

        rank = self.rank if rank is None else rank
        for actor, _ in holders:
            try:
                if self.drill_fetch_fails:
                    raise ConnectionError(f"injected: rank {rank}'s memory snapshot cannot be fetched")
                data = ray.get(ray.get_actor(actor, namespace=NAMESPACE).fetch.remote(
                    rank, self.world if world is None else world, step), timeout=self.c.memory_fetch_timeout_s)
            except Exception:  # noqa: BLE001 - an actor on a node being lost: another holder may answer
                data = None
            if data:
                return data
        return None

    def snapshot(self, engine, state: TrainState, *, committed: Optional[int] = None, force: bool = False,
                 run_records: Optional[dict] = None) -> None:
        """Copy this rank's state into the older generation when due (every memory_every_n_steps, and at every
        storage checkpoint, before it is saved: memory is then never older than a committed checkpoint). The copy
        runs beside the next step (a GPU's on a side stream, host memory's on a thread); `settle` commits it before
        the optimizer step changes its sources."""
        if not self.enabled:
            return
        self.note_committed(committed)
        self.settle()
        self.interval.tick(self.last_stall_s if self._took else None)
        self._took = False
        if not (force or self.interval.due(state.step)):
            return
        t0 = time.perf_counter()
        if self.drill_delay_s:
            time.sleep(self.drill_delay_s)
        kind = engine_kind(engine)
        if kind is None:
            return self._off(f"optimizer {type(engine.optimizer).__name__} is not one the memory tier captures")
        skeleton, tensors = snapshot.dump_skeleton(capture(engine, state, kind, committed, run_records or {}))
        if self._unjudged is not None and self._unjudged[0] == self._gen:
            self._unjudged = None  # overwritten before its loss was read (never restored, never marked)
        path = self._path(self._gen, snapshot.size_needed(skeleton, tensors))
        if path is None:
            return
        # samples: the data position tells timelines apart (a rollback skips a window; its old snapshots differ).
        # judged: this step's loss was read before the snapshot (a step that logs, evaluates or checkpoints).
        meta = {"format": FORMAT, "step": state.step, "world": self.world, "rank": self.rank, "committed": committed,
                "samples": state.samples_seen, "time": round(time.time(), 3), "judged": state.step == self._judged}
        if any(t.is_cuda for t in tensors):
            self._pending = (snapshot.write_from_gpu(self._mapping(self._gen, path), meta, skeleton, tensors,
                                                     self._side_stream(tensors)), tensors, path, state.step, self._gen,
                             meta["judged"])
        else:
            # Host tensors: copied and checksummed by a thread of their own (both without the GIL) while the next
            # step computes, as a GPU's side stream does; `settle` waits for it before the optimizer step.
            copy = self._host_copier().submit(snapshot.write_mapped, self._mapping(self._gen, path), meta, skeleton,
                                              tensors)
            self._pending = (_HostWrite(copy), tensors, path, state.step, self._gen, meta["judged"])
        self._gen = 1 - self._gen
        self._took = True
        self.last_stall_s = self._launch_s = time.perf_counter() - t0
        if force:
            self.settle()

    def settle(self) -> None:
        """Commit the snapshot whose copy is in flight (waiting for the copy if it has not landed): called before the
        optimizer step changes what it copies. The wait is added to the snapshot's stall."""
        if self._pending is None:
            return
        t0 = time.perf_counter()
        pending, _tensors, path, step, gen, judged = self._pending  # (tensors held until the copy has read them)
        try:
            pending.finish()
        except Exception as e:
            raise RuntimeError(f"rank {self.rank}: the memory snapshot of step {step} could not be copied to {path}: "
                               f"{type(e).__name__}: {e}") from e
        finally:
            self._pending = None  # cleared once the copy is over: `invalidate` must not miss one still running
        self.last_stall_s = self._launch_s + time.perf_counter() - t0
        if judged:
            self._replicate(path, step)
        else:
            self._unjudged = (gen, path, step)
            if self._judged == step:  # its loss was read while the copy was in flight
                self.judged(step)

    def judged(self, step: int) -> None:
        """The loop read `step`'s loss and the health rules passed it: a snapshot of that step is taken as judged
        from now on, and one committed before (a loss read a step late) is marked judged in its file and only then
        offered to a peer. Host-side bookkeeping only: the loss was read already, nothing waits for the device."""
        if not self.enabled:
            return
        self._judged = step
        if self._unjudged is not None and self._unjudged[2] == step:
            gen, path, _ = self._unjudged
            self._unjudged = None
            snapshot.mark_judged(self._maps[gen], step)
            self._replicate(path, step)

    def _replicate(self, path: str, step: int) -> None:
        k = self.c.memory_peer_every_n_steps
        if k and step % k == 0:
            # Not waited for: the actor drops it while this rank's previous copy is still on its way.
            self.actor.replicate.remote(self.rank, path)

    def _host_copier(self):
        if self._copier is None:
            from concurrent.futures import ThreadPoolExecutor

            self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raytrain-snapshot")
        return self._copier

    def _side_stream(self, tensors: list):
        import torch

        if self._stream is None:
            self._stream = torch.cuda.Stream(device=next(t.device for t in tensors if t.is_cuda))
        return self._stream

    def _mapping(self, gen: int, path: str) -> snapshot.Mapping:
        if gen not in self._maps:
            self._maps[gen] = snapshot.Mapping(path)
        return self._maps[gen]

    def invalidate(self, *, everywhere: bool = False) -> None:
        """This rank's snapshots end their timeline (a rollback, or a start that did not restore from them);
        everywhere (a rollback, rank 0): every file of the run on every node too, the generations ranks left on
        nodes they no longer run on and the peer copies, which the agreement would otherwise still offer."""
        if not self.enabled:
            return
        if self._pending is not None:  # a copy in flight belongs to the ending timeline: invalidated below
            pending = self._pending[0]
            self._pending = None
            pending.wait()
        for path in self._paths.values():
            snapshot.invalidate(path)
        self._gen = 0
        self._judged = self._unjudged = None  # the next timeline's losses are judged afresh
        if everywhere and self.rank == 0:
            import ray

            refs = []
            for name in run_actors(self.run_uri):
                try:
                    refs.append(ray.get_actor(name, namespace=NAMESPACE).invalidate_all.remote())
                except ValueError:  # gone with its node
                    pass
            ray.wait(refs, num_returns=len(refs), timeout=self.c.memory_fetch_timeout_s)

    def record(self) -> dict:
        """The last snapshot's stall (its launch, outside the step's phase timers, and its settle inside the optimizer
        phase), the launch alone, and the interval in force, for metrics.jsonl."""
        if self.last_stall_s is None:
            return {}
        return {"snapshot_stall_s": round(self.last_stall_s, 6), "snapshot_launch_s": round(self._launch_s, 6),
                "snapshot_every": self.interval.every}

    def _path(self, gen: int, nbytes: int) -> Optional[str]:
        """Generation `gen`'s file, at least nbytes long (asked of the node's actor only when it must grow)."""
        import ray

        from raytrain.console import say

        if self._sizes.get(gen, 0) >= nbytes:
            return self._paths[gen]
        want = int(nbytes * 1.02) + 2**20  # headroom: the pickled counters and RNG state vary a little in size
        path = ray.get(self.actor.segment.remote(self.rank, gen, want))
        if gen in self._maps:  # the file grew: map it again
            self._maps.pop(gen).close()
        if path is None:
            self._off(f"{want / 2**20:,.1f} MiB more would exceed checkpoint.memory_budget_gb="
                      f"{self.c.memory_budget_gb:g} or the free space of {self.c.memory_dir}")
            return None
        self._paths[gen], self._sizes[gen], self.bytes = path, want, max(self.bytes, want)
        if gen == 1 and not self._said and self.rank == 0:
            self._said = True
            held = ray.get(self.actor.held_bytes.remote())
            say(f"memory snapshots {self.interval.describe()}: {nbytes / 2**20:,.2f} MiB per rank "
                f"per generation (about 12 x params / data-parallel ranks), x2 generations; {held / 2**20:,.2f} MiB "
                f"on rank 0's node in {self.c.memory_dir}")
        return path

    def _off(self, why: str) -> None:
        from raytrain.console import say

        say(f"warning: rank {self.rank}: memory snapshots off ({why}); recovery restores from storage checkpoints")
        self.invalidate()
        self.enabled = False
