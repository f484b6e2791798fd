"""Every use of Ray's private modules, in one place: written against ray 2.60.0 (pinned in pyproject.toml).

Ray has no public API for these; each is a small named function here so that a Ray upgrade means reading
this one file. Nothing here imports Ray at module import: callers decide when Ray is loaded.
"""

from __future__ import annotations

import logging
import sys
from typing import Optional

RAY_VERSION = "2.60.0"


def train_context():
    """The Ray Train worker's own context (inside a Train worker); its preemption info is read without a remote call."""
    from ray.train.v2._internal.execution.context import get_train_context

    return get_train_context()


def quiet_train_report_logger(level: int = logging.WARNING) -> None:
    """Ray Train's "Reporting training result N" comes from a logger named by its file path, outside ray.train."""
    try:
        from ray.train.v2._internal.execution import context
    except ImportError:
        return
    logger = getattr(context, "logger", None)
    if logger is not None:
        logger.setLevel(level)


def controller_callback_base() -> type:
    """The base class of callbacks that run inside the Train controller (Train v2 has no public one)."""
    from ray.train.v2._internal.execution.callback import ControllerCallback

    return ControllerCallback


def shorten_placement_group_cleaner(callbacks: list, stop_timeout_s: float) -> None:
    """Ray's PlacementGroupCleanerCallback exits inside its own stop(), so the controller always waits out its
    whole stop timeout (12 s); set a shorter one on the trainer's default callbacks."""
    for cb in callbacks:
        if type(cb).__name__ == "PlacementGroupCleanerCallback" and hasattr(cb, "_stop_timeout"):
            cb._stop_timeout = stop_timeout_s


def drop_placement_group_cleaner_in_a_driver(callbacks: list) -> list:
    """Ray's PlacementGroupCleanerCallback left out where the run's driver is a Ray driver process.

    The cleaner is a detached actor that removes the run's placement groups if its Train controller dies while the
    job lives on. Ray already removes a job's placement groups when its driver exits, and `raytrain train` exits as
    soon as its controller is gone; so there the cleaner only costs a new process importing ray.train beside the
    workers' start (about 2 s of every run on 2 cores) and a wait for its stop at the end. Inside a Ray actor or task
    (a Tune trial, whose driver outlives the trials that ASHA stops) it stays.
    """
    import ray._private.worker as ray_worker

    if ray_worker.global_worker.mode == ray_worker.WORKER_MODE:  # (a driver not yet connected is a driver too)
        return callbacks
    return [cb for cb in callbacks if type(cb).__name__ != "PlacementGroupCleanerCallback"]


def drop_unused_datasets_callback(callbacks: list, datasets: Optional[dict]) -> list:
    """Ray's DatasetsCallback without Ray Datasets to shard: left out.

    Ray 2.60 adds it to every trainer, and on every worker group start (each restart too) it creates a
    DatasetManager actor: a new process that imports ray.train and Ray Data (1.7 s of imports measured here),
    there only to hand out shards of the trainer's `datasets`. raytrain's workers read their shards themselves
    (raytrain/worker/data_plane.py) and pass none, so the process only competed with the new workers for CPU.
    """
    if datasets:
        return callbacks
    return [cb for cb in callbacks if type(cb).__name__ != "DatasetsCallback"]


