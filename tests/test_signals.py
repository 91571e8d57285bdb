"""Signals for integrators, sent by real enqueues and a real runner: ``job_enqueued`` only after
the enqueuing commit, ``job_started``/``job_finished`` per attempt with its outcome,
``job_dead_lettered`` when a job is dead-lettered, a rescued attempt reported by its rescuer,
and a failing receiver never changes a job's fate."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import connection, transaction

from django_persistent_jobs import enqueue, enqueue_many, signals
from django_persistent_jobs.models import JobStatus, PersistentJob
from django_persistent_jobs.runner import Runner
from tests.core_support import claim_as, wait_for
from tests.runner_support import wait_status

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]


class Recorder:
    """Collects what each signal sent (receivers run in runner threads, hence the lock)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.lock = threading.Lock()

    def receiver(self, name: str) -> Callable[..., None]:
        def receive(sender: Any, **kwargs: Any) -> None:
            with self.lock:
                self.events.append((name, kwargs))
        return receive

    def of(self, name: str, job_id: Any = None) -> list[dict[str, Any]]:
        with self.lock:
            return [kw for n, kw in self.events if n == name and (
                job_id is None or kw.get("job_id", getattr(kw.get("job"), "id", None)) == job_id)]


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    rec = Recorder()
    pairs = [(signals.job_enqueued, rec.receiver("enqueued")),
             (signals.job_started, rec.receiver("started")),
             (signals.job_finished, rec.receiver("finished")),
             (signals.job_dead_lettered, rec.receiver("dead"))]
    for signal, receiver in pairs:
        signal.connect(receiver, weak=False)
    yield rec
    for signal, receiver in pairs:
        signal.disconnect(receiver)


def test_job_enqueued_is_sent_after_commit_and_never_for_a_rollback(recorder: Recorder):
    with transaction.atomic():
        job = enqueue("test.noop", {"n": 1})
        assert recorder.of("enqueued") == []  # not before the commit
    assert [kw["job"].id for kw in recorder.of("enqueued")] == [job.id]
    with pytest.raises(RuntimeError), transaction.atomic():
        enqueue("test.noop", {"n": 2})
        raise RuntimeError("roll back")
    assert len(recorder.of("enqueued")) == 1
    # Skip dedup returning the active job inserts nothing and so announces nothing.
    first = enqueue("test.noop", {}, dedup_key="k")
    again = enqueue("test.noop", {}, dedup_key="k")
    assert again.id == first.id
    assert [kw["job"].id for kw in recorder.of("enqueued")] == [job.id, first.id]


def test_enqueue_many_announces_each_inserted_job_once(recorder: Recorder):
    held = enqueue("test.noop", {}, dedup_key="held")
    recorder.events.clear()
    jobs = enqueue_many([("test.noop", {"i": i}) for i in range(3)])
    keyed = enqueue_many([{"job_type": "test.noop", "dedup_key": "held"},
                          {"job_type": "test.noop", "dedup_key": "new"},
                          {"job_type": "test.noop", "dedup_key": "new"}])
    announced = [kw["job"].id for kw in recorder.of("enqueued")]
    assert announced[:3] == [j.id for j in jobs]
    assert announced[3:] == [keyed[1].id]
    assert held.id not in announced


def test_started_finished_and_dead_lettered_from_a_real_runner(
        recorder: Recorder, start_runner: Callable[..., Runner]):
    flaky = enqueue("test.ledger", {"fail_times": 1})
    doomed = enqueue("test.ledger", {"permanent": True})
    runner = start_runner(concurrency=2)
    wait_status(flaky.id, JobStatus.COMPLETED)
    wait_status(doomed.id, JobStatus.DEAD_LETTERED)
    wait_for(lambda: len(recorder.of("finished")) >= 3, message="three finished signals")
    started = recorder.of("started", flaky.id)
    assert [kw["attempt"] for kw in started] == [1, 2]
    assert all(kw["runner_id"] == runner.runner_id and kw["queue"] == "default"
               and kw["due_at"] is not None for kw in started)
    finished = recorder.of("finished", flaky.id)
    assert [(kw["outcome"], kw["status"], kw["error_code"]) for kw in finished] == [
        ("failed", "failed", "PLANNED"), ("completed", "completed", "")]
    assert all(kw["duration"] is not None and kw["duration"] >= 0 for kw in finished)
    [dead_finish] = recorder.of("finished", doomed.id)
    assert (dead_finish["outcome"], dead_finish["error_code"]) == ("dead_lettered",
                                                                   "PLANNED_PERMANENT")
    [dead] = recorder.of("dead", doomed.id)
    assert dead["error_code"] == "PLANNED_PERMANENT" and dead["attempt"] == 1
    assert "planned permanent failure" in dead["error_message"]
    assert recorder.of("dead", flaky.id) == []


