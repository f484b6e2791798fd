"""DeepSpeed's import as a training worker does it (raytrain.quiet.quiet_deepspeed), each case in a fresh process:
its built ops cached in this venv (two venvs sharing torch's per-user cache rebuilt the op in turn, 45-100 s each),
a user's folder kept, its autotuner kept from importing mlflow (1.6-2 s of every worker's start-up), and its CPU shm op
never built."""

import json
import os
import subprocess
import sys

PROBE = """
import json, os, sys
from raytrain.quiet import quiet_deepspeed
quiet_deepspeed()
import deepspeed.autotuning.autotuner as tuner
from deepspeed.comm.torch import build_shm_op
print(json.dumps({"dir": os.environ.get("TORCH_EXTENSIONS_DIR"), "mlflow": "mlflow" in sys.modules,
                  "tuner_mlflow": tuner.has_mlflow, "shm_op": build_shm_op() is not None}))
"""


def _probe(**env) -> dict:
    full = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**full, **env}, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_deepspeed_ops_are_cached_in_this_venv_and_mlflow_is_not_imported():
    got = _probe()
    if sys.prefix != sys.base_prefix:  # the suite runs in .venv; a system Python keeps torch's default
        assert got["dir"] == os.path.join(sys.prefix, "torch_extensions")
    assert not got["mlflow"] and not got["tuner_mlflow"]


def test_a_users_op_cache_folder_wins_and_the_shm_op_is_never_built(tmp_path):
    """DeepSpeed's CPU shm op (45-100 s of gcc at a venv's first run) is neither built nor loaded: what a process
    group's set-up asks for (deepspeed.comm.torch.build_shm_op) comes back empty, and nothing lands in the cache."""
    got = _probe(TORCH_EXTENSIONS_DIR=str(tmp_path))
    assert got["dir"] == str(tmp_path)
    assert got["shm_op"] is False and not os.listdir(tmp_path)
