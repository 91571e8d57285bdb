"""Operator actions on jobs: the one implementation the admin, commands and any HTTP view call.

Each action is one conditional UPDATE, so it is atomic against a runner finishing the job at the
same moment: whichever commits first wins, and the loser sees the state it lost to.
"""

from __future__ import annotations

import logging
import uuid
from datetime import datetime
from typing import Literal

from django.db import IntegrityError, connections, transaction
from django.db.models import Q, QuerySet

from . import bounds, conf
from .errors import (
    ConfigurationError,
    EnqueueError,
    InvalidJobIdError,
    InvalidJobStateError,
    JobNotFoundError,
)
from .handlers import global_backoff, registry
from .models import JOB_COLUMNS_SQL, JobStatus, PersistentJob, job_from_row

logger = logging.getLogger("django_persistent_jobs.services")

RetryMode = Literal["now", "later", "reset"]
RETRY_MODES: tuple[str, ...] = ("now", "later", "reset")
NOTIFY_CHANNEL = "persistent_jobs"


def _alias() -> str:
    return conf.settings.DATABASE


def _load(job_id: uuid.UUID | str) -> PersistentJob:
    try:
        key = job_id if isinstance(job_id, uuid.UUID) else uuid.UUID(str(job_id))
    except (ValueError, AttributeError, TypeError):
        raise InvalidJobIdError(f"{bounds.show(job_id)} is not a job id (a UUID).") from None
    try:
        return PersistentJob.objects.using(_alias()).get(pk=key)
    except PersistentJob.DoesNotExist:
        raise JobNotFoundError(f"No job with id {key}.") from None


def _backoff_seconds(job: PersistentJob) -> float:
    spec = registry.get(job.job_type)
    fn = spec.effective_backoff() if spec else global_backoff()
    try:
        value = fn(max(job.attempts, 1))
    except Exception as exc:
        # The operator's action must not end in a traceback (or a bulk action stop halfway)
        # because of the handler's code: say what failed, and what to use instead.
        raise ConfigurationError(
            f"The backoff for {job.job_type!r} raised {type(exc).__name__}: {exc} for attempt "
            f"{max(job.attempts, 1)}. Use retry mode 'now' or fix the backoff."
        ) from exc
    if bounds.backoff_problem(value) is not None:
        # Checked here so the operator gets a message instead of an SQL overflow.
        raise ConfigurationError(
            f"The backoff for {job.job_type!r} returned {bounds.show(value)} seconds for attempt "
            f"{max(job.attempts, 1)}; it must return a finite number of seconds (at most "
            f"{bounds.MAX_SECONDS:.0f}). Use retry mode 'now' or fix the backoff."
        )
    return bounds.backoff_seconds(value)


def _by(actor: str | None) -> str:
    return f" by {actor}" if actor else " by operator"


