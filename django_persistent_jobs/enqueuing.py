"""``enqueue()`` and ``enqueue_many()``: the only ways jobs are created.

Both run on the caller's connection, so they join the caller's ``transaction.atomic()`` block:
if it rolls back, the job never existed and no wake-up is sent (the NOTIFY comes from an insert
trigger and PostgreSQL delivers notifications only on commit). Everything is validated before the
first statement, so bad input writes nothing.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import psycopg
from django.db import (
    DEFAULT_DB_ALIAS,
    DatabaseError,
    OperationalError,
    ProgrammingError,
    connections,
    transaction,
)
from django.db.models import DEFERRED, Q
from django.db.models.base import ModelState
from django.db.models.signals import post_init, pre_init
from django.db.models.sql import Query

from . import bounds, conf, signals
from .errors import (
    ConfigurationError,
    DedupKeyTakenError,
    EnqueueError,
    PayloadError,
    PreparedStatementLostError,
    UnknownJobTypeError,
)
from .handlers import HandlerSpec, registry
from .ids import UUID7Batch, uuid7
from .models import JOB_COLUMNS, JOB_COLUMNS_SQL, WAITING_DEDUP, PersistentJob, job_from_row
from .payload import PayloadLimits, prepare_payload
from .runner.db import error_line, is_lost_prepared_statement
from .runner.store import prepared
from .types import Dedup

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.db.backends.utils import CursorWrapper as Cursor

logger = logging.getLogger("django_persistent_jobs.enqueue")

_INSERT_COLUMNS = (
    "id", "job_type", "payload", "queue", "priority", "max_retries", "next_run_at",
    "timeout_seconds", "dedup_key", "dedup", "schedule", "tenant",
)
_INSERT_COLUMNS_SQL = ", ".join(_INSERT_COLUMNS)
_NEXT_RUN = "COALESCE(%s::timestamptz, now() + %s::float8 * interval '1 second')"


def _condition_sql(condition: Q) -> str:
    """``condition`` as the SQL Django writes for it in a partial index, constants inlined.

    The dedup statements must spell the waiting-job predicate exactly as the unique index
    ``pj_dedup_waiting_uniq`` does (``ON CONFLICT ... WHERE`` infers the index from it), so both
    are compiled from the one ``Q`` in ``models``.
    """
    query = Query(model=PersistentJob, alias_cols=False)
    where = query.build_where(condition)
    connection = connections[DEFAULT_DB_ALIAS]
    sql, params = where.as_sql(query.get_compiler(connection=connection), connection)
    literals = []
    for param in params:
        if not isinstance(param, str):
            raise TypeError(f"cannot inline {param!r} into the dedup predicate")
        literals.append("'" + param.replace("'", "''").replace("%", "%%") + "'")
    return str(sql % tuple(literals))


_WAITING_KEY = _condition_sql(WAITING_DEDUP)
_ON_CONFLICT = f"ON CONFLICT (job_type, dedup_key) WHERE {_WAITING_KEY} DO NOTHING"
#: Takes the enqueue turn of each ``(job_type, dedup_key)``, in one order for every session (so
#: two batches sharing keys cannot deadlock each other). Volatile functions in the select list
#: run after ORDER BY, so the locks are taken in that order.
_LOCK_KEYS = (
    "SELECT pg_advisory_xact_lock(hashtext(u.t), hashtext(u.k)) FROM unnest(%s::text[], "
    "%s::text[]) AS u(t, k) ORDER BY hashtext(u.t), hashtext(u.k)"
)


@dataclass(slots=True, eq=False)
class _Prepared:
    """One validated job, ready to insert. (Not frozen: a frozen dataclass's ``__init__`` sets
    each field through ``object.__setattr__``, which was a sixth of ``enqueue_many``'s time.)"""

    id: uuid.UUID
    job_type: str
    payload: Any
    payload_json: str
    queue: str
    priority: int
    max_retries: int
    run_at: datetime | None
    delay: float
    timeout: float
    dedup_key: str | None
    dedup: Dedup
    schedule_json: str | None
    tenant: str | None
    #: Enqueued for a caller confined to ``tenant`` (``enqueue_as_tenant``): its dedup key must
    #: not meet an active job outside the tenant.
    confined: bool = False

    def params(self) -> list[Any]:
        return [
            self.id, self.job_type, self.payload_json, self.queue, self.priority,
            self.max_retries, self.run_at, self.delay, self.timeout, self.dedup_key,
            self.dedup.value, self.schedule_json, self.tenant,
        ]


def _spec_for(job_type: Any) -> HandlerSpec | None:
    _require(bounds.job_type_problem(job_type))
    return registry.resolve(
        job_type, missing=UnknownJobTypeError, invalid=ConfigurationError,
        hint=". Register it with @job_handler in an installed app's jobs.py, or set "
        "PERSISTENT_JOBS['ALLOW_UNREGISTERED'] = True if another service runs it.",
    )


def _require(problem: str | None) -> None:
    if problem is not None:
        raise EnqueueError(problem)


@dataclass(frozen=True)
class _Options:
    """Everything about a job except its payload and dedup key, resolved and validated."""

    spec: HandlerSpec | None
    queue: str
    priority: int
    max_retries: int
    timeout: float
    run_at: datetime | None
    delay: float
    dedup: Dedup
    tenant: str | None


def _resolve_options(
    job_type: str, *, run_at: datetime | None = None, delay: timedelta | float | None = None,
    dedup: Dedup | str | None = None, max_retries: int | None = None,
    timeout: float | timedelta | None = None, queue: str | None = None,
    priority: int | None = None, tenant: str | None = None,
) -> _Options:
    """Fill options left as ``None`` from the handler, then settings, and check every value
    against ``bounds`` (the same rules the system check applies to handlers and settings)."""
    spec = _spec_for(job_type)
    if run_at is not None and delay is not None:
        raise EnqueueError("Give run_at or delay, not both.")
    if run_at is not None:
        _require(bounds.run_at_problem(run_at))
        # Sent in UTC: only the instant matters, and PostgreSQL cannot read every offset a
        # Python datetime may carry (beyond +-15:59, or with seconds), which would fail the
        # insert and abort the caller's transaction.
        run_at = run_at.astimezone(UTC)
    delay_s = 0.0
    if delay is not None:
        _require(bounds.delay_problem(delay))
        delay_s = bounds.seconds_of(delay) or 0.0
    if dedup is None:
        dedup = spec.effective_dedup() if spec else conf.settings.DEDUP
    _require(bounds.dedup_problem(dedup))
    if max_retries is None:
        max_retries = spec.effective_max_retries() if spec else conf.settings.MAX_RETRIES
    _require(bounds.max_retries_problem(max_retries))
    if timeout is None:
        timeout = spec.effective_timeout() if spec else conf.settings.TIMEOUT
    _require(bounds.timeout_problem(timeout))
    if queue is None:
        queue = spec.effective_queue() if spec else conf.settings.DEFAULT_QUEUE
    _require(bounds.queue_problem(queue))
    if priority is None:
        priority = spec.priority if spec else 0
    _require(bounds.priority_problem(priority))
    _require(bounds.tenant_problem(tenant))
    return _Options(spec=spec, queue=queue, priority=priority, max_retries=max_retries,
                    timeout=bounds.seconds_of(timeout) or 0.0, run_at=run_at, delay=delay_s,
                    dedup=Dedup(dedup), tenant=tenant)


def _prepare_with(
    job_type: str, payload: Any, options: _Options, dedup_key: str | None,
    schedule: Mapping[str, Any] | None = None, limits: PayloadLimits | None = None,
    new_id: Callable[[], uuid.UUID] = uuid7,
) -> _Prepared:
    _require(bounds.dedup_key_problem(dedup_key))
    stored, text = prepare_payload({} if payload is None else payload, limits)
    spec = options.spec
    if spec is not None and spec.validator is not None:
        try:
            spec.validator(stored)
        except Exception as exc:
            raise PayloadError(
                f"payload rejected by the validator of {job_type!r}: {exc}"
            ) from exc
    return _Prepared(
        id=new_id(), job_type=job_type, payload=stored,
        payload_json=text, queue=options.queue,
        priority=options.priority, max_retries=options.max_retries, run_at=options.run_at,
        delay=options.delay, timeout=options.timeout, dedup_key=dedup_key, dedup=options.dedup,
        schedule_json=json.dumps(schedule) if schedule is not None else None,
        tenant=options.tenant,
    )


def _prepare(
    job_type: str, payload: Any, *, dedup_key: str | None = None,
    schedule: Mapping[str, Any] | None = None, **options: Any,
) -> _Prepared:
    return _prepare_with(job_type, payload, _resolve_options(job_type, **options), dedup_key,
                         schedule)


def _values_sql() -> str:
    return f"%s, %s, %s::jsonb, %s, %s, %s, {_NEXT_RUN}, %s, %s, %s, %s::jsonb, %s"


def _select_active(cursor: Cursor, job_type: str, dedup_key: str) -> tuple[Any, ...] | None:
    cursor.execute(
        f"SELECT {JOB_COLUMNS_SQL} FROM persistent_jobs WHERE job_type = %s AND dedup_key = %s "
        "AND status IN ('pending', 'failed', 'running') AND NOT (dedup = 'enqueue') "
        "ORDER BY (status = 'running') DESC, id LIMIT 1",
        [job_type, dedup_key],
    )
    row: tuple[Any, ...] | None = cursor.fetchone()
    return row


_INSERT_VALUES = f"INSERT INTO persistent_jobs ({_INSERT_COLUMNS_SQL}) VALUES ({_values_sql()})"
_INSERT_KEYED = f"{_INSERT_VALUES} {_ON_CONFLICT} RETURNING {JOB_COLUMNS_SQL}"


def _insert_one(cursor: Cursor, job: _Prepared) -> tuple[Any, ...] | None:
    """Insert a keyed job (Skip or Replace); ``None`` means a concurrent waiting duplicate won
    the unique index."""
    return _execute_insert(cursor, _INSERT_KEYED, job.params())


#: The insert of a job that takes no dedup turn: one call of the PL/pgSQL function of
#: migration 0012, whose ``INSERT`` PostgreSQL plans once per server session (a text insert is
#: parsed and planned on every call). The casts make the call resolve whether parameters are
#: bound by Django (as literals) or by the server.
_INSERT_TYPES = ("uuid", "text", "jsonb", "text", "integer", "integer", "timestamptz", "float8",
                 "float8", "text", "text", "jsonb", "text")  # ``_Prepared.params()``, in order
_INSERT_CALL = f"SELECT persistent_jobs_insert({', '.join(f'%s::{t}' for t in _INSERT_TYPES)})"
_INSERT_FUNCTION = f"persistent_jobs_insert({', '.join(_INSERT_TYPES)})"
#: The same insert as text, returning the same array: for a database without the function
#: (its migrations were not run, as with pytest-django's ``--nomigrations``).
_INSERT_TEXT = f"{_INSERT_VALUES} RETURNING ARRAY[next_run_at, created_at]"
#: Whether each database (alias, name) has the function, looked up by this process's first
#: plain enqueue there.
_HAS_INSERT_FUNCTION: dict[tuple[str, str], bool] = {}


def _has_insert_function(cursor: Cursor, alias: str) -> bool:
    key = (alias, str(connections[alias].settings_dict.get("NAME")))
    known = _HAS_INSERT_FUNCTION.get(key)
    if known is None:
        cursor.execute("SELECT to_regprocedure(%s) IS NOT NULL", [_INSERT_FUNCTION])
        row = cursor.fetchone()
        known = _HAS_INSERT_FUNCTION[key] = bool(row and row[0])
        if not known:
            logger.warning(
                "enqueue(): database %r has no function persistent_jobs_insert() (migration "
                "0012 of django_persistent_jobs has not run there, for example tests run with "
                "--nomigrations); this process inserts jobs with a plain INSERT instead, which "
                "PostgreSQL plans on every call. Run `python manage.py migrate`.", alias,
                extra={"event": "insert_function_missing", "alias": alias},
            )
    return known


def _insert_plain(cursor: Cursor, job: _Prepared, alias: str) -> PersistentJob:
    """Insert a job without a dedup turn and return it, built from what was sent plus the two
    values the server chose (the due time and the creation time): fetching the whole row back
    cost as much client time as the rest of ``enqueue()``. (JSON values are those the payload
    encodes to, compared equal to a fresh read's; their keys keep the caller's order.)"""
    sql = _INSERT_CALL if _has_insert_function(cursor, alias) else _INSERT_TEXT
    try:
        row = _execute_insert(cursor, sql, job.params())
    except ProgrammingError as exc:
        missing = getattr(exc.__cause__, "sqlstate", None) == "42883"
        if missing and "persistent_jobs_insert" in str(exc):
            raise ProgrammingError(
                f"enqueue() needs the function persistent_jobs_insert() in database {alias!r}, "
                "which was there when this process first enqueued: run `python manage.py "
                "migrate django_persistent_jobs` (migration 0012 adds it), or restart the "
                "process if it was removed on purpose."
            ) from exc
        raise
    assert row is not None
    due, created = row[0]
    values = _known_fields(job, json.loads(job.payload_json))
    values.update({
        "schedule": None if job.schedule_json is None else json.loads(job.schedule_json),
        "next_run_at": due, "locked_by": None, "locked_at": None, "lock_token": None,
        "last_error": "", "last_error_code": "", "progress": None, "handbacks": 0,
        "result": None, "cancel_requested": False, "created_at": created, "updated_at": created,
        "finished_at": None,
    })
    return _loaded(values, alias)


def _execute_insert(cursor: Cursor, sql: str, params: list[Any]) -> tuple[Any, ...] | None:
    """Run one of ``enqueue()``'s inserts and return its row, as a prepared statement when
    ``PREPARED_STATEMENTS`` is on (parsed once per connection instead of on every call)."""
    if conf.settings.PREPARED_STATEMENTS and cursor.db.alias not in _UNPREPARED:
        try:
            with prepared(cursor) as fast:
                fast.execute(sql, params, prepare=True)
                return fast.fetchone()
        except DatabaseError as exc:
            if not is_lost_prepared_statement(exc):
                raise
            _stop_preparing(cursor.db, exc)
    cursor.execute(sql, params)
    row: tuple[Any, ...] | None = cursor.fetchone()
    return row


#: Database aliases whose connections lost a prepared insert (see ``_stop_preparing``): their
#: ``enqueue()`` sends the insert unprepared from then on, in this process.
_UNPREPARED: set[str] = set()


def _stop_preparing(db: BaseDatabaseWrapper, exc: DatabaseError) -> None:
    """The connection lost the prepared insert: a pooler in transaction mode that does not keep
    prepared statements moved it to another server session (PgBouncer before 1.21, or with
    ``max_prepared_statements = 0``). Stop preparing on this alias, in this process.

    In autocommit the failed statement took nothing with it, so the caller's insert is simply
    sent again unprepared. Inside a transaction the error aborted it (or the savepoint it runs
    in), so it is raised, saying what to change: a dedup round (``_round``) and a schedule's
    run (``schedules.firing.insert_run``) own a savepoint or transaction around their insert
    and go again once it has rolled back; in the caller's own transaction, the caller's retry
    goes unprepared.
    """
    first = db.alias not in _UNPREPARED
    _UNPREPARED.add(db.alias)
    if first:
        logger.warning(
            "enqueue(): the database connection %r lost its prepared insert (%s); a connection "
            "pooler in transaction mode that does not keep prepared statements does this. "
            "Inserts go unprepared from now on in this process; set "
            "PERSISTENT_JOBS['PREPARED_STATEMENTS'] = False to say so up front.", db.alias,
            error_line(exc),
            extra={"event": "prepared_statements_off", "alias": db.alias},
        )
    if not db.get_autocommit():  # (an atomic block, or autocommit turned off by hand)
        raise PreparedStatementLostError(
            f"enqueue() could not run its prepared insert on database {db.alias!r} ({exc}), "
            "and the error aborted the surrounding transaction (or savepoint). A "
            "connection pooler in transaction mode that does not keep prepared statements "
            "(PgBouncer before 1.21, or with max_prepared_statements = 0) causes this. "
            "Retry the transaction (this process now sends the insert unprepared), and set "
            "PERSISTENT_JOBS['PREPARED_STATEMENTS'] = False for this database."
        ) from exc


_CANCEL_WAITING = (
    "UPDATE persistent_jobs SET status = 'cancelled', last_error_code = 'REPLACED', "
    "last_error = 'replaced by a newer job with the same dedup key', finished_at = now(), "
    f"updated_at = now() WHERE job_type = %s AND dedup_key = ANY(%s) AND {_WAITING_KEY}"
)


def _cancel_waiting_duplicates(cursor: Cursor, job_type: str, keys: list[str],
                               tenant: str | None = None) -> int:
    """``tenant``: cancel only that tenant's duplicates (a confined Replace)."""
    if tenant is None:
        cursor.execute(_CANCEL_WAITING, [job_type, keys])
    else:
        cursor.execute(f"{_CANCEL_WAITING} AND tenant = %s", [job_type, keys, tenant])
    return int(cursor.rowcount)


#: An active job holding the key with its dedup enforced, owned by another tenant or by none.
_FOREIGN_HOLDER = (
    "SELECT 1 FROM persistent_jobs WHERE job_type = %s AND dedup_key = %s "
    "AND status IN ('pending', 'failed', 'running') AND NOT (dedup = 'enqueue') "
    "AND tenant IS DISTINCT FROM %s LIMIT 1"
)


def _refuse_foreign_holder(cursor: Cursor, job: _Prepared) -> None:
    """Raise ``DedupKeyTakenError`` when the key of a confined job is held outside its tenant.

    Checked at the start of every round, and a confined Replace cancels only its own tenant's
    duplicates: a foreign job that becomes waiting after this check makes the round's insert
    lose on the unique index, and the next round's check refuses. So a confined caller is never
    handed another tenant's job nor cancels one, whatever runs concurrently.
    """
    cursor.execute(_FOREIGN_HOLDER, [job.job_type, job.dedup_key, job.tenant])
    if cursor.fetchone() is not None:
        raise DedupKeyTakenError(
            f"dedup_key {job.dedup_key!r} is held by an active {job.job_type!r} job outside "
            f"tenant {job.tenant!r}; nothing was enqueued. Use another key (for example one "
            "that starts with the tenant's name)."
        )


def lock_dedup_keys(cursor: Cursor, keys: Iterable[tuple[str, str]]) -> None:
    """Wait for the enqueue turn of each ``(job_type, dedup_key)`` and hold it until the
    transaction ends.

    A Skip or Replace enqueue that lost a race for its key (its insert met another one's row)
    takes the key's turn this way and then settles, instead of racing again and again. The lock
    is a transaction-scoped advisory lock on the key's hash (two ``int4`` keys: a space apart
    from single-key advisory locks); a hash collision only makes two keys take turns. Only keys
    that were actually contended are locked, so a transaction enqueuing many keys does not fill
    PostgreSQL's lock table.
    """
    pairs = sorted(set(keys))
    if pairs:
        cursor.execute(_LOCK_KEYS, [[t for t, _ in pairs], [k for _, k in pairs]])


class _Contended(Exception):
    """An optimistic Replace lost its race for these keys; undo it and take their turns."""

    def __init__(self, keys: list[tuple[str, str]]) -> None:
        super().__init__(keys)
        self.keys = keys


def _enqueue_prepared(job: _Prepared, alias: str) -> tuple[PersistentJob, bool]:
    """Return ``(job, created)``; ``created`` is False when Skip returned an existing job."""
    if job.dedup_key is None or job.dedup is Dedup.ENQUEUE:
        with connections[alias].cursor() as cursor:
            return _insert_plain(cursor, job, alias), True
    tried = False
    if job.dedup is Dedup.SKIP:
        # Uncontended, Skip is one SELECT, or one INSERT: no transaction of its own needed. A
        # lost race leaves nothing behind (the insert did nothing), so it can wait its turn.
        with connections[alias].cursor() as cursor:
            settled = _attempt(cursor, job, alias)
        if settled is not None:
            return settled
        tried = True
    elif not connections[alias].in_atomic_block:
        # Autocommit: Replace's cancel and insert are a transaction of their own, and a lost
        # round simply rolls it back (no savepoint needed, as in ``_round``).
        settled = _round(None, job, alias)
        if settled is not None:
            return settled
        tried = True
    # A key's turn lasts until the transaction ends: a transaction of its own when the caller
    # runs in autocommit; inside the caller's atomic block this adds nothing.
    with transaction.atomic(using=alias, savepoint=False), connections[alias].cursor() as cursor:
        try:
            if not tried:
                settled = _round(cursor, job, alias)
                if settled is not None:
                    return settled
            lock_dedup_keys(cursor, [(job.job_type, job.dedup_key)])
            return _settle(cursor, job, alias)
        except DedupKeyTakenError as exc:
            # Raised only after the block ends well: an exception leaving a block without a
            # savepoint would doom the caller's transaction, and the round's own savepoint
            # has already undone everything it did.
            refused = exc
    raise refused


def _attempt(cursor: Cursor, job: _Prepared, alias: str) -> tuple[PersistentJob, bool] | None:
    """One round of Skip or Replace for a keyed job; ``None`` when another job with the key
    became waiting in between (the insert met it on the unique index)."""
    assert job.dedup_key is not None
    if job.confined:
        _refuse_foreign_holder(cursor, job)
    if job.dedup is Dedup.SKIP:
        existing = _select_active(cursor, job.job_type, job.dedup_key)
        if existing is not None:
            return job_from_row(existing, alias), False
    else:
        _cancel_waiting_duplicates(cursor, job.job_type, [job.dedup_key],
                                   job.tenant if job.confined else None)
    row = _insert_one(cursor, job)
    return None if row is None else (job_from_row(row, alias), True)


def _is_deadlock(exc: BaseException) -> bool:
    return getattr(exc.__cause__, "sqlstate", None) == "40P01"


#: Deadlocks a keyed enqueue holding its key's turn sits out before it raises the last one.
#: Holding the turn, it can lose a round to another enqueue of its key only once per rival;
#: deadlocking again and again means a cycle through rows its own transaction holds (two
#: transactions enqueueing Replace keys in opposite orders), which no retry can break.
DEADLOCKS_WITH_TURN = 3


def _round(cursor: Cursor | None, job: _Prepared, alias: str,
           deadlocks: list[OperationalError] | None = None) -> tuple[PersistentJob, bool] | None:
    """``_attempt`` in a savepoint (or a transaction of its own outside any); ``None`` (with
    nothing left behind) when it lost the race.

    Losing means the insert met a concurrent job's row, or PostgreSQL broke a deadlock between
    enqueues of the same keys by failing this statement: either way the savepoint undoes the
    round's cancellations, so no row lock is held while waiting for the key's turn (the enqueue
    holding the turn may need that row), and the caller's transaction stays usable.
    """
    try:
        with transaction.atomic(using=alias), connections[alias].cursor() as own:
            settled = _attempt(cursor or own, job, alias)
            if settled is None:
                raise _Contended([])
        return settled
    except _Contended:
        return None
    except PreparedStatementLostError:
        # Only the round is lost (its savepoint, or its own transaction, rolled back): again,
        # with the insert sent unprepared from now on (``_stop_preparing``).
        return _round(cursor, job, alias, deadlocks)
    except OperationalError as exc:
        if not _is_deadlock(exc):
            raise
        if deadlocks is not None:
            deadlocks.append(exc)
        return None


def _settle(cursor: Cursor, job: _Prepared, alias: str) -> tuple[PersistentJob, bool]:
    """Skip or Replace one keyed job while holding its key's turn, until it is done.

    Every enqueue that meets a conflict waits for the turn before trying again, so while this
    one holds it a round can be lost only to an enqueue making its first attempt or to a retry
    being scheduled for a running job with the key; neither repeats, and nothing here gives up
    or raises because others use the key. A deadlock that keeps coming back is another matter
    (``DEADLOCKS_WITH_TURN``): it is raised, for the caller to roll back and try again.
    """
    deadlocks: list[OperationalError] = []
    while True:
        settled = _round(cursor, job, alias, deadlocks)
        if settled is not None:
            return settled
        if len(deadlocks) > DEADLOCKS_WITH_TURN:
            raise deadlocks[-1]


def enqueue(
    job_type: str, payload: Any = None, *, run_at: datetime | None = None,
    delay: timedelta | float | None = None, dedup_key: str | None = None,
    dedup: Dedup | str | None = None, max_retries: int | None = None,
    timeout: float | timedelta | None = None, queue: str | None = None,
    priority: int | None = None, tenant: str | None = None,
) -> PersistentJob:
    """Create a job in the caller's transaction and return it.

    With Skip dedup and an active job holding ``dedup_key``, nothing is inserted and the active
    job is returned. Options left as ``None`` come from the handler, then from settings.
    ``tenant`` names the tenant or service that owns the job: stored on the row, seen by the
    handler as ``ctx.tenant``, kept by retries. Dedup keys are not scoped by tenant.
    """
    return _enqueue_one(_prepare(
        job_type, payload, run_at=run_at, delay=delay, dedup_key=dedup_key, dedup=dedup,
        max_retries=max_retries, timeout=timeout, queue=queue, priority=priority, tenant=tenant,
    ))


def enqueue_as_tenant(job_type: str, payload: Any = None, *, tenant: str,
                      **options: Any) -> PersistentJob:
    """``enqueue`` for a caller that may see and touch only ``tenant``'s jobs (a tenant-bound
    API token).

    Dedup keys are shared by all tenants, so a plain ``enqueue`` with a key another tenant's
    active job holds would hand that job back (Skip) or cancel it (Replace). Here that raises
    ``DedupKeyTakenError`` and writes nothing; a key held by the tenant's own job behaves as in
    ``enqueue``. ``options`` are ``enqueue``'s keyword arguments.
    """
    job = _prepare(job_type, payload, tenant=tenant, **options)
    job.confined = True
    return _enqueue_one(job)


def _enqueue_one(job: _Prepared) -> PersistentJob:
    alias = conf.settings.DATABASE
    result, created = _enqueue_prepared(job, alias)
    result._pj_created = created  # type: ignore[attr-defined]  # the HTTP API: 201 or 200
    if created:
        signals.enqueued(result, alias)
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(
            "job %s %s", "enqueued" if created else "deduplicated", result.id,
            extra={"event": "enqueue" if created else "dedup_skip", "job_id": str(result.id),
                   "job_type": job.job_type, "queue": result.queue,
                   "dedup_key": job.dedup_key},
        )
    return result


# --- recurring schedules: the scheduler inserts runs through the same path ---------------------
def enqueue_scheduled_run(
    job_type: str, payload: Any, *, schedule: Mapping[str, Any], dedup_key: str,
    queue: str | None = None, priority: int | None = None, tenant: str | None = None,
) -> tuple[PersistentJob, bool]:
    """Insert one run of a recurring schedule in the caller's transaction.

    Like ``enqueue`` (same validation, handler dedup strategy, NOTIFY), plus the run's
    ``schedule`` JSON, and it reports whether a row was inserted: ``False`` means Skip dedup
    returned the schedule's still-active previous run. Internal: ``schedules.firing``
    calls it (for the scheduler and ``run_schedule_now``); users call ``run_schedule_now``.
    """
    job = _prepare(job_type, payload, dedup_key=dedup_key, queue=queue, priority=priority,
                   tenant=tenant, schedule=schedule)
    alias = conf.settings.DATABASE
    result, created = _enqueue_prepared(job, alias)
    if created:
        signals.enqueued(result, alias)
    return result, created


#: The options an ``enqueue_many`` item (or its ``common`` keyword arguments) may give.
_ITEM_OPTIONS = frozenset({"run_at", "delay", "dedup_key", "dedup", "max_retries", "timeout",
                           "queue", "priority", "tenant"})


def _item_kwargs(item: Any, common: dict[str, Any]) -> tuple[str, Any, dict[str, Any]]:
    if isinstance(item, tuple) and len(item) == 2:
        return item[0], item[1], dict(common)
    if isinstance(item, Mapping):
        data = dict(item)
        if "job_type" not in data:
            raise EnqueueError(f"enqueue_many item {bounds.show(item)} has no 'job_type'.")
        job_type = data.pop("job_type")
        payload = data.pop("payload", None)
        unknown = set(data) - _ITEM_OPTIONS
        if unknown:
            raise EnqueueError(
                f"enqueue_many item has unknown keys {bounds.show(sorted(map(str, unknown)))}.")
        return job_type, payload, {**common, **data}
    raise EnqueueError(
        "enqueue_many takes (job_type, payload) tuples or dicts with 'job_type' and 'payload', "
        f"got {bounds.show(item)}."
    )


def _options_key(job_type: Any, kwargs: dict[str, Any]) -> Any:
    """A cache key for resolved options; ``None`` when a value is unhashable. Types are part of
    it: ``priority=True`` must not reuse what ``priority=1`` resolved to (they are equal)."""
    options = tuple((name, type(value), value) for name, value in sorted(kwargs.items())
                    ) if kwargs else ()  # most items have no options of their own
    key = (type(job_type), job_type, options)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def enqueue_many(items: Iterable[Any], **common: Any) -> list[PersistentJob]:
    """Insert many jobs in one statement, in the caller's transaction.

    ``items`` are ``(job_type, payload)`` tuples or dicts with ``job_type``, ``payload`` and any
    ``enqueue`` option; ``common`` options apply to every item. Every item is validated before
    anything is written. The result is aligned with ``items``: a Skip-deduplicated item yields
    the job that already held its key.
    """
    alias = conf.settings.DATABASE
    unknown = set(common) - _ITEM_OPTIONS
    if unknown:
        raise EnqueueError(f"enqueue_many got unknown options {sorted(unknown)}; it takes "
                           f"{sorted(_ITEM_OPTIONS)}.")
    if isinstance(items, str | bytes | Mapping) or not isinstance(items, Iterable):
        raise EnqueueError("enqueue_many takes an iterable of items (a list of (job_type, "
                           f"payload) tuples or dicts), got {bounds.show(items)}.")
    prepared: list[_Prepared] = []
    cache: dict[Any, _Options] = {}
    limits = PayloadLimits()
    new_id = UUID7Batch().next
    for index, item in enumerate(items):
        try:
            if type(item) is tuple and len(item) == 2 and not common and type(item[0]) is str:
                # Most batches: (job_type, payload) with no options, which ``_item_kwargs`` and
                # ``_options_key`` would turn into an empty option dict and this same key.
                job_type, payload = item
                kwargs: dict[str, Any] = {}
                dedup_key = None
                cache_key: Any = (str, job_type, ())
            else:
                job_type, payload, kwargs = _item_kwargs(item, common)
                dedup_key = kwargs.pop("dedup_key", None)
                cache_key = _options_key(job_type, kwargs)
            options = cache.get(cache_key) if cache_key is not None else None
            if options is None:
                options = _resolve_options(job_type, **kwargs)
                if cache_key is not None:
                    cache[cache_key] = options
            prepared.append(_prepare_with(job_type, payload, options, dedup_key, None, limits,
                                          new_id))
        except EnqueueError as exc:
            raise type(exc)(f"item {index}: {exc}", exc.code) from exc
    if not prepared:
        return []
    keyed = [p for p in prepared if p.dedup_key is not None and p.dedup is not Dedup.ENQUEUE]
    with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
        if keyed:
            return signals.enqueued_many(_enqueue_many_dedup(cursor, prepared, alias),
                                         {p.id for p in prepared}, alias)
        _copy_insert(connections[alias], prepared)
    return signals.enqueued_many([_instance(p, alias) for p in prepared], None, alias)


def _copy_insert(connection: BaseDatabaseWrapper, jobs: list[_Prepared]) -> None:
    """Insert with binary-free text COPY: several times faster than a bound multi-row INSERT.

    ``next_run_at`` is computed from the database's ``now()`` (the transaction's start, the same
    value a column default would use), so the database clock still decides what is due.
    """
    raw = connection.connection
    cursor = psycopg.Cursor(raw)  # server-side binding; Django's default cursor binds client-side
    # Errors as Django's (``django.db.OperationalError`` and the rest), as every other statement
    # of ``enqueue_many`` and ``enqueue`` raises them: a caller's ``except DatabaseError`` or
    # retry on ``OperationalError`` must not miss a lost connection or a statement timeout
    # because this one statement went through psycopg directly (Django also marks a lost
    # connection unusable this way).
    with connection.wrap_database_errors:
        try:
            _copy_rows(cursor, jobs)
        finally:
            cursor.close()


def _copy_rows(cursor: psycopg.Cursor[Any], jobs: list[_Prepared]) -> None:
    """``_copy_insert``'s statements, on its cursor."""
    # The database's now in UTC, made aware here: with ``USE_TZ = False`` ``now()`` reads as a
    # naive local time, and a delay added to that is wall-clock arithmetic (an hour off across
    # a daylight-saving change; in the repeated hour, read back as the later instant).
    cursor.execute("SELECT now() AT TIME ZONE 'UTC'")
    row = cursor.fetchone()
    assert row is not None
    db_now: datetime = row[0].replace(tzinfo=UTC)
    now_text = _copy_time(db_now)
    with cursor.copy(f"COPY persistent_jobs ({_INSERT_COLUMNS_SQL}) FROM STDIN") as copy:
        # The rows as COPY's text format, written in chunks: psycopg's ``write_row``
        # adapts every value through its dumpers, which cost more than the rest of a
        # job's preparation.
        lines: list[str] = []
        for job in jobs:
            next_run = now_text if job.run_at is None and not job.delay else _copy_time(
                job.run_at if job.run_at is not None
                else db_now + timedelta(seconds=job.delay))
            lines.append("\t".join((
                str(job.id), _copy_text(job.job_type), _copy_text(job.payload_json),
                _copy_text(job.queue), str(int(job.priority)), str(int(job.max_retries)),
                next_run, repr(float(job.timeout)), _copy_text(job.dedup_key),
                job.dedup.value, _copy_text(job.schedule_json), _copy_text(job.tenant),
            )))
            if len(lines) >= _COPY_CHUNK:
                copy.write("\n".join(lines) + "\n")
                lines.clear()
        if lines:
            copy.write("\n".join(lines) + "\n")


#: Rows per ``copy.write`` in ``_copy_insert``.
_COPY_CHUNK = 1000
#: COPY's text format gives these characters a meaning; anything else is taken as it is.
_COPY_ESCAPES = str.maketrans({"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"})


def _copy_text(value: str | None) -> str:
    """A text column's value in COPY's text format (``\\N`` for NULL)."""
    if value is None:
        return "\\N"
    if "\\" in value or "\n" in value or "\r" in value or "\t" in value:
        return value.translate(_COPY_ESCAPES)
    return value


def _copy_time(value: datetime) -> str:
    """A datetime as COPY's text format reads a ``timestamptz``: an aware one in UTC, a naive
    one (``USE_TZ = False``) as it is, read in the session's time zone as psycopg would send
    it."""
    if value.tzinfo is None:
        return value.isoformat()
    return value.astimezone(UTC).isoformat()


def _bulk_insert_deduplicated(cursor: Cursor, jobs: list[_Prepared]) -> set[Any]:
    """Insert in one statement, skipping jobs whose key an active job holds; return inserted ids.

    (Batches without dedup keys go through ``_copy_insert`` instead.)
    """
    skip_running = (
        " WHERE NOT (u.dedup = 'skip' AND u.dedup_key IS NOT NULL AND EXISTS (SELECT 1 FROM "
        "persistent_jobs r WHERE r.status = 'running' AND r.job_type = u.job_type AND "
        "r.dedup_key = u.dedup_key AND NOT (r.dedup = 'enqueue')))"
    )
    sql = (
        f"INSERT INTO persistent_jobs ({_INSERT_COLUMNS_SQL}) SELECT u.id, u.job_type, "
        "u.payload::jsonb, "
        "u.queue, u.priority, u.max_retries, COALESCE(u.run_at, now() + u.delay * interval "
        "'1 second'), u.timeout, u.dedup_key, u.dedup, u.schedule::jsonb, u.tenant FROM unnest("
        "%s::uuid[], %s::text[], %s::text[], %s::text[], %s::int[], %s::int[], "
        "%s::timestamptz[], %s::float8[], %s::float8[], %s::text[], %s::text[], %s::text[], "
        "%s::text[]) AS u(id, job_type, payload, queue, priority, max_retries, run_at, delay, "
        f"timeout, dedup_key, dedup, schedule, tenant){skip_running} {_ON_CONFLICT} RETURNING id"
    )
    columns_data: list[list[Any]] = [[] for _ in range(13)]
    for job in jobs:
        for i, value in enumerate(job.params()):
            columns_data[i].append(value)
    cursor.execute(sql, columns_data)
    return {row[0] for row in cursor.fetchall()}


def _enqueue_many_dedup(
    cursor: Cursor, prepared: list[_Prepared], alias: str
) -> list[PersistentJob]:
    # Within one batch, Skip keeps the first item per key and Replace keeps the last.
    chosen: dict[tuple[str, str], _Prepared] = {}
    for job in prepared:
        if job.dedup_key is None or job.dedup is Dedup.ENQUEUE:
            continue
        key = (job.job_type, job.dedup_key)
        if job.dedup is Dedup.REPLACE or key not in chosen:
            chosen[key] = job
    # Keyed rows go in in one global order, (job_type, dedup_key): two batches sharing keys then
    # meet on the unique index in the same order and wait for each other instead of deadlocking.
    # Ids (and so FIFO order) were assigned in item order already.
    to_insert = [
        p for p in prepared if p.dedup_key is None or p.dedup is Dedup.ENQUEUE
    ] + sorted(chosen.values(), key=lambda p: (p.job_type, p.dedup_key or ""))
    replace_keys: dict[str, list[str]] = {}
    for (job_type, dedup_key), job in chosen.items():
        if job.dedup is Dedup.REPLACE:
            replace_keys.setdefault(job_type, []).append(dedup_key)
    locked = False
    deadlocks = 0
    while True:
        try:
            # A savepoint, as in ``_round``: if a Replace key lost its race (or PostgreSQL broke
            # a deadlock with another batch), the cancellations are undone, the batch's Replace
            # keys take their turns, and the batch goes in again holding them.
            with transaction.atomic(using=alias):
                for job_type, keys in replace_keys.items():
                    _cancel_waiting_duplicates(cursor, job_type, keys)
                inserted = _bulk_insert_deduplicated(cursor, to_insert)
                lost = [key for key, job in chosen.items()
                        if job.dedup is Dedup.REPLACE and job.id not in inserted]
                if lost:
                    raise _Contended(lost)
            break
        except _Contended:
            pass
        except OperationalError as exc:
            if not _is_deadlock(exc):
                raise
            if locked:
                deadlocks += 1
                if deadlocks > DEADLOCKS_WITH_TURN:
                    raise  # a cycle through rows this transaction holds (see ``_settle``)
        if not locked:
            # All of the batch's Replace keys at once, in the one global order: taking only the
            # lost ones, round after round, could take them in another order than a concurrent
            # batch does, and deadlock with it.
            lock_dedup_keys(cursor, [k for k, job in chosen.items() if job.dedup is Dedup.REPLACE])
            locked = True
    # Skip keys whose winner was not inserted: an active job holds the key (the common case, no
    # turn needed), or the insert lost a race to a concurrent enqueue. The contended keys take
    # their turns together, in the one global order, and are settled one by one.
    existing_cache: dict[tuple[str, str], PersistentJob] = {}
    contended: list[tuple[str, str]] = []
    for key, winner in chosen.items():
        if winner.id in inserted:
            continue
        if winner.dedup is Dedup.SKIP:
            row = _select_active(cursor, *key)
            if row is not None:
                existing_cache[key] = job_from_row(row, alias)
                continue
        contended.append(key)
    lock_dedup_keys(cursor, contended)
    for key in contended:
        existing_cache[key] = _settle(cursor, chosen[key], alias)[0]
    results: list[PersistentJob] = []
    for job in prepared:
        if job.id in inserted:
            results.append(_instance(job, alias))
            continue
        if job.dedup_key is None or job.dedup is Dedup.ENQUEUE:
            raise EnqueueError(f"job {job.id} was not inserted; nothing else explains it.")
        key = (job.job_type, job.dedup_key)
        winner = chosen[key]
        if winner.id in inserted:
            results.append(_instance(winner, alias))
            continue
        results.append(existing_cache[key])
    return results


def _known_fields(job: _Prepared, payload: Any) -> dict[str, Any]:
    """The fields of a just-inserted job that the caller's side knows (by attribute name)."""
    return {
        "id": job.id, "job_type": job.job_type, "payload": payload, "status": "pending",
        "queue": job.queue, "priority": job.priority, "attempts": 0,
        "max_retries": job.max_retries, "timeout_seconds": job.timeout,
        "dedup_key": job.dedup_key, "dedup": job.dedup.value, "tenant": job.tenant,
    }


def _instance(job: _Prepared, alias: str) -> PersistentJob:
    """A model instance for an inserted row; columns the database filled in load on access."""
    return _loaded(_known_fields(job, job.payload), alias)


def _loaded(values: dict[str, Any], alias: str) -> PersistentJob:
    """A model instance holding ``values`` (by attribute name), as loaded from ``alias``.

    Built without ``Model.__init__``, which costs more than the rest of building the job (5 µs
    against 2 for the 26 fields, on the 2-core VM) and, for large batches, more than the insert
    itself. What it would add is ``pre_init`` and ``post_init``: when a receiver listens for
    this model, the regular constructor runs (through ``from_db``, as a query would load the
    row), so those receivers see every job this module returns. Attributes left out are
    deferred: they load on access, as with ``only()``.
    """
    if pre_init.has_listeners(PersistentJob) or post_init.has_listeners(PersistentJob):
        return PersistentJob.from_db(
            alias, JOB_COLUMNS, [values.get(c, DEFERRED) for c in JOB_COLUMNS])
    obj = PersistentJob.__new__(PersistentJob)
    obj.__dict__.update(values)
    state = ModelState()
    state.adding = False
    state.db = alias
    obj._state = state
    return obj
