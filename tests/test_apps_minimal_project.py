"""The job system in a project without ``django.contrib.auth``, ``admin`` or ``contenttypes``.

A worker-only service installs nothing but this app and its own handlers. Its settings live in
``tests/minimal_project`` (a database of its own, created here); every step runs as that project
would run it, in a subprocess: ``migrate`` (whose migrations must not depend on the auth app),
``makemigrations --check``, ``check``, an ``enqueue``, ``runjobs --burst`` with a worker process
(threads are the default; a worker process is a fresh interpreter that must not need the auth app
either), and the ``jobs`` command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from tests.core_support import ROOT, conninfo

pytestmark = [pytest.mark.timeout(240)]

ENQUEUE = """\
import django
django.setup()
from django.db import transaction
from django_persistent_jobs import enqueue
with transaction.atomic():
    print(enqueue("minimal.echo", {"hello": "world"}).id)
"""

NO_USER_TOKEN = """\
import types
import django
django.setup()
from django_persistent_jobs.api.tokens import ApiToken
token, secret = ApiToken.objects.create_token(user=types.SimpleNamespace(pk=1), name="orphan")
print(token.user, ApiToken.objects.authenticate(secret))
"""


@pytest.fixture
def minimal_database() -> Iterator[str]:
    """An empty database for the minimal project; its URL."""
    server = conninfo()
    name = os.environ.get("TEST_DATABASE_NAME", "test_persistent_jobs") + "_minimal"
    with psycopg.connect(**{**server, "dbname": "postgres"}, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.execute(f'CREATE DATABASE "{name}"')
    password = f":{server['password']}" if server.get("password") else ""
    try:
        yield f"postgres://{server['user']}{password}@{server['host']}:{server['port']}/{name}"
    finally:
        with psycopg.connect(**{**server, "dbname": "postgres"}, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def run(database_url: str, *args: str) -> str:
    """Run ``args`` (after the interpreter) in the minimal project; return its stdout and then
    its stderr (where ``runjobs`` logs)."""
    env = dict(os.environ)
    env.update({"DATABASE_URL": database_url,
                "DJANGO_SETTINGS_MODULE": "tests.minimal_project.settings"})
    env.pop("PJ_TEST_SETTINGS", None)
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{args} failed ({done.returncode}):\n{output}"
    return output


def manage(database_url: str, *args: str) -> str:
    return run(database_url, "manage.py", *args)


def test_the_job_system_runs_in_a_project_without_auth_admin_or_contenttypes(
    minimal_database: str,
) -> None:
    output = manage(minimal_database, "migrate")
    assert "Apply all migrations: django_persistent_jobs\n" in output, output
    assert "Applying django_persistent_jobs.0001_initial" in output
    manage(minimal_database, "makemigrations", "--check", "--dry-run")
    assert "no issues" in manage(minimal_database, "check")

    job_id = run(minimal_database, "-c", ENQUEUE).strip().splitlines()[-1]
    output = manage(minimal_database, "runjobs", "--burst", "--processes", "1", "-v", "2")
    assert f"job {job_id} completed" in output, output
    assert "worker 1 started" in output  # the job ran in a worker process

    shown: dict[str, Any] = json.loads(manage(minimal_database, "jobs", "show", job_id, "--json"))
    assert (shown["status"], shown["attempts"], shown["job_type"]) == (
        "completed", 1, "minimal.echo")
    # Tokens exist (the table is migrated) but, with no user model, authenticate nobody.
    assert run(minimal_database, "-c", NO_USER_TOKEN).strip().endswith("None None")
    with psycopg.connect(minimal_database) as conn:
        tables = {row[0] for row in conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
    assert not {t for t in tables if t.startswith(("auth_", "django_admin", "django_content"))}
    assert "persistent_jobs_api_tokens" in tables
