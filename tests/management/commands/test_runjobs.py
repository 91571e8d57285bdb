"""``python manage.py runjobs``: argument checking, ``--burst``, ``--queues`` (real processes)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from django_persistent_jobs import enqueue, job_handler
from django_persistent_jobs.handlers import registry
from django_persistent_jobs.models import JobAttempt, JobRunnerRecord, JobStatus, PersistentJob
from tests.runner_support import get_job
from tests.testapp.models import LedgerEntry

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

Spawn = Callable[..., "subprocess.Popen[bytes]"]
LOG_ENV = {"PJ_TEST_LOG": "INFO"}  # runner logs on stdout end up in assertion messages


def _finish(proc: subprocess.Popen[bytes], timeout: float = 30) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"runjobs did not exit within {timeout}s:\n{out.decode()}") from None
    return proc.returncode, out.decode(errors="replace")


@pytest.mark.django_db  # no runner starts: a rolled-back test is enough
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--concurrency", "0"], "--concurrency"),
        (["--concurrency", "-3"], "--concurrency"),
        (["--poll-interval", "0"], "--poll-interval"),
        (["--poll-interval", "-1"], "--poll-interval"),
        (["--queues", ","], "--queues"),
        (["--queues", " , ,"], "--queues"),
        # Beyond what a thread can wait (``threading.TIMEOUT_MAX``): refused at start, not a
        # traceback at the first wait or a claim loop that dies after the runner started.
        # ``--burst`` so that a regression ends instead of running on.
        (["--burst", "--poll-interval", "1e300"], "poll_interval"),
        (["--burst", "--grace", "1e300"], "shutdown_grace"),
        (["--burst", "--database-wait", "inf"], "database_wait"),
        (["--burst", "--database-wait", "1e300"], "database_wait"),
        # An empty value (``--queues "$QUEUES"`` with the variable unset) names no queue: it
        # must not quietly serve every queue, as leaving the option out does.
        (["--burst", "--queues", ""], "--queues"),
    ],
)
def test_bad_arguments_are_command_errors(args: list[str], message: str) -> None:
    with pytest.raises(CommandError, match=message):
        call_command("runjobs", *args)
    assert not JobRunnerRecord.objects.exists()


@pytest.mark.django_db
def test_invalid_handler_is_a_command_error() -> None:
    with registry.isolated():

        @job_handler("rt.bad_options", timeout=-5)
        def bad(payload: Any) -> None:
            return None

        with pytest.raises(CommandError, match="timeout"):
            call_command("runjobs", "--burst")
    assert not JobRunnerRecord.objects.exists()


def test_burst_processes_everything_due_and_exits_zero(spawn_runner: Spawn) -> None:
    due = [enqueue("test.ledger", {"note": f"due {i}"}) for i in range(20)]
    doomed = enqueue("test.ledger", {"permanent": True})
    later = enqueue("test.ledger", {"note": "tomorrow"}, delay=86400)
    started = time.monotonic()
    code, output = _finish(spawn_runner("--burst", "--concurrency", "3", env=LOG_ENV))
    assert code == 0, output
    assert time.monotonic() - started < 30
    statuses = dict(PersistentJob.objects.values_list("id", "status"))
    assert {statuses[j.id] for j in due} == {JobStatus.COMPLETED}
    assert statuses[doomed.id] == JobStatus.DEAD_LETTERED
    assert statuses[later.id] == JobStatus.PENDING
    assert LedgerEntry.objects.count() == 20
    assert JobAttempt.objects.count() == 21
    assert not JobRunnerRecord.objects.exists()


@pytest.mark.parametrize("processes", ["0", "1"])
def test_payloads_are_decoded_where_the_handlers_run_and_an_undecodable_one_costs_its_job(
    spawn_runner: Spawn, processes: str,
) -> None:
    """The claim loop leaves payloads undecoded (with worker processes, the supervisor does no
    per-payload work); each is decoded where its handler runs. One Python cannot decode (an
    integer of 5,000 digits: valid jsonb, written by raw SQL) dead-letters its own job only,
    in the same claim as jobs that run with their payloads intact."""
    from django.db import connection

    payload = {"note": "ünïcode ✓", "nested": {"list": [1, 2.5, None, True], "big": 2**70}}
    good = [enqueue("test.ledger", dict(payload, i=i)) for i in range(5)]
    bad = enqueue("test.ledger", {"note": "placeholder"})
    with connection.cursor() as cursor:
        cursor.execute("UPDATE persistent_jobs SET payload = ('{\"n\": ' || repeat('7', 5000) "
                       "|| '}')::jsonb WHERE id = %s", [bad.id])
    code, output = _finish(spawn_runner("--burst", "--processes", processes, env=LOG_ENV))
    assert code == 0, output
    assert {get_job(j.id).status for j in good} == {JobStatus.COMPLETED}
    assert sorted(LedgerEntry.objects.values_list("note", flat=True)) == [payload["note"]] * 5
    status, code_, message = PersistentJob.objects.filter(id=bad.id).values_list(
        "status", "last_error_code", "last_error").get()
    assert (status, code_) == (JobStatus.DEAD_LETTERED, "PAYLOAD_INVALID")
    assert "cannot be decoded" in message


@pytest.mark.parametrize("processes", ["0", "1"])
def test_a_line_per_completed_job_only_from_verbosity_2_failures_always(
    spawn_runner: Spawn, processes: str,
) -> None:
    """At thousands of jobs a second a line per job costs a fifth of the rate; the attempts are
    in the database anyway. Failures and dead letters are logged at every verbosity above 0."""
    quiet = [enqueue("test.ledger", {"note": "writes"}), enqueue("test.noop", {})]
    doomed = enqueue("test.ledger", {"permanent": True})
    code, output = _finish(spawn_runner("--burst", "--processes", processes, env=LOG_ENV))
    assert code == 0, output
    assert get_job(quiet[0].id).status == get_job(quiet[1].id).status == JobStatus.COMPLETED
    assert " completed" not in output, output
    assert f"job {doomed.id} dead-lettered" in output, output

    loud = [enqueue("test.ledger", {"note": "writes"}), enqueue("test.noop", {})]
    code, output = _finish(spawn_runner("--burst", "--processes", processes, "-v", "2",
                                        env=LOG_ENV))
    assert code == 0, output
    for job in loud:  # one written with the handler's transaction, one by the completer
        assert f"job {job.id} completed" in output, output


def test_database_wait_zero_tries_once_and_runs(spawn_runner: Spawn) -> None:
    """``--database-wait 0`` (documented: >= 0) means "do not wait for a database that is
    down", not "give up before trying": against a reachable database the burst runs."""
    job = enqueue("test.ledger", {"note": "no wait"})
    code, output = _finish(spawn_runner("--burst", "--database-wait", "0", env=LOG_ENV))
    assert code == 0, output
    assert get_job(job.id).status == JobStatus.COMPLETED


