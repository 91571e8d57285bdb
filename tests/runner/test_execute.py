"""Settling a job can never take the runner down (invariant 12), in process: real runner threads
against real PostgreSQL.

Covers a failure or timeout racing a Replace enqueue of the same dedup key, error text that
PostgreSQL cannot store, a settling statement that keeps failing, ``async def`` handlers, counted
hand-backs at shutdown, and a runner that claims only the job types it has handlers for.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, connections, transaction

from django_persistent_jobs import (
    Dedup,
    JobContext,
    Runner,
    TransientJobError,
    job_handler,
    signals,
)
from django_persistent_jobs.backoff import constant
from django_persistent_jobs.enqueuing import enqueue
from django_persistent_jobs.handlers import Registry
from django_persistent_jobs.models import JobAttempt, JobStatus, PersistentJob
from django_persistent_jobs.runner import store
from tests.core_support import claim_as, refusing_updates
from tests.runner_support import (
    Gate,
    attempts_of,
    db_now,
    get_job,
    isolated_registry,
    wait_for,
    wait_status,
)
from tests.testapp.models import LedgerEntry, SideEffect

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

StartRunner = Callable[..., Runner]

__all__ = ["isolated_registry"]  # a fixture, used by name


def assert_runner_alive(runner: Runner) -> None:
    """The runner is still running and still executes jobs."""
    assert not runner.stopping.is_set() and runner.exit_code == 0, runner.exit_code
    probe = enqueue("test.ledger", {"note": "probe"})
    wait_status(probe.id, JobStatus.COMPLETED)
    assert not runner.stopping.is_set() and runner.exit_code == 0


def settling_blocked() -> bool:
    """True while a runner's settling statement waits on a lock (here: the unique index entry
    of a concurrent, uncommitted enqueue)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock' AND query LIKE %s", ["%WITH cur AS%"],
        )
        return bool(cursor.fetchone()[0])


class HeldEnqueue:
    """A Replace enqueue in another thread and connection, held uncommitted until released."""

    def __init__(self, job_type: str, key: str) -> None:
        self.inserted = threading.Event()
        self.release = Gate(60)
        self.job_id: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(job_type, key), daemon=True)

    def start(self) -> HeldEnqueue:
        self.thread.start()
        return self

    def _run(self, job_type: str, key: str) -> None:
        try:
            with transaction.atomic():
                self.job_id = enqueue(job_type, {"newer": True}, dedup_key=key,
                                      dedup=Dedup.REPLACE).id
                self.inserted.set()
                self.release.wait()
        except BaseException as exc:  # reported by the test
            self.error = exc
            self.inserted.set()
        finally:
            connections.close_all()


@pytest.fixture
def held() -> Iterator[list[HeldEnqueue]]:
    made: list[HeldEnqueue] = []
    yield made
    for item in made:
        item.release.open()
        item.thread.join(10)


# ------------------------------------------------------------ failure vs a Replace enqueue

@pytest.mark.parametrize("path", ["error", "timeout"])
def test_failure_racing_a_replace_enqueue_settles_as_replaced(
    path: str, isolated_registry: Registry, start_runner: StartRunner,
    held: list[HeldEnqueue],
) -> None:
    """The failed job's transition meets the newer job's uncommitted unique-index entry, waits,
    and then loses to it (23505): it must settle as replaced and the runner go on."""
    ran: list[Any] = []

    @job_handler("hs.replace_race", dedup=Dedup.REPLACE, max_retries=3, backoff=constant(0),
                 timeout=60 if path == "error" else 1)
    def replace_race(payload: dict[str, Any], ctx: JobContext) -> None:
        ran.append(payload)
        if payload.get("newer"):
            return
        enqueuer = HeldEnqueue("hs.replace_race", "k").start()
        held.append(enqueuer)
        assert enqueuer.inserted.wait(20)
        if path == "error":
            raise RuntimeError("failing while a newer job is being enqueued")
        while True:  # hangs until the supervisor takes the job over at its timeout
            time.sleep(0.02)

    job = enqueue("hs.replace_race", {"first": True}, dedup_key="k")
    runner = start_runner(concurrency=2)
    wait_for(lambda: held and held[0].inserted.is_set(), 20, message="the held enqueue")
    assert held[0].error is None, held[0].error
    wait_for(settling_blocked, 20, message="the failure transition to wait on the new row")
    held[0].release.open()
    held[0].thread.join(10)

    replaced = wait_status(job.id, JobStatus.CANCELLED)
    assert replaced.last_error_code == "REPLACED"
    [attempt] = attempts_of(job.id)
    assert attempt.error_code == ("HANDLER_ERROR" if path == "error" else "TIMEOUT")
    newer = wait_status(held[0].job_id, JobStatus.COMPLETED)
    assert newer.attempts == 1 and {"newer": True} in ran
    assert_runner_alive(runner)


