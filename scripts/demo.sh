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
# (a Train job that takes every CPU starves its own data pipeline; pitfalls #1).
NUM_CPUS="${RAYTRAIN_DEMO_CPUS:-4}"

if [ ! -f "$DATA/train/manifest.json" ] || [ ! -f "$DATA/val/manifest.json" ]; then
  echo "[demo] preparing the python-docs dataset into $DATA"
  raytrain prepare inputs='[python-docs]' out="$DATA" vocab_size=2048 seq_len=128 shard_rows=512
else
  echo "[demo] reusing prepared dataset $DATA"
fi

echo "[demo] starting a local Ray cluster (GCS port $GCS_PORT, dashboard/jobs port $DASH_PORT, $NUM_CPUS CPUs)"
echo "[demo] $RAYTRAIN_AUTH_LINE"
RAY_TMP="$(mktemp -d /tmp/raytrain-demo-XXXX)"
# The agents' ports are free ones, not Ray's fixed defaults (52365 for the job agent, 10001 ...): another
# Ray instance on this machine holds those, and the jobs API then never finds an agent to run the job.
read -r AGENT_PORT AGENT_GRPC METRICS RTENV CLIENT < <(python - <<'PY'
import socket
socks = [socket.socket() for _ in range(5)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*[s.getsockname()[1] for s in socks])
PY
)
ray start --head --block --port="$GCS_PORT" --dashboard-host=127.0.0.1 --dashboard-port="$DASH_PORT" \
  --dashboard-agent-listen-port="$AGENT_PORT" --dashboard-agent-grpc-port="$AGENT_GRPC" \
  --metrics-export-port="$METRICS" --runtime-env-agent-port="$RTENV" --ray-client-server-port="$CLIENT" \
  --num-cpus="$NUM_CPUS" --include-dashboard=true --disable-usage-stats >"$RAY_TMP/ray-start.log" 2>&1 &
RAY_PID=$!
stop_cluster() {
  echo "[demo] stopping the Ray cluster this script started"
  kill "$RAY_PID" 2>/dev/null || true
  wait "$RAY_PID" 2>/dev/null || true
  # `ray start --block` stops its processes but leaves the "current cluster" pointer behind.
  if grep -qs ":$GCS_PORT\$" /tmp/ray/ray_current_cluster; then rm -f /tmp/ray/ray_current_cluster; fi
}
trap stop_cluster EXIT

export RAY_ADDRESS="http://127.0.0.1:$DASH_PORT"
for _ in $(seq 1 120); do
  if ray job list >/dev/null 2>&1; then break; fi
  if ! kill -0 "$RAY_PID" 2>/dev/null; then
    echo "[demo] error: Ray did not start; see $RAY_TMP/ray-start.log" >&2; tail -5 "$RAY_TMP/ray-start.log" >&2; exit 1
  fi
  sleep 1
done

# Submitted without waiting, then followed: what follows is the job's own output (the run's progress),
# not the submission client's chatter, which goes to $RAY_TMP/submit.log. (.git and .venv are left out
# of the uploaded working dir by Ray itself.)
echo "[demo] ray job submit --submission-id $RUN_NAME ... -- raytrain train --config tiny ... (ray job logs -f $RUN_NAME)"
submit() {
  ray job submit --no-wait --submission-id "$RUN_NAME" --working-dir "$ROOT" \
    --runtime-env-json '{"excludes": ["/data", "/runs"]}' \
    -- raytrain train --config tiny \
    data.train="$DATA/train" data.val="$DATA/val" \
    checkpoint.storage="$RUNS" run.name="$RUN_NAME" "$@" >"$RAY_TMP/submit.log" 2>&1
}
# The jobs API answers a few seconds before the node's job agent does ("No available agent"), and on a
# busy machine the dashboard can miss a connection while it starts.
deadline=$((SECONDS + 300))
while true; do
  if submit "$@"; then break; fi
  if [ "$SECONDS" -ge "$deadline" ] || ! grep -qE "No available agent|Failed to connect to Ray" "$RAY_TMP/submit.log"; then
    echo "[demo] error: ray job submit failed; see $RAY_TMP/submit.log" >&2; tail -3 "$RAY_TMP/submit.log" >&2; exit 1
  fi
  sleep 2
done
python - "$RUN_NAME" <<'PY'
# `ray job logs -f` with the Jobs SDK: the job's output only, and the job's final state as the exit code.
import asyncio, logging, os, sys
from ray.job_submission import JobStatus, JobSubmissionClient

logging.getLogger("ray.dashboard.modules.job.sdk").setLevel(logging.WARNING)  # its own "WebSocket closed" line

client, job = JobSubmissionClient(os.environ["RAY_ADDRESS"]), sys.argv[1]

async def follow():
    async for chunk in client.tail_job_logs(job):
        print(chunk, end="", flush=True)

asyncio.run(follow())
status = client.get_job_status(job)
if status != JobStatus.SUCCEEDED:
    print(f"[demo] error: job {job} ended {status}: {client.get_job_info(job).message}", file=sys.stderr)
    sys.exit(1)
PY

if [ ! -f "$RUNS/$RUN_NAME/summary.json" ]; then
  echo "[demo] error: no summary.json in $RUNS/$RUN_NAME; the job did not finish" >&2
  exit 1
fi
echo "[demo] done. Look around: raytrain ckpt list $RUNS/$RUN_NAME ; cat $RUNS/$RUN_NAME/metrics.jsonl"
