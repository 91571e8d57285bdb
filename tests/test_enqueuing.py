"""enqueue() and enqueue_many(): transactional insert, wake-ups, scheduling, option validation."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from django.db import IntegrityError, connection, transaction
from django.db import ProgrammingError as DjangoProgrammingError
from django.test.utils import CaptureQueriesContext

from django_persistent_jobs import (
    ConfigurationError,
    Dedup,
    EnqueueError,
    PreparedStatementLostError,
    UnknownJobTypeError,
    enqueue,
    enqueue_many,
    enqueuing,
    job_handler,
)
from django_persistent_jobs.handlers import registry
from django_persistent_jobs.models import JobStatus, PersistentJob
from tests.core_support import (
    PREPARED_INSERTS,
    db_now,
    lose_prepared_inserts,
    notifications_until_marker,
    pj_settings,
    prepare_foreign_statements,
    raw_connection,
)


@job_handler("core.enq.configured", max_retries=5, timeout=12, queue="emails", priority=7,
             dedup=Dedup.ENQUEUE)
def configured(payload: Any) -> None:
    return None


class Rollback(Exception):
    pass



@pytest.fixture
def listener() -> Iterator[psycopg.Connection[Any]]:
    with raw_connection() as conn:
        conn.execute("LISTEN persistent_jobs")
        yield conn


# ------------------------------------------------------------------ transactional enqueue

@pytest.mark.django_db(transaction=True)
def test_rollback_leaves_no_job_and_sends_no_wakeup(listener: psycopg.Connection[Any]) -> None:
    with pytest.raises(Rollback), transaction.atomic():
        doomed = enqueue("test.noop", {"n": 1})
        assert PersistentJob.objects.filter(id=doomed.id).exists()  # visible inside
        raise Rollback
    assert not PersistentJob.objects.filter(id=doomed.id).exists()

    with transaction.atomic():
        kept = enqueue("test.noop", {"n": 2})
    # Commit order is delivery order: had the rollback sent a NOTIFY, it would come first.
    assert notifications_until_marker(listener, "marker") == [str(kept.id)]
    assert list(PersistentJob.objects.values_list("id", flat=True)) == [kept.id]


@pytest.mark.django_db(transaction=True)
def test_job_is_invisible_to_others_until_the_callers_commit(
    listener: psycopg.Connection[Any],
) -> None:
    with raw_connection() as other, transaction.atomic():
        job = enqueue("test.noop")
        seen = other.execute("SELECT count(*) FROM persistent_jobs WHERE id = %s",
                             [job.id]).fetchone()
        assert seen == (0,)
        assert notifications_until_marker(listener, "before-commit") == []
    with raw_connection() as other:
        assert other.execute("SELECT status FROM persistent_jobs WHERE id = %s",
                             [job.id]).fetchone() == ("pending",)
    # The NOTIFY carries the job id and nothing else.
    assert notifications_until_marker(listener, "after-commit") == [str(job.id)]


@pytest.mark.django_db(transaction=True)
def test_delayed_job_sends_no_wakeup_but_a_due_one_does(
    listener: psycopg.Connection[Any],
) -> None:
    later = enqueue("test.noop", delay=3600)
    due = enqueue("test.noop")
    assert notifications_until_marker(listener, "m") == [str(due.id)]
    assert later.id != due.id


@pytest.mark.django_db(transaction=True)
def test_enqueue_many_sends_one_wakeup_per_statement(listener: psycopg.Connection[Any]) -> None:
    with transaction.atomic():
        jobs = enqueue_many([("test.noop", {"i": i}) for i in range(50)])
    notes = notifications_until_marker(listener, "m")
    assert len(notes) == 1
    assert notes[0] in {str(j.id) for j in jobs}


# ------------------------------------------------------------------ defaults and scheduling

@pytest.mark.django_db
def test_enqueue_returns_the_stored_job_with_handler_defaults() -> None:
    job = enqueue("test.ledger", {"note": "x"})
    assert isinstance(job, PersistentJob)
    assert job.status == JobStatus.PENDING
    assert job.payload == {"note": "x"}
    assert (job.max_retries, job.timeout_seconds, job.queue, job.priority) == (3, 60.0,
                                                                               "default", 0)
    assert job.attempts == 0 and job.dedup == "skip" and job.schedule is None
    stored = PersistentJob.objects.get(id=job.id)
    assert stored.payload == {"note": "x"}
    assert stored.next_run_at == job.next_run_at == db_now()  # due at once, by the DB clock
    assert job.id.version == 7


def _fields(job: PersistentJob) -> dict[str, Any]:
    return {f.attname: getattr(job, f.attname) for f in PersistentJob._meta.concrete_fields}


@pytest.mark.django_db
@pytest.mark.parametrize("use_tz", [True, False])
@pytest.mark.parametrize("options", [
    {},
    {"delay": 90, "tenant": "acme", "priority": -4, "queue": "q", "max_retries": 0},
    {"run_at": datetime(2031, 5, 17, 12, 30, tzinfo=UTC), "timeout": 2.5},
    {"dedup_key": "k", "dedup": Dedup.ENQUEUE},  # a key that takes no dedup turn
])
def test_a_plain_enqueue_returns_exactly_the_row_it_stored(
    settings: Any, use_tz: bool, options: dict[str, Any],
) -> None:
    """A job without a dedup turn goes in through ``persistent_jobs_insert()`` and comes back
    built from what was sent plus the server's due and creation times: every field must equal a
    fresh read of the row (time zone support on or off), and the statement is one call."""
    settings.USE_TZ = use_tz
    payload = {"order": 7, "lines": [1.5, "two", None, {"deep": True}], "note": "é ' %s"}
    enqueue("test.noop")  # (the process's first plain enqueue looks the function up)
    with CaptureQueriesContext(connection) as queries:
        job = enqueue("test.noop", payload, **options)
    assert [q["sql"].split("(")[0] for q in queries.captured_queries] == [
        "SELECT persistent_jobs_insert"]
    stored = PersistentJob.objects.get(id=job.id)
    assert _fields(job) == _fields(stored)
    assert job._state.db == stored._state.db and not job._state.adding
    job.status = JobStatus.CANCELLED
    job.save(update_fields=["status"])  # an ordinary model instance: it saves as one
    assert PersistentJob.objects.get(id=job.id).status == JobStatus.CANCELLED


@pytest.mark.django_db
@pytest.mark.parametrize("signal_name", ["pre_init", "post_init"])
def test_init_receivers_of_the_job_model_see_every_job_enqueue_returns(signal_name: str) -> None:
    """The returned jobs are built without ``Model.__init__`` (it was most of ``enqueue()``'s
    own Python), which would skip the init signals: with a receiver connected for the job model,
    they are built the regular way, so the receiver sees each one, and they still equal a fresh
    read (``enqueue_many`` leaves the columns the database filled in deferred)."""
    from django.db.models import signals as model_signals

    signal = getattr(model_signals, signal_name)
    seen: list[Any] = []

    def receiver(sender: Any, **kwargs: Any) -> None:
        seen.append(kwargs.get("instance"))

    signal.connect(receiver, sender=PersistentJob)
    try:
        one = enqueue("test.noop", {"n": 1})
        many = enqueue_many([("test.noop", {"n": 2}), ("test.noop", {"n": 3})])
    finally:
        signal.disconnect(receiver, sender=PersistentJob)
    assert len(seen) == 3
    if signal_name == "post_init":
        assert [job.pk for job in seen] == [one.pk, *(job.pk for job in many)]
    for job in [one, *many]:
        assert type(job) is PersistentJob and not job._state.adding
        assert _fields(job) == _fields(PersistentJob.objects.get(id=job.id))
    seen.clear()
    enqueue("test.noop")  # disconnected: the fast path again, unseen
    assert seen == []


@pytest.fixture
def insert_function_unknown() -> Iterator[None]:
    """This process forgets whether the database has ``persistent_jobs_insert()`` (it looks
    that up on its first plain enqueue there), before and after the test."""
    enqueuing._HAS_INSERT_FUNCTION.clear()
    yield
    enqueuing._HAS_INSERT_FUNCTION.clear()


@pytest.mark.django_db
def test_without_the_insert_function_enqueue_inserts_as_text_and_says_so(
    insert_function_unknown: None, caplog: pytest.LogCaptureFixture,
) -> None:
    """A database whose migrations did not run (pytest-django's ``--nomigrations`` builds the
    tables from the models, without migration 0012's function): ``enqueue()`` still works, with
    a plain insert, and one warning says what is missing."""
    with connection.cursor() as cursor:
        cursor.execute("DROP FUNCTION persistent_jobs_insert")  # rolled back with the test
    with caplog.at_level("WARNING", logger="django_persistent_jobs.enqueue"):
        jobs = [enqueue("test.noop", {"n": n}, delay=n) for n in range(3)]
    for job in jobs:
        assert _fields(job) == _fields(PersistentJob.objects.get(id=job.id))
    warnings = [r for r in caplog.records if getattr(r, "event", "") == "insert_function_missing"]
    assert len(warnings) == 1 and "migrate" in warnings[0].getMessage()


@pytest.mark.django_db
def test_an_insert_function_dropped_under_a_running_process_says_to_migrate(
    insert_function_unknown: None,
) -> None:
    """The function was there at this process's first enqueue and is gone now (migrated back
    while the process ran): the error names the command, instead of PostgreSQL's "function
    does not exist"."""
    enqueue("test.noop")
    with connection.cursor() as cursor:
        cursor.execute("DROP FUNCTION persistent_jobs_insert")  # rolled back with the test
    needs_migrate = r"manage\.py migrate django_persistent_jobs"
    with pytest.raises(DjangoProgrammingError, match=needs_migrate), transaction.atomic():
        enqueue("test.noop")
    assert PersistentJob.objects.count() == 1


