"""Reaches into Ray's private code (written for ray 2.60.0, the pin), each gated: see raytrain/internals/__init__.py.

Nothing here imports Ray at module import: callers decide when Ray is loaded.
"""

from __future__ import annotations

import hmac
import os
from typing import Optional

from raytrain.internals.registry import fell_back, gate, guarded, register

V = "2.60.0"

PREEMPTION_INFO = register(
    "ray.train.local_preemption_info", package="ray", written_for=V,
    gain="a drain notice read every step from the worker's own Train context, with no remote call; Ray's public "
         "ray.train.get_preemption_info() is a barrier through the controller (a round trip per call)",
    fallback="drain notices read with ray.train.get_preemption_info() every PUBLIC_POLL_STEPS steps (SIGTERM as before)")
CONTROLLER_CALLBACKS = register(
    "ray.train.controller_callbacks", package="ray", written_for=V,
    gain="restart phases timed inside the Train controller (attempts.jsonl); a Tune trial that ASHA stops aborts its "
         "Train run, whose placement group would otherwise hold its CPUs and later trials would wait forever",
    fallback="restart phases not recorded; a stopped Tune trial's placement group is left to Ray's own cleaner")
INTERNAL_KV = register(
    "ray.internal_kv", package="ray", written_for=V,
    gain="the controller hands a restart's phase times to rank 0 through GCS: no object-storage request between a "
         "fault and the first resumed step",
    fallback="restart phases not recorded")
TUNE_REPORT_QUEUE = register(
    "ray.tune.report_queue", package="ray", written_for=V,
    gain="a sweep trial's final report waits until Tune has taken the last forwarded one (else Tune may see them "
         "out of order and stop the trial before its summary)",
    fallback="a fixed 2 s wait before the final report")
AUTH_CONFIG = register(
    "ray.auth_config_reload", package="ray", written_for=V,
    gain="a token created by this process is used by its own ray.init (else 'Missing authentication token')",
    fallback="not reloaded: if Ray refuses the new token, run the command again")
DATA_REF_BUNDLES = register(
    "ray.data.ref_bundles", package="ray", written_for=V,
    gain="data.reader=ray: each unit's rows go from the object store of the node that read them straight to the ranks "
         "that need them; without it every byte of training data passes through the one ingest router's process "
         "(fetched, decoded, put again), a bandwidth that does not grow with the cluster",
    fallback="rows through the ingest router (Dataset.iter_rows, one ray.put per unit)")
AUTH_CHECK = register(
    "ray.auth_token_check", package="ray", written_for=V,
    gain="the serving admin endpoints check Ray's own token the way Ray does",
    fallback="fails closed: admin requests need 'Authorization: Bearer <this machine's Ray token>'")

CONTROLLER_YIELDS = register(
    "ray.train.controller_yields", package="ray", written_for=V,
    gain="a Ctrl-C (the Train controller's abort) ends an elastic run at once while it waits below MIN: Ray's control "
         "loop never gives its event loop a turn while no worker group runs",
    fallback="Ray's controller: a Ctrl-C while the run waits below MIN takes effect when capacity comes back or "
             "run.max_wait_for_capacity ends the wait")

ENV_KNOBS = register(
    "ray.internal_env", package="ray", written_for=V,
    gain="Ray-internal environment variables: Ray Train's worker poll at 0.5 s instead of 2 s (a dead worker and "
         "the end of every run are seen at the next poll: up to 1.5 s of every restart), and telling a driver that "
         "runs inside `ray job submit` (whose runtime_env already carries the S3 settings: Ray refuses a merge that "
         "sets them again)",
    fallback="Ray Train polls at its default; a driver inside a job is told by RAY_SUBMISSION_ID alone")
# Ray's own names of the variables (its internal constants: their names change without notice).
HEALTH_CHECK_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
PREEMPTION_POLL_ENV = "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"
JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


PLANNED_EXIT_LOG = register(
    "ray.train.error_log_filter", package="ray", written_for=V,
    gain="a rank that leaves on purpose (an elastic run's ranks after a preemption notice's checkpoint) is not "
         "logged as an error with its traceback, once per rank and reclaim, on the job's console",
    fallback="Ray Train logs each such exit as 'Error in training function' with its traceback")
# The module whose logger Ray Train reports a training function's exception with (ray/train/v2/_internal/util.py).
_ERROR_LOGGER = "ray.train.v2._internal.util"


