#!/usr/bin/env bash
# The demo, end to end: venv, database, migrate, enqueue example jobs, run the runner, summary.
source "$(dirname "$0")/_bootstrap.sh"
if [ -z "${DATABASE_URL:-}" ]; then
    DATABASE_URL="$("$PYBIN" scripts/demo_db.py)"
    export DATABASE_URL
else
    "$PYBIN" scripts/demo_db.py --ensure "$DATABASE_URL"
fi
export DJANGO_SETTINGS_MODULE=example_project.settings
echo "==> database: $DATABASE_URL"
"$PYBIN" manage.py migrate --verbosity 0
"$PYBIN" manage.py demo "$@"
