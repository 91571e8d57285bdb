"""The job and attempt lists read a bounded number of rows, however large the tables.

Asserted on the SQL the pages issue (not on timings): no ``COUNT`` that is not over a
``LIMIT``, no ``SELECT DISTINCT`` over a table without a ``LIMIT``, the attempt list in id
order (the primary key's index), and a count past the exact limit taken from the planner.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from django_persistent_jobs import enqueue, job_handler
from django_persistent_jobs.admin import listing
from django_persistent_jobs.models import JobAttempt, JobRunnerRecord, PersistentJob
from tests.admin.pages import ATTEMPTS, JOBS
from tests.core_support import db_now, staff_client


@job_handler("listq.a")
def listq_a(payload: Any) -> None:
    return None


def unbounded(sql: str) -> list[str]:
    """What in ``sql`` reads a whole table: a COUNT or a DISTINCT with no LIMIT after it."""
    problems = []
    upper = " ".join(sql.upper().split())
    for match in re.finditer(r"COUNT\(|SELECT DISTINCT", upper):
        if "LIMIT" not in upper[match.start():]:
            problems.append(f"{match.group(0)} without a LIMIT: {sql[:300]}")
    return problems


def fill() -> None:
    now = db_now()
    for tenant in ("acme", "globex", None):
        job = enqueue("listq.a", {}, tenant=tenant)
        PersistentJob.objects.filter(pk=job.pk).update(status="dead_lettered", attempts=1,
                                                       last_error_code="BOOM",
                                                       finished_at=now)
        JobAttempt.objects.create(job_id=job.pk, attempt=1, runner_id="h:1:r",
                                  outcome="dead_lettered", error_code="BOOM",
                                  error_message="x", started_at=now, finished_at=now)
    JobRunnerRecord.objects.create(id="h:2:r", hostname="h", pid=2, concurrency=1,
                                   heartbeat_at=now, queues=["mail"])


@pytest.mark.django_db
@pytest.mark.parametrize("url", [JOBS, ATTEMPTS])
def test_an_unfiltered_list_issues_no_unbounded_count_or_distinct(url: str) -> None:
    fill()
    client: Client = staff_client("viewer", "view_persistentjob")
    client.get(reverse(url))  # (sessions, content types: cached after the first load)
    with CaptureQueriesContext(connection) as queries:
        response = client.get(reverse(url))
    assert response.status_code == 200
    problems = [p for q in queries.captured_queries for p in unbounded(q["sql"])]
    assert not problems, problems
    assert len(queries.captured_queries) <= 12, [q["sql"] for q in queries.captured_queries]
    page = response.content.decode()
    # The sidebar still offers what there is to filter on.
    for value in ("acme", "globex", "BOOM", "listq.a"):
        assert value in page, value
    if url == JOBS:
        assert "mail" in page  # a queue a runner serves
    else:
        assert "h:1:r" in page and "h:2:r" in page  # runners of attempts, and registered ones


@pytest.mark.django_db
def test_the_attempt_list_is_in_id_order_newest_first() -> None:
    fill()
    client: Client = staff_client("viewer", "view_persistentjob")
    with CaptureQueriesContext(connection) as queries:
        response = client.get(reverse(ATTEMPTS))
    rows = response.context["cl"].result_list
    assert [a.pk for a in rows] == sorted((a.pk for a in rows), reverse=True)
    listed = [q["sql"] for q in queries.captured_queries
              if 'FROM "persistent_jobs_attempts"' in q["sql"] and "ORDER BY" in q["sql"]
              and 'INNER JOIN "persistent_jobs"' in q["sql"]]
    assert listed and all('ORDER BY "persistent_jobs_attempts"."id" DESC' in sql
                          for sql in listed), listed


@pytest.mark.django_db
def test_past_the_exact_limit_the_count_is_the_planners_estimate_and_said_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fill()
    monkeypatch.setattr(listing, "EXACT_UP_TO", 2)
    client: Client = staff_client("viewer", "view_persistentjob")
    response = client.get(reverse(JOBS))
    assert response.status_code == 200
    assert response.context["cl"].paginator.estimated
    assert response.context["cl"].result_count >= 3
    assert "estimate" in response.content.decode()
    exact = client.get(reverse(JOBS) + "?tenant=acme")
    assert not exact.context["cl"].paginator.estimated
    assert exact.context["cl"].result_count == 1
    assert "estimate" not in exact.content.decode()


@pytest.mark.django_db
def test_a_value_given_in_the_url_is_listed_even_when_no_source_names_it() -> None:
    fill()
    enqueue("listq.a", {}, queue="rare-queue")
    client: Client = staff_client("viewer", "view_persistentjob")
    response = client.get(reverse(JOBS) + "?queue=rare-queue")
    assert response.status_code == 200 and len(response.context["cl"].result_list) == 1
    assert "rare-queue" in response.content.decode()
