#!/usr/bin/env bash
# A simulated autoscaling spot cluster on this machine (cluster/local-fake.yaml, Ray's fake_multinode
# provider): `up` starts the head on private ports on 127.0.0.1 with token auth, `status` shows nodes
# and pending demand, `down` stops every process of this cluster (and only those).
#
#   scripts/local_cluster.sh up        # then: eval "$(scripts/local_cluster.sh env)"
#   ray job submit --working-dir . -- raytrain train ... scaling.resources_per_worker='{spot: 1}'
#   python scripts/preempt.py --notice 10       # reclaim a spot node like a cloud does
#   scripts/local_cluster.sh down
#
# Ports: RAYTRAIN_CLUSTER_PORT (GCS, default 6391) and RAYTRAIN_CLUSTER_DASHBOARD_PORT (jobs API /
# dashboard, default 8291). State (pid, rendered config, Ray's temp dir, logs) lives in
# /tmp/raytrain-cluster-<port>, so several clusters on different ports do not meet.
set -euo pipefail
ACTION="${1:-}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ "$ACTION" = up ]; then
  source "$ROOT/scripts/_env.sh" ""   # "" : no extras (a sourced script would see our args)
else
  # down / status / env only need the venv's ray, not the setup checks (which can take minutes).
  export PATH="$ROOT/.venv/bin:$PATH" RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
fi
cd "$ROOT"

PORT="${RAYTRAIN_CLUSTER_PORT:-6391}"
DASH_PORT="${RAYTRAIN_CLUSTER_DASHBOARD_PORT:-8291}"
STATE="/tmp/raytrain-cluster-$PORT"   # short: Ray's unix socket paths live below it (108-byte limit)
CONFIG="${RAYTRAIN_CLUSTER_CONFIG:-$ROOT/cluster/local-fake.yaml}"

print_env() {
  echo "export RAY_ADDRESS=http://127.0.0.1:$DASH_PORT"
  echo "export RAY_AUTH_MODE=token"
}

# PIDs of every process of this cluster: all of them carry our private temp dir on their command line
# (the head's and each fake node's raylet, GCS, dashboard, agents and workers).
cluster_pids() {
  # By command line (raylets, GCS, monitor), and by the marker every process of this cluster inherits:
  # the fake nodes' dashboard and runtime-env agents rename themselves (ray::DashboardAgent) and
  # outlive their raylet, so their command line no longer names the cluster.
  local pid
  for pid in $( (pgrep -f -- "$STATE/ray" || true
                 grep -lsz "^RAYTRAIN_CLUSTER_STATE=$STATE\$" /proc/[0-9]*/environ | cut -d/ -f3) | sort -u); do
    [ "$pid" != "$$" ] && [ "$pid" != "$BASHPID" ] && echo "$pid"
  done
}

