# Sourced by the other scripts: find Python 3.12+, create .venv, install the project once.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

find_python() {
    for candidate in "${PYTHON:-}" python3.13 python3.12 \
        "$(command -v pyenv >/dev/null 2>&1 && ls -d "$(pyenv root)"/versions/3.1[23].*/bin/python3 2>/dev/null | tail -1)" \
        python3; do
        [ -n "$candidate" ] || continue
        if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
            command -v "$candidate"; return 0
        fi
    done
    echo "Python 3.12 or newer is required (Django 6.1 needs it); set PYTHON=/path/to/python3.12" >&2
    return 1
}

VENV="${VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
    PY="$(find_python)"
    echo "==> creating $VENV with $PY"
    "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.installed-$(cat pyproject.toml | sha1sum | cut -c1-12)"
if [ ! -f "$STAMP" ]; then
    echo "==> installing django-persistent-jobs and its dev dependencies"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet -e ".[dev]"
    touch "$STAMP"
fi
PYBIN="$VENV/bin/python"
