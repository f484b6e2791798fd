"""The registry of reaches into other packages' private code: each one's version, gate and fallback."""


from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

FORCE_ENV = "RAYTRAIN_INTERNALS"  # "stock": every gate reads as a version mismatch


@dataclass(frozen=True)
class Reach:
    """One reach into a package's private code, and why it is worth its risk."""

    name: str
    package: str  # the distribution it reaches into (its installed version is checked)
    written_for: str  # the version it was written and tested against (the project's pin)
    gain: str  # what it buys: a failure removed, a per-step cost, restart seconds on a GPU cluster
    fallback: str  # what happens when its gate is closed or it raises


REACHES: dict[str, Reach] = {}
_WARNED: set[str] = set()


def register(name: str, *, package: str, written_for: str, gain: str, fallback: str) -> str:
    """Record a reach (at import of its module); returns its name, which its users pass to `gate`."""
    REACHES[name] = Reach(name, package, written_for, gain, fallback)
    return name


@functools.lru_cache(maxsize=None)
def installed(package: str) -> Optional[str]:
    """The installed version of a distribution; None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def check_env() -> None:
    """RAYTRAIN_INTERNALS, checked where a command starts: unset, empty or "stock"."""
    value = os.environ.get(FORCE_ENV, "").strip().lower()
    if value not in ("", "stock"):
        from raytrain.errors import UserError

        raise UserError(f"{FORCE_ENV}={os.environ[FORCE_ENV]!r} is not understood: set it to 'stock' (every reach "
                        "into another package's private code off, raytrain/internals) or unset it")


def forced_stock() -> bool:
    return os.environ.get(FORCE_ENV, "").strip().lower() == "stock"


def gate(name: str) -> bool:
    """Whether reach `name` may be used here: its package is the version it was written for, and not forced off.
    A closed gate says so once per process."""
    r = REACHES[name]
    have = installed(r.package)
    if not forced_stock() and have == r.written_for:
        return True
    why = f"{FORCE_ENV}=stock" if forced_stock() else f"{r.package} {have} installed, written for {r.written_for}"
    _warn(name, f"{r.name} off ({why}): {r.fallback}")
    return False


def fell_back(name: str, err: BaseException) -> None:
    """Reach `name` raised: say so once; the caller then takes the fallback."""
    first = (str(err).strip().splitlines() or [""])[0][:200]
    _warn(name, f"{name} failed ({type(err).__name__}: {first}): {REACHES[name].fallback}")


def guarded(name: str, reach: Callable[[], Any], fallback: Callable[[], Any]) -> Any:
    """reach() where the gate is open and it does not raise, else fallback()."""
    if gate(name):
        try:
            return reach()
        except Exception as e:  # noqa: BLE001 - any failure of private code means: take the stock path
            fell_back(name, e)
    return fallback()


def _warn(name: str, line: str) -> None:
    if name in _WARNED:
        return
    _WARNED.add(name)
    if os.environ.get("RANK", "0") == "0":  # a Train worker group: rank 0 speaks for all
        sys.stderr.write(f"[raytrain] warning: {line}\n")
        sys.stderr.flush()


def load_all() -> dict[str, Reach]:
    """Every registered reach: imports each module of raytrain.internals (none imports its package at import)."""
    import importlib
    import pkgutil

    import raytrain.internals as package

    for m in pkgutil.iter_modules(package.__path__):
        if m.name != "registry":
            importlib.import_module(f"raytrain.internals.{m.name}")
    return dict(REACHES)