def quiet_planned_exits(exception_name: str) -> None:
    """Drop Ray Train's error lines for the exception named (a planned exit); other errors are logged as before."""
    import logging

    if not gate(PLANNED_EXIT_LOG):
        return
    logger = logging.getLogger(_ERROR_LOGGER)
    if not any(getattr(f, "planned", None) == exception_name for f in logger.filters):
        drop = logging.Filter()
        drop.planned = exception_name
        drop.filter = lambda record: exception_name not in record.getMessage()
        logger.addFilter(drop)


def set_worker_poll_s(seconds: float) -> None:
    """Ray Train's controller polls its workers this often (Ray passes the driver's value on to the controller); a
    value the user set wins."""
    if gate(ENV_KNOBS):
        os.environ.setdefault(HEALTH_CHECK_ENV, str(seconds))


def preemption_poll_s(default: float = 5.0) -> float:
    """How often Ray Train relays a drain to its workers, as set for this process (drills shorten it)."""
    return float(os.environ.get(PREEMPTION_POLL_ENV, default)) if gate(ENV_KNOBS) else default


def in_ray_job() -> bool:
    """Whether this driver runs inside `ray job submit`."""
    return bool((gate(ENV_KNOBS) and os.environ.get(JOB_CONFIG_ENV)) or os.environ.get("RAY_SUBMISSION_ID"))


def local_preemption_info():
    """This worker's copy of Ray Train's preemption info (None: no drain), read without a remote call."""
    from ray.train.v2._internal.execution.context import get_train_context

    return get_train_context().preemption_context.preemption_info


def controller_callback_base() -> type:
    """The base class of callbacks that run inside the Train controller (Train v2 has no public one)."""
    from ray.train.v2._internal.execution.callback import ControllerCallback

    return ControllerCallback


def worker_group_callback_base() -> type:
    """The base class of callbacks the Train controller runs around its worker groups (no public one in 2.60)."""
    from ray.train.v2._internal.execution.callback import WorkerGroupCallback

    return WorkerGroupCallback


def restarting_state() -> type:
    """The controller state a failure moves a running group into (a retry is decided)."""
    from ray.train.v2._internal.execution.controller.state import RestartingState

    return RestartingState


def abort_controller(controller, timeout_s: float) -> None:
    """Ask a Train controller actor to shut its worker group down and remove its placement group."""
    import ray

    ray.get(controller.abort.remote(), timeout=timeout_s)


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


def report_queue_empty(callback) -> bool:
    """Whether Tune's TuneReportCallback has handed every forwarded report to Tune."""
    return callback._training_actor_item_queue.empty()


def output_blocks(ds):
    """(block ref, first row, rows) of each of a Dataset's output blocks in order, no block fetched here (Ray Data's
    RefBundle: its block refs, metadata and slices)."""
    for bundle in ds.iter_internal_ref_bundles():
        for ref, meta, part in zip(bundle.block_refs, bundle.metadata, bundle.slices):
            lo, hi = (part.start_offset, part.end_offset) if part is not None else (0, meta.num_rows)
            yield ref, lo, hi - lo


def block_row(block, i: int) -> dict:
    """Row i of a fetched Ray Data block as {column: Arrow scalar} (bytes columns stay zero-copy buffers)."""
    from ray.data.block import BlockAccessor

    table = BlockAccessor.for_block(block).to_arrow()
    return {name: table.column(name)[i] for name in table.column_names}


def reload_auth_config() -> None:
    """Ray caches its config (auth mode included) when its core module loads, and its token loader caches "no
    token" once it looked: re-read both (what ray.init() does when it turns token mode on by itself)."""
    if not gate(AUTH_CONFIG):
        return
    import sys

    raylet = sys.modules.get("ray._raylet")
    if raylet is None:  # not loaded yet: it will read the environment and the file when it is
        return
    try:
        raylet.Config.initialize("")
        raylet.AuthenticationTokenLoader.instance().reset_cache()
    except Exception as e:  # noqa: BLE001
        fell_back(AUTH_CONFIG, e)


def token_auth_enabled() -> bool:
    """Whether the Ray instance this process belongs to uses token authentication (closed gate: yes)."""
    if not gate(AUTH_CHECK):
        return True
    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled

        return is_token_auth_enabled()
    except Exception as e:  # noqa: BLE001
        fell_back(AUTH_CHECK, e)
        return True


def valid_request_token(authorization: str, local_token: Optional[str]) -> bool:
    """Whether an HTTP Authorization header carries this cluster's Ray token (closed gate: equal to the token this
    machine has, compared in constant time; no token here: refused)."""
    if gate(AUTH_CHECK):
        try:
            from ray._private.authentication.authentication_utils import validate_request_token

            return bool(validate_request_token(authorization))
        except Exception as e:  # noqa: BLE001
                fell_back(AUTH_CHECK, e)
    return bool(local_token) and hmac.compare_digest(authorization.encode(), f"Bearer {local_token}".encode())


