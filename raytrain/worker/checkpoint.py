"""The one checkpoint path: every piece of resumable state is saved and restored here.

A checkpoint directory holds:
    engine/ + latest            DeepSpeed engine state (model, optimizer, LR scheduler), all ranks' shards
    rng/rank_NNNNN.pt           each rank's Python / NumPy / torch RNG state
    raytrain_state.json         step, samples_seen (the data position), tokens_seen, world size
    config.yaml                 the resolved config of the run that wrote it
    manifest.json               written last: every file with size and sha256 (see raytrain.checkpoints)
    _uploaded/rank_NNNNN.json   per-rank upload markers (the save's token and that rank's files)
Each rank writes its part to a local staging directory and uploads it into the one checkpoint
directory in storage (in the background by default). When every rank's marker is there, rank 0
writes the manifest: the checkpoint is committed. Resume always takes the newest committed one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
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
    rank's upload ends with a marker file naming the save's token and its files' sizes and hashes;
    rank 0 writes the manifest only when every rank's marker for this token is in storage. A rank
    that cannot upload (after retries) writes no marker, so the checkpoint is never committed: a
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
        staging = ckpt_cfg.staging_dir or os.path.join(tempfile.gettempdir(), "raytrain-staging")
        self._staging = os.path.join(os.path.expanduser(staging), f"{os.getpid()}-rank{rank}")

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
        try:
            files = checkpoints.hash_local_files(local)
            _retry(lambda: storage.upload_dir(local, uri), self.c.upload_retries)
            _retry(lambda: storage.write_text(storage.join(uri, _MARKERS, f"rank_{self.rank:05d}.json"),
                                              json.dumps({"token": token, "files": files})), self.c.upload_retries)
        except Exception as e:  # noqa: BLE001 - any failure leaves the checkpoint uncommitted, never half-registered
            self._fail(name, f"rank {self.rank} could not upload checkpoint {name}: {_first_line(e)}")
            return
        finally:
            shutil.rmtree(local, ignore_errors=True)
        self.last_upload_s = time.perf_counter() - t0
        if self.rank != 0:
            return
        try:
            merged = self._await_markers(uri, token)
            checkpoints.commit(uri, step, merged, extra)
            self.committed = name
            checkpoints.prune(self.run_uri, self.c.keep_last, protect=(uri, *self.protect), keep_every=self.c.keep_every)
        except Exception as e:  # noqa: BLE001
            self._fail(name, f"checkpoint {name} was not committed: {_first_line(e)}")

    def _await_markers(self, uri: str, token: str) -> dict:
        from raytrain import storage

        deadline = time.monotonic() + self.c.commit_timeout_s
        merged: dict = {}
        pending = set(range(self.world))
        while pending:
            for r in sorted(pending):
                m = storage.join(uri, _MARKERS, f"rank_{r:05d}.json")
                if storage.exists(m):
                    rec = json.loads(storage.read_text(m))
                    if rec.get("token") == token:
                        merged.update(rec["files"])
                        pending.discard(r)
            if pending:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks {sorted(pending)} did not finish uploading within "
                                       f"checkpoint.commit_timeout_s={self.c.commit_timeout_s:g}")
                time.sleep(0.1)
        return merged

    def _fail(self, name: str, msg: str) -> None:
        from raytrain.worker.runlog import say

        self.failed.append(name)
        self._error = msg
        say(f"warning: {msg}; training goes on (a restart would resume from the previous complete checkpoint)"
            if self.c.on_upload_failure == "warn" else f"error: {msg}")


_MARKERS = "_uploaded"  # per-rank upload markers; not part of the manifest


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


def find_resume_point(run_uri: str, rank: int, deep: bool = True):
    """Rank 0 picks the newest committed checkpoint and every rank gets the same answer."""
    import torch.distributed as dist

    from raytrain import checkpoints
    from raytrain.worker.runlog import say

    choice = [None]
    if rank == 0:
        # Checksums too by default: a file corrupted in place keeps its size.
        info = checkpoints.latest_complete(run_uri, log=say, deep=deep)
        choice[0] = info.uri if info else None
    if dist.is_initialized():
        dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return None
    import ray.train

    from raytrain import storage

    fs, path = storage.resolve(choice[0])
    return ray.train.Checkpoint(path=path, filesystem=fs)


def peek_state(checkpoint) -> TrainState:
    """Only the counters of a checkpoint (a few bytes), read before the engine is built."""
    with checkpoint.filesystem.open_input_stream(f"{checkpoint.path}/{STATE}") as f:
        return TrainState(**json.loads(f.read()))


def _to_universal(ckpt_dir: str, out_dir: str) -> str:
    """Convert the saved engine state to DeepSpeed's universal format (any world size can load it)."""
    import argparse
    import contextlib
    import io

    from deepspeed.checkpoint import ds_to_universal

    target = os.path.join(out_dir, ENGINE_TAG + "_universal")
    args = argparse.Namespace(input_folder=os.path.join(ckpt_dir, ENGINE_TAG), output_folder=target,
                              num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                              inject_missing_state=True)  # our ZeRO-1/2 saves carry no universal info
    with contextlib.redirect_stdout(io.StringIO()):  # the converter prints every tensor
        ds_to_universal.main(args)
    return os.path.basename(target)