def retry_job(
    job_id: uuid.UUID | str, mode: RetryMode = "now", *, actor: str | None = None,
) -> PersistentJob:
    """Put a failed, dead-lettered or cancelled job back in play (or make a pending one due
    now) and return it.

    ``now``: due immediately, attempt count kept; ``later``: due after the backoff for its
    attempt count; ``reset``: attempts, hand-backs and errors cleared, due now (a fresh start:
    a job dead-lettered for hand-backs past ``HANDBACK_LIMIT`` would otherwise have its next
    hand-back charged at once). When ``now``/``later`` find
    the retries used up, the job is granted one more attempt (``max_retries`` is raised by one),
    because an operator asking for a retry means it.

    ``actor`` names who asked (a username, ``"cli"``, an API client); it goes into the log line
    so that every operator action can be traced to a person or a tool.
    """
    if not isinstance(mode, str) or mode not in RETRY_MODES:
        raise EnqueueError(f"mode must be one of {RETRY_MODES}, got {bounds.show(mode)}.",
                           code="INVALID_RETRY_MODE")
    job = _load(job_id)
    allowed = (JobStatus.FAILED, JobStatus.DEAD_LETTERED, JobStatus.CANCELLED, JobStatus.PENDING)
    if job.status not in allowed:
        raise InvalidJobStateError(
            f"Job {job.id} is {job.status}; only failed, dead-lettered, cancelled or pending "
            "jobs can be retried."
        )
    delay = _backoff_seconds(job) if mode == "later" else 0.0
    reset = mode == "reset"
    sql = (
        "UPDATE persistent_jobs SET status = 'pending', "
        "next_run_at = now() + %s * interval '1 second', "
        "attempts = CASE WHEN %s THEN 0 ELSE attempts END, "
        "handbacks = CASE WHEN %s THEN 0 ELSE handbacks END, "
        "max_retries = CASE WHEN NOT %s AND attempts >= max_retries + 1 THEN attempts "
        "ELSE max_retries END, "
        "last_error = CASE WHEN %s THEN '' ELSE last_error END, "
        "last_error_code = CASE WHEN %s THEN '' ELSE last_error_code END, "
        "cancel_requested = false, finished_at = NULL, locked_by = NULL, locked_at = NULL, "
        "lock_token = NULL, updated_at = now() "
        "WHERE id = %s AND status = ANY(%s) "
        f"RETURNING {JOB_COLUMNS_SQL}"
    )
    try:
        with transaction.atomic(using=_alias()), connections[_alias()].cursor() as cursor:
            cursor.execute(sql, [delay, reset, reset, reset, reset, reset, job.id, list(allowed)])
            row = cursor.fetchone()
            if row is not None and delay == 0:
                cursor.execute("SELECT pg_notify(%s, %s)", [NOTIFY_CHANNEL, str(job.id)])
    except IntegrityError:
        raise InvalidJobStateError(
            f"Job {job.id} cannot be retried: another waiting job of type {job.job_type!r} "
            f"holds dedup key {job.dedup_key!r}. Cancel that one first or retry it instead."
        ) from None
    if row is None:
        current = _load(job.id)
        raise InvalidJobStateError(
            f"Job {job.id} changed to {current.status} while being retried; nothing was done."
        )
    result = job_from_row(row, _alias())
    logger.info(
        "job %s retried%s (mode=%s)", result.id, _by(actor), mode,
        extra={"event": "operator_retry", "job_id": str(result.id), "job_type": result.job_type,
               "mode": mode, "actor": actor},
    )
    return result


def cancel_job(job_id: uuid.UUID | str, *, actor: str | None = None) -> PersistentJob:
    """Cancel a waiting job, or ask a running job's handler to stop; return the job.

    A pending or failed job becomes ``cancelled`` at once. A running job keeps running but its
    ``JobContext.cancel_requested`` turns true within a heartbeat; if it then fails it is not
    retried, and if it calls ``ctx.raise_if_cancelled()`` it ends as ``cancelled``. ``actor``
    is logged as for ``retry_job``.
    """
    job = _load(job_id)
    # A savepoint inside a caller's transaction (ATOMIC_REQUESTS, an atomic() block, a bulk
    # action), as retry_job has: an UPDATE the database refuses (a trigger, a lock timeout)
    # then undoes only itself, instead of aborting the caller's transaction for every later
    # statement ("current transaction is aborted").
    with transaction.atomic(using=_alias()), connections[_alias()].cursor() as cursor:
        cursor.execute(
            "UPDATE persistent_jobs SET "
            "status = CASE WHEN status = 'running' THEN status ELSE 'cancelled' END, "
            "cancel_requested = true, "
            "finished_at = CASE WHEN status = 'running' THEN finished_at ELSE now() END, "
            "last_error_code = CASE WHEN status = 'running' THEN last_error_code "
            "ELSE 'CANCELLED' END, "
            "last_error = CASE WHEN status = 'running' THEN last_error "
            "ELSE %s END, "
            "updated_at = now() "
            "WHERE id = %s AND status IN ('pending', 'failed', 'running') "
            f"RETURNING {JOB_COLUMNS_SQL}",
            [f"cancelled by {actor}" if actor else "cancelled by an operator", job.id],
        )
        row = cursor.fetchone()
    if row is None:
        current = _load(job.id)
        raise InvalidJobStateError(
            f"Job {job.id} is {current.status}; only pending, failed or running jobs can be "
            "cancelled."
        )
    result = job_from_row(row, _alias())
    logger.info(
        "job %s %s%s", result.id,
        "cancellation requested" if result.status == JobStatus.RUNNING else "cancelled",
        _by(actor),
        extra={"event": "operator_cancel", "job_id": str(result.id),
               "job_type": result.job_type, "status": result.status, "actor": actor},
    )
    return result


