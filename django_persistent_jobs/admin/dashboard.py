"""The dashboard: one page that answers what failed, how often, is anything stuck, who owns it.

It is server-rendered from ``stats.dashboard_stats()`` (the same numbers the HTTP API and the
metrics serve), needs no JavaScript and loads nothing from elsewhere: the charts are inline
SVG. It appears on the admin index as "Dashboard" (a proxy model, see ``models.JobDashboard``)
and needs the permission to view jobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse

from ..models import JobDashboard, JobStatus
from ..stats import FAILED_OUTCOMES, STUCK_KINDS, Bucket, dashboard_stats
from . import display, listing
from .database import refuse_nul
from .jobs import FailedAttemptsFilter, changelist_url, job_url, runner_url, status_badge

if TYPE_CHECKING:
    _DashboardAdminBase = admin.ModelAdmin[JobDashboard]
else:
    _DashboardAdminBase = admin.ModelAdmin

WINDOWS: dict[str, timedelta] = {
    "1h": timedelta(hours=1), "6h": timedelta(hours=6), "24h": timedelta(hours=24),
    "7d": timedelta(days=7),
}
DEFAULT_WINDOW = "24h"
CHART_WIDTH, CHART_HEIGHT = 860, 120
SERIES_COLORS = {"completed": "#3d9a50", "failed": "#e08a1e", "dead_lettered": "#c62828"}
SERIES_LABELS = {"completed": "completed", "failed": "failed attempts",
                 "dead_lettered": "dead-lettered"}


@dataclass(frozen=True)
class Bar:
    x: float
    width: float
    segments: list[tuple[str, float, float, int]]  #: (color, y, height, count)
    title: str
    label: str


def chart(buckets: list[Bucket], unit: str) -> dict[str, Any]:
    """Stacked bars (completed, failed, dead-lettered) as SVG geometry for the template."""
    peak = max((b.completed + b.failed + b.dead_lettered for b in buckets), default=0) or 1
    plot = CHART_HEIGHT - 16  # room for the axis labels
    step = CHART_WIDTH / max(len(buckets), 1)
    bars = []
    for i, bucket in enumerate(buckets):
        y = float(plot)
        segments = []
        for series in ("completed", "failed", "dead_lettered"):
            count = getattr(bucket, series)
            height = plot * count / peak
            if count:
                height = max(height, 1.5)
                y -= height
                segments.append((SERIES_COLORS[series], round(y, 1), round(height, 1), count))
        when = (bucket.start.strftime("%d %b %H:00") if unit == "hour"
                else bucket.start.strftime("%a %d %b"))
        bars.append(Bar(
            x=round(i * step + 1, 1), width=round(max(step - 2, 1), 1), segments=segments,
            title=(f"{display.utc(bucket.start)}: {bucket.completed} completed, "
                   f"{bucket.failed} failed attempts, {bucket.dead_lettered} dead-lettered"),
            label=when,
        ))
    return {"bars": bars, "peak": peak, "width": CHART_WIDTH, "height": CHART_HEIGHT,
            "axis_y": plot + 12, "base": plot, "first": bars[0].label if bars else "",
            "last": bars[-1].label if bars else "",
            "totals": {s: sum(getattr(b, s) for b in buckets) for s in SERIES_COLORS}}


@admin.register(JobDashboard)
class JobDashboardAdmin(_DashboardAdminBase):
    """Not a table: its "changelist" is the dashboard page."""

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return request.user.has_perm("django_persistent_jobs.view_persistentjob") or \
            request.user.has_perm("django_persistent_jobs.change_persistentjob")

    def has_module_permission(self, request: HttpRequest) -> bool:
        return self.has_view_permission(request)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def get_urls(self) -> list[URLPattern]:
        return [path("", self.admin_site.admin_view(self.dashboard_view),
                     name="django_persistent_jobs_jobdashboard_changelist")]

    def dashboard_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        refuse_nul(request)
        window_key = request.GET.get("window", DEFAULT_WINDOW)
        if window_key not in WINDOWS:
            window_key = DEFAULT_WINDOW
        tenant = request.GET.get("tenant") or None
        stats = dashboard_stats(window=WINDOWS[window_key], tenant=tenant)
        now = stats.now
        window_start = now - stats.window

        def here(**changes: Any) -> str:
            params = {"window": window_key, "tenant": tenant, **changes}
            query = urlencode({k: v for k, v in params.items() if v})
            return f"?{query}" if query else "?"

        can_retry = request.user.has_perm("django_persistent_jobs.retry_persistentjob")
        groups = []
        # A group's links open exactly what it counts: its failed attempts (by error code)
        # finished in the window as the stats saw it (since and until, to the microsecond),
        # and the jobs behind them, not the jobs whose last error has that code.
        since, until = window_start.isoformat(), now.isoformat()
        for group in stats.failure_groups:
            attempts_query = urlencode({k: v for k, v in {
                "job_type": group.job_type, "error_code": group.error_code, "tenant": tenant,
                "outcome__in": ",".join(FAILED_OUTCOMES),
                "finished_at__gte": since, "finished_at__lte": until,
            }.items() if v is not None})
            groups.append({
                "g": group,
                "jobs_url": changelist_url(job_type=group.job_type, tenant=tenant, **{
                    FailedAttemptsFilter.CODE: group.error_code,
                    FailedAttemptsFilter.SINCE: since, FailedAttemptsFilter.UNTIL: until}),
                "attempts_url": reverse("admin:django_persistent_jobs_jobattempt_changelist")
                + "?" + attempts_query,
                "retry_url": (reverse("admin:django_persistent_jobs_persistentjob_retry_group")
                              + "?" + urlencode({k: v for k, v in {
                                  "job_type": group.job_type, "error_code": group.error_code,
                                  "tenant": tenant}.items() if v is not None}))
                if can_retry and group.dead_letters else None,
                "first_seen": display.when(group.first_seen, now),
                "last_seen": display.when(group.last_seen, now),
            })
        stuck = [{
            "s": job, "url": job_url(job.id), "short": display.short_id(job.id),
            "kinds": [STUCK_KINDS[k] for k in job.kinds], "since": display.when(job.since, now),
            "badge": status_badge(job.status),
        } for job in stats.stuck]
        runners = [{
            "r": runner,
            "url": runner_url(runner.id) if runner.state != "gone" else None,
            "beat": display.when(runner.heartbeat_at, now) if runner.heartbeat_at else "-",
            "held_url": changelist_url(locked_by=runner.id, status__exact=JobStatus.RUNNING,
                                       tenant=tenant),
        } for runner in stats.runners]
        queues = [{
            "q": queue, "url": changelist_url(queue=queue.queue, tenant=tenant),
            "wait": display.duration(queue.oldest_due_wait)
            if queue.oldest_due_wait is not None else "-",
        } for queue in stats.queues]
        statuses = [{
            "status": status, "label": JobStatus(status).label, "count": count,
            "badge": status_badge(status),
            "url": changelist_url(status__exact=status, tenant=tenant),
        } for status, count in stats.status_counts.items()]
        tenants = [{
            "t": row, "name": row.tenant if row.tenant is not None else "(no tenant)",
            "dashboard_url": here(tenant=row.tenant) if row.tenant is not None else None,
            "jobs_url": changelist_url(tenant=row.tenant) if row.tenant is not None
            else changelist_url(tenant__isnull="True"),
        } for row in stats.tenants]
        # (A loose index scan: one probe per tenant, not a DISTINCT over every job.)
        known_tenants = listing.tenants(limit=200)
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts, "title": "Jobs dashboard", "stats": stats,
            "now_utc": display.utc(now), "window_key": window_key, "windows": [
                (key, here(window=key)) for key in WINDOWS],
            "tenant": tenant, "known_tenants": known_tenants, "all_tenants_url": here(tenant=""),
            "statuses": statuses, "total_jobs": sum(stats.status_counts.values()),
            "queues": queues, "job_types": [{
                "t": row, "url": changelist_url(job_type=row.job_type, tenant=tenant),
                "cells": [(row.counts[s], changelist_url(job_type=row.job_type,
                                                         status__exact=s, tenant=tenant))
                          for s in JobStatus.values],
            } for row in stats.job_types],
            "status_labels": [JobStatus(s).label for s in JobStatus.values],
            "hourly": chart(stats.hourly, "hour"), "daily": chart(stats.daily, "day"),
            "series": [(SERIES_LABELS[k], c) for k, c in SERIES_COLORS.items()],
            "groups": groups, "stuck": stuck, "stuck_counts": [
                (STUCK_KINDS[k], n) for k, n in stats.stuck_counts.items()],
            "unclaimed_after": display.duration(stats.unclaimed_after),
            "stale_after": display.duration(stats.stale_after),
            "late_after": display.duration(stats.late_after),
            "runners": runners, "tenants": tenants,
            "stale_runners": sum(1 for r in stats.runners if r.stale),
            "jobs_url": changelist_url(), "attempts_url": reverse(
                "admin:django_persistent_jobs_jobattempt_changelist"),
        }
        return TemplateResponse(request, "admin/django_persistent_jobs/dashboard.html", context)