@contextlib.contextmanager
def _local_copy(checkpoint):
    """The checkpoint as a local directory: itself when local, else downloaded once per node and removed after.

    Not Ray's `Checkpoint.as_directory`: its copy reads remote files in 1 MiB ranged GETs, which restored at
    0.2-0.3 of boto3's rate; storage.download_dir reads 16 MiB at a time, files in parallel."""
    import pyarrow.fs as pafs
    from filelock import FileLock

    from raytrain import storage

    if isinstance(checkpoint.filesystem, pafs.LocalFileSystem):
        yield checkpoint.path
        return
    # Ranks on one node share one copy (keyed by the checkpoint's path); the last one out removes it.
    d = os.path.join(tempfile.gettempdir(), "raytrain-restore-" + hashlib.sha1(checkpoint.path.encode()).hexdigest()[:16])
    with FileLock(d + ".lock"):
        if not os.path.exists(os.path.join(d, ".complete")):
            shutil.rmtree(d, ignore_errors=True)
            storage.download_dir("s3://" + checkpoint.path, d)
            open(os.path.join(d, ".complete"), "w").close()
        users = os.path.join(d, ".users")
        os.makedirs(users, exist_ok=True)
        me = os.path.join(users, str(os.getpid()))
        open(me, "w").close()
    try:
        yield d
    finally:
        with FileLock(d + ".lock"):
            os.remove(me)
            if not os.listdir(users):
                shutil.rmtree(d, ignore_errors=True)


def restore(engine, checkpoint, rank: int, world_size: int) -> TrainState:
    """Load engine, RNG and counters from a checkpoint. Collective across ranks.

    Written by another number of workers: the engine state is converted to DeepSpeed's universal
    checkpoint format and loaded from there (the engine must be built with `load_universal`).
    """
    with _local_copy(checkpoint) as d:
        with open(os.path.join(d, STATE)) as f:
            state = TrainState(**json.load(f))
        if state.world_size != world_size:
            with tempfile.TemporaryDirectory(prefix="raytrain-universal-") as u:
                tag = _to_universal(d, u)
                path, _ = engine.load_checkpoint(u, tag=tag)
        else:
            path, _ = engine.load_checkpoint(d, tag=ENGINE_TAG)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load the engine state in {checkpoint.path}")
        # RNG streams belong to ranks; after a resize, ranks without a saved stream keep their seed.
        rng_file = os.path.join(d, "rng", f"rank_{rank:05d}.pt")
        if os.path.exists(rng_file):
            _set_rng_state(torch.load(rng_file, weights_only=False))
    state.world_size = world_size
    return state
