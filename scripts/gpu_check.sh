#!/usr/bin/env bash
# The prepared GPU check (issue 44; docs/BENCHMARKS.md, "GPU check (issue 44)"): on a bare H100 / H200 machine, with
# the wheels scripts/gpu_wheels.sh put in .whl/ carried beside the tree, it measures raytrain's step path on one GPU
# (GPT-2 124M, memory snapshots on and off, tests/test_gpu.py where Ray is installed, a ~1.1B Llama) beside the
# frozen baselines and a plain torch.compile loop, in at most 5 minutes, writing $OUT/gpu_check.json after each part.
#
#   ./scripts/gpu_check.sh [gpu_check.py args]      # results in ${OUT:-gpu_check_out}/
#
# Without a CUDA device it says so in one line and exits 2 at once. Env: PYTHON (default python3), OUT,
# GPU_CHECK_TIMEOUT (seconds for the whole Python run, default 290), GPU_CHECK_SITE (default /tmp/site).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"

if ! info="$("$PY" -c 'import torch; print(torch.__version__, int(torch.cuda.is_available()))' 2>/dev/null)"; then
  echo "gpu_check: no CUDA device (torch is not importable by $PY); run it on a GPU machine, see docs/BENCHMARKS.md" >&2
  exit 2
fi
if [ "${info##* }" != 1 ]; then
  echo "gpu_check: no CUDA device (torch ${info% *} sees none); run it on a GPU machine, see docs/BENCHMARKS.md" >&2
  exit 2
fi

SITE="${GPU_CHECK_SITE:-/tmp/site}"
if compgen -G ".whl/*.whl" >/dev/null; then
  # What the image lacks (deepspeed, pydantic, hjson, ...): --no-deps, the set is complete (gpu_wheels.sh checked it).
  if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      --root-user-action=ignore .whl/*.whl; then
    echo "gpu_check: installing .whl/*.whl into $SITE failed (see above)" >&2
    exit 3
  fi
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "gpu_check: no .whl/ here: using what $PY has (run scripts/gpu_wheels.sh and carry .whl on a bare machine)"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export DS_ACCELERATOR=cuda PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 \
  RAY_USAGE_STATS_ENABLED=0
exec timeout -k 10 "${GPU_CHECK_TIMEOUT:-290}" "$PY" scripts/gpu_check.py --out "${OUT:-gpu_check_out}" "$@"
