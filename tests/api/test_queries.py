"""``queries``: the ``created_after``/``created_before`` filters mean ``created_at``, exactly."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta

import pytest

from django_persistent_jobs import queries
from django_persistent_jobs.models import PersistentJob
from tests.api_support import stage

pytestmark = pytest.mark.django_db


def test_the_created_filters_mean_created_at_exactly_whatever_the_id_says() -> None:
    """A job's id carries the app server's clock when ``enqueue`` ran; its ``created_at`` is
    the database's at the start of the enqueuing transaction: a long transaction or a skewed
    clock puts them hours apart. The filter still means ``created_at``, exactly."""
    early = stage()  # enqueued in a transaction opened days before (created_at earlier)
    late = stage()  # or a database clock ahead of the app's
    PersistentJob.objects.filter(pk=early.pk).update(
        created_at=early.created_at - timedelta(days=3))
    PersistentJob.objects.filter(pk=late.pk).update(
        created_at=late.created_at + timedelta(days=3))
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
    # A row written by hand with a random (not time-ordered) id is found by its created_at.
    stranger = PersistentJob.objects.create(id=uuid.uuid4(), job_type="test.noop")
    stranger.refresh_from_db()
    assert str(stranger.id) in ids(created_after=stranger.created_at,
                                   created_before=stranger.created_at + second)


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
