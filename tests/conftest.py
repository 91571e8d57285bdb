"""Shared fixtures: real PostgreSQL, real runner threads and processes, polls with deadlines."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from django_persistent_jobs.runner import Runner
from tests.core_support import wait_for

__all__ = ["wait_for"]  # re-exported for test modules that import it from conftest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def start_runner() -> Iterator[Callable[..., Runner]]:
    """Start in-process runners (real threads, own connections); all are stopped at teardown."""
    runners: list[Runner] = []

    def start(**kwargs: Any) -> Runner:
        kwargs.setdefault("cleanup", False)
        runner = Runner(**kwargs)
        runner.start()
        assert runner.wait_until_started(30), "runner did not start"
        runners.append(runner)
        return runner

    yield start
    for runner in runners:
        runner.force_stop() if runner.forced.is_set() else runner.request_stop()
    for runner in runners:
        runner.finished.wait(30)


def test_database_env() -> dict[str, str]:
    """Environment for runner subprocesses: same settings, pointed at the test database."""
    settings = connection.settings_dict
    url = (f"postgres://{settings['USER'] or 'postgres'}"
           f"{':' + settings['PASSWORD'] if settings['PASSWORD'] else ''}"
           f"@{settings['HOST'] or '127.0.0.1'}:{settings['PORT'] or 5432}/{settings['NAME']}")
    env = dict(os.environ)
    env.update({"DATABASE_URL": url, "DJANGO_SETTINGS_MODULE": "tests.settings",
                "PYTHONUNBUFFERED": "1", "TEST_DATABASE_NAME": settings["NAME"]})
    return env


@pytest.fixture
def spawn_runner() -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Start ``manage.py runjobs`` processes against the test database; killed at teardown."""
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        full_env = test_database_env()
        full_env.update(env or {})
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "manage.py"), "runjobs", *args],
            cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        procs.append(proc)
        return proc

    yield spawn
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def db_clock() -> Any:
    """The database's current time (to compare with timestamps the server keeps)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        return cursor.fetchone()[0]


def wait_handler_inside(since: Any, timeout: float = 60.0, message: str = "a handler") -> None:
    """Wait until a runner process's handler is inside its job, past its first statement.

    A claimed job is ``running`` (with a ``running`` attempt) before a worker starts it, and a
    runner stopping hands back an unstarted job unlike one that started; tests about the
    latter must wait for the start. The handlers they use first insert a ``SideEffect`` row in
    their job's transaction: uncommitted, it shows only as a connection idle in a transaction
    whose last statement was that insert. ``since`` (from ``db_clock()``, before the runner was
    spawned) excludes connections of runners that were already gone.
    """

    def inside() -> bool:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT 1 FROM pg_stat_activity WHERE datname = current_database()"
                " AND pid <> pg_backend_pid() AND backend_start >= %s"
                " AND state = 'idle in transaction'"
                " AND query LIKE 'INSERT INTO \"testapp_sideeffect\"%%'", [since])
            return cursor.fetchone() is not None

    wait_for(inside, timeout, message=f"{message} to start")