@pytest.mark.django_db
def test_a_plain_enqueue_takes_its_cursor_from_the_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whatever hooks ``connection.cursor()`` (a tenant router setting ``search_path``, the
    debug toolbar) sees the insert, as for any query."""
    made: list[Any] = []
    original = connection.cursor

    def cursor() -> Any:
        made.append(original())
        return made[-1]

    monkeypatch.setattr(connection, "cursor", cursor)
    job = enqueue("test.noop", {"n": 1})
    assert len(made) >= 1
    assert PersistentJob.objects.get(id=job.id).payload == {"n": 1}


@pytest.mark.django_db
def test_handler_options_then_settings_then_defaults() -> None:
    job = enqueue("core.enq.configured")
    assert (job.max_retries, job.timeout_seconds, job.queue, job.priority, job.dedup) == (
        5, 12.0, "emails", 7, "enqueue")
    with pj_settings(MAX_RETRIES=9, TIMEOUT=timedelta(minutes=2), DEFAULT_QUEUE="bulk",
                     DEDUP="replace"):
        merged = enqueue("test.noop")  # test.noop sets none of these
        own = enqueue("core.enq.configured")  # the handler's options win over settings
    assert (merged.max_retries, merged.timeout_seconds, merged.queue, merged.dedup) == (
        9, 120.0, "bulk", "replace")
    assert (own.max_retries, own.timeout_seconds, own.queue) == (5, 12.0, "emails")
    explicit = enqueue("core.enq.configured", max_retries=0, timeout=1.5, queue="q",
                       priority=-3, dedup="skip")
    assert (explicit.max_retries, explicit.timeout_seconds, explicit.queue, explicit.priority,
            explicit.dedup) == (0, 1.5, "q", -3, "skip")


@pytest.mark.django_db
def test_run_at_and_delay_set_next_run_at() -> None:
    now = db_now()  # inside the test's transaction, now() is fixed: exact comparisons hold
    at = datetime(2031, 5, 17, 12, 30, tzinfo=UTC)
    assert enqueue("test.noop", run_at=at).next_run_at == at
    assert enqueue("test.noop", delay=90).next_run_at == now + timedelta(seconds=90)
    assert enqueue("test.noop", delay=2.5).next_run_at == now + timedelta(seconds=2.5)
    assert enqueue("test.noop", delay=timedelta(hours=2)).next_run_at == now + timedelta(hours=2)
    assert enqueue("test.noop", delay=0).next_run_at == now
    past = now - timedelta(days=1)
    assert enqueue("test.noop", run_at=past).next_run_at == past  # due at once


@pytest.mark.django_db(transaction=True)
def test_delay_is_measured_by_the_database_clock() -> None:
    job = enqueue("test.noop", delay=600)
    with connection.cursor() as cursor:
        cursor.execute("SELECT next_run_at - now() FROM persistent_jobs WHERE id = %s", [job.id])
        remaining = cursor.fetchone()[0]
    assert timedelta(seconds=595) < remaining <= timedelta(seconds=600)


# ------------------------------------------------------------------ bad input

AWARE = datetime(2030, 1, 1, tzinfo=UTC)

BAD_ARGS: list[tuple[dict[str, Any], str]] = [
    ({"run_at": AWARE, "delay": 5}, "Give run_at or delay, not both"),
    ({"run_at": datetime(2030, 1, 1)}, "run_at must be timezone-aware"),
    ({"run_at": "2030-01-01T00:00:00Z"}, "run_at must be a datetime"),
    ({"delay": -1}, "delay must be >= 0"),
    ({"delay": timedelta(seconds=-5)}, "delay must be >= 0"),
    ({"delay": math.nan}, "delay must be >= 0"),
    ({"delay": "5"}, "delay must be a timedelta or seconds"),
    ({"delay": True}, "delay must be a timedelta or seconds"),
    ({"dedup": "sometimes"}, "dedup must be one of ['skip', 'enqueue', 'replace']"),
    ({"dedup_key": ""}, "dedup_key must be a string of 1..255 characters"),
    ({"dedup_key": "k" * 256}, "dedup_key must be a string of 1..255 characters"),
    ({"dedup_key": 42}, "dedup_key must be a string"),
    ({"queue": ""}, "queue must be a string of 1..100 characters"),
    ({"queue": "q" * 101}, "queue must be a string of 1..100 characters"),
    ({"queue": 3}, "queue must be a string"),
    ({"priority": 40000}, "priority must be an integer in -32768..32767"),
    ({"priority": 1.5}, "priority must be an integer"),
    ({"priority": True}, "priority must be an integer"),
    ({"max_retries": -1}, "max_retries must be an integer in 0..1000000"),
    ({"max_retries": "3"}, "max_retries must be an integer"),
    ({"timeout": 0}, "timeout must be a number of seconds > 0"),
    ({"timeout": -5}, "timeout must be a number of seconds > 0"),
    ({"timeout": math.inf}, "timeout must be a number of seconds > 0"),
    ({"timeout": "30"}, "timeout must be a number of seconds > 0"),
]


@pytest.mark.django_db
@pytest.mark.parametrize(("kwargs", "message"), BAD_ARGS,
                         ids=[f"{next(iter(k))}={v!r}"[:40] for k, _ in BAD_ARGS
                              for v in [next(iter(k.values()))]])
def test_bad_arguments_are_refused_before_anything_is_written(
    kwargs: dict[str, Any], message: str,
) -> None:
    with pytest.raises(EnqueueError) as info:
        enqueue("test.noop", {"a": 1}, **kwargs)
    assert message in str(info.value)
    assert info.value.code == "ENQUEUE_INVALID"
    with pytest.raises(EnqueueError) as many:
        enqueue_many([("test.noop", {}), {"job_type": "test.noop", **kwargs}])
    assert str(many.value).startswith("item 1: ") and message in str(many.value)
    assert PersistentJob.objects.count() == 0


@pytest.mark.django_db
def test_a_naive_run_at_is_refused_with_a_hint_that_works_without_time_zone_support(
    settings: Any,
) -> None:
    """With ``USE_TZ = False``, ``timezone.now()`` is naive itself: the message suggested it
    (and following the hint raised the same error). It names an aware value that works under
    either setting, and that value is accepted."""
    settings.USE_TZ = False
    with pytest.raises(EnqueueError) as info:
        enqueue("test.noop", run_at=datetime.now())
    message = str(info.value)
    assert "run_at must be timezone-aware" in message and "datetime.now(UTC)" in message
    assert "timezone.now() + timedelta(...) with USE_TZ = True" in message
    job = enqueue("test.noop", run_at=datetime.now(UTC) + timedelta(minutes=5))
    assert PersistentJob.objects.filter(id=job.id).exists()


@pytest.mark.django_db
@pytest.mark.parametrize("job_type", ["", None, 5])
def test_job_type_must_be_a_non_empty_string(job_type: Any) -> None:
    with pytest.raises(EnqueueError, match=r"job_type must be a string of 1\.\.200 characters"):
        enqueue(job_type)


@pytest.mark.django_db
def test_unknown_job_type_is_refused_unless_allowed() -> None:
    with pytest.raises(UnknownJobTypeError) as info:
        enqueue("core.nobody.handles.this", {"x": 1})
    message = str(info.value)
    assert info.value.code == "UNKNOWN_JOB_TYPE"
    assert "'core.nobody.handles.this'" in message and "test.noop" in message
    assert "@job_handler" in message and "ALLOW_UNREGISTERED" in message
    assert PersistentJob.objects.count() == 0

    with pj_settings(ALLOW_UNREGISTERED=True, MAX_RETRIES=2, TIMEOUT=40, DEFAULT_QUEUE="remote"):
        job = enqueue("core.nobody.handles.this", {"x": 1}, dedup_key="k")
        again = enqueue("core.nobody.handles.this", {"x": 2}, dedup_key="k")
    assert (job.max_retries, job.timeout_seconds, job.queue, job.dedup) == (2, 40.0, "remote",
                                                                           "skip")
    assert again.id == job.id  # global DEDUP default (skip) applies to unregistered types
    assert PersistentJob.objects.count() == 1


@pytest.mark.django_db
def test_handler_with_invalid_options_cannot_be_enqueued() -> None:
    with registry.isolated():
        job_handler("core.enq.broken", max_retries=-2)(lambda payload: None)
        with pytest.raises(ConfigurationError, match="max_retries must be an integer in 0"):
            enqueue("core.enq.broken")
    assert PersistentJob.objects.count() == 0


# ------------------------------------------------------------------ enqueue_many

@pytest.fixture
def insert_statements() -> Callable[[], list[int]]:
    """Count INSERT/COPY statements into persistent_jobs (rows per statement) with a
    statement-level trigger; created inside the test's transaction, so it rolls back with it."""
    with connection.cursor() as cursor:
        cursor.execute("""
            CREATE TABLE core_insert_statements (seq serial, n int);
            CREATE FUNCTION core_count_inserts() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                INSERT INTO core_insert_statements (n) SELECT count(*) FROM new_rows;
                RETURN NULL;
            END $$;
            CREATE TRIGGER core_count_inserts AFTER INSERT ON persistent_jobs
            REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT
            EXECUTE FUNCTION core_count_inserts();
        """)

    def counts() -> list[int]:
        with connection.cursor() as cursor:
            cursor.execute("SELECT n FROM core_insert_statements ORDER BY seq")
            return [row[0] for row in cursor.fetchall()]

    return counts


