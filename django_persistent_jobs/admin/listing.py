"""What keeps the job and attempt lists fast on tables of millions of rows.

Django's admin counts the rows of every list it shows (the paginator's ``COUNT(*)``, even with
``show_full_result_count = False``, which only drops the second, unfiltered count), and an
``AllValuesFieldListFilter`` lists its choices with a ``SELECT DISTINCT`` over the whole table,
every value in the sidebar. On a table of a million finished jobs each of those reads every row
on every page load. Here:

- ``EstimatedCountPaginator`` counts exactly up to ``EXACT_UP_TO`` rows (a count over a
  ``LIMIT``, which stops there) and beyond that takes PostgreSQL's planner estimate for the same
  query (``EXPLAIN``, no rows read); the list says when its count is an estimate.
- ``values_filter`` makes a sidebar filter of one column (the same parameters as Django's, so
  links keep working) whose choices come from somewhere cheap: the handler registry and the
  settings for job types and queues, an index for tenants (a loose index scan: one index probe
  per tenant listed, at most ``MAX_CHOICES``), the latest failed attempts for error codes, the
  runners table and the latest attempts for runner ids. A value given in the URL is always
  listed, so a link to a value the sidebar does not list still shows it selected.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from functools import cached_property
from typing import Any

from django.contrib import admin
from django.core.paginator import Paginator
from django.db import connections
from django.db.models import QuerySet
from django.http import HttpRequest

from .. import conf
from ..handlers import registry
from ..models import JobAttempt, JobRunnerRecord, JobStatus, PersistentJob
from ..stats import FAILED_OUTCOMES
from .database import alias, objects

#: Up to this many rows a list's count is exact; beyond, it is the planner's estimate.
EXACT_UP_TO = 10_000
#: At most this many choices in a sidebar filter fed from the tables (tenants, codes, runners).
MAX_CHOICES = 100
#: Error codes and runner ids are taken from this many of the latest attempts.
RECENT_ATTEMPTS = 1_000


def planner_rows(queryset: QuerySet[Any]) -> int:
    """How many rows PostgreSQL's planner expects ``queryset`` to return (``EXPLAIN``: it
    plans the query from the table statistics and reads no row)."""
    sql, params = queryset.query.get_compiler(using=queryset.db).as_sql()
    with connections[queryset.db].cursor() as cursor:
        cursor.execute(f"EXPLAIN (FORMAT JSON) {sql}", params)
        plan = cursor.fetchone()[0]
    if isinstance(plan, str):
        plan = json.loads(plan)
    return int(plan[0]["Plan"]["Plan Rows"])


class EstimatedCountPaginator(Paginator):  # type: ignore[type-arg]
    """A paginator whose count reads at most ``EXACT_UP_TO`` + 1 rows (see the module)."""

    #: Whether ``count`` is the planner's estimate (the list then says so).
    estimated = False

    @property
    def exact_up_to(self) -> int:
        """Up to how many rows the count is exact (for the list's note)."""
        return EXACT_UP_TO

    @cached_property
    def count(self) -> int:
        queryset: QuerySet[Any] = self.object_list.order_by()  # type: ignore[attr-defined]
        counted = queryset.values("pk")[:EXACT_UP_TO + 1].count()
        if counted <= EXACT_UP_TO:
            return counted
        self.estimated = True
        return max(planner_rows(queryset.values("pk")), EXACT_UP_TO + 1)


def values_filter(values: Callable[[], Iterable[str]], *, empty: bool = False,
                  ) -> type[admin.AllValuesFieldListFilter]:
    """A sidebar filter on one column listing ``values()`` (sorted; a value given in the URL
    too) instead of every distinct value in the table; ``empty`` adds the "-" choice (the
    column is NULL)."""

    class ValuesFilter(admin.AllValuesFieldListFilter):
        def __init__(self, field: Any, request: HttpRequest, params: dict[str, Any],
                     model: Any, model_admin: Any, field_path: str) -> None:
            super().__init__(field, request, params, model, model_admin, field_path)
            raw: Any = self.lookup_val or []
            given = [raw] if isinstance(raw, str) else list(raw)
            choices: list[str | None] = [*sorted(
                {str(value) for value in values() if value} | {str(v) for v in given if v})]
            # (Replaces the parent's SELECT DISTINCT over the table, which is lazy: never run.)
            self.lookup_choices = [*choices, None] if empty else choices  # type: ignore[assignment]

    return ValuesFilter


# ------------------------------------------------------------------ where the choices come from

def job_types() -> list[str]:
    """The job types this process has handlers for."""
    return registry.job_types()


def queues() -> set[str]:
    """The queues the handlers, the settings and the registered runners name."""
    found = {spec.effective_queue() for spec in registry}
    found.add(conf.settings.DEFAULT_QUEUE)
    found.update(conf.settings.QUEUES or ())
    for listed in objects(JobRunnerRecord).values_list("queues", flat=True)[:MAX_CHOICES]:
        if isinstance(listed, list):
            found.update(str(queue) for queue in listed)
    return found


def tenants(limit: int = MAX_CHOICES) -> list[str]:
    """The first ``limit`` tenants in order, by a loose index scan of the tenant index
    (``pj_tenant_status_idx``): each step is one probe for the next tenant, so the cost is the
    number listed, however many jobs each tenant has."""
    connection = connections[alias()]
    table = connection.ops.quote_name(PersistentJob._meta.db_table)
    sql = f"""
        WITH RECURSIVE t(tenant) AS (
            (SELECT tenant FROM {table} WHERE tenant IS NOT NULL ORDER BY tenant LIMIT 1)
            UNION ALL
            SELECT (SELECT j.tenant FROM {table} j
                    WHERE j.tenant IS NOT NULL AND j.tenant > t.tenant
                    ORDER BY j.tenant LIMIT 1)
            FROM t WHERE t.tenant IS NOT NULL
        )
        SELECT tenant FROM t WHERE tenant IS NOT NULL LIMIT %s"""
    with connection.cursor() as cursor:
        cursor.execute(sql, [limit])
        return [row[0] for row in cursor.fetchall()]


def recent_error_codes() -> list[str]:
    """The error codes of recent failures, the first ``MAX_CHOICES`` in order: those of the
    latest ``RECENT_ATTEMPTS`` failed attempts (through the failed-attempts index, newest
    first), and the last error codes of as many failed and of the latest dead-lettered jobs
    (through the claim and finished-jobs indexes). Each read stops at its ``LIMIT``."""
    attempts = (objects(JobAttempt).filter(outcome__in=FAILED_OUTCOMES)
                .order_by("-finished_at").values_list("error_code", flat=True)[:RECENT_ATTEMPTS])
    failed = (objects(PersistentJob).filter(status=JobStatus.FAILED).order_by()
              .values_list("last_error_code", flat=True)[:RECENT_ATTEMPTS])
    dead = (objects(PersistentJob).filter(status=JobStatus.DEAD_LETTERED)
            .order_by("-finished_at").values_list("last_error_code", flat=True)[:RECENT_ATTEMPTS])
    return sorted({*attempts, *failed, *dead} - {""})[:MAX_CHOICES]


def runner_ids() -> list[str]:
    """The registered runners and the runners of the latest ``RECENT_ATTEMPTS`` attempts."""
    found = set(objects(JobRunnerRecord).values_list("id", flat=True)[:MAX_CHOICES])
    found.update(objects(JobAttempt).order_by("-id")
                 .values_list("runner_id", flat=True)[:RECENT_ATTEMPTS])
    return sorted(found)[:MAX_CHOICES]
