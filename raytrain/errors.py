"""The one exception type that reaches users as a single line and a non-zero exit."""


class UserError(Exception):
    """Bad input (config, data, storage, cluster). The message says what is wrong and what to do.

    The CLI prints it as one line and exits with status 2; no traceback, nothing half-written.
    """


class CapacityTimeout(UserError):
    """An elastic run waited run.max_wait_for_capacity below its MIN size and ends (exit status 3)."""

    exit_status = 3


class RestoreElsewhere(RuntimeError):
    """An attempt that must restore in a new attempt: its memory snapshots were refused and the storage checkpoint it
    falls back to needs an engine built another way. Not a failure of the run: an elastic run's controller retries
    it without charging run.max_failures (a fixed-size run's charges it, as Ray does)."""


def first_line(e: BaseException, limit: int = 200) -> str:
    """The line of an exception that names the cause: Ray prefixes errors raised in its workers with lines
    of its own ("ray::...", a traceback), and a log line or one-line error needs only the cause."""
    text = str(e).strip()
    for line in text.splitlines():
        if line.strip() and not line.startswith(("ray::", "Traceback", "  ")):
            text = line.strip()
    return (text or type(e).__name__)[:limit]
