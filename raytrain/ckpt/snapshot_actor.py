"""The per-node actor of the memory tier: it owns a run's snapshot files on its node and copies them to a partner node.

Each node of a run has one detached actor (`NodeMemory`, pinned to its node, created on demand by the first rank
that needs it, named by run and node). It owns the run's shared-memory files on that node: two generations per rank,
written by the ranks themselves (raytrain/ckpt/host_snapshots.py; layout in raytrain/ckpt/snapshot.py), plus the peer copies
other nodes sent it. The driver removes a run's actors and files when the run ends or fails, and any leftovers at
the next start (`release_run`).

Peer copy: once a snapshot's loss is judged a rank may ask its actor to send that generation to the partner node's
actor (the next actor of the run by name); one copy per rank is in flight at a time, and a request that finds the
previous copy still running is dropped, so a slow network turns "every checkpoint.memory_peer_every_n_steps" into
"every k steps" on its own. Bytes per node per copy: its ranks' snapshots, 12 x params / nodes.
"""

from __future__ import annotations

import glob
import hashlib
import os
import threading
import time
from typing import Optional

from raytrain.ckpt import snapshot

NAMESPACE = "raytrain-memory"


def run_key(run_uri: str) -> str:
    """A short stable name for a run (its URI hashed): actor names and shared-memory file names carry it."""
    return hashlib.sha1(run_uri.encode()).hexdigest()[:12]


def actor_name(run_uri: str, node: str) -> str:
    return f"raytrain-mem-{run_key(run_uri)}-{node}"


def _node_key(node: str) -> str:
    # Simulated nodes share one /dev/shm: the files name their node too.
    return hashlib.sha1(node.encode()).hexdigest()[:12]


def file_prefix(shm_dir: str, run_uri: str) -> str:
    return os.path.join(os.path.expanduser(shm_dir), f"raytrain-{run_key(run_uri)}-")


def run_actors(run_uri: str) -> list[str]:
    """Names of the run's node actors alive in the cluster, sorted."""
    import ray

    prefix = actor_name(run_uri, "")
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a.get("namespace") == NAMESPACE and a["name"].startswith(prefix))


