"""Which usable size the live nodes hold, when to grow, whether a lost worker's node is gone: the elastic decisions.

Runs inside the Ray Train controller (raytrain/internals/ray.py wraps it in Ray's scaling and failure policies), so
it sees the cluster fresh before every start: `ray.nodes()` (alive nodes and their resources) less the nodes Ray is
draining, less the nodes of the last worker group whose raylet no longer answers. The last check is what makes a
lost node cheap: Ray marks a node dead only after its health checks fail (about 15 s by default), and a group started
on it meanwhile would wait a minute for a placement that never comes. A TCP connect to the raylet's port is answered
(or refused) at once by a live host, and a reclaimed VM does not answer within `PROBE_TIMEOUT_S`.
"""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

from raytrain.errors import CapacityTimeout

PROBE_TIMEOUT_S = 1.0
WAIT_PAUSE_S = 1.0  # between two looks at the cluster while below MIN (the controller's loop has no pause there)


@dataclass
class Node:
    """One Ray node as the decision sees it."""

    id: str
    resources: dict
    address: tuple[str, int]  # its raylet (node manager), for the liveness probe
    draining: bool = False


@dataclass
class Sizing:
    """The elastic decisions of one run (one per Train controller)."""

    sizes: list[int]  # usable world sizes, ascending (Config.sizes)
    per_worker: dict  # Ray resources one worker takes
    monitor_s: float  # a running group looks for room to grow this often
    grow_stable_s: float  # a node counts toward growing once alive this long
    max_wait_s: Optional[float]  # below MIN this long: CapacityTimeout; None: wait for ever
    nodes: Callable[[], list[Node]]  # the cluster now
    reachable: Callable[[tuple[str, int]], bool] = None  # a raylet answers
    publish: Callable[[dict], None] = lambda event: None  # an event for the driver (raytrain/elastic/events.py)
    ask_checkpoint: Callable[[], Optional[int]] = lambda: None  # before a grow (raytrain/elastic/resize_request.py)
    clock: Callable[[], float] = time.time
    pause: Callable[[float], None] = time.sleep  # (defer_pauses: the caller sleeps, take_pause says how long)
    group_nodes: set = field(default_factory=set)  # nodes of the newest worker group
    first_seen: dict = field(default_factory=dict)  # node id -> when this controller first saw it alive
    gone: set = field(default_factory=set)  # nodes found lost: never counted again (a node id is one raylet's life)
    waiting_since: Optional[float] = None
    deferred_s: float = 0.0  # a pause due, for a caller that sleeps without blocking its event loop
    drained: set = field(default_factory=set)  # of the nodes `lost` found gone, those Ray was draining
    growing: bool = False  # a grow was decided and its group not yet restarted
    last_look: float = float("-inf")
    _seeded: bool = False

    def __post_init__(self):
        if self.reachable is None:
            self.reachable = raylet_answers

    # --- what the cluster holds --------------------------------------------------------------------------------
    def _look(self) -> list[Node]:
        """Alive, not draining; node first-seen times kept (nodes there at the run's start count as stable)."""
        now = self.clock()
        # A node found lost stays out even while Ray still lists it alive (until its health checks fail): else the
        # next look to grow would count it and restart the group onto a node that is not there.
        nodes = [n for n in self.nodes() if not n.draining and n.id not in self.gone]
        for n in nodes:
            self.first_seen.setdefault(n.id, float("-inf") if not self._seeded else now)
        self._seeded = True
        return nodes

    def _fits(self, nodes: Iterable[Node]) -> int:
        return sum(workers_on(n.resources, self.per_worker) for n in nodes)

    def _usable(self, room: int) -> Optional[int]:
        fits = [n for n in self.sizes if n <= room]
        return fits[-1] if fits else None

    def lost(self, node_ids: Iterable[str]) -> set:
        """Of these nodes, those gone: not alive, draining, or whose raylet does not answer (probed together)."""
        ids = set(node_ids)
        if not ids:
            return set()
        alive = {n.id: n for n in self.nodes()}
        gone = {i for i in ids if i not in alive or alive[i].draining}
        self.drained = {i for i in ids if i in alive and alive[i].draining}  # reclaimed with notice
        ask = [alive[i] for i in ids - gone]
        if ask:
            with ThreadPoolExecutor(max_workers=min(32, len(ask))) as pool:
                answers = list(pool.map(lambda n: self.reachable(n.address), ask))
            gone |= {n.id for n, ok in zip(ask, answers) if not ok}
        self.gone |= gone
        return gone

    def defer_pauses(self) -> None:
        """Pauses are left to the caller (take_pause), which sleeps where its event loop still serves calls."""
        self.pause = self._defer

    def _defer(self, seconds: float) -> None:
        self.deferred_s = max(self.deferred_s, seconds)

    def take_pause(self) -> float:
        """The pause due since the last take (0.0: none)."""
        seconds, self.deferred_s = self.deferred_s, 0.0
        return seconds

    # --- decisions ---------------------------------------------------------------------------------------------
    def start_size(self) -> Optional[int]:
        """The size to start (or restart) a worker group at now; None: below MIN, wait (pausing briefly, since the
        controller asks again at once). Raises CapacityTimeout once the run has waited run.max_wait_for_capacity."""
        nodes = self._look()
        gone = self.lost({n.id for n in nodes} & self.group_nodes)
        room = self._fits(n for n in nodes if n.id not in gone)
        size = self._usable(room)
        now = self.clock()
        if size is not None:
            if self.waiting_since is not None:
                self.publish({"event": "capacity_back", "time": round(now, 3), "waited_s": round(now - self.waiting_since, 3),
                              "workers": size})
            self.waiting_since = None
            self.last_look = now
            return size
        if self.waiting_since is None:
            self.waiting_since = now
            self.publish({"event": "waiting", "time": round(now, 3), "room": room, "min": self.sizes[0]})
        elif self.max_wait_s is not None and now - self.waiting_since >= self.max_wait_s:
            raise CapacityTimeout(
                f"waited {now - self.waiting_since:.0f} s (run.max_wait_for_capacity={self.max_wait_s:g}) with room for "
                f"{room} worker(s), below scaling.num_workers' MIN {self.sizes[0]}; the run's checkpoints are kept: "
                "submit it again when capacity returns")
        self.pause(WAIT_PAUSE_S)
        return None

    def grow_size(self, current: int) -> Optional[int]:
        """A larger usable size that nodes alive for grow_stable_s hold, looked for every monitor_s; None: stay."""
        now = self.clock()
        if now - self.last_look < self.monitor_s:
            return None
        self.last_look = now
        nodes = self._look()
        stable = [n for n in nodes if now - self.first_seen[n.id] >= self.grow_stable_s]
        size = self._usable(self._fits(stable))
        if size is not None and size > current:
            # A node lost without notice is listed alive until Ray's health checks fail (15 s and more): probed
            # first, or the group would restart larger and wait for a placement on a node that is not there.
            gone = self.lost({n.id for n in stable} - self.group_nodes)
            size = self._usable(self._fits(n for n in stable if n.id not in gone))
        if size is not None and size > current:
            self.publish({"event": "grow", "time": round(now, 3), "from": current, "to": size})
            self.growing = True
            return size
        return None

    def before_resize(self) -> None:
        """Right before the controller restarts the group for a grow: a checkpoint at the ranks' next step boundary,
        waited for (so the new group redoes no step); without one in time, the group grows from the newest."""
        if not self.growing:
            return
        self.growing = False
        t0 = self.clock()
        step = self.ask_checkpoint()
        self.publish({"event": "grow_checkpoint", "time": round(self.clock(), 3), "step": step,
                      "waited_s": round(self.clock() - t0, 3)})

    def started(self, node_ids: Iterable[str], workers: int) -> None:
        """A worker group of `workers` is up on these nodes: the next look to grow comes monitor_s from now (a group
        that has not trained yet is not restarted for a node that joined while it started)."""
        self.group_nodes = set(node_ids)
        self.last_look = self.clock()
        self.publish({"event": "started", "time": round(self.clock(), 3), "workers": workers})


