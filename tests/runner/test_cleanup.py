"""Cleanup of finished jobs: RETENTION per status, attempts deleted with their job, dead letters
kept by default, recent and unfinished jobs never touched."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db import connection

from django_persistent_jobs import enqueue
from django_persistent_jobs.models import JobAttempt, PersistentJob
from django_persistent_jobs.runner import store
from django_persistent_jobs.runner.cleanup import cleanup_once
from tests.core_support import pj_settings


def finished(status: str, age: timedelta, attempts: int = 1) -> PersistentJob:
    job = enqueue("test.noop", {"status": status, "age": age.total_seconds()})
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE persistent_jobs SET status = %s, finished_at = now() - %s, "
            "created_at = now() - %s - interval '1 minute' WHERE id = %s",
            [status, age, age, job.id],
        )
    for number in range(1, attempts + 1):
        JobAttempt.objects.create(job_id=job.id, attempt=number, runner_id="r", outcome="failed")
    return job


def remaining() -> set[Any]:
    return set(PersistentJob.objects.values_list("id", flat=True))


@pytest.fixture
def history() -> dict[str, PersistentJob]:
    days = timedelta(days=1)
    jobs = {
        "old_completed": finished("completed", 8 * days, attempts=2),
        "new_completed": finished("completed", 6 * days),
        "old_cancelled": finished("cancelled", 30 * days),
        "new_cancelled": finished("cancelled", timedelta(hours=1)),
        "old_dead": finished("dead_lettered", 400 * days, attempts=3),
        "new_dead": finished("dead_lettered", 2 * days),
        "pending": enqueue("test.noop", run_at=None),
        "failed": finished("failed", 0 * days),
    }
    # An unfinished job created long ago is not "old": only finished_at counts.
    with connection.cursor() as cursor:
        cursor.execute("UPDATE persistent_jobs SET created_at = now() - interval '1 year', "
                       "finished_at = NULL WHERE id = ANY(%s)",
                       [[jobs["pending"].id, jobs["failed"].id]])
    return jobs


@pytest.mark.django_db
def test_default_retention_deletes_old_completed_and_cancelled_only(
    history: dict[str, PersistentJob],
) -> None:
    assert cleanup_once("default") == 2
    assert remaining() == {j.id for k, j in history.items()
                           if k not in ("old_completed", "old_cancelled")}
    # Attempts go with their job; other jobs keep theirs.
    assert not JobAttempt.objects.filter(job_id=history["old_completed"].id).exists()
    assert JobAttempt.objects.filter(job_id=history["old_dead"].id).count() == 3
    assert cleanup_once("default") == 0  # idempotent


@pytest.mark.django_db
def test_dead_letters_are_deleted_only_when_configured(
    history: dict[str, PersistentJob],
) -> None:
    with pj_settings(RETENTION={"dead_lettered": timedelta(days=30)}):
        assert cleanup_once("default") == 3  # completed/cancelled keep their 7-day default
    assert history["old_dead"].id not in remaining()
    assert history["new_dead"].id in remaining()
    assert not JobAttempt.objects.filter(job_id=history["old_dead"].id).exists()


@pytest.mark.django_db
def test_one_retention_value_applies_to_completed_and_cancelled(
    history: dict[str, PersistentJob],
) -> None:
    with pj_settings(RETENTION=timedelta(minutes=30)):
        assert cleanup_once("default") == 4
    assert remaining() == {j.id for k, j in history.items()
                           if k in ("old_dead", "new_dead", "pending", "failed")}


@pytest.mark.django_db
def test_retention_none_keeps_everything(history: dict[str, PersistentJob]) -> None:
    with pj_settings(RETENTION=None):
        assert cleanup_once("default") == 0
    with pj_settings(RETENTION={"completed": None, "cancelled": 3600}):
        assert cleanup_once("default") == 1  # old_cancelled only
    assert len(remaining()) == len(history) - 1


@pytest.mark.django_db
def test_cleanup_deletes_in_batches_until_done() -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO persistent_jobs (id, job_type, payload, status, max_retries, "
            "finished_at) SELECT gen_random_uuid(), 'test.noop', '{}'::jsonb, 'completed', 3, "
            "now() - interval '30 days' FROM generate_series(1, 12345)"
        )
        cursor.execute(
            "INSERT INTO persistent_jobs_attempts (job_id, attempt, runner_id, outcome) "
            "SELECT id, 1, 'r', 'completed' FROM persistent_jobs"
        )
    keep = enqueue("test.noop")
    assert cleanup_once("default") == 12345
    assert remaining() == {keep.id}
    assert JobAttempt.objects.count() == 0


@pytest.mark.django_db
def test_the_longest_retention_the_check_accepts_is_one_cleanup_can_compute() -> None:
    """The check's bound is what cleanup's ``finished_at < now() - interval`` can compute: a
    larger one passed the check and then failed every cleanup ("timestamp out of range")."""
    from django_persistent_jobs import bounds

    kept = finished("dead_lettered", timedelta(days=3000))
    longest = timedelta(seconds=bounds.MAX_SECONDS)
    with pj_settings(RETENTION={"completed": longest, "cancelled": longest,
                                "dead_lettered": longest}):
        assert cleanup_once("default") == 0
    with pj_settings(RETENTION={"dead_lettered": timedelta(days=2000)}):
        assert cleanup_once("default") == 1
    assert kept.id not in remaining()


@pytest.mark.django_db
def test_a_finished_row_without_finished_at_is_aged_by_its_last_update() -> None:
    """Rows written by hand (the ORM, a restored backup) may be terminal with no
    ``finished_at``: they are deleted once their last update is past the retention."""
    old = enqueue("test.noop", {"n": 1})
    recent = enqueue("test.noop", {"n": 2})
    PersistentJob.objects.filter(pk=old.pk).update(
        status="completed", finished_at=None, updated_at=timedelta(days=-30) + _now())
    PersistentJob.objects.filter(pk=recent.pk).update(status="completed", finished_at=None)
    assert cleanup_once("default") == 1
    assert remaining() == {recent.id}


@pytest.mark.django_db
def test_cleanup_reads_the_job_table_through_its_index_only() -> None:
    """Both of its conditions (a finished time, or none and an old update) are index searches:
    with a million finished rows kept, a round must not read the table whole."""
    finished("completed", timedelta(days=30))
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")  # what a big table's planner picks
        cursor.execute("SELECT seq_scan FROM pg_stat_xact_user_tables "
                       "WHERE relname = 'persistent_jobs'")
        [before] = cursor.fetchone()
        assert store.cleanup(cursor, "completed", 86400.0) == 1
        cursor.execute("SELECT seq_scan FROM pg_stat_xact_user_tables "
                       "WHERE relname = 'persistent_jobs'")
        [after] = cursor.fetchone()
    assert after == before


def _now() -> Any:
    from django.utils import timezone

    return timezone.now()


@pytest.mark.django_db
def test_a_finished_job_the_database_refuses_to_delete_is_kept_and_the_rest_go(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A project's own foreign key to a finished job (what ``ForeignKey(PersistentJob)``
    makes) refuses its deletion. The batch it is in used to fail as a whole, and the error
    stopped the runner (the cleanup loop died, at start-up too). Now that job is kept, logged
    ``cleanup_refused``, and left out of later batches; the rest of the batch goes."""
    from django_persistent_jobs.runner import cleanup

    days = timedelta(days=1)
    referenced = finished("completed", 8 * days, attempts=2)
    others = [finished("completed", 8 * days) for _ in range(3)]
    with connection.cursor() as cursor:
        cursor.execute("CREATE TABLE pj_test_invoice (job_id uuid REFERENCES persistent_jobs(id))")
        cursor.execute("INSERT INTO pj_test_invoice VALUES (%s)", [referenced.id])
    try:
        assert cleanup_once("default") == 3
        assert remaining() == {referenced.id}
        assert JobAttempt.objects.filter(job_id=referenced.id).count() == 2  # kept whole
        assert any(getattr(r, "event", None) == "cleanup_refused" and r.refused == 1
                   for r in caplog.records)
        caplog.clear()
        more = finished("completed", 8 * days)
        assert cleanup_once("default") == 1  # left out: the batch is not refused again
        assert more.id not in remaining() and referenced.id in remaining()
        assert not any(getattr(r, "event", None) == "cleanup_refused" for r in caplog.records)
        assert {o.id for o in others} & remaining() == set()
    finally:
        cleanup._refused.pop("default", None)
