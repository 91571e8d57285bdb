"""``django.tasks`` backends: ``PersistentJobsBackend`` (durable, run by ``runjobs``) and
``InProcessBackend`` (runs in the enqueuing process, lost on restart).

Configure one in ``settings.TASKS``::

    TASKS = {"default": {"BACKEND": "django_persistent_jobs.backends.PersistentJobsBackend"}}

The names are imported lazily, so that ``discovery`` (used by the app config) can be imported on
Django 5.2 without the ``django-tasks`` backport installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_getattr

_EXPORTS = {
    "PersistentJobsBackend": ".persistent",
    "InProcessBackend": ".inprocess",
    "PersistentTask": ".tasks",
    "ResultError": ".tasks",
}

__all__ = ["InProcessBackend", "PersistentJobsBackend", "PersistentTask", "ResultError"]

if TYPE_CHECKING:
    from .inprocess import InProcessBackend
    from .persistent import PersistentJobsBackend
    from .tasks import PersistentTask, ResultError


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
