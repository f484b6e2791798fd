"""What a person sees from raytrain's processes: library chatter silenced at its source, our own lines kept.

Everything silenced here is either a notice meant for a library's maintainers (deprecations), a line that
repeats what our own progress line says (Ray Train's per-report dump), or a guess a library announces
that we make for it explicitly (DeepSpeed's accelerator). What the run needs to keep is in the run
directory (metrics.jsonl, summary.json, attempts.jsonl) and Ray's session logs, not on the console.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import warnings


def quiet_warnings() -> None:
    # Deprecation notices from torch / DeepSpeed / transformers: a user of raytrain can act on none of them.
    for category in (FutureWarning, DeprecationWarning, PendingDeprecationWarning):
        warnings.filterwarnings("ignore", category=category)


def quiet_progress_bars() -> None:
    """Call before transformers / huggingface_hub are imported. Their per-load bars ("Loading weights", "Writing
    model shards") repeat on every export, serve replica and worker start; our own line says what was loaded."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers reads hub's switch at import
    if "transformers" in sys.modules:  # imported already (a reused Ray worker process)
        sys.modules["transformers"].utils.logging.disable_progress_bar()


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
    if "deepspeed" not in sys.modules:
        if "DS_ACCELERATOR" not in os.environ:
            import torch

            if not torch.cuda.is_available():
                os.environ["DS_ACCELERATOR"] = "cpu"
        blocked = "mlflow" not in sys.modules
        if blocked:
            sys.modules["mlflow"] = None  # an ImportError for that one import; its try/except turns the feature off
        try:
            import deepspeed  # noqa: F401
        finally:
            if blocked:
                del sys.modules["mlflow"]
    import deepspeed.ops

    # DeepSpeed builds its CPU shared-memory allreduce op (45-100 s of gcc, once per venv) when it first sets up a
    # process group, for one use: its inference all-reduce (tensor-parallel layers on CPU), which falls back to the
    # gloo group without it. Training's collectives use the gloo group either way. This table of which ops can be
    # built is read only there (deepspeed 0.19.8); filled in first, it also skips the probe of every op.
    vars(deepspeed.ops).setdefault("__compatible_ops__", {})["deepspeed_shm_comm"] = False


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
    # "Reporting training result N: TrainingReport(...)": outside the ray.train tree that RunConfig's
    # LoggingConfig filters.
    from raytrain.ray_internals import quiet_train_report_logger

    quiet_train_report_logger(logging.WARNING)


@contextlib.contextmanager
def no_stdout():
    """DeepSpeed's comm set-up print()s "DeepSpeed ... built successfully" on every start; nothing else it
    prints to stdout during engine creation is for a user (its warnings go through its logger, to stderr)."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield
