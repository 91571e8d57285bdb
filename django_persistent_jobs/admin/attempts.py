"""Attempt history as data: every execution of every job, filterable and countable.

"How often did X fail with Y this week" is one filtered list here: outcome, error code, job
type, runner and start date narrow it, the message is searchable, and the result count is
exact.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.contrib import admin
from django.db.models import QuerySet
from django.db.models.functions import Now
from django.http import HttpRequest
from django.utils.html import format_html
from django.utils.safestring import SafeString

from ..models import JobAttempt
from . import display, listing
from .database import JobsDatabaseMixin
from .jobs import JobViewersMixin, ReadOnlyAdminMixin, job_url

if TYPE_CHECKING:
    _AttemptAdminBase = admin.ModelAdmin[JobAttempt]
else:
    _AttemptAdminBase = admin.ModelAdmin


class JobTypeFilter(admin.SimpleListFilter):
    """The attempt's job type (a column of the job, not of the attempt)."""

    title = "job type"
    parameter_name = "job_type"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        # The registered types (not a SELECT DISTINCT over every job), and the one asked for.
        given = self.value()
        types = set(listing.job_types()) | ({given} if given else set())
        return [(t, t) for t in sorted(types)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset.filter(job__job_type=value) if value else queryset


class TenantFilter(admin.SimpleListFilter):
    title = "tenant"
    parameter_name = "tenant"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        given = self.value()
        tenants = {t for t in listing.tenants() if t} | ({given} if given else set())
        return [(t, t) for t in sorted(tenants)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset.filter(job__tenant=value) if value else queryset


@admin.register(JobAttempt)
class JobAttemptAdmin(JobsDatabaseMixin[JobAttempt], JobViewersMixin, ReadOnlyAdminMixin,
                      _AttemptAdminBase):
    list_display = ("job_link", "outcome_display", "message", "started")
    list_filter = (
        "outcome",
        ("error_code", listing.values_filter(listing.recent_error_codes)),
        JobTypeFilter,
        ("runner_id", listing.values_filter(listing.runner_ids)),
        TenantFilter,
        ("started_at", admin.DateFieldListFilter),
    )
    search_fields = ("error_message",)
    search_help_text = "Search the error messages."
    allowed_lookups = frozenset({
        # The sidebar filters.
        "outcome__exact", "outcome__isnull", "error_code__exact", "error_code__isnull",
        JobTypeFilter.parameter_name, "runner_id__exact", "runner_id__isnull",
        TenantFilter.parameter_name, "started_at__gte", "started_at__lt", "started_at__isnull",
        # A dashboard failure group's "attempts" link, and the plain forms of the filters.
        "outcome", "error_code", "runner_id", "outcome__in", "finished_at__gte", "finished_at__lte",
    })
    time_lookups = frozenset({"started_at__gte", "started_at__lt", "finished_at__gte",
                              "finished_at__lte"})
    list_select_related = ("job",)
    list_per_page = 100
    # Newest first by id: the id is the attempt's fencing token, from a sequence, so id order is
    # the order attempts began, and the primary key's index serves it (no index on started_at:
    # ordering by it sorted the whole table for each page).
    ordering = ("-id",)
    # As on the job list: a bounded count, no second unfiltered count, no per-choice counts.
    paginator = listing.EstimatedCountPaginator
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    fields = ("job_link", "attempt", "job_type", "outcome", "error_code", "error_class",
              "error_message", "runner_id", "started_at", "finished_at", "duration",
              "traceback")
    readonly_fields = fields

    def get_queryset(self, request: HttpRequest) -> QuerySet[JobAttempt]:
        return super().get_queryset(request).annotate(pj_now=Now())

    @admin.display(description="job · attempt · type", ordering="job_id")
    def job_link(self, obj: JobAttempt) -> SafeString:
        return format_html('<a href="{}"><code title="{}">{}</code></a> #{}<br><small>{}</small>',
                           job_url(obj.job_id), obj.job_id, display.short_id(obj.job_id),
                           obj.attempt, obj.job.job_type)

    @admin.display(description="outcome · took", ordering="outcome")
    def outcome_display(self, obj: JobAttempt) -> SafeString:
        return format_html('{}<br><small class="pj-muted">{}</small>', obj.get_outcome_display(),
                           self.took(obj))

    @admin.display(description="job type", ordering="job__job_type")
    def job_type(self, obj: JobAttempt) -> str:
        return obj.job.job_type

    @admin.display(description="error", ordering="error_code")
    def message(self, obj: JobAttempt) -> SafeString:
        return format_html('<code>{}</code><br><span title="{}">{}</span>', obj.error_code,
                           obj.error_message, display.truncate(obj.error_message, 90))

    @admin.display(description="started · runner", ordering="started_at")
    def started(self, obj: JobAttempt) -> SafeString:
        now = getattr(obj, "pj_now", None) or display.db_now()
        return format_html('{}<br><small class="pj-muted">{}</small>',
                           display.when(obj.started_at, now), obj.runner_id)

    @admin.display(description="took", ordering="duration")
    def took(self, obj: JobAttempt) -> str:
        return display.duration(obj.duration) if obj.duration is not None else "-"