def test_the_settling_statement_resolves_a_replace_race_for_every_caller(
    isolated_registry: Registry, held: list[HeldEnqueue],
) -> None:
    """Rescue settles jobs with the same statement: it must survive the race on its own."""
    job_handler("hs.replace_store", dedup=Dedup.REPLACE)(lambda payload: None)
    job = enqueue("hs.replace_store", {"first": True}, dedup_key="k")
    with connection.cursor() as cursor:
        [claimed] = claim_as(cursor, "ghost:settle", 1, None, ghost=True)
    enqueuer = HeldEnqueue("hs.replace_store", "k").start()
    held.append(enqueuer)
    assert enqueuer.inserted.wait(20) and enqueuer.error is None

    def release_when_blocked() -> None:
        try:
            wait_for(settling_blocked, 20, message="the rescue transition to wait")
        finally:
            enqueuer.release.open()
            connections.close_all()

    watcher = threading.Thread(target=release_when_blocked, daemon=True)
    watcher.start()
    with connection.cursor() as cursor:
        status = store.transition(cursor, claimed.id, claimed.token, kind="retry",
                                  code="RUNNER_LOST", message="rescued", outcome="rescued")
    watcher.join(10)
    assert status == "cancelled"
    stored = get_job(job.id)
    assert (stored.status, stored.last_error_code) == ("cancelled", "REPLACED")
    assert attempts_of(job.id)[0].outcome == "rescued"
    assert get_job(enqueuer.job_id).status == JobStatus.PENDING


# ------------------------------------------------------------ text PostgreSQL cannot store

def test_error_text_with_nul_and_lone_surrogates_is_stored_escaped(
    isolated_registry: Registry, start_runner: StartRunner, caplog: pytest.LogCaptureFixture,
) -> None:
    bad_name = b"report-\xff.csv".decode("utf-8", "surrogateescape")

    @job_handler("hs.bad_text", max_retries=0)
    def bad_text(payload: dict[str, Any]) -> None:
        raise TransientJobError(f"cannot open {bad_name}: got b'\x00\x01'", code="BAD\x00\udcff")

    @job_handler("hs.bad_text_plain", max_retries=0)
    def bad_text_plain(payload: dict[str, Any]) -> None:
        raise ValueError(f"nul \x00 and {bad_name}")

    sent: list[dict[str, Any]] = []

    def receiver(**kwargs: Any) -> None:
        sent.append(kwargs)

    signals.job_finished.connect(receiver, weak=False, dispatch_uid="tests-bad-text")
    signals.job_dead_lettered.connect(receiver, weak=False, dispatch_uid="tests-bad-text-dl")
    job = enqueue("hs.bad_text", {})
    plain = enqueue("hs.bad_text_plain", {})
    try:
        runner = start_runner(concurrency=1)
        dead = wait_status(job.id, JobStatus.DEAD_LETTERED)
        wait_for(lambda: sum(kw.get("job_id") == job.id for kw in sent) == 2,
                 message="job_finished and job_dead_lettered")
    finally:
        signals.job_finished.disconnect(dispatch_uid="tests-bad-text")
        signals.job_dead_lettered.disconnect(dispatch_uid="tests-bad-text-dl")
    # Receivers get the code and message as stored, which a metric label or a log can carry.
    for kwargs in (kw for kw in sent if kw.get("job_id") == job.id):
        assert kwargs["error_code"] == "BAD\\x00\\udcff"
        if "error_message" in kwargs:
            assert kwargs["error_message"] == "cannot open report-\\udcff.csv: got b'\\x00\x01'"
    assert dead.last_error == "cannot open report-\\udcff.csv: got b'\\x00\x01'"
    assert dead.last_error_code == "BAD\\x00\\udcff"
    [attempt] = attempts_of(job.id)
    assert (attempt.outcome, attempt.error_code) == ("dead_lettered", "BAD\\x00\\udcff")
    assert attempt.error_message == dead.last_error
    assert "report-\\udcff.csv" in attempt.traceback and "TransientJobError" in attempt.traceback
    other = wait_status(plain.id, JobStatus.DEAD_LETTERED)
    assert other.last_error_code == "HANDLER_ERROR"
    assert other.last_error == "ValueError: nul \\x00 and report-\\udcff.csv"
    assert_runner_alive(runner)
    # Logged as stored: a UTF-8 log handler can write every line (no "--- Logging error ---").
    # (Both jobs' lines: they are written just after the outcome commits.)
    def logged() -> list[str]:
        return [record.getMessage() for record in list(caplog.records)
                if record.name.startswith("django_persistent_jobs")]

    wait_for(lambda: sum("dead-lettered after attempt 1" in line for line in logged()) == 2,
             message="both jobs' dead-letter lines")
    lines = logged()
    assert any("report-\\udcff.csv" in line for line in lines), lines
    for line in lines:
        assert "\x00" not in line
        line.encode("utf-8")


