"""Batched completions: the jobs of handlers that ran no SQL are completed together, one fenced
statement and one commit per batch, and each job still gets its own answer (completed, or claim
lost), its own signal and log line, after the commit. Handlers that wrote to the database keep
their completion in their own transaction."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from django_persistent_jobs import JobContext, enqueue, enqueue_many, job_handler
from django_persistent_jobs.handlers import Registry
from django_persistent_jobs.models import JobAttempt, PersistentJob
from django_persistent_jobs.runner import Runner, store
from django_persistent_jobs.runner.completer import Completer
from django_persistent_jobs.runner.db import sqlstate
from django_persistent_jobs.runner.starts import StartLog
from tests.core_support import (
    claim_as,
    pj_settings,
    raw_connection,
    refusing_updates,
    subprocess_env,
    wait_for,
)
from tests.faults.batch_handlers import runs_of
from tests.runner_support import Gate, attempts_of, finished, isolated_registry
from tests.testapp.models import LedgerEntry

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

__all__ = ["finished", "isolated_registry"]  # fixtures, used by name

StartRunner = Callable[..., Runner]

def commits() -> int:
    with raw_connection() as conn:
        row = conn.execute("SELECT xact_commit FROM pg_stat_database "
                           "WHERE datname = current_database()").fetchone()
    assert row is not None
    return int(row[0])


def claim(count: int) -> list[store.ClaimedJob]:
    with raw_connection() as conn, conn.cursor() as cursor:
        return claim_as(cursor, "completer-test", count, None)


def complete_from_threads(completer: Completer, jobs: list[store.ClaimedJob]) -> dict[Any, Any]:
    """Hand every job to ``completer`` from a thread of its own (as the workers do)."""
    answers: dict[Any, Any] = {}

    def hand_over(job: store.ClaimedJob) -> None:
        try:
            answers[job.id] = completer.complete("default", job)
        except Exception as exc:
            answers[job.id] = exc

    threads = [threading.Thread(target=hand_over, args=(job,)) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return answers


def blocked_flushes() -> list[int]:
    """Backends whose batched completion waits for a row lock."""
    with raw_connection() as conn:
        return [row[0] for row in conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock' AND query LIKE '%%unnest%%'").fetchall()]


@pytest.fixture
def refuse_completion() -> Iterator[Callable[[Any], None]]:
    """A trigger that makes PostgreSQL reject the completion of one job's first attempt with an
    error retrying does not fix (``check_violation``, as a trigger or constraint of the
    project's own would raise). Its retry, attempt 2, may complete."""
    with contextlib.ExitStack() as stack:

        def install(job_id: Any) -> None:
            stack.enter_context(refusing_updates(
                "pj_test_refuse_completion", "persistent_jobs",
                f"NEW.status = 'completed' AND OLD.id = '{job_id}'::uuid AND OLD.attempts = 1",
                f"refusing to complete job {job_id}", errcode="check_violation"))

        yield install


def split_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [record for record in caplog.records
            if getattr(record, "event", None) == "completion_split"]


# ------------------------------------------------------------------ the completer itself

def test_after_batch_runs_once_a_batch_is_answered_so_a_worker_reports_it_in_one_message(
) -> None:
    """A worker process sends one ``DONE`` per batch (``after_batch``), not one per job: the
    hook must run after every answer of its batch, once per batch, on the completer's thread."""
    enqueue_many([("test.noop", {"i": i}) for i in range(5)])
    jobs = claim(5)
    assert len(jobs) == 5
    completer = Completer(linger=5.0, max_batch=5)  # the five go in one batch
    answered: list[Any] = []
    seen_by_hook: list[list[Any]] = []
    hooked = threading.Event()

    def after_batch() -> None:
        seen_by_hook.append(list(answered))
        if len(answered) == 5:
            hooked.set()

    completer.after_batch = after_batch
    for job in jobs:
        assert completer.submit("default", job, None,
                                lambda ok, error, job=job: answered.append((job.id, ok, error)))
    assert hooked.wait(30), seen_by_hook
    assert seen_by_hook == [answered]  # once, after all five answers
    assert sorted(answered, key=str) == sorted(((j.id, True, None) for j in jobs), key=str)
    assert completer.statements == 1
    assert completer.close(10)


def test_a_fenced_out_job_does_not_complete_and_the_rest_of_its_batch_does() -> None:
    enqueue_many([("test.noop", {"i": i}) for i in range(3)])
    jobs = claim(3)
    assert len(jobs) == 3
    lost = jobs[1]
    with connection.cursor() as cursor:  # rescued meanwhile: its token is no longer the job's
        assert store.transition(cursor, lost.id, lost.token, kind="retry", code="RUNNER_LOST",
                                message="rescued") == "failed"
    completer = Completer(max_batch=3, linger=30.0)  # written when the third arrives
    try:
        answers = complete_from_threads(completer, jobs)
    finally:
        assert completer.close(10)
    assert completer.statements == 1 and completer.completed == 2
    assert answers == {jobs[0].id: True, lost.id: False, jobs[2].id: True}
    statuses = dict(PersistentJob.objects.values_list("id", "status"))
    assert statuses == {jobs[0].id: "completed", lost.id: "failed", jobs[2].id: "completed"}
    outcomes = dict(JobAttempt.objects.values_list("id", "outcome"))
    assert outcomes == {jobs[0].token: "completed", lost.token: "failed",
                        jobs[2].token: "completed"}


def test_a_batch_one_job_of_which_cannot_be_completed_is_split_and_the_others_complete(
    refuse_completion: Callable[[Any], None], caplog: pytest.LogCaptureFixture,
) -> None:
    """The database rejects one job's completion with an error retrying does not fix: the
    batch statement fails whole, so the completer writes its completions one at a time
    (``completion_split``). The others complete, each once; the one it cannot write is
    answered with its error (its runner then fails the attempt, see below) and stays as it
    was, running under its claim."""
    caplog.set_level(logging.WARNING, logger="django_persistent_jobs.runner")
    enqueue_many([("test.noop", {"i": i}) for i in range(4)])
    jobs = claim(4)
    assert len(jobs) == 4
    bad = jobs[2]
    refuse_completion(bad.id)
    completer = Completer(max_batch=4, linger=30.0)  # the four go in one batch
    try:
        answers = complete_from_threads(completer, jobs)
    finally:
        assert completer.close(10)
    error = answers.pop(bad.id)
    assert isinstance(error, Exception) and sqlstate(error) == "23514", error
    assert answers == {job.id: True for job in jobs if job is not bad}
    [split] = split_records(caplog)
    assert "completing 4 jobs in one statement failed" in split.getMessage()
    assert "refusing to complete job" in split.getMessage()
    # The failed batch committed nothing; then one statement per job, three of them landed.
    assert (completer.statements, completer.completed) == (3, 3)
    statuses = dict(PersistentJob.objects.values_list("id", "status"))
    assert statuses == {job.id: "running" if job is bad else "completed" for job in jobs}
    outcomes = dict(JobAttempt.objects.values_list("id", "outcome"))
    assert outcomes == {job.token: "running" if job is bad else "completed" for job in jobs}
    assert PersistentJob.objects.get(id=bad.id).lock_token == bad.token  # still its claim


def test_a_completion_whose_commit_landed_before_its_connection_failed_is_reported_done() -> None:
    """After a connection failure the batch is written again; a job its first try completed
    is then not completed by the second, and must be reported completed, not lost."""
    enqueue("test.noop", {})
    (job,) = claim(1)
    with raw_connection() as conn, conn.cursor() as cursor:
        assert store.complete_many(cursor, [(job, None)]) == {job.token}  # the first try
    completer = Completer()
    try:
        assert completer.complete("default", job) is True  # the retry
    finally:
        completer.close(10)
    assert JobAttempt.objects.get(id=job.token).outcome == "completed"


def test_a_closed_completer_answers_not_written() -> None:
    enqueue("test.noop", {})
    (job,) = claim(1)
    completer = Completer()
    assert completer.close(1)
    assert completer.complete("default", job) is None
    assert PersistentJob.objects.get(id=job.id).status == "running"


# ------------------------------------------------------------------ through a runner

def test_completions_of_handlers_that_ran_no_sql_are_batched(
    isolated_registry: Registry, start_runner: StartRunner,
    finished: list[tuple[Any, str | None]],
) -> None:
    concurrency = 10
    rounds = 40
    # The jobs of one round return together, as a busy runner's short jobs do.
    barrier = threading.Barrier(concurrency)

    @job_handler("completer.together", timeout=60)
    def together(payload: Any, ctx: JobContext) -> None:
        barrier.wait(30)

    total = concurrency * rounds
    ids = [job.id for job in enqueue_many(
        [("completer.together", {"i": i}) for i in range(total)])]
    before = commits()
    with pj_settings(PREFETCH=total):  # claims take everything at once: count completions
        runner = start_runner(concurrency=concurrency)
    wait_for(lambda: len(finished) >= total, timeout=60, message="every job to finish")
    statements = runner.pool.completer.statements
    runner.stop(timeout=30)
    spent = commits() - before
    assert sorted(finished, key=str) == sorted(((i, "completed") for i in ids), key=str)
    assert PersistentJob.objects.filter(id__in=ids, status="completed").count() == total
    assert JobAttempt.objects.filter(job_id__in=ids, outcome="completed").count() == total
    # One commit per batch instead of one per job. Completing each job on its own would spend at
    # least one commit per job on completions alone; with batches, everything the database saw
    # commit meanwhile (the batches, the claims and the runner's polls, heartbeats and
    # registration, whose number grows with the time a loaded machine takes) stays under that.
    assert statements <= total // 2, statements
    assert spent < total, (spent, statements)
    # Most of these jobs waited for a worker; each attempt is on record as started, from when
    # it started (written with its completion, or with a claim), not from when it was claimed.
    attempts = JobAttempt.objects.filter(job_id__in=ids)
    assert not attempts.filter(started=False).exists()
    for began, ended, took in attempts.values_list("started_at", "finished_at", "duration"):
        assert began <= ended and abs(took - (ended - began)) < timedelta(milliseconds=1)


def test_a_handler_that_wrote_to_the_database_completes_in_its_own_transaction(
    isolated_registry: Registry, start_runner: StartRunner,
    finished: list[tuple[Any, str | None]],
) -> None:
    @job_handler("completer.writes", timeout=60)
    def writes(payload: Any, ctx: JobContext) -> None:
        LedgerEntry.objects.create(job_id=ctx.job_id, note="written")

    job = enqueue("completer.writes", {})
    runner = start_runner(concurrency=2)
    wait_for(lambda: finished, message="the job to finish")
    assert runner.pool.completer.statements == 0
    assert finished == [(job.id, "completed")]
    assert LedgerEntry.objects.filter(job_id=job.id).count() == 1


def test_a_flush_cut_off_by_a_dropped_connection_completes_each_job_exactly_once(
    isolated_registry: Registry, start_runner: StartRunner,
    finished: list[tuple[Any, str | None]],
) -> None:
    running = threading.Semaphore(0)
    go, returned = Gate(), threading.Semaphore(0)

    @job_handler("completer.quick", timeout=60)
    def quick(payload: Any, ctx: JobContext) -> None:
        running.release()
        go.wait()
        returned.release()

    ids = [job.id for job in enqueue_many([("completer.quick", {"i": i}) for i in range(4)])]
    runner = start_runner(concurrency=4)
    for _ in ids:
        assert running.acquire(timeout=30)
    with raw_connection(autocommit=False) as blocker:
        # Hold the running jobs' rows so their batch waits on them; then kill its connection.
        blocker.execute("SELECT id FROM persistent_jobs WHERE id = ANY(%s) FOR UPDATE", [ids])
        go.open()
        for _ in ids:
            assert returned.acquire(timeout=30)
        (pid, *_) = wait_for(blocked_flushes, message="the batch to wait for the row locks")
        with raw_connection() as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", [pid])
        # Written again on a new connection, which waits for the rows in its turn.
        wait_for(lambda: [p for p in blocked_flushes() if p != pid],
                 message="the batch to be written again")
        assert not finished
        blocker.rollback()
    wait_for(lambda: len(finished) >= 4, timeout=30, message="the jobs to finish")
    runner.stop(timeout=30)
    assert sorted(finished, key=str) == sorted(((i, "completed") for i in ids), key=str)
    assert dict(PersistentJob.objects.filter(id__in=ids).values_list("id", "attempts")) == {
        i: 1 for i in ids}
    assert JobAttempt.objects.filter(job_id__in=ids, outcome="completed").count() == 4


@pytest.mark.parametrize("processes", [0, 1])
def test_a_runner_whose_batch_fails_for_one_job_fails_only_that_attempt(
    start_runner: StartRunner, refuse_completion: Callable[[Any], None], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str], finished: list[tuple[Any, str | None]], processes: int,
) -> None:
    """Through a runner, on threads and in a worker process: four SQL-less handlers return
    while the completer is busy with a fifth job's batch (held by a row lock), so their four
    completions form the next batch, which the database rejects for one of them. The split
    completes the three others, once each; the fourth fails its attempt (charged, as
    guarantees.md 2a says: the error costs only its own job) and its retry completes it.
    Nothing is lost, nothing completes twice, and the runner goes on."""
    for name, value in subprocess_env().items():  # worker processes use the test database
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PJ_TEST_LOG", "INFO")  # a worker process logs to its stdout
    caplog.set_level(logging.WARNING, logger="django_persistent_jobs.runner")
    runs, first_gate, gate = tmp_path / "runs", tmp_path / "first", tmp_path / "gate"
    first = enqueue("faults.solo", {"runs": str(runs), "gate": str(first_gate)})
    ids = [job.id for job in enqueue_many(
        [("faults.solo", {"runs": str(runs), "gate": str(gate), "n": i}) for i in range(4)])]
    bad = ids[1]
    refuse_completion(bad)
    runner = start_runner(concurrency=5, processes=processes, poll_interval=0.1)
    wait_for(lambda: len(runs_of(runs)) == 5, timeout=30, message="every handler to start")
    with raw_connection(autocommit=False) as blocker:
        blocker.execute("SELECT id FROM persistent_jobs WHERE id = %s FOR UPDATE", [first.id])
        first_gate.touch()  # the first job returns alone; its batch waits for its row
        wait_for(blocked_flushes, timeout=20, message="the first batch to wait for the row")
        gate.touch()  # the four return and queue behind it
        wait_for(lambda: runner.pool.completing == 5, timeout=20,
                 message="the four completions to be handed over")
        blocker.rollback()
    everyone = [first.id, *ids]
    wait_for(lambda: PersistentJob.objects.filter(id__in=everyone, status="completed").count()
             == 5, timeout=30, message="every job to complete")
    assert runner.failure is None and not runner.finished.is_set()  # it ran on
    assert runs_of(runs) == {str(job_id): 2 if job_id == bad else 1 for job_id in everyone}
    for job_id in everyone:
        attempts = [(a.attempt, a.outcome) for a in attempts_of(job_id)]
        assert attempts == ([(1, "failed"), (2, "completed")] if job_id == bad
                            else [(1, "completed")]), (job_id, attempts)
    [refused] = [a for a in attempts_of(bad) if a.outcome == "failed"]
    assert refused.error_code == "HANDLER_ERROR"
    assert "refusing to complete job" in refused.error_message
    done = PersistentJob.objects.get(id=bad)
    assert (done.attempts, done.handbacks) == (2, 0)
    if processes:
        out = capfd.readouterr().out
        assert out.count("completing 4 jobs in one statement failed") == 1, out
    else:
        [split] = split_records(caplog)
        assert "completing 4 jobs in one statement failed" in split.getMessage()
        # Each job's signal once per attempt: the three and the first completed once, the
        # refused one failed, then completed.
        assert sorted(finished, key=str) == sorted(
            [(job_id, "completed") for job_id in everyone] + [(bad, "failed")], key=str)


