"""App config: imports every installed app's ``jobs`` module so handlers are registered."""

from __future__ import annotations

from django.apps import AppConfig
from django.utils.module_loading import autodiscover_modules


class PersistentJobsConfig(AppConfig):
    name = "django_persistent_jobs"
    label = "django_persistent_jobs"
    verbose_name = "Persistent jobs"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks  # noqa: F401  (registers the system checks)

        autodiscover_modules("jobs")
        from .backends.discovery import discover_tasks

        discover_tasks()  # tasks of a PersistentJobsBackend in settings.TASKS
        from django.apps import apps

        from .api.tokens import connect_user_cleanup

        connect_user_cleanup()  # when the project has a user model
        if apps.is_installed("django.contrib.admin"):
            from .api import admin as _api_admin  # noqa: F401  (registers the token admin)
        from . import metrics

        metrics.connect_signals()
