"""The example project's URLs: the admin (and its static files), the operator API, metrics.

Static files are served by Django here whatever ``DEBUG`` says, so that the demo's admin is
styled in its default configuration (DEBUG off) with nothing else to install. A real deployment
serves ``collectstatic``'s output from its web server, a CDN or WhiteNoise instead: Django's
static view is simple, not fast.
"""

from django.contrib import admin
from django.contrib.staticfiles.views import serve
from django.urls import include, path, re_path

from django_persistent_jobs.metrics import metrics_view

urlpatterns = [
    path("admin/", admin.site.urls),
    path("jobs/", include("django_persistent_jobs.urls")),  # operator API (docs/api.md)
    path("metrics", metrics_view),  # Prometheus, needs the "metrics" extra (docs/metrics.md)
    re_path(r"^static/(?P<path>.*)$", serve, {"insecure": True}),
]