def test_handler_exit_interrupt_and_unprintable_errors_fail_the_attempt_not_the_runner(
    isolated_registry: Registry, start_runner: StartRunner,
) -> None:
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no text for you")

    @job_handler("hs.sys_exit", max_retries=0)
    def sys_exit(payload: dict[str, Any]) -> None:
        sys.exit(3)

    @job_handler("hs.unprintable", max_retries=0)
    def unprintable(payload: dict[str, Any]) -> None:
        raise Unprintable()

    @job_handler("hs.keyboard", max_retries=1, backoff=constant(0))
    def keyboard(payload: dict[str, Any]) -> None:
        raise KeyboardInterrupt  # it used to stop the runner (exit 2), the job left running

    exited = enqueue("hs.sys_exit", {})
    odd = enqueue("hs.unprintable", {})
    interrupted = enqueue("hs.keyboard", {})
    runner = start_runner(concurrency=1)
    dead = wait_status(exited.id, JobStatus.DEAD_LETTERED)
    assert (dead.last_error_code, dead.last_error) == ("HANDLER_ERROR", "SystemExit: 3")
    dead = wait_status(interrupted.id, JobStatus.DEAD_LETTERED)
    assert (dead.last_error_code, dead.attempts) == ("HANDLER_ERROR", 2)
    assert dead.last_error.startswith("KeyboardInterrupt")
    dead = wait_status(odd.id, JobStatus.DEAD_LETTERED)
    assert dead.last_error_code == "HANDLER_ERROR"
    assert "Unprintable" in dead.last_error and "str() of this exception failed" in dead.last_error
    assert_runner_alive(runner)


def test_a_handler_session_ended_by_idle_in_transaction_timeout_is_a_db_error(
    isolated_registry: Registry, start_runner: StartRunner,
) -> None:
    """PostgreSQL ends a session that sat in a transaction past
    ``idle_in_transaction_session_timeout`` with SQLSTATE 25P03, which psycopg raises as an
    ``InternalError``: the connection is gone, as after a restart, so the attempt fails
    ``DB_ERROR`` (it was ``HANDLER_ERROR``) and the retry runs on a fresh connection."""

    @job_handler("hs.idles", max_retries=2, backoff=constant(0))
    def idles(payload: dict[str, Any], ctx: JobContext) -> None:
        with connection.cursor() as cursor:
            if ctx.attempt == 1:
                cursor.execute("SET LOCAL idle_in_transaction_session_timeout = '200ms'")
                time.sleep(0.6)  # idle in the job's transaction: the server ends the session
            cursor.execute("SELECT 1")
        LedgerEntry.objects.create(job_id=ctx.job_id, note="idles")

    job = enqueue("hs.idles", {})
    runner = start_runner(concurrency=1)
    done = wait_status(job.id, JobStatus.COMPLETED)
    assert done.attempts == 2
    first = JobAttempt.objects.get(job_id=job.id, attempt=1)
    assert first.error_code == "DB_ERROR", (first.error_code, first.error_message)
    assert LedgerEntry.objects.filter(job_id=job.id).count() == 1
    assert_runner_alive(runner)


