"""Where the tests' PostgreSQL is: DATABASE_URL, else a testcontainers instance if Docker runs."""

from __future__ import annotations

import atexit
import os

_container_url: str | None = None


def _docker_reachable() -> bool:
    try:
        import docker  # type: ignore[import-untyped]

        docker.from_env(timeout=2).ping()
        return True
    except Exception:
        return False


def database_url() -> str | None:
    global _container_url
    url = os.environ.get("DATABASE_URL")
    if url:
        return url
    if _container_url:
        return _container_url
    if not _docker_reachable():
        return None
    from testcontainers.postgres import PostgresContainer

    container = PostgresContainer("postgres:15", driver=None)
    container.start()
    atexit.register(container.stop)
    _container_url = container.get_connection_url()
    os.environ["DATABASE_URL"] = _container_url  # runner subprocesses inherit it
    return _container_url
