"""The fault suite's machinery: runner processes we can kill, a private PostgreSQL we can restart,
and the checks every scenario ends with.

Synchronisation is by events with deadlines only: a runner's log line (runners log one line per
event to stdout, see ``PJ_TEST_LOG`` in ``tests/settings.py``) or a database state polled until a
deadline. Fixed sleeps appear only as *fault parameters* (how long an outage lasts, how often a
runner is killed), never as a stand-in for "wait until X happened".

The machinery lives in one module per concern; this module gathers the names scenarios use:

- ``runners``: runner subprocesses (start, freeze, kill, wait for log lines) and their sessions;
- ``sql``: test-side queries that survive a server restart, the suite's jobs, polls;
- ``tests.core_support.wait_for``: every poll, called with ``reconnect=True`` here: a scenario
  may restart PostgreSQL under the test, and a dropped connection then counts as "not yet";
- ``invariants``: the end-of-scenario checks (``verify``) and the numbers a scenario reports;
- ``cluster``: a private PostgreSQL cluster the scenarios may stop and restart.
"""

from __future__ import annotations

from tests.core_support import wait_for

from .cluster import PrivateCluster, migrate, using_database
from .invariants import Attempt, Verdict, attempts_of, ledger_of, report, verify
from .runners import (
    APP_PREFIX,
    FAST_SETTINGS,
    HEARTBEAT,
    POLL,
    PROCESSES,
    STALE,
    Fleet,
    RunnerProcess,
    backends,
    cpu_seconds,
    database_url,
    runner_pid_from_id,
    terminate,
)
from .sql import (
    JOB_TYPE,
    TERMINAL,
    create_ledger,
    db_retrying,
    enqueue_jobs,
    enqueue_one,
    job_row,
    new_id,
    sql,
    sql_value,
    status_counts,
    wait_all_terminal,
    wait_status,
)

__all__ = [
    "APP_PREFIX",
    "FAST_SETTINGS",
    "HEARTBEAT",
    "JOB_TYPE",
    "POLL",
    "PROCESSES",
    "STALE",
    "TERMINAL",
    "Attempt",
    "Fleet",
    "PrivateCluster",
    "RunnerProcess",
    "Verdict",
    "attempts_of",
    "backends",
    "cpu_seconds",
    "create_ledger",
    "database_url",
    "db_retrying",
    "enqueue_jobs",
    "enqueue_one",
    "job_row",
    "ledger_of",
    "migrate",
    "new_id",
    "report",
    "runner_pid_from_id",
    "sql",
    "sql_value",
    "status_counts",
    "terminate",
    "using_database",
    "verify",
    "wait_all_terminal",
    "wait_for",
    "wait_status",
]
