"""Plans that cannot go stale: the runner's per-job statements keep finding rows through indexes
after the statistics were taken on empty tables (a fresh install, a benchmark's TRUNCATE), and a
drain that starts on empty tables never reads a job table whole.

A prepared statement's generic plan is made once, from the table sizes of that moment; made on
an empty table it scans sequentially (free there) and keeps doing so as the table grows, until
a vacuum or analyze invalidates it. These tests count what PostgreSQL itself reports
(``pg_stat_xact_user_tables``, ``pg_stat_user_tables``), not time.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
from django.db import connection

from django_persistent_jobs import enqueue, enqueue_many, signals
from django_persistent_jobs.runner import store
from tests.core_support import claim_as, raw_connection, wait_for

TABLES = ("persistent_jobs", "persistent_jobs_attempts")
#: A claim key before every job (``store.ClaimKey``): a resumed claim that sees them all.
EARLIEST = (0, datetime(2000, 1, 1, tzinfo=UTC), uuid.UUID(int=0))


def empty_tables_analyzed(analyze: bool = True) -> None:
    """The statistics of a fresh install: both tables analyzed while empty, or (``analyze``
    false) never analyzed at all (a TRUNCATE forgets what an earlier ANALYZE found)."""
    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE persistent_jobs, persistent_jobs_attempts, "
                       "persistent_jobs_runners CASCADE")
        if analyze:
            for table in TABLES:
                cursor.execute(f"ANALYZE {table}")


def add_history(finished: int) -> None:
    """Finished jobs with their attempts, written without analyzing anything."""
    with connection.cursor() as cursor:
        cursor.execute("""
            WITH jobs AS (
                INSERT INTO persistent_jobs (id, job_type, payload, status, max_retries,
                                             attempts, finished_at)
                SELECT gen_random_uuid(), 'test.noop', '{}'::jsonb, 'completed', 3, 1, now()
                FROM generate_series(1, %s)
                RETURNING id
            )
            INSERT INTO persistent_jobs_attempts (job_id, attempt, runner_id, outcome)
            SELECT id, 1, 'history', 'completed' FROM jobs
        """, [finished])


def xact_counts(conn: psycopg.Connection[Any]) -> dict[str, tuple[int, int]]:
    """``(seq_scan, idx_tup_fetch)`` per job table, counted in this session's open transaction."""
    rows = conn.execute(
        "SELECT relname, seq_scan, idx_tup_fetch FROM pg_stat_xact_user_tables "
        "WHERE relname = ANY(%s)", [list(TABLES)]).fetchall()
    return {name: (seq, fetched) for name, seq, fetched in rows}


def table_counts() -> dict[str, dict[str, int]]:
    """The server's flushed counters per job table (a fresh connection: a fresh snapshot)."""
    with raw_connection() as conn:
        rows = conn.execute(
            "SELECT relname, seq_scan, seq_tup_read, n_tup_ins, n_tup_upd, idx_tup_fetch "
            "FROM pg_stat_user_tables WHERE relname = ANY(%s)", [list(TABLES)]).fetchall()
    return {name: {"seq_scan": seq, "seq_tup_read": read, "ins": ins, "upd": upd,
                   "idx_tup_fetch": fetched}
            for name, seq, read, ins, upd, fetched in rows}


def claim_of_150_fetches_a_few_rows_per_job(
    claimer: psycopg.Connection[Any], claims: psycopg.Cursor[Any], key: Any,
) -> None:
    """Claim 150 jobs (after ``key``, if given) and check the rows fetched through indexes in
    each job table: a few per job, not one per job per claimed job."""
    with claimer.transaction():
        before = xact_counts(claimer)
        jobs = claim_as(claims, "plans", 150, None, ["test.noop"], after=key)
        after = xact_counts(claimer)
    assert len(jobs) == 150
    fetched = {t: after[t][1] - before[t][1] for t in TABLES}
    assert all(n < 5 * len(jobs) for n in fetched.values()), (key, fetched)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("analyzed", [True, False], ids=["analyzed-empty", "never-analyzed"])
