"""Communication health: which collective each rank is in, a warning when one runs long, a diagnosis instead of a hang.

A collective that never completes (a dead or stalled peer, a wrong network interface) is the classic
silent hang of distributed training. The process group is created with `scaling.collective_timeout_s`
so the backend gives up; this module names what was waiting: the rank, the collective, how long, and
the settings that matter. A watcher thread also logs, once, a collective that has taken
more than half the timeout. On NCCL the watchdog kills the process at the timeout (Ray sets
TORCH_NCCL_ASYNC_ERROR_HANDLING=1) before Python sees an error, so there the watcher also files the
diagnosis just before the timeout, and withdraws it if the collective completes after all.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Callable, Optional

from raytrain.console import say

# What gloo, NCCL and torch.distributed say when a peer never answered or went away.
_SIGNS = ("timed out", "timeout", "connection closed by peer", "connection reset by peer", "broken pipe",
          "communicator was aborted", "nccl error", "recv operation", "send operation")

ADVICE = ("check that every worker is alive (`ray status`, `ray list actors`), the network interface "
          "(GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME), TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (NCCL errors instead of "
          "hangs), and scaling.collective_timeout_s (raise it if a slow step, a checkpoint or an eval legitimately "
          "keeps one rank away that long)")




class CommunicationError(RuntimeError):
    """A collective failed or timed out; the message says where and what to check. Ray Train's failure
    policy still applies (a dead peer is a worker failure, and the group restarts from a checkpoint)."""


def is_comm_failure(e: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(e, getattr(dist, "DistBackendError", ())) or isinstance(e, getattr(dist, "DistNetworkError", ())):
        return True
    return isinstance(e, RuntimeError) and any(s in str(e).lower() for s in _SIGNS)


def settings(backend: str, timeout_s: float) -> str:
    env = ", ".join(f"{k}={os.environ.get(k, 'unset')}" for k in (
        ("GLOO_SOCKET_IFNAME",) if backend == "gloo" else ("NCCL_SOCKET_IFNAME", "TORCH_NCCL_ASYNC_ERROR_HANDLING")))
    return f"backend {backend}, scaling.collective_timeout_s={timeout_s:g}, {env}"


class CommWatch:
    def __init__(self, rank: int, world: int, backend: str, timeout_s: float, warn_frac: float = 0.5,
                 count: Callable[[str], None] = lambda rule: None, log: Callable[[str], None] = say,
                 poll_s: float = 1.0, report: Optional[Callable[[str], None]] = None,
                 retract: Callable[[], None] = lambda: None, file_before_s: Optional[float] = None):
        self.rank, self.world, self.backend, self.timeout_s = rank, world, backend, timeout_s
        self.report = report  # where the driver finds the whole diagnosis (Ray truncates worker errors)
        self.retract = retract
        # NCCL: file the diagnosis this long into a wait (a few polls before the watchdog's timeout).
        self.file_before_s = file_before_s if file_before_s is not None else (
            max(0.5 * timeout_s, timeout_s - 5 * poll_s) if backend == "nccl" else None)
        self._filed: Optional[tuple[str, int]] = None
        self.warn_after_s, self.count, self.log, self.poll_s = timeout_s * warn_frac, count, log, poll_s
        self._current: Optional[tuple[str, int, float]] = None  # (collective, step, entered)
        self._warned: set[tuple[str, int]] = set()
        self.step = 0
        self._stop = threading.Event()
        if world > 1:
            threading.Thread(target=self._watch, name="raytrain-comm-watch", daemon=True).start()

    @contextlib.contextmanager
    def __call__(self, what: str):
        """Wrap a region whose collectives must complete on every rank."""
        if self.world == 1:
            yield
            return
        entered, key = time.monotonic(), (what, self.step)
        self._current = (what, self.step, entered)
        try:
            yield
        except CommunicationError:
            raise
        except Exception as e:
            if not is_comm_failure(e):
                raise
            self.count("comm_timeout")
            msg = (f"communication failure on rank {self.rank} of {self.world} at step {self.step}, in {what}, "
                   f"after {time.monotonic() - entered:.1f}s ({settings(self.backend, self.timeout_s)}): "
                   f"{_first_line(e)}. A peer rank stopped answering or died: {ADVICE}")
            self.log(msg)
            if self.report:
                _quietly(lambda: self.report(msg))
            # Not chained: Ray shows the end of a worker traceback, and this line must be in it.
            raise CommunicationError(msg) from None
        else:
            if self._filed == key:  # it completed after all: no failure to report
                self._filed = None
                _quietly(self.retract)
        finally:
            self._current = None

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            cur = self._current
            if cur is None:
                continue
            what, step, entered = cur
            waited = time.monotonic() - entered
            if waited >= self.warn_after_s and (what, step) not in self._warned:
                self._warned.add((what, step))
                self.count("comm_slow")
                self.log(f"health: rank {self.rank} has waited {waited:.0f}s in {what} at step {step} "
                         f"(timeout {self.timeout_s:g}s): a peer rank may be stalled or gone. Advice: {ADVICE}")
            if (self.file_before_s is not None and self.report and waited >= self.file_before_s
                    and self._filed != (what, step)):
                self._filed = (what, step)
                _quietly(lambda: self.report(
                    f"communication failure on rank {self.rank} of {self.world} at step {step}, in {what}: no answer "
                    f"after {waited:.1f}s, and NCCL's watchdog ends the process at the timeout "
                    f"({settings(self.backend, self.timeout_s)}). A peer rank stopped answering or died: {ADVICE}"))

    def close(self) -> None:
        self._stop.set()


def watch_for_run(cfg, *, rank: int, world: int, cuda: bool, count: Callable[[str], None]) -> CommWatch:
    """The run's watch: a timeout becomes a diagnosis in the run directory (read by the driver), not a hang."""
    from raytrain import storage
    from raytrain.rundir import COMM_FAILURE, RunDir

    comm_file = RunDir(cfg.run_uri).uri(COMM_FAILURE)
    return CommWatch(rank, world, "nccl" if cuda else "gloo", cfg.scaling.collective_timeout_s, count=count,
                     report=lambda msg: storage.write_text(comm_file, msg),
                     retract=lambda: storage.delete_file(comm_file))


def _quietly(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - the storage may be what failed; the log line stands
        pass


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__
