"""Helpers every test module may use: polls with a deadline, the database clock, settings
overrides, extra connections and the environment of subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
from django.conf import settings
from django.db import InterfaceError, OperationalError, connection, connections, transaction
from django.test import override_settings

#: The repository's root (where ``manage.py`` is), the working directory of subprocesses.
ROOT = Path(__file__).resolve().parent.parent


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, message: str = "condition",
             *, interval: float = 0.02, reconnect: bool = False) -> Any:
    """Poll ``predicate`` until it returns something truthy or ``timeout`` passes.

    With ``reconnect`` a dropped database connection counts as "not yet": the connection is
    closed so the next poll opens a new one (for scenarios that restart PostgreSQL).
    """
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except (OperationalError, InterfaceError) as exc:
            if not reconnect:
                raise
            last_error = exc
            connection.close()
        if time.monotonic() >= deadline:
            extra = f" (last database error: {last_error})" if last_error else ""
            raise AssertionError(f"timed out after {timeout}s waiting for {message}{extra}")
        time.sleep(interval)


def db_now(*, clock: bool = False) -> datetime:
    """The database's time: ``now()`` (the current transaction's start, the time ``enqueue``
    stamps on rows it writes in that transaction), or with ``clock`` the wall clock
    (``clock_timestamp()``), for comparisons with rows other connections wrote."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()" if clock else "SELECT now()")
        value: datetime = cursor.fetchone()[0]
    return value


def pj_settings(**overrides: Any) -> override_settings:
    """``override_settings`` for some ``PERSISTENT_JOBS`` keys, keeping the suite's others."""
    return override_settings(PERSISTENT_JOBS={**settings.PERSISTENT_JOBS, **overrides})


#: The statements ``enqueue()`` prepares, as ``pg_prepared_statements`` shows them.
PREPARED_INSERTS = ("statement LIKE 'INSERT INTO persistent_jobs %%' "
                    "OR statement LIKE 'SELECT persistent_jobs_insert(%%'")


def lose_prepared(where: str, params: list[Any] | None = None) -> list[str]:
    """What a pooler in transaction mode does to a client it moves to another server session:
    the prepared statements psycopg believes it has (those ``where`` selects in
    ``pg_prepared_statements``) are not there (``DEALLOCATE`` by name, which psycopg does not
    notice, unlike ``DEALLOCATE ALL``). Returns the names lost."""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT name FROM pg_prepared_statements WHERE {where}", params)
        names = [name for (name,) in cursor.fetchall()]
        assert names, "no prepared statement to lose"
        for name in names:
            cursor.execute(f'DEALLOCATE "{name}"')
    return names


def lose_prepared_inserts() -> list[str]:
    """``lose_prepared`` for the statements ``enqueue()`` prepared."""
    return lose_prepared(PREPARED_INSERTS)


def prepare_foreign_statements(names: list[str]) -> None:
    """The other thing such a pooler does: the server session the client lands on has another
    client's statement under the names psycopg used for ours (``_pg3_N`` is a per-connection
    counter, the same in every client), with another number of parameters: binding ours to it
    fails with 08P01, "bind message supplies N parameters, but prepared statement ... requires
    1"."""
    with connection.cursor() as cursor:
        for name in names:
            cursor.execute(f'PREPARE "{name}" (int) AS SELECT $1')


def conninfo() -> dict[str, Any]:
    """psycopg connection arguments for the test database (the one Django's connection uses)."""
    s = connection.settings_dict
    args: dict[str, Any] = {"dbname": s["NAME"], "user": s["USER"] or "postgres",
                            "host": s["HOST"] or "127.0.0.1", "port": s["PORT"] or 5432}
    if s["PASSWORD"]:
        args["password"] = s["PASSWORD"]
    return args


@contextmanager
def raw_connection(autocommit: bool = True) -> Iterator[psycopg.Connection[Any]]:
    """A second, independent connection (its own backend and transaction) to the test database."""
    conn = psycopg.connect(**conninfo(), autocommit=autocommit)
    try:
        yield conn
    finally:
        conn.close()


@contextmanager
def refusing_updates(name: str, table: str, condition: str, message: str,
                     errcode: str | None = None) -> Iterator[None]:
    """A trigger that makes PostgreSQL reject every update of ``table`` for which the SQL
    ``condition`` (over ``OLD`` and ``NEW``) holds, raising ``message`` (with SQLSTATE
    ``errcode``, else P0001): an error retrying does not fix, as a trigger or constraint of the
    project's own would raise. Dropped on exit. ``name`` names the trigger and its function;
    the caller interpolates only values it made itself."""
    code = f" USING ERRCODE = '{errcode}'" if errcode else ""
    with connection.cursor() as cursor:
        cursor.execute(f"""
            CREATE FUNCTION {name}() RETURNS trigger AS $$
            BEGIN
                IF {condition} THEN
                    RAISE EXCEPTION '{message}'{code};
                END IF;
                RETURN NEW;
            END $$ LANGUAGE plpgsql;
            CREATE TRIGGER {name} BEFORE UPDATE ON {table}
                FOR EACH ROW EXECUTE FUNCTION {name}();
        """)
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"DROP TRIGGER IF EXISTS {name} ON {table}; "
                           f"DROP FUNCTION IF EXISTS {name}()")


def blocked_backends(conn: psycopg.Connection[Any]) -> int:
    """Backends of this database currently waiting on a heavyweight lock."""
    row = conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND wait_event_type = 'Lock'"
    ).fetchone()
    assert row is not None
    return int(row[0])