@pytest.mark.django_db
def test_enqueue_many_inserts_the_batch_in_one_statement(
    insert_statements: Callable[[], list[int]],
) -> None:
    items: list[Any] = [("test.noop", {"i": i}) for i in range(200)]
    items.append({"job_type": "core.enq.configured", "payload": {"d": 1}, "priority": 2,
                  "delay": 60})
    with CaptureQueriesContext(connection) as queries:
        jobs = enqueue_many(items, queue="batch")
    assert insert_statements() == [201]  # one statement wrote every row
    assert not [q for q in queries.captured_queries if "INSERT" in q["sql"].upper()]
    assert len(jobs) == 201
    assert [j.payload for j in jobs[:3]] == [{"i": 0}, {"i": 1}, {"i": 2}]
    stored = {j.id: j for j in PersistentJob.objects.all()}
    assert set(stored) == {j.id for j in jobs}
    assert all(stored[j.id].payload == j.payload and stored[j.id].queue == "batch" for j in jobs)
    assert all(stored[j.id].status == "pending" for j in jobs)
    last = stored[jobs[-1].id]
    assert (last.job_type, last.priority, last.max_retries, last.timeout_seconds) == (
        "core.enq.configured", 2, 5, 12.0)
    assert last.next_run_at == db_now() + timedelta(seconds=60)
    assert stored[jobs[0].id].next_run_at == db_now()
    # FIFO: ids (UUIDv7) follow the input order.
    assert [j.id for j in jobs] == sorted(j.id for j in jobs)
    # With dedup keys the batch still goes in one INSERT.
    keyed = enqueue_many([("test.noop", {"i": i}) for i in range(5)], dedup_key="same")
    assert len({j.id for j in keyed}) == 1
    assert insert_statements() == [201, 1]