def watch_drains_in_controller(callbacks: list) -> list:
    """Ray's drain watcher, run as a thread of the Train controller instead of an actor with max_restarts=-1.

    Ray 2.60's controller adds a PreemptionCallback that starts a watcher actor on every worker group start and
    passes it the workers' actor handles; handles go through the object store, and with max_restarts > 0 Ray
    Core prints an error-level line on every run (ray-project/ray#53727). The watcher's poll loop already runs
    on a thread of its own, so here it runs inside the controller's process: no line, and no new process (1-2 s
    of imports on these machines) in front of every restart. The controller runs where the driver does, which
    a drain of a worker node does not touch. Ray's own is turned off through its switch, which the trainer
    propagates to the controller; a user who set that switch keeps Ray's behaviour.
    """
    import os

    from ray.train.v2._internal.callbacks.preemption_callback import PreemptionCallback
    from ray.train.v2._internal.constants import ENABLE_PREEMPTION_WATCHER_ENV_VAR
    from ray.train.v2._internal.execution.preemption import PreemptionWatcher

    if not _WATCHER_SWITCHED_OFF:
        if ENABLE_PREEMPTION_WATCHER_ENV_VAR in os.environ:
            return callbacks  # the user's own setting of Ray's switch
        # Process-wide, not set and unset around one run: Tune starts trials' controllers from several threads.
        # Remembered, so the next run in this process (a Tune trial, a resubmission) still gets a watcher.
        os.environ[ENABLE_PREEMPTION_WATCHER_ENV_VAR] = "0"
        _WATCHER_SWITCHED_OFF.append(True)

    class ControllerPreemptionCallback(PreemptionCallback):
        def after_worker_group_start(self, worker_group) -> None:
            self._stop_watcher()  # a previous group's watcher, as Ray's own callback does
            node_to_ranks: dict = {}
            actors: dict = {}
            for w in worker_group.get_workers():
                rank = w.distributed_context.world_rank
                node_to_ranks.setdefault(w.metadata.node_id, []).append(rank)
                actors[rank] = w.actor
            # In the controller's own process (its poll loop is a daemon thread): no actor process to start on
            # every worker group start and restart, and no handles passed through the object store.
            self._watcher = PreemptionWatcher(node_to_ranks=node_to_ranks, poll_interval_s=self._poll_interval_s,
                                              worker_actors_by_rank=actors)

        def _stop_watcher(self) -> None:
            watcher, self._watcher = self._watcher, None
            if watcher is not None:
                watcher._stop_event.set()  # its thread ends at its next wake-up

    return [*callbacks, ControllerPreemptionCallback()]


_WATCHER_SWITCHED_OFF: list = []  # set once this process turned Ray's own watcher off (the user had not)


def scaling_policy_not_waiting_for_the_coordinator(policy):
    """Ray's fixed-size scaling policy, with its first resource request sent without waiting for the answer.

    Ray 2.60's controller registers the run's resources with an AutoscalingCoordinator, a detached actor of the
    cluster, before it starts the first worker group, and waits up to 5 s for the reply. On a fresh cluster that
    actor is a new process that imports Ray Data first (1.6 s on an idle machine here), all of it in front of the
    workers' start; on a busy one the wait runs out, Ray prints a warning with a traceback into the job's output
    and asks again, waiting once more. The request only informs the autoscaler, which also sees the worker
    group's pending placement group; the policy sends it again (waiting then, by when the actor is up) every
    20 s while the group runs. Elastic policies read reservations back from the coordinator: left as they are.
    """
    import time

    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import ResourceRequestPriority
    from ray.train._internal.autoscaling_coordinator_client import build_train_resource_request
    from ray.train.v2._internal.execution.scaling_policy import AUTOSCALING_REQUESTS_EXPIRE_TIME_S
    from ray.train.v2._internal.execution.scaling_policy.fixed import FixedScalingPolicy

    if type(policy) is not FixedScalingPolicy:
        return policy

    class FixedScalingPolicyNotWaiting(FixedScalingPolicy):
        def _send_resource_request(self):
            resources, selectors = build_train_resource_request(
                self.scaling_config, self._get_num_workers_for_resource_request())
            client = self._coordinator_client
            client._autoscaling_coordinator.request_resources.remote(
                requester_id=self._requester_id, resources=resources, label_selectors=selectors,
                expire_after_s=AUTOSCALING_REQUESTS_EXPIRE_TIME_S, priority=ResourceRequestPriority.HIGH)
            client._latest_autoscaling_request_time = time.monotonic()  # the next one in 20 s, as after a reply

    return FixedScalingPolicyNotWaiting(scaling_config=policy.scaling_config)


