"""Settings for the test suite: a real PostgreSQL, from DATABASE_URL or testcontainers."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from typing import Any

import django
from django.core.exceptions import ImproperlyConfigured

from tests.database import database_url

SECRET_KEY = "tests-only-not-secret"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
ROOT_URLCONF = "tests.urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
STATIC_URL = "static/"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",  # the admin's CSS in live-server (browser) tests
    "django_persistent_jobs",
    "tests.testapp",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [{
    "BACKEND": "django.template.backends.django.DjangoTemplates",
    "APP_DIRS": True,
    "OPTIONS": {"context_processors": [
        "django.template.context_processors.request",
        "django.contrib.auth.context_processors.auth",
        "django.contrib.messages.context_processors.messages",
    ]},
}]


def _databases() -> dict:
    import environ

    url = database_url()
    if url is None:
        raise ImproperlyConfigured(
            "The tests need a real PostgreSQL. Set DATABASE_URL, for example\n"
            "  DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres\n"
            "or make a Docker engine reachable so testcontainers can start one."
        )
    config = environ.Env.db_url_config(url)
    name = os.environ.get("TEST_DATABASE_NAME", "test_persistent_jobs")
    config["TEST"] = {"NAME": name}
    # "jobs": a second alias on the same server, for the tests that set PERSISTENT_JOBS
    # ["DATABASE"] to an alias other than "default" (tests/admin/test_jobs_database.py). Its
    # test database is created only when a collected test names it (databases={"default",
    # "jobs"}): pytest-django sets up the aliases the tests ask for, so the rest of the suite
    # neither migrates nor flushes it.
    jobs = {**config, "TEST": {"NAME": f"{name}_jobs"}}
    return {"default": config, "jobs": jobs}


DATABASES = _databases()

# django.tasks: the durable backend (run by runjobs) and the in-process one. On Django 5.2 the
# task API comes from the django-tasks backport, whose app registers its checks and signals.
TASKS = {
    "default": {
        "BACKEND": "django_persistent_jobs.backends.PersistentJobsBackend",
        "QUEUES": ["default", "tasks-other"],
    },
    "inprocess": {
        "BACKEND": "django_persistent_jobs.backends.InProcessBackend",
        "QUEUES": [],
        "OPTIONS": {"WORKERS": 2},
    },
    "serial": {  # one thread: start order is exactly dispatch order
        "BACKEND": "django_persistent_jobs.backends.InProcessBackend",
        "QUEUES": [],
        "OPTIONS": {"WORKERS": 1},
    },
}
if django.VERSION < (6, 0):
    INSTALLED_APPS.append("django_tasks")

# Short timings so runner tests finish quickly; individual tests override what they need.
PERSISTENT_JOBS = {
    "POLL_INTERVAL": 0.2,
    "STALE_LOCK_TIMEOUT": 3,
    "HEARTBEAT_INTERVAL": 0.5,
    "SHUTDOWN_GRACE": 5,
    "CLEANUP_INTERVAL": 3600,
    "RETENTION": {"completed": timedelta(days=7), "cancelled": timedelta(days=7),
                  "dead_lettered": None},
}

# Runner subprocesses (tests/faults starts real ``runjobs`` processes) cannot use
# override_settings, so they take their timings from the environment: PJ_TEST_SETTINGS is a JSON
# object merged into PERSISTENT_JOBS (numbers in seconds).
if os.environ.get("PJ_TEST_SETTINGS"):
    PERSISTENT_JOBS.update(json.loads(os.environ["PJ_TEST_SETTINGS"]))

LOGGING: dict[str, Any] = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"null": {"class": "logging.NullHandler"}},
    "loggers": {"django_persistent_jobs": {"handlers": ["null"], "level": "DEBUG",
                                           "propagate": True}},
}

# PJ_TEST_LOG=INFO (or DEBUG) makes a runner subprocess log to stdout, one line per event, so
# the fault suite can wait for what a runner says (an event, not a sleep) and keep its logs.
if os.environ.get("PJ_TEST_LOG"):
    LOGGING["formatters"] = {"line": {
        "format": "%(asctime)s.%(msecs)03d %(process)d %(threadName)s %(levelname)s %(message)s",
        "datefmt": "%H:%M:%S",
    }}
    LOGGING["handlers"]["console"] = {"class": "logging.StreamHandler",
                                      "stream": "ext://sys.stdout", "formatter": "line"}
    LOGGING["loggers"]["django_persistent_jobs"] = {
        "handlers": ["console"], "level": os.environ["PJ_TEST_LOG"], "propagate": False,
    }
