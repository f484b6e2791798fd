#!/usr/bin/env bash
# The main job end to end on this machine:
#   set up .venv -> prepare a dataset from the Python docs shipped with Python -> start a local Ray
#   cluster -> `ray job submit` a 2-worker DeepSpeed ZeRO-2 training run -> print its summary -> stop
#   the cluster this script started. Safe to run again: each run gets a new run name.
# Extra arguments are passed to `raytrain train` as overrides, e.g. ./scripts/demo.sh run.max_steps=100
set -euo pipefail
source "$(dirname "$0")/_env.sh" ""   # "" : no extras (a sourced script would see our args)
cd "$ROOT"

DATA="${RAYTRAIN_DEMO_DATA:-$ROOT/data/python-docs}"
RUNS="${RAYTRAIN_DEMO_RUNS:-$ROOT/runs}"
RUN_NAME="demo-$(date +%Y%m%d-%H%M%S)"
GCS_PORT="${RAYTRAIN_DEMO_PORT:-6390}"
DASH_PORT="${RAYTRAIN_DEMO_DASHBOARD_PORT:-8290}"
# Logical CPUs: 2 training workers x 1 CPU + CPUs for Ray Data, independent of the cores present
# (a Train job that takes every CPU starves its own data pipeline).
NUM_CPUS="${RAYTRAIN_DEMO_CPUS:-4}"

if [ ! -f "$DATA/train/manifest.json" ] || [ ! -f "$DATA/val/manifest.json" ]; then
  echo "[demo] preparing the python-docs dataset into $DATA"
  raytrain prepare inputs='[python-docs]' out="$DATA" vocab_size=2048 seq_len=128 shard_rows=512
else
  echo "[demo] reusing prepared dataset $DATA"
fi

TAG=demo
# shellcheck source=scripts/_ray_local.sh
source "$ROOT/scripts/_ray_local.sh"
start_cluster
echo "[demo] ray job submit --submission-id $RUN_NAME ... -- raytrain train --config tiny ... (ray job logs -f $RUN_NAME)"
# data.reader=ray: the training rows come through Ray Data (the sample plan's units read by a pipeline and routed
# to the ranks by key, docs/DATA.md); on this one machine its tasks share the workers' CPUs (docs/BENCHMARKS.md).
submit_and_follow "$RUN_NAME" raytrain train --config tiny data.train="$DATA/train" data.val="$DATA/val" \
  checkpoint.storage="$RUNS" run.name="$RUN_NAME" data.reader=ray "$@"

if [ ! -f "$RUNS/$RUN_NAME/summary.json" ]; then
  echo "[demo] error: no summary.json in $RUNS/$RUN_NAME; the job did not finish" >&2
  exit 1
fi
echo "[demo] done. Look around: raytrain ckpt list $RUNS/$RUN_NAME ; cat $RUNS/$RUN_NAME/metrics.jsonl"
