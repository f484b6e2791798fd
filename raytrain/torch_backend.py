"""Ray Train's torch process group (gloo / NCCL), set up by a Train controller that never imports torch.

Ray's TorchConfig lives in a module that imports torch first, and every run's controller unpickles the run's backend
config when it starts: 2.2 s of one core in front of each run's first worker group on these 2-core machines, with the
other core idle (docs/BENCHMARKS.md). This config and backend do what Ray's do for a Train v2 worker group, and the
controller's half of it (the master address, which function runs on which worker) needs no torch; each worker runs
Ray's own set-up and shutdown functions (`raytrain.ray_internals`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import ray
from ray.train.backend import Backend, BackendConfig

from raytrain import ray_internals

logger = logging.getLogger(__name__)


@dataclass
class ProcessGroupConfig(BackendConfig):
    """Ray's TorchConfig for raytrain's runs: `backend` "gloo" (CPU) or "nccl" (GPU), rendezvous through env://."""

    backend: str = "gloo"
    timeout_s: int = 1800

    @property
    def backend_cls(self):
        return ProcessGroupBackend

    @property
    def train_func_context(self):  # used where the train function is wrapped (the driver) and runs (the workers)
        return ray_internals.torch_train_func_context()

    @property
    def framework(self):
        return ray_internals.torch_framework()

    def to_dict(self) -> dict:
        return {"backend": self.backend, "init_method": "env", "timeout_s": self.timeout_s}


def _set_master(addr: str, port: int) -> None:
    os.environ["MASTER_ADDR"] = addr
    os.environ["MASTER_PORT"] = str(port)


class ProcessGroupBackend(Backend):
    """Ray's torch backend's start and shutdown for a Train v2 worker group, driven from the controller."""

    share_cuda_visible_devices = True  # as Ray's: each worker sees its node's GPUs of the run (NCCL needs the peers)

    def on_start(self, worker_group, backend_config: ProcessGroupConfig) -> None:
        addr, port = worker_group.execute_single(0, ray_internals.address_and_free_port)
        worker_group.execute(_set_master, addr=addr, port=port)
        worker_group.execute(ray_internals.set_torch_distributed_env)  # LOCAL_RANK, RANK, WORLD_SIZE, ...
        n = len(worker_group)
        ray.get([worker_group.execute_single_async(i, ray_internals.setup_torch_process_group,
                                                   backend=backend_config.backend, world_rank=i, world_size=n,
                                                   init_method="env://", timeout_s=backend_config.timeout_s)
                 for i in range(n)])

    def on_shutdown(self, worker_group, backend_config: ProcessGroupConfig) -> None:
        futures = worker_group.execute_async(ray_internals.shutdown_torch, destroy_process_group=len(worker_group) > 1)
        timeout_s = ray_internals.torch_shutdown_timeout_s()
        try:
            ray.get(futures, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            logger.warning("torch process group shutdown timed out after %s seconds", timeout_s)