def reset_token_cache() -> None:
    """Ray's token loader caches "no token" once it has looked; forget that after a token file is created."""
    if "ray._raylet" in sys.modules:
        sys.modules["ray._raylet"].AuthenticationTokenLoader.instance().reset_cache()


def reload_ray_config() -> None:
    """Ray caches its config (auth mode included) when its core module loads; re-read it from the environment
    (what ray.init() does when it turns token mode on by itself)."""
    if "ray._raylet" in sys.modules:
        sys.modules["ray._raylet"].Config.initialize("")


def local_auth_token() -> Optional[str]:
    """The token this machine has (RAY_AUTH_TOKEN, its file), whether or not RAY_AUTH_MODE is set here; None if none."""
    from ray._raylet import AuthenticationTokenLoader

    loader = AuthenticationTokenLoader.instance()
    return loader.get_raw_token(ignore_auth_mode=True) if loader.has_token(ignore_auth_mode=True) else None


def token_auth_enabled() -> bool:
    """Whether the Ray instance this process belongs to uses token authentication."""
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    return is_token_auth_enabled()


def valid_request_token(authorization: str) -> bool:
    """Whether an HTTP Authorization header carries this cluster's Ray token."""
    from ray._private.authentication.authentication_utils import validate_request_token

    return validate_request_token(authorization)


def worker_group_callback_base() -> type:
    """The base class of callbacks the Train controller runs around its worker groups (no public one in 2.60)."""
    from ray.train.v2._internal.execution.callback import WorkerGroupCallback

    return WorkerGroupCallback


def restarting_state() -> type:
    """The controller state a failure moves a running group into (a retry is decided)."""
    from ray.train.v2._internal.execution.controller.state import RestartingState

    return RestartingState


def kv_put(key: str, value: bytes) -> None:
    """A small value in the cluster's GCS key-value store (no object storage request, a millisecond)."""
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put(key, value, overwrite=True, namespace="raytrain")


def kv_get(key: str) -> Optional[bytes]:
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_initialized

    return _internal_kv_get(key, namespace="raytrain") if _internal_kv_initialized() else None


def kv_del(key: str) -> None:
    from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_initialized

    if _internal_kv_initialized():
        _internal_kv_del(key, namespace="raytrain")


# Ray's torch backend, in the pieces raytrain.torch_backend drives from the controller (each imports torch only where
# it runs: on a worker, or in the driver that wraps the train function).

def address_and_free_port() -> tuple:
    """(this node's IP, a free port): where Ray's torch backend puts the process group's master (run on rank 0)."""
    from ray.train._internal.utils import get_address_and_port

    return get_address_and_port()


def set_torch_distributed_env() -> None:
    """LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, RANK, WORLD_SIZE and the device variables, as Ray sets them."""
    from ray.train.torch.config import _set_torch_distributed_env_vars

    _set_torch_distributed_env_vars()


def setup_torch_process_group(**kwargs) -> None:
    """Ray's process-group set-up on a worker (NCCL's async error handling included)."""
    from ray.train.torch.config import _setup_torch_process_group

    _setup_torch_process_group(**kwargs)


def shutdown_torch(destroy_process_group: bool) -> None:
    from ray.train.torch.config import _shutdown_torch

    _shutdown_torch(destroy_process_group=destroy_process_group)


def torch_shutdown_timeout_s() -> int:
    from ray._private import ray_constants
    from ray.train.constants import DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S

    return ray_constants.env_integer(TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S)


def torch_train_func_context():
    """The context Ray's torch backend runs the train function in (the CUDA device set)."""
    from ray.train.torch.config import TorchConfigContextManager

    return TorchConfigContextManager


def torch_framework():
    """How Ray Train's state export names a torch run's framework."""
    from ray.train.v2._internal.util import TrainingFramework

    return TrainingFramework.TORCH
