from django.contrib import admin
from django.urls import include, path

from django_persistent_jobs.metrics import metrics_view

urlpatterns = [
    path("admin/", admin.site.urls),
    path("jobs/", include("django_persistent_jobs.urls")),
    path("metrics", metrics_view),
]
