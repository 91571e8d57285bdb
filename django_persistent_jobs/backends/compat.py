"""One import point for the task API: ``django.tasks`` on Django 6+, the ``django_tasks`` backport
on Django 5.2.

The backport mirrors Django's API under another package name (and names two exceptions
differently), so the backends import everything from here and work unchanged on both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeAlias

import django

if TYPE_CHECKING or django.VERSION >= (6, 0):
    from django.tasks import task_backends
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import (
        DEFAULT_TASK_PRIORITY,
        TASK_MAX_PRIORITY,
        TASK_MIN_PRIORITY,
        Task,
        TaskContext,
        TaskError,
        TaskResult,
        TaskResultStatus,
    )
    from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
    from django.tasks.signals import task_enqueued, task_finished, task_started
    from django.utils.json import normalize_json

    TASKS_PACKAGE = "django.tasks"
else:  # Django 5.2: the API comes from the ``django-tasks`` backport package.
    try:
        from django_tasks import task_backends
    except ImportError as exc:  # pragma: no cover - depends on the installed packages
        raise ImportError(
            "django_persistent_jobs.backends needs django.tasks: on Django 5.2 install the "
            "backport with `pip install django-persistent-jobs[tasks]` (the django-tasks "
            "package) and add 'django_tasks' to INSTALLED_APPS."
        ) from exc
    from django_tasks.backends.base import BaseTaskBackend
    from django_tasks.base import (
        DEFAULT_TASK_PRIORITY,
        TASK_MAX_PRIORITY,
        TASK_MIN_PRIORITY,
        Task,
        TaskContext,
        TaskError,
        TaskResult,
        TaskResultStatus,
    )
    from django_tasks.exceptions import InvalidTaskError as InvalidTask
    from django_tasks.exceptions import TaskResultDoesNotExist
    from django_tasks.signals import task_enqueued, task_finished, task_started
    from django_tasks.utils import normalize_json

    TASKS_PACKAGE = "django_tasks"

if TYPE_CHECKING:
    # Tasks of any signature: the backends treat every task alike. For annotations only: the
    # classes are not subscriptable at run time.
    AnyTask: TypeAlias = Task[Any, Any]
    AnyTaskResult: TypeAlias = TaskResult[Any, Any]

__all__ = [
    "DEFAULT_TASK_PRIORITY",
    "TASKS_PACKAGE",
    "TASK_MAX_PRIORITY",
    "TASK_MIN_PRIORITY",
    "BaseTaskBackend",
    "InvalidTask",
    "Task",
    "TaskContext",
    "TaskError",
    "TaskResult",
    "TaskResultDoesNotExist",
    "TaskResultStatus",
    "normalize_json",
    "task_backends",
    "task_enqueued",
    "task_finished",
    "task_started",
]
