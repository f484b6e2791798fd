#!/usr/bin/env bash
# Run the test suite: ./scripts/test.sh [--fast] [pytest args]. Creates or reuses .venv with test extras.
# --fast: the development tier (-m "not slow": no cluster, no server, no multi-worker run; minutes, not half an hour).
set -euo pipefail
source "$(dirname "$0")/_env.sh" test
cd "$ROOT"
# pytest exits 5 when it collected no tests; that is a failure here, and is passed on as one.
if [ "${1:-}" = "--fast" ]; then
  shift
  exec python -m pytest -m "not slow" "$@"
fi
exec python -m pytest "$@"
