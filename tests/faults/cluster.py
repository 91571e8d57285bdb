"""A private PostgreSQL cluster the scenarios may stop, restart and misconfigure, and pointing
this test process at it."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from django.db import connection

from tests.core_support import ROOT, subprocess_env


def _postgres_bindir() -> Path | None:
    candidates = [os.environ.get("PJ_PG_BINDIR", "")]
    with suppress(OSError):
        candidates.append(subprocess.run(["pg_config", "--bindir"], capture_output=True,
                                         text=True, check=False).stdout.strip())
    candidates += sorted((str(p) for p in Path("/usr/lib/postgresql").glob("*/bin")),
                         reverse=True)
    for candidate in candidates:
        if candidate and (Path(candidate) / "initdb").exists():
            return Path(candidate)
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class PrivateCluster:
    """A throw-away PostgreSQL instance the suite may stop, restart and misconfigure at will.

    The development server is shared, so scenarios that take PostgreSQL down run against one of
    these instead. ``initdb`` refuses to run as root, so as root it runs as the ``postgres`` user.
    The cluster has a synchronous standby that never connects (``synchronous_standby_names =
    'ghost'``) while commits default to ``synchronous_commit = local``: a transaction that opts
    in to ``on`` then commits locally and waits forever, which is how a test makes a COMMIT
    whose outcome the client never hears.
    """

    def __init__(self) -> None:
        bindir = _postgres_bindir()
        if bindir is None:
            raise FileNotFoundError("no PostgreSQL server binaries (initdb) found; set "
                                    "PJ_PG_BINDIR")
        self.bindir = bindir
        self.base = Path(tempfile.mkdtemp(prefix="pj-faults-pg-"))
        self.data = self.base / "data"
        self.logfile = self.base / "server.log"
        self.port = _free_port()
        self.as_postgres: list[str] = (["runuser", "-u", "postgres", "--"]
                                       if os.geteuid() == 0 else [])
        if self.as_postgres:
            shutil.chown(self.base, "postgres", "postgres")
        self.base.chmod(0o700)

    def _run(self, *args: str, timeout: float = 60.0) -> str:
        result = subprocess.run([*self.as_postgres, *args], capture_output=True, text=True,
                                timeout=timeout, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({result.returncode}):\n"
                               f"{result.stdout}\n{result.stderr}\n{self.server_log()}")
        return result.stdout

    def init(self) -> None:
        self._run(str(self.bindir / "initdb"), "-D", str(self.data), "-U", "postgres",
                  "-A", "trust", "-E", "UTF8", "--no-sync", "--no-instructions")
        settings = {
            "port": self.port, "listen_addresses": "'127.0.0.1'",
            "unix_socket_directories": f"'{self.base}'", "max_connections": 100,
            "shared_buffers": "'32MB'", "fsync": "off", "full_page_writes": "off",
            "synchronous_standby_names": "'ghost'", "synchronous_commit": "local",
            "log_min_messages": "warning",
        }
        with open(self.data / "postgresql.conf", "a", encoding="utf-8") as conf:
            for key, value in settings.items():
                conf.write(f"{key} = {value}\n")

    def pg_ctl(self, *args: str) -> None:
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l", str(self.logfile),
                  "-w", "-t", "60", *args)
        connection.close()  # the test's own session did not survive either

    def start(self) -> None:
        self.pg_ctl("start")

    def stop(self, mode: str = "fast") -> None:
        self.pg_ctl("stop", "-m", mode)

    def restart(self, mode: str = "fast") -> None:
        self.pg_ctl("restart", "-m", mode)

    def url(self, dbname: str) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{dbname}"

    def execute(self, query: str, dbname: str = "postgres") -> None:
        import psycopg

        with psycopg.connect(host="127.0.0.1", port=self.port, user="postgres", dbname=dbname,
                             autocommit=True) as conn:
            conn.execute(query.encode())

    def server_log(self) -> str:
        try:
            return self.logfile.read_text()[-3000:]
        except OSError:
            return ""

    def destroy(self) -> None:
        with suppress(Exception):
            self.pg_ctl("stop", "-m", "immediate")
        shutil.rmtree(self.base, ignore_errors=True)


def migrate(database_url: str) -> None:
    """``manage.py migrate`` against another database, as a deployment would."""
    env = subprocess_env()
    env["DATABASE_URL"] = database_url
    result = subprocess.run([sys.executable, str(ROOT / "manage.py"), "migrate", "--noinput",
                             "-v", "0"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


@contextmanager
def using_database(database_url: str) -> Iterator[None]:
    """Point this process's default connection at another database for a while.

    The test process talks to the private cluster through the same public API and ORM as
    everywhere else; only this thread uses the connection, and the original settings (the
    shared test database) are restored afterwards so pytest-django tears down as usual.
    """
    import environ

    target = environ.Env.db_url_config(database_url)
    settings = connection.settings_dict
    saved = dict(settings)
    connection.close()
    settings.update({key: target[key] for key in ("NAME", "USER", "PASSWORD", "HOST", "PORT")})
    try:
        yield
    finally:
        connection.close()
        settings.clear()
        settings.update(saved)
