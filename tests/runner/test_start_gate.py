"""The start gate's thread (``starts.StartGate``): it records starts on a connection of its own,
and when its runner stops it exits with that connection closed, instead of idling on for
seconds after the runner said it stopped."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection

from django_persistent_jobs.runner import Runner, starts
from django_persistent_jobs.runner.starts import StartGate
from tests.core_support import raw_connection, refusing_updates, wait_for
from tests.runner_support import a_job_waiting_behind_another

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(60)]


def _sessions() -> set[int]:
    """The other sessions on the test database."""
    with raw_connection() as probe:
        rows = probe.execute("SELECT pid FROM pg_stat_activity WHERE datname = "
                             "current_database() AND pid <> pg_backend_pid() "
                             "AND backend_type = 'client backend'").fetchall()
    return {row[0] for row in rows}


def _gate_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "pj-start-gate" and t.is_alive()}


def test_a_closed_gate_leaves_no_thread_or_session_and_opens_again_on_demand() -> None:
    connection.ensure_connection()
    sessions, threads = _sessions(), _gate_threads()
    gate = StartGate(connection.alias)
    assert gate.admit(-1) is False  # no such waiting attempt: written, and refused
    started = _gate_threads() - threads
    assert len(started) == 1 and _sessions() - sessions, "the gate wrote on a session of its own"
    gate.close(10)
    assert not any(t.is_alive() for t in started)
    wait_for(lambda: _sessions() <= sessions, timeout=5, message="the gate's session to close")
    # A request after close (a lane still starting a job while the runner stops) is served.
    assert gate.admit(-2) is False
    assert gate.statements == 2
    gate.close(10)
    assert _gate_threads() <= threads


def test_a_stopped_runner_leaves_no_gate_thread_behind(
    start_runner: Callable[..., Runner],
) -> None:
    threads = _gate_threads()
    runner = start_runner(concurrency=2)
    gate: Any = runner.pool.gate
    assert gate is not None
    assert gate.admit(-1) is False  # as a waiting job starting without a fresh lease would
    assert _gate_threads() - threads
    runner.stop(timeout=30)
    assert runner.finished.is_set()
    # Idle, the gate's thread would have waited five seconds with its connection open.
    assert _gate_threads() <= threads


def test_a_gate_whose_thread_could_not_start_says_so_and_starts_one_next_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No thread to be had (the process hit its thread limit): the start is refused with the
    error rather than waiting for ever on a thread that never ran, and the next one works."""
    connection.ensure_connection()
    gate = StartGate(connection.alias)
    real_start = threading.Thread.start

    def refuse(self: threading.Thread) -> None:
        if self.name == "pj-start-gate":
            raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", refuse)
    with pytest.raises(RuntimeError, match="new thread"):
        gate.admit(-1)
    monkeypatch.setattr(threading.Thread, "start", real_start)
    assert gate.admit(-2) is False
    assert gate.statements == 1  # only the second request was written
    gate.close(10)


