"""``stats.dashboard_stats``: every dashboard number, against rows staged in real PostgreSQL."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import connection

from django_persistent_jobs import enqueue, job_handler
from django_persistent_jobs.models import JobAttempt, JobRunnerRecord, PersistentJob
from django_persistent_jobs.stats import dashboard_stats
from tests.core_support import db_now


@job_handler("stats.mail", queue="mail")
def mail(payload: Any) -> None:
    return None


@job_handler("stats.report", queue="reports")
def report(payload: Any) -> None:
    return None


def job(job_type: str = "stats.mail", tenant: str | None = None, **fields: Any) -> PersistentJob:
    created = enqueue(job_type, {}, tenant=tenant)
    if fields:
        PersistentJob.objects.filter(pk=created.pk).update(**fields)
    return PersistentJob.objects.get(pk=created.pk)


def attempt(of: PersistentJob, n: int, outcome: str, code: str, finished: datetime,
            message: str = "boom") -> JobAttempt:
    return JobAttempt.objects.create(
        job=of, attempt=n, runner_id="r1", outcome=outcome, error_code=code,
        error_message=message, started_at=finished - timedelta(seconds=1), finished_at=finished,
        duration=timedelta(seconds=1))


def runner(runner_id: str, beat_age: timedelta, now: datetime,
           queues: list[str] | None = None, job_types: list[str] | None = None
           ) -> JobRunnerRecord:
    return JobRunnerRecord.objects.create(
        id=runner_id, hostname="h", pid=1, queues=queues, job_types=job_types, concurrency=4,
        version="1.2", heartbeat_at=now - beat_age, started_at=now - timedelta(hours=1))


@pytest.mark.django_db
def test_counts_per_status_type_and_tenant_and_the_tenant_confines_them() -> None:
    now = db_now()
    job("stats.mail", tenant="acme")
    job("stats.mail", tenant="acme", status="completed", finished_at=now)
    job("stats.report", tenant="globex", status="dead_lettered", finished_at=now,
        last_error_code="BOOM")
    job("stats.report")

    everything = dashboard_stats(now=now)
    assert everything.status_counts["pending"] == 2
    assert everything.status_counts["completed"] == 1
    assert everything.status_counts["dead_lettered"] == 1
    assert sum(everything.status_counts.values()) == 4
    by_type = {t.job_type: t for t in everything.job_types}
    assert by_type["stats.mail"].total == 2 and by_type["stats.mail"].counts["completed"] == 1
    assert by_type["stats.report"].counts["dead_lettered"] == 1
    tenants = {t.tenant: t for t in everything.tenants}
    assert (tenants["acme"].total, tenants["globex"].total, tenants[None].total) == (2, 1, 1)

    acme = dashboard_stats(now=now, tenant="acme")
    assert acme.tenant == "acme"
    assert sum(acme.status_counts.values()) == 2
    assert [t.job_type for t in acme.job_types] == ["stats.mail"]
    assert [t.tenant for t in acme.tenants] == ["acme"]
    assert {q.queue: q.waiting for q in acme.queues}.get("reports", 0) == 0


@pytest.mark.django_db
def test_queues_depth_oldest_due_wait_and_whether_a_live_runner_serves_them() -> None:
    now = db_now()
    job("stats.mail", next_run_at=now - timedelta(minutes=5))
    job("stats.mail", next_run_at=now - timedelta(minutes=1))
    job("stats.mail", next_run_at=now + timedelta(hours=1))
    job("stats.mail", status="running", locked_by="live-1", locked_at=now)
    job("stats.report", next_run_at=now - timedelta(seconds=30))
    runner("live-1", timedelta(seconds=0), now, queues=["mail"])
    runner("dead-1", timedelta(minutes=10), now, queues=["reports"])

    queues = {q.queue: q for q in dashboard_stats(now=now).queues}
    mail_q = queues["mail"]
    assert (mail_q.waiting, mail_q.due, mail_q.running) == (3, 2, 1)
    assert mail_q.oldest_due_wait is not None
    assert timedelta(minutes=5) - timedelta(seconds=1) <= mail_q.oldest_due_wait
    assert mail_q.oldest_due_wait <= timedelta(minutes=5) + timedelta(seconds=1)
    assert mail_q.served and mail_q.runners == ["live-1"]
    reports = queues["reports"]
    assert (reports.waiting, reports.due, reports.served, reports.runners) == (1, 1, False, [])


@pytest.mark.django_db
def test_hourly_and_daily_series_count_completions_failures_and_dead_letters() -> None:
    now = db_now()
    hour = now.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
    two_hours_ago = hour - timedelta(hours=2) + timedelta(minutes=10)
    done = job("stats.mail", status="completed", finished_at=now)
    job("stats.mail", status="completed", finished_at=two_hours_ago)
    dead = job("stats.report", status="dead_lettered", finished_at=two_hours_ago)
    attempt(dead, 1, "failed", "BOOM", two_hours_ago - timedelta(minutes=5))
    attempt(dead, 2, "dead_lettered", "BOOM", two_hours_ago)
    attempt(done, 1, "timed_out", "TIMEOUT", now)
    job("stats.mail", status="completed", finished_at=now - timedelta(days=3))
    job("stats.mail", status="completed", finished_at=now - timedelta(days=30))

    stats = dashboard_stats(now=now)
    assert len(stats.hourly) == 24 and stats.hourly[-1].start == hour
    assert [b.start for b in stats.hourly] == sorted(b.start for b in stats.hourly)
    current, earlier = stats.hourly[-1], stats.hourly[-3]
    assert (current.completed, current.failed, current.dead_lettered) == (1, 1, 0)
    assert (earlier.completed, earlier.failed, earlier.dead_lettered) == (1, 2, 1)
    assert sum(b.completed for b in stats.hourly) == 2
    assert len(stats.daily) == 7
    assert stats.daily[-1].start == hour.replace(hour=0)
    assert sum(b.completed for b in stats.daily) == 3  # the 30-day-old one is outside
    assert sum(b.failed for b in stats.daily) == 3


@pytest.mark.django_db
@pytest.mark.parametrize("time_zone", ["UTC", "Asia/Kolkata"])
def test_the_series_count_and_times_are_utc_with_use_tz_false(settings: Any,
                                                              time_zone: str) -> None:
    """With ``USE_TZ = False`` Django hands out naive datetimes (in ``TIME_ZONE``): the series
    were all zeros (the truncated hours came back naive and never matched the aware UTC
    buckets), and ``to_dict`` read naive times in the server's zone. The buckets are UTC hours
    and days whatever the settings (Asia/Kolkata, +05:30, has no whole-hour offset)."""
    settings.USE_TZ = False
    settings.TIME_ZONE = time_zone
    done = job("stats.mail")
    dead = job("stats.report")
    with connection.cursor() as cursor:
        cursor.execute("UPDATE persistent_jobs SET status = 'completed', "
                       "finished_at = now() - interval '1 minute' WHERE id = %s", [done.id])
        cursor.execute("UPDATE persistent_jobs SET status = 'dead_lettered', "
                       "finished_at = now() - interval '2 hours' WHERE id = %s", [dead.id])
        cursor.execute("SELECT date_trunc('hour', (now() - interval '1 minute') AT TIME ZONE "
                       "'UTC'), date_trunc('hour', (now() - interval '2 hours') AT TIME ZONE "
                       "'UTC'), now() AT TIME ZONE 'UTC'")
        done_hour, dead_hour, utc_now = (v.replace(tzinfo=UTC) for v in cursor.fetchone())
    stats = dashboard_stats()
    assert stats.status_counts["completed"] == 1
    by_hour = {b.start: b for b in stats.hourly}
    assert by_hour[done_hour].completed == 1
    assert by_hour[dead_hour].dead_lettered == 1
    assert sum(b.completed for b in stats.hourly) == 1
    assert sum(b.completed for b in stats.daily) == 1
    assert sum(b.dead_lettered for b in stats.daily) == 1
    assert all(b.start.tzinfo is not None and b.start.utcoffset() == timedelta(0)
               for b in [*stats.hourly, *stats.daily])
    data = stats.to_dict()
    served_now = datetime.fromisoformat(data["now"])
    assert served_now.utcoffset() == timedelta(0)
    assert abs(served_now - utc_now) < timedelta(seconds=30)


@pytest.mark.django_db
def test_failure_groups_in_the_window_with_first_last_seen_and_dead_letters() -> None:
    now = db_now()
    a = job("stats.mail", status="dead_lettered", last_error_code="SMTP_DOWN", finished_at=now)
    b = job("stats.mail", status="failed", last_error_code="SMTP_DOWN")
    c = job("stats.report", status="dead_lettered", last_error_code="NO_DATA", finished_at=now)
    attempt(a, 1, "failed", "SMTP_DOWN", now - timedelta(hours=3))
    attempt(a, 2, "dead_lettered", "SMTP_DOWN", now - timedelta(minutes=2), "last words")
    attempt(b, 1, "failed", "SMTP_DOWN", now - timedelta(hours=1))
    attempt(b, 1, "failed", "SMTP_DOWN", now - timedelta(days=3))  # outside 24 h
    attempt(c, 1, "dead_lettered", "NO_DATA", now - timedelta(minutes=1))
    attempt(c, 1, "completed", "", now)  # not a failure

    groups = dashboard_stats(now=now).failure_groups
    assert [(g.job_type, g.error_code, g.attempts, g.jobs) for g in groups] == [
        ("stats.mail", "SMTP_DOWN", 3, 2), ("stats.report", "NO_DATA", 1, 1)]
    smtp = groups[0]
    assert smtp.first_seen == now - timedelta(hours=3)
    assert smtp.last_seen == now - timedelta(minutes=2)
    assert smtp.last_message == "last words"
    assert (smtp.dead_letters, groups[1].dead_letters) == (1, 1)
    last_hour = dashboard_stats(now=now, window=timedelta(hours=1, minutes=30)).failure_groups
    assert [(g.error_code, g.attempts) for g in last_hour] == [("SMTP_DOWN", 2), ("NO_DATA", 1)]
    week = dashboard_stats(now=now, window=timedelta(days=7)).failure_groups
    assert week[0].attempts == 4


@pytest.mark.django_db
def test_stuck_jobs_of_the_four_kinds_and_runner_states() -> None:
    now = db_now()
    runner("live-1", timedelta(seconds=0), now, queues=["mail"])
    # The test settings beat every 0.5 s and call a runner dead after 3 s.
    runner("late-1", timedelta(seconds=2.5), now, queues=["mail"])
    runner("dead-1", timedelta(minutes=5), now)
    hung = job("stats.mail", status="running", locked_by="live-1",
               locked_at=now - timedelta(seconds=400), timeout_seconds=300)
    orphan = job("stats.mail", status="running", locked_by="dead-1",
                 locked_at=now - timedelta(seconds=10), timeout_seconds=300)
    ghost = job("stats.mail", status="running", locked_by="reaped-1",
                locked_at=now - timedelta(seconds=10), timeout_seconds=300)
    waiting = job("stats.mail", next_run_at=now - timedelta(minutes=10))
    unserved = job("stats.report", next_run_at=now - timedelta(seconds=5))
    job("stats.mail", next_run_at=now - timedelta(seconds=5))  # due, served, not long: fine
    job("stats.mail", status="running", locked_by="live-1", locked_at=now,
        timeout_seconds=300)  # healthy

    stats = dashboard_stats(now=now)
    kinds = {s.id: s.kinds for s in stats.stuck}
    assert kinds == {
        str(hung.id): ["past_timeout"],
        str(orphan.id): ["stale_runner"],
        str(ghost.id): ["stale_runner"],
        str(waiting.id): ["unclaimed"],
        str(unserved.id): ["unserved_queue"],
    }
    # "late" still serves, so only the dead runner's and the ghost's jobs are stranded.
    assert stats.stuck_counts == {"past_timeout": 1, "stale_runner": 2, "unclaimed": 1,
                                  "unserved_queue": 1, "unhandled_type": 0}
    runners = {r.id: r for r in stats.runners}
    assert {k: (r.state, r.stale, r.jobs_held) for k, r in runners.items()} == {
        "live-1": ("live", False, 2), "late-1": ("late", True, 0),
        "dead-1": ("dead", True, 1), "reaped-1": ("gone", True, 1),
    }
    assert runners["live-1"].queues == ["mail"] and runners["dead-1"].queues is None
    assert runners["dead-1"].heartbeat_age == timedelta(minutes=5)
    assert (runners["live-1"].version, runners["live-1"].concurrency) == ("1.2", 4)
    # A late runner still serves its queues (it may only be slow); a dead one does not.
    JobRunnerRecord.objects.filter(id="late-1").update(queues=["mail", "reports"])
    assert str(unserved.id) not in {s.id for s in dashboard_stats(now=now).stuck}


@pytest.mark.django_db
def test_past_timeout_counts_from_the_attempts_start_not_the_claim() -> None:
    """With ``PREFETCH`` a runner claims jobs that wait in it for a free worker: the timeout
    starts when a worker starts one (the attempt's ``started_at``), so neither the wait of a
    job that started late nor a job still waiting counts as running past its timeout."""
    from django.db import connection

    from tests.core_support import claim_as

    now = db_now()
    runner("live-1", timedelta(seconds=0), now, queues=["mail"])
    runner("dead-1", timedelta(minutes=5), now, queues=["mail"])
    claimed: dict[str, Any] = {}
    with connection.cursor() as cursor:
        for name, holder, direct in [("waiting", "live-1", 0), ("started_late", "live-1", 1),
                                     ("hung", "live-1", 1), ("waiting_dead", "dead-1", 0)]:
            enqueued = job("stats.mail")
            [claimed[name]] = claim_as(cursor, holder, 1, ("mail",), direct=direct)
            assert claimed[name].id == enqueued.id and claimed[name].waiting == (direct == 0)
    long_ago = now - timedelta(seconds=400)
    PersistentJob.objects.filter(pk__in=[c.id for c in claimed.values()]).update(
        locked_at=long_ago, timeout_seconds=300)
    JobAttempt.objects.filter(id=claimed["started_late"].token).update(
        started_at=now - timedelta(seconds=10))
    JobAttempt.objects.filter(id=claimed["hung"].token).update(
        started_at=now - timedelta(seconds=350))

    stats = dashboard_stats(now=now)
    by_id = {s.id: s for s in stats.stuck}
    assert {k: s.kinds for k, s in by_id.items()} == {
        str(claimed["hung"].id): ["past_timeout"],
        str(claimed["waiting_dead"].id): ["stale_runner"],
    }
    assert stats.stuck_counts["past_timeout"] == 1
    assert by_id[str(claimed["hung"].id)].detail == "running 5m, timeout 5m"
    held = by_id[str(claimed["waiting_dead"].id)]
    assert held.detail == ("runner dead-1 last beat 5m ago; claimed, not started (it waited "
                           "for a free worker)")
    assert held.since == long_ago  # still when it was claimed


@pytest.mark.django_db
def test_a_due_job_no_live_runner_serving_its_queue_handles_is_stuck_at_once() -> None:
    """Runners claim only the types they have handlers for (rolling deploys): a due job whose
    type no live runner serving its queue lists will wait until one starts, so the console
    names it at once rather than after ``unclaimed_after``. Queue and type must meet in one
    runner: a runner that serves the queue without the handler does not count."""
    now = db_now()
    runner("mail-only", timedelta(seconds=0), now, queues=["mail"], job_types=["stats.mail"])
    runner("reports", timedelta(seconds=0), now, job_types=["stats.report"])  # every queue
    runner("dead-all", timedelta(minutes=5), now, job_types=["stats.mail", "stats.new"])
    due_soon = now - timedelta(seconds=1)
    handled = job("stats.mail", next_run_at=due_soon)  # mail-only
    report_on_mail = job("stats.report", queue="mail", next_run_at=due_soon)  # "reports"
    mail_on_reports = job("stats.mail", queue="reports", next_run_at=due_soon)
    # A type only a newer release has a handler for (enqueued there).
    newer = job("stats.mail", next_run_at=due_soon)
    later = job("stats.mail", next_run_at=now + timedelta(hours=1))
    failed = job("stats.mail", status="failed", next_run_at=due_soon)
    running = job("stats.mail", status="running", locked_by="mail-only", locked_at=now,
                  timeout_seconds=300)
    PersistentJob.objects.filter(pk__in=[newer.pk, later.pk, failed.pk, running.pk]).update(
        job_type="stats.new")

    stats = dashboard_stats(now=now)
    by_id = {s.id: s for s in stats.stuck}
    assert {k: s.kinds for k, s in by_id.items()} == {
        str(mail_on_reports.id): ["unhandled_type"],
        str(newer.id): ["unhandled_type"],
        str(failed.id): ["unhandled_type"],  # a retry that is due waits the same way
    }
    assert stats.stuck_counts["unhandled_type"] == 3
    assert by_id[str(newer.id)].detail == (
        "no live runner serving queue 'mail' has a handler for 'stats.new'")
    assert {str(handled.id), str(report_on_mail.id), str(later.id),
            str(running.id)}.isdisjoint(by_id)
    runners = {r.id: r for r in stats.runners}
    assert runners["mail-only"].job_types == ["stats.mail"]
    assert json.loads(json.dumps(stats.to_dict()))["runners"][0]["job_types"] is not None

    # A live runner that does not list its types (a row from before runners listed them) may
    # handle any, on its own queues only: the job on "reports" is still unhandled.
    runner("old", timedelta(seconds=0), now, queues=["mail"])
    with_old = dashboard_stats(now=now)
    assert {s.id for s in with_old.stuck} == {str(mail_on_reports.id)}
    assert with_old.stuck_counts["unhandled_type"] == 1
    JobRunnerRecord.objects.filter(id="old").update(queues=None)  # every queue: nothing left
    assert dashboard_stats(now=now).stuck_counts["unhandled_type"] == 0
    JobRunnerRecord.objects.filter(id="old").delete()
    # Replicas listing the same queues and types are one clause; a late runner still counts.
    for n in range(3):
        runner(f"replica-{n}", timedelta(seconds=2.5), now, queues=["reports"],
               job_types=["stats.mail"])
    assert dashboard_stats(now=now).stuck_counts["unhandled_type"] == 2  # mail_on_reports ok
    JobRunnerRecord.objects.filter(id__startswith="replica-").delete()
    # With no live runner at all, "unserved_queue" says it; "unhandled_type" does not repeat it.
    JobRunnerRecord.objects.filter(id__in=["mail-only", "reports"]).delete()
    nobody = dashboard_stats(now=now)
    assert nobody.stuck_counts["unhandled_type"] == 0
    assert nobody.stuck_counts["unserved_queue"] == 5


@pytest.mark.django_db
def test_the_stuck_total_counts_past_the_listed_ones() -> None:
    from django_persistent_jobs.stats import LIST_LIMIT

    now = db_now()
    old = now - timedelta(minutes=10)
    PersistentJob.objects.bulk_create([
        PersistentJob(job_type="stats.mail", queue="mail", payload={}, next_run_at=old)
        for _ in range(LIST_LIMIT + 25)])
    stats = dashboard_stats(now=now)
    assert len(stats.stuck) == LIST_LIMIT
    assert stats.total_stuck == stats.stuck_total == LIST_LIMIT + 25
    assert stats.to_dict()["stuck_total"] == LIST_LIMIT + 25


@pytest.mark.django_db
def test_the_active_job_aggregates_read_the_partial_indexes() -> None:
    """Waiting and running jobs are found through the partial indexes, not a scan of the
    history: checked on the plan PostgreSQL picks for the stats' filter."""
    from django.db import connection

    from django_persistent_jobs.stats import ACTIVE

    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        sql, params = PersistentJob.objects.filter(ACTIVE).values("id").query.sql_with_params()
        cursor.execute(f"EXPLAIN {sql}", params)
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "pj_claim_idx" in plan and "pj_locked_by_idx" in plan, plan


@pytest.mark.django_db
def test_to_dict_is_json_ready() -> None:
    now = db_now()
    dead = job("stats.mail", status="dead_lettered", last_error_code="X", finished_at=now,
               tenant="acme")
    attempt(dead, 1, "dead_lettered", "X", now)
    runner("live-1", timedelta(0), now)
    data = dashboard_stats(now=now).to_dict()
    text = json.dumps(data)
    assert data["status_counts"]["dead_lettered"] == 1
    assert data["failure_groups"][0]["error_code"] == "X"
    assert data["failure_groups"][0]["first_seen"] == now.astimezone(UTC).isoformat()
    assert data["window"] == 86400.0
    assert data["runners"][0]["heartbeat_age"] == 0.0
    assert len(data["hourly"]) == 24 and "acme" in text
