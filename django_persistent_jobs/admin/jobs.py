"""The job list and the job page: find what failed, read why, retry or cancel it.

Job rows change only through runners and the operator services, never by editing fields, so the
admin is read-only over job data; every action goes through ``services`` (see ``actions``). The
list is built to fit a laptop screen: short ids, relative ages, the last error in the row, and
no "next run" for jobs that will never run again. The job page puts what an operator asks first
(status, last error, when it runs next, which runner holds it) in a banner at the top.
"""

from __future__ import annotations

import math
import re
import uuid
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from django.contrib import admin, messages
from django.contrib.admin.utils import quote as admin_quote
from django.core.exceptions import BadRequest, PermissionDenied
from django.db.models import Count, Q, QuerySet
from django.db.models.functions import Now
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.dateparse import parse_datetime
from django.utils.html import format_html
from django.utils.safestring import SafeString

from .. import queries
from ..models import JobAttempt, JobRunnerRecord, JobStatus, PersistentJob
from ..services import failure_group_dead_letters, retry_failure_group
from ..stats import FAILED_OUTCOMES, run_start, runner_state, runner_thresholds
from . import actions, display, listing
from .database import JobsDatabaseMixin, objects, parse_time, refuse_nul
from .schedules import schedule_link

if TYPE_CHECKING:
    _JobAdminBase = admin.ModelAdmin[PersistentJob]
else:  # the admin classes are not subscriptable at run time
    _JobAdminBase = admin.ModelAdmin

STATUS_COLORS = {
    JobStatus.PENDING: "#555", JobStatus.RUNNING: "#0b62a4", JobStatus.COMPLETED: "#1a7f37",
    JobStatus.FAILED: "#b35900", JobStatus.DEAD_LETTERED: "#b00020",
    JobStatus.CANCELLED: "#6e6e6e",
}
_HEX_SUFFIX = re.compile(r"^[0-9a-fA-F]{6,31}$")


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


class JobViewersMixin:
    """Attempts and runners are part of what a job viewer needs to see: the permission to view
    jobs is enough to view them (their own view permission still works on its own)."""

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return request.user.has_perm("django_persistent_jobs.view_persistentjob") or bool(
            super().has_view_permission(request, obj))  # type: ignore[misc]


def status_badge(status: str) -> SafeString:
    label = JobStatus(status).label if status in JobStatus.values else status
    return format_html('<b class="pj-status" style="color:{}">{}</b>',
                       STATUS_COLORS.get(JobStatus(status), "inherit")
                       if status in JobStatus.values else "inherit", label)


def job_url(job_id: uuid.UUID | str) -> str:
    return reverse("admin:django_persistent_jobs_persistentjob_change", args=[job_id])


def changelist_url(**params: Any) -> str:
    query = urlencode({k: v for k, v in params.items() if v is not None})
    base = reverse("admin:django_persistent_jobs_persistentjob_changelist")
    return f"{base}?{query}" if query else base


def runner_url(runner_id: str) -> str:
    """A runner's admin page. The id is quoted the admin's way: ``runjobs --name`` may give
    one with ``_`` sequences that the admin would otherwise unquote into another id."""
    return reverse("admin:django_persistent_jobs_jobrunnerrecord_change",
                   args=[admin_quote(runner_id)])


def progress_fraction(progress: Any) -> tuple[float | None, str]:
    """(fraction done in 0..1 or None, a caption) from what a handler reported.

    Handlers report a number (0..1, or a percentage up to 100) or a dict such as
    ``{"done": 3, "of": 9, "message": "..."}``; anything else is shown as JSON.
    """
    def number(value: Any) -> float | None:
        if not isinstance(value, int | float) or isinstance(value, bool):
            return None
        try:
            result = float(value)
        except OverflowError:  # an integer beyond any float: valid JSON, no fraction
            return None
        return result if math.isfinite(result) else None

    caption = ""
    fraction: float | None = None
    if isinstance(progress, dict):
        # Only a plain text: a nested value would show what redaction hides in the JSON.
        text = progress.get("message") or progress.get("stage")
        caption = text if isinstance(text, str) else ""
        done = number(progress.get("done", progress.get("current")))
        total = number(progress.get("of", progress.get("total")))
        percent = number(progress.get("percent"))
        if done is not None and total:
            fraction = done / total
            caption = f"{done:g} of {total:g}" + (f": {caption}" if caption else "")
        elif percent is not None:
            fraction = percent / 100
    elif (value := number(progress)) is not None:
        fraction = value if value <= 1 else value / 100
    if fraction is None:
        return None, caption
    return min(max(fraction, 0.0), 1.0), caption


