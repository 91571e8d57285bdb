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