def _prepared_inserts() -> int:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM pg_prepared_statements WHERE {PREPARED_INSERTS}")
        return int(cursor.fetchone()[0])


@pytest.mark.django_db
def test_enqueue_prepares_its_insert_when_told_to() -> None:
    """With ``PREPARED_STATEMENTS`` PostgreSQL parses and plans a lone enqueue's insert once per
    connection; without it (the default, safe behind any pooler) the insert goes as text every
    time. The job is the same either way."""
    with connection.cursor() as cursor:
        cursor.execute("DEALLOCATE ALL")  # what earlier tests prepared on this connection
    plain = enqueue("core.enq.configured", {"n": 1}, delay=5)  # the default
    assert _prepared_inserts() == 0
    with pj_settings(PREPARED_STATEMENTS=True):
        fast = [enqueue("core.enq.configured", {"n": 2}, delay=5) for _ in range(3)]
    assert _prepared_inserts() == 1  # one statement, prepared once, used three times
    stored = PersistentJob.objects.in_bulk([plain.id, *(j.id for j in fast)])
    for job in (plain, *fast):
        row = stored[job.id]
        assert (row.job_type, row.queue, row.priority, row.max_retries) == (
            "core.enq.configured", "emails", 7, 5)
        assert (job.created_at, job.next_run_at) == (row.created_at, row.next_run_at)
        assert job.next_run_at == db_now() + timedelta(seconds=5)
        assert job.payload == row.payload