def _moment(name: str, value: str) -> datetime:
    """A time from a filter parameter; an unreadable one, or one outside what a UTC timestamp
    holds, is a bad lookup (the admin's "?e=1" redirect), never a 500."""
    return parse_time(name, value)


class FailedAttemptsFilter(admin.ListFilter):
    """Jobs with a failed attempt of one error code finished between two times: exactly the
    jobs a dashboard failure group counts (its "jobs" number links here). A job's last error
    code is not that set: it may have failed otherwise since, or before the window. Shown in
    the sidebar only while it narrows the list."""

    title = "failed attempts"
    CODE, SINCE, UNTIL = "failed_with", "failed_since", "failed_until"

    def __init__(self, request: HttpRequest, params: dict[str, Any], model: Any,
                 model_admin: Any) -> None:
        super().__init__(request, params, model, model_admin)
        given: dict[str, str] = {}
        for name in (self.CODE, self.SINCE, self.UNTIL):
            if name in params:
                value = params.pop(name)
                given[name] = str(value[-1] if isinstance(value, list) else value)
        self.used_parameters.update(given)
        self.code = given.get(self.CODE)
        self.since = _moment(self.SINCE, given[self.SINCE]) if self.SINCE in given else None
        self.until = _moment(self.UNTIL, given[self.UNTIL]) if self.UNTIL in given else None

    def has_output(self) -> bool:
        return bool(self.used_parameters)

    def expected_parameters(self) -> list[str | None]:
        return [self.CODE, self.SINCE, self.UNTIL]

    def choices(self, changelist: Any) -> Any:
        shown = ", ".join(part for part in (
            f"code {self.code or '(none)'}" if self.code is not None else "",
            f"since {display.utc(self.since)}" if self.since else "",
            f"until {display.utc(self.until)}" if self.until else "") if part)
        yield {"selected": False, "display": "All",
               "query_string": changelist.get_query_string(remove=self.expected_parameters())}
        yield {"selected": True, "display": shown, "query_string": changelist.get_query_string()}

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        failed = objects(JobAttempt).filter(outcome__in=FAILED_OUTCOMES)
        if self.code is not None:
            failed = failed.filter(error_code=self.code)
        if self.since is not None:
            failed = failed.filter(finished_at__gte=self.since)
        if self.until is not None:
            failed = failed.filter(finished_at__lte=self.until)
        return queryset.filter(id__in=failed.values("job_id"))


