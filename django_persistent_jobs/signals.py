"""Signals for integrators: a job was enqueued, started, finished, dead-lettered.

All are sent with ``sender=PersistentJob`` and keyword arguments only (see ``docs/api.md``):

``job_enqueued``
    after the transaction that inserted the job committed (never for a rolled-back enqueue,
    nor when Skip dedup returned an existing job): ``job`` (the ``PersistentJob``).
``job_started``
    in the runner, in the worker thread, just before the handler runs: ``job_id``,
    ``job_type``, ``queue``, ``tenant``, ``attempt``, ``runner_id``, ``due_at`` (when the job
    became due, or None if unknown).
``job_finished``
    when an attempt ended and its outcome is committed: the ``job_started`` arguments plus
    ``outcome`` (the attempt outcome: ``completed``, ``failed``, ``dead_lettered``,
    ``cancelled``, ``timed_out``, ``interrupted``, ``rescued``), ``status`` (the job's new
    status), ``error_code`` ("" on success) and ``duration`` (seconds the handler ran in this
    process, or None when the attempt was settled elsewhere, e.g. rescued). A job that only
    waited in a lost runner for a free worker is handed back ``interrupted``, not ``rescued``.
    Sent once per attempt: a completion that lands just as the timeout enforcer takes the job
    over is reported by the handler's thread, the batch writer or the enforcer, whichever
    claims it first (``runner.execute.InFlight.claim_report``; with ``--processes``, by the
    worker). A worker process killed between sending it and its supervisor hearing the job was
    done can have it sent twice (the supervisor reports a dead worker's completions).
``job_dead_lettered``
    when a job reached ``dead_lettered``: ``job_id``, ``job_type``, ``queue``, ``tenant``,
    ``attempt``, ``error_code``, ``error_message``.

Receivers run synchronously in the thread that settled the job; an exception in a receiver is
logged and swallowed (``send_robust``), because a metrics hook must never decide a job's fate.
Sending is skipped entirely while a signal has no receivers, so the runner's hot path pays one
attribute check per event when nobody listens.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from django.db import transaction
from django.dispatch import Signal

if TYPE_CHECKING:
    from .models import PersistentJob

logger = logging.getLogger("django_persistent_jobs.signals")

job_enqueued = Signal()
job_started = Signal()
job_finished = Signal()
job_dead_lettered = Signal()

#: Attempt outcome recorded for each job status a fenced transition can produce.
_OUTCOME_FOR_STATUS = {
    "completed": "completed", "failed": "failed", "dead_lettered": "dead_lettered",
    "cancelled": "cancelled", "pending": "interrupted",
}


class Attempt(Protocol):
    """What the runner-side signals need of an attempt: a runner's ``ClaimedJob`` (which also
    has ``queue``, ``tenant`` and ``due_at``) or a rescued attempt (which does not)."""

    @property
    def id(self) -> uuid.UUID: ...
    @property
    def job_type(self) -> str: ...
    @property
    def attempt(self) -> int: ...
    @property
    def token(self) -> int: ...


@dataclass(frozen=True)
class _RescuedAttempt:
    id: uuid.UUID
    token: int
    job_type: str
    attempt: int
    queue: str | None = None
    tenant: str | None = None


_SENDER: type[PersistentJob] | None = None


def _sender() -> type[PersistentJob]:
    global _SENDER
    if _SENDER is None:
        from .models import PersistentJob

        _SENDER = PersistentJob
    return _SENDER


def _send(signal: Signal, **kwargs: Any) -> None:
    for receiver, result in signal.send_robust(sender=_sender(), **kwargs):
        if isinstance(result, Exception):
            logger.error("receiver %r of a persistent-jobs signal failed: %s", receiver, result,
                         exc_info=result, extra={"event": "signal_receiver_failed"})


def enqueued(job: PersistentJob, using: str) -> None:
    """Arrange ``job_enqueued`` for after the caller's transaction commits (or now, in
    autocommit). Called by ``enqueue`` for every job it inserted."""
    if not job_enqueued.receivers:
        return
    transaction.on_commit(lambda: _send(job_enqueued, job=job), using=using)


#: When each attempt this process is running started (monotonic), by fencing token, so
#: ``job_finished`` can report a duration whichever code path settles the attempt.
_started_at: dict[int, float] = {}


def enqueued_many(jobs: list[PersistentJob], inserted_ids: Collection[uuid.UUID] | None,
                  using: str) -> list[PersistentJob]:
    """``enqueued`` for each job of a batch that was inserted (``inserted_ids`` None: all of
    them; otherwise a job returned by Skip dedup has an id the batch did not generate).
    Returns ``jobs`` so the caller can pass its result through."""
    if job_enqueued.receivers:
        seen: set[uuid.UUID] = set()
        for job in jobs:
            if (inserted_ids is None or job.id in inserted_ids) and job.id not in seen:
                seen.add(job.id)
                enqueued(job, using)
    return jobs


def _job_fields(job: Attempt) -> dict[str, Any]:
    """The common arguments, from a runner's ``ClaimedJob``."""
    return {
        "job_id": job.id, "job_type": job.job_type, "queue": getattr(job, "queue", None),
        "tenant": getattr(job, "tenant", None), "attempt": job.attempt,
        "due_at": getattr(job, "due_at", None),
    }


