#!/usr/bin/env bash
# A cluster's own CA and a certificate it signs, for Ray's mutual TLS and `raytrain serve --ssl-*`:
#   scripts/tls_certs.sh DIR [HOST ...] [--days N]     (HOSTs: the names / IPs clients use; default 127.0.0.1 localhost)
# Writes DIR/ca.crt, DIR/ca.key, DIR/server.crt, DIR/server.key (keys 0600, never printed). docs/CLUSTERS.md says how
# to hand them to the nodes and how to rotate them.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$ROOT/.venv/bin/python"
[ -x "$PY" ] || PY=python3
exec "$PY" -m raytrain.tls "$@"
