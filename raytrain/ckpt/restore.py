"""Resume: the newest step every rank can restore from its node's memory (collective), else the newest committed
checkpoint every rank reads intact from storage (collective); then load engine, RNG and counters from it."""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from typing import Optional

from raytrain import storage
from raytrain.rundir import RunDir
from raytrain.ckpt.catalog import complete_candidates
from raytrain.ckpt.layout import ENGINE_TAG, RESTORES, STATE, UNIVERSAL, UNIVERSAL_TAG, rng_file, step_of
from raytrain.ckpt.node_cache import local_root, make_local, node_id, release, remove_stale
from raytrain.ckpt.reshard import ensure_universal, universal_files
from raytrain.ckpt.state import TrainState, set_rng_state

_RANKED = re.compile(r"(?:^|/)(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_(?:optim|model)_states\.pt$|(?:^|/)rank_(\d+)\.pt$")


@dataclass
class MemoryPoint:
    """The step every rank restores from host memory, and this rank's state for it (raytrain/ckpt/host_snapshots.py)."""

    step: int
    state: Optional[dict]  # None when this rank could not fetch or read it (`refused` says why)
    source: str = "memory:local"
    record: Optional[dict] = None  # rank 0's restores.jsonl line, written after the first step (off the critical path)
    refused: Optional[str] = None  # this rank's reason in the vote on applying it (agree_apply), when it has one
    # Written by another number of workers (an elastic run that changed size): the old size, every old rank's
    # holders, and (step, samples_seen); `state` is cut from the old ranks' snapshots once the engine is built
    # (host_snapshots.MemoryTier.load_resized), which alone knows which of them this rank's partition needs.
    from_world: Optional[int] = None
    holders: Optional[dict] = None
    counters: Optional[tuple[int, int]] = None
    t0: float = 0.0


def find_memory_point(memory, rank: int, *, resizable: bool = True) -> Optional[MemoryPoint]:
    """The newest step whose snapshot of every rank some node of the run holds (the rank's own node first, else a
    peer copy or a node it ran on before), at one data position, whose loss was judged, and not older than the newest
    committed storage checkpoint any snapshot knew of; None (storage path) otherwise.

    One all-gather of small records when the tier is on (every rank has the same config, so all or none call
    it): each rank sends what its node's actor holds, headers only. Each rank keeps two generations: ranks killed
    one step apart still share the older one. Only a rank whose node lacks its snapshot moves bytes (one fetch).
    A fetch or read that fails is not raised here, where the other ranks would go on into the engine's collectives
    without this one: it is this rank's reason (`refused`) in the vote the loop takes before applying (agree_apply),
    which sends every rank to storage.
    """
    from raytrain.console import say

    if not memory.enabled:
        return None
    t0 = time.perf_counter()
    world = _world()
    recs = _all_gather({"rank": rank, "node": node_id(), **memory.holdings()}, world)
    agreed = newest_memory_point(recs, world) if resizable else agree_memory(recs, world)
    if agreed is not None and not resizable:  # only this size's snapshots: another's cannot be cut for this engine
        agreed = (*agreed, world, None)
    if agreed is None:
        if rank == 0 and any(r["held"] for r in recs):
            have = {}
            for r in {r["actor"]: r for r in recs}.values():
                for held_rank, step, *_ in r["held"]:
                    have.setdefault(held_rank, set()).add(step)
            say("memory snapshots do not cover every rank at one judged step ("
                + "; ".join(f"rank {k}: {sorted(have.get(k, ())) or 'none'}" for k in range(world))
                + "); restoring from storage")
        # A new timeline starts from storage: older snapshots must never be taken for it (the ones other sizes
        # wrote are held on other nodes too: rank 0 ends them everywhere).
        memory.invalidate(everywhere=any(len(h) > 6 and h[6] != world for r in recs for h in r["held"]))
        return None
    step, holders, from_world, samples = agreed
    if from_world != world:
        if rank == 0:
            say(f"restore step {step} from host memory: the snapshots of the {from_world} workers before, cut "
                f"for {world}")
        return MemoryPoint(step, None, "memory:resize", from_world=from_world, holders=holders,
                           counters=(step, int(samples)), t0=t0)
    actor_of = {r["rank"]: r["actor"] for r in recs}
    fetched = [k for k in range(world) if actor_of[k] not in {a for a, _ in holders[k]}]
    source = "memory:peer" if fetched else "memory:local"
    try:
        point = MemoryPoint(step, memory.load(step, holders[rank], actor_of[rank]), source)
    except Exception as e:  # noqa: BLE001 - any failure is this rank's "no" in the vote, never a rank left behind
        return MemoryPoint(step, None, source, refused=refusal(e))
    if rank == 0:
        say(f"restore step {step} from host memory ({point.source}) in {time.perf_counter() - t0:.2f} s")
        point.record = {
            "source": point.source, "step": step, "checkpoint": None, "ok": True, "time": round(time.time(), 3),
            "s": round(time.perf_counter() - t0, 3), "fetched_ranks": fetched,
            "ranks": [{"rank": r["rank"], "node": r["node"]} for r in recs]}
    return point


