"""Django settings for the benchmark: the app, the bench handlers, and the ``pj_bench`` database.

``bench/run.py`` creates ``pj_bench`` fresh on the server named by ``DATABASE_URL`` and exports
``PJ_BENCH_DATABASE_URL`` (the same server, database ``pj_bench``) so that the ``runjobs``
subprocesses it starts use exactly the database it measures. Parsing is done with the standard
library so the benchmark needs nothing beyond the package's own dependencies.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import unquote, urlsplit

DEFAULT_SERVER_URL = "postgres://postgres@127.0.0.1:5432/postgres"
BENCH_DB_NAME = os.environ.get("PJ_BENCH_DB", "pj_bench")


def bench_database_url() -> str:
    """The URL of the benchmark database: ``PJ_BENCH_DATABASE_URL``, else DATABASE_URL's server."""
    explicit = os.environ.get("PJ_BENCH_DATABASE_URL")
    if explicit:
        return explicit
    parts = urlsplit(os.environ.get("DATABASE_URL") or DEFAULT_SERVER_URL)
    return parts._replace(path="/" + BENCH_DB_NAME).geturl()


def database_config(url: str) -> dict[str, Any]:
    """A Django ``DATABASES`` entry for a ``postgres://user:pass@host:port/name`` URL."""
    parts = urlsplit(url)
    if parts.scheme not in {"postgres", "postgresql", "pgsql"}:
        raise ValueError(f"DATABASE_URL must be a postgres:// URL, got {url!r}")
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": unquote(parts.path.lstrip("/")),
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or "",
        "PORT": str(parts.port or ""),
        # Persistent connections, as a real runner would use; no health checks on the hot path.
        "CONN_MAX_AGE": None,
    }


SECRET_KEY = "bench-only-not-secret"
DEBUG = False  # DEBUG=True would record every query in memory and skew both speed and RSS.
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = ["django.contrib.contenttypes", "django_persistent_jobs", "bench"]
DATABASES = {"default": database_config(bench_database_url())}

PERSISTENT_JOBS = {
    # Cleanup would delete the finished rows the --finished-rows figure needs to keep.
    "RETENTION": {"completed": None, "cancelled": None, "dead_lettered": None},
    "CLEANUP_INTERVAL": 3600,
}

# WARNING, not INFO: one log line per job would measure the logging system, not the runner.
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"stderr": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["stderr"], "level": "WARNING"},
}