def test_a_stored_payload_python_cannot_decode_costs_only_its_own_job(
    start_runner: StartRunner,
) -> None:
    """Rows written by raw SQL or an older release: an integer of 5,000 digits is valid JSON
    (and valid jsonb) but more than Python's int_max_str_digits allows to parse."""
    job = enqueue("test.ledger", {"note": "placeholder"}, priority=5)
    with connection.cursor() as cursor:
        cursor.execute("UPDATE persistent_jobs SET payload = ('{\"n\": ' || repeat('7', 5000) "
                       "|| '}')::jsonb WHERE id = %s", [job.id])
    neighbour = enqueue("test.ledger", {"note": "same batch"})
    runner = start_runner(concurrency=2)
    # (Read without the payload: the ORM cannot decode it either.)
    row = PersistentJob.objects.filter(id=job.id).values_list(
        "status", "last_error_code", "last_error", "attempts")
    _status, code, message, attempts = wait_for(
        lambda: next((r for r in row.all() if r[0] == JobStatus.DEAD_LETTERED), None),
        15, message="the undecodable job to be dead-lettered")
    assert code == "PAYLOAD_INVALID" and "cannot be decoded" in message and attempts == 1
    wait_status(neighbour.id, JobStatus.COMPLETED)
    assert_runner_alive(runner)


def test_out_of_range_backoff_delay_is_bounded(
    isolated_registry: Registry, start_runner: StartRunner,
) -> None:
    """A backoff function may return anything; ``next_run_at`` must stay storable."""

    @job_handler("hs.far_retry_huge", max_retries=2, backoff=lambda attempt: 1e300)
    def far_retry_huge(payload: dict[str, Any]) -> None:
        raise RuntimeError("come back much later")

    @job_handler("hs.far_retry_inf", max_retries=2, backoff=lambda attempt: float("inf"))
    def far_retry_inf(payload: dict[str, Any]) -> None:
        raise RuntimeError("come back never")

    huge = enqueue("hs.far_retry_huge", {})
    infinite = enqueue("hs.far_retry_inf", {})
    runner = start_runner(concurrency=1)
    for job in (huge, infinite):
        failed = wait_status(job.id, JobStatus.FAILED)
        assert timedelta(days=3000) < failed.next_run_at - db_now(clock=True) < timedelta(days=3700)
    assert_runner_alive(runner)


# ------------------------------------------------------------ a settling statement that fails

@pytest.fixture
def refuse_code() -> Iterator[Callable[[str], None]]:
    """A trigger that makes PostgreSQL reject any job update that would store ``code``."""
    with contextlib.ExitStack() as stack:

        def install(code: str) -> None:
            stack.enter_context(refusing_updates(
                "pj_test_refuse", "persistent_jobs", f"NEW.last_error_code = '{code}'",
                f"refusing to store error code {code}"))

        yield install


def test_a_settling_failure_hands_the_job_back_and_the_runner_goes_on(
    isolated_registry: Registry, start_runner: StartRunner, settings: Any,
    refuse_code: Callable[[str], None],
) -> None:
    settings.PERSISTENT_JOBS = {**settings.PERSISTENT_JOBS, "HANDBACK_LIMIT": 1}
    refuse_code("UNSTORABLE")
    runs: list[int] = []

    @job_handler("hs.unsettleable", max_retries=5, backoff=constant(0))
    def unsettleable(payload: dict[str, Any], ctx: JobContext) -> None:
        runs.append(ctx.attempt)
        SideEffect.objects.create(job_id=ctx.job_id, attempt=ctx.attempt)
        raise TransientJobError("this outcome cannot be recorded", code="UNSTORABLE")

    job = enqueue("hs.unsettleable", {}, max_retries=0)
    runner = start_runner(concurrency=1)
    # First run: the failure cannot be recorded, so the job is handed back (free, counted).
    # Second run: handed back again, past HANDBACK_LIMIT: charged, and out of retries.
    dead = wait_status(job.id, JobStatus.DEAD_LETTERED, timeout=30)
    assert dead.handbacks == 2 and dead.attempts == 1 and runs == [1, 1]
    assert dead.last_error_code == "INTERRUPTED"
    assert "could not record the outcome" in dead.last_error
    assert [(a.attempt, a.outcome, a.error_code) for a in attempts_of(job.id)] == [
        (1, "interrupted", "SETTLE_FAILED"), (1, "dead_lettered", "INTERRUPTED")]
    assert not SideEffect.objects.filter(job_id=job.id).exists()
    assert_runner_alive(runner)


