"""The worker-only project's URLs (``tests/settings_worker_only.py``): the operator API alone."""

from django.urls import include, path

urlpatterns = [path("jobs/", include("django_persistent_jobs.urls"))]
