#!/usr/bin/env bash
# The fine-tuning recipe end to end on this machine (README "Instruction and chat fine-tuning, LoRA"), after
# ./scripts/demo.sh:
#   the base model (the newest demo run's last checkpoint exported to models/v1, or RAYTRAIN_FT_BASE=<HF model
#   dir>) -> an instruction set from what ships with Python (held-out modules apart) -> prepare both with the
#   base's tokenizer -> start a local Ray cluster -> `ray job submit` a 2-worker LoRA fine-tune validated on the
#   held-out modules -> held-out loss before and after -> the merged export (models/v1-sft), ready to serve.
# Extra arguments are passed to `raytrain train` as overrides, e.g. ./scripts/finetune.sh model.lora.r=0 (every
# parameter trains) or run.max_steps=30.
set -euo pipefail
source "$(dirname "$0")/_env.sh" lora   # peft, for LoRA
cd "$ROOT"

RUNS="${RAYTRAIN_DEMO_RUNS:-$ROOT/runs}"
DATA="${RAYTRAIN_FT_DATA:-$ROOT/data}"
MODELS="${RAYTRAIN_FT_MODELS:-$ROOT/models}"
RUN_NAME="sft-$(date +%Y%m%d-%H%M%S)"
GCS_PORT="${RAYTRAIN_DEMO_PORT:-6390}"
DASH_PORT="${RAYTRAIN_DEMO_DASHBOARD_PORT:-8290}"
NUM_CPUS="${RAYTRAIN_DEMO_CPUS:-4}"
TAG=finetune
# shellcheck source=scripts/_ray_local.sh
source "$ROOT/scripts/_ray_local.sh"

BASE="${RAYTRAIN_FT_BASE:-$MODELS/v1}"
if [ ! -f "$BASE/config.json" ]; then
  if [ -n "${RAYTRAIN_FT_BASE:-}" ]; then
    echo "[finetune] error: RAYTRAIN_FT_BASE=$BASE is not a Hugging Face model directory (no config.json)" >&2; exit 2
  fi
  # The newest demo run (run names carry their start time) and its newest complete checkpoint.
  CKPT="$(python - "$RUNS" <<'PY'
import os, sys
from raytrain.ckpt.catalog import latest_complete
runs = sys.argv[1]
names = sorted(n for n in (os.listdir(runs) if os.path.isdir(runs) else []) if n.startswith("demo-"))
info = next((i for i in (latest_complete(os.path.join(runs, n)) for n in reversed(names)) if i), None)
print(info.uri if info else "")
PY
)"
  if [ -z "$CKPT" ]; then
    echo "[finetune] error: no base model: run ./scripts/demo.sh first (or set RAYTRAIN_FT_BASE=<HF model dir>)" >&2; exit 2
  fi
  echo "[finetune] exporting the base model $CKPT -> $BASE"
  raytrain export --checkpoint "$CKPT" --out "$BASE" >/dev/null
fi

echo "[finetune] an instruction set from the Python standard library -> $DATA/instructions"
python scripts/gen_instructions.py --out "$DATA/instructions"
for split in train heldout; do
  if [ ! -f "$DATA/sft-$split/train/manifest.json" ]; then
    raytrain prepare format=prompt_completion inputs="[$DATA/instructions/$split.jsonl]" out="$DATA/sft-$split" \
      tokenizer="$BASE" seq_len=128 val_fraction=0 >/dev/null
  fi
done

start_cluster
echo "[finetune] ray job submit --submission-id $RUN_NAME ... -- raytrain train ... model.lora.r=8 (ray job logs -f $RUN_NAME)"
submit_and_follow "$RUN_NAME" raytrain train --config tiny model.init_from="$BASE" \
  data.train="$DATA/sft-train/train" data.val="$DATA/sft-heldout/train" checkpoint.storage="$RUNS" run.name="$RUN_NAME" \
  model.lora.r=8 model.lora.target_modules='[c_attn,c_fc]' optim.lr=5e-3 optim.warmup_steps=5 \
  run.max_steps=60 run.eval_every=30 run.log_every=10 checkpoint.every_n_steps=30 "$@"

python - "$RUNS/$RUN_NAME" <<'PY'
import json, sys
from raytrain.rundir import METRICS, RunDir
vals = [r["val_loss"] for r in RunDir(sys.argv[1]).read_jsonl(METRICS) if "val_loss" in r]
if len(vals) < 2:
    sys.exit(f"[finetune] error: {sys.argv[1]} logged no held-out loss after step 0; see its metrics.jsonl")
print(f"[finetune] held-out instruction loss (modules never trained on): {vals[0]:.3f} -> {vals[-1]:.3f}")
PY
CKPT="$(python -c "import sys; from raytrain.ckpt.catalog import latest_complete; print(latest_complete(sys.argv[1]).uri)" "$RUNS/$RUN_NAME")"
raytrain export --checkpoint "$CKPT" --out "$MODELS/$RUN_NAME" >/dev/null
echo "[finetune] done: the adapter merged into $MODELS/$RUN_NAME. Serve it: raytrain serve $MODELS/$RUN_NAME"
echo "[finetune]   then: curl -s localhost:8000/v1/chat/completions -d '{\"messages\": [{\"role\": \"user\", \"content\": \"...\"}]}'"
