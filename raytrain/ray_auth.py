"""Ray token authentication for every Ray instance raytrain starts or joins: one token, created once, never overwritten.

Ray 2.60 runs clusters in token mode: a `ray start` with no token refuses to start, and a client
without one is refused ("Missing authentication token"). The token lives where Ray itself looks:
$RAY_AUTH_TOKEN, else the file $RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token. We create that file only when
none of the three exists, and we never switch authentication off.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from raytrain.internals.ray import reload_auth_config

MODE_ENV = "RAY_AUTH_MODE"


def token_path() -> Path:
    """The file Ray reads the token from (when $RAY_AUTH_TOKEN is not set)."""
    return Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token").expanduser()


def where() -> str:
    """One line: where the token lives and how a client in another shell finds it."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return ("Ray token authentication: token from $RAY_AUTH_TOKEN; clients in another shell need the same "
                f"variable and {MODE_ENV}=token")
    return (f"Ray token authentication: token in {token_path()}; `ray job submit` from another shell finds it "
            f"there when {MODE_ENV}=token is set")


def ensure_token(create: bool = True) -> bool:
    """Make this process (and what it starts) use token mode, creating a token if none exists.

    `create=False` when joining an existing cluster: a new random token could never match its token.
    Returns True when a token was created now. An explicit RAY_AUTH_MODE is the user's choice and is kept.
    """
    path = token_path()
    have = bool(os.environ.get("RAY_AUTH_TOKEN")) or (path.is_file() and path.stat().st_size > 0)
    if not (create or have):
        return False  # joining a cluster with no token here: Ray's own rules (and its error) apply
    if MODE_ENV not in os.environ:
        os.environ[MODE_ENV] = "token"
        reload_auth_config()  # Ray read the auth mode when it loaded
    if os.environ[MODE_ENV].lower() != "token" or have:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        # O_EXCL: when two starts race, the first token wins and the second start uses it.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))  # what `ray get-auth-token --generate` writes: 256 random bits
    reload_auth_config()  # its token loader cached "no token" when it looked
    return True


if __name__ == "__main__":  # scripts/_env.sh: `python -m raytrain.ray_auth` prints where the token lives
    created = ensure_token()
    print(("created a new token. " if created else "") + where())


def local_token() -> str | None:
    """The token this machine has, where Ray reads it ($RAY_AUTH_TOKEN, else the token file), whether or not
    RAY_AUTH_MODE is set here; None if none."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path = token_path()
    try:
        return path.read_text().strip() or None
    except OSError:
        return None
