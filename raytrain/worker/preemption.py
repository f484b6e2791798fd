"""Preemption notices: agreement across ranks that the run must checkpoint now (node drain, SIGTERM, or the controller
about to restart the group at a larger size).

Three sources (the third: raytrain/elastic/resize_request.py, a request rank 0 reads). Ray reports a node being drained for preemption (a cloud's
notice turned into a drain by raytrain's notice watcher on the node, KubeRay's SIGTERM, or `ray drain-node`): Ray Train's watcher writes it into every
worker's train context, which each rank reads locally. A SIGTERM reaches only the processes on one node,
so each rank sets a local flag. Both ride on the step's loss all-reduce (worker/verdict.py), so every rank
sees them at the same step - a checkpoint is collective, so all ranks must decide together - and no rank
makes a Ray call.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Optional

from raytrain.errors import first_line
from raytrain.internals.registry import fell_back, gate
from raytrain.internals.ray import PREEMPTION_INFO, local_preemption_info
from raytrain.console import say
from raytrain.worker.node_notices import NodeNotices


# After a grow's checkpoint the ranks wait this long for the controller to tear the group down (steps trained meanwhile
# would be thrown away); a controller that gave up waiting for the checkpoint restarts the group from it anyway.
GROW_HOLD_S = 120.0

# Where Ray's public preemption call stands in for the local read: a round trip through the controller, so not
# every step. A degraded mode: at several seconds a step, ten steps can outlast a drain's notice (SIGTERM still works).
PUBLIC_POLL_STEPS = 10


class NoticeLeave(RuntimeError):
    """An elastic run's ranks leave after a drain notice's checkpoint: the controller restarts the group on the
    nodes that stay at once, instead of the ranks idling until the drained node goes (Ray Train waits for every rank
    of a preempted group to end, or for the drain's deadline)."""


class PreemptionNotice:
    def __init__(self, rank: int, *, enabled: bool = True, run_uri: Optional[str] = None, leave: bool = False,
                 watch: bool = False):
        self.rank, self.enabled, self.leave = rank, enabled, leave
        self.pending: Optional[str] = None
        self._info_broken = False
        self._local = gate(PREEMPTION_INFO)  # else Ray's public (remote, barrier) call, every PUBLIC_POLL_STEPS
        self.sigterm = _SIGTERM
        self._drain_seen = self._sigterm_seen = False
        self.requested = threading.Event()  # set on rank 0 by the controller's request before a grow
        self.grow_heard = False
        self.deadline_ms: Optional[int] = None
        if enabled:
            self._install_sigterm_handler()
        from raytrain.elastic.resize_request import Listener

        self.grow_requests = Listener(run_uri or "", self.requested, enabled=enabled and rank == 0 and run_uri is not None)
        # The cloud's reclaim notice where no node watcher turns it into a drain (checkpoint.watch_notices).
        self.node_notices = NodeNotices(enabled=enabled and watch)

    def committed(self, step: int) -> None:
        """The notice's checkpoint is committed at `step`: a controller waiting to grow is told."""
        if self.grow_heard:
            self.grow_requests.answer(step)

    def close(self) -> None:
        self.grow_requests.close()
        self.node_notices.close()

    def _install_sigterm_handler(self) -> None:
        # The train function runs in a thread, and Python lets only the main thread set signal handlers.
        # The worker actor's main thread runs its methods, so we ask it, through our own actor handle,
        # to run a module-level function (sent by reference, so it sets this process's flag).
        import ray

        try:
            actor = ray.get_runtime_context().current_actor
            ray.get(actor.execute.remote(_install_handler), timeout=30)
        except Exception as e:  # noqa: BLE001 - not fatal: drains are still seen
            say(f"warning: rank {self.rank}: SIGTERM handler not installed ({first_line(e)}); only drain "
                "notices will trigger a preemption checkpoint")

    def flags(self, step: int) -> tuple[bool, bool, bool]:
        """(SIGTERM seen here, drain notice seen here, a grow's checkpoint requested here) not yet agreed on: this rank's
        part of the step's vote.
        No Ray call: Ray Train's preemption watcher pushes a drain notice into every worker's own train
        context, which is read here locally (where Ray's internals differ: Ray's public call, every
        PUBLIC_POLL_STEPS steps, the same steps on every rank since it is a barrier)."""
        sig = self.enabled and self.sigterm.is_set() and not self._sigterm_seen
        drain = False
        if self.enabled and not self._drain_seen:
            drain = (self._local_info() if self._local else self._public_info(step)) is not None
        return sig, drain, self.requested.is_set() and not self.grow_heard

    def heard(self, sig: bool, drain: bool, grow: bool = False) -> None:
        """Some rank saw a SIGTERM / a drain / the controller's request before a grow (the step's vote): kept in
        `pending` until `take()`."""
        if grow and not self.grow_heard:
            self.grow_heard = True
            self.pending = self.pending or "the controller restarts the group at a larger size"
        if sig and not self._sigterm_seen:
            self._sigterm_seen = True
            self.pending = self.pending or "SIGTERM"
        if drain and not self._drain_seen:
            self._drain_seen = True
            # Another rank may have been told a moment earlier. (Every rank gets here at the same step: the public
            # call, a barrier, is made the same number of times on each.)
            info = self._local_info(wait_s=10.0) if self._local else self._public_info(None)
            self.deadline_ms = info.deadline_ms if info is not None else None
            left = f", {info.deadline_ms / 1000 - time.time():.0f}s before the deadline" if info and info.deadline_ms else ""
            ranks = info.preempted_ranks if info is not None else "?"
            self.pending = self.pending or f"node drain for preemption (ranks {ranks}{left})"

    def defer(self, reason: Optional[str]) -> None:
        """A notice taken on a step that was then rolled back: acted on at the next step instead."""
        self.pending = self.pending or reason

    def take(self) -> Optional[str]:
        """The reason of a notice agreed on and not yet acted on, once."""
        reason, self.pending = self.pending, None
        return reason

    def _public_info(self, step: Optional[int]):
        """Ray's public preemption info (a barrier through the controller): at `step`s that are multiples of
        PUBLIC_POLL_STEPS, or now (None)."""
        if self._info_broken or (step is not None and step % PUBLIC_POLL_STEPS):
            return None
        import ray.train

        try:
            return ray.train.get_preemption_info()
        except Exception as e:  # noqa: BLE001 - e.g. no Train context: SIGTERM still works
            self._broken(e)
            return None

    def _broken(self, e: BaseException) -> None:
        self._info_broken = True
        if self.rank == 0:
            say(f"warning: preemption notices unavailable ({first_line(e)}); SIGTERM still works")

    def _local_info(self, wait_s: float = 0.0):
        """This worker's copy of Ray Train's preemption info (None: no drain), read without any remote call."""
        if self._info_broken:
            return None
        deadline = time.monotonic() + wait_s
        while True:
            try:
                info = local_preemption_info()
            except Exception as e:  # noqa: BLE001
                fell_back(PREEMPTION_INFO, e)
                self._local = False  # from the next step on: Ray's public call
                return None
            if info is not None or time.monotonic() >= deadline:
                return info
            time.sleep(0.1)

    def hold(self, grace_s: float = 30.0) -> None:
        """After a drain's checkpoint: wait for the node to go instead of training steps that would be lost (an
        elastic run's ranks leave instead: NoticeLeave).

        Ray Train tears the group down at the drain deadline, so steps taken after the checkpoint are
        thrown away; waiting loses none. If the node outlives the deadline by `grace_s` (a cancelled
        notice), training simply goes on. Every rank has the same deadline, so they leave together.
        """
        if self.grow_heard and not self._drain_seen:
            say(f"rank {self.rank}: checkpoint committed; waiting up to {GROW_HOLD_S:.0f}s for the group to restart "
                "at its new size")
            time.sleep(GROW_HOLD_S)
            self.grow_heard = False
            self.requested.clear()
            say(f"rank {self.rank}: the group was not restarted; training on")
            return
        if self._drain_seen and self.leave:
            raise NoticeLeave(f"rank {self.rank}: leaving after the preemption notice's checkpoint; the elastic "
                              "controller restarts the group without the draining node")
        if not self._drain_seen or not self.deadline_ms:
            return
        wait = self.deadline_ms / 1000 + grace_s - time.time()
        if wait > 0:
            say(f"rank {self.rank}: checkpoint committed; waiting up to {wait:.0f}s for the preempted node to go")
            time.sleep(wait)
        say(f"rank {self.rank}: still here {grace_s:.0f}s after the preemption deadline; training on")

    def exit_if_terminated(self) -> None:
        """After the notice's checkpoint is committed: a rank that got SIGTERM now honours it."""
        if not self.sigterm.is_set():
            return
        say(f"rank {self.rank}: exiting after the preemption checkpoint (SIGTERM)")
        # Hand the signal back to Ray's own handler, which ends the worker cleanly; Ray Train then
        # restarts the group from the checkpoint just committed.
        import ray

        try:
            ray.get_runtime_context().current_actor.execute.remote(_reraise)
        except Exception:  # noqa: BLE001
            os._exit(1)
        time.sleep(60)  # the main thread ends the process; never return into the training loop
        os._exit(1)


# Per process: set by the handler in the main thread, read by the training thread.
_SIGTERM = threading.Event()
_PREV_HANDLER: list = []


def _install_handler() -> None:
    _PREV_HANDLER[:] = [signal.getsignal(signal.SIGTERM)]
    signal.signal(signal.SIGTERM, lambda signum, frame: _SIGTERM.set())


def _reraise() -> None:
    prev = _PREV_HANDLER[0] if _PREV_HANDLER else None
    signal.signal(signal.SIGTERM, prev if callable(prev) else signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)

