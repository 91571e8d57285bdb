#!/usr/bin/env bash
# The test suite on every supported Django series: on Django 6.1 ruff, mypy,
# `makemigrations --check` and pytest; then on Django 5.2 LTS (with the django-tasks backport)
# `makemigrations --check` and pytest. DJANGO_SERIES=6.1 or DJANGO_SERIES=5.2 runs one series.
# Extra arguments go to pytest.
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"

if [ -z "${DJANGO_SERIES:-}" ]; then
    failed=()
    for series in 6.1 5.2; do
        echo "==> Django $series"
        DJANGO_SERIES="$series" "$HERE/test.sh" "$@" || failed+=("$series")
    done
    if [ "${#failed[@]}" -gt 0 ]; then
        echo "==> FAILED on Django ${failed[*]}"
        exit 1
    fi
    echo "==> passed on Django 6.1 and 5.2"
    exit 0
fi

set -e
source "$HERE/_bootstrap.sh"
# Fail early, with the message that says what to set, when no PostgreSQL is configured.
"$PYBIN" -c 'import os, sys
from tests.database import _docker_reachable
if not os.environ.get("DATABASE_URL") and not _docker_reachable():
    sys.exit("The tests need a real PostgreSQL. Set DATABASE_URL, for example\n"
             "  DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres scripts/test.sh\n"
             "or make a Docker engine reachable so testcontainers can start one.")'
if [ "$DJANGO_SERIES" = "6.1" ]; then
    # Lint and types do not depend on the Django series: checked once, on the newest.
    echo "==> ruff"
    "$VENV/bin/ruff" check django_persistent_jobs example_project tests bench
    echo "==> mypy"
    "$VENV/bin/mypy" django_persistent_jobs
fi
echo "==> makemigrations --check (Django $DJANGO_SERIES)"
DJANGO_SETTINGS_MODULE=tests.settings "$PYBIN" manage.py makemigrations --check --dry-run
echo "==> pytest (Django $DJANGO_SERIES, $("$PYBIN" -c 'import sys; print("Python %d.%d" % sys.version_info[:2])'))"
"$PYBIN" -m pytest "$@"
if [ "$#" -eq 0 ] && [ "$DJANGO_SERIES" = "6.1" ]; then
    # The fault suite again, with every runner running its jobs in a worker process: the
    # guarantees hold in both process models (tests/faults/harness.py: PJ_TEST_PROCESSES).
    # Once, on the newest series: the process model does not depend on the Django series.
    echo "==> pytest tests/faults with worker processes"
    PJ_TEST_PROCESSES=1 "$PYBIN" -m pytest tests/faults -q \
        --deselect tests/faults/test_worker_processes.py
fi
