"""The one checkpoint path: every piece of resumable state is saved and restored here.

A checkpoint directory holds:
    engine/ + latest            DeepSpeed engine state (model, optimizer, LR scheduler), all ranks' shards
    rng/rank_NNNNN.pt           each rank's Python / NumPy / torch RNG state
    raytrain_state.json         step, samples_seen (the data position), tokens_seen, world size
    config.yaml                 the resolved config of the run that wrote it
    manifest.json               written last: every file with size and sha256 (see raytrain.checkpoints)
Each rank writes its part to a local staging directory and uploads it into the one checkpoint
directory in storage (in the background by default), then reports its files (sizes, sha256) in one
all-gather; rank 0 writes the manifest from those records: the checkpoint is committed. Resume takes
the newest committed one whose files every rank reads intact (each rank checks its own).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import tempfile
import threading
import time
import uuid
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
    preemptions: int = 0  # preemption notices survived (a checkpoint taken on a drain or SIGTERM)
    global_batch: int = 0  # sequences per step when saved; a resized resume keeps it


def dir_name(step: int) -> str:
    return f"checkpoint_{step:08d}"


def _rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            # This worker's own device only: the GPUs a process sees differ from node to node and after a
            # resize, so a per-visible-GPU list would not fit (or would seed the wrong device) on resume.
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def _set_rng_state(s: dict) -> None:
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    if s.get("cuda") is not None and torch.cuda.is_available():
        cuda = s["cuda"]
        torch.cuda.set_rng_state(cuda if torch.is_tensor(cuda) else cuda[0])  # [0]: a list from older checkpoints


class CheckpointWriter:
    """Saves checkpoints: the local copy on the training thread, upload and commit after it.

    `save` writes this rank's part to a local staging directory (the only time training waits in
    async mode), then uploads it - in a background thread (`upload: async`) or inline (`sync`). Each
    rank's upload ends with a record of the save's token and its files' sizes and hashes, all-gathered
    on a gloo group of the writer's own; rank 0 writes the manifest only when every rank's record says
    it uploaded. A rank that cannot upload (after retries) says so, and the checkpoint is never committed: a
    warning, or a stop when `on_upload_failure: stop`. At most one save is in flight at a time.
    """

    def __init__(self, ckpt_cfg, run_uri: str, rank: int, world: int, protect: tuple[str, ...] = ()):
        self.c, self.run_uri, self.rank, self.world = ckpt_cfg, run_uri, rank, world
        self.protect = protect  # e.g. the checkpoint this attempt resumed from
        self.committed: Optional[str] = None  # newest checkpoint this writer committed (rank 0)
        self.failed: list[str] = []
        self.last_stall_s = 0.0  # training time lost to the last save (local write + inline upload)
        self.last_upload_s = 0.0
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[str] = None
        staging = ckpt_cfg.staging_dir or os.path.join(_local_root(getattr(ckpt_cfg, "local_dir", None)), "staging")
        self._staging = os.path.join(os.path.expanduser(staging), f"{os.getpid()}-rank{rank}")
        self._group = _commit_group(world, ckpt_cfg.commit_timeout_s)

    def save(self, engine, state: TrainState, config_yaml: str) -> str:
        """Collective: every rank calls it at the same step. Returns the checkpoint's directory name."""
        import torch.distributed as dist

        from raytrain import checkpoints, storage

        t0 = time.perf_counter()
        self.wait()
        name = dir_name(state.step)
        uri = storage.join(self.run_uri, name)
        token = [uuid.uuid4().hex if self.rank == 0 else None]
        if self.rank == 0:
            # A directory of this name can exist from an earlier attempt: its manifest must not vouch
            # for files about to be overwritten, nor its markers for this save.
            checkpoints.uncommit(uri)
            storage.delete_dir(storage.join(uri, _MARKERS))
            storage.delete_dir(storage.join(uri, UNIVERSAL))  # an earlier timeline's conversion
        if dist.is_initialized():
            dist.broadcast_object_list(token, src=0)  # also the barrier after the uncommit
        local = os.path.join(self._staging, name)
        shutil.rmtree(local, ignore_errors=True)
        engine.save_checkpoint(local, tag=ENGINE_TAG)
        os.makedirs(os.path.join(local, "rng"), exist_ok=True)
        torch.save(_rng_state(), os.path.join(local, "rng", f"rank_{self.rank:05d}.pt"))
        if self.rank == 0:
            with open(os.path.join(local, STATE), "w") as f:
                json.dump(asdict(state), f)
            with open(os.path.join(local, CONFIG), "w") as f:
                f.write(config_yaml)
        extra = {"world_size": state.world_size, "global_batch": state.global_batch}
        job = (local, uri, state.step, token[0], extra)
        if self.c.upload == "async":
            self._thread = threading.Thread(target=self._upload_and_commit, args=job, daemon=True,
                                            name=f"raytrain-upload-{name}")
            self._thread.start()
        else:
            self._upload_and_commit(*job)
            self.check()
        self.last_stall_s = time.perf_counter() - t0
        return name

    def wait(self) -> None:
        """Block until the save in flight (if any) is uploaded and, on rank 0, committed or given up."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.check()

    def check(self) -> None:
        if self._error and self.c.on_upload_failure == "stop":
            from raytrain.errors import UserError

            raise UserError(self._error + " (checkpoint.on_upload_failure=stop; fix the storage and resubmit "
                            "the run: it resumes from its newest complete checkpoint)")

    def _upload_and_commit(self, local: str, uri: str, step: int, token: str, extra: dict) -> None:
        from raytrain import checkpoints, storage

        t0 = time.perf_counter()
        name = uri.rsplit("/", 1)[-1]
        rec = {"rank": self.rank, "token": token, "files": None}
        try:
            files = checkpoints.hash_local_files(local)
            _retry(lambda: storage.upload_dir(local, uri), self.c.upload_retries)
            rec["files"] = files
        except Exception as e:  # noqa: BLE001 - any failure leaves the checkpoint uncommitted, never half-registered
            self._fail(name, f"rank {self.rank} could not upload checkpoint {name}: {_first_line(e)}")
        finally:
            shutil.rmtree(local, ignore_errors=True)
        self.last_upload_s = time.perf_counter() - t0
        try:
            # Every rank reports its files (or its failure) in one all-gather of small records, on a group of
            # its own so that this background thread never interleaves with training's collectives.
            recs = self._gather(rec)
        except Exception as e:  # noqa: BLE001 - a rank that never reports leaves the checkpoint uncommitted
            if self.rank == 0 and name not in self.failed:
                self._fail(name, f"checkpoint {name} was not committed: {_first_line(e)}")
            return
        if self.rank != 0 or name in self.failed:  # this rank's own failure is already said
            return
        try:
            missing = [r for r in range(self.world) if not recs[r] or recs[r]["token"] != token or not recs[r]["files"]]
            if missing:
                raise RuntimeError(f"ranks {missing} did not upload their part")
            merged: dict = {}
            for r in recs:
                merged.update(r["files"])
            checkpoints.commit(uri, step, merged, extra)
            self.committed = name
            checkpoints.prune(self.run_uri, self.c.keep_last, protect=(uri, *self.protect), keep_every=self.c.keep_every)
        except Exception as e:  # noqa: BLE001
            self._fail(name, f"checkpoint {name} was not committed: {_first_line(e)}")

    def _gather(self, rec: dict) -> list:
        import torch.distributed as dist

        if self.world == 1:
            return [rec]
        if self._group is None:
            raise RuntimeError(f"no process group to hear from the other {self.world - 1} ranks")
        out = [None] * self.world
        dist.all_gather_object(out, rec, group=self._group)
        return out

    def _fail(self, name: str, msg: str) -> None:
        from raytrain.worker.runlog import say

        self.failed.append(name)
        self._error = msg
        say(f"warning: {msg}; training goes on (a restart would resume from the previous complete checkpoint)"
            if self.c.on_upload_failure == "warn" else f"error: {msg}")


_MARKERS = "_uploaded"  # per-rank upload markers of older versions; removed before a save reuses a directory


def _commit_group(world: int, timeout_s: float):
    """A gloo group for the commit's all-gather (None without a process group): it runs in the upload thread,
    so it must not share a communicator with the training loop; its timeout is checkpoint.commit_timeout_s."""
    import datetime

    import torch.distributed as dist

    if world == 1 or not dist.is_initialized():
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def _retry(fn, retries: int, base_s: float = 1.0):
    """Call fn, retrying with exponential backoff: transient storage errors should not cost a checkpoint."""
    for attempt in range(retries + 1):
        try:
            return fn()
        except Exception:  # noqa: BLE001
            if attempt == retries:
                raise
            time.sleep(base_s * 2**attempt)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def default_local_dir() -> str:
    """The node's largest local disk (instance NVMe where mounted), not the root volume's /tmp."""
    candidates = ["/opt/dlami/nvme", "/mnt/local_ssd", "/local_disk0", "/mnt", os.path.expanduser("~/.cache")]
    best, free = os.path.join(tempfile.gettempdir()), -1
    for c in candidates:
        if os.path.isdir(c) and os.access(c, os.W_OK):
            f = shutil.disk_usage(c).free
            if f > free:
                best, free = c, f
    return os.path.join(best, "raytrain")


def _local_root(local_dir: Optional[str]) -> str:
    return os.path.expanduser(local_dir) if local_dir else default_local_dir()


def _node_id() -> str:
    """This worker's Ray node: its full id. Not Ray Train's node rank, which numbers nodes by IP address (all
    nodes of a simulated cluster share 127.0.0.1), nor a prefix of the id (fake nodes' ids share a long one)."""
    try:
        import ray

        node = ray.get_runtime_context().get_node_id()
        if node:
            return node
    except Exception:  # noqa: BLE001 - outside Ray: one process, one node
        pass
    import socket

    return socket.gethostname()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def remove_stale(root: str) -> None:
    """Delete restore and save staging left by killed processes on this node (their pids are gone)."""
    from filelock import FileLock

    os.makedirs(root, exist_ok=True)
    with FileLock(os.path.join(root, ".lock")):
        rdir = os.path.join(root, "restore")
        for name in os.listdir(rdir) if os.path.isdir(rdir) else []:
            users = os.path.join(rdir, name, ".users")
            pids = [int(p) for p in os.listdir(users) if p.isdigit()] if os.path.isdir(users) else []
            if not any(_alive(p) for p in pids):
                shutil.rmtree(os.path.join(rdir, name), ignore_errors=True)
        sdir = os.path.join(root, "staging")
        for name in os.listdir(sdir) if os.path.isdir(sdir) else []:
            pid = name.split("-", 1)[0]
            if pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(os.path.join(sdir, name), ignore_errors=True)


_RANKED = re.compile(r"(?:^|/)(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_(?:optim|model)_states\.pt$|(?:^|/)rank_(\d+)\.pt$")


def files_for_rank(files: dict, rank: int, world: int, saved_world: int, tensor_parallel: bool = False) -> list[str]:
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


def _hash_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fetch(uri: str, rel: str, meta: dict, staged: str, deep: bool) -> tuple[bool, int]:
    """One file into the node's staging directory, once per node (the first rank to need it downloads it, hashing
    as it streams; the others reuse its verdict). (good, bytes this rank downloaded)."""
    from filelock import FileLock

    from raytrain import storage

    key = hashlib.sha1(rel.encode()).hexdigest()[:20]
    marks = os.path.join(staged, ".verdict")
    os.makedirs(marks, exist_ok=True)
    with FileLock(os.path.join(marks, key + ".lock")):
        for verdict in ("ok", "bad"):
            if os.path.exists(os.path.join(marks, f"{key}.{verdict}")):
                return verdict == "ok", 0
        dest = os.path.join(staged, rel)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        fs, path = storage.resolve(storage.join(uri, rel))
        h, n = hashlib.sha256(), 0
        try:
            with fs.open_input_stream(path) as src, open(dest + ".part", "wb") as out:
                while True:
                    block = src.read(storage._CHUNK)
                    if not block:
                        break
                    h.update(block)
                    out.write(block)
                    n += len(block)
            good = n == meta["size"] and (not deep or h.hexdigest() == meta["sha256"])
        except OSError:
            good = False
        if good:
            os.replace(dest + ".part", dest)
        open(os.path.join(marks, f"{key}.{'ok' if good else 'bad'}"), "w").close()
        return good, n


def _stage(root: str, uri: str) -> str:
    """This node's staging directory for a checkpoint, with this process registered as a user."""
    from filelock import FileLock

    d = os.path.join(root, "restore", f"{_node_id()}-{hashlib.sha1(uri.encode()).hexdigest()[:16]}")
    with FileLock(os.path.join(root, ".lock")):
        os.makedirs(os.path.join(d, ".users"), exist_ok=True)
        open(os.path.join(d, ".users", str(os.getpid())), "w").close()
    return d


def release(point: Optional["ResumePoint"]) -> None:
    """Done with a resume point: the last user on the node removes its staging directory."""
    from filelock import FileLock

    if point is None or not point.staged:
        return
    root = os.path.dirname(os.path.dirname(point.staged))
    with FileLock(os.path.join(root, ".lock")):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(point.staged, ".users", str(os.getpid())))
        users = os.path.join(point.staged, ".users")
        if not os.path.isdir(users) or not os.listdir(users):
            shutil.rmtree(point.staged, ignore_errors=True)
    point.staged = None


