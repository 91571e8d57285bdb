"""Schema guarantees: the partial unique dedup index, the status constraint, and a claim query
that stays an index scan however many finished rows the table holds (the plan is asserted)."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from django_persistent_jobs.models import PersistentJob, due, held_by_dedup
from django_persistent_jobs.runner import store
from tests.core_support import claim_as

SEQ_SCAN_ON_JOBS = re.compile(r"Seq Scan on persistent_jobs(?!_)")


def index_def(name: str) -> str:
    with connection.cursor() as cursor:
        cursor.execute("SELECT indexdef FROM pg_indexes WHERE tablename = 'persistent_jobs' "
                       "AND indexname = %s", [name])
        row = cursor.fetchone()
    assert row is not None, f"index {name} is missing"
    return str(row[0])


def row(**fields: Any) -> PersistentJob:
    fields.setdefault("job_type", "core.idx")
    fields.setdefault("max_retries", 3)
    return PersistentJob.objects.create(**fields)


@pytest.mark.django_db
def test_indexes_are_partial_where_it_matters() -> None:
    unique = index_def("pj_dedup_waiting_uniq")
    assert "CREATE UNIQUE INDEX pj_dedup_waiting_uniq" in unique
    assert "(job_type, dedup_key) WHERE" in unique
    where = unique.split(" WHERE ", 1)[1]
    assert "'pending'" in where and "'failed'" in where and "'running'" not in where
    assert "'enqueue'" in where and "dedup_key IS NOT NULL" in where
    claim = index_def("pj_claim_idx")
    assert "(priority DESC, next_run_at, id) WHERE" in claim
    claim_where = claim.split(" WHERE ", 1)[1]
    assert "'pending'" in claim_where and "'failed'" in claim_where
    assert "'completed'" not in claim_where and "'running'" not in claim_where
    running = index_def("pj_running_key_idx")
    assert "(job_type, dedup_key) WHERE" in running and "'running'" in running


@pytest.mark.django_db
def test_the_runner_maintains_no_index_it_does_not_need() -> None:
    """Claiming and completing a job are never HOT updates (status is in the partial indexes'
    predicates), so every index covering the row takes a new entry at each: the attempts table
    has one index by job (not the foreign key's own as well), and the per-type index leaves out
    the two statuses every job passes through."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT indexname, indexdef FROM pg_indexes "
                       "WHERE tablename = 'persistent_jobs_attempts'")
        attempts = dict(cursor.fetchall())
    by_job = [name for name, ddl in attempts.items() if "(job_id" in ddl]
    assert by_job == ["pj_attempt_job_idx"], attempts
    assert "(job_id, attempt)" in attempts["pj_attempt_job_idx"]
    per_type = index_def("pj_type_status_idx")
    where = per_type.split(" WHERE ", 1)[1]
    assert "(job_type, status) WHERE" in per_type
    assert "'dead_lettered'" in where and "'pending'" in where and "'failed'" in where
    assert "'running'" not in where and "'completed'" not in where


@pytest.mark.django_db
def test_dead_letters_of_a_type_are_found_through_an_index() -> None:
    """The per-type index still serves the lookups it exists for (failure groups, stats)."""
    from django_persistent_jobs.services import failure_group_dead_letters

    with connection.cursor() as cursor:
        cursor.execute("""
            INSERT INTO persistent_jobs (id, job_type, payload, status, max_retries,
                                         last_error_code, finished_at)
            SELECT gen_random_uuid(), 'core.idx.' || (g % 20), '{}'::jsonb,
                   CASE WHEN g % 1000 = 0 THEN 'dead_lettered' ELSE 'completed' END, 3,
                   'E' || (g % 3), now()
            FROM generate_series(1, 40000) AS g
        """)
        cursor.execute("ANALYZE persistent_jobs")
        sql, params = failure_group_dead_letters("core.idx.0", "E1").query.sql_with_params()
        cursor.execute("EXPLAIN " + sql, params)
        plan = "\n".join(r[0] for r in cursor.fetchall())
    assert not SEQ_SCAN_ON_JOBS.search(plan), plan


