"""Operator actions: retry_job (now / later / reset) and cancel_job, including cancelling a job
that is running in a real runner."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from django.db import DatabaseError, connection, transaction

from django_persistent_jobs import (
    InvalidJobStateError,
    JobContext,
    JobNotFoundError,
    cancel_job,
    enqueue,
    job_handler,
    retry_job,
)
from django_persistent_jobs.backoff import constant
from django_persistent_jobs.models import JobAttempt, JobStatus, PersistentJob
from django_persistent_jobs.runner import Runner, store
from tests.core_support import (
    claim_as,
    db_now,
    notifications_until_marker,
    raw_connection,
    refusing_updates,
    wait_for,
)

STARTED = threading.Event()
SAW_CANCEL: list[bool] = []


@job_handler("core.svc.slow_backoff", backoff=constant(120), max_retries=3)
def slow_backoff(payload: Any) -> None:
    return None


@job_handler("core.svc.cancellable", timeout=30, max_retries=5)
def cancellable(payload: dict[str, Any], ctx: JobContext) -> None:
    STARTED.set()
    cancelled = ctx.wait_for_cancel(20)
    SAW_CANCEL.append(ctx.cancel_requested)
    if cancelled and payload.get("obey", True):
        ctx.raise_if_cancelled()
    if cancelled:
        raise RuntimeError("ignored the cancellation and failed anyway")



def claim_one() -> store.ClaimedJob:
    with connection.cursor() as cursor:
        (job,) = claim_as(cursor, "core-svc", 1, None)
    return job


def make(status: str, job_type: str = "core.svc.slow_backoff", **fields: Any) -> PersistentJob:
    """A job put straight into ``status`` (operators meet jobs in every state)."""
    job = enqueue(job_type, {"n": 1}, dedup_key=fields.pop("dedup_key", None))
    values: dict[str, Any] = {"status": status, **fields}
    if status in ("completed", "dead_lettered", "cancelled"):
        values.setdefault("finished_at", db_now())
    PersistentJob.objects.filter(id=job.id).update(**values)
    return PersistentJob.objects.get(id=job.id)


@pytest.fixture
def listener() -> Iterator[psycopg.Connection[Any]]:
    with raw_connection() as conn:
        conn.execute("LISTEN persistent_jobs")
        yield conn


# ------------------------------------------------------------------ retry_job

@pytest.mark.django_db
def test_retry_now_makes_a_dead_letter_due_with_one_more_attempt() -> None:
    job = make("dead_lettered", attempts=4, max_retries=3, last_error="boom",
               last_error_code="BOOM", next_run_at=db_now() - timedelta(hours=1))
    result = retry_job(job.id, mode="now")
    assert isinstance(result, PersistentJob)
    assert (result.status, result.attempts, result.max_retries) == ("pending", 4, 4)
    assert result.next_run_at == db_now()
    assert (result.last_error, result.last_error_code) == ("boom", "BOOM")  # history kept
    assert result.finished_at is None and result.locked_by is None and result.lock_token is None
    stored = PersistentJob.objects.get(id=job.id)
    assert (stored.status, stored.max_retries, stored.next_run_at) == ("pending", 4, db_now())
    # Default mode is "now", and string ids work.
    again = make("dead_lettered", attempts=1, max_retries=3)
    assert retry_job(str(again.id)).max_retries == 3  # retries left: not bumped


@pytest.mark.django_db
def test_retry_later_waits_for_the_handlers_backoff() -> None:
    job = make("dead_lettered", attempts=4, max_retries=3, last_error_code="BOOM")
    result = retry_job(job.id, mode="later")
    assert result.status == "pending" and result.attempts == 4 and result.max_retries == 4
    assert result.next_run_at == db_now() + timedelta(seconds=120)


@pytest.mark.django_db
def test_retry_reset_starts_over() -> None:
    job = make("dead_lettered", attempts=4, max_retries=3, last_error="boom",
               last_error_code="BOOM", cancel_requested=True)
    result = retry_job(job.id, mode="reset")
    assert (result.status, result.attempts, result.max_retries) == ("pending", 0, 3)
    assert (result.last_error, result.last_error_code) == ("", "")
    assert result.next_run_at == db_now() and not result.cancel_requested


@pytest.mark.django_db
def test_retry_reset_frees_the_hand_backs_too_and_the_other_modes_keep_them() -> None:
    """A job dead-lettered for hand-backs past ``HANDBACK_LIMIT`` (``INTERRUPTED``) and reset
    starts over: its next hand-back (a deploy stopping its runner) is free again rather than
    charged at once as a failed attempt."""
    job = make("dead_lettered", attempts=4, max_retries=3, handbacks=7,
               last_error_code="INTERRUPTED")
    assert retry_job(job.id, mode="reset").handbacks == 0
    assert PersistentJob.objects.get(id=job.id).handbacks == 0
    for mode in ("now", "later"):
        kept = make("dead_lettered", attempts=4, max_retries=3, handbacks=7)
        assert retry_job(kept.id, mode=mode).handbacks == 7, mode


@pytest.mark.django_db
def test_retry_applies_to_failed_cancelled_and_pending_jobs() -> None:
    failed = make("failed", attempts=1, next_run_at=db_now() + timedelta(hours=1))
    assert retry_job(failed.id).next_run_at == db_now()  # no need to wait for the backoff
    cancelled = make("cancelled", cancel_requested=True, last_error_code="CANCELLED")
    result = retry_job(cancelled.id)
    assert result.status == "pending" and not result.cancel_requested
    assert result.finished_at is None
    delayed = make("pending", next_run_at=db_now() + timedelta(days=1))
    assert retry_job(delayed.id).next_run_at == db_now()
    (claimed,) = [claim_one()]
    assert claimed.id in {failed.id, cancelled.id, delayed.id}


@pytest.mark.django_db
@pytest.mark.parametrize("status", ["running", "completed"])
def test_retry_refuses_running_and_completed_jobs(status: str) -> None:
    job = make(status)
    with pytest.raises(InvalidJobStateError) as info:
        retry_job(job.id)
    assert str(info.value) == (f"Job {job.id} is {status}; only failed, dead-lettered, cancelled "
                               "or pending jobs can be retried.")
    assert PersistentJob.objects.get(id=job.id).status == status


@pytest.mark.django_db
def test_retry_refuses_bad_ids_and_modes() -> None:
    missing = uuid.uuid4()
    with pytest.raises(JobNotFoundError, match=f"No job with id {missing}."):
        retry_job(missing)
    with pytest.raises(JobNotFoundError, match=r"'not-a-uuid' is not a job id \(a UUID\)\."):
        retry_job("not-a-uuid")
    job = make("dead_lettered")
    with pytest.raises(ValueError, match=r"mode must be one of \('now', 'later', 'reset'\), "
                                         r"got 'soon'\."):
        retry_job(job.id, mode="soon")  # type: ignore[arg-type]


@pytest.mark.django_db
def test_retry_refuses_when_a_newer_job_holds_the_dedup_key() -> None:
    old = make("cancelled", dedup_key="k")
    newer = enqueue("core.svc.slow_backoff", {"n": 2}, dedup_key="k")
    with pytest.raises(InvalidJobStateError) as info:
        retry_job(old.id)
    assert ("another waiting job of type 'core.svc.slow_backoff' holds dedup key 'k'"
            in str(info.value))
    # The caller's transaction is still usable, and nothing changed.
    assert PersistentJob.objects.get(id=old.id).status == "cancelled"
    assert PersistentJob.objects.get(id=newer.id).status == "pending"


@pytest.mark.django_db(transaction=True)
def test_retry_now_wakes_runners_and_later_does_not(listener: psycopg.Connection[Any]) -> None:
    later = make("dead_lettered", attempts=4)
    now = make("dead_lettered", attempts=4)
    notifications_until_marker(listener, "setup")  # drain the inserts' wake-ups
    retry_job(later.id, mode="later")
    retry_job(now.id, mode="now")
    assert notifications_until_marker(listener, "m") == [str(now.id)]


# ------------------------------------------------------------------ cancel_job

@pytest.mark.django_db
@pytest.mark.parametrize("status", ["pending", "failed"])
def test_cancel_a_waiting_job(status: str) -> None:
    job = make(status)
    result = cancel_job(job.id)
    assert result.status == JobStatus.CANCELLED and result.cancel_requested
    assert result.finished_at == db_now()
    assert (result.last_error_code, result.last_error) == ("CANCELLED", "cancelled by an operator")
    assert PersistentJob.objects.get(id=job.id).status == "cancelled"
    with connection.cursor() as cursor:
        assert claim_as(cursor, "core-svc", 10, None) == []


@pytest.mark.django_db
@pytest.mark.parametrize("status", ["completed", "dead_lettered", "cancelled"])
def test_cancel_refuses_finished_jobs(status: str) -> None:
    job = make(status)
    with pytest.raises(InvalidJobStateError) as info:
        cancel_job(job.id)
    assert str(info.value) == (f"Job {job.id} is {status}; only pending, failed or running jobs "
                               "can be cancelled.")


@pytest.mark.django_db
def test_a_refused_cancel_inside_a_transaction_leaves_it_usable_for_the_next() -> None:
    """Inside a caller's transaction (``ATOMIC_REQUESTS``, an ``atomic()`` block, the admin's
    bulk action) a cancel that the database refuses undoes only itself: the next cancel in the
    same transaction succeeds instead of failing with "current transaction is aborted"."""
    frozen, other = make("pending"), make("pending")
    with transaction.atomic(), refusing_updates(
            "pj_svc_refuse", "persistent_jobs", f"OLD.id = '{frozen.id}'", "frozen for an audit"):
        with pytest.raises(DatabaseError, match="frozen for an audit"):
            cancel_job(frozen.id)
        assert cancel_job(other.id).status == JobStatus.CANCELLED
    assert PersistentJob.objects.get(id=other.id).status == "cancelled"
    assert PersistentJob.objects.get(id=frozen.id).status == "pending"


@pytest.mark.django_db
def test_cancel_refuses_unknown_ids() -> None:
    with pytest.raises(JobNotFoundError, match="No job with id"):
        cancel_job(uuid.uuid4())
    with pytest.raises(JobNotFoundError, match="is not a job id"):
        cancel_job(12)


@pytest.mark.django_db
def test_cancelling_a_running_job_requests_and_the_request_wins_over_a_retry() -> None:
    job = enqueue("core.svc.slow_backoff", {"n": 1})
    claimed = claim_one()
    result = cancel_job(job.id)
    assert result.status == "running" and result.cancel_requested
    assert result.finished_at is None and result.lock_token == claimed.token
    with connection.cursor() as cursor:
        assert store.cancel_requests(cursor, "core-svc") == [(job.id, claimed.token)]
        assert store.transition(cursor, job.id, claimed.token, kind="retry",
                                code="HANDLER_ERROR", message="failed after the request") == (
            "cancelled")
    assert PersistentJob.objects.get(id=job.id).status == "cancelled"


@pytest.mark.django_db(transaction=True)
def test_cancel_reaches_a_running_handler_through_its_context(
    start_runner: Callable[..., Runner],
) -> None:
    STARTED.clear()
    SAW_CANCEL.clear()
    job = enqueue("core.svc.cancellable", {"obey": True})
    start_runner(scheduler=False)
    assert STARTED.wait(20), "handler did not start"
    assert PersistentJob.objects.get(id=job.id).status == "running"
    requested = cancel_job(job.id)
    assert requested.status == "running" and requested.cancel_requested
    wait_for(lambda: PersistentJob.objects.get(id=job.id).status == "cancelled",
             message="the handler to stop on the cancellation request")
    assert SAW_CANCEL == [True]
    (attempt,) = JobAttempt.objects.filter(job_id=job.id)
    assert (attempt.outcome, attempt.error_code) == ("cancelled", "CANCELLED")

    # A handler that ignores the request and fails is not retried either.
    STARTED.clear()
    stubborn = enqueue("core.svc.cancellable", {"obey": False})
    assert STARTED.wait(20)
    cancel_job(stubborn.id)
    wait_for(lambda: PersistentJob.objects.get(id=stubborn.id).status == "cancelled",
             message="the stubborn job to end cancelled")
    stored = PersistentJob.objects.get(id=stubborn.id)
    assert stored.attempts == 1 and stored.last_error_code == "HANDLER_ERROR"


@pytest.mark.django_db
def test_retry_later_with_a_broken_backoff_says_so_and_changes_nothing() -> None:
    from django_persistent_jobs import ConfigurationError
    from django_persistent_jobs.handlers import registry

    with registry.isolated():
        job_handler("core.svc.inf_backoff", backoff=lambda attempt: float("inf"))(
            lambda payload: None)
        job = make("dead_lettered", job_type="core.svc.inf_backoff", attempts=2)
        with pytest.raises(ConfigurationError, match=r"returned inf seconds for attempt 2"):
            retry_job(job.id, mode="later")
        assert PersistentJob.objects.get(id=job.id).status == "dead_lettered"
        assert retry_job(job.id, mode="now").status == "pending"


@pytest.mark.django_db
def test_retry_later_with_a_backoff_that_raises_says_so_and_changes_nothing() -> None:
    """The handler's backoff is the application's code: an exception from it is the
    operator's error message (a refusal the API, the admin and ``jobs retry`` all show), not a
    traceback, and the job is left as it was."""
    from django_persistent_jobs import ConfigurationError
    from django_persistent_jobs.handlers import registry

    def broken(attempt: int) -> float:
        raise KeyError("no such tier")

    with registry.isolated():
        job_handler("core.svc.raising_backoff", backoff=broken)(lambda payload: None)
        job = make("dead_lettered", job_type="core.svc.raising_backoff", attempts=3)
        with pytest.raises(ConfigurationError,
                           match=r"raised KeyError: 'no such tier' for attempt 3"):
            retry_job(job.id, mode="later")
        assert PersistentJob.objects.get(id=job.id).status == "dead_lettered"
        assert retry_job(job.id, mode="now").status == "pending"
