"""Jobs and attempts as JSON-ready dicts: one shape for the API and ``jobs --json``.

The shapes are the ``JobSummary``, ``Job`` and ``Attempt`` schemas of the OpenAPI document
(``api/openapi.py``); a test holds the two together.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from ..models import JobAttempt, PersistentJob
from ..stats import as_utc


def when(value: datetime | None) -> str | None:
    """ISO 8601 in UTC with its offset (``format: date-time``), also with ``USE_TZ = False``,
    where Django hands out naive datetimes in ``TIME_ZONE``."""
    return as_utc(value).isoformat() if value is not None else None


def job_summary(job: PersistentJob) -> dict[str, Any]:
    """What a list shows: everything but the potentially large JSON columns."""
    return {
        "id": str(job.id),
        "job_type": job.job_type,
        "status": job.status,
        "queue": job.queue,
        "priority": job.priority,
        "tenant": job.tenant,
        "attempts": job.attempts,
        "max_retries": job.max_retries,
        "dedup_key": job.dedup_key,
        "last_error_code": job.last_error_code,
        "next_run_at": when(job.next_run_at),
        "created_at": when(job.created_at),
        "updated_at": when(job.updated_at),
        "finished_at": when(job.finished_at),
    }


def attempt_dict(attempt: JobAttempt) -> dict[str, Any]:
    return {
        "attempt": attempt.attempt,
        "runner_id": attempt.runner_id,
        "outcome": attempt.outcome,
        "started_at": when(attempt.started_at),
        "finished_at": when(attempt.finished_at),
        "duration_seconds": attempt.duration_seconds,
        "error_code": attempt.error_code,
        "error_class": attempt.error_class,
        "error_message": attempt.error_message,
        "traceback": attempt.traceback,
    }


def job_detail(job: PersistentJob, attempts: list[JobAttempt] | None = None) -> dict[str, Any]:
    data = job_summary(job)
    data.update({
        "payload": job.payload,
        "dedup": job.dedup,
        "timeout_seconds": job.timeout_seconds,
        "locked_by": job.locked_by,
        "last_error": job.last_error,
        "progress": job.progress,
        "result": job.result,
        "cancel_requested": job.cancel_requested,
        "schedule": job.schedule,
        "handbacks": job.handbacks,
    })
    if attempts is not None:
        data["attempt_history"] = [attempt_dict(a) for a in attempts]
    return data