@admin.register(PersistentJob)
class PersistentJobAdmin(JobsDatabaseMixin[PersistentJob], ReadOnlyAdminMixin, _JobAdminBase):
    list_display = ("short_id", "job_display", "status_display", "timing",
                    "last_error_display")
    list_display_links = ("short_id",)
    list_filter = (
        "status",
        # Choices from cheap sources, not a SELECT DISTINCT over the table (``listing``).
        ("job_type", listing.values_filter(listing.job_types)),
        ("queue", listing.values_filter(listing.queues)),
        ("tenant", listing.values_filter(listing.tenants, empty=True)),
        ("last_error_code", listing.values_filter(listing.recent_error_codes)),
        FailedAttemptsFilter,
    )
    search_fields = ("dedup_key", "tenant", "job_type")
    allowed_lookups = frozenset({
        # The sidebar filters.
        "status__exact", "status__isnull", "job_type__exact", "job_type__isnull",
        "queue__exact", "queue__isnull", "tenant__exact", "tenant__isnull",
        "last_error_code__exact", "last_error_code__isnull",
        FailedAttemptsFilter.CODE, FailedAttemptsFilter.SINCE, FailedAttemptsFilter.UNTIL,
        # The links of the dashboard, the job page, the runners and the schedules.
        "status", "job_type", "queue", "tenant", "last_error_code", "locked_by",
        "schedule__name",
    })
    time_lookups = frozenset({FailedAttemptsFilter.SINCE, FailedAttemptsFilter.UNTIL})
    search_help_text = ("Search by job id (whole, or its last 8 characters as shown), dedup key, "
                        "tenant or job type.")
    actions = ["retry_now", "retry_later", "retry_reset", "cancel"]
    list_per_page = 50
    # The count reads at most listing.EXACT_UP_TO rows, then estimates; no second, unfiltered
    # count; no per-choice counts in the sidebar (each would read the table).
    paginator = listing.EstimatedCountPaginator
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    change_form_template = "admin/django_persistent_jobs/persistentjob/change_form.html"

    # ------------------------------------------------------------------ permissions
    def has_retry_permission(self, request: HttpRequest) -> bool:
        return actions.has_permission(request, "retry")

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        return actions.has_permission(request, "cancel")

    # ------------------------------------------------------------------ list
    def get_queryset(self, request: HttpRequest) -> QuerySet[PersistentJob]:
        # The database clock, once per query: ages in the list agree with what decides "due".
        # A running job's age and timeout count from its attempt's start, not its claim (one
        # claimed to wait for a free worker has not started): the rule the stats use.
        return super().get_queryset(request).annotate(pj_now=Now(), pj_run_start=run_start())

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[PersistentJob], search_term: str
    ) -> tuple[QuerySet[PersistentJob], bool]:
        term = search_term.strip()
        try:
            return queryset.filter(id=uuid.UUID(term)), False
        except ValueError:
            pass
        found, may_dup = super().get_search_results(request, queryset, search_term)
        if _HEX_SUFFIX.match(term):
            # The short id the list shows is the id's tail: find it by suffix too.
            suffix_ids = queries.ids_ending_with(queryset, term)
            found = queryset.filter(Q(id__in=suffix_ids) | Q(id__in=found.values("id")))
        return found, may_dup

    @admin.display(description="id", ordering="id")
    def short_id(self, obj: PersistentJob) -> SafeString:
        return format_html('<code title="{}">{}</code>', obj.id, display.short_id(obj.id))

    @admin.display(description="job type · queue · tenant", ordering="job_type")
    def job_display(self, obj: PersistentJob) -> SafeString:
        return format_html('{}<br><small class="pj-muted">{} · {}</small>', obj.job_type,
                           obj.queue, obj.tenant or "no tenant")

    @admin.display(description="status · attempts", ordering="status")
    def status_display(self, obj: PersistentJob) -> SafeString:
        badge = status_badge(obj.status)
        used = format_html('<small class="pj-muted">attempt {}/{}</small>', obj.attempts,
                           obj.max_retries + 1)
        if obj.cancel_requested and obj.status == JobStatus.RUNNING:
            return format_html('{}<br><small class="pj-warn">cancel requested</small><br>{}',
                               badge, used)
        return format_html("{}<br>{}", badge, used)

    @admin.display(description="when", ordering="next_run_at")
    def timing(self, obj: PersistentJob) -> SafeString:
        """One line on where the job is in time; a finished job has no "next run"."""
        now = getattr(obj, "pj_now", None) or display.db_now()
        if obj.status in JobStatus.terminal():
            line = format_html("ended {}", display.when(obj.finished_at or obj.updated_at, now))
        elif obj.status == JobStatus.RUNNING:
            started_at = getattr(obj, "pj_run_start", None)
            line = (format_html("started {}", display.when(started_at, now)) if started_at
                    else format_html("claimed {}, not started", display.when(obj.locked_at, now)))
        elif obj.is_due(now):
            line = format_html("due {}", display.when(obj.next_run_at, now))
        else:
            line = format_html("runs {}", display.when(obj.next_run_at, now))
        return format_html('<span class="pj-nowrap">{}</span><br>'
                           '<small class="pj-muted pj-nowrap">created {}</small>', line,
                           display.when(obj.created_at, now))

    @admin.display(description="last error", ordering="last_error_code")
    def last_error_display(self, obj: PersistentJob) -> SafeString:
        if not obj.last_error_code and not obj.last_error:
            return format_html("{}", "")
        return format_html('<code>{}</code><br><span class="pj-msg" title="{}">{}</span>',
                           obj.last_error_code or "", obj.last_error,
                           display.truncate(obj.last_error, 80))

    # ------------------------------------------------------------------ bulk actions
    def _bulk(self, request: HttpRequest, queryset: QuerySet[PersistentJob], name: str) -> None:
        """Run the action on the selected jobs it applies to, one service call each; the others
        are counted by status in one query and reported in one line. ("Select all" over a
        table of finished jobs called the service, a query or more, once per row, only to be
        refused.)"""
        action = actions.ACTIONS[name]
        applicable = queryset.filter(status__in=action.applies_to)
        skipped = dict(queryset.exclude(status__in=action.applies_to).order_by()
                       .values_list("status").annotate(n=Count("id")).values_list("status", "n"))
        done, refused = actions.perform(self, request, action,
                                        list(applicable.values_list("id", flat=True)))
        actions.report(self, request, action.verb, len(done), refused)
        if skipped:
            counts = ", ".join(f"{n} {status.replace('_', '-')}"
                               for status, n in sorted(skipped.items()))
            allowed = ", ".join(status.replace("_", "-") for status in action.applies_to)
            self.message_user(
                request, f"Skipped {sum(skipped.values())} job(s) ({counts}): "
                         f"{action.label} applies only to {allowed} jobs.", messages.WARNING)

    @admin.action(description="Retry now", permissions=["retry"])
    def retry_now(self, request: HttpRequest, queryset: QuerySet[PersistentJob]) -> None:
        self._bulk(request, queryset, "retry_now")

    @admin.action(description="Retry later (after backoff)", permissions=["retry"])
    def retry_later(self, request: HttpRequest, queryset: QuerySet[PersistentJob]) -> None:
        self._bulk(request, queryset, "retry_later")

    @admin.action(description="Retry from scratch (reset attempts)", permissions=["retry"])
    def retry_reset(self, request: HttpRequest, queryset: QuerySet[PersistentJob]) -> None:
        self._bulk(request, queryset, "retry_reset")

    @admin.action(description="Cancel", permissions=["cancel"])
    def cancel(self, request: HttpRequest, queryset: QuerySet[PersistentJob]) -> None:
        self._bulk(request, queryset, "cancel")

    # ------------------------------------------------------------------ extra views
    def get_urls(self) -> list[URLPattern]:
        wrap = self.admin_site.admin_view
        return [
            path("retry-group/", wrap(self.retry_group_view),
                 name="django_persistent_jobs_persistentjob_retry_group"),
            path("<path:object_id>/do/<str:action>/", wrap(self.job_action_view),
                 name="django_persistent_jobs_persistentjob_action"),
            *super().get_urls(),
        ]

    def job_action_view(self, request: HttpRequest, object_id: str, action: str) -> HttpResponse:
        """The job page's buttons: POST only, each gated by its permission."""
        if request.method != "POST":
            return HttpResponseRedirect(job_url(object_id))
        spec = actions.ACTIONS.get(action)
        if spec is None:
            raise Http404(f"No action {action!r}.")
        if not (self.has_view_permission(request)
                and actions.has_permission(request, spec.permission)):
            raise PermissionDenied
        job = self.get_object(request, object_id)
        if job is None:
            raise Http404("No such job.")
        done, refused = actions.perform(self, request, spec, [job.pk])
        if done:
            self.message_user(request, f"{spec.history_message(done[0])}", messages.SUCCESS)
        for reason in refused:
            self.message_user(request, reason, messages.WARNING)
        return HttpResponseRedirect(job_url(job.pk))

    def retry_group_view(self, request: HttpRequest) -> HttpResponse:
        """"Retry every dead letter of this failure group": a confirmation page with the count,
        then one retry per job (each logged on the job)."""
        if not (self.has_view_permission(request) and self.has_retry_permission(request)):
            raise PermissionDenied
        refuse_nul(request)
        source = request.POST if request.method == "POST" else request.GET
        job_type = source.get("job_type", "")
        error_code = source.get("error_code", "")
        tenant = source.get("tenant") or None
        if not job_type:
            raise Http404("Give job_type and error_code.")
        # The page says how many dead letters it shows as of when it was drawn (the database's
        # wall clock, which no committed dead letter is later than); the confirmation carries
        # that time and retries those only, not jobs that
        # were dead-lettered while the operator read the page.
        shown_at = request.POST.get("shown_at") if request.method == "POST" else None
        if request.method == "POST" and request.POST.get("confirm") == "yes" and shown_at:
            try:
                until = parse_datetime(shown_at)
                if until is not None and until.tzinfo is not None:
                    until.astimezone(UTC)  # (outside years 1-9999 in UTC: OverflowError)
            except (ValueError, OverflowError):
                until = None
            if until is None or until.tzinfo is None:
                raise BadRequest(f"shown_at must be an ISO 8601 time with its offset, "
                                 f"got {shown_at!r}.")
            retried, refused = retry_failure_group(job_type, error_code, tenant=tenant,
                                                   actor=actions.actor_of(request),
                                                   until=until)
            actions.log_group_retry(self, request, retried, job_type, error_code)
            actions.report(self, request, "Retried (now)", len(retried), refused)
            if not retried and not refused:
                self.message_user(request, "No dead letters left in this group.",
                                  messages.INFO)
            return HttpResponseRedirect(changelist_url(job_type=job_type,
                                                       last_error_code=error_code,
                                                       tenant=tenant))
        now = display.db_now(clock=True)
        jobs = failure_group_dead_letters(job_type, error_code, tenant=tenant, until=now)
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts, "title": "Retry dead letters of a failure group",
            "job_type": job_type, "error_code": error_code, "tenant": tenant,
            "shown_at": now.isoformat(),
            "count": jobs.count(), "sample": list(jobs.order_by("-finished_at")[:10]),
            "list_url": changelist_url(job_type=job_type, last_error_code=error_code,
                                       status__exact=JobStatus.DEAD_LETTERED, tenant=tenant),
        }
        return TemplateResponse(
            request, "admin/django_persistent_jobs/persistentjob/retry_group.html", context)

    # ------------------------------------------------------------------ the job page
    def change_view(self, request: HttpRequest, object_id: str, form_url: str = "",
                    extra_context: dict[str, Any] | None = None) -> HttpResponse:
        job = self.get_object(request, object_id)
        context = dict(extra_context or {})
        if job is not None:
            context.update(self.job_context(request, job))
        return super().change_view(request, object_id, form_url, context)

    def job_context(self, request: HttpRequest, job: PersistentJob) -> dict[str, Any]:
        now = display.db_now()
        attempts = list(objects(JobAttempt).filter(job=job)
                        .order_by("-id"))  # newest first, also after a reset restarted the numbers
        runner_info = None
        if job.locked_by:
            record = objects(JobRunnerRecord).filter(id=job.locked_by).first()
            if record is None:
                runner_info = {"state": "gone", "text": "no runner row: presumed dead"}
            else:
                state = runner_state(now - record.heartbeat_at, *runner_thresholds())
                runner_info = {"state": state, "text": f"{state}, last heartbeat "
                                                       f"{display.age(record.heartbeat_at, now)}"}
        # Progress is handler-reported data like the payload: the same redaction (REDACT_KEYS)
        # for the caption as for the JSON below.
        fraction, caption = progress_fraction(display.redact(job.progress))
        buttons = [
            spec for spec in actions.ACTIONS.values()
            if job.status in spec.applies_to and actions.has_permission(request, spec.permission)
            and not (spec.name == "cancel" and job.cancel_requested)
        ]
        # The timeout runs from the current attempt's start; a job claimed to wait for a free
        # worker has none yet (and is not "past its timeout").
        running_since = getattr(job, "pj_run_start", None)  # (``get_queryset``)
        timeout_at = (running_since + timedelta(seconds=job.timeout_seconds)
                      if running_since is not None and job.timeout_seconds is not None
                      else None)
        return {
            "job": job, "now": now, "attempt_rows": [
                {"a": a, "started": display.when_full(a.started_at, now),
                 "duration": display.duration(a.duration) if a.duration is not None else (
                     (f"running {display.duration(now - a.started_at)}" if a.started
                      else "waiting for a free worker")
                     if a.outcome == "running" else "-")}
                for a in attempts],
            "status_badge": status_badge(job.status),
            "status_class": job.status,
            "created": display.when_full(job.created_at, now),
            "updated": display.when_full(job.updated_at, now),
            "finished": display.when_full(job.finished_at, now) if job.finished_at else None,
            "locked": display.when_full(job.locked_at, now) if job.locked_at else None,
            "running_since": (display.when_full(running_since, now) if running_since
                              else None),
            "next_run": (display.when_full(job.next_run_at, now)
                         if job.status in JobStatus.waiting() else None),
            "timeout_at": display.when_full(timeout_at, now) if timeout_at else None,
            "overdue": timeout_at is not None and timeout_at < now,
            "job_age": display.duration(now - job.created_at),
            "runner_info": runner_info,
            "runner_url": (runner_url(job.locked_by) if job.locked_by and runner_info
                           and runner_info["state"] != "gone" else None),
            "progress_fraction": fraction, "progress_percent": (
                round(fraction * 100) if fraction is not None else None),
            "progress_caption": caption,
            # Progress is handler-reported data like the payload: the same redaction.
            "progress_json": display.pretty_json(display.redact(job.progress))
            if job.progress is not None else None,
            "payload_json": display.pretty_json(display.redact(job.payload)),
            "result_json": (display.pretty_json(display.redact(job.result))
                            if job.result is not None else None),
            "schedule_html": schedule_link(job),
            "buttons": buttons,
            "button_urls": [(spec, reverse("admin:django_persistent_jobs_persistentjob_action",
                                           args=[job.pk, spec.name])) for spec in buttons],
            "same_group_url": (changelist_url(job_type=job.job_type,
                                              last_error_code=job.last_error_code)
                               if job.last_error_code else None),
            "tenant_url": changelist_url(tenant=job.tenant) if job.tenant else None,
        }
