#!/usr/bin/env bash
# The test suite: lint, types, migrations up to date, then pytest against real PostgreSQL.
source "$(dirname "$0")/_bootstrap.sh"
# Fail early, with the message that says what to set, when no PostgreSQL is configured.
"$PYBIN" -c 'import os, sys
from tests.database import _docker_reachable
if not os.environ.get("DATABASE_URL") and not _docker_reachable():
    sys.exit("The tests need a real PostgreSQL. Set DATABASE_URL, for example\n"
             "  DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres scripts/test.sh\n"
             "or make a Docker engine reachable so testcontainers can start one.")'
echo "==> ruff"
"$VENV/bin/ruff" check django_persistent_jobs example_project tests bench
echo "==> mypy"
"$VENV/bin/mypy" django_persistent_jobs
echo "==> makemigrations --check"
DJANGO_SETTINGS_MODULE=tests.settings "$PYBIN" manage.py makemigrations --check --dry-run
echo "==> pytest"
"$PYBIN" -m pytest "$@"
if [ "$#" -eq 0 ]; then
    # The fault suite again, with every runner running its jobs in a worker process: the
    # guarantees hold in both process models (tests/faults/harness.py: PJ_TEST_PROCESSES).
    echo "==> pytest tests/faults with worker processes"
    PJ_TEST_PROCESSES=1 "$PYBIN" -m pytest tests/faults -q \
        --deselect tests/faults/test_worker_processes.py
fi
