"""``queries``: the list filters' SQL, checked on the plans PostgreSQL picks, and the id bounds
that let a ``created_after``/``created_before`` filter range-scan the primary key."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection

from django_persistent_jobs import queries
from django_persistent_jobs.models import PersistentJob
from tests.api_support import stage

pytestmark = pytest.mark.django_db


def plan_of(job_filter: queries.JobFilter) -> str:
    """The plan of the list's query (``list_jobs``), with sequential scans discouraged as a
    table of millions would (this one holds a handful of rows)."""
    qs = (job_filter.apply(queries.jobs_queryset()).order_by("-id")
          .defer("payload", "result", "progress")[:51])
    sql, params = qs.query.sql_with_params()
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute(f"EXPLAIN {sql}", params)
        return "\n".join(row[0] for row in cursor.fetchall())


@pytest.mark.parametrize(("query", "bound"), [
    ({"created_before": ["2000-01-01T00:00:00Z"]}, "id <"),
    ({"created_after": ["2000-01-01T00:00:00Z"]}, "id >="),
    ({"created_after": ["2000-01-01T00:00:00Z"], "created_before": ["2001-01-01T00:00:00Z"]},
     "id >="),
])
def test_a_created_at_range_range_scans_the_primary_key(query: dict[str, list[str]],
                                                        bound: str) -> None:
    """With a million finished jobs, ``?created_before=`` far in the past walked the whole
    primary key newest first testing ``created_at`` on each row (0.4 s): the id bound is an
    ``Index Cond`` of the primary key now, not only a ``Filter``."""
    stage()
    plan = plan_of(queries.build_filter(query))
    index_conditions = [line for line in plan.splitlines() if "Index Cond" in line]
    assert any(bound in line for line in index_conditions), plan
    assert "persistent_jobs_pkey" in plan, plan


def test_the_id_bounds_keep_jobs_whose_id_time_is_off_by_less_than_the_margin() -> None:
    """A job's id carries the app server's clock when ``enqueue`` ran; its ``created_at`` is
    the database's at the start of the enqueuing transaction: a long transaction or a skewed
    clock puts them hours apart. The filter still means ``created_at``, exactly."""
    early = stage()  # enqueued in a transaction opened 23 hours before (created_at earlier)
    late = stage()  # or a database clock ahead of the app's
    PersistentJob.objects.filter(pk=early.pk).update(
        created_at=early.created_at - timedelta(hours=23))
    PersistentJob.objects.filter(pk=late.pk).update(
        created_at=late.created_at + timedelta(hours=23))
    early.refresh_from_db()
    late.refresh_from_db()

    def ids(**bounds: datetime) -> set[str]:
        job_filter = queries.JobFilter(**bounds)  # type: ignore[arg-type]
        return {str(j.id) for j in queries.list_jobs(job_filter, limit=500).jobs}

    second = timedelta(seconds=1)
    assert ids(created_after=early.created_at, created_before=early.created_at + second) == {
        str(early.id)}
    assert ids(created_after=late.created_at, created_before=late.created_at + second) == {
        str(late.id)}
    assert ids(created_before=early.created_at) == set()
    assert ids(created_after=late.created_at + second) == set()
    assert ids(created_before=late.created_at + second) == {str(early.id), str(late.id)}
    assert str(early.id) in {str(i) for i in queries.iter_matching(
        queries.JobFilter(created_before=early.created_at + second))}


def test_id_range_at_the_edges_of_time_bounds_only_what_it_can() -> None:
    """Dates before 1970 (or past what 48 bits of milliseconds hold) give no id bound rather
    than an error or a wrong one; the ``created_at`` condition still applies."""
    ancient = datetime(1, 1, 2, 0, 0, 1, tzinfo=UTC)
    last = datetime(9999, 12, 30, 23, 59, tzinfo=UTC)
    assert queries.id_range(ancient, None) == (None, None)
    assert queries.id_range(datetime(1969, 12, 31, tzinfo=UTC), None) == (None, None)
    low, high = queries.id_range(None, last)
    assert low is None and high is not None
    job = stage()
    for after, before in ((ancient, None), (None, last), (ancient, last)):
        found = queries.list_jobs(queries.JobFilter(created_after=after, created_before=before))
        assert [j.id for j in found.jobs] == [job.id]


def test_the_api_filter_agrees_with_created_at() -> None:
    from django.test import Client

    from tests.api_support import ALL_PERMS, bearer, make_token, make_user

    secret = make_token(make_user("operator", *ALL_PERMS))
    job = stage()
    client = Client()
    for query, expected in (("created_before=2000-01-01T00:00:00Z", []),
                            ("created_after=2000-01-01T00:00:00Z", [str(job.id)]),
                            ("created_after=0001-01-02T00:00:01Z", [str(job.id)]),
                            ("created_before=9999-12-30T00:00:00Z", [str(job.id)])):
        response = client.get(f"/jobs/?{query}", **bearer(secret))
        assert response.status_code == 200, response.content[:300]
        assert [j["id"] for j in response.json()["results"]] == expected, query
