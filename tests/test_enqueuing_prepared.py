"""``enqueue()``'s prepared insert: on by default where the connection allows it, off where the
database says it sits behind a pooler that cannot keep prepared statements or Django watches
its cursors, and a pooler's refusal met at run time is survived in autocommit and explained in
a transaction.

A pooler that cannot keep prepared statements runs a statement prepared on one server
connection on another, where it does not exist. The same happens here, on a real PostgreSQL,
when the server forgets the statement behind psycopg's back (``DEALLOCATE ALL`` sent through
libpq directly, which psycopg's own bookkeeping does not see).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from django_persistent_jobs import ConfigurationError, enqueue, enqueuing
from django_persistent_jobs.models import PersistentJob
from tests.core_support import pj_settings

pytestmark = pytest.mark.django_db(transaction=True)


def prepared_inserts() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_prepared_statements "
                       "WHERE statement LIKE 'INSERT INTO persistent_jobs %%'")
        return int(cursor.fetchone()[0])


def forget_behind_psycopgs_back() -> None:
    """What a transaction-mode pooler does to a prepared statement: the server connection the
    next execution lands on does not have it."""
    connection.ensure_connection()
    raw = connection.connection
    assert raw is not None
    raw.pgconn.exec_(b"DEALLOCATE ALL")


@pytest.fixture(autouse=True)
def fresh_process_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts as a process that has met no refusal, on a connection that has
    prepared nothing."""
    monkeypatch.setattr(enqueuing, "_prepare_refused", False)
    with connection.cursor() as cursor:
        cursor.execute("DEALLOCATE ALL")
    yield


@pytest.fixture
def database_options() -> Iterator[dict[str, Any]]:
    """The connection's ``settings_dict``, restored afterwards."""
    saved = {key: (dict(value) if isinstance(value, dict) else value)
             for key, value in connection.settings_dict.items()}
    yield connection.settings_dict
    connection.settings_dict.clear()
    connection.settings_dict.update(saved)


def test_by_default_the_insert_is_prepared_once_per_connection() -> None:
    jobs = [enqueue("test.noop", {"n": n}) for n in range(3)]
    assert prepared_inserts() == 1
    stored = PersistentJob.objects.in_bulk([job.id for job in jobs])
    assert [stored[job.id].payload for job in jobs] == [{"n": 0}, {"n": 1}, {"n": 2}]


@pytest.mark.parametrize("change", [
    {"OPTIONS": {"prepare_threshold": None}},  # psycopg's switch for such poolers
    {"DISABLE_SERVER_SIDE_CURSORS": True},  # Django's sign of transaction pooling
], ids=["prepare_threshold-None", "DISABLE_SERVER_SIDE_CURSORS"])
def test_a_database_that_says_it_is_behind_a_pooler_gets_plain_inserts(
    database_options: dict[str, Any], change: dict[str, Any],
) -> None:
    database_options.update(change)
    enqueue("test.noop", {})
    assert prepared_inserts() == 0
    with pj_settings(PREPARED_STATEMENTS=True):  # an explicit setting wins
        enqueue("test.noop", {})
    assert prepared_inserts() == 1