@pytest.mark.django_db
def test_a_prepared_enqueue_reads_times_as_django_does_without_time_zone_support(
    prepared_inserts: None, settings: Any,
) -> None:
    """The prepared statement runs on a psycopg cursor of its own: with ``USE_TZ = False`` set
    after the connection opened, it must read naive times, as Django's cursors do."""
    settings.USE_TZ = False
    job = enqueue("test.noop", {"n": 1}, delay=30)
    assert _prepared_inserts() >= 1
    stored = PersistentJob.objects.get(id=job.id)
    assert job.next_run_at.tzinfo is None
    assert _fields(job) == _fields(stored)


@pytest.mark.django_db
def test_a_prepared_enqueue_follows_a_time_zone_change_after_an_earlier_enqueue(
    prepared_inserts: None, settings: Any,
) -> None:
    """The prepared insert's cursor is kept for the connection's life: one made while
    ``USE_TZ`` was on must not be the one that reads the times once it is off (it would read
    aware datetimes where Django reads naive ones)."""
    before = enqueue("test.noop", {"n": 0}, delay=30)
    assert before.next_run_at.tzinfo is not None
    settings.USE_TZ = False
    job = enqueue("test.noop", {"n": 1}, delay=30)
    assert _prepared_inserts() >= 1
    assert job.next_run_at.tzinfo is None
    assert _fields(job) == _fields(PersistentJob.objects.get(id=job.id))


@pytest.mark.django_db
def test_a_prepared_enqueue_follows_the_sessions_time_zone_without_time_zone_support(
    prepared_inserts: None, settings: Any,
) -> None:
    """With ``USE_TZ = False`` Django's own time zone stays None while ``TIME_ZONE`` changes
    the session's (``SET TIME ZONE``), in which naive times are read. The kept cursor of the
    prepared insert must read them in the session's zone of the moment, as a fresh ORM read
    does, not in the zone its loaders were made in."""
    settings.USE_TZ = False
    settings.TIME_ZONE = "America/New_York"
    enqueue("test.noop", {"n": 0}, delay=30)  # the cursor is made, and its loaders
    settings.TIME_ZONE = "Asia/Tokyo"
    job = enqueue("test.noop", {"n": 1}, delay=30)
    assert _prepared_inserts() >= 1
    assert _fields(job) == _fields(PersistentJob.objects.get(id=job.id))


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("prepared", [False, True])
@pytest.mark.parametrize("dedup_key", [None, "k"])
def test_an_enqueue_in_a_broken_transaction_says_so_as_django_does(
    prepared: bool, dedup_key: str | None,
) -> None:
    """An ORM error caught inside ``atomic()`` leaves the block broken: Django refuses every
    later query with ``TransactionManagementError``, which says what happened. A prepared
    enqueue runs on a cursor of its own and must refuse the same way, not send its statement
    into the aborted transaction and surface PostgreSQL's "current transaction is aborted"."""
    existing = enqueue("test.noop", {"n": 0})
    with pj_settings(PREPARED_STATEMENTS=prepared):
        try:
            with transaction.atomic():
                with pytest.raises(IntegrityError):
                    PersistentJob.objects.create(id=existing.id, job_type="test.noop")
                with pytest.raises(transaction.TransactionManagementError):
                    enqueue("test.noop", {"n": 1}, dedup_key=dedup_key)
        finally:
            enqueuing._UNPREPARED.clear()
    assert list(PersistentJob.objects.values_list("id", flat=True)) == [existing.id]


