# Sourced by demo.sh and test.sh: create or reuse .venv at the repo root and install raytrain into it.
# Needs only Python >= 3.10, pip and gcc. Re-installs only when pyproject.toml changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
EXTRAS="${1:-}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"

stamp="$VENV/.raytrain-installed${EXTRAS:+-$EXTRAS}"
want="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing raytrain${EXTRAS:+[$EXTRAS]} and its pinned dependencies (first time: a few minutes)"
  # This machine's pip config names local indexes that may not exist; pip warns for each package.
  quiet() { "$@" 2>&1 | { grep -v "^WARNING: Location .* is ignored" || true; }; }
  # torch first, pinned: an unpinned resolve pulls a multi-GB CUDA build on CPU machines.
  # On GPU machines install the CUDA build of the same version before running this script.
  if ! python -c "import torch" 2>/dev/null; then
    quiet python -m pip install -q "torch==2.13.0"
  fi
  quiet python -m pip install -q -e "$ROOT${EXTRAS:+[$EXTRAS]}"
  echo "$want" > "$stamp"
fi

# DeepSpeed JIT-compiles its CPU shared-memory allreduce op on first use (~30-100 s, needs gcc).
# Build it once here, into ~/.cache/torch_extensions, so the first training run does not pay it.
if ! python -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  python - <<'PY' 2>/dev/null || echo "[setup] note: DeepSpeed's shm op did not build; it will be built (or skipped) at first use"
import io, contextlib
with contextlib.redirect_stdout(io.StringIO()):
    from deepspeed.accelerator import get_accelerator
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        builder.load(verbose=False)
PY
fi
# Ray's token authentication (pitfalls #2): clients and clusters we start agree on token mode.
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
export RAY_USAGE_STATS_ENABLED=0
