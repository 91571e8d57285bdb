"""Django admin: find what failed, why and how often, then retry or cancel it.

The admin is read-only over job data (jobs are changed by runners and the operator actions, never
by editing fields), and every action goes through ``services`` so it behaves exactly like the
Python API. Retrying and cancelling need the ``retry_persistentjob`` / ``cancel_persistentjob``
permissions on top of view access.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.html import format_html

from .errors import ConfigurationError, InvalidJobStateError, JobNotFoundError
from .models import JobAttempt, JobRunnerRecord, JobStatus, PersistentJob
from .services import cancel_job, retry_job

if TYPE_CHECKING:
    _InlineBase = admin.TabularInline[JobAttempt, PersistentJob]
    _JobAdminBase = admin.ModelAdmin[PersistentJob]
    _RunnerAdminBase = admin.ModelAdmin[JobRunnerRecord]
else:  # the admin classes are not subscriptable at run time
    _InlineBase = admin.TabularInline
    _JobAdminBase = _RunnerAdminBase = admin.ModelAdmin


class ReadOnlyAdminMixin:
    """Rows here change only through runners and the operator services, never by editing.

    Deleting is refused too: deleting a running job or a live runner's row would pull work out
    from under a runner (its jobs would be rescued while it still runs them).
    """

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class JobAttemptInline(ReadOnlyAdminMixin, _InlineBase):
    model = JobAttempt
    extra = 0
    can_delete = False
    fields = ("attempt", "outcome", "error_code", "error_message", "runner_id", "started_at",
              "finished_at", "duration", "traceback")
    readonly_fields = fields
    ordering = ("attempt", "id")


def _bulk(
    request: HttpRequest, modeladmin: _JobAdminBase,
    queryset: QuerySet[PersistentJob], verb: str, action: Callable[[Any], PersistentJob],
) -> None:
    done, refused = 0, []
    for job_id in queryset.values_list("id", flat=True):
        try:
            action(job_id)
            done += 1
        except (InvalidJobStateError, JobNotFoundError, ConfigurationError) as exc:
            refused.append(str(exc))
    if done:
        modeladmin.message_user(request, f"{verb} {done} job(s).", messages.SUCCESS)
    for reason in refused[:20]:
        modeladmin.message_user(request, reason, messages.WARNING)
    if len(refused) > 20:
        modeladmin.message_user(request, f"... and {len(refused) - 20} more refused.",
                                messages.WARNING)


@admin.register(PersistentJob)
class PersistentJobAdmin(ReadOnlyAdminMixin, _JobAdminBase):
    list_display = ("id", "job_type", "colored_status", "queue", "priority", "attempts_used",
                    "next_run_at", "last_error_code", "locked_by", "updated_at")
    list_filter = (
        "status",
        ("job_type", admin.AllValuesFieldListFilter),
        ("queue", admin.AllValuesFieldListFilter),
        ("last_error_code", admin.AllValuesFieldListFilter),
    )
    search_fields = ("dedup_key",)
    search_help_text = "Search by job id (exact) or dedup key."
    readonly_fields = [f.name for f in PersistentJob._meta.fields] + ["schedule_link"]
    inlines = [JobAttemptInline]
    actions = ["retry_now", "retry_later", "retry_reset", "cancel"]
    list_per_page = 50
    show_full_result_count = False
    date_hierarchy = None


    def has_retry_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("django_persistent_jobs.retry_persistentjob")

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("django_persistent_jobs.cancel_persistentjob")

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[PersistentJob], search_term: str
    ) -> tuple[QuerySet[PersistentJob], bool]:
        term = search_term.strip()
        try:
            job_id = uuid.UUID(term)
        except ValueError:
            return super().get_search_results(request, queryset, search_term)
        return queryset.filter(id=job_id), False

    @admin.display(description="status", ordering="status")
    def colored_status(self, obj: PersistentJob) -> str:
        color = {
            JobStatus.COMPLETED: "green", JobStatus.DEAD_LETTERED: "#b00",
            JobStatus.FAILED: "#c60", JobStatus.RUNNING: "#06c", JobStatus.CANCELLED: "#777",
        }.get(JobStatus(obj.status), "inherit")
        return format_html('<b style="color:{}">{}</b>', color, obj.get_status_display())

    @admin.display(description="recurring schedule")
    def schedule_link(self, obj: PersistentJob) -> str:  # issue 3: a run links to its schedule
        from .admin_schedules import schedule_link

        return schedule_link(obj)

    @admin.display(description="attempts")
    def attempts_used(self, obj: PersistentJob) -> str:
        return f"{obj.attempts}/{obj.max_retries + 1}"

    @admin.action(description="Retry now", permissions=["retry"])
    def retry_now(self, request: HttpRequest, queryset: QuerySet[PersistentJob]) -> None:
        _bulk(request, self, queryset, "Retried (now)", lambda j: retry_job(j, mode="now"))

    @admin.action(description="Retry later (after backoff)", permissions=["retry"])
    def retry_later(self, request: HttpRequest, queryset: QuerySet[PersistentJob]) -> None:
        _bulk(request, self, queryset, "Scheduled retry (later) of",
              lambda j: retry_job(j, mode="later"))

    @admin.action(description="Retry from scratch (reset attempts)", permissions=["retry"])
    def retry_reset(self, request: HttpRequest, queryset: QuerySet[PersistentJob]) -> None:
        _bulk(request, self, queryset, "Reset and retried", lambda j: retry_job(j, mode="reset"))

    @admin.action(description="Cancel", permissions=["cancel"])
    def cancel(self, request: HttpRequest, queryset: QuerySet[PersistentJob]) -> None:
        _bulk(request, self, queryset, "Cancelled (or asked to stop)", cancel_job)


@admin.register(JobRunnerRecord)
class JobRunnerAdmin(ReadOnlyAdminMixin, _RunnerAdminBase):
    list_display = ("id", "name", "hostname", "pid", "concurrency", "queues", "started_at",
                    "heartbeat_at")
    readonly_fields = [f.name for f in JobRunnerRecord._meta.fields]



# Recurring schedules have their own admin module (issue 3).
from . import admin_schedules  # noqa: E402,F401
