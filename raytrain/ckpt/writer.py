"""Saving checkpoints: each rank stages its part locally, uploads it (in the background by default), and rank 0
commits the manifest once every rank's upload is reported."""

from __future__ import annotations

import os
import shutil
import threading
import time
import uuid
from typing import Callable, Optional

from raytrain import storage
from raytrain.ckpt import catalog
from raytrain.ckpt.layout import CONFIG, ENGINE_TAG, STATE, UNIVERSAL, dir_name, hash_local_files, rng_file
from raytrain.ckpt.node_cache import local_root
from raytrain.ckpt.state import TrainState, rng_state
from raytrain.errors import UserError, first_line

_MARKERS = "_uploaded"  # per-rank upload markers of older versions; removed before a save reuses a directory


class CheckpointWriter:
    """Saves checkpoints: the local copy on the training thread, upload and commit after it.

    `save` writes this rank's part to a local staging directory (the only time training waits in
    async mode), then uploads it - in a background thread (`upload: async`) or inline (`sync`). Each
    rank's upload ends with a record of the save's token and its files' sizes and hashes, all-gathered
    on a gloo group of the writer's own; rank 0 writes the manifest only when every rank's record says
    it uploaded. A rank that cannot upload (after retries) says so, and the checkpoint is never committed: a
    warning, or a stop when `on_upload_failure: stop`. At most one save is in flight at a time.
    """

    def __init__(self, ckpt_cfg, *, run_uri: str, rank: int, world: int, protect: tuple[str, ...] = (),
                 on_commit: Optional[Callable[[int], None]] = None):
        self.c, self.run_uri, self.rank, self.world = ckpt_cfg, run_uri, rank, world
        # Told the step the moment rank 0 commits (from the upload's thread): the node actors learn of a commit
        # even when rank 0 never reaches another step (stalled, or its node lost right after the manifest).
        self.on_commit = on_commit
        self.protect = protect  # e.g. the checkpoint this attempt resumed from
        self.committed: Optional[str] = None  # newest checkpoint this writer committed (rank 0)
        self.failed: list[str] = []
        self.last_stall_s = 0.0  # training time lost to the last save (local write + inline upload)
        self.last_upload_s = 0.0
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[str] = None
        # Under local_dir, where remove_stale (node_cache.py) finds what killed processes left.
        staging = os.path.join(local_root(getattr(ckpt_cfg, "local_dir", None)), "staging")
        self._staging = os.path.join(staging, f"{os.getpid()}-rank{rank}")
        self._group = _commit_group(world, ckpt_cfg.commit_timeout_s)

    def save(self, engine, state: TrainState, config_yaml: str) -> str:
        """Collective: every rank calls it at the same step. Returns the checkpoint's directory name."""
        import torch
        import torch.distributed as dist

        t0 = time.perf_counter()
        self.wait()
        name = dir_name(state.step)
        uri = storage.join(self.run_uri, name)
        token = [uuid.uuid4().hex if self.rank == 0 else None]
        if self.rank == 0:
            # A directory of this name can exist from an earlier attempt: its manifest must not vouch
            # for files about to be overwritten, nor its markers for this save.
            catalog.uncommit(uri)
            storage.delete_dir(storage.join(uri, _MARKERS))
            storage.delete_dir(storage.join(uri, UNIVERSAL))  # an earlier timeline's conversion
        if dist.is_initialized():
            dist.broadcast_object_list(token, src=0)  # also the barrier after the uncommit
        local = os.path.join(self._staging, name)
        shutil.rmtree(local, ignore_errors=True)
        # LoRA: the adapter only; the frozen base is rebuilt from the config and checked by sha256 (raytrain/lora.py)
        lora = hasattr(getattr(engine, "module", None), "peft_config")
        engine.save_checkpoint(local, tag=ENGINE_TAG, **({"exclude_frozen_parameters": True} if lora else {}))
        os.makedirs(os.path.dirname(os.path.join(local, rng_file(self.rank))), exist_ok=True)
        torch.save(rng_state(), os.path.join(local, rng_file(self.rank)))
        if self.rank == 0:
            with open(os.path.join(local, STATE), "w") as f:
                f.write(state.to_json())
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
        """Raise the last upload failure when `on_upload_failure: stop`."""
        if self._error and self.c.on_upload_failure == "stop":
            raise UserError(self._error + " (checkpoint.on_upload_failure=stop; fix the storage and resubmit "
                            "the run: it resumes from its newest complete checkpoint)")

    def _upload_and_commit(self, local: str, uri: str, step: int, token: str, extra: dict) -> None:
        t0 = time.perf_counter()
        name = uri.rsplit("/", 1)[-1]
        rec = {"rank": self.rank, "token": token, "files": None}
        try:
            files = hash_local_files(local)
            _retry(lambda: storage.upload_dir(local, uri), self.c.upload_retries)
            rec["files"] = files
        except Exception as e:  # noqa: BLE001 - any failure leaves the checkpoint uncommitted, never half-registered
            self._fail(name, f"rank {self.rank} could not upload checkpoint {name}: {first_line(e)}")
        finally:
            shutil.rmtree(local, ignore_errors=True)
        self.last_upload_s = time.perf_counter() - t0
        try:
            # Every rank reports its files (or its failure) in one all-gather of small records, on a group of
            # its own so that this background thread never interleaves with training's collectives.
            recs = self._gather(rec)
        except Exception as e:  # noqa: BLE001 - a rank that never reports leaves the checkpoint uncommitted
            if self.rank == 0 and name not in self.failed:
                self._fail(name, f"checkpoint {name} was not committed: {first_line(e)}")
            return
        if self.rank != 0 or name in self.failed:  # this rank's own failure is already said
            return
        try:
            self._commit(uri, step, recs, token, extra)
            self.committed = name
            if self.on_commit is not None:
                try:
                    self.on_commit(step)
                except Exception:  # noqa: BLE001 - a hint for memory restores; the next snapshot tells it again
                    pass
            catalog.prune(self.run_uri, self.c.keep_last, protect=(uri, *self.protect), keep_every=self.c.keep_every)
        except Exception as e:  # noqa: BLE001
            self._fail(name, f"checkpoint {name} was not committed: {first_line(e)}")

    def _commit(self, uri: str, step: int, recs: list, token: str, extra: dict) -> None:
        """Rank 0: the manifest from every rank's record."""
        missing = [r for r in range(self.world) if not recs[r] or recs[r]["token"] != token or not recs[r]["files"]]
        if missing:
            raise RuntimeError(f"ranks {missing} did not upload their part")
        merged: dict = {}
        for r in recs:
            merged.update(r["files"])
        catalog.commit(uri, step, merged, extra)

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
        from raytrain.console import say

        self.failed.append(name)
        self._error = msg
        say(f"warning: {msg}; training goes on (a restart would resume from the previous complete checkpoint)"
            if self.c.on_upload_failure == "warn" else f"error: {msg}")


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