# ------------------------------------------------------------ async handlers

def test_async_handler_runs_to_completion_atomically(
    isolated_registry: Registry, start_runner: StartRunner,
) -> None:
    @job_handler("hs.async_write", max_retries=2, backoff=constant(0))
    async def async_write(payload: dict[str, Any], ctx: JobContext) -> None:
        await SideEffect.objects.acreate(job_id=ctx.job_id, attempt=ctx.attempt)
        await asyncio.sleep(0.01)
        if ctx.attempt <= payload.get("fail_times", 0):
            raise TransientJobError(f"planned {ctx.attempt}", code="PLANNED")
        await LedgerEntry.objects.acreate(job_id=ctx.job_id, note=payload["note"])

    @job_handler("hs.async_one_arg")
    async def async_one_arg(payload: dict[str, Any]) -> None:
        await LedgerEntry.objects.acreate(job_id=payload["id"], note="one-arg")

    ok = enqueue("hs.async_write", {"note": "ran"})
    flaky = enqueue("hs.async_write", {"note": "second", "fail_times": 1})
    one_arg = enqueue("hs.async_one_arg", {"id": "00000000-0000-0000-0000-00000000a5c1"})
    runner = start_runner(concurrency=2)
    for job in (ok, flaky, one_arg):
        wait_status(job.id, JobStatus.COMPLETED)
    assert LedgerEntry.objects.get(job_id=ok.id).note == "ran"
    assert LedgerEntry.objects.get(job_id=flaky.id).note == "second"
    assert LedgerEntry.objects.filter(note="one-arg").count() == 1
    # The failed attempt's write rolled back with it: the async ORM ran in the job's transaction.
    assert list(SideEffect.objects.filter(job_id=flaky.id).values_list("attempt", flat=True)) \
        == [2]
    assert [a.outcome for a in attempts_of(flaky.id)] == ["failed", "completed"]
    assert_runner_alive(runner)


def test_async_handler_times_out_fenced_and_is_retried(
    isolated_registry: Registry, start_runner: StartRunner,
) -> None:
    @job_handler("hs.async_hang", max_retries=2, backoff=constant(0), timeout=1)
    async def async_hang(payload: dict[str, Any], ctx: JobContext) -> None:
        await SideEffect.objects.acreate(job_id=ctx.job_id, attempt=ctx.attempt)
        if ctx.attempt == 1:
            await asyncio.sleep(60)
        await LedgerEntry.objects.acreate(job_id=ctx.job_id, note="after timeout")

    job = enqueue("hs.async_hang", {})
    started = time.monotonic()
    runner = start_runner(concurrency=1)
    done = wait_status(job.id, JobStatus.COMPLETED, timeout=30)
    assert time.monotonic() - started < 20
    assert done.attempts == 2
    assert [(a.outcome, a.error_code) for a in attempts_of(job.id)] == [
        ("timed_out", "TIMEOUT"), ("completed", "")]
    assert list(SideEffect.objects.filter(job_id=job.id).values_list("attempt", flat=True)) \
        == [2]
    assert_runner_alive(runner)


# ------------------------------------------------------------ hand-backs are counted

