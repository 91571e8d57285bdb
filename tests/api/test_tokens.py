"""api/tokens.py: tokens name their user by primary key, so the job system needs no auth app."""

from __future__ import annotations

import subprocess
import sys

import psycopg
import pytest
from django.contrib.auth import get_user_model

from django_persistent_jobs.api.tokens import ApiToken
from tests.core_support import ROOT, conninfo, subprocess_env

pytestmark = pytest.mark.django_db


def test_a_token_acts_as_its_user_and_dies_with_it():
    user = get_user_model().objects.create_user("ops-bot", password="x")
    token, secret = ApiToken.objects.create_token(user=user, name="grafana")

    authenticated = ApiToken.objects.authenticate(secret)
    assert authenticated == token and authenticated.user == user

    user.delete()
    assert not ApiToken.objects.filter(pk=token.pk).exists()
    assert ApiToken.objects.authenticate(secret) is None


@pytest.mark.parametrize("tenant", ["", 42, "x" * 201, "a\x00b"])
def test_a_token_for_an_unusable_tenant_is_refused_not_left_unbound(tenant: object):
    """``tenant=""`` (an unset variable, a blank form value) made an *unbound* token, one that
    sees every tenant: the opposite of what the caller was confining. As for a job's tenant
    (``bounds.tenant_problem``), only ``None`` means "no tenant"; anything else unusable is an
    error, and no token is created."""
    user = get_user_model().objects.create_user("ops-bot", password="x")
    with pytest.raises(ValueError, match="tenant"):
        ApiToken.objects.create_token(user=user, name="acme-bot", tenant=tenant)
    assert not ApiToken.objects.exists()


def test_a_token_whose_user_is_gone_or_inactive_authenticates_nobody():
    user = get_user_model().objects.create_user("ops-bot", password="x")
    _, secret = ApiToken.objects.create_token(user=user, name="grafana")
    user.is_active = False
    user.save()
    assert ApiToken.objects.authenticate(secret) is None

    orphan = ApiToken.objects.create(name="orphan", user_pk="987654321", key_prefix="pjt_x",
                                     key_hash="0" * 64)
    assert orphan.user is None


def _manage(env: dict[str, str], *args: str) -> str:
    done = subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"manage.py {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.django_db(transaction=True)
def test_a_worker_only_project_without_contrib_apps_migrates_checks_and_runs_jobs():
    # The contrib apps' models are what a project without those apps cannot load; importing
    # their plain modules is harmless (on Django 5.2 the django-tasks backport imports the
    # admin's, through django-stubs-ext).
    args = conninfo()
    name = f"{args['dbname']}_worker_only"
    admin_args = {**args, "dbname": "postgres"}
    with psycopg.connect(**admin_args, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        env = subprocess_env()
        env["DATABASE_URL"] = env["DATABASE_URL"].rsplit("/", 1)[0] + "/" + name
        env["DJANGO_SETTINGS_MODULE"] = "tests.settings_worker_only"
        _manage(env, "migrate", "-v", "0")
        _manage(env, "check", "--fail-level", "WARNING")
        _manage(env, "makemigrations", "--check", "--dry-run", "django_persistent_jobs")
        _manage(env, "shell", "-c",
                "from django_persistent_jobs import enqueue; enqueue('test.noop', {})")
        loaded = _manage(env, "shell", "--no-imports", "-c", (
            "import sys, django_persistent_jobs.runner, django_persistent_jobs.urls; "
            "print(sorted(m for m in sys.modules if m in ('django.contrib.admin.models', "
            "'django.contrib.auth.models', 'django.contrib.contenttypes.models')))"))
        assert loaded.strip() == "[]"
        # Handlers in a worker process: a fresh interpreter, which must not need auth either.
        _manage(env, "runjobs", "--burst", "--processes", "1")
        with psycopg.connect(**{**args, "dbname": name}) as conn:
            rows = conn.execute("SELECT status FROM persistent_jobs").fetchall()
        assert rows == [("completed",)]
    finally:
        with psycopg.connect(**admin_args, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