def resize_memory_point(memory, engine, point: MemoryPoint, *, rank: int) -> MemoryPoint:
    """A point written by another number of workers with this rank's state cut from it (memory.load_resized), or
    its reason not to apply it; rank 0's restores.jsonl line says which old ranks were read and in how long."""
    from raytrain.console import say

    try:
        point.state, fetched = memory.load_resized(engine, point)
    except Exception as e:  # noqa: BLE001 - this rank's "no" in the vote (agree_apply), never a rank left behind
        point.refused = refusal(e)
        return point
    if rank == 0:
        secs = time.perf_counter() - point.t0
        say(f"restore step {point.step} from host memory ({point.from_world} -> {_world()} workers) in {secs:.2f} s")
        point.record = {"source": point.source, "step": point.step, "checkpoint": None, "ok": True,
                        "time": round(time.time(), 3), "s": round(secs, 3), "from_world": point.from_world,
                        "fetched_bytes_rank0": fetched}
    return point


def refusal(e: BaseException) -> str:
    """A failure as a rank's reason in a vote: its type and first line."""
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"


def agree_apply(reason: Optional[str], rank: int, world: int) -> Optional[str]:
    """Collective (one small all-gather): every rank's answer to "can you apply your snapshot?" (None: yes).
    None when all can; else why not, rank by rank, the same on every rank."""
    reasons = _all_gather({"rank": rank, "reason": reason}, world)
    refused = [f"rank {r['rank']}: {r['reason']}" for r in reasons if r["reason"] is not None]
    return "; ".join(refused) if refused else None


def agree_memory(recs: list[dict], world: int, *, of_world: Optional[int] = None
                 ) -> Optional[tuple[int, dict[int, list[tuple[str, str]]]]]:
    """(step, {rank: [(actor, path), ...] holding it}) for the newest step every rank's snapshot is held at, by
    some node, at one data position (`samples`: a rollback's timelines differ there), whose loss some rank judged
    (the loss is all-reduced: one rank's reading of it is every rank's), not below the newest committed checkpoint
    rank 0's snapshots or any node's actor knew of; None when there is none. `recs`: one per rank, {"actor", "held":
    [[rank, step, samples, committed, path, judged, world], ...]} (ranks on one node send the same holdings; an
    entry without its world is of `world`). `of_world`: the snapshots a run of that size wrote (default: `world`)."""
    got = _agree(recs, world, world if of_world is None else of_world)
    return None if got is None else got[:2]


def newest_memory_point(recs: list[dict], world: int) -> Optional[tuple[int, dict, int, object]]:
    """(step, holders, world that wrote it, samples) of the newest agreed step over every world size whose snapshots
    are held (an elastic run that changed size: the size before); this world's on a tie. None when none."""
    sizes = {world} | {h[6] for r in recs if r.get("actor") for h in r["held"] if len(h) > 6}
    best = None
    for w in sorted(sizes, key=lambda w: w != world):  # this world first: it wins a tie
        got = _agree(recs, world, w)
        if got is not None and (best is None or got[0] > best[0]):
            best = (got[0], got[1], w, got[2])
    return best