def test_repeated_handbacks_are_charged_and_end_dead_lettered(
    isolated_registry: Registry, start_runner: StartRunner, settings: Any,
) -> None:
    """A job that gets its runner stopped every time it runs (a watchdog, a memory limit)."""
    settings.PERSISTENT_JOBS = {**settings.PERSISTENT_JOBS, "HANDBACK_LIMIT": 2}
    started = threading.Semaphore(0)

    @job_handler("hs.gets_runner_stopped", max_retries=1, backoff=constant(0))
    def gets_runner_stopped(payload: dict[str, Any], ctx: JobContext) -> None:
        started.release()
        while True:  # until the runner stops and hands it back
            time.sleep(0.02)

    job = enqueue("hs.gets_runner_stopped", {})
    seen = []
    for _ in range(4):
        runner = start_runner(concurrency=1, shutdown_grace=0.1)
        assert started.acquire(timeout=20), "the job did not start"
        runner.stop(timeout=30)
        stored = get_job(job.id)
        seen.append((stored.status, stored.attempts, stored.handbacks, stored.last_error_code))
    # Two free hand-backs, then each one is charged: attempt 1 fails, attempt 2 is the last.
    assert seen == [("pending", 0, 1, "SHUTDOWN"), ("pending", 0, 2, "SHUTDOWN"),
                    ("failed", 1, 3, "INTERRUPTED"), ("dead_lettered", 2, 4, "INTERRUPTED")]
    outcomes = [(a.attempt, a.outcome, a.error_code) for a in attempts_of(job.id)]
    assert outcomes == [(1, "interrupted", "SHUTDOWN"), (1, "interrupted", "SHUTDOWN"),
                        (1, "failed", "INTERRUPTED"), (2, "dead_lettered", "INTERRUPTED")]


def test_unstarted_handbacks_are_not_counted(
    isolated_registry: Registry, start_runner: StartRunner, settings: Any,
) -> None:
    """A prefetched job that never started did nothing to get its runner stopped."""
    settings.PERSISTENT_JOBS = {**settings.PERSISTENT_JOBS, "PREFETCH": 1}
    gate = Gate()
    started = threading.Event()

    @job_handler("hs.blocker", backoff=constant(0))
    def blocker(payload: dict[str, Any]) -> None:
        started.set()
        gate.wait()

    first = enqueue("hs.blocker", {}, priority=5)
    waiting = enqueue("hs.blocker", {})
    runner = start_runner(concurrency=1, shutdown_grace=5)
    # Both are claimed together (status running at once); the first must have started.
    assert started.wait(30)
    wait_status(waiting.id, JobStatus.RUNNING)  # claimed, waiting for the busy worker
    runner.request_stop()
    gate.open()
    runner.finished.wait(30)
    assert get_job(first.id).status == JobStatus.COMPLETED
    stored = get_job(waiting.id)
    assert stored.handbacks == 0 and stored.attempts == 0


# ------------------------------------------------------------ rolling deploys

def test_runner_claims_only_the_job_types_it_has_handlers_for(
    isolated_registry: Registry, start_runner: StartRunner, settings: Any,
) -> None:
    """A job type only the next release knows waits for a runner that has it."""
    settings.PERSISTENT_JOBS = {**settings.PERSISTENT_JOBS, "ALLOW_UNREGISTERED": True}
    newer = enqueue("hs.next_release_only", {"n": 1}, priority=10)
    runner = start_runner(concurrency=2)
    known = enqueue("test.ledger", {"note": "old release"})
    wait_status(known.id, JobStatus.COMPLETED)
    stored = get_job(newer.id)
    assert (stored.status, stored.attempts, stored.last_error_code) == ("pending", 0, "")
    assert not JobAttempt.objects.filter(job_id=newer.id).exists()

    # The new release's handler appears: the next claim picks the job up.
    @job_handler("hs.next_release_only")
    def next_release_only(payload: dict[str, Any], ctx: JobContext) -> None:
        LedgerEntry.objects.create(job_id=ctx.job_id, note="new release")

    runner.wake.set()
    done = wait_status(newer.id, JobStatus.COMPLETED)
    assert done.attempts == 1 and LedgerEntry.objects.get(job_id=newer.id).note == "new release"


def test_generator_handler_is_not_marked_completed(
    isolated_registry: Registry, start_runner: StartRunner,
) -> None:
    """Defence in depth behind the registration check: a handler whose call returns a
    generator never ran its body, so the job must not count as completed."""

    class Sneaky:
        def __call__(self, payload: Any, ctx: JobContext) -> Any:
            def body() -> Iterator[None]:
                LedgerEntry.objects.create(job_id=ctx.job_id, note="never")
                yield None
            return body()

    job_handler("hs.generator")(Sneaky())
    job = enqueue("hs.generator", {})
    runner = start_runner(concurrency=1)
    dead = wait_status(job.id, JobStatus.DEAD_LETTERED)
    assert dead.last_error_code == "HANDLER_INVALID" and "generator" in dead.last_error
    assert not LedgerEntry.objects.filter(job_id=job.id).exists()
    assert_runner_alive(runner)


