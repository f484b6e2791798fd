"""A worker's console line."""

from __future__ import annotations

import sys


def say(msg: str) -> None:
    """A console line from a worker. Not print(): Ray Train v2 patches print to log *and* echo it."""
    sys.stdout.write(f"[raytrain] {msg}\n")
    sys.stdout.flush()