def workers_on(resources: dict, per_worker: dict) -> int:
    """How many workers one node's resources hold."""
    need = {k: v for k, v in per_worker.items() if v > 0}
    if not need:
        return 0
    return int(min(resources.get(k, 0.0) // v for k, v in need.items()))


def raylet_answers(address: tuple[str, int]) -> bool:
    """Whether a node's raylet accepts a TCP connection within PROBE_TIMEOUT_S."""
    try:
        with socket.create_connection(address, timeout=PROBE_TIMEOUT_S):
            return True
    except OSError:
        return False


def cluster_nodes(draining: Callable[[], set]) -> list[Node]:
    """The alive nodes of the connected Ray cluster, marked where Ray is draining them."""
    import ray

    out, drained = [], draining()
    for n in ray.nodes():
        if n.get("Alive"):
            out.append(Node(n["NodeID"], dict(n.get("Resources") or {}),
                            (n.get("NodeManagerAddress", "127.0.0.1"), int(n.get("NodeManagerPort") or 0)),
                            n["NodeID"] in drained))
    return out


def build(*, sizes: list[int], per_worker: dict, monitor_s: float, grow_stable_s: float, max_wait_s: Optional[float],
          resize_wait_s: float, run_uri: str) -> Sizing:
    """A run's Sizing, made inside the Train controller (this function travels there by name, its arguments by value)."""
    from raytrain.elastic import resize_request
    from raytrain.elastic.events import Publisher
    from raytrain.internals.ray import draining_nodes

    return Sizing(sizes=sizes, per_worker=per_worker, monitor_s=monitor_s, grow_stable_s=grow_stable_s,
                  max_wait_s=max_wait_s, nodes=lambda: cluster_nodes(draining_nodes), publish=Publisher(run_uri),
                  ask_checkpoint=lambda: resize_request.ask(run_uri, resize_wait_s))
