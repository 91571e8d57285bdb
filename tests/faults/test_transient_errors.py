"""Scenario 9: database errors at completion.

A trigger (installed in this test's database only) makes every statement that moves one marked
job out of ``running`` fail with a chosen SQLSTATE while the fault is switched on: first the
fenced completion, inside the handler's transaction, then every attempt to record the failure.
A sequence (not rolled back with the failed statement) counts the hits, so the test switches the
fault off only after the runner has demonstrably retried through it.

Transient errors (serialization failure, read-only transaction as during a fail-over, disk
full) are retried until they clear; the job is then safely re-run and completes once. An error
that is not transient (a check constraint the runner's own statement violates) stops the runner
loudly, as a dead loop does, so the job is rescued by another runner instead of staying claimed
by a live one forever. The case where the COMMIT itself succeeds but its answer is lost is in
``test_postgres.py`` (it needs a server we may configure).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .harness import (
    Fleet,
    enqueue_jobs,
    enqueue_one,
    job_row,
    ledger_of,
    report,
    sql,
    sql_value,
    verify,
    wait_all_terminal,
    wait_for,
    wait_status,
)

pytestmark = [pytest.mark.faults, pytest.mark.django_db(transaction=True),
              pytest.mark.timeout(120)]

INSTALL = """
CREATE SEQUENCE IF NOT EXISTS faults_fault_hits;
CREATE TABLE IF NOT EXISTS faults_fault (sqlstate text NOT NULL);
TRUNCATE faults_fault;
CREATE OR REPLACE FUNCTION faults_fail_settlement() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    code text;
BEGIN
    SELECT sqlstate INTO code FROM faults_fault LIMIT 1;
    IF code IS NOT NULL AND OLD.payload ? 'db_fault' AND NEW.status <> 'running' THEN
        PERFORM nextval('faults_fault_hits');
        RAISE EXCEPTION 'injected fault % while settling job %', code, OLD.id
            USING ERRCODE = code;
    END IF;
    RETURN NEW;
END;
$$;
DROP TRIGGER IF EXISTS faults_fail_settlement ON persistent_jobs;
CREATE TRIGGER faults_fail_settlement BEFORE UPDATE ON persistent_jobs
    FOR EACH ROW WHEN (OLD.status = 'running') EXECUTE FUNCTION faults_fail_settlement();
"""

UNINSTALL = """
DROP TRIGGER IF EXISTS faults_fail_settlement ON persistent_jobs;
DROP FUNCTION IF EXISTS faults_fail_settlement();
DROP TABLE IF EXISTS faults_fault;
DROP SEQUENCE IF EXISTS faults_fault_hits;
"""


@pytest.fixture
def fault(ledger: None) -> Iterator[None]:
    sql(INSTALL)
    yield
    sql(UNINSTALL)


def _hits() -> int:
    return int(sql_value("SELECT CASE WHEN is_called THEN last_value ELSE 0 END "
                         "FROM faults_fault_hits"))


def _switch(sqlstate: str | None) -> None:
    sql("TRUNCATE faults_fault")
    if sqlstate:
        sql("INSERT INTO faults_fault VALUES (%s)", [sqlstate])


@pytest.mark.parametrize("sqlstate", ["40001", "25006", "53100"],
                         ids=["serialization_failure", "read_only_transaction", "disk_full"])
def test_transient_error_at_completion_is_retried_then_the_job_reruns(
    fleet: Fleet, fault: None, sqlstate: str,
) -> None:
    _switch(sqlstate)
    start = _hits()
    runner = fleet.spawn("transient", concurrency=2)
    job = enqueue_one({"db_fault": True})
    others = enqueue_jobs(30, {"work": 0.02})
    # The completion failed, then recording the failure failed at least twice more.
    wait_for(lambda: _hits() - start >= 3, timeout=30, message="the runner to hit the fault",
             reconnect=True)
    row = job_row(job)
    assert (row["status"], row["locked_by"]) == ("running", runner.runner_id)
    wait_all_terminal(others, timeout=30)  # the runner serves other jobs meanwhile
    _switch(None)
    done = wait_status(job, "completed", timeout=20)
    assert done["attempts"] == 2
    assert sql("SELECT outcome, error_code FROM persistent_jobs_attempts WHERE job_id = %s "
               "ORDER BY id", [job]) == [("failed", "DB_ERROR"), ("completed", "")]
    assert ledger_of(job) == [(2, runner.runner_id)]
    verify([job, *others])
    assert runner.alive
    report(f"transient_{sqlstate}", fault_hits=_hits() - start)


def test_persistent_error_settling_a_job_stops_the_runner_so_the_job_is_rescued(
    fleet: Fleet, fault: None,
) -> None:
    _switch("23514")  # check_violation: not something retrying will fix
    runner = fleet.spawn("broken", concurrency=2)
    job = enqueue_one({"db_fault": True})
    assert runner.wait_exit(30) == 2  # stopped loudly, like a runner whose loop died
    row = job_row(job)
    assert (row["status"], row["locked_by"]) == ("running", runner.runner_id)
    assert sql("SELECT count(*) FROM persistent_jobs_runners WHERE id = %s",
               [runner.runner_id]) == [(0,)]  # it unregistered: its job is an orphan now
    _switch(None)
    rescuer = fleet.spawn("rescuer", concurrency=2)
    wait_status(job, "completed", timeout=20)
    assert sql("SELECT runner_id, outcome, error_code FROM persistent_jobs_attempts "
               "WHERE job_id = %s ORDER BY id", [job]) == [
        (runner.runner_id, "rescued", "RUNNER_LOST"), (rescuer.runner_id, "completed", "")]
    assert ledger_of(job) == [(2, rescuer.runner_id)]
    verify([job])