def test_a_rescued_attempt_is_reported_by_the_rescuer(
        recorder: Recorder, start_runner: Callable[..., Runner]):
    job = enqueue("test.ledger", {})
    with connection.cursor() as cursor:  # claimed by a runner that never existed
        [claimed] = claim_as(cursor, "ghost-runner", 1, None, ghost=True)
    assert claimed.id == job.id
    runner = start_runner(concurrency=1)
    wait_status(job.id, JobStatus.COMPLETED)
    wait_for(lambda: len(recorder.of("finished", job.id)) >= 2, message="two finishes")
    rescued, completed = recorder.of("finished", job.id)
    assert (rescued["outcome"], rescued["status"], rescued["error_code"]) == (
        "rescued", "failed", "RUNNER_LOST")
    assert rescued["runner_id"] == runner.runner_id and rescued["duration"] is None
    assert (rescued["queue"], rescued["tenant"]) == ("default", None)
    assert completed["outcome"] == "completed"


def test_a_job_that_only_waited_in_a_lost_runner_is_reported_handed_back_not_rescued(
        recorder: Recorder, start_runner: Callable[..., Runner]):
    """A job claimed to wait for a free worker (``PREFETCH``) never started in the runner that
    died: the rescuer hands it back uncharged, and reports what its attempt row says
    (``interrupted``), as a stopping runner does for its unstarted jobs; not ``rescued``,
    which the metrics count as a rescued attempt. No metric series gets an empty queue."""
    from django_persistent_jobs import metrics
    from django_persistent_jobs.models import JobAttempt

    # Read from this process's event metrics, not the exposition: earlier tests of the suite
    # may have left label values in them that are none of this test's business.
    def rescued_count() -> float:
        return sum(s.value for f in metrics.events().rescued.collect() for s in f.samples
                   if s.name == "persistent_jobs_rescued_attempts_total"
                   and s.labels.get("job_type") == "test.ledger")

    assert metrics.enable()
    before = rescued_count()
    job = enqueue("test.ledger", {}, queue="side", tenant="acme")
    with connection.cursor() as cursor:  # claimed to wait by a runner that never existed
        [claimed] = claim_as(cursor, "ghost-runner", 1, ("side",), direct=0, ghost=True)
    assert claimed.id == job.id and claimed.waiting
    runner = start_runner(concurrency=1, queues=("side",))
    wait_status(job.id, JobStatus.COMPLETED)
    wait_for(lambda: len(recorder.of("finished", job.id)) >= 2, message="two finishes")
    handed, completed = recorder.of("finished", job.id)
    assert (handed["outcome"], handed["status"], handed["error_code"]) == (
        "interrupted", "pending", "RUNNER_LOST")
    assert (handed["queue"], handed["tenant"], handed["runner_id"], handed["duration"]) == (
        "side", "acme", runner.runner_id, None)
    assert completed["outcome"] == "completed" and completed["attempt"] == 1  # not charged
    assert [a.outcome for a in JobAttempt.objects.filter(job_id=job.id).order_by("id")] == [
        "interrupted", "completed"]
    assert rescued_count() == before
    empty = [s for f in metrics.events().collect() for s in f.samples
             if s.labels.get("queue") == ""]
    assert empty == []


def test_a_failing_receiver_does_not_change_the_outcome(start_runner: Callable[..., Runner]):
    def explode(sender: Any, **kwargs: Any) -> None:
        raise RuntimeError("receiver bug")

    signals.job_started.connect(explode, weak=False)
    signals.job_finished.connect(explode, weak=False)
    try:
        job = enqueue("test.ledger", {})
        start_runner(concurrency=1)
        done = wait_status(job.id, JobStatus.COMPLETED)
        assert done.attempts == 1
    finally:
        signals.job_started.disconnect(explode)
        signals.job_finished.disconnect(explode)
    assert PersistentJob.objects.get(pk=job.id).status == JobStatus.COMPLETED


def test_job_enqueued_for_a_recurring_run(recorder: Recorder):
    from django_persistent_jobs import add_schedule, run_schedule_now

    add_schedule("sig-tick", "test.recurring.work", interval=3600, payload={"note": "s"})
    job = run_schedule_now("sig-tick")
    assert [kw["job"].id for kw in recorder.of("enqueued")] == [job.id]
