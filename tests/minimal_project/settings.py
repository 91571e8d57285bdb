"""A project with nothing but the job system and one app of handlers: no ``django.contrib.auth``,
``admin``, ``contenttypes``, sessions or URLs (a worker-only service). The tests run
``migrate``, ``check``, ``enqueue`` and ``runjobs`` against it in subprocesses."""

from __future__ import annotations

import os

import environ

SECRET_KEY = "tests-only-not-secret"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = ["django_persistent_jobs", "tests.minimal_project.jobsapp"]

DATABASES = {"default": environ.Env.db_url_config(os.environ["DATABASE_URL"])}

PERSISTENT_JOBS = {"POLL_INTERVAL": 0.2, "HEARTBEAT_INTERVAL": 0.5, "STALE_LOCK_TIMEOUT": 5}
