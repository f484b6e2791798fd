"""What a person sees from raytrain's processes: library chatter silenced at its source, our own lines kept.

Everything silenced here is either a notice meant for a library's maintainers (named deprecations, one by one),
a progress bar that repeats what our own line says, or a guess a library announces that we make for it explicitly
(DeepSpeed's accelerator). What the run needs to keep is in the run
directory (metrics.jsonl, summary.json, attempts.jsonl) and Ray's session logs, not on the console.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import warnings


# Notices a user of raytrain can act on none of: (category, module that warns (regex), message (regex), why it is
# here). Filtered one by one, never a whole category: a new deprecation, the one announcing the next break, shows.
# (Python shows FutureWarnings by default, DeprecationWarnings only from __main__.)
KNOWN_WARNINGS: tuple = (
    (FutureWarning, r"torch\.distributed\.c10d_logger",
     r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
     "DeepSpeed 0.19.8's ZeRO collectives call them on every step (torch 2.13 renamed them)"),
    (FutureWarning, r"transformers\.modeling_utils", r"`is_gradient_checkpointing` is deprecated",
     "peft reads the attribute when it wraps a model for LoRA (transformers 5 renamed it)"),
)


def quiet_warnings() -> None:
    for category, module, message, _why in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


def quiet_progress_bars() -> None:
    """Call before transformers / huggingface_hub are imported. Their per-load bars ("Loading weights", "Writing
    model shards") repeat on every export, serve replica and worker start; our own line says what was loaded."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers reads hub's switch at import
    if "transformers" in sys.modules:  # imported already (a reused Ray worker process)
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def quiet_deepspeed() -> None:
    """Call before deepspeed is first imported (it imports it); also sets where its built ops are cached and
    leaves its CPU shm op unbuilt (below). With no CUDA, name the CPU accelerator ourselves, so DeepSpeed does not
    warn that it fell back to it ("Setting accelerator to CPU ..."). And keep its import
    from importing mlflow: its autotuner (never used here) does when mlflow is installed, 1.6-2 s of every
    worker's start-up on these machines (docs/BENCHMARKS.md); our MLflow tracker imports it where it is used."""
    # Its JIT-built ops (CPU Adam for ZeRO offload) cached per virtual environment, as scripts/_env.sh sets: torch's
    # default cache is shared by every venv of one Python, and two venvs would rebuild an op in turn (45-100 s).
    if sys.prefix != sys.base_prefix:
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    from raytrain.internals.deepspeed import import_deepspeed_without_mlflow, skip_shm_comm_op

    if "deepspeed" not in sys.modules:
        if "DS_ACCELERATOR" not in os.environ:
            import torch

            if not torch.cuda.is_available():
                os.environ["DS_ACCELERATOR"] = "cpu"
        import_deepspeed_without_mlflow()
    # DeepSpeed builds its CPU shared-memory allreduce op (45-100 s of gcc, once per venv) when it first sets up a
    # process group, for one use: its inference all-reduce (tensor-parallel layers on CPU), which falls back to the
    # gloo group without it. Training's collectives use the gloo group either way.
    skip_shm_comm_op()


def quiet_worker() -> None:
    """Start of a Ray Train worker: our progress lines stay, the rest goes to Ray's log files only."""
    quiet_warnings()
    quiet_progress_bars()
    quiet_deepspeed()
    # Ray Train configures the worker's root logger at INFO with a console handler; library INFO lines
    # (Ray Data, DeepSpeed's engine set-up) would reach the job's output through it.
    logging.getLogger().setLevel(logging.WARNING)
    for name in ("ray.train", "ray.data", "DeepSpeed", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # An elastic run's ranks leave after a preemption notice's checkpoint (worker/preemption.py NoticeLeave): the
    # controller's "reclaimed" line says so once; a traceback per rank would read as a failure.
    from raytrain.internals.ray import quiet_planned_exits

    quiet_planned_exits("NoticeLeave")


@contextlib.contextmanager
def no_stdout():
    """DeepSpeed's comm set-up print()s "DeepSpeed ... built successfully" on every start; nothing else it
    prints to stdout during engine creation is for a user (its warnings go through its logger, to stderr)."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield
