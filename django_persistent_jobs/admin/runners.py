"""Runners as an operator needs them: is each one alive, what does it serve, what does it hold.

The heartbeat is shown as an age with a live / late / dead flag computed by ``stats`` with the
same thresholds the runners use to judge each other, so a runner that was SIGKILLed shows as
dead here before (and after) its jobs are rescued.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.contrib import admin
from django.db.models import Count, OuterRef, QuerySet, Subquery
from django.db.models.functions import Coalesce, Now
from django.http import HttpRequest
from django.utils.html import format_html
from django.utils.safestring import SafeString

from ..models import JobRunnerRecord, JobStatus, PersistentJob
from ..stats import runner_state, runner_thresholds
from . import display
from .database import JobsDatabaseMixin, objects
from .jobs import JobViewersMixin, ReadOnlyAdminMixin, changelist_url

if TYPE_CHECKING:
    _RunnerAdminBase = admin.ModelAdmin[JobRunnerRecord]
else:
    _RunnerAdminBase = admin.ModelAdmin

STATE_COLORS = {"live": "#1a7f37", "late": "#b35900", "dead": "#b00020"}


@admin.register(JobRunnerRecord)
class JobRunnerAdmin(JobsDatabaseMixin[JobRunnerRecord], JobViewersMixin, ReadOnlyAdminMixin,
                     _RunnerAdminBase):
    list_display = ("id", "name", "state", "heartbeat", "queue_list", "concurrency", "held",
                    "version", "started")
    readonly_fields = ("id", "name", "state", "heartbeat", "hostname", "pid", "queue_list",
                       "type_list", "concurrency", "held", "version", "started")
    fields = readonly_fields
    search_fields = ("id", "name", "hostname")

    def get_queryset(self, request: HttpRequest) -> QuerySet[JobRunnerRecord]:
        held = (objects(PersistentJob).filter(status=JobStatus.RUNNING, locked_by=OuterRef("id"))
                .order_by().values("locked_by").annotate(n=Count("id")).values("n"))
        return super().get_queryset(request).annotate(
            pj_now=Now(), pj_held=Coalesce(Subquery(held[:1]), 0))

    @admin.display(description="state")
    def state(self, obj: JobRunnerRecord) -> SafeString:
        now = getattr(obj, "pj_now", None) or display.db_now()
        state = runner_state(now - obj.heartbeat_at, *runner_thresholds())
        label = {"live": "live", "late": "late (stale)", "dead": "DEAD (stale heartbeat)"}[state]
        return format_html('<b class="pj-runner-{}" style="color:{}">{}</b>', state,
                           STATE_COLORS[state], label)

    @admin.display(description="last heartbeat", ordering="heartbeat_at")
    def heartbeat(self, obj: JobRunnerRecord) -> SafeString:
        now = getattr(obj, "pj_now", None) or display.db_now()
        return display.when(obj.heartbeat_at, now)

    @admin.display(description="started", ordering="started_at")
    def started(self, obj: JobRunnerRecord) -> SafeString:
        now = getattr(obj, "pj_now", None) or display.db_now()
        return display.when(obj.started_at, now)

    @admin.display(description="queues")
    def queue_list(self, obj: JobRunnerRecord) -> str:
        return ", ".join(obj.queues) if isinstance(obj.queues, list) else "all"

    @admin.display(description="job types it claims")
    def type_list(self, obj: JobRunnerRecord) -> str:
        # A runner claims only the types it has handlers for: the answer to "why does nobody
        # take this job?" during a rolling deploy.
        if not isinstance(obj.job_types, list):
            return "not listed (a runner from before runners listed them)"
        return ", ".join(obj.job_types) or "none (no handler registered)"

    @admin.display(description="jobs held")
    def held(self, obj: JobRunnerRecord) -> SafeString:
        count = getattr(obj, "pj_held", None)
        if count is None:
            count = objects(PersistentJob).filter(status=JobStatus.RUNNING,
                                                  locked_by=obj.id).count()
        if not count:
            return format_html("{}", 0)
        return format_html('<a href="{}">{}</a>',
                           changelist_url(locked_by=obj.id, status__exact="running"), count)