def test_stopping_waits_for_completions_being_written(
    isolated_registry: Registry, start_runner: StartRunner,
    finished: list[tuple[Any, str | None]],
) -> None:
    running, go, returned = Gate(), Gate(), Gate()

    @job_handler("completer.last", timeout=60)
    def last(payload: Any, ctx: JobContext) -> None:
        running.open()
        go.wait()
        returned.open()

    job = enqueue("completer.last", {})
    runner = start_runner(concurrency=2, shutdown_grace=30)
    assert running.wait()
    with raw_connection(autocommit=False) as blocker:
        blocker.execute("SELECT id FROM persistent_jobs WHERE id = %s FOR UPDATE", [job.id])
        go.open()
        assert returned.wait()
        wait_for(blocked_flushes, message="the completion to wait for the row lock")
        runner.request_stop()
        # The handler returned, so the job holds no slot; the runner still waits for its
        # completion before it stops.
        assert runner.pool.busy == 0 and runner.pool.completing == 1
        assert not runner.finished.wait(0.5)
        blocker.rollback()
    assert runner.finished.wait(30)
    assert finished == [(job.id, "completed")]
    row = PersistentJob.objects.get(id=job.id)
    assert (row.status, row.attempts) == ("completed", 1)


def test_a_batch_stores_each_jobs_own_result_next_to_jobs_without_one() -> None:
    """The batch's arrays go to PostgreSQL in binary: a text array holding JSON results and
    NULLs, ids and tokens of every size the claim hands out."""
    enqueue_many([("test.noop", {})] * 3)
    jobs = claim(3)
    results = ['{"answer": 42}', None, '"done"']
    with raw_connection() as conn, conn.cursor() as cursor:
        done = store.complete_many(cursor, list(zip(jobs, results, strict=True)))
    assert done == {job.token for job in jobs}
    stored = dict(PersistentJob.objects.values_list("id", "result"))
    assert stored == {jobs[0].id: {"answer": 42}, jobs[1].id: None, jobs[2].id: "done"}
    assert set(JobAttempt.objects.values_list("outcome", flat=True)) == {"completed"}


