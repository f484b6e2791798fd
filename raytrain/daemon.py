"""Start a node-side service once, detached from the shell that starts it: its own session, a pid file; a second start
finds it alive and starts nothing (cluster start commands run again on every `ray up`)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import time
from typing import Callable, Optional

from raytrain.errors import UserError


def running(pid_file: str, argv: list[str]) -> Optional[int]:
    """The pid in `pid_file` when that process is alive and runs `argv` (a pid the system gave to another process
    since does not count); None otherwise."""
    try:
        pid = int(open(pid_file).read().strip())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = [a.decode() for a in f.read().split(b"\0") if a]
    except (OSError, ValueError):
        return None
    return pid if cmdline[-len(argv):] == argv else None


def start_once(argv: list[str], *, pid_file: str, log_file: str, ready: Callable[[], bool],
               ready_timeout_s: float = 60.0) -> tuple[int, bool]:
    """(pid, started): the process of `pid_file` when it already runs `argv`, else `argv` started in a session of its
    own (it outlives the shell and `ray stop`), output to `log_file`, once `ready()` says it serves. Starts are
    serialised by a lock beside the pid file; a process that exits before it is ready is an error with its log's end."""
    os.makedirs(os.path.dirname(os.path.abspath(pid_file)), exist_ok=True)
    with open(pid_file + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        pid = running(pid_file, argv)
        if pid is not None:
            return pid, False
        with open(log_file, "ab") as log:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, close_fds=True)
        deadline = time.monotonic() + ready_timeout_s
        while not ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                if proc.poll() is None:
                    proc.kill()
                tail = open(log_file, errors="replace").read()[-600:].strip().splitlines()[-1:]
                raise UserError(f"{' '.join(argv[:4])} did not start (exit {proc.poll()}): {' '.join(tail)} "
                                f"(log: {log_file})")
            time.sleep(0.1)
        tmp = pid_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(f"{proc.pid}\n")
        os.replace(tmp, pid_file)
        return proc.pid, True
