"""Operator actions from the admin: retry and cancel, one job or many, each one on the record.

Every action goes through ``services`` (the same behaviour as the Python API and the CLI), with
the acting user as ``actor`` so the log line names them, and every job it changed gets an admin
``LogEntry``, so the job's History page says who did what and when. The same permission gates
the list's bulk actions, the detail page's buttons and the failure-group retry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.db import DatabaseError
from django.http import HttpRequest

from ..errors import ConfigurationError, InvalidJobStateError, JobNotFoundError
from ..models import JobStatus, PersistentJob
from ..services import cancel_job, retry_job

if TYPE_CHECKING:
    _JobAdminBase = admin.ModelAdmin[PersistentJob]
else:
    _JobAdminBase = admin.ModelAdmin

REFUSED = (InvalidJobStateError, JobNotFoundError, ConfigurationError)
#: How many refusal messages one bulk action shows before summarising the rest.
MAX_MESSAGES = 20


@dataclass(frozen=True)
class JobAction:
    name: str
    label: str  #: the button and the bulk action's name
    permission: str  #: "retry" or "cancel": the custom permission on persistent jobs
    verb: str  #: "<verb> 3 job(s)." after a bulk action
    applies_to: tuple[str, ...]  #: statuses the action accepts (buttons show only for these)
    run: Callable[[Any, str], PersistentJob]  #: (job id, actor) -> job

    def history_message(self, job: PersistentJob) -> str:
        if self.name == "cancel" and job.status == JobStatus.RUNNING:
            return "Cancellation requested (the job is running; its handler is told to stop)."
        return f"{self.label}: now {job.get_status_display().lower()}."


_RETRYABLE = (JobStatus.FAILED, JobStatus.DEAD_LETTERED, JobStatus.CANCELLED, JobStatus.PENDING)
_CANCELLABLE = (JobStatus.PENDING, JobStatus.FAILED, JobStatus.RUNNING)

ACTIONS: dict[str, JobAction] = {a.name: a for a in (
    JobAction("retry_now", "Retry now", "retry", "Retried (now)", _RETRYABLE,
              lambda job_id, actor: retry_job(job_id, mode="now", actor=actor)),
    JobAction("retry_later", "Retry later (after backoff)", "retry", "Scheduled retry (later) of",
              _RETRYABLE, lambda job_id, actor: retry_job(job_id, mode="later", actor=actor)),
    JobAction("retry_reset", "Retry from scratch (reset attempts)", "retry",
              "Reset and retried", _RETRYABLE,
              lambda job_id, actor: retry_job(job_id, mode="reset", actor=actor)),
    JobAction("cancel", "Cancel", "cancel", "Cancelled (or asked to stop)", _CANCELLABLE,
              lambda job_id, actor: cancel_job(job_id, actor=actor)),
)}


def actor_of(request: HttpRequest) -> str:
    """How the services and the log name the acting user."""
    user = request.user
    return f"admin user {user.get_username()!r}" if user.is_authenticated else "admin"


def has_permission(request: HttpRequest, permission: str) -> bool:
    return request.user.has_perm(f"django_persistent_jobs.{permission}_persistentjob")


def perform(
    modeladmin: _JobAdminBase, request: HttpRequest, action: JobAction, job_ids: list[Any],
) -> tuple[list[PersistentJob], list[str]]:
    """Run ``action`` on each job; record a LogEntry per changed job. Returns (done, refused)."""
    done: list[PersistentJob] = []
    refused: list[str] = []
    actor = actor_of(request)
    for job_id in job_ids:
        try:
            job = action.run(job_id, actor)
        except REFUSED as exc:
            refused.append(str(exc))
            continue
        except DatabaseError as exc:
            # (The database went away, or refused this job's update: a trigger, a lock
            # timeout.) Said for this job, as a refusal is; the jobs already done stay done
            # and are reported, rather than an error page that hides what was applied.
            refused.append(f"Job {job_id}: database error: {' '.join(str(exc).split())}")
            continue
        modeladmin.log_change(request, job, action.history_message(job))
        done.append(job)
    return done, refused


def report(
    modeladmin: _JobAdminBase, request: HttpRequest, verb: str, done: int, refused: list[str],
) -> None:
    if done:
        modeladmin.message_user(request, f"{verb} {done} job(s).", messages.SUCCESS)
    for reason in refused[:MAX_MESSAGES]:
        modeladmin.message_user(request, reason, messages.WARNING)
    if len(refused) > MAX_MESSAGES:
        modeladmin.message_user(request, f"... and {len(refused) - MAX_MESSAGES} more refused.",
                                messages.WARNING)


def log_group_retry(
    modeladmin: _JobAdminBase, request: HttpRequest, jobs: list[PersistentJob], job_type: str,
    error_code: str,
) -> None:
    message = f"Retried now with every dead letter of failure group {job_type} / {error_code}."
    for job in jobs:
        modeladmin.log_change(request, job, message)