def test_a_start_whose_reply_was_lost_is_admitted_when_written_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server commits the start, then the connection drops before the answer arrives: the
    gate writes it again, and the job it did start must be admitted, not refused (refused, it
    stayed started and ``running`` under a live runner that no longer ran it). A job handed
    back meanwhile is still refused."""
    from django.db import OperationalError

    from django_persistent_jobs import enqueue
    from django_persistent_jobs.models import JobAttempt
    from tests.core_support import claim_as

    kept, handed = enqueue("test.noop", {}), enqueue("test.noop", {})
    with raw_connection() as conn, conn.cursor() as cursor:
        claimed = {job.id: job for job in claim_as(cursor, "gate-test", 2, direct=0)}
        cursor.execute("UPDATE persistent_jobs_attempts SET outcome = 'interrupted' "
                       "WHERE id = %s", [claimed[handed.id].token])  # handed back meanwhile
    token = claimed[kept.id].token
    real_admit = starts.store.admit
    lost = []

    def reply_lost(cursor: Any, tokens: Any, **kwargs: Any) -> Any:
        answer = real_admit(cursor, tokens, **kwargs)  # (autocommit: committed)
        if not lost:
            lost.append(answer)
            raise OperationalError("server closed the connection unexpectedly")
        return answer

    monkeypatch.setattr(starts.store, "admit", reply_lost)
    connection.ensure_connection()
    gate = StartGate(connection.alias)
    try:
        assert gate.admit(token) is True
        assert gate.admit(claimed[handed.id].token) is False
    finally:
        gate.close(10)
    assert lost == [{token}]
    first = JobAttempt.objects.get(id=token)
    assert first.started and first.started_at is not None
    # Written again, the start keeps its first time; a first try never admits it twice.
    with raw_connection() as conn, conn.cursor() as cursor:
        assert real_admit(cursor, [token], again=True) == {token}
        assert real_admit(cursor, [token]) == set()
    assert JobAttempt.objects.get(id=token).started_at == first.started_at


def test_a_gate_thread_that_dies_answers_its_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gate's thread dies of a ``BaseException`` while writing (here ``SystemExit`` from
    the write): the lane waiting on it hears "gave up" (the job is not run, and stays claimed
    to be handed back) instead of waiting for ever; the next request starts a thread."""
    connection.ensure_connection()
    gate = StartGate(connection.alias)
    real_admit = starts.store.admit

    def die(cursor: Any, tokens: Any, **kwargs: Any) -> Any:
        raise SystemExit("the gate's thread is told to exit")

    monkeypatch.setattr(starts.store, "admit", die)
    answer: list[bool | None] = []
    asker = threading.Thread(target=lambda: answer.append(gate.admit(-1)), daemon=True)
    asker.start()
    asker.join(10)
    assert not asker.is_alive(), "the request was never answered"
    assert answer == [None]
    monkeypatch.setattr(starts.store, "admit", real_admit)
    assert gate.admit(-2) is False
    gate.close(10)


@pytest.mark.django_db
def test_a_job_refused_at_its_start_sends_no_job_started() -> None:
    """A waiting job the gate refuses (handed back while it waited) never runs: announcing
    its start would count an attempt with no ``job_finished`` and leave a tracing span open."""
    import uuid

    from django_persistent_jobs.context import JobContext
    from django_persistent_jobs.runner.execute import InFlight, execute
    from django_persistent_jobs.runner.store import ClaimedJob
    from django_persistent_jobs.signals import job_started

    class Refusing:
        def admit(self, token: int) -> bool:
            return False

    job = ClaimedJob(id=uuid.uuid4(), job_type="test.noop", payload={}, attempt=1,
                     max_retries=3, timeout=60, token=424242, queue="default", priority=0,
                     cancel_requested=False, waiting=True)
    ctx = JobContext(job_id=job.id, job_type=job.job_type, attempt=1, max_retries=3,
                     runner_id="r")
    seen: list[object] = []

    def receiver(sender: object, **kwargs: object) -> None:
        seen.append(kwargs.get("job_id"))

    job_started.connect(receiver)
    try:
        assert execute("default", InFlight(job=job, ctx=ctx, deadline=None,
                                           gate=Refusing()), "r", threading.Event()) is False
    finally:
        job_started.disconnect(receiver)
    assert seen == []


@pytest.mark.parametrize("processes", [0, 1])
def test_a_waiting_job_whose_start_cannot_be_written_is_handed_back_at_once(
    start_runner: Callable[..., Runner], tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
    settings: Any, processes: int,
) -> None:
    """A waiting job goes through the gate (the runner's LISTEN session, and with it its
    lease, was lost after the claim) and the gate cannot write its start: a real trigger
    rejects that one update, an error retrying does not fix. The job must not run on that
    attempt; it used to stay claimed by the live runner, run by nobody, until the runner
    exited. It is handed back at once, uncharged (counted, code ``START_FAILED``), and the
    runner, still running, claims and runs it again."""
    _refused_start_is_handed_back(start_runner, tmp_path, monkeypatch, settings, processes)