@pytest.mark.django_db
def test_unique_dedup_index_covers_waiting_jobs_only() -> None:
    row(dedup_key="k", status="pending")
    for status in ("pending", "failed"):
        with pytest.raises(IntegrityError, match="pj_dedup_waiting_uniq"), transaction.atomic():
            row(dedup_key="k", status=status)
    # Running, finished, Enqueue-strategy and other-type rows may share the key.
    row(dedup_key="k", status="running")
    row(dedup_key="k", status="completed")
    row(dedup_key="k", status="cancelled")
    row(dedup_key="k", status="pending", dedup="enqueue")
    row(dedup_key="k", status="pending", job_type="core.idx.other")
    row(dedup_key=None, status="pending")
    row(dedup_key=None, status="pending")
    assert PersistentJob.objects.filter(dedup_key="k").count() == 6


@pytest.mark.django_db
def test_status_is_constrained() -> None:
    with pytest.raises(IntegrityError, match="pj_status_valid"), transaction.atomic():
        row(status="done")


@pytest.mark.django_db
def test_claim_query_is_an_index_scan_with_many_finished_rows() -> None:
    with connection.cursor() as cursor:
        cursor.execute("""
            INSERT INTO persistent_jobs (id, job_type, payload, status, max_retries, dedup_key,
                                         next_run_at, finished_at, attempts)
            SELECT gen_random_uuid(), 'core.idx.' || (g % 20), '{"n": 1}'::jsonb,
                   (ARRAY['completed', 'dead_lettered', 'cancelled'])[1 + g % 3], 3,
                   CASE WHEN g % 2 = 0 THEN 'key-' || g END,
                   now() - interval '1 day', now() - interval '1 hour', 1
            FROM generate_series(1, 60000) AS g
        """)
        cursor.execute("""
            INSERT INTO persistent_jobs (id, job_type, payload, status, max_retries, dedup_key,
                                         next_run_at, priority, queue)
            SELECT gen_random_uuid(), 'core.idx.' || (g % 20), '{}'::jsonb,
                   CASE WHEN g % 5 = 0 THEN 'failed' ELSE 'pending' END, 3,
                   'waiting-' || g, now() - (g || ' seconds')::interval, g % 3,
                   CASE WHEN g % 2 = 0 THEN 'default' ELSE 'mail' END
            FROM generate_series(1, 40) AS g
        """)
        cursor.execute("""
            INSERT INTO persistent_jobs (id, job_type, payload, status, max_retries, dedup_key,
                                         attempts, lock_token)
            SELECT gen_random_uuid(), 'core.idx.1', '{}'::jsonb, 'running', 3, 'running-' || g,
                   1, g FROM generate_series(1, 5) AS g
        """)
        cursor.execute("ANALYZE persistent_jobs")
        plans = {}
        for name, sql, params in (
            ("all queues", store.claim_sql(10), {"runner": "r"}),
            ("some queues", store.claim_sql(10, with_queues=True),
             {"runner": "r", "queues": ["mail"]}),
            ("registered types", store.claim_sql(10, with_types=True),
             {"runner": "r", "types": [f"core.idx.{n}" for n in range(0, 20, 2)]}),
            ("some queues, registered types", store.claim_sql(10, True, True),
             {"runner": "r", "queues": ["mail"], "types": ["core.idx.1", "core.idx.3"]}),
        ):
            params = {**params, "direct": 10, "started": [], "started_at": []}
            with store.prepared(cursor) as fast:  # (binary parameters, as the runner sends)
                fast.execute("EXPLAIN " + sql, params)
                plans[name] = "\n".join(r[0] for r in fast.fetchall())
        # The runner prepares the statement, so PostgreSQL settles on a generic plan (queues
        # and types unknown at plan time): that plan must walk pj_claim_idx too, for every
        # variant of the ORM-built text.
        for name, (queues, types) in {"generic plan": (False, False),
                                      "some queues, generic plan": (True, False),
                                      "registered types, generic plan": (False, True),
                                      "some queues, registered types, generic plan": (True, True),
                                      }.items():
            generic = (store.claim_sql(10, queues, types).replace("%(runner)s", "$1")
                       .replace("%(queues)s", "$2").replace("%(types)s", "$3")
                       .replace("%(direct)s", "$4").replace("%(started)b", "$5")
                       .replace("%(started_at)b", "$6"))
            cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
            cursor.execute("PREPARE pj_claim_generic(text, text[], text[], int, bigint[], "
                           f"timestamptz[]) AS {generic}")
            cursor.execute("EXPLAIN EXECUTE pj_claim_generic('r', '{mail}', '{core.idx.1}', "
                           "10, '{}', '{}')")
            plans[name] = "\n".join(r[0] for r in cursor.fetchall())
            cursor.execute("DEALLOCATE pj_claim_generic")
            cursor.execute("SET LOCAL plan_cache_mode = auto")
        # A claim resuming after the last claimed key starts its index scan there (an index
        # condition), which is what keeps it from walking the dead entries before that key.
        resumed = (store.claim_sql(10, after=True).replace("%(runner)s", "$1")
                   .replace("%(after_priority)s", "$2").replace("%(after_at)s", "$3")
                   .replace("%(after_id)s", "$4").replace("%(direct)s", "$5")
                   .replace("%(started)b", "$6").replace("%(started_at)b", "$7"))
        cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        cursor.execute("PREPARE pj_claim_after(text, int, timestamptz, uuid, int, bigint[], "
                       f"timestamptz[]) AS {resumed}")
        cursor.execute("EXPLAIN EXECUTE pj_claim_after('r', 0, now(), gen_random_uuid(), 10, "
                       "'{}', '{}')")
        plans["resumed after a key, generic plan"] = "\n".join(r[0] for r in cursor.fetchall())
        cursor.execute("DEALLOCATE pj_claim_after")
        cursor.execute("SET LOCAL plan_cache_mode = auto")
        index_cond = [line for line in plans["resumed after a key, generic plan"].splitlines()
                      if "Index Cond" in line]
        assert index_cond and "next_run_at" in index_cond[0] and "priority" in index_cond[0], \
            plans["resumed after a key, generic plan"]
        print("\n\n".join(f"-- claim plan ({k}), 60k finished rows:\n{v}"
                          for k, v in plans.items()))
        for name, plan in plans.items():
            assert "pj_claim_idx" in plan, f"{name}:\n{plan}"
            assert not SEQ_SCAN_ON_JOBS.search(plan), f"{name}:\n{plan}"
            assert "LockRows" in plan, f"{name}:\n{plan}"  # FOR UPDATE SKIP LOCKED

        # And it returns the right jobs: priority first, then the oldest due.
        cursor.execute("SELECT id FROM persistent_jobs WHERE status IN ('pending', 'failed') "
                       "ORDER BY priority DESC, next_run_at LIMIT 3")
        expected = [r[0] for r in cursor.fetchall()]
        assert [j.id for j in claim_as(cursor, "r", 3, None)] == expected


