"""``task`` from django.tasks (Django 6+) or the django_tasks backport (Django 5.2)."""

import django

if django.VERSION >= (6, 0):
    from django.tasks import task
else:  # pragma: no cover - exercised by the Django 5.2 run of the suite
    from django_tasks import task  # type: ignore[no-redef]

__all__ = ["task"]
