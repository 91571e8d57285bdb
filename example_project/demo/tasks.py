"""A ``django.tasks`` task run by the durable backend (``TASKS`` in settings).

Defined with Django's own ``@task``; ``max_retries`` and ``timeout`` are django-persistent-jobs
options passed through it. ``runjobs`` runs it like any job (retries, timeout, rescue, atomic
completion) and stores its return value, which ``get_result(...).return_value`` reads back.
"""

from __future__ import annotations

import logging
from typing import Any

import django

if django.VERSION >= (6, 0):
    from django.tasks import task
else:  # Django 5.2: the django-tasks backport (pip install django-persistent-jobs[tasks])
    from django_tasks import task  # type: ignore[no-redef]

logger = logging.getLogger("example_project.demo")


@task(max_retries=2, timeout=30)
def order_total(order_id: int, lines: list[dict[str, Any]]) -> dict[str, Any]:
    """Add up an order's lines; the result is stored with the task."""
    total = round(sum(line["qty"] * line["price"] for line in lines), 2)
    logger.info("order %s totals %.2f", order_id, total)
    return {"order_id": order_id, "total": total, "lines": len(lines)}
