"""Request validation shared by the endpoints: `RequestError` and typed field readers that say what to send."""

from __future__ import annotations

from typing import Optional


class RequestError(Exception):
    """A client mistake: answered with `status` and the one-line `reason` (`param`: the field at fault)."""

    def __init__(self, status: int, reason: str, param: Optional[str] = None):
        super().__init__(reason)
        self.status, self.reason, self.param = status, reason, param


def int_field(body: dict, key: str, default: Optional[int], lo: int, hi: int) -> Optional[int]:
    """body[key] as an integer in [lo, hi] (default when absent or null)."""
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise RequestError(422, f"'{key}' must be an integer in [{lo}, {hi}], got {v!r}", key)
    return v


def number_field(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    """body[key] as a number in [lo, hi] (default when absent or null)."""
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise RequestError(422, f"'{key}' must be a number in [{lo:g}, {hi:g}], got {v!r}", key)
    return float(v)


def bool_field(body: dict, key: str, default: bool = False) -> bool:
    """body[key] as a JSON boolean."""
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(422, f"'{key}' must be true or false, got {v!r}", key)
    return v


def stop_field(body: dict) -> list[str]:
    """`stop`: a string or a list of up to 4 non-empty strings."""
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(422, f"'stop' must be a non-empty string or a list of up to 4 of them, got {v!r}", "stop")
    return stops
