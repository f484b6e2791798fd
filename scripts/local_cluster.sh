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
# Ray's mutual TLS on every connection of the cluster (GCS, raylets, object transfers, workers, drivers):
#   scripts/tls_certs.sh /tmp/my-cluster-tls                 # once: a CA and a certificate for 127.0.0.1
#   scripts/local_cluster.sh up --tls /tmp/my-cluster-tls    # or RAYTRAIN_CLUSTER_TLS=DIR scripts/local_cluster.sh up
# The certificate, its key and the CA are checked first (a bad one: one line, exit 2, nothing started); every
# process of the cluster gets RAY_USE_TLS / RAY_TLS_* (paths only), and `env` prints them for clients that
# join with ray.init (`ray job submit` goes over the jobs API's HTTP and needs only the token).
#
# Ports: RAYTRAIN_CLUSTER_PORT (GCS, default 6391) and RAYTRAIN_CLUSTER_DASHBOARD_PORT (jobs API /
# dashboard, default 8291). State (pid, rendered config, Ray's temp dir, logs) lives in
# /tmp/raytrain-cluster-<port>, so several clusters on different ports do not meet.
set -euo pipefail
ACTION="${1:-}"
[ $# -gt 0 ] && shift
TLS_DIR="${RAYTRAIN_CLUSTER_TLS:-}"
while [ $# -gt 0 ]; do
  case "$1" in
    --tls) [ $# -ge 2 ] || { echo "local_cluster.sh: --tls needs a directory made by scripts/tls_certs.sh DIR" >&2; exit 2; }
           TLS_DIR="$2"; shift 2 ;;
    --tls=*) TLS_DIR="${1#--tls=}"; shift ;;
    *) echo "local_cluster.sh: unknown option $1 (usage: $0 up [--tls DIR] | down | status | env)" >&2; exit 2 ;;
  esac
done
# Absolute, from where the caller stands (the script moves to the repo root below).
case "$TLS_DIR" in ""|/*) ;; *) TLS_DIR="$PWD/$TLS_DIR" ;; esac
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
  tls_exports
}

# A TLS cluster's client settings: the paths of the certificate, key and CA that `up --tls` was given, never
# their contents, and the switch that keeps a client's Ray on 127.0.0.1, the address the certificate is for (`up`).
tls_exports() {
  [ -s "$STATE/tls" ] || return 0
  local d; d="$(cat "$STATE/tls")"
  printf 'export RAY_USE_TLS=1 RAY_TLS_SERVER_CERT=%q RAY_TLS_SERVER_KEY=%q RAY_TLS_CA_CERT=%q\n' \
    "$d/server.crt" "$d/server.key" "$d/ca.crt"
  echo "export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0"
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
  if [ -n "$TLS_DIR" ]; then
    # Bad material fails here, in one line, before anything starts: Ray itself would only log a failed handshake
    # per connection and hang. Every node of this cluster dials 127.0.0.1, so the certificate must be for it.
    python -m raytrain.tls check "$TLS_DIR/server.crt" "$TLS_DIR/server.key" "$TLS_DIR/ca.crt" \
      --what local_cluster.sh --host 127.0.0.1 || exit 2
  fi
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
  # The head's resources from the config: its CPUs, and any custom resources (the fake provider starts worker
  # nodes with theirs; the head is `ray start`'s, so it gets them here).
  local head_cpus head_res
  read -r head_cpus head_res < <(python - "$CONFIG" <<'PY'
import json, sys, yaml
res = dict(yaml.safe_load(open(sys.argv[1]))["available_node_types"]["ray.head.default"].get("resources") or {})
cpus = res.pop("CPU", 0)
res = {k: v for k, v in res.items() if k not in ("GPU", "memory", "object_store_memory")}
print(cpus, json.dumps(res, separators=(",", ":")) if res else "")
PY
)
  local tls_env=()
  if [ -n "$TLS_DIR" ]; then
    # Every process of the cluster inherits these from `ray start`: the head's GCS, raylet, dashboard and agents,
    # the autoscaler, the fake nodes it starts (Node() in the autoscaler's process), their workers and the jobs'
    # drivers. Paths only.
    # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0: Ray turns --node-ip-address=127.0.0.1 (and every fake node's address)
    # into this machine's outward address, and TLS clients check the address they dial against the certificate.
    # With it, Ray's own address lookup answers 127.0.0.1: every node and connection stays on loopback, where the
    # certificate is valid. (Its other effect, refusing `ray start --address` for a second node, does not apply:
    # the fake provider starts nodes without `ray start`.)
    tls_env=(RAY_USE_TLS=1 RAY_TLS_SERVER_CERT="$TLS_DIR/server.crt" RAY_TLS_SERVER_KEY="$TLS_DIR/server.key"
             RAY_TLS_CA_CERT="$TLS_DIR/ca.crt" RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0)
    echo "$TLS_DIR" > "$STATE/tls"
  fi
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
  local tls_note=""
  [ -z "$TLS_DIR" ] || tls_note=", mutual TLS with $TLS_DIR/server.crt"
  echo "[cluster] starting head (GCS 127.0.0.1:$PORT, jobs API http://127.0.0.1:$DASH_PORT), autoscaling from $CONFIG$tls_note"
  # RAY_memory_monitor_refresh_ms=0: every fake node's raylet watches the memory of the WHOLE machine
  # and kills workers at 95%, so on a shared machine one busy neighbour would kill our training
  # workers and the head's Train controller. Real nodes keep Ray's default. Drain timeout 0: `down` stops the
  # head at once, not after the 30 s SIGTERM drain that only Serve replicas on real nodes need.
  # shellcheck disable=SC2086
  env -u RAY_USE_TLS -u RAY_TLS_SERVER_CERT -u RAY_TLS_SERVER_KEY -u RAY_TLS_CA_CERT -u RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER \
    ${tls_env[@]+"${tls_env[@]}"} \
    RAYTRAIN_CLUSTER_STATE="$STATE" RAY_FAKE_CLUSTER=1 RAY_memory_monitor_refresh_ms=0 RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0 \
    setsid nohup ray start --head --block --port="$PORT" --node-ip-address=127.0.0.1 \
    --dashboard-host=127.0.0.1 --dashboard-port="$DASH_PORT" --include-dashboard=true \
    --dashboard-agent-listen-port="$AGENT_PORT" --dashboard-agent-grpc-port="$AGENT_GRPC" \
    --metrics-export-port="$METRICS" --runtime-env-agent-port="$RTENV" --ray-client-server-port="$CLIENT" \
    --num-cpus="$head_cpus" ${head_res:+--resources="$head_res"} --temp-dir="$STATE/ray" --autoscaling-config="$STATE/cluster.yaml" \
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
      eval "$(tls_exports)"   # a TLS cluster's GCS answers only with its certificates
      ray status --address="127.0.0.1:$PORT"
    else
      echo "[cluster] not running (GCS port $PORT)"; exit 1
    fi ;;
  env) print_env ;;
  *) echo "usage: $0 up [--tls DIR]|down|status|env   (ports: RAYTRAIN_CLUSTER_PORT, RAYTRAIN_CLUSTER_DASHBOARD_PORT; TLS: RAYTRAIN_CLUSTER_TLS)" >&2; exit 2 ;;
esac
