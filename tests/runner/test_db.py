"""``run_bounded``: a supervisor duty waits a bounded time for a row lock, then leaves the work
for its next round (real PostgreSQL, the lock held by another session)."""

from __future__ import annotations

import time

import psycopg
import pytest
from django.db import connection, transaction

from django_persistent_jobs import enqueue
from django_persistent_jobs.runner.db import NotNow, run_bounded

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(60)]


def _other_session() -> psycopg.Connection:
    params = connection.get_connection_params()
    return psycopg.connect(**{k: v for k, v in params.items()
                              if isinstance(v, str | int) and not isinstance(v, bool)})


def test_a_locked_row_is_left_for_later_after_the_lock_timeout() -> None:
    with transaction.atomic():
        job = enqueue("test.noop", {})
    touch = "UPDATE persistent_jobs SET updated_at = now() WHERE id = %s RETURNING id"
    with _other_session() as holder:
        holder.execute("SELECT id FROM persistent_jobs WHERE id = %s FOR UPDATE", [job.id])
        began = time.monotonic()
        with pytest.raises(NotNow) as caught:
            run_bounded("default", lambda c: c.execute(touch, [job.id]), what="touching",
                        lock_timeout=0.3)
        waited = time.monotonic() - began
        assert caught.value.locked
        assert 0.25 <= waited < 5, waited
        holder.rollback()
    # Once the holder is gone the same work goes through, and the connection is still usable.
    def touch_and_read(cursor: object) -> object:
        cursor.execute(touch, [job.id])  # type: ignore[attr-defined]
        return cursor.fetchone()  # type: ignore[attr-defined]

    assert run_bounded("default", touch_and_read, what="touching") == (job.id,)


def test_a_loop_that_dies_of_a_lost_prepared_statement_says_the_runner_needs_a_session(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Behind a pooler in transaction mode that does not keep prepared statements, the claim
    (a prepared statement) fails with "prepared statement ... does not exist" and its loop
    dies: the runner says what is wrong and what to change, not only the SQL error. (The
    error is PostgreSQL's own, raised through Django's cursor as the claim's would be.)"""
    from django_persistent_jobs.runner.loop import Loop

    def body() -> None:
        with connection.cursor() as cursor:
            cursor.execute("EXECUTE pj_no_such_statement")

    def other_failure() -> None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1 / 0")

    with caplog.at_level("CRITICAL", logger="django_persistent_jobs.runner"):
        for name, target in (("claimer", body), ("scheduler", other_failure)):
            loop = Loop(name, target)
            loop.start()
            loop.join(30)
            assert not loop.alive and loop.failure is not None
    advice = [r for r in caplog.records if getattr(r, "event", "") == "runner_needs_session"]
    assert [r.loop for r in advice] == ["claimer"]  # type: ignore[attr-defined]
    text = advice[0].getMessage()
    assert "pooler in transaction mode" in text and "session mode" in text