up() {
  if [ -f "$STATE/pid" ] && kill -0 "$(cat "$STATE/pid")" 2>/dev/null; then
    echo "[cluster] already up (pid $(cat "$STATE/pid")); 'down' first to restart"; print_env; return 0
  fi
  rm -rf "$STATE"; mkdir -p "$STATE"
  # The fake provider connects each new node to the GCS named in the config: point it at our port.
  python - "$CONFIG" "$STATE/cluster.yaml" "127.0.0.1:$PORT" <<'PY'
import sys, yaml
src, dst, gcs = sys.argv[1:]
cfg = yaml.safe_load(open(src))
cfg["provider"]["gcs_address"] = gcs
yaml.safe_dump(cfg, open(dst, "w"), sort_keys=False)
PY
  local head_cpus
  head_cpus="$(python -c "import yaml,sys; print(yaml.safe_load(open(sys.argv[1]))['available_node_types']['ray.head.default']['resources'].get('CPU', 0))" "$CONFIG")"
  # Every listening port is private: loopback only, and the fixed ones chosen here, not Ray's defaults
  # that another cluster on this machine may hold.
  read -r AGENT_PORT AGENT_GRPC METRICS RTENV CLIENT < <(python - <<'PY'
import socket
socks = [socket.socket() for _ in range(5)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*[s.getsockname()[1] for s in socks])
PY
)
  echo "[cluster] starting head (GCS 127.0.0.1:$PORT, jobs API http://127.0.0.1:$DASH_PORT), autoscaling from $CONFIG"
  # RAY_memory_monitor_refresh_ms=0: every fake node's raylet watches the memory of the WHOLE machine
  # and kills workers at 95%, so on a shared machine one busy neighbour would kill our training
  # workers and the head's Train controller. Real nodes keep Ray's default. Drain timeout 0: `down` stops the
  # head at once, not after the 30 s SIGTERM drain that only Serve replicas on real nodes need.
  RAYTRAIN_CLUSTER_STATE="$STATE" RAY_FAKE_CLUSTER=1 RAY_memory_monitor_refresh_ms=0 RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0 \
    setsid nohup ray start --head --block --port="$PORT" --node-ip-address=127.0.0.1 \
    --dashboard-host=127.0.0.1 --dashboard-port="$DASH_PORT" --include-dashboard=true \
    --dashboard-agent-listen-port="$AGENT_PORT" --dashboard-agent-grpc-port="$AGENT_GRPC" \
    --metrics-export-port="$METRICS" --runtime-env-agent-port="$RTENV" --ray-client-server-port="$CLIENT" \
    --num-cpus="$head_cpus" --temp-dir="$STATE/ray" --autoscaling-config="$STATE/cluster.yaml" \
    --disable-usage-stats >"$STATE/ray-start.log" 2>&1 </dev/null &
  echo $! > "$STATE/pid"
  export RAY_ADDRESS="http://127.0.0.1:$DASH_PORT"
  for _ in $(seq 1 120); do
    if ray job list >/dev/null 2>&1; then
      echo "[cluster] up. Clients need:"; print_env
      echo "[cluster] $RAYTRAIN_AUTH_LINE"
      return 0
    fi
    if ! kill -0 "$(cat "$STATE/pid")" 2>/dev/null; then
      echo "[cluster] error: Ray did not start; see $STATE/ray-start.log:" >&2; tail -5 "$STATE/ray-start.log" >&2
      return 1
    fi
    sleep 1
  done
  echo "[cluster] error: the jobs API did not answer within 120 s; see $STATE/ray-start.log" >&2
  return 1
}

down() {
  if [ -f "$STATE/pid" ]; then
    local pid; pid="$(cat "$STATE/pid")"
    # `ray start --block` stops the head's processes when it gets SIGTERM.
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  fi
  # Fake worker nodes were started by the autoscaler, not by `ray start`: stop them by their pid.
  local left; left="$(cluster_pids)"
  if [ -n "$left" ]; then
    # shellcheck disable=SC2086
    kill $left 2>/dev/null || true; sleep 2
    left="$(cluster_pids)"
    # shellcheck disable=SC2086
    [ -n "$left" ] && kill -9 $left 2>/dev/null || true
  fi
  # Ray's session logs grow with every node; keep them only while the cluster lives.
  rm -rf "$STATE"
  if grep -qs ":$PORT\$" /tmp/ray/ray_current_cluster; then rm -f /tmp/ray/ray_current_cluster; fi
  echo "[cluster] down (GCS port $PORT)"
}

case "$ACTION" in
  up) up ;;
  down) down ;;
  status)
    if [ -f "$STATE/pid" ] && kill -0 "$(cat "$STATE/pid")" 2>/dev/null; then
      ray status --address="127.0.0.1:$PORT"
    else
      echo "[cluster] not running (GCS port $PORT)"; exit 1
    fi ;;
  env) print_env ;;
  *) echo "usage: $0 up|down|status|env   (ports: RAYTRAIN_CLUSTER_PORT, RAYTRAIN_CLUSTER_DASHBOARD_PORT)" >&2; exit 2 ;;
esac