def test_that_hand_back_waits_a_moment_for_a_locked_job_row(
    start_runner: Callable[..., Runner], tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
    settings: Any, caplog: pytest.LogCaptureFixture,
) -> None:
    """The same, with the job's row locked by another session when the hand-back comes (say
    another runner handing the job back): the hand-back tries again for a moment instead of
    giving up at once, which left the job claimed by its live runner until it exited."""
    caplog.set_level("DEBUG", logger="django_persistent_jobs")
    _refused_start_is_handed_back(start_runner, tmp_path, monkeypatch, settings, 0,
                                  caplog=caplog)


def _refused_start_is_handed_back(
    start_runner: Callable[..., Runner], tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
    settings: Any, processes: int, caplog: pytest.LogCaptureFixture | None = None,
) -> None:
    """The two tests above; with ``caplog``, the job's row is locked from before the gate
    fails until the hand-back has met the lock."""
    from django_persistent_jobs.models import JobStatus
    from tests.runner_support import attempts_of, wait_status

    runner, waiting, token, open_gate = a_job_waiting_behind_another(
        start_runner, tmp_path, monkeypatch, settings, processes)
    with refusing_updates(
        "pj_test_refuse_start", "persistent_jobs_attempts",
        f"NEW.started AND NOT OLD.started AND OLD.id = {int(token)}",
        f"refusing to record the start of attempt {int(token)}",
    ):
        _end_lease_period(runner, waiting.id)
        with contextlib.ExitStack() as stack:
            if caplog is not None:
                locker = stack.enter_context(raw_connection(autocommit=False))
                locker.execute("SELECT 1 FROM persistent_jobs WHERE id = %s FOR UPDATE",
                               [waiting.id])
            open_gate.touch()  # the first job returns; the waiting one starts, via the gate
            if caplog is not None:
                records = caplog.records
                wait_for(lambda: any(getattr(r, "event", None) == "row_locked"
                                     for r in records), timeout=10,
                         message="the hand-back to meet the locked row")
                locker.rollback()
        done = wait_status(waiting.id, JobStatus.COMPLETED, timeout=20)
    assert runner.failure is None and not runner.finished.is_set()  # it ran on
    assert (done.attempts, done.handbacks) == (1, 1)
    assert [(a.attempt, a.outcome, a.error_code, a.started) for a in attempts_of(waiting.id)
            ] == [(1, "interrupted", "START_FAILED", False), (1, "completed", "", True)]


def _end_lease_period(runner: Runner, job_id: Any) -> None:
    """Make the waiting job ``job_id`` start through the gate: end the lease period it was
    claimed in, by ending the LISTEN session that holds the runner's lease."""
    from django_persistent_jobs.runner.store import LEASE_NAMESPACE

    # A claim that read the lease before it was first held (the claim loop's first round can
    # straddle the wait for it) carries no period: its waiting jobs go through the gate anyway.
    [period] = [item.job.lease_period for item in list(runner.pool.in_flight.values())
                if item.job.id == job_id]
    if period is None:
        return
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' "
            "AND granted AND objsubid = 2 AND classid = %s AND database = (SELECT oid "
            "FROM pg_database WHERE datname = current_database()) "
            "AND objid = (hashtext(%s)::bigint & 4294967295)::text::oid",
            [LEASE_NAMESPACE, runner.runner_id])
        assert cursor.fetchall() == [(True,)]
    wait_for(lambda: not runner.lease.fresh(period), timeout=10,
             message="the lease period the job was claimed in to end")


#: How long the database refuses the gate's write in the tests below: longer than the jobs'
#: timeout (1 s) plus a round of the timeout enforcer.
REFUSED_SECONDS = 2.5