def _foreign_statement_under_our_name() -> list[str]:
    """Another client's statement under the name psycopg uses for the insert."""
    names = lose_prepared_inserts()
    prepare_foreign_statements(names)
    return names


@pytest.fixture
def prepared_inserts() -> Iterator[None]:
    """``PREPARED_STATEMENTS`` on, and the process-wide "this alias lost its prepared insert"
    memory forgotten afterwards."""
    with pj_settings(PREPARED_STATEMENTS=True):
        yield
    enqueuing._UNPREPARED.clear()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("loss", [lose_prepared_inserts, _foreign_statement_under_our_name])
def test_a_lost_prepared_insert_in_autocommit_is_sent_as_text_and_loses_nothing(
    prepared_inserts: None, caplog: pytest.LogCaptureFixture, loss: Callable[[], list[str]],
) -> None:
    """In autocommit the failed prepared insert wrote nothing and aborted nothing: the same
    insert goes again as text, the caller gets its job, and the process stops preparing (one
    warning naming the setting)."""
    first = enqueue("test.noop", {"n": 1})
    loss()
    with caplog.at_level("WARNING", logger="django_persistent_jobs.enqueue"):
        second = enqueue("test.noop", {"n": 2})
        third = enqueue("test.noop", {"n": 3})
    stored = PersistentJob.objects.in_bulk([first.id, second.id, third.id])
    assert [stored[j.id].payload for j in (first, second, third)] == [{"n": 1}, {"n": 2}, {"n": 3}]
    assert PersistentJob.objects.count() == 3  # nothing twice
    warnings = [r for r in caplog.records if getattr(r, "event", "") == "prepared_statements_off"]
    assert len(warnings) == 1
    assert "PREPARED_STATEMENTS" in warnings[0].getMessage()
    if loss is lose_prepared_inserts:
        assert _prepared_inserts() == 0  # nothing prepared again after the loss


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("dedup", "in_atomic"), [
    (Dedup.REPLACE, False), (Dedup.REPLACE, True), (Dedup.SKIP, False)])
def test_a_lost_prepared_insert_of_a_keyed_enqueue_is_sent_as_text(
    prepared_inserts: None, dedup: Dedup, in_atomic: bool,
) -> None:
    """A Replace enqueue runs its insert in a savepoint (inside the caller's transaction) or in
    a transaction of its own (in autocommit): the loss aborts only that, and the call still
    returns its job; the caller's transaction goes on and commits. (Skip inserts in the
    caller's transaction itself, where the loss is the caller's to retry, as for an unkeyed
    enqueue.)"""
    for key in ("k0", "k00"):
        enqueue("test.noop", {"n": 0}, dedup_key=key, dedup=dedup)  # prepared, plain and keyed
    first = enqueue("test.noop", {"n": 1}, dedup_key="k1", dedup=dedup)
    lose_prepared_inserts()
    with transaction.atomic() if in_atomic else contextlib.nullcontext():
        PersistentJob.objects.filter(id=first.id).update(priority=3)
        second = enqueue("test.noop", {"n": 2}, dedup_key="k2", dedup=dedup)
        third = enqueue("test.noop", {"n": 3}, dedup_key="k1", dedup=dedup)
    assert enqueuing._UNPREPARED  # the loss was met, not dodged
    assert PersistentJob.objects.get(id=second.id).payload == {"n": 2}
    assert PersistentJob.objects.get(id=first.id).priority == 3
    if dedup is Dedup.REPLACE:
        assert PersistentJob.objects.get(id=first.id).status == JobStatus.CANCELLED
        assert PersistentJob.objects.get(id=third.id).payload == {"n": 3}
    else:
        assert third.id == first.id


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("how", ["atomic", "autocommit off"])
def test_a_lost_prepared_insert_inside_a_transaction_raises_a_clear_error_and_the_retry_works(
    prepared_inserts: None, how: str,
) -> None:
    """Inside the caller's transaction the error has aborted it: ``enqueue()`` raises a
    ``ProgrammingError`` that says what to set, the whole transaction rolls back (nothing of
    it half-kept), and the caller's retry commits, sent as text. Also when the caller turned
    autocommit off by hand instead of using ``atomic()``."""
    enqueue("test.noop", {"n": 0})
    lose_prepared_inserts()
    if how == "atomic":
        with pytest.raises(PreparedStatementLostError) as caught, transaction.atomic():
            PersistentJob.objects.filter(payload={"n": 0}).update(priority=9)
            enqueue("test.noop", {"n": 1})
    else:
        transaction.set_autocommit(False)
        try:
            PersistentJob.objects.filter(payload={"n": 0}).update(priority=9)
            with pytest.raises(PreparedStatementLostError) as caught:
                enqueue("test.noop", {"n": 1})
            transaction.rollback()
        finally:
            transaction.set_autocommit(True)
    assert isinstance(caught.value, DjangoProgrammingError)
    assert "PREPARED_STATEMENTS" in str(caught.value)
    assert "pooler" in str(caught.value)
    assert PersistentJob.objects.get(payload={"n": 0}).priority == 0  # rolled back as a whole
    assert not PersistentJob.objects.filter(payload={"n": 1}).exists()
    with transaction.atomic():
        PersistentJob.objects.filter(payload={"n": 0}).update(priority=9)
        retried = enqueue("test.noop", {"n": 1})
    assert PersistentJob.objects.get(id=retried.id).payload == {"n": 1}
    assert PersistentJob.objects.get(payload={"n": 0}).priority == 9