class NodeMemory:
    """The Ray actor that owns one node's snapshot files of one run (created with `node_actor`)."""

    def __init__(self, prefix: str, budget_bytes: int, *, run_uri: str = "", name: str = ""):
        self.prefix, self.budget, self.run_uri, self.name = prefix, budget_bytes, run_uri, name
        # Files of this run and node that no live actor owns: a killed actor's, never loaded (their writer
        # timeline is unknown), so the node starts clean.
        for path in glob.glob(self.prefix + "*"):
            os.unlink(path)
        self.files: dict[str, int] = {}
        self._lock = threading.Lock()
        self._sending: set[int] = set()  # ranks whose peer copy is in flight
        self._partner: tuple[float, Optional[str]] = (-1e9, None)  # (when looked up, name)
        # The newest storage checkpoint of the run any rank here said was committed, whatever the world size: a
        # snapshot older than it is never restored (after an elastic run changed size and changed back, the older
        # size's snapshots are of a point the run has long passed).
        self.committed_high: Optional[int] = None

    def note_committed(self, step: int, forward: bool = True) -> None:
        """A storage checkpoint of the run is committed at `step`; told by rank 0 (`forward`: passed on to every other
        node actor of the run, so that a restore after rank 0's node is lost, which reads the survivors' actors
        only, still never takes a snapshot older than it; a few small calls per commit, off the training loop)."""
        if self.committed_high is not None and step <= self.committed_high:
            return
        self.committed_high = step
        if not forward:
            return
        import ray

        for name in run_actors(self.run_uri):
            if name != self.name:
                try:
                    ray.get_actor(name, namespace=NAMESPACE).note_committed.remote(step, False)
                except ValueError:  # gone since the listing (its node went)
                    pass

    def segment(self, rank: int, gen: int, nbytes: int) -> Optional[str]:
        """The path of rank's generation `gen`, sized to at least nbytes; None when the budget or the free shared
        memory would be exceeded."""
        path = f"{self.prefix}r{rank}-g{gen}"
        with self._lock:
            if self.files.get(path, 0) >= nbytes:
                return path
            if not self._fits(nbytes - self.files.get(path, 0)):
                return None
            with open(path, "ab") as f:
                f.truncate(nbytes)
            self.files[path] = nbytes
        return path

    def _fits(self, grow: int) -> bool:
        st = os.statvfs(os.path.dirname(self.prefix) or ".")
        return not ((self.budget and sum(self.files.values()) + grow > self.budget) or grow > st.f_bavail * st.f_frsize)

    def paths(self, rank: int) -> list[str]:
        """Rank's generation files that exist on this node."""
        return [p for p in (f"{self.prefix}r{rank}-g{g}" for g in (0, 1)) if p in self.files and os.path.exists(p)]

    def held_bytes(self) -> int:
        return sum(self.files.values())

    def replicate(self, rank: int, path: str) -> Optional[int]:
        """Send rank's generation at `path` to the partner node's actor; the step sent, or None (the previous copy
        of this rank still in flight, no partner, or the generation changed while it was read)."""
        import ray

        with self._lock:
            if rank in self._sending:
                return None
            self._sending.add(rank)
        try:
            partner = self._partner_name()
            got = snapshot.committed_bytes(path) if partner else None
            if got is None:
                return None
            ray.get(ray.get_actor(partner, namespace=NAMESPACE).receive.remote(rank, got[1]))
            return got[0]
        except Exception:  # noqa: BLE001 - the partner went with its node: the next copy looks for another at once
            self._partner = (float("-inf"), None)
            return None
        finally:
            with self._lock:
                self._sending.discard(rank)

    def _partner_name(self) -> Optional[str]:
        """The next of the run's node actors after this one, by name (looked up again every 30 s)."""
        t, name = self._partner
        if time.monotonic() - t > 30:  # also "no partner" is kept 30 s: a one-node run asks the GCS rarely
            names = [n for n in run_actors(self.run_uri) if n != self.name]
            later = [n for n in names if n > self.name]
            name = (later or names or [None])[0]
            self._partner = (time.monotonic(), name)
        return name

    def receive(self, rank: int, data: bytes) -> bool:
        """Keep another node's copy of rank's newest generation (written whole, then renamed: never torn)."""
        path = f"{self.prefix}peer-r{rank}"
        with self._lock:
            if not self._fits(len(data) - self.files.get(path, 0)):
                return False
            self.files[path] = len(data)
        with open(path + ".tmp", "wb") as f:
            f.write(data)
        os.replace(path + ".tmp", path)
        return True

    def holdings(self, fmt: int) -> dict:
        """{"held": [[rank, step, samples, committed, path, judged, world], ...] of every generation and peer copy
        held here, whatever size of run wrote it (headers only: cheap), "committed": the newest committed checkpoint
        told here}: what the restore's agreement gathers from every node."""
        out = []
        with self._lock:
            paths = sorted(self.files)
        for path in paths:
            h = snapshot.read_header(path)
            if h and h.get("format") == fmt:
                out.append([int(h["rank"]), int(h["step"]), h.get("samples"), h.get("committed"), path,
                            snapshot.judged(path, h), int(h["world"])])
        return {"held": out, "committed": self.committed_high}

    def fetch(self, rank: int, world: int, step: Optional[int] = None) -> Optional[bytes]:
        """Rank's intact generation (world size `world`) held here, its own or a peer copy, at `step` (None: the
        newest): what a restore on another node reads when its own node does not hold it."""
        best: Optional[tuple[int, bytes]] = None
        for path in [*self.paths(rank), f"{self.prefix}peer-r{rank}"]:
            got = snapshot.committed_bytes(path)
            h = snapshot.header_of(got[1]) if got else None
            if (h and h.get("rank") == rank and h.get("world") == world and step in (None, got[0])
                    and (best is None or got[0] > best[0])):
                best = got
        return best[1] if best else None

    def invalidate_all(self) -> int:
        """Every generation and peer copy held here ends its timeline (a rollback); returns how many."""
        with self._lock:
            paths = sorted(self.files)
        for path in paths:
            snapshot.invalidate(path)
        return len(paths)

    def shutdown(self) -> int:
        """Remove every file this actor owns (the run is over); returns how many."""
        n = 0
        for path in set(self.files) | set(glob.glob(self.prefix + "*")):
            try:
                os.unlink(path)
                n += 1
            except FileNotFoundError:
                pass
        self.files.clear()
        return n


def node_actor(run_uri: str, ckpt_cfg):
    """This node's NodeMemory actor of the run: the existing one, or a new one pinned to this node (detached, so
    that it outlives the worker group; `release_run` removes it)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    prefix = file_prefix(ckpt_cfg.memory_dir, run_uri) + _node_key(node) + "-"
    name = actor_name(run_uri, node)
    # Threads: a peer copy in flight must not hold up a rank's call for a file.
    return ray.remote(NodeMemory).options(
        name=name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0, max_concurrency=4,
        max_restarts=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
    ).remote(prefix, int(ckpt_cfg.memory_budget_gb * 2**30), run_uri=run_uri, name=name)


def release_run(run_uri: str, shm_dir: str) -> int:
    """Driver: remove the run's node actors (each removes its files first) and the run's files left on this machine
    by actors that died; returns the number of actors removed. Run at the start (leftovers of a killed driver) and
    at the end of every run."""
    import ray

    names = run_actors(run_uri)
    for name in names:
        try:
            actor = ray.get_actor(name, namespace=NAMESPACE)
            ray.get(actor.shutdown.remote(), timeout=30)
            ray.kill(actor)
        except Exception:  # noqa: BLE001 - an actor already gone (its node lost): nothing to remove there
            pass
    for path in glob.glob(file_prefix(shm_dir, run_uri) + "*"):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    # ray.kill returns before the GCS has marked the actor dead: wait (briefly) until the names are free, so a
    # run started right after, or a caller checking, never meets one of them.
    deadline = time.monotonic() + 10
    while names and set(run_actors(run_uri)) & set(names) and time.monotonic() < deadline:
        time.sleep(0.1)
    return len(names)