ELASTIC_POLICY = register(
    "ray.train.elastic_policy", package="ray", written_for=V,
    gain="raytrain's scaling and failure policies in the Train controller: a group starts only at sizes that keep the "
         "global batch, sees a lost node at once (its raylet probed) instead of waiting a minute for a placement on a "
         "node Ray has not yet marked dead, waits below MIN without spending a budget, and a worker lost with its node "
         "is charged to run.max_preemptions, not run.max_failures",
    fallback="Ray's own policies: an elastic run trains at its MAX size only, waiting for it (the fixed size); a "
             "worker lost with its node is charged to run.max_failures")
DRAINING_NODES = register(
    "ray.draining_nodes", package="ray", written_for=V,
    gain="an elastic run never starts a worker group on a node Ray is draining (a noticed reclaim)",
    fallback="draining nodes count as capacity until they leave (a group started on one restarts once more)")


def draining_nodes() -> set:
    """Ids of the nodes Ray is draining (the same call Ray Train's own preemption watcher makes)."""
    def reach():
        import ray._private.state

        return set(ray._private.state.state.get_draining_nodes() or {})

    return guarded(DRAINING_NODES, reach, set)


_SIZINGS: dict = {}  # run token -> its Sizing, in the Train controller's process


def controller_sizing(token: str, make):
    """The one Sizing (raytrain/elastic/sizing.py) of run `token` in this (controller) process."""
    if token not in _SIZINGS:
        _SIZINGS[token] = make()
    return _SIZINGS[token]


def elastic_trainer(trainer_cls: type, make_sizing, failure_config, token: str) -> type:
    """`trainer_cls` (TorchTrainer) whose controller takes raytrain's scaling and failure policies, deciding through
    the Sizing that `make_sizing()` builds inside the controller (raytrain/elastic/sizing.py), one per `token`."""

    from ray.train.v2._internal.execution.scaling_policy import NoopDecision, ResizeDecision, ScalingPolicy

    from raytrain.errors import CapacityTimeout

    def sizing():
        # Both policies are pickled into the controller apart (each with its own copy of what it refers to): they
        # meet in a module of the controller's process.
        return controller_sizing(token, make_sizing)

    class RaytrainScaling(ScalingPolicy):
        def _get_num_workers_for_resource_request(self) -> int:
            return self.scaling_config.max_workers  # the autoscaler is asked for MAX

        def _resize(self, n: int):
            return ResizeDecision(num_workers=n, resources_per_worker=self.scaling_config._resources_per_worker_not_none)

        def make_decision_for_non_running_worker_group(self):
            self._maybe_send_resource_request()
            try:
                n = sizing().start_size()
            except CapacityTimeout:
                raise
            except Exception as e:  # noqa: BLE001 - a failing decision must not end the run: the fixed size
                fell_back(ELASTIC_POLICY, e)
                n = self.scaling_config.max_workers
            return NoopDecision() if n is None else self._resize(n)

        def before_controller_execute_resize_decision(self, decision) -> None:
            try:
                sizing().before_resize()  # a grow: the ranks checkpoint first (waits at most scaling.resize_wait_s)
            except Exception as e:  # noqa: BLE001 - the resize goes ahead from the newest checkpoint
                fell_back(ELASTIC_POLICY, e)

        def make_decision_for_running_worker_group(self, worker_group_state, worker_group_status):
            self._maybe_send_resource_request()
            try:
                s = sizing()
                nodes = {w.metadata.node_id for w in worker_group_state.workers}
                if nodes != s.group_nodes:
                    s.started(nodes, worker_group_state.num_workers)
                n = s.grow_size(worker_group_state.num_workers)
            except Exception as e:  # noqa: BLE001 - a failing decision must not end the run: stay at this size
                fell_back(ELASTIC_POLICY, e)
                n = None
            return NoopDecision() if n is None else self._resize(n)

    class ElasticTrainer(trainer_cls):
        def _initialize_and_run_controller(self, **controller_init_kwargs):
            controller_init_kwargs["scaling_policy"] = RaytrainScaling(self.scaling_config)
            controller_init_kwargs["failure_policy"] = _failure_policy(sizing)(failure_config)
            controller = guarded(CONTROLLER_YIELDS, lambda: _yielding_controller(sizing), lambda: None)
            if controller is None:
                return super()._initialize_and_run_controller(**controller_init_kwargs)
            return _run_controller(self, controller, controller_init_kwargs)

    ElasticTrainer.__name__ = ElasticTrainer.__qualname__ = trainer_cls.__name__
    return ElasticTrainer


