#!/usr/bin/env bash
# The test suite on both supported Django series, one leg after the other:
#   Django 6.1, Python 3.13 (.venv):        ruff, mypy, `makemigrations --check`, the whole
#                                           suite, its fault suite with worker processes;
#   Django 5.2 LTS, Python 3.11 (.venv-dj52, django-tasks backport): `makemigrations --check`,
#                                           the whole suite, its fault suite with runner threads
#                                           (less test_worker_processes.py).
# In both, the tests outside tests/faults run on two pytest-xdist workers, then the fault suite
# runs alone.
# On request (not in the default run, which must fit CI's 25 minutes on a 2-core machine):
#   Django 6.1, Python 3.12 (.venv-py312):  `makemigrations --check`, the suite without the fault
#                                           suite, the browser test and the API fuzz run.
# Why this split (and why the fault suite runs once per executor model): README.md, "Tests".
# DJANGO_SERIES=6.1 or 5.2 runs one leg; PYTHON_SERIES=3.N with it picks the extra-Python leg
# (DJANGO_SERIES=6.1 PYTHON_SERIES=3.12). Extra arguments go to pytest and replace the leg's
# own selection (DJANGO_SERIES=6.1 scripts/test.sh -k dedup -x).
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"

if [ -z "${DJANGO_SERIES:-}" ]; then
    failed=()
    # The second leg's virtualenv is built while the first leg's tests run (a minute saved).
    prepare_log="$(mktemp)"
    (DJANGO_SERIES=5.2 PYTHON_SERIES="" bash -c "source '$HERE/_bootstrap.sh'" >"$prepare_log" 2>&1) &
    prepare_pid=$!
    for leg in "6.1" "5.2"; do
        if [ "$leg" = "5.2" ] && [ -n "$prepare_pid" ]; then
            wait "$prepare_pid" || echo "==> preparing .venv-dj52 failed (the leg tries again)"
            cat "$prepare_log"
            prepare_pid=""
        fi
        series="${leg%% *}"
        python=""
        [ "$leg" != "$series" ] && python="${leg#* }"
        echo "==> Django $series${python:+ on Python $python}"
        began=$SECONDS
        DJANGO_SERIES="$series" PYTHON_SERIES="$python" "$HERE/test.sh" "$@" \
            || failed+=("Django $series${python:+ (Python $python)}")
        echo "==> Django $series${python:+ on Python $python}: $((SECONDS - began))s"
    done
    if [ "${#failed[@]}" -gt 0 ]; then
        printf '==> FAILED on %s\n' "${failed[@]}"
        exit 1
    fi
    echo "==> passed on Django 6.1 (Python 3.13) and Django 5.2 (Python 3.11) in ${SECONDS}s"
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
mypy_pid=""
if [ "$DJANGO_SERIES" = "6.1" ] && [ -z "$PYTHON_SERIES" ]; then
    # Lint and types do not depend on the Django series: checked once, on the newest.
    echo "==> ruff"
    "$VENV/bin/ruff" check django_persistent_jobs example_project tests bench
    # mypy checks beside pytest (half a minute saved); its verdict is waited for at the end.
    echo "==> mypy (beside pytest; its output follows the tests)"
    mypy_log="$(mktemp)"
    "$VENV/bin/mypy" django_persistent_jobs >"$mypy_log" 2>&1 &
    mypy_pid=$!
fi
finish_mypy() {
    [ -n "$mypy_pid" ] || return 0
    local status=0
    wait "$mypy_pid" || status=$?
    echo "==> mypy"
    cat "$mypy_log"
    return "$status"
}
echo "==> makemigrations --check (Django $DJANGO_SERIES)"
DJANGO_SETTINGS_MODULE=tests.settings "$PYBIN" manage.py makemigrations --check --dry-run
echo "==> pytest (Django $DJANGO_SERIES, $("$PYBIN" -c 'import sys; print("Python %d.%d" % sys.version_info[:2])'))"
if [ "$#" -gt 0 ]; then
    status=0
    "$PYBIN" -m pytest "$@" || status=$?
    finish_mypy || status=1
    exit "$status"
fi
# A moved test file must not silently drop out of these selections.
for path in tests/faults tests/faults/test_worker_processes.py tests/admin/test_browser.py \
        tests/api/test_views_fuzz.py; do
    [ -e "$path" ] || { echo "scripts/test.sh names $path, which does not exist" >&2; exit 2; }
done
status=0
if [ -n "$PYTHON_SERIES" ]; then
    # An extra Python version of a series: every test of our own code paths on this
    # interpreter, minus the fault suite (timing-heavy; it runs on both other legs, once per
    # executor model), the browser test and the schemathesis fuzz run (the admin's HTML and the
    # views' HTTP handling do not depend on the Python version; the example-based API tests
    # run here).
    "$PYBIN" -m pytest --ignore=tests/faults --ignore=tests/admin/test_browser.py \
        --ignore=tests/api/test_views_fuzz.py || status=$?
else
    # Everything but the fault suite on two pytest-xdist workers (each with its own test
    # database): those tests wait on runner threads and PostgreSQL far more than they compute.
    "$PYBIN" -m pytest -n 2 --ignore=tests/faults || status=$?
    # The fault suite alone, one test at a time: it kills, freezes and times runners, and a
    # second test beside it would blur its timings. It runs once per executor model, not once
    # per model and series: here, on Django 6.1, its runners hand jobs to worker processes
    # (--processes 1); on the 5.2 leg they run them on threads (runjobs' default;
    # tests/faults/runners.py: PJ_TEST_PROCESSES). test_worker_processes.py starts its own
    # --processes runners whatever the leg, so it runs on the process leg only.
    if [ "$DJANGO_SERIES" = "6.1" ]; then
        PJ_TEST_PROCESSES=1 "$PYBIN" -m pytest tests/faults || status=$?
    else
        PJ_TEST_PROCESSES=0 "$PYBIN" -m pytest tests/faults \
            --ignore=tests/faults/test_worker_processes.py || status=$?
    fi
fi
finish_mypy || status=1
exit "$status"