def find_resume_point(run_uri: str, rank: int, deep: bool = True, local_dir: Optional[str] = None,
                      tensor_parallel: bool = False) -> Optional[ResumePoint]:
    """The newest committed checkpoint every rank could read intact; collective across ranks.

    Rank 0 lists the committed checkpoints (sizes checked) and shares their manifests. Each rank then fetches only
    the files it reads (its partitions and the shared ones) - once per node, into `checkpoint.local_dir` - and
    checks their sha256 while they stream in (`deep`; in place when storage is local). One all-gather of small
    records decides: if any rank found a bad file, every rank moves on to the previous complete checkpoint.
    Bytes downloaded per node are logged and appended to <run>/restores.jsonl.
    """
    import torch.distributed as dist

    from raytrain import checkpoints, storage
    from raytrain.worker.runlog import say

    world = dist.get_world_size() if dist.is_initialized() else 1
    remote = storage.is_remote(run_uri)
    root = _local_root(local_dir)
    remove_stale(root)
    offer = [None]
    if rank == 0:
        offer[0] = checkpoints.complete_candidates(run_uri, log=say)
    if dist.is_initialized():
        dist.broadcast_object_list(offer, src=0)
    for uri, manifest in offer[0] or []:
        files = manifest["files"]
        saved_world = int(manifest.get("world_size") or world)
        if saved_world != world:
            # Resize: the checkpoint's universal form, converted once (rank 0, or an earlier resize) and kept
            # beside it in storage; the other ranks wait here for it, then read it instead of the partitions.
            uni = [None]
            if rank == 0:
                uni[0] = ensure_universal(run_uri, uri, files, root, deep, saved_world, world)
            if dist.is_initialized():
                dist.broadcast_object_list(uni, src=0)
            if "bad" in uni[0]:
                if rank == 0:
                    say(f"warning: skipping checkpoint {uri}: {uni[0]['bad'][0]} failed verification; trying the "
                        "previous one")
                continue
            files = {**{k: v for k, v in files.items() if not k.startswith(ENGINE_TAG + "/")},
                     **{f"{UNIVERSAL}/{k}": v for k, v in uni[0]["files"].items()}}
            saved_world = world  # what the ranks read now is the same for every world size
        mine = files_for_rank(files, rank, world, saved_world, tensor_parallel)
        t0 = time.perf_counter()
        bad, nbytes, staged = [], 0, None
        if remote:
            staged = _stage(root, uri)
            for rel in mine:
                good, n = _fetch(uri, rel, files[rel], staged, deep)
                nbytes += n
                if not good:
                    bad.append(rel)
        elif deep:
            _, base = storage.resolve(uri)
            bad = [rel for rel in mine if _hash_file(os.path.join(base, rel)) != files[rel]["sha256"]]
        rec = {"rank": rank, "node": _node_id(), "bad": bad, "bytes": nbytes, "files": len(mine),
               "reads": sum(files[rel]["size"] for rel in mine), "s": round(time.perf_counter() - t0, 3)}
        if bad:
            say(f"warning: rank {rank}: {', '.join(bad[:3])} in {uri} failed its sha256/size check")
        recs = [None] * world
        if dist.is_initialized():
            dist.all_gather_object(recs, rec)
        else:
            recs = [rec]
        point = ResumePoint(uri, staged if remote else storage.resolve(uri)[1], staged, int(manifest.get("world_size") or world))
        ok = not any(r["bad"] for r in recs)
        if rank == 0:
            nodes: dict[str, int] = {}
            for r in recs:
                nodes[r["node"]] = nodes.get(r["node"], 0) + r["bytes"]
            total = sum(f["size"] for f in files.values())
            if ok and remote:
                say(f"restore {uri.rsplit('/', 1)[-1]}: downloaded per node " + ", ".join(
                    f"node ..{n[-8:]} {b / 2**20:,.1f} MiB" for n, b in sorted(nodes.items())) + f" of {total / 2**20:,.1f} MiB")
            elif not ok:
                which = "; ".join(f"rank {r['rank']}: {r['bad'][0]}" for r in recs if r["bad"])
                say(f"warning: skipping checkpoint {uri}: {which} failed verification; trying the previous one")
            _append(storage.join(run_uri, "restores.jsonl"), {
                "checkpoint": uri.rsplit("/", 1)[-1], "ok": ok, "time": round(time.time(), 3),
                "checkpoint_bytes": total, "node_bytes": nodes, "ranks": recs})
        if not ok:
            release(point)
            continue
        return point
    return None


