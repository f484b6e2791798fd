#!/usr/bin/env bash
# Run the test suite: ./scripts/test.sh [pytest args]. Creates or reuses .venv with test extras.
set -euo pipefail
source "$(dirname "$0")/_env.sh" test
cd "$ROOT"
# pytest exits 5 when it collected no tests; that is a failure here, and is passed on as one.
exec python -m pytest "$@"