def _yielding_controller(sizing) -> type:
    """Ray's TrainController whose loop gives its event loop a turn after every iteration, and takes the sizing's
    pause below MIN there (asyncio.sleep) instead of in the decision (time.sleep): Ray's loop never awaits while no
    worker group runs, so its abort() - a Ctrl-C in the driver - would wait until capacity came back."""
    import asyncio

    from ray.train.v2._internal.execution.controller import TrainController

    class YieldingController(TrainController):
        async def _run_control_loop_iteration(self):
            s = sizing()
            s.defer_pauses()
            await super()._run_control_loop_iteration()
            await asyncio.sleep(s.take_pause())

    return YieldingController


def _run_controller(trainer, controller_cls: type, controller_init_kwargs: dict):
    """DataParallelTrainer._initialize_and_run_controller of Ray 2.60.0 with another controller class: the actor on
    the driver's node, the environment Ray propagates; a Ctrl-C aborts it and raises KeyboardInterrupt."""
    import signal
    import threading

    import ray
    from ray.train.v2.api import data_parallel_trainer as dpt

    env_vars = dpt.get_env_vars_to_propagate()
    env_vars.setdefault(dpt.RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR,
                        dpt.DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE)
    here = {ray._raylet.RAY_NODE_ID_KEY: ray.get_runtime_context().get_node_id()}
    actor_cls = ray.remote(num_cpus=0, label_selector=here, runtime_env={"env_vars": env_vars})(controller_cls)
    controller = actor_cls.remote(**controller_init_kwargs)
    if threading.current_thread() is not threading.main_thread():  # a Tune trial's thread: no signal handlers
        ray.get(controller.run.remote())
        return ray.get(controller.get_result.remote())

    def interrupted(signum, frame):
        # Ray's own handler exits 0 (or 1) in silence; a Ctrl-C here aborts the controller (its workers with it) and
        # ends the command as an interrupt. A second Ctrl-C does not wait for the abort.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            ray.get(controller.abort.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - the controller exits inside abort(): its call fails by design
            pass
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGINT, interrupted)
    try:
        ray.get(controller.run.remote())
        return ray.get(controller.get_result.remote())
    finally:
        signal.signal(signal.SIGINT, before)


def _failure_policy(sizing) -> type:
    """Ray's failure policy, but a worker lost with its node (raytrain/elastic/sizing.py `lost`) is a preemption and a
    wait for capacity that ran out ends the run."""
    import time

    from ray.train.v2._internal.execution.failure_handling import FailureDecision
    from ray.train.v2._internal.execution.failure_handling.default import DefaultFailurePolicy, _is_preemption_failure
    from ray.train.v2.api.exceptions import ControllerError, WorkerGroupError

    from raytrain.errors import CapacityTimeout, RestoreElsewhere

    class RaytrainFailures(DefaultFailurePolicy):
        free_retries = 3  # restores that start over in a new attempt (RestoreElsewhere), not charged

        def make_decision(self, training_failed_error):
            err = training_failed_error
            if isinstance(err, ControllerError) and isinstance(err.controller_failure, CapacityTimeout):
                return FailureDecision.RAISE
            if isinstance(err, WorkerGroupError) and self.free_retries and err.worker_failures and all(
                    isinstance(getattr(e, "_base_exc", e), RestoreElsewhere) for e in err.worker_failures.values()):
                self.free_retries -= 1
                return FailureDecision.RETRY
            if isinstance(err, WorkerGroupError) and not _is_preemption_failure(err):
                s = sizing()
                try:
                    gone = s.lost(s.group_nodes)
                except Exception as e:  # noqa: BLE001 - unknown: charged as Ray would
                    fell_back(ELASTIC_POLICY, e)
                    gone = set()
                if gone:  # the worker went with its node (or left it after a notice): a reclaim, not a failure
                    s.publish({"event": "reclaimed" if gone <= s.drained else "lost_node", "time": round(time.time(), 3),
                               "nodes": sorted(gone)})
                    self._preemption_failures += 1
                    limit = self.failure_config.max_preemption_failures
                    return FailureDecision.RETRY if limit == -1 or self._preemption_failures <= limit \
                        else FailureDecision.RAISE
            return super().make_decision(err)

    return RaytrainFailures