def _append(uri: str, rec: dict) -> None:
    from raytrain import storage

    old = storage.read_text(uri) if storage.exists(uri) else ""
    storage.write_text(uri, old + json.dumps(rec) + "\n")


def peek_state(checkpoint) -> TrainState:
    """Only the counters of a checkpoint (a few bytes), read before the engine is built."""
    with checkpoint.filesystem.open_input_stream(f"{checkpoint.path}/{STATE}") as f:
        return TrainState(**json.loads(f.read()))


UNIVERSAL = "universal"  # beside the checkpoint's files: its DeepSpeed universal form, for resized resumes


def ensure_universal(run_uri: str, uri: str, files: dict, root: str, deep: bool, from_world: int,
                     to_world: int) -> dict:
    """{"files": manifest of <checkpoint>/universal} - converted now if no earlier resize did it - or
    {"bad": [...]} when the checkpoint's partitions fail verification. One process runs it (rank 0)."""
    from raytrain import checkpoints, storage
    from raytrain.worker.runlog import say

    muri = storage.join(uri, UNIVERSAL, checkpoints.MANIFEST)
    if storage.exists(muri):
        return {"files": json.loads(storage.read_text(muri))["files"]}
    t0 = time.perf_counter()
    engine_files = {k: v for k, v in files.items() if k.startswith(ENGINE_TAG + "/")}
    point = None
    if storage.is_remote(uri):
        point = ResumePoint(uri, "", _stage(root, uri + "#convert"))
        point.path = point.staged
        bad = [rel for rel in sorted(engine_files) if not _fetch(uri, rel, engine_files[rel], point.staged, deep)[0]]
    else:
        point = ResumePoint(uri, storage.resolve(uri)[1])
        bad = [rel for rel in sorted(engine_files)
               if deep and _hash_file(os.path.join(point.path, rel)) != engine_files[rel]["sha256"]]
    try:
        if bad:
            return {"bad": bad}
        os.makedirs(root, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="universal-", dir=root) as out:
            _to_universal(point.path, out)
            ufiles = checkpoints.hash_local_files(out)
            storage.upload_dir(out, storage.join(uri, UNIVERSAL))
        # Written last, like a checkpoint's manifest: a conversion cut short is redone, never half-used.
        storage.write_text(muri, json.dumps({"files": ufiles, "from_world": from_world}, indent=1))
    finally:
        release(point)
    secs = time.perf_counter() - t0
    name = uri.rsplit("/", 1)[-1]
    say(f"universal conversion of {name} (written by {from_world} workers, resumed on {to_world}): {secs:.1f}s, "
        f"kept in {name}/{UNIVERSAL} for later resizes")
    _append(storage.join(run_uri, "conversions.jsonl"), {"checkpoint": name, "from_world": from_world,
                                                        "to_world": to_world, "s": round(secs, 3),
                                                        "time": round(time.time(), 3)})
    return {"files": ufiles}