@pytest.mark.django_db
def test_job_tables_are_vacuumed_after_a_fixed_number_of_changes() -> None:
    """Dead index entries slow every claim until a vacuum; the default 20% threshold is far too
    late for a queue table, so migration 0005 sets fixed thresholds."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT relname, reloptions FROM pg_class WHERE relname IN "
                       "('persistent_jobs', 'persistent_jobs_attempts')")
        options = {name: set(opts or []) for name, opts in cursor.fetchall()}
    assert "autovacuum_vacuum_threshold=2000" in options["persistent_jobs"]
    assert "autovacuum_vacuum_scale_factor=0" in options["persistent_jobs"]
    assert "autovacuum_vacuum_threshold=10000" in options["persistent_jobs_attempts"]


@pytest.mark.django_db
def test_claim_statement_is_built_from_the_claimable_queryset() -> None:
    """The claim's ``picked`` part is ``PersistentJob.objects.claimable()`` as the ORM compiles
    it, constants inlined (the generic plan needs them to prove the partial index predicate),
    and the registered-types filter kept as ``array_position(...) IS NOT NULL``."""
    for queues in (False, True):
        for types in (False, True):
            text = store.claim_sql(7, queues, types)
            picked = store.picked_sql(7, queues, types)
            assert picked in text
            assert store.claim_sql(7, queues, types) is text  # compiled once
            assert picked.endswith("LIMIT 7 FOR UPDATE SKIP LOCKED")
            assert "\"status\" IN ('pending', 'failed')" in picked
            assert "NOT EXISTS" in picked and "'running'" in picked and "'enqueue'" in picked
            assert ("%(queues)s" in picked) is queues
            assert ("array_position((%(types)s::text[])" in picked) is types
            assert "%s" not in picked.replace("%(queues)s", "").replace("%(types)s", "")


@pytest.mark.django_db
def test_claimable_lists_what_the_claim_takes_in_order() -> None:
    """One definition of "due and claimable": what the queryset lists is what a claim takes."""
    future = timezone.now() + timedelta(hours=1)
    row(status="pending", priority=0)
    row(status="failed", priority=5)
    row(status="pending", priority=1, queue="mail")
    row(status="pending", job_type="core.idx.other")
    row(status="pending", next_run_at=future)  # not due
    row(status="completed")
    row(status="running", dedup_key="busy", lock_token=1)
    row(status="pending", dedup_key="busy")  # blocked by the running job with its key
    row(status="pending", dedup_key="busy", dedup="enqueue", job_type="core.idx.other")
    cases: list[tuple[tuple[str, ...] | None, list[str] | None]] = [
        (None, None), (("mail",), None), (None, ["core.idx"]), (("default",), ["core.idx.other"]),
    ]
    for queues, types in cases:
        expected = list(PersistentJob.objects.claimable(queues=queues, job_types=types)
                        .values_list("id", flat=True))
        with transaction.atomic(), connection.cursor() as cursor:
            claimed = [j.id for j in claim_as(cursor, "r", 100, queues, types)]
            transaction.set_rollback(True)
        assert claimed == expected, (queues, types)
    assert len(PersistentJob.objects.claimable()) == 5


@pytest.mark.django_db
def test_due_is_claimable_plus_the_jobs_held_by_dedup() -> None:
    """The operator views count as due what a claim would take plus the jobs a running job with
    their dedup key holds back, and nothing else (``models.due``, ``models.held_by_dedup``)."""
    past = timezone.now() - timedelta(hours=1)
    row(status="pending", next_run_at=past)
    row(status="failed", next_run_at=past)
    row(status="pending", next_run_at=timezone.now() + timedelta(hours=1))  # not due
    row(status="completed")
    row(status="running", dedup_key="busy", lock_token=1)
    held = row(status="pending", dedup_key="busy", next_run_at=past)
    row(status="pending", dedup_key="busy", dedup="enqueue", job_type="core.idx.other")
    jobs = PersistentJob.objects
    due_now = set(jobs.filter(due()).values_list("id", flat=True))
    claimable = set(jobs.claimable().values_list("id", flat=True))
    held_back = set(jobs.filter(due(), held_by_dedup()).values_list("id", flat=True))
    assert held_back == {held.id}
    assert due_now == claimable | held_back and not claimable & held_back
    assert len(due_now) == 4
    earlier = set(jobs.filter(due(past - timedelta(minutes=1))).values_list("id", flat=True))
    assert earlier == set()


@pytest.mark.django_db
def test_a_schedules_runs_are_found_through_an_index() -> None:
    """The admin's "runs of X" (``?schedule__name=X``) must not read a table of a million
    finished one-shot jobs: only recurring runs are in ``pj_schedule_name_idx``."""
    with connection.cursor() as cursor:
        cursor.execute("""
            INSERT INTO persistent_jobs (id, job_type, payload, status, max_retries, schedule,
                                         finished_at, attempts)
            SELECT gen_random_uuid(), 'core.idx', '{}'::jsonb, 'completed', 3,
                   CASE WHEN g % 100 = 0 THEN jsonb_build_object('name', 'sched-' || (g % 7))
                   END, now(), 1
            FROM generate_series(1, 20000) AS g
        """)
        cursor.execute("ANALYZE persistent_jobs")
    plan = PersistentJob.objects.filter(schedule__name="sched-3").explain()
    assert "pj_schedule_name_idx" in plan, plan
    assert PersistentJob.objects.filter(schedule__name="sched-3").count() == 28