@pytest.mark.django_db(transaction=True)
def test_statements_that_reset_the_session_are_not_taken_for_a_lost_insert(
    prepared_inserts: None, caplog: pytest.LogCaptureFixture,
) -> None:
    """``DISCARD ALL`` (a pooler's reset between clients in session mode) and DDL on the table
    are seen by psycopg, which prepares the insert again: no loss, no warning, and a column
    type change does not leave a stale plan behind."""
    enqueue("test.noop", {"n": 1})
    with caplog.at_level("WARNING", logger="django_persistent_jobs.enqueue"):
        with connection.cursor() as cursor:
            cursor.execute("DISCARD ALL")
        enqueue("test.noop", {"n": 2})
        with connection.cursor() as cursor:
            cursor.execute("ALTER TABLE persistent_jobs ALTER COLUMN priority TYPE integer")
        try:
            enqueue("test.noop", {"n": 3})
        finally:
            with connection.cursor() as cursor:
                cursor.execute("ALTER TABLE persistent_jobs ALTER COLUMN priority TYPE smallint")
        enqueue("test.noop", {"n": 4})
    assert not enqueuing._UNPREPARED
    assert not [r for r in caplog.records if getattr(r, "event", "") == "prepared_statements_off"]
    assert _prepared_inserts() == 1  # prepared again after each reset
    assert PersistentJob.objects.count() == 4


@pytest.mark.django_db(transaction=True)
def test_other_database_errors_of_the_prepared_insert_are_not_taken_for_a_lost_statement(
    prepared_inserts: None,
) -> None:
    """Only a missing (or foreign) prepared statement turns preparing off: a constraint
    violation is the caller's error and goes up unchanged, preparing stays on."""
    job = enqueue("test.noop", {"n": 1})
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE persistent_jobs ADD CONSTRAINT pj_test_no_n2 "
                       "CHECK (payload <> '{\"n\": 2}'::jsonb) NOT VALID")
    try:
        with pytest.raises(IntegrityError):
            enqueue("test.noop", {"n": 2})
    finally:
        with connection.cursor() as cursor:
            cursor.execute("ALTER TABLE persistent_jobs DROP CONSTRAINT pj_test_no_n2")
    assert not enqueuing._UNPREPARED
    assert PersistentJob.objects.filter(id=job.id).exists()


@pytest.mark.django_db
def test_enqueue_many_stores_text_and_times_as_given() -> None:
    """The batch is written in COPY's text format, where a backslash, tab, newline or
    carriage return means something: every such character arrives as it was sent."""
    tricky = "a\\b\tc\nd\re \\N é ✓ \u2028"
    paris = timezone(timedelta(hours=1))
    when = datetime(2031, 5, 4, 3, 2, 1, 123456, tzinfo=paris)
    jobs = enqueue_many([
        {"job_type": "test.noop", "payload": {"text": tricky, "list": [tricky, 1.5, None]},
         "queue": "q\\1", "tenant": tricky, "dedup": "enqueue", "dedup_key": tricky},
        {"job_type": "test.noop", "payload": tricky, "run_at": when},
        {"job_type": "test.noop", "payload": None, "delay": 1.5},
    ])
    rows = {j.id: j for j in PersistentJob.objects.filter(id__in=[j.id for j in jobs])}
    first, second, third = (rows[j.id] for j in jobs)
    assert first.payload == {"text": tricky, "list": [tricky, 1.5, None]}
    assert (first.queue, first.tenant, first.dedup_key) == ("q\\1", tricky, tricky)
    assert second.payload == tricky and second.next_run_at == when
    assert third.payload == {} and third.next_run_at == db_now() + timedelta(seconds=1.5)
    assert first.next_run_at == db_now()


@pytest.mark.django_db
def test_enqueue_many_works_without_time_zone_support(settings: Any) -> None:
    """With ``USE_TZ = False`` the database clock reads as a naive datetime, which the batch
    writes as it is (read back in the session's time zone)."""
    settings.USE_TZ = False
    jobs = enqueue_many([("test.noop", {"n": 1}), {"job_type": "test.noop", "delay": 60}])
    rows = {j.id: j for j in PersistentJob.objects.filter(id__in=[j.id for j in jobs])}
    now, later = rows[jobs[0].id], rows[jobs[1].id]
    assert now.next_run_at.tzinfo is None
    assert later.next_run_at - now.next_run_at == timedelta(seconds=60)
    assert abs(now.next_run_at - now.created_at) < timedelta(seconds=1)