def test_django_sees_the_prepared_insert_like_any_query() -> None:
    """It goes through Django's cursor wrapper: ``DEBUG`` query logging (here
    ``CaptureQueriesContext``, as the debug toolbar does) and ``execute_wrapper``s (as APM
    integrations do) see it, and it is still prepared."""
    with CaptureQueriesContext(connection) as captured:
        enqueue("test.noop", {})
    assert any("INSERT INTO persistent_jobs" in q["sql"] for q in captured)
    seen: list[str] = []

    def wrapper(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        seen.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(wrapper):
        enqueue("test.noop", {})
    assert any(sql.startswith("INSERT INTO persistent_jobs") for sql in seen)
    assert prepared_inserts() == 1


def test_only_a_connection_that_reaches_postgresql_itself_prepares_by_default(
    database_options: dict[str, Any],
) -> None:
    """Behind a pooler that cannot keep prepared statements a prepared statement may run
    another client's statement of the same name: by default only a connection whose server
    address and port are the ones it connected to prepares. A connection through a port
    mapping, a proxy or a Unix socket sends the insert as text."""
    connection.ensure_connection()
    info = connection.connection.info
    with connection.cursor() as cursor:
        cursor.execute("SELECT host(inet_server_addr()), inet_server_port()")
        assert cursor.fetchone() == (info.hostaddr, info.port)  # (the suite's own setup)
    enqueue("test.noop", {})
    assert prepared_inserts() == 1
    # The same server through a Unix socket: nothing says who is at the other end.
    connection.close()
    with connection.cursor() as cursor:
        cursor.execute("SHOW unix_socket_directories")
        sockets = cursor.fetchone()[0].split(",")[0].strip()
    connection.close()
    database_options["HOST"] = sockets
    enqueue("test.noop", {})
    with connection.cursor() as cursor:
        cursor.execute("SELECT inet_server_addr() IS NULL")
        assert cursor.fetchone() == (True,)
    assert prepared_inserts() == 0
    connection.close()


def test_a_refusal_in_autocommit_costs_nothing_and_stops_preparing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    enqueue("test.noop", {"n": 1})
    assert prepared_inserts() == 1
    forget_behind_psycopgs_back()
    with caplog.at_level(logging.WARNING, logger="django_persistent_jobs"):
        job = enqueue("test.noop", {"n": 2})  # refused, then sent again unprepared
    assert PersistentJob.objects.get(id=job.id).payload == {"n": 2}
    (warning,) = [r for r in caplog.records if getattr(r, "event", "") == "prepare_refused"]
    assert "PREPARED_STATEMENTS" in warning.getMessage()
    enqueue("test.noop", {"n": 3})
    assert prepared_inserts() == 0  # this process no longer prepares
    assert PersistentJob.objects.count() == 3


def test_a_refusal_inside_a_transaction_says_what_to_do_and_the_retry_works() -> None:
    enqueue("test.noop", {"n": 1})
    forget_behind_psycopgs_back()
    with pytest.raises(ConfigurationError, match="roll it back; then try the enqueue again"), \
            transaction.atomic():
        enqueue("test.noop", {"n": 2})
    with transaction.atomic():  # what the caller does next: it works, unprepared
        enqueue("test.noop", {"n": 3})
    assert sorted(j.payload["n"] for j in PersistentJob.objects.all()) == [1, 3]


def test_a_refusal_with_prepared_statements_asked_for_is_an_error() -> None:
    with pj_settings(PREPARED_STATEMENTS=True):
        enqueue("test.noop", {"n": 1})
        forget_behind_psycopgs_back()
        with pytest.raises(ConfigurationError, match="PREPARED_STATEMENTS'\\] = False"):
            enqueue("test.noop", {"n": 2})
    assert not enqueuing._prepare_refused  # asked for explicitly: not switched off behind it
    assert [j.payload for j in PersistentJob.objects.all()] == [{"n": 1}]


def test_a_refusal_of_a_keyed_enqueue_in_autocommit_says_to_try_again() -> None:
    """A Replace enqueue in autocommit runs in a transaction of its own (its savepoint), which
    the refusal ends: the caller, who opened no transaction, is told to try again, and that
    works."""
    enqueue("test.noop", {"n": 1}, dedup_key="first", dedup="replace")  # its insert prepared
    forget_behind_psycopgs_back()
    with pytest.raises(ConfigurationError, match="try the enqueue again"):
        enqueue("test.noop", {"n": 2}, dedup_key="k", dedup="replace")
    enqueue("test.noop", {"n": 3}, dedup_key="k", dedup="replace")
    assert sorted(j.payload["n"] for j in PersistentJob.objects.all()) == [1, 3]