def test_a_backoff_returning_a_timedelta_or_no_number_gives_a_usable_delay(
    isolated_registry: Registry, start_runner: StartRunner,
) -> None:
    """The runner reads a backoff's answer as ``retry_job(mode="later")`` does: a ``timedelta``
    is its seconds; NaN or a string is no delay at all (not "retry at once"): the fallback."""

    @job_handler("hs.timedelta_backoff", max_retries=2,
                 backoff=lambda attempt: timedelta(seconds=1000))
    def timedelta_backoff(payload: dict[str, Any]) -> None:
        raise RuntimeError("come back in 1000 s")

    @job_handler("hs.nan_backoff", max_retries=2, backoff=lambda attempt: float("nan"))
    def nan_backoff(payload: dict[str, Any]) -> None:
        raise RuntimeError("come back when?")

    spaced = enqueue("hs.timedelta_backoff", {})
    unusable = enqueue("hs.nan_backoff", {})
    runner = start_runner(concurrency=1)
    failed = wait_status(spaced.id, JobStatus.FAILED)
    assert timedelta(seconds=990) < failed.next_run_at - db_now(clock=True) <= timedelta(
        seconds=1000)
    failed = wait_status(unusable.id, JobStatus.FAILED)
    assert timedelta(seconds=50) < failed.next_run_at - db_now(clock=True) <= timedelta(
        seconds=60)
    assert_runner_alive(runner)


def test_a_job_no_live_runner_has_a_handler_for_is_dead_lettered(
    isolated_registry: Registry, start_runner: StartRunner,
) -> None:
    """The contract's "an unknown job type dead-letters with UNKNOWN_JOB_TYPE", for a row
    ``enqueue`` would have refused (written by hand, or left by a removed handler)."""
    unknown = PersistentJob.objects.create(job_type="hs.removed_long_ago", payload={})
    runner = start_runner(concurrency=1)
    dead = wait_status(unknown.id, JobStatus.DEAD_LETTERED)
    assert (dead.attempts, dead.last_error_code) == (1, "UNKNOWN_JOB_TYPE")
    [attempt] = JobAttempt.objects.filter(job_id=unknown.id)
    assert (attempt.outcome, attempt.error_code) == ("dead_lettered", "UNKNOWN_JOB_TYPE")
    assert_runner_alive(runner)


def test_a_job_another_live_runner_has_a_handler_for_is_left_to_it(
    isolated_registry: Registry, start_runner: StartRunner,
) -> None:
    """A type some live runner serving the queue lists (a newer release, another service)
    is not this runner's to judge: it waits for that runner."""
    with connection.cursor() as cursor:
        store.register_runner(cursor, "newer-release:1", "elsewhere", 4242, None, 1, "test",
                              job_types=["hs.newer_only"])
    theirs = PersistentJob.objects.create(job_type="hs.newer_only", payload={})
    orphan = PersistentJob.objects.create(job_type="hs.nobodys", payload={})
    start_runner(concurrency=1)
    wait_status(orphan.id, JobStatus.DEAD_LETTERED)
    stored = get_job(theirs.id)
    assert (stored.status, stored.attempts) == (JobStatus.PENDING, 0)


def test_a_runner_with_no_handlers_judges_no_job_unknown(
    isolated_registry: Registry, caplog: Any,
) -> None:
    """A runner started with the wrong settings module (no app, no handler) must not
    dead-letter the whole table as ``UNKNOWN_JOB_TYPE``: it claims nothing and says why. (A
    burst runner looks for unknown types before it stops, so its exit settles the question.)"""
    for job_type in isolated_registry.job_types():
        isolated_registry.unregister(job_type)
    stranded = PersistentJob.objects.create(job_type="hs.someone_elses", payload={})
    with caplog.at_level("WARNING", logger="django_persistent_jobs.runner"):
        assert Runner(burst=True, cleanup=False, scheduler=False).run() == 0
    assert any(getattr(r, "event", None) == "no_handlers" for r in caplog.records)
    stored = get_job(stranded.id)
    assert (stored.status, stored.attempts) == (JobStatus.PENDING, 0)