def test_per_job_statements_use_indexes_after_statistics_of_empty_tables(analyzed: bool) -> None:
    empty_tables_analyzed(analyzed)
    nobody = store.ClaimedJob(
        id=uuid.uuid4(), job_type="test.noop", payload={}, attempt=1, max_retries=0,
        timeout=None, token=1, queue="default", priority=0, cancel_requested=False)
    with raw_connection() as claimer, raw_connection() as handler:
        claims, handles = claimer.cursor(), handler.cursor()
        # As the runner does: a claiming session of its own, statements run on empty tables
        # more than five times (after five custom plans PostgreSQL settles on a generic one).
        for _ in range(8):
            store.index_only_session(claims)
            assert claim_as(claims, "plans", 10, None, ["test.noop"]) == []
            assert claim_as(claims, "plans", 150, None, ["test.noop"]) == []
            assert claim_as(claims, "plans", 150, None, ["test.noop"], after=EARLIEST) == []
            assert not store.complete(handles, nobody)
            assert store.transition(handles, nobody.id, nobody.token, kind="retry", code="E",
                                    message="m") is None
        # The tables grow; nothing analyzes them.
        add_history(20_000)
        enqueue_many([("test.noop", {"i": i}) for i in range(2_000)])

        with claimer.transaction():
            before = xact_counts(claimer)
            jobs = claim_as(claims, "plans", 10, None, ["test.noop"])
            after = xact_counts(claimer)
        assert len(jobs) == 10
        with handler.transaction():
            handled_before = xact_counts(handler)
            for job in jobs[:5]:
                assert store.complete(handles, job)
            for job in jobs[5:]:
                assert store.transition(handles, job.id, job.token, kind="retry", code="E",
                                        message="m") == "failed"
            handled_after = xact_counts(handler)

        # A large claim costs a few lookups per job: a plan made on empty tables expects one
        # row from each CTE, and must not probe every claimed id once per claimed job.
        # (Both forms: from the head of the claim order, and resumed after a key.)
        for key in (None, EARLIEST):
            claim_of_150_fetches_a_few_rows_per_job(claimer, claims, key)

        # The claim's generic plan, as PostgreSQL kept it for this session.
        name, types = claimer.execute(
            "SELECT name, parameter_types::text[] FROM pg_prepared_statements "
            "WHERE statement LIKE '%%FOR UPDATE SKIP LOCKED%%' AND statement LIKE '%%LIMIT 10%%' "
            "AND generic_plans > 0"
        ).fetchone() or (None, None)
        assert name is not None, "the claim never reached its generic plan"
        examples = {"text[]": "'{test.noop}'", "bigint[]": "'{}'",
                    "timestamp with time zone[]": "'{}'", "text": "'plans'"}
        args = ", ".join(examples.get(t, "1") for t in types)
        plan = "\n".join(r[0] for r in claimer.execute(f'EXPLAIN EXECUTE "{name}"({args})'))

    assert "pj_claim_idx" in plan and "Seq Scan" not in plan, plan
    for table in TABLES:
        # No statement scanned a table whole, and no index was walked whole either: ten claimed
        # jobs, five completed and five failed, fetch tens of rows, not the 22,000 there are.
        for first, last in ((before, after), (handled_before, handled_after)):
            assert last[table][0] == first[table][0], (table, first, last, plan)
            assert last[table][1] - first[table][1] < 200, (table, first, last, plan)


@pytest.mark.django_db(transaction=True)
def test_a_claim_costs_a_few_lookups_per_job_whatever_plan_it_settled_on() -> None:
    """A runner that starts on a backlog nobody analyzed makes its claim plans there (five
    custom plans, then the generic one). Claims of 150 jobs each must fetch a few rows per job,
    not probe every claimed id once per claimed job (150 x 150)."""
    empty_tables_analyzed(analyze=False)
    enqueue_many([("test.noop", {"i": i}) for i in range(3_000)])
    with raw_connection() as claimer:
        claims = claimer.cursor()
        store.index_only_session(claims)
        for key in (None, EARLIEST):
            for _ in range(8):
                claim_of_150_fetches_a_few_rows_per_job(claimer, claims, key)


@pytest.fixture
def finished_count() -> Iterator[list[int]]:
    """How many ``job_finished`` signals were sent (the runner's own count, no query)."""
    count = [0]
    lock = threading.Lock()

    def receiver(**kwargs: Any) -> None:
        with lock:
            count[0] += 1

    signals.job_finished.connect(receiver, weak=False, dispatch_uid="plans-count")
    try:
        yield count
    finally:
        signals.job_finished.disconnect(dispatch_uid="plans-count")


@pytest.mark.django_db(transaction=True)
def test_a_drain_after_a_start_on_empty_tables_reads_no_table_whole(
    start_runner: Any, finished_count: list[int],
) -> None:
    """A runner started on empty, analyzed tables runs its first jobs there, so whatever plans
    it keeps were made on empty tables; the backlog that follows must not make it scan them.
    Sequential scans of a table that is still a few pages are fine (the planner picks them
    because they are cheapest there); a kept plan that scans the growing table once per job
    reads on the order of N * N / 2 rows."""
    empty_tables_analyzed()
    base = table_counts()
    runner = start_runner(concurrency=10, poll_interval=0.05)
    for i in range(8):
        enqueue("test.noop", {"warm": i})
        wait_for(lambda i=i: finished_count[0] >= i + 1, message=f"warm-up job {i}")
    drain = 3_000
    enqueue_many([("test.noop", {"i": i}) for i in range(drain)])
    wait_for(lambda: finished_count[0] >= 8 + drain, timeout=120, message="the drain")
    runner.stop(timeout=30)
    # A backend reports its counters when it exits: wait until every job's insert and
    # completion shows, then every scan that happened shows too.
    total = 8 + drain

    def flushed() -> dict[str, dict[str, int]] | None:
        now = table_counts()
        attempts = now["persistent_jobs_attempts"]
        base_attempts = base["persistent_jobs_attempts"]
        done = (attempts["ins"] - base_attempts["ins"] >= total
                and attempts["upd"] - base_attempts["upd"] >= total)
        return now if done else None

    final = wait_for(flushed, timeout=30, message="the runner's statistics")
    read = {t: final[t]["seq_tup_read"] - base[t]["seq_tup_read"] for t in TABLES}
    scans = {t: final[t]["seq_scan"] - base[t]["seq_scan"] for t in TABLES}
    fetched = {t: final[t]["idx_tup_fetch"] - base[t]["idx_tup_fetch"] for t in TABLES}
    print(f"drain of {drain}: seq scans {scans}, rows read by them {read}, "
          f"rows fetched through indexes {fetched}")
    for table in TABLES:
        assert read[table] < 100 * drain, (table, scans, read)
        # A few per job (claim, completion, foreign-key check), not one per job per job of its
        # claim (a nested loop probing the whole claimed id array for each claimed job).
        assert fetched[table] < 12 * drain, (table, fetched)