@pytest.mark.django_db
def test_enqueue_many_validates_every_item_before_writing() -> None:
    items: list[Any] = [("test.noop", {"i": i}) for i in range(10)]
    items.insert(7, ("test.noop", {"when": datetime(2030, 1, 1, tzinfo=UTC)}))
    with CaptureQueriesContext(connection) as queries, pytest.raises(EnqueueError) as info:
        enqueue_many(items)
    assert str(info.value).startswith("item 7: payload['when'] is a datetime")
    assert info.value.code == "PAYLOAD_INVALID"
    assert queries.captured_queries == []
    with pytest.raises(UnknownJobTypeError, match="item 2: No handler"):
        enqueue_many([("test.noop", {}), ("test.noop", {}), ("core.nope", {})])
    assert PersistentJob.objects.count() == 0


@pytest.mark.django_db
def test_enqueue_many_rejects_malformed_items() -> None:
    with pytest.raises(EnqueueError, match="has no 'job_type'"):
        enqueue_many([{"payload": {}}])
    with pytest.raises(EnqueueError, match=r"unknown keys \['colour'\]"):
        enqueue_many([{"job_type": "test.noop", "colour": "red"}])
    with pytest.raises(EnqueueError, match="takes \\(job_type, payload\\) tuples"):
        enqueue_many(["test.noop"])
    assert enqueue_many([]) == []
    assert PersistentJob.objects.count() == 0


@pytest.mark.django_db(transaction=True)
def test_enqueue_many_joins_the_callers_transaction() -> None:
    with pytest.raises(Rollback), transaction.atomic():
        enqueue_many([("test.noop", {"i": i}) for i in range(20)])
        assert PersistentJob.objects.count() == 20
        raise Rollback
    assert PersistentJob.objects.count() == 0


@pytest.mark.django_db(transaction=True)
def test_enqueue_many_raises_djangos_database_errors() -> None:
    """The bulk insert (COPY, on psycopg's own cursor) fails as any Django query would: a lock
    timeout (here the table is locked by another session) is ``django.db.OperationalError``,
    which a caller's ``except DatabaseError`` or retry code catches, not a psycopg error."""
    from django.db import OperationalError as DjangoOperationalError

    from tests.core_support import raw_connection

    with raw_connection(autocommit=False) as holder:
        holder.execute("LOCK TABLE persistent_jobs IN ACCESS EXCLUSIVE MODE")
        with pytest.raises(DjangoOperationalError, match="lock timeout"), transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL lock_timeout = '100ms'")
            enqueue_many([("test.noop", {"n": n}) for n in range(3)])
        holder.rollback()
    assert enqueue_many([("test.noop", {"n": 9})])[0].status == JobStatus.PENDING


@pytest.mark.django_db
def test_enqueue_many_delays_cross_a_daylight_saving_change_without_time_zone_support(
    settings: Any,
) -> None:
    """With ``USE_TZ = False`` the database's ``now()`` reads as a naive local time: a delay
    added to that in Python is wall-clock arithmetic, an hour off across a daylight-saving
    change. ``enqueue_many`` must agree with ``enqueue`` (which adds the delay on the server)
    to the second; both run in this test's one transaction, so they share ``now()``."""
    from zoneinfo import ZoneInfo

    settings.USE_TZ = False
    settings.TIME_ZONE = "America/New_York"
    zone = ZoneInfo("America/New_York")
    start = datetime.now(UTC)
    days = next(d for d in range(1, 367)
                if (start + timedelta(days=d)).astimezone(zone).utcoffset()
                != start.astimezone(zone).utcoffset())
    delay = timedelta(days=days + 1)  # past the next change of the clocks, whenever this runs
    one = enqueue("test.noop", {"n": 1}, delay=delay)
    [many] = enqueue_many([("test.noop", {"n": 2})], delay=delay)
    with connection.cursor() as cursor:
        cursor.execute("SELECT extract(epoch FROM (SELECT next_run_at FROM persistent_jobs "
                       "WHERE id = %s) - (SELECT next_run_at FROM persistent_jobs WHERE id = %s))",
                       [many.id, one.id])
        (apart,) = cursor.fetchone()
    assert abs(float(apart)) < 1, apart


# A UTC offset PostgreSQL cannot read (beyond +-15:59, or with seconds or microseconds, which
# psycopg sends as they are) made the insert fail with "time zone displacement out of range",
# which also broke the caller's transaction. The instant is what counts: it is sent in UTC.
ODD_OFFSETS = [
    timezone(timedelta(hours=16)),
    timezone(timedelta(hours=-16)),
    timezone(timedelta(hours=23, minutes=59)),
    timezone(timedelta(hours=5, minutes=30, seconds=15, microseconds=7)),
]


@pytest.mark.django_db
@pytest.mark.parametrize("tz", ODD_OFFSETS, ids=str)
def test_a_run_at_with_any_utc_offset_is_stored_as_its_instant(tz: timezone) -> None:
    when = datetime(2031, 1, 1, 12, tzinfo=tz)
    with transaction.atomic():
        plain = enqueue("test.noop", run_at=when)
        keyed = enqueue("test.noop", run_at=when, dedup_key="odd-offset")
        many = enqueue_many([("test.noop", {})], run_at=when)
        many_keyed = enqueue_many([{"job_type": "test.noop", "dedup_key": "odd-many"}],
                                  run_at=when)
        # The caller's transaction is still usable.
        assert PersistentJob.objects.count() == 4
    for job in (plain, keyed, *many, *many_keyed):
        assert PersistentJob.objects.get(id=job.id).next_run_at == when