def _agree(recs: list[dict], world: int, of_world: int):
    """agree_memory's search among the snapshots of one world size: (step, holders, samples) or None. The floor
    counts every committed checkpoint told, whatever size wrote it."""
    by: dict[tuple[int, int], dict] = {}  # (rank, step) -> {samples: [(actor, path)]}
    judged: set[tuple[int, int]] = set()  # (step, samples) whose loss was read and found healthy
    floor = None
    for r in {r["actor"]: r for r in recs if r.get("actor")}.values():
        if r.get("committed") is not None:  # the newest committed checkpoint told to that node, any world size
            floor = r["committed"] if floor is None else max(floor, r["committed"])
        for held_rank, step, samples, committed, path, ok, *size in r["held"]:
            if held_rank == 0 and committed is not None:
                floor = committed if floor is None else max(floor, committed)
            if (size[0] if size else world) != of_world:
                continue
            by.setdefault((held_rank, step), {}).setdefault(samples, []).append((r["actor"], path))
            if ok:
                judged.add((step, samples))
    for step in sorted({s for _, s in by}, reverse=True):
        if floor is not None and step < floor:
            break
        common = {samples for samples in by.get((0, step), {}) if (step, samples) in judged}
        for k in range(1, of_world):
            common &= set(by.get((k, step), {}))
        if common:
            samples = sorted(common, key=str)[0]
            return step, {k: by[(k, step)][samples] for k in range(of_world)}, samples
    return None


@dataclass
class ResumePoint:
    """A verified checkpoint and the local directory that holds the files this rank reads from it."""

    uri: str  # the checkpoint in storage
    path: str  # local directory (the checkpoint itself when storage is local)
    staged: Optional[str] = None  # this node's staging directory, released after the restore
    world_size: int = 0

    @property
    def filesystem(self):
        import pyarrow.fs as pafs

        return pafs.LocalFileSystem()

    def release(self) -> None:
        """Done with the files: the last user on the node removes its staging directory."""
        release(self.staged)
        self.staged = None


def files_for_rank(files: dict, rank: int, world: int, saved_world: int, *, tensor_parallel: bool = False) -> list[str]:
    """The manifest entries this rank reads on restore: its own partitions (zero_pp_rank_R_*, rng/rank_R) and
    everything shared (the 16-bit weights of ZeRO-0/1/2, counters, config). All of it for a resize (the universal
    conversion reads every partition) or a tensor-parallel run (data-parallel ranks are not world ranks)."""
    if saved_world != world or tensor_parallel:
        return sorted(files)
    out = []
    for rel in files:
        m = None if rel.startswith(UNIVERSAL + "/") else _RANKED.search(rel)  # a universal form is read whole
        if m is None or int(m.group(1) or m.group(2)) == rank:
            out.append(rel)
    return sorted(out)