def test_burst_with_nothing_due_exits_zero(spawn_runner: Spawn) -> None:
    later = enqueue("test.ledger", {}, delay=3600)
    code, output = _finish(spawn_runner("--burst", env=LOG_ENV))
    assert code == 0, output
    assert get_job(later.id).status == JobStatus.PENDING
    assert not JobAttempt.objects.exists()


def test_burst_runs_a_retry_that_falls_due_while_work_is_running(spawn_runner: Spawn) -> None:
    """A job that fails once (retry due 0.2 s later, test.ledger's backoff) is finished too when
    the retry becomes due while other work is still running."""
    flaky = enqueue("test.ledger", {"fail_times": 1})
    slow = enqueue("test.ledger", {"sleep": 1.5})
    code, output = _finish(spawn_runner("--burst", "--concurrency", "2", env=LOG_ENV))
    assert code == 0, output
    assert get_job(slow.id).status == JobStatus.COMPLETED
    done = get_job(flaky.id)
    assert done.status == JobStatus.COMPLETED and done.attempts == 2


@pytest.mark.parametrize("processes", ["0", "1"])
def test_burst_runs_the_retry_of_a_timed_out_job_that_is_due_at_once(
    spawn_runner: Spawn, processes: str,
) -> None:
    """A timeout frees the job's slot before its retry is written: the burst must not stop in
    between, on a claim that found nothing due and no job running, while that retry (due at
    once: no backoff) is being written. Every attempt times out, so the job ends dead-lettered
    after its one retry, in this one burst."""
    job = enqueue("test.oversleep", {"sleep": 3}, timeout=0.5)
    code, output = _finish(spawn_runner("--burst", "--processes", processes, env=LOG_ENV))
    assert code == 0, output
    done = get_job(job.id)
    assert (done.status, done.attempts, done.last_error_code) == (
        JobStatus.DEAD_LETTERED, 2, "TIMEOUT"), output
    assert list(JobAttempt.objects.filter(job_id=job.id).order_by("attempt")
                .values_list("outcome", flat=True)) == ["timed_out", "timed_out"]


def test_queues_option_restricts_claiming(spawn_runner: Spawn) -> None:
    jobs = {q: enqueue("test.ledger", {"note": q}, queue=q) for q in ("alpha", "beta", "gamma")}
    code, output = _finish(spawn_runner("--burst", "--queues", "alpha, beta", env=LOG_ENV))
    assert code == 0, output
    assert get_job(jobs["alpha"].id).status == JobStatus.COMPLETED
    assert get_job(jobs["beta"].id).status == JobStatus.COMPLETED
    gamma = get_job(jobs["gamma"].id)
    assert gamma.status == JobStatus.PENDING and gamma.attempts == 0
    assert sorted(LedgerEntry.objects.values_list("note", flat=True)) == ["alpha", "beta"]
