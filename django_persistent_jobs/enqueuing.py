"""``enqueue()`` and ``enqueue_many()``: the only ways jobs are created.

Both run on the caller's connection, so they join the caller's ``transaction.atomic()`` block:
if it rolls back, the job never existed and no wake-up is sent (the NOTIFY comes from an insert
trigger and PostgreSQL delivers notifications only on commit). Everything is validated before the
first statement, so bad input writes nothing.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import psycopg
from django.db import connections, transaction
from django.db.models.base import ModelState
from django.utils import timezone

from . import bounds, conf
from .errors import ConfigurationError, EnqueueError, PayloadError, UnknownJobTypeError
from .handlers import HandlerSpec, registry
from .ids import uuid7
from .models import JOB_COLUMNS_SQL, PersistentJob, job_from_row
from .payload import PayloadLimits, prepare_payload
from .types import Dedup

logger = logging.getLogger("django_persistent_jobs.enqueue")

_MAX_DEDUP_ROUNDS = 5
_INSERT_COLUMNS = (
    "id", "job_type", "payload", "queue", "priority", "max_retries", "next_run_at",
    "timeout_seconds", "dedup_key", "dedup", "schedule", "tenant",
)
_NEXT_RUN = "COALESCE(%s::timestamptz, now() + %s::float8 * interval '1 second')"
_WAITING_KEY = (
    "status IN ('pending', 'failed') AND dedup_key IS NOT NULL AND NOT (dedup = 'enqueue')"
)
_ON_CONFLICT = f"ON CONFLICT (job_type, dedup_key) WHERE {_WAITING_KEY} DO NOTHING"


@dataclass(frozen=True)
class _Prepared:
    """One validated job, ready to insert."""

    id: Any
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

    def params(self) -> list[Any]:
        return [
            self.id, self.job_type, self.payload_json, self.queue, self.priority,
            self.max_retries, self.run_at, self.delay, self.timeout, self.dedup_key,
            self.dedup.value, self.schedule_json, self.tenant,
        ]


def _spec_for(job_type: Any) -> HandlerSpec | None:
    if not isinstance(job_type, str) or not job_type:
        raise EnqueueError(f"job_type must be a non-empty string, got {job_type!r}.")
    return registry.resolve(
        job_type, missing=UnknownJobTypeError, invalid=ConfigurationError,
        hint=". Register it with @job_handler in an installed app's jobs.py, or set "
        "PERSISTENT_JOBS['ALLOW_UNREGISTERED'] = True if another service runs it.",
    )


def _require(problem: str | None) -> None:
    if problem is not None:
        raise EnqueueError(problem)


def _as_int(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise EnqueueError(f"{name} must be an integer in {low}..{high}, got {value!r}.")
    return value


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
    timeout: float | None = None, queue: str | None = None, priority: int | None = None,
    tenant: str | None = None,
) -> _Options:
    spec = _spec_for(job_type)
    if run_at is not None and delay is not None:
        raise EnqueueError("Give run_at or delay, not both.")
    if run_at is not None:
        if not isinstance(run_at, datetime):
            raise EnqueueError(f"run_at must be a datetime, got {type(run_at).__name__}.")
        if timezone.is_naive(run_at):
            raise EnqueueError(
                "run_at must be timezone-aware (for example timezone.now() + timedelta(...)); "
                "a naive datetime is ambiguous."
            )
    delay_s = 0.0
    if delay is not None:
        if isinstance(delay, timedelta):
            delay_s = delay.total_seconds()
        elif isinstance(delay, int | float) and not isinstance(delay, bool):
            delay_s = float(delay)
        else:
            raise EnqueueError(f"delay must be a timedelta or seconds, got {delay!r}.")
        if not math.isfinite(delay_s) or delay_s < 0:
            raise EnqueueError(f"delay must be >= 0, got {delay!r}.")
    try:
        strategy = Dedup(dedup) if dedup is not None else (
            spec.effective_dedup() if spec else Dedup(conf.get("DEDUP"))
        )
    except ValueError:
        raise EnqueueError(
            f"dedup must be one of {[d.value for d in Dedup]}, got {dedup!r}."
        ) from None
    if max_retries is None:
        max_retries = spec.effective_max_retries() if spec else int(conf.get("MAX_RETRIES"))
    _as_int("max_retries", max_retries, 0, 1_000_000)
    if timeout is None:
        timeout = spec.effective_timeout() if spec else conf.seconds(conf.get("TIMEOUT"))
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not (
        math.isfinite(timeout) and timeout > 0
    ):
        raise EnqueueError(f"timeout must be a number of seconds > 0, got {timeout!r}.")
    if queue is None:
        queue = spec.effective_queue() if spec else str(conf.get("DEFAULT_QUEUE"))
    if not isinstance(queue, str) or not 0 < len(queue) <= 100:
        raise EnqueueError(f"queue must be a string of 1..100 characters, got {queue!r}.")
    if priority is None:
        priority = spec.priority if spec else 0
    _as_int("priority", priority, -32768, 32767)
    _require(bounds.tenant_problem(tenant))
    return _Options(spec=spec, queue=queue, priority=priority, max_retries=max_retries,
                    timeout=float(timeout), run_at=run_at, delay=delay_s, dedup=strategy,
                    tenant=tenant)


def _prepare_with(
    job_type: str, payload: Any, options: _Options, dedup_key: str | None,
    schedule: Mapping[str, Any] | None = None, limits: PayloadLimits | None = None,
) -> _Prepared:
    if dedup_key is not None and (not isinstance(dedup_key, str) or not 0 < len(dedup_key) <= 255):
        raise EnqueueError(f"dedup_key must be a string of 1..255 characters, got {dedup_key!r}.")
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
        id=uuid7(), job_type=job_type, payload=stored, payload_json=text, queue=options.queue,
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


def _select_active(cursor: Any, job_type: str, dedup_key: str) -> tuple[Any, ...] | None:
    cursor.execute(
        f"SELECT {JOB_COLUMNS_SQL} FROM persistent_jobs WHERE job_type = %s AND dedup_key = %s "
        "AND status IN ('pending', 'failed', 'running') AND NOT (dedup = 'enqueue') "
        "ORDER BY (status = 'running') DESC, id LIMIT 1",
        [job_type, dedup_key],
    )
    row: tuple[Any, ...] | None = cursor.fetchone()
    return row


def _insert_one(cursor: Any, job: _Prepared) -> tuple[Any, ...] | None:
    """Insert; ``None`` means a concurrent waiting duplicate won the unique index."""
    columns = ", ".join(_INSERT_COLUMNS)
    if job.dedup_key is None or job.dedup is Dedup.ENQUEUE:
        sql = (f"INSERT INTO persistent_jobs ({columns}) VALUES ({_values_sql()}) "
               f"RETURNING {JOB_COLUMNS_SQL}")
    else:
        sql = (f"INSERT INTO persistent_jobs ({columns}) VALUES ({_values_sql()}) "
               f"{_ON_CONFLICT} RETURNING {JOB_COLUMNS_SQL}")
    cursor.execute(sql, job.params())
    row: tuple[Any, ...] | None = cursor.fetchone()
    return row


def _cancel_waiting_duplicates(cursor: Any, job_type: str, keys: list[str]) -> int:
    cursor.execute(
        "UPDATE persistent_jobs SET status = 'cancelled', last_error_code = 'REPLACED', "
        "last_error = 'replaced by a newer job with the same dedup key', finished_at = now(), "
        "updated_at = now() WHERE job_type = %s AND dedup_key = ANY(%s) AND "
        f"{_WAITING_KEY}",
        [job_type, keys],
    )
    return int(cursor.rowcount)


def _enqueue_prepared(job: _Prepared, alias: str) -> tuple[PersistentJob, bool]:
    """Return ``(job, created)``; ``created`` is False when Skip returned an existing job."""
    if job.dedup_key is not None and job.dedup is Dedup.REPLACE:
        # Cancelling the old job and inserting the new one must commit together, also when the
        # caller runs in autocommit: otherwise a failed insert would leave neither job waiting.
        # Inside the caller's atomic block this adds nothing (no savepoint).
        with transaction.atomic(using=alias, savepoint=False):
            return _enqueue_prepared_in(job, alias)
    return _enqueue_prepared_in(job, alias)


def _enqueue_prepared_in(job: _Prepared, alias: str) -> tuple[PersistentJob, bool]:
    with connections[alias].cursor() as cursor:
        for _ in range(_MAX_DEDUP_ROUNDS):
            if job.dedup_key is not None and job.dedup is Dedup.SKIP:
                existing = _select_active(cursor, job.job_type, job.dedup_key)
                if existing is not None:
                    return job_from_row(existing, alias), False
            elif job.dedup_key is not None and job.dedup is Dedup.REPLACE:
                _cancel_waiting_duplicates(cursor, job.job_type, [job.dedup_key])
            row = _insert_one(cursor, job)
            if row is not None:
                return job_from_row(row, alias), True
        raise EnqueueError(
            f"Could not settle dedup key {job.dedup_key!r} for {job.job_type!r} after "
            f"{_MAX_DEDUP_ROUNDS} rounds of concurrent enqueues; nothing was inserted."
        )


def enqueue(
    job_type: str, payload: Any = None, *, run_at: datetime | None = None,
    delay: timedelta | float | None = None, dedup_key: str | None = None,
    dedup: Dedup | str | None = None, max_retries: int | None = None,
    timeout: float | None = None, queue: str | None = None, priority: int | None = None,
    tenant: str | None = None,
) -> PersistentJob:
    """Create a job in the caller's transaction and return it.

    With Skip dedup and an active job holding ``dedup_key``, nothing is inserted and the active
    job is returned. Options left as ``None`` come from the handler, then from settings.
    ``tenant`` names the tenant or service that owns the job: stored on the row, seen by the
    handler as ``ctx.tenant``, kept by retries. Dedup keys are not scoped by tenant.
    """
    alias = str(conf.get("DATABASE"))
    job = _prepare(
        job_type, payload, run_at=run_at, delay=delay, dedup_key=dedup_key, dedup=dedup,
        max_retries=max_retries, timeout=timeout, queue=queue, priority=priority, tenant=tenant,
    )
    result, created = _enqueue_prepared(job, alias)
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(
            "job %s %s", "enqueued" if created else "deduplicated", result.id,
            extra={"event": "enqueue" if created else "dedup_skip", "job_id": str(result.id),
                   "job_type": job_type, "queue": result.queue, "dedup_key": dedup_key},
        )
    return result


# --- recurring schedules (issue 3): the scheduler inserts runs through the same path ---------
def enqueue_scheduled_run(
    job_type: str, payload: Any, *, schedule: Mapping[str, Any], dedup_key: str,
    queue: str | None = None, priority: int | None = None, tenant: str | None = None,
) -> tuple[PersistentJob, bool]:
    """Insert one run of a recurring schedule in the caller's transaction.

    Like ``enqueue`` (same validation, handler dedup strategy, NOTIFY), plus the run's
    ``schedule`` JSON, and it reports whether a row was inserted: ``False`` means Skip dedup
    returned the schedule's still-active previous run. Internal: schedule_services and
    runner/scheduler call it; users call ``run_schedule_now``.
    """
    job = _prepare(job_type, payload, dedup_key=dedup_key, queue=queue, priority=priority,
                   tenant=tenant, schedule=schedule)
    return _enqueue_prepared(job, str(conf.get("DATABASE")))


def _item_kwargs(item: Any, common: dict[str, Any]) -> tuple[str, Any, dict[str, Any]]:
    if isinstance(item, tuple) and len(item) == 2:
        return item[0], item[1], dict(common)
    if isinstance(item, Mapping):
        data = dict(item)
        if "job_type" not in data:
            raise EnqueueError(f"enqueue_many item {item!r} has no 'job_type'.")
        job_type = data.pop("job_type")
        payload = data.pop("payload", None)
        allowed = {"run_at", "delay", "dedup_key", "dedup", "max_retries", "timeout", "queue",
                   "priority", "tenant"}
        unknown = set(data) - allowed
        if unknown:
            raise EnqueueError(f"enqueue_many item has unknown keys {sorted(unknown)}.")
        return job_type, payload, {**common, **data}
    raise EnqueueError(
        "enqueue_many takes (job_type, payload) tuples or dicts with 'job_type' and 'payload', "
        f"got {item!r}."
    )


def enqueue_many(items: Iterable[Any], **common: Any) -> list[PersistentJob]:
    """Insert many jobs in one statement, in the caller's transaction.

    ``items`` are ``(job_type, payload)`` tuples or dicts with ``job_type``, ``payload`` and any
    ``enqueue`` option; ``common`` options apply to every item. Every item is validated before
    anything is written. The result is aligned with ``items``: a Skip-deduplicated item yields
    the job that already held its key.
    """
    alias = str(conf.get("DATABASE"))
    prepared: list[_Prepared] = []
    cache: dict[Any, _Options] = {}
    limits = PayloadLimits()
    for index, item in enumerate(items):
        job_type, payload, kwargs = _item_kwargs(item, common)
        dedup_key = kwargs.pop("dedup_key", None)
        try:
            try:
                cache_key: Any = (job_type, tuple(sorted(kwargs.items())))
                hash(cache_key)
            except TypeError:
                cache_key = None
            options = cache.get(cache_key) if cache_key is not None else None
            if options is None:
                options = _resolve_options(job_type, **kwargs)
                if cache_key is not None:
                    cache[cache_key] = options
            prepared.append(_prepare_with(job_type, payload, options, dedup_key, None, limits))
        except EnqueueError as exc:
            raise type(exc)(f"item {index}: {exc}", exc.code) from exc
    if not prepared:
        return []
    keyed = [p for p in prepared if p.dedup_key is not None and p.dedup is not Dedup.ENQUEUE]
    with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
        if keyed:
            return _enqueue_many_dedup(cursor, prepared, alias)
        _copy_insert(connections[alias], prepared)
    return [_instance(p, alias) for p in prepared]


def _copy_insert(connection: Any, jobs: list[_Prepared]) -> None:
    """Insert with binary-free text COPY: several times faster than a bound multi-row INSERT.

    ``next_run_at`` is computed from the database's ``now()`` (the transaction's start, the same
    value a column default would use), so the database clock still decides what is due.
    """
    raw = connection.connection
    cursor = psycopg.Cursor(raw)  # server-side binding; Django's default cursor binds client-side
    try:
        cursor.execute("SELECT now()")
        row = cursor.fetchone()
        assert row is not None
        db_now: datetime = row[0]
        columns = ", ".join(_INSERT_COLUMNS)
        with cursor.copy(f"COPY persistent_jobs ({columns}) FROM STDIN") as copy:
            for job in jobs:
                next_run = job.run_at if job.run_at is not None else (
                    db_now + timedelta(seconds=job.delay) if job.delay else db_now
                )
                copy.write_row((
                    job.id, job.job_type, job.payload_json, job.queue, job.priority,
                    job.max_retries, next_run, job.timeout, job.dedup_key, job.dedup.value,
                    job.schedule_json, job.tenant,
                ))
    finally:
        cursor.close()


def _bulk_insert_deduplicated(cursor: Any, jobs: list[_Prepared]) -> set[Any]:
    """Insert in one statement, skipping jobs whose key an active job holds; return inserted ids.

    (Batches without dedup keys go through ``_copy_insert`` instead.)
    """
    columns = ", ".join(_INSERT_COLUMNS)
    skip_running = (
        " WHERE NOT (u.dedup = 'skip' AND u.dedup_key IS NOT NULL AND EXISTS (SELECT 1 FROM "
        "persistent_jobs r WHERE r.status = 'running' AND r.job_type = u.job_type AND "
        "r.dedup_key = u.dedup_key AND NOT (r.dedup = 'enqueue')))"
    )
    sql = (
        f"INSERT INTO persistent_jobs ({columns}) SELECT u.id, u.job_type, u.payload::jsonb, "
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


def _enqueue_many_dedup(cursor: Any, prepared: list[_Prepared], alias: str) -> list[PersistentJob]:
    # Within one batch, Skip keeps the first item per key and Replace keeps the last.
    chosen: dict[tuple[str, str], _Prepared] = {}
    for job in prepared:
        if job.dedup_key is None or job.dedup is Dedup.ENQUEUE:
            continue
        key = (job.job_type, job.dedup_key)
        if job.dedup is Dedup.REPLACE or key not in chosen:
            chosen[key] = job
    to_insert = [
        p for p in prepared
        if p.dedup_key is None or p.dedup is Dedup.ENQUEUE
        or chosen[(p.job_type, p.dedup_key)] is p
    ]
    replace_keys: dict[str, list[str]] = {}
    for (job_type, dedup_key), job in chosen.items():
        if job.dedup is Dedup.REPLACE:
            replace_keys.setdefault(job_type, []).append(dedup_key)
    for job_type, keys in replace_keys.items():
        _cancel_waiting_duplicates(cursor, job_type, keys)
    inserted = _bulk_insert_deduplicated(cursor, to_insert)
    results: list[PersistentJob] = []
    existing_cache: dict[tuple[str, str], PersistentJob] = {}
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
        if key not in existing_cache:
            row = _select_active(cursor, job.job_type, job.dedup_key)
            if row is None:
                # The holder finished between our insert and this lookup: insert it singly.
                result, _ = _enqueue_prepared(winner, alias)
                existing_cache[key] = result
            else:
                existing_cache[key] = job_from_row(row, alias)
        results.append(existing_cache[key])
    return results


def _instance(job: _Prepared, alias: str) -> PersistentJob:
    """A model instance for an inserted row; columns the database filled in load on access.

    Built without ``Model.__init__`` (and so without the init signals): for large batches the
    regular constructor cost more than the insert itself.
    """
    obj = PersistentJob.__new__(PersistentJob)
    obj.__dict__.update({
        "id": job.id, "job_type": job.job_type, "payload": job.payload, "status": "pending",
        "queue": job.queue, "priority": job.priority, "attempts": 0,
        "max_retries": job.max_retries, "timeout_seconds": job.timeout,
        "dedup_key": job.dedup_key, "dedup": job.dedup.value, "tenant": job.tenant,
    })
    state = ModelState()
    state.adding = False
    state.db = alias
    obj._state = state
    return obj