def _to_universal(ckpt_dir: str, out_dir: str) -> str:
    """Convert the saved engine state to DeepSpeed's universal format (any world size can load it)."""
    import argparse
    import contextlib
    import io

    from deepspeed.checkpoint import ds_to_universal

    target = os.path.join(out_dir, ENGINE_TAG + "_universal")
    # Parallel extraction of the partitions: the conversion runs once per checkpoint, on one process.
    workers = max(1, (os.cpu_count() or 2) // 2)
    args = argparse.Namespace(input_folder=os.path.join(ckpt_dir, ENGINE_TAG), output_folder=target,
                              num_extract_workers=workers, num_merge_workers=workers, keep_temp_folder=False,
                              strict=True, inject_missing_state=True)  # our ZeRO-1/2 saves carry no universal info
    with contextlib.redirect_stdout(io.StringIO()):  # the converter prints every tensor
        ds_to_universal.main(args)
    return os.path.basename(target)


def restore(engine, checkpoint: ResumePoint, rank: int, world_size: int) -> TrainState:
    """Load engine, RNG and counters from a resume point (find_resume_point). Collective across ranks.

    Written by another number of workers: the engine state comes from the checkpoint's universal form
    (converted once per checkpoint, see ensure_universal; the engine must be built with `load_universal`).
    """
    try:
        d = checkpoint.path
        with open(os.path.join(d, STATE)) as f:
            state = TrainState(**json.load(f))
        if state.world_size != world_size:  # find_resume_point fetched the universal form (ensure_universal)
            path, _ = engine.load_checkpoint(os.path.join(d, UNIVERSAL), tag=ENGINE_TAG + "_universal")
        else:
            path, _ = engine.load_checkpoint(d, tag=ENGINE_TAG)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load the engine state in {checkpoint.uri}")
        # RNG streams belong to ranks; after a resize, ranks without a saved stream keep their seed.
        rng_file = os.path.join(d, "rng", f"rank_{rank:05d}.pt")
        if os.path.exists(rng_file):
            _set_rng_state(torch.load(rng_file, weights_only=False))
    finally:
        release(checkpoint)
    state.world_size = world_size
    return state
