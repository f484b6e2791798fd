"""Driver side: the Train controller a run gets, with raytrain's scaling and failure policies where Ray's internals are
the version they were written for (raytrain/internals/ray.py), else Ray's own at the run's MAX size."""

from __future__ import annotations

import functools
import hashlib

from raytrain.config import Config
from raytrain.elastic.sizing import build
from raytrain.internals.registry import gate
from raytrain.internals.ray import ELASTIC_POLICY, elastic_trainer


def trainer_class(cfg: Config, trainer_cls: type, failure_config) -> tuple[type, int | tuple[int, int]]:
    """(the trainer class, ScalingConfig's num_workers) for this run: raytrain's policies over the usable sizes, or
    the stock trainer at the largest usable size."""
    sizes = sorted(cfg.sizes())
    if not gate(ELASTIC_POLICY):
        return trainer_cls, sizes[-1]
    s = cfg.scaling
    make = functools.partial(build, sizes=sizes, per_worker=s.worker_resources, monitor_s=s.resize_monitor_s,
                             grow_stable_s=s.resize_monitor_s if s.grow_stable_s is None else s.grow_stable_s,
                             max_wait_s=cfg.run.max_wait_for_capacity, resize_wait_s=s.resize_wait_s,
                             run_uri=cfg.run_uri)
    token = hashlib.sha1(cfg.run_uri.encode()).hexdigest()[:12]
    return elastic_trainer(trainer_cls, make, failure_config, token), \
        (sizes[0] if len(sizes) == 1 else (sizes[0], sizes[-1]))
