"""``run_bounded``: a supervisor duty waits a bounded time for a row lock, then leaves the work
for its next round (real PostgreSQL, the lock held by another session)."""

from __future__ import annotations

import time

import psycopg
import pytest
from django.db import connection, transaction

from django_persistent_jobs import enqueue
from django_persistent_jobs.runner import store
from django_persistent_jobs.runner.db import (
    NotNow,
    is_lost_prepared_statement,
    run_bounded,
    run_with_retry,
)
from tests.core_support import lose_prepared, prepare_foreign_statements

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


_SUM = "SELECT %s::int + %s::int"


def _prepared_sum(cursor: object) -> int:
    """A two-parameter statement, prepared by psycopg as the claim is (``store.prepared``)."""
    with store.prepared(cursor) as fast:  # type: ignore[arg-type]
        fast.execute(_SUM, [2, 3], prepare=True)
        row = fast.fetchone()
    assert row is not None
    return int(row[0])


def _another_clients_statement_under_our_name() -> None:
    """Another client's one-parameter statement under the name psycopg used for ours."""
    prepare_foreign_statements(lose_prepared("statement LIKE %s", ["%::int + %"]))


def test_a_statement_bound_to_another_clients_is_not_retried_as_weather(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """psycopg raises that 08P01 as an ``OperationalError``, the class of a lost connection,
    but it is no outage: a retry on a fresh connection only moves the failure to a later
    statement. ``run_with_retry`` raises it at once, as it does a statement that is simply
    gone (26000), so that the loop dies saying the runner needs a session of its own."""
    assert run_with_retry("default", _prepared_sum, what="adding") == 5
    _another_clients_statement_under_our_name()
    with caplog.at_level("WARNING", logger="django_persistent_jobs.runner"), pytest.raises(
            Exception) as caught:
        run_with_retry("default", _prepared_sum, what="adding")
    assert is_lost_prepared_statement(caught.value), caught.value
    assert not [r for r in caplog.records if getattr(r, "event", "") == "db_retry"]


def test_a_loop_that_dies_of_a_statement_bound_to_another_clients_says_the_runner_needs_a_session(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from django_persistent_jobs.runner.loop import Loop

    def body() -> None:
        run_with_retry("default", _prepared_sum, what="adding")
        _another_clients_statement_under_our_name()
        run_with_retry("default", _prepared_sum, what="adding")

    with caplog.at_level("CRITICAL", logger="django_persistent_jobs.runner"):
        loop = Loop("claimer", body)
        loop.start()
        loop.join(30)
    assert not loop.alive and loop.failure is not None
    advice = [r for r in caplog.records if getattr(r, "event", "") == "runner_needs_session"]
    assert [r.loop for r in advice] == ["claimer"]  # type: ignore[attr-defined]


def test_a_statement_bound_to_another_clients_is_told_by_where_the_server_raised_it() -> None:
    """The server translates its messages (``lc_messages``): the 08P01 is recognised by the
    routine that raised it, which the server reports untranslated, not by its English text.
    Here the real error, wrapped in one whose text is the German server's."""
    from django.db import OperationalError

    assert run_with_retry("default", _prepared_sum, what="adding") == 5
    _another_clients_statement_under_our_name()
    with pytest.raises(Exception) as caught:
        run_with_retry("default", _prepared_sum, what="adding")
    real = caught.value.__cause__ if caught.value.__cause__ is not None else caught.value
    assert real.diag.source_function == "exec_bind_message"  # type: ignore[union-attr]
    german = OperationalError("Binden-Nachricht enthält 2 Parameter, aber vorbereitete "
                              "Anweisung »_pg3_0« erfordert 1")
    german.__cause__ = real
    assert is_lost_prepared_statement(german)


def test_a_protocol_violation_that_is_not_about_a_prepared_statement_is_not_taken_for_one(
) -> None:
    """08P01 also names real violations of the protocol (the server then ends the session):
    only the one about a prepared statement's parameters is a lost statement."""
    violation = psycopg.errors.ProtocolViolation("invalid frontend message type 0")
    assert not is_lost_prepared_statement(violation)


def _session_pid(cursor: object) -> int:
    cursor.execute("SELECT pg_backend_pid()")  # type: ignore[attr-defined]
    return int(cursor.fetchone()[0])  # type: ignore[attr-defined]


def test_a_kept_cursor_follows_its_connection_through_a_reset_and_a_killed_session() -> None:
    """The claim loop and the completer run their statements on a cursor kept for the
    connection's life (``keep_cursor``). A kept cursor must never outlive its connection:
    after the thread's connection was closed, or the server ended its session, the next
    statement runs on a fresh connection with a fresh cursor instead of failing for ever on
    the dead one."""
    from django_persistent_jobs.runner.db import kept_cursor, reset_connection

    first = run_with_retry("default", _session_pid, what="reading", keep_cursor=True)
    assert kept_cursor("default") is kept_cursor("default")  # one per connection
    assert run_with_retry("default", _session_pid, what="reading", keep_cursor=True) == first

    reset_connection("default")
    second = run_with_retry("default", _session_pid, what="reading", keep_cursor=True)
    assert second is not None and second != first

    with _other_session() as admin:
        admin.execute("SELECT pg_terminate_backend(%s, 5000)", [second])  # (waits for it)
    # The dead session's cursor fails once (a connection error, retried as weather), then the
    # statement runs on a new session.
    third = run_with_retry("default", _session_pid, what="reading", keep_cursor=True)
    assert third is not None and third not in (first, second)
    assert run_with_retry("default", _session_pid, what="reading", keep_cursor=True) == third
