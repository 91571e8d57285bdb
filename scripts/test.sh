#!/usr/bin/env bash
# The test suite: lint, types, migrations up to date, then pytest against real PostgreSQL.
source "$(dirname "$0")/_bootstrap.sh"
echo "==> ruff"
"$VENV/bin/ruff" check django_persistent_jobs example_project tests bench
echo "==> mypy"
"$VENV/bin/mypy" django_persistent_jobs
echo "==> makemigrations --check"
DJANGO_SETTINGS_MODULE=tests.settings "$PYBIN" manage.py makemigrations --check --dry-run
echo "==> pytest"
"$PYBIN" -m pytest "$@"
