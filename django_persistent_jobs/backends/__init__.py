"""``django.tasks`` backends: ``PersistentJobsBackend`` (durable, run by ``runjobs``) and
``InProcessBackend`` (runs in the enqueuing process, lost on restart).

Configure one in ``settings.TASKS``::

    TASKS = {"default": {"BACKEND": "django_persistent_jobs.backends.PersistentJobsBackend"}}

The names are imported lazily, so that ``discovery`` (used by the app config) can be imported on
Django 5.2 without the ``django-tasks`` backport installed.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

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


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(module, __name__), name)
    globals()[name] = value
    return value