def _gated_past_its_timeout(
    start_runner: Callable[..., Runner], tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
    settings: Any, processes: int, **options: Any,
) -> tuple[Runner, Any, Any]:
    """A waiting job (``options`` for its ``enqueue``, with a 1 s timeout) that starts
    through the gate while the database refuses to record its start with a transient error
    (as during an outage) for ``REFUSED_SECONDS``; the gate retries. The runner, the job, and
    the database's clock when the refusals stopped. ``STALE_LOCK_TIMEOUT`` is raised so that
    the bound on a gate stuck for good (``InFlight.start_clock``) is far away."""
    settings.PERSISTENT_JOBS = {**settings.PERSISTENT_JOBS, "STALE_LOCK_TIMEOUT": 20}
    runner, waiting, token, open_gate = a_job_waiting_behind_another(
        start_runner, tmp_path, monkeypatch, settings, processes, timeout=1, **options)
    with refusing_updates(
        "pj_test_refuse_start", "persistent_jobs_attempts",
        f"NEW.started AND NOT OLD.started AND NEW.outcome = 'running' "
        f"AND OLD.id = {int(token)}",
        f"the database refuses to record the start of attempt {int(token)} for now",
        errcode="57P03",  # cannot_connect_now: transient, retried
    ):
        _end_lease_period(runner, waiting.id)
        open_gate.touch()  # the first job returns; the waiting one starts, via the gate
        # The scenario's outage, not a synchronisation: it must outlast the job's timeout.
        time.sleep(REFUSED_SECONDS)
        with connection.cursor() as cursor:
            cursor.execute("SELECT clock_timestamp()")
            refused_until = cursor.fetchone()[0]
    return runner, waiting, refused_until


@pytest.mark.parametrize("processes", [0, 1])
def test_a_waiting_jobs_timeout_counts_from_when_its_start_is_on_record(
    start_runner: Callable[..., Runner], tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
    settings: Any, processes: int,
) -> None:
    """The gate's wait for the database is not the handler's time: the job's timeout clock
    starts once its start is on record, and the job then runs and completes on that attempt.
    Its clock used to start before the gate, so the enforcer charged it a ``TIMEOUT`` for a
    handler that never ran (on threads and in a worker process alike)."""
    from django_persistent_jobs.models import JobStatus
    from tests.runner_support import attempts_of, wait_status

    runner, waiting, refused_until = _gated_past_its_timeout(
        start_runner, tmp_path, monkeypatch, settings, processes)
    done = wait_status(waiting.id, JobStatus.COMPLETED, timeout=30)
    assert runner.failure is None and not runner.finished.is_set()
    assert (done.attempts, done.handbacks) == (1, 0)
    [attempt] = attempts_of(waiting.id)
    assert (attempt.attempt, attempt.outcome, attempt.error_code, attempt.started) == (
        1, "completed", "", True)
    assert attempt.started_at >= refused_until  # started once the gate could write it


@pytest.mark.parametrize("processes", [0, 1])
def test_a_waiting_job_admitted_late_still_times_out_a_timeout_after_its_start(
    start_runner: Callable[..., Runner], tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
    settings: Any, processes: int,
) -> None:
    """The same wait at the gate, for a handler that then overruns its 1 s timeout: it is
    timed out one timeout after its start went on record (its deadline is set when the gate
    admits it, not lost because it went through the gate)."""
    from tests.runner_support import attempts_of

    runner, waiting, refused_until = _gated_past_its_timeout(
        start_runner, tmp_path, monkeypatch, settings, processes,
        job_type="test.oversleep", payload={"sleep": 3}, max_retries=0)
    first: list[Any] = []

    def settled() -> bool:
        attempts = [a for a in attempts_of(waiting.id) if a.outcome != "running"]
        first[:] = attempts[:1]
        return bool(attempts)

    wait_for(settled, timeout=30, message="the first attempt to be settled")
    [attempt] = first
    assert (attempt.attempt, attempt.outcome, attempt.error_code, attempt.started) == (
        1, "timed_out", "TIMEOUT", True)
    assert attempt.started_at >= refused_until
    # A timeout (1 s) after its start, give or take the enforcer's round; the handler would
    # have slept 3 s.
    assert 0.9 <= attempt.duration.total_seconds() < 2.5, attempt.duration
    assert runner.failure is None
