# Sourced by demo.sh and test.sh: create or reuse .venv at the repo root and install raytrain into it.
# Needs only Python >= 3.10, pip and gcc. Re-installs only when pyproject.toml changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
EXTRAS="${1:-}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  if ! "$PY" -m venv "$VENV" >/dev/null 2>&1; then
    rm -rf "$VENV"
    echo "[setup] error: '$PY -m venv' failed; install the venv module (Debian/Ubuntu: apt-get install python3-venv)" >&2
    exit 1
  fi
fi
# DeepSpeed compiles its CPU Adam op (ZeRO offload) against the Python headers at first use.
if ! "$VENV/bin/python" -c "import os,sys,sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))"; then
  echo "[setup] error: Python headers (Python.h) not found; DeepSpeed needs them (Debian/Ubuntu: apt-get install python3-dev)" >&2
  exit 1
fi
if ! command -v gcc >/dev/null 2>&1 && ! command -v cc >/dev/null 2>&1; then
  echo "[setup] error: no C compiler; DeepSpeed needs gcc (Debian/Ubuntu: apt-get install gcc g++)" >&2
  exit 1
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
# Some machines (this project's CI among them) set PYTHONDONTWRITEBYTECODE; then every process - each Ray worker,
# controller, test - compiles from source every module that set-up's import below (or pip) did not compile, and
# raytrain's own: about 0.2 s each for raytrain alone. Bytecode caches are .gitignored.
unset PYTHONDONTWRITEBYTECODE

stamp="$VENV/.raytrain-installed${EXTRAS:+-$EXTRAS}"
want="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
# The test extra holds every other extra (tests/test_structure.py checks it): after ./scripts/test.sh neither
# demo.sh (no extra) nor an extra's script (finetune.sh: lora) needs a second pip run.
if [ "$(cat "$VENV/.raytrain-installed-test" 2>/dev/null)" = "$want" ]; then
  stamp="$VENV/.raytrain-installed-test"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing raytrain${EXTRAS:+[$EXTRAS]} and its pinned dependencies (first time: a few minutes)"
  # This machine's pip config names local indexes that may not exist; pip warns for each package.
  quiet() { "$@" 2>&1 | { grep -v "^WARNING: Location .* is ignored" || true; }; }
  # torch first, pinned: an unpinned resolve would pull the newest (multi-GB CUDA) build. PyPI's
  # Linux wheel of 2.13.0 is itself a CUDA build; on CPU-only machines install the CPU wheel of the
  # same version from PyTorch's CPU index into .venv before running this script to save the download.
  # --no-compile: pip byte-compiles every module it installs (about 29,000 files with the test extra, 100 s of one
  # core here), most of which no run imports. Python compiles a module at its first import instead, and the
  # modules every command imports are compiled below, once, in one process (about 20 s), so that a first run's
  # processes do not each compile them.
  if ! python -c "import torch" 2>/dev/null; then
    quiet python -m pip install -q --no-compile "torch==2.13.0"
  fi
  quiet python -m pip install -q --no-compile -e "$ROOT${EXTRAS:+[$EXTRAS]}"
  python - <<'PY' >/dev/null 2>&1 || true
import importlib
from raytrain.quiet import quiet_deepspeed
quiet_deepspeed()  # torch and DeepSpeed, as a worker imports them
for name in ("raytrain.cli", "raytrain.trainer", "raytrain.worker.loop", "raytrain.data.prepare", "raytrain.serving.app",
             "ray.train.torch", "ray.data", "ray.serve", "deepspeed.runtime.engine",
             "transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama",
             "transformers.models.mixtral.modeling_mixtral"):
    try:
        importlib.import_module(name)
    except Exception:  # an extra that is not installed: its modules compile at first use
        pass
PY
  echo "$want" > "$stamp"
fi

# DeepSpeed's JIT-built ops (CPU Adam for ZeRO offload; its shm op is never built: raytrain/quiet.py) are cached per
# virtual environment. Torch's default cache (~/.cache/torch_extensions/py311_cpu) is shared by every venv of one
# Python, and a build's command names its venv's paths, so two venvs (two checkouts) rebuilt an op in turn, 45-100 s
# each time. A folder set by the user wins.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$VENV/torch_extensions}"
# A process killed while DeepSpeed (torch's extension loader) held its build lock leaves the lock file
# behind, and every later DeepSpeed start then waits on it forever. No build takes minutes here, so a
# lock older than 10 minutes is stale.
find "$TORCH_EXTENSIONS_DIR" -name lock -mmin +10 -delete 2>/dev/null || true
# Ray's token authentication: clients and clusters we start agree on token mode, and a
# token exists before the first `ray start` (which refuses to start without one). Never overwritten.
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
RAYTRAIN_AUTH_LINE="$(python -m raytrain.ray_auth)"
export RAYTRAIN_AUTH_LINE
export RAY_USAGE_STATS_ENABLED=0
