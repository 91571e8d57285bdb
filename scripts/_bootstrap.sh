# Sourced by the other scripts: create the virtualenv of one Django series and install the
# project into it once (again whenever pyproject.toml changes).
#   DJANGO_SERIES=6.1 (default): .venv, Python 3.12+ (3.13 first), Django 6.1, dev tools (ruff,
#                                mypy).
#   DJANGO_SERIES=5.2:           .venv-dj52, Python 3.11 (3.10-3.13), Django 5.2 LTS and the
#                                django-tasks backport, test dependencies only.
# PYTHON_SERIES=3.N pins the interpreter's minor version for either series, in a virtualenv of
# its own (.venv-py3N, .venv-dj52-py3N) with test dependencies only: DJANGO_SERIES=6.1
# PYTHON_SERIES=3.12 is the suite's Python 3.12 leg.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

DJANGO_SERIES="${DJANGO_SERIES:-6.1}"
case "$DJANGO_SERIES" in
    6.1) MIN_MINOR=12; MAX_MINOR=99; DJANGO_SPEC="Django>=6.1,<6.2"; EXTRAS="dev"
         DEFAULT_VENV="$ROOT/.venv"
         CANDIDATES="python3.13 python3.12" ;;
    5.2) MIN_MINOR=10; MAX_MINOR=13; DJANGO_SPEC="Django>=5.2,<5.3"; EXTRAS="test,tasks"
         DEFAULT_VENV="$ROOT/.venv-dj52"
         CANDIDATES="python3.11 python3.12 python3.13 python3.10" ;;
    *) echo "DJANGO_SERIES must be 6.1 or 5.2, got '$DJANGO_SERIES'" >&2; exit 2 ;;
esac
PYTHON_SERIES="${PYTHON_SERIES:-}"
if [ -n "$PYTHON_SERIES" ]; then
    pinned="${PYTHON_SERIES#3.}"
    case "$PYTHON_SERIES" in
        3.[0-9]|3.[0-9][0-9]) ;;
        *) echo "PYTHON_SERIES must look like 3.12, got '$PYTHON_SERIES'" >&2; exit 2 ;;
    esac
    if [ "$pinned" -lt "$MIN_MINOR" ] || [ "$pinned" -gt "$MAX_MINOR" ]; then
        echo "Django $DJANGO_SERIES runs on Python 3.$MIN_MINOR to 3.$MAX_MINOR, not $PYTHON_SERIES" >&2
        exit 2
    fi
    MIN_MINOR="$pinned"; MAX_MINOR="$pinned"
    CANDIDATES="python$PYTHON_SERIES"
    DEFAULT_VENV="$DEFAULT_VENV-py3$pinned"
    [ "$DJANGO_SERIES" = "6.1" ] && DEFAULT_VENV="$ROOT/.venv-py3$pinned"
    EXTRAS="${EXTRAS/dev/test}"
fi

find_python() {
    local pyenv_pythons=""
    if command -v pyenv >/dev/null 2>&1; then
        pyenv_pythons="$(ls -d "$(pyenv root)"/versions/3.1[0-3].*/bin/python3 2>/dev/null | sort -r -V || true)"
    fi
    # shellcheck disable=SC2086
    for candidate in "${PYTHON:-}" $CANDIDATES python3 $pyenv_pythons; do
        [ -n "$candidate" ] || continue
        if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "import sys; sys.exit(not ((3, $MIN_MINOR) <= sys.version_info[:2] <= (3, $MAX_MINOR)))" 2>/dev/null; then
            command -v "$candidate"; return 0
        fi
    done
    echo "Django $DJANGO_SERIES needs Python 3.$MIN_MINOR or newer (up to 3.$MAX_MINOR); set PYTHON=/path/to/python3" >&2
    return 1
}

if [ "$DJANGO_SERIES" = "6.1" ] && [ -z "$PYTHON_SERIES" ]; then
    VENV="${VENV:-$DEFAULT_VENV}"
else
    VENV="$DEFAULT_VENV"
fi
if [ ! -x "$VENV/bin/python" ]; then
    PY="$(find_python)"
    echo "==> creating $VENV with $PY (Django $DJANGO_SERIES)"
    "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.installed-$( (cat pyproject.toml; echo "$DJANGO_SPEC $EXTRAS") | sha1sum | cut -c1-12)"
if [ ! -f "$STAMP" ]; then
    echo "==> installing django-persistent-jobs[$EXTRAS] with $DJANGO_SPEC into $VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet -e ".[$EXTRAS]" "$DJANGO_SPEC"
    touch "$STAMP"
fi
PYBIN="$VENV/bin/python"
