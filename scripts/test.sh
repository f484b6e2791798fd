#!/usr/bin/env bash
# Run the test suite: ./scripts/test.sh [pytest args]. Creates or reuses .venv with test extras.
set -euo pipefail
source "$(dirname "$0")/_env.sh" test
cd "$ROOT"
# Some machines (this project's CI among them) set PYTHONDONTWRITEBYTECODE, and then every process of the suite -
# each Ray worker, controller and test subprocess - compiles raytrain's modules from source again: about 0.2 s
# each here. The installed packages were compiled by pip; this lets raytrain's own be cached too (.gitignored).
unset PYTHONDONTWRITEBYTECODE
# pytest exits 5 when it collected no tests; that is a failure here, and is passed on as one.
exec python -m pytest "$@"