def find_resume_point(run_uri: str, rank: int, *, deep: bool = True, local_dir: Optional[str] = None,
                      tensor_parallel: bool = False) -> Optional[ResumePoint]:
    """The newest committed checkpoint every rank could read intact; collective across ranks.

    Rank 0 lists the committed checkpoints (sizes checked) and shares their manifests. Each rank then fetches only
    the files it reads (its partitions and the shared ones) - once per node, into `checkpoint.local_dir` - and
    checks their sha256 while they stream in (`deep`; in place when storage is local). One all-gather of small
    records decides: if any rank found a bad file, every rank moves on to the previous complete checkpoint.
    Bytes downloaded per node are logged and appended to <run>/restores.jsonl.
    """
    from raytrain.console import say

    world = _world()
    root = local_root(local_dir)
    remove_stale(root)
    offer = _broadcast(complete_candidates(run_uri, log=say) if rank == 0 else None)
    for uri, manifest in offer or []:
        files = manifest["files"]
        saved_world = read_world = int(manifest.get("world_size") or world)
        if saved_world != world:
            # Resize: the checkpoint's universal form, converted once (rank 0, or an earlier resize) and kept
            # beside it in storage; the other ranks wait here for it, then read it instead of the partitions.
            uni = _broadcast(ensure_universal(run_uri, uri, files, root=root, deep=deep, from_world=saved_world,
                                              to_world=world) if rank == 0 else None)
            if "bad" in uni:
                if rank == 0:
                    say(f"warning: skipping checkpoint {uri}: {uni['bad'][0]} failed verification; trying the "
                        "previous one")
                continue
            files = universal_files(files, uni["files"])
            read_world = world  # what the ranks read now is the same for every world size
        mine = files_for_rank(files, rank, world, read_world, tensor_parallel=tensor_parallel)
        point, rec = _read_mine(uri, files, mine, rank=rank, root=root, deep=deep)
        point.world_size = saved_world
        recs = _all_gather(rec, world)
        ok = not any(r["bad"] for r in recs)
        if rank == 0:
            _report(run_uri, uri, files, recs, ok=ok)
        if ok:
            return point
        point.release()
    return None


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def _broadcast(obj):
    """Rank 0's `obj` on every rank (collective when there is a process group)."""
    import torch.distributed as dist

    box = [obj]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def _all_gather(rec: dict, world: int) -> list:
    """Every rank's `rec`, in rank order (collective when there is a process group)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return [rec]
    out = [None] * world
    dist.all_gather_object(out, rec)
    return out


def _read_mine(uri: str, files: dict, mine: list[str], *, rank: int, root: str,
               deep: bool) -> tuple[ResumePoint, dict]:
    """This rank's files of a checkpoint made local and verified: the resume point and this rank's record of it."""
    from raytrain.console import say

    t0 = time.perf_counter()
    local = make_local(uri, files, mine, root=root, deep=deep)
    rec = {"rank": rank, "node": node_id(), "bad": local.bad, "bytes": local.nbytes, "files": len(mine),
           "reads": sum(files[rel]["size"] for rel in mine), "s": round(time.perf_counter() - t0, 3)}
    if local.bad:
        say(f"warning: rank {rank}: {', '.join(local.bad[:3])} in {uri} failed its sha256/size check")
    return ResumePoint(uri, local.path, local.staged), rec


def _report(run_uri: str, uri: str, files: dict, recs: list, *, ok: bool) -> None:
    """Rank 0: the bytes downloaded per node (or which rank found a bad file), said and added to restores.jsonl."""
    from raytrain.console import say

    nodes: dict[str, int] = {}
    for r in recs:
        nodes[r["node"]] = nodes.get(r["node"], 0) + r["bytes"]
    total = sum(f["size"] for f in files.values())
    if ok and storage.is_remote(run_uri):
        say(f"restore {uri.rsplit('/', 1)[-1]}: downloaded per node " + ", ".join(
            f"node ..{n[-8:]} {b / 2**20:,.1f} MiB" for n, b in sorted(nodes.items())) + f" of {total / 2**20:,.1f} MiB")
    elif not ok:
        which = "; ".join(f"rank {r['rank']}: {r['bad'][0]}" for r in recs if r["bad"])
        say(f"warning: skipping checkpoint {uri}: {which} failed verification; trying the previous one")
    RunDir(run_uri).append_jsonl(RESTORES, {
        "source": "storage", "step": step_of(uri), "checkpoint": uri.rsplit("/", 1)[-1], "ok": ok, "time": round(time.time(), 3),
        "checkpoint_bytes": total, "node_bytes": nodes, "ranks": recs})


def peek_state(point) -> TrainState:
    """Only the counters of a checkpoint (a few bytes), read before the engine is built."""
    with point.filesystem.open_input_stream(f"{point.path}/{STATE}") as f:
        return TrainState.from_json(f.read())


def restore(engine, point: ResumePoint, *, rank: int, world: int) -> TrainState:
    """Load engine, RNG and counters from a resume point (find_resume_point). Collective across ranks.

    Written by another number of workers: the engine state comes from the checkpoint's universal form
    (converted once per checkpoint, see reshard.ensure_universal; the engine must be built with `load_universal`).
    """
    import torch

    try:
        d = point.path
        with open(os.path.join(d, STATE)) as f:
            state = TrainState.from_json(f.read())
        if state.world_size != world:  # find_resume_point fetched the universal form
            path, _ = engine.load_checkpoint(os.path.join(d, UNIVERSAL), tag=UNIVERSAL_TAG)
        else:
            # LoRA checkpoints hold the adapter only (the base is the model as built): not strict for them
            path, _ = engine.load_checkpoint(d, tag=ENGINE_TAG, load_module_strict=not hasattr(engine.module, "peft_config"))
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load the engine state in {point.uri}")
        # RNG streams belong to ranks; after a resize, ranks without a saved stream keep their seed.
        rng = os.path.join(d, rng_file(rank))
        if os.path.exists(rng):
            set_rng_state(torch.load(rng, weights_only=False))
    finally:
        point.release()
    state.world_size = world
    return state