def _listening() -> bool:
    return bool(job_started.receivers or job_finished.receivers
                or job_dead_lettered.receivers)


def started(job: Attempt, runner_id: str) -> None:
    """The runner is about to run ``job`` (a ``ClaimedJob``)."""
    if not _listening():
        return
    _started_at[job.token] = time.monotonic()
    if job_started.receivers:
        _send(job_started, runner_id=runner_id, **_job_fields(job))


def finished(
    job: Attempt, runner_id: str, *, status: str | None, code: str = "", message: str = "",
    attempt_outcome: str | None = None,
) -> None:
    """An attempt of ``job`` (a ``ClaimedJob``) was settled with job status ``status``.

    ``status`` None means this process did not settle it (the claim was already lost): whoever
    settled the attempt sends the signals for it, so nothing is sent here.
    """
    began = _started_at.pop(job.token, None)
    if status is None or not _listening():
        return
    outcome = attempt_outcome or _OUTCOME_FOR_STATUS.get(status, status)
    if job_finished.receivers:
        duration = time.monotonic() - began if began is not None else None
        _send(job_finished, runner_id=runner_id, outcome=outcome, status=status,
              error_code="" if status == "completed" else code, duration=duration,
              **_job_fields(job))
    if status == "dead_lettered" and job_dead_lettered.receivers:
        _send(job_dead_lettered, job_id=job.id, job_type=job.job_type,
              queue=getattr(job, "queue", None), tenant=getattr(job, "tenant", None),
              attempt=job.attempt, error_code=code, error_message=message)


def rescued(job_id: uuid.UUID, token: int, job_type: str, attempt: int, runner_id: str,
            status: str, code: str, message: str, *, queue: str | None = None,
            tenant: str | None = None, started: bool = True) -> None:
    """Another runner's attempt was settled by ``runner_id`` after that runner died.

    A started attempt was charged: outcome ``rescued``. One that only waited in the lost
    runner for a free worker (``started`` false) was handed back: outcome ``interrupted``
    (``cancelled`` if a cancellation was requested), as a stopping runner reports the jobs it
    hands back; past ``HANDBACK_LIMIT`` that hand-back is charged, and its status says so
    (``failed``, ``dead_lettered``, code ``INTERRUPTED``). Reporting it ``rescued`` would count
    a run that never happened; reporting it ``dead_lettered`` would tell the ``django.tasks``
    relay that the task's own code had already reported its end (it never ran)."""
    if not _listening():
        return
    job = _RescuedAttempt(id=job_id, token=token, job_type=job_type, attempt=attempt,
                          queue=queue, tenant=tenant)
    if started:
        outcome: str | None = "rescued"
    else:
        outcome = None if status == "cancelled" else "interrupted"
    finished(job, runner_id, status=status, code=code, message=message,
             attempt_outcome=outcome)
