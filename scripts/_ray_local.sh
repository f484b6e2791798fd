# Sourced by demo.sh and finetune.sh (after _env.sh): a local Ray cluster for this script, and `ray job submit`
# followed as `ray job logs -f` would. Needs GCS_PORT, DASH_PORT, NUM_CPUS set; defines start_cluster and
# submit_and_follow; the cluster is stopped when the script exits.

start_cluster() {
  echo "[$TAG] starting a local Ray cluster (GCS port $GCS_PORT, dashboard/jobs port $DASH_PORT, $NUM_CPUS CPUs)"
  echo "[$TAG] $RAYTRAIN_AUTH_LINE"
  RAY_TMP="$(mktemp -d /tmp/raytrain-$TAG-XXXX)"
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
  # Drain timeout 0: on SIGTERM `ray start --block` first drains the node for Serve's sake, and after a job it
  # waits out the whole 30 s with nothing to migrate; a script's own cluster stops at once instead.
  RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0 ray start --head --block --port="$GCS_PORT" \
    --dashboard-host=127.0.0.1 --dashboard-port="$DASH_PORT" \
    --dashboard-agent-listen-port="$AGENT_PORT" --dashboard-agent-grpc-port="$AGENT_GRPC" \
    --metrics-export-port="$METRICS" --runtime-env-agent-port="$RTENV" --ray-client-server-port="$CLIENT" \
    --num-cpus="$NUM_CPUS" --include-dashboard=true --disable-usage-stats >"$RAY_TMP/ray-start.log" 2>&1 &
  RAY_PID=$!
  trap stop_cluster EXIT
  export RAY_ADDRESS="http://127.0.0.1:$DASH_PORT"
  for _ in $(seq 1 120); do
    if ray job list >/dev/null 2>&1; then return 0; fi
    if ! kill -0 "$RAY_PID" 2>/dev/null; then
      echo "[$TAG] error: Ray did not start; see $RAY_TMP/ray-start.log" >&2; tail -5 "$RAY_TMP/ray-start.log" >&2; exit 1
    fi
    sleep 1
  done
}

stop_cluster() {
  echo "[$TAG] stopping the Ray cluster this script started"
  kill "$RAY_PID" 2>/dev/null || true
  wait "$RAY_PID" 2>/dev/null || true
  # `ray start --block` stops its processes but leaves the "current cluster" pointer behind.
  if grep -qs ":$GCS_PORT\$" /tmp/ray/ray_current_cluster; then rm -f /tmp/ray/ray_current_cluster; fi
}

# submit_and_follow JOB_ID ENTRYPOINT...: submitted without waiting, then followed: what follows is the job's own
# output (the run's progress), not the submission client's chatter, which goes to $RAY_TMP/submit.log. (.git and
# .venv are left out of the uploaded working dir by Ray itself; so are data/, runs/ and models/.)
submit_and_follow() {
  local job="$1"; shift
  # The jobs API answers a few seconds before the node's job agent does ("No available agent"), and on a
  # busy machine the dashboard can miss a connection while it starts.
  local deadline=$((SECONDS + 300))
  while ! ray job submit --no-wait --submission-id "$job" --working-dir "$ROOT" \
      --runtime-env-json '{"excludes": ["/data", "/runs", "/models"]}' -- "$@" >"$RAY_TMP/submit.log" 2>&1; do
    if [ "$SECONDS" -ge "$deadline" ] || ! grep -qE "No available agent|Failed to connect to Ray" "$RAY_TMP/submit.log"; then
      echo "[$TAG] error: ray job submit failed; see $RAY_TMP/submit.log" >&2; tail -3 "$RAY_TMP/submit.log" >&2; exit 1
    fi
    sleep 2
  done
  python - "$job" "$TAG" <<'PY'
# `ray job logs -f` with the Jobs SDK: the job's output only, and the job's final state as the exit code.
import asyncio, logging, os, sys
from ray.job_submission import JobStatus, JobSubmissionClient

logging.getLogger("ray.dashboard.modules.job.sdk").setLevel(logging.WARNING)  # its own "WebSocket closed" line

client, (job, tag) = JobSubmissionClient(os.environ["RAY_ADDRESS"]), sys.argv[1:3]

async def follow():
    async for chunk in client.tail_job_logs(job):
        print(chunk, end="", flush=True)

asyncio.run(follow())
status = client.get_job_status(job)
if status != JobStatus.SUCCEEDED:
    print(f"[{tag}] error: job {job} ended {status}: {client.get_job_info(job).message}", file=sys.stderr)
    sys.exit(1)
PY
}