def notifications_until_marker(
    conn: psycopg.Connection[Any], marker: str, channel: str = "persistent_jobs",
    timeout: float = 10.0,
) -> list[str]:
    """Payloads received on ``conn`` (which LISTENs) before ``marker``, sent after the test's work.

    PostgreSQL delivers notifications in commit order, so everything a test's earlier commits
    sent arrives before the marker: an absent notification is proven absent without sleeping.
    """
    with psycopg.connect(**conninfo(), autocommit=True) as sender:
        sender.execute("SELECT pg_notify(%s, %s)", [channel, marker])
    payloads: list[str] = []
    for note in conn.notifies(timeout=timeout):
        if note.channel == channel and note.payload == marker:
            return payloads
        payloads.append(note.payload)
    raise AssertionError(f"marker notification not received within {timeout}s; got {payloads}")


#: A database URL nothing answers at (port 1): for what happens when the database is down.
UNREACHABLE_DATABASE_URL = "postgres://postgres@127.0.0.1:1/nowhere"


def run_without_database(*args: str) -> subprocess.CompletedProcess[str]:
    """``python *args`` from the repository root with the suite's settings and a database
    that does not answer: a dead database's answers, from a process of its own (this one's
    connections stay as they are)."""
    env = {**subprocess_env(), "DATABASE_URL": UNREACHABLE_DATABASE_URL}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)


def subprocess_env() -> dict[str, str]:
    """Environment for ``manage.py`` subprocesses: the suite's settings, pointed at the test
    database (which exists only while the tests run, under its test name)."""
    settings_dict = connection.settings_dict
    url = (f"postgres://{settings_dict['USER'] or 'postgres'}"
           f"{':' + settings_dict['PASSWORD'] if settings_dict['PASSWORD'] else ''}"
           f"@{settings_dict['HOST'] or '127.0.0.1'}:{settings_dict['PORT'] or 5432}"
           f"/{settings_dict['NAME']}")
    env = dict(os.environ)
    env.update({"DATABASE_URL": url, "DJANGO_SETTINGS_MODULE": "tests.settings",
                "PYTHONUNBUFFERED": "1", "TEST_DATABASE_NAME": settings_dict["NAME"]})
    return env


def claim_as(cursor: Any, runner_id: str, limit: int, queues: tuple[str, ...] | None = None,
             *args: Any, ghost: bool = False, **kwargs: Any) -> list[Any]:
    """``store.claim`` as runner ``runner_id``, registering its row first: a runner claims only
    while its row exists. With ``ghost`` the row is deleted again afterwards, leaving jobs
    locked by a runner that no longer exists (what a reaped runner leaves behind)."""
    from django_persistent_jobs.runner import store

    # Looked up first, not upserted: ``register_runner`` refreshes the heartbeat of an
    # existing row, and callers may have aged it on purpose (a runner presumed dead).
    cursor.execute("SELECT 1 FROM persistent_jobs_runners WHERE id = %s", [runner_id])
    if cursor.fetchone() is None:
        store.register_runner(cursor, runner_id, "test-host", os.getpid(), queues, 1, "test")
    jobs = store.claim(cursor, runner_id, limit, queues, *args, **kwargs)
    if ghost:
        cursor.execute("DELETE FROM persistent_jobs_runners WHERE id = %s", [runner_id])
    return jobs


def register_runner(runner_id: str) -> None:
    """Give ``runner_id`` a runner row (on the default connection), so that it may claim."""
    from django_persistent_jobs.runner import store

    with connection.cursor() as cursor:
        store.register_runner(cursor, runner_id, "test-host", os.getpid(), None, 1, "test")


class Rollback(Exception):
    """Raised to roll back the holding transaction of ``race_for_key``."""


def race_for_key(hold: Callable[[], Any], contend: Callable[[], Any], *,
                 hold_rolls_back: bool = False) -> tuple[Future[Any], Future[Any]]:
    """Run ``hold`` in a transaction kept open, then ``contend`` in another thread; ``contend``
    must block on what ``hold`` wrote (seen in pg_stat_activity) until the first transaction
    commits, or rolls back with ``hold_rolls_back``. Both run on their own connections."""
    inserted, release = threading.Event(), threading.Event()

    def first() -> Any:
        try:
            with transaction.atomic():
                result = hold()
                inserted.set()
                assert release.wait(20)
                if hold_rolls_back:
                    raise Rollback
            return result
        finally:
            connections.close_all()

    def second() -> Any:
        try:
            with transaction.atomic():
                return contend()
        finally:
            connections.close_all()

    pool = ThreadPoolExecutor(2)
    with raw_connection() as monitor:
        try:
            f1 = pool.submit(first)
            assert inserted.wait(20)
            f2 = pool.submit(second)
            wait_for(lambda: blocked_backends(monitor) >= 1 or f2.done(),
                     message="the second transaction to block on the first one's write")
            assert not f2.done(), "the second transaction did not wait for the first"
        finally:
            release.set()
            pool.shutdown(wait=True)
    return f1, f2


def staff_client(username: str, *codenames: str) -> Any:
    """A logged-in test ``Client`` for a staff user with exactly these permissions of this
    app (``view_persistentjob``...): what an operator with that role sees."""
    from django.contrib.auth.models import Permission, User
    from django.test import Client

    user = User.objects.create_user(username, is_staff=True)
    perms = Permission.objects.filter(content_type__app_label="django_persistent_jobs",
                                      codename__in=codenames)
    assert perms.count() == len(codenames), codenames
    user.user_permissions.add(*perms)
    client = Client()
    client.force_login(user)
    return client
