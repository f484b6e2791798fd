"""How every raytrain command reaches Ray: one rule per kind of address, checked before any work starts.

The address is the command's setting (`scaling.address` for train and tune), else $RAY_ADDRESS:

| address | what the command does |
| --- | --- |
| none, or `local` | starts a private local Ray instance for itself (at least this machine's CPUs, more when the command needs more, e.g. train's workers + data CPUs), with token authentication (a token is created if none exists); it is shut down when the command ends |
| `auto`, or `HOST:PORT` (the GCS address) | joins that running cluster (`auto`: the one this node belongs to, after `ray start`) with the token this machine has |
| `ray://HOST:10001` | joins through Ray Client, with the token this machine has |
| `http://...`, `https://...` | refused with one line: that is the Ray Jobs API address (what `ray job submit` and `scripts/local_cluster.sh env` use), which a driver cannot join; submit with `ray job submit -- raytrain <command> ...`, or on a cluster node use `auto` |

A process already connected to Ray (a test session, a Tune trial) keeps its connection, whatever the address
(a Jobs API address is refused all the same).
`raytrain prepare` with `engine=auto` connects only when an address other than the Jobs API's is given
(otherwise it reads in this process); `engine=ray` follows the table.

Every connection forwards the non-secret S3 settings (AWS_ENDPOINT_URL, AWS_REGION, ...) to the job's
workers, never credentials, and, on a cluster named by its address, RAY_ADDRESS itself, which Ray Train's
placement-group cleaner uses to find the cluster.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Callable, Optional

from raytrain.errors import UserError

# Non-secret S3 settings that workers need to see the same endpoint as the driver. Credentials are
# never forwarded: every node gets them from its own AWS provider chain (instance profile, env, files).
FORWARDED_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION",
                 # encryption of object traffic and objects (raytrain/storage.py): the same in every process
                 "RAYTRAIN_S3_ALLOW_HTTP", "RAYTRAIN_S3_SSE", "RAYTRAIN_S3_SSE_KMS_KEY_ID")
LOCAL = (None, "", "local")
# Commands whose config has scaling.address; the others are pointed at RAY_ADDRESS.
_SETTING = {"train": "scaling.address", "tune": "scaling.address"}


def already_connected() -> bool:
    """Whether this process holds a Ray connection (checked without importing Ray, a second of start-up)."""
    ray = sys.modules.get("ray")
    return bool(ray is not None and ray.is_initialized())


def resolve(setting: Optional[str] = None) -> Optional[str]:
    """The address a command uses: its own setting, else $RAY_ADDRESS; None for a private local instance."""
    return setting or os.environ.get("RAY_ADDRESS") or None


def is_jobs_api(address: Optional[str]) -> bool:
    return bool(address) and address.startswith(("http://", "https://"))


def check_address(command: str, setting: Optional[str] = None, prefix: str = "") -> Optional[str]:
    """Refuse a Jobs API address with one line (before any work: fast); returns the address to use."""
    address = resolve(setting)
    if is_jobs_api(address):  # wrong for every driver, connected or not: say so before anything runs
        name = "scaling.address" if setting else "RAY_ADDRESS"
        auto = _SETTING.get(command, "RAY_ADDRESS") + "=auto"
        raise UserError(f"{prefix}{name}={address} is the Ray Jobs API address, which a driver cannot join: submit "
                        f"with `ray job submit -- raytrain {command} ...`, or on a cluster node set {auto}")
    return address


PROBE_S = 5.0  # a cluster's GCS (or Ray Client server) answers a TCP connect at once when it is up


def _reachable(address: str, setting: Optional[str]) -> None:
    """A HOST:PORT (or ray://HOST:PORT) that accepts no connection is one line, not Ray's minutes of retries."""
    import socket

    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if address == "auto" or not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_S).close()
    except OSError as e:
        name = "scaling.address" if setting else "RAY_ADDRESS"
        raise UserError(f"{name}={address}: no Ray cluster answers there ({e.strerror or type(e).__name__}); start "
                        "one (`ray start --head`, `ray up cluster/...`) or fix the address") from None


def forwarded_env(address: Optional[str]) -> dict[str, str]:
    """Environment the job's workers get from the driver (see the module docstring)."""
    # Inside `ray job submit` the job's runtime_env already reaches the workers with the S3 settings; adding
    # keys it also sets would make Ray refuse the merge. RAY_ADDRESS (below) it does not set.
    from raytrain.internals.ray import in_ray_job

    env = {} if in_ray_job() else {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
    if address not in LOCAL and address != "auto" and not address.startswith("ray://"):
        # Ray Train's placement-group cleaner looks the cluster up once a second; without an address it
        # searches the machine, and with a second Ray instance there it warns on every look.
        env["RAY_ADDRESS"] = address
    return env


def connect(command: str, setting: Optional[str] = None, *, local_cpus: float = 0.0,
            local_options: Optional[dict] = None, before_local_start: Optional[Callable[[], None]] = None,
            worker_logs: bool = True, logging_level: int = logging.WARNING) -> bool:
    """Connect as the module docstring's table says. True when this call started a private local instance
    (the caller shuts it down). `local_cpus`: logical CPUs the command needs on a local instance;
    `before_local_start` may refuse with a UserError; `worker_logs`: echo workers' output here."""
    import ray

    from raytrain.ray_auth import ensure_token

    if ray.is_initialized():
        return False
    address = check_address(command, setting)
    local = address in LOCAL
    if not local:
        _reachable(address, setting)
    ensure_token(create=local)  # joining: a new random token could never match the cluster's
    env = forwarded_env(address)
    kw: dict = {"runtime_env": {"env_vars": env} if env else None, "log_to_driver": worker_logs,
                "logging_level": logging_level}
    if worker_logs:
        # A job-level logging config drops the "(RayTrainWorker pid=...)" prefix from forwarded lines and
        # keeps Ray's INFO chatter off this console; the workers' own lines still arrive.
        kw["logging_config"] = ray.LoggingConfig(encoding="TEXT", log_level=logging.getLevelName(logging_level))
    if not local:
        ray.init(address=address, **kw)
        return False
    if before_local_start is not None:
        before_local_start()
    # address="local": a fresh instance, never a stray cluster an earlier `ray start` left on this machine
    # (ray.init() alone would join it).
    ray.init(address="local", num_cpus=max(int(local_cpus + 0.999), os.cpu_count() or 1), include_dashboard=False,
             **kw, **(local_options or {}))
    return True
