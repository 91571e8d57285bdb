"""Settings for the example project, read from the environment (django-environ).

DATABASE_URL must point at PostgreSQL (``scripts/demo.sh`` finds or starts one for you).
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from urllib.parse import unquote

import django
import environ

BASE_DIR = Path(__file__).resolve().parent.parent
env = environ.Env(DEBUG=(bool, False))
environ.Env.read_env(BASE_DIR / ".env") if (BASE_DIR / ".env").exists() else None

DEBUG = env("DEBUG")
SECRET_KEY = env("SECRET_KEY", default="example-project-insecure-key-change-me")
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["localhost", "127.0.0.1"])
DATABASES = {
    "default": env.db(
        "DATABASE_URL", default="postgres://postgres@127.0.0.1:5432/persistent_jobs_demo"
    )
}
# A Unix-socket directory may arrive URL-encoded (postgres://user@%2Fpath%2Fto%2Fdir/db).
DATABASES["default"]["HOST"] = unquote(str(DATABASES["default"].get("HOST", "")))

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_persistent_jobs",
    "example_project.demo",
]
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "example_project.urls"
TEMPLATES = [{
    "BACKEND": "django.template.backends.django.DjangoTemplates",
    "APP_DIRS": True,
    "OPTIONS": {"context_processors": [
        "django.template.context_processors.request",
        "django.contrib.auth.context_processors.auth",
        "django.contrib.messages.context_processors.messages",
    ]},
}]
WSGI_APPLICATION = "example_project.wsgi.application"
STATIC_URL = "static/"  # served by example_project/urls.py, even with DEBUG off
USE_TZ = True
TIME_ZONE = env("TIME_ZONE", default="UTC")
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

PERSISTENT_JOBS = {
    "MAX_RETRIES": 3,
    "TIMEOUT": 60,
    "CONCURRENCY": env.int("PJ_CONCURRENCY", default=4),
    "POLL_INTERVAL": 1.0,
    "STALE_LOCK_TIMEOUT": 30,
    "RETENTION": {"completed": timedelta(days=7), "cancelled": timedelta(days=7),
                  "dead_lettered": None},
}

# django.tasks: Django's @task API on the durable backend, run by `manage.py runjobs`. On
# Django 5.2 the task API comes from the django-tasks backport, installed as an app.
TASKS = {"default": {"BACKEND": "django_persistent_jobs.backends.PersistentJobsBackend"}}
if django.VERSION < (6, 0):
    INSTALLED_APPS.append("django_tasks")

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)-7s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "loggers": {
        "django_persistent_jobs": {"handlers": ["console"], "level": "INFO", "propagate": False},
        "example_project": {"handlers": ["console"], "level": "INFO", "propagate": False},
        # Django's task signals log each task's start and finish (django_tasks on 5.2).
        "django.tasks": {"handlers": ["console"], "level": "INFO", "propagate": False},
        "django_tasks": {"handlers": ["console"], "level": "INFO", "propagate": False},
    },
}