def test_a_batch_writes_the_starts_still_noted_for_its_jobs() -> None:
    """A waiting job started on the fast path has its start noted (``starts.StartLog``) until a
    claim writes it; handed to the completer, the job takes its start out of the log, and its
    batch writes it with the completion, so no claim writes it a second time."""
    enqueue_many([("test.noop", {})] * 3)
    with raw_connection() as conn, conn.cursor() as cursor:
        jobs = claim_as(cursor, "completer-test", 3, None, direct=1)
    assert [job.waiting for job in jobs] == [False, True, True]
    claimed_at = dict(JobAttempt.objects.values_list("id", "started_at"))
    log = StartLog()
    log.note(jobs[1].token)  # started on the fast path; jobs[2]'s start is not noted
    completer = Completer()
    completer.starts = log
    try:
        answers = complete_from_threads(completer, jobs)
    finally:
        completer.close(10)
    assert answers == {job.id: True for job in jobs}
    assert log.take(jobs[1].token) is None  # written: nothing left for the next claim
    rows = {row.id: row for row in JobAttempt.objects.all()}
    assert all(row.started and row.outcome == "completed" for row in rows.values())
    assert rows[jobs[0].token].started_at == claimed_at[jobs[0].token]  # direct: unchanged
    assert rows[jobs[1].token].started_at > claimed_at[jobs[1].token]  # the noted start
    assert rows[jobs[2].token].started_at == claimed_at[jobs[2].token]  # nothing better known
    for row in rows.values():
        assert row.finished_at is not None
        assert abs(row.duration - (row.finished_at - row.started_at)) < timedelta(milliseconds=1)
