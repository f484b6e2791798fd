"""The registry of every reach into another package's private code: the version each was written for, its gate, its fallback.

A reach is a use of something a package does not promise to keep: a private module or name, a `sys.modules` entry,
a patched module global, a private attribute, a private class's name or signature. Each lives in this package, one
module per package reached (`ray.py`, `deepspeed.py`), registered (registry.py) with the version it was written for, the gain
that justifies it and what happens without it. Callers ask `gate(name)` before using one (or go through `guarded`):
on another version of the package, or with RAYTRAIN_INTERNALS=stock (every gate closed: tests, and a user's escape
hatch after an upgrade), the gate is closed and the caller falls back: to the package's stock behaviour where there is
one, else the feature turns off; a security check fails closed. A reach that raises falls back the same way. Either
way one warning line per reach and process says so (rank 0's only, on a Train worker group).
tests/test_internals.py fails on a private reach anywhere else in raytrain/.
"""
