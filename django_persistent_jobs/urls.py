"""The operator API's routes: ``path("jobs/", include("django_persistent_jobs.urls"))``.

Fixed names come before ``<job_id>`` so "stats" is never read as a job id; job ids are matched
as plain strings so that a malformed id gets the API's JSON 404 instead of Django's HTML one.
"""

from __future__ import annotations

from django.urls import path

from .api import views

app_name = "persistent_jobs"

urlpatterns = [
    path("", views.jobs_view, name="jobs"),
    path("stats", views.stats_view, name="stats"),
    path("openapi.json", views.openapi_view, name="openapi"),
    path("<str:job_id>", views.job_view, name="job"),
    path("<str:job_id>/retry", views.retry_view, name="retry"),
    path("<str:job_id>/cancel", views.cancel_view, name="cancel"),
    # Last: anything else under the prefix (``<id>/``, ``stats/``) answers a JSON 404.
    path("<path:rest>", views.unknown_route_view),
]
