"""Preemption notices: agreement across ranks that the run must checkpoint now (node drain or SIGTERM).

Two sources. Ray reports a node being drained for preemption (a spot interruption notice turned into
a drain by the autoscaler / KubeRay, or `ray drain-node`) through `ray.train.get_preemption_info()`,
itself a barrier across workers. A SIGTERM reaches only the processes on one node, so each rank sets
a local flag and a one-element all-reduce each step makes every rank see it at the same step - a
checkpoint is collective, so all ranks must decide together.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist

from raytrain.worker.runlog import say


class PreemptionNotice:
    def __init__(self, rank: int, world: int, check_s: float, enabled: bool = True, carry_checkpoint: bool = False,
                 device: torch.device | str = "cpu"):
        self.rank, self.world, self.check_s, self.enabled = rank, world, check_s, enabled
        self.device = torch.device(device)  # where the flags are reduced: NCCL reduces device tensors only
        # checkpoint.every_n_steps=auto: rank 0's "checkpoint now" rides on the same all-reduce.
        self.carry_checkpoint = carry_checkpoint
        self.checkpoint_agreed = False
        self._last_check = time.monotonic()
        self.sigterm = _SIGTERM
        self._drain_seen = self._sigterm_seen = False
        self.deadline_ms: Optional[int] = None
        if enabled:
            self._install_sigterm_handler()

    def _install_sigterm_handler(self) -> None:
        # The train function runs in a thread, and Python lets only the main thread set signal handlers.
        # The worker actor's main thread runs its methods, so we ask it, through our own actor handle,
        # to run a module-level function (sent by reference, so it sets this process's flag).
        import ray

        try:
            actor = ray.get_runtime_context().current_actor
            ray.get(actor.execute.remote(_install_handler), timeout=30)
        except Exception as e:  # noqa: BLE001 - not fatal: drains are still seen
            say(f"warning: rank {self.rank}: SIGTERM handler not installed ({_first_line(e)}); only drain "
                "notices will trigger a preemption checkpoint")

    def poll(self, step: int, want_checkpoint: bool = False) -> Optional[str]:
        """Called by every rank after every step; returns a reason once per new notice, else None.
        `checkpoint_agreed` then says whether any rank passed `want_checkpoint`."""
        self.checkpoint_agreed = False
        if not (self.enabled or self.carry_checkpoint):
            return None
        # [any rank got SIGTERM, rank 0's clock says it is time to ask Ray, a scheduled checkpoint]: one
        # all-reduce carries all three, so the (barrier) query to Ray happens on every rank at the same
        # step, every check_s seconds, and every rank saves at the same step.
        due = (self.enabled and self.rank == 0 and not self._drain_seen
               and time.monotonic() - self._last_check >= self.check_s)
        sig = self.enabled and self.sigterm.is_set()
        flag = torch.tensor([int(sig), int(due), int(want_checkpoint)], dtype=torch.int32)
        if self.world > 1:
            flag = flag.to(self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        sigterm, due, self.checkpoint_agreed = flag.tolist()
        if sigterm and not self._sigterm_seen:
            self._sigterm_seen = True
            return "SIGTERM"
        if due:
            self._last_check = time.monotonic()
            import ray.train

            try:
                info = ray.train.get_preemption_info()
            except Exception as e:  # noqa: BLE001 - same error on every rank (e.g. no Train context), so safe
                say(f"warning: rank {self.rank}: preemption notices unavailable ({_first_line(e)}); SIGTERM still works")
                self._drain_seen, info = True, None
            if info is not None:
                self._drain_seen = True
                self.deadline_ms = info.deadline_ms
                left = f", {info.deadline_ms / 1000 - time.time():.0f}s before the deadline" if info.deadline_ms else ""
                return f"node drain for preemption (ranks {info.preempted_ranks}{left})"
        return None

    def hold(self, grace_s: float = 30.0) -> None:
        """After a drain's checkpoint: wait for the node to go instead of training steps that would be lost.

        Ray Train tears the group down at the drain deadline, so steps taken after the checkpoint are
        thrown away; waiting loses none. If the node outlives the deadline by `grace_s` (a cancelled
        notice), training simply goes on. Every rank has the same deadline, so they leave together.
        """
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


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