def status_counts() -> dict[str, int]:
    """Jobs per status, for summaries (the demo, dashboards)."""
    counts = dict.fromkeys(JobStatus.values, 0)
    with connections[_alias()].cursor() as cursor:
        cursor.execute("SELECT status, count(*) FROM persistent_jobs GROUP BY status")
        for status, count in cursor.fetchall():
            counts[status] = count
    return counts


def failure_group_dead_letters(
    job_type: str, error_code: str, *, tenant: str | None = None,
    until: datetime | None = None,
) -> QuerySet[PersistentJob]:
    """The dead-lettered jobs of one failure group (job type and last error code).

    With ``until``, only those dead-lettered at or before it: what an operator was shown at
    that time, not jobs that joined the group since.
    """
    jobs = PersistentJob.objects.using(_alias()).filter(
        status=JobStatus.DEAD_LETTERED, job_type=job_type, last_error_code=error_code)
    if until is not None:
        jobs = jobs.filter(Q(finished_at__lte=until) | Q(finished_at__isnull=True))
    return jobs if tenant is None else jobs.filter(tenant=tenant)


def retry_failure_group(
    job_type: str, error_code: str, *, tenant: str | None = None, mode: RetryMode = "now",
    actor: str | None = None, until: datetime | None = None,
) -> tuple[list[PersistentJob], list[str]]:
    """Retry every dead letter of a failure group; return (retried jobs, refusal messages).

    Each job is retried on its own (one conditional UPDATE each), so a job that changed state
    meanwhile, or whose dedup key is taken by a newer job, is refused without stopping the rest.
    ``until`` leaves out jobs dead-lettered after it (see ``failure_group_dead_letters``), so a
    confirmed "retry these" retries what was shown.
    """
    retried: list[PersistentJob] = []
    refused: list[str] = []
    ids = list(failure_group_dead_letters(job_type, error_code, tenant=tenant, until=until)
               .order_by("id").values_list("id", flat=True))
    for job_id in ids:
        try:
            retried.append(retry_job(job_id, mode=mode, actor=actor))
        except (InvalidJobStateError, JobNotFoundError, ConfigurationError) as exc:
            refused.append(str(exc))
    return retried, refused


#: The statuses a bulk retry or cancel selected by filters acts on when no status is named:
#: retrying a completed job, or cancelling a finished one, would only be refused job by job.
BULK_ACTION_STATUSES: dict[str, tuple[str, ...]] = {
    "retry": (JobStatus.FAILED.value, JobStatus.DEAD_LETTERED.value),
    "cancel": (JobStatus.PENDING.value, JobStatus.FAILED.value),
}


def prune_finished(*, wait_for_database: bool = False) -> int:
    """Delete every finished job past its ``RETENTION`` now; return how many were deleted.

    The runners' cleanup loop does this on its own schedule; this is the operator's "now"
    (``manage.py jobs prune``, a cron job). An operator's call gets a database error at once
    (``wait_for_database=False``) instead of waiting out the outage as a runner does.
    """
    from .runner.cleanup import cleanup_once

    return cleanup_once(_alias(), wait_for_database=wait_for_database)

