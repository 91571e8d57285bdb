"""A runner the server can never hold stops at start-up, saying what to change (real PostgreSQL).

Before, ``runjobs --concurrency 150`` against ``max_connections = 100`` started 150 handler
threads that took every free connection and retried the rest forever (a burst with nothing due
never ended, and every other client of the server was refused meanwhile); a much larger value
ran the process out of threads and aborted it.
"""

from __future__ import annotations

import logging
import threading

import psycopg
import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection

from django_persistent_jobs import Runner
from django_persistent_jobs.errors import ConfigurationError
from django_persistent_jobs.models import JobRunnerRecord
from django_persistent_jobs.runner import budget

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]


def _limit() -> int:
    return budget.server_room(connection.alias).limit


def test_the_server_s_limits_are_read_for_this_role() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('max_connections')::int, "
                       "current_setting('superuser_reserved_connections')::int, rolsuper "
                       "FROM pg_roles WHERE rolname = current_user")
        max_connections, superuser_reserved, superuser = cursor.fetchone()
    room = budget.server_room(connection.alias)
    assert room.max_connections == max_connections
    assert room.limit == max_connections - room.reserved
    # A superuser may use the slots reserved for superusers; PostgreSQL 15 has no others.
    assert room.reserved == (0 if superuser else superuser_reserved)
    assert 0 < room.free <= room.limit  # (this test's own session is one of those in use)


@pytest.mark.parametrize("processes", [0, 2])
def test_a_runner_that_needs_more_connections_than_the_server_allows_does_not_start(
    processes: int,
) -> None:
    limit = _limit()
    concurrency = limit if processes == 0 else limit // processes
    threads_before = threading.active_count()
    runner = Runner(concurrency=concurrency, processes=processes, burst=True,
                    liveness_sidecar=False)
    with pytest.raises(ConfigurationError, match=r"max_connections") as raised:
        runner.run()
    needed = budget.sessions_needed(processes, concurrency)
    assert needed > limit
    assert f"at least {needed} database connections" in str(raised.value)
    assert "--concurrency" in str(raised.value)
    # Stopped before anything was started: no runner row, no handler threads, no workers.
    assert not JobRunnerRecord.objects.exists()
    assert threading.active_count() <= threads_before + 1
    assert runner.exit_code != 0


def test_runjobs_says_what_to_change_instead_of_hanging() -> None:
    with pytest.raises(CommandError, match=r"max_connections") as raised:
        call_command("runjobs", "--burst", "--concurrency", "100000")
    assert "at least 100005 database connections" in str(raised.value)
    assert not JobRunnerRecord.objects.exists()


def test_a_runner_that_fits_the_server_but_not_what_is_free_now_starts_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Other clients come and go: only a warning. Twelve sessions held here make the room
    small enough to ask for more than is free but well within the limit (the parallel test
    process may open or close a few sessions meanwhile)."""
    params = connection.get_connection_params()
    held = [psycopg.connect(**params) for _ in range(12)]
    try:
        room = budget.server_room(connection.alias)
        concurrency = room.free + 5 - budget.THREAD_RUNNER_OWN
        assert budget.sessions_needed(0, concurrency) < room.limit - 5
        with caplog.at_level(logging.WARNING, logger="django_persistent_jobs.runner"):
            budget.check(connection.alias, 0, concurrency, "r-test")
    finally:
        for session in held:
            session.close()
    [record] = [r for r in caplog.records if getattr(r, "event", None) == "connections_short"]
    assert "are free now" in record.getMessage()


def test_a_runner_within_what_is_free_starts_without_a_word(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="django_persistent_jobs.runner"):
        budget.check(connection.alias, 1, 2, "r-test")
    assert not [r for r in caplog.records if getattr(r, "event", None) == "connections_short"]


@pytest.mark.parametrize(
    ("needed", "verdict"),
    [(50, None), (80, None), (81, "warning"), (97, "warning"), (98, "error")],
)
def test_the_verdict_s_thresholds(needed: int, verdict: str | None) -> None:
    room = budget.ServerRoom(limit=97, free=80, max_connections=100, reserved=3)
    answer = room.verdict(needed, "test")
    assert (answer[0] if answer else None) == verdict
    if verdict == "error":
        assert answer is not None and "max_connections = 100, less 3 reserved" in answer[1]
