"""Recurring schedules against real PostgreSQL: the runtime API, code sync, firing policies
(one run per tick, coalescing, dedup with a slow run, failures, vanished handlers) and the admin.

Due-ness always comes from the database clock: tests move ``next_run_at`` with SQL relative to
``now()`` instead of waiting for wall-clock time to pass.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, timedelta
from itertools import pairwise
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from django.db import IntegrityError, connection, connections, transaction
from django.db.models import F
from django.db.models.functions import Now
from django.test import Client
from django.urls import reverse

from django_persistent_jobs import (
    Runner,
    ScheduleError,
    ScheduleNotFoundError,
    add_schedule,
    enqueuing,
    job_handler,
    pause_schedule,
    remove_schedule,
    resume_schedule,
    run_schedule_now,
    update_schedule,
)
from django_persistent_jobs.handlers import registry
from django_persistent_jobs.models import (
    InactiveReason,
    JobAttempt,
    JobSchedule,
    JobStatus,
    PersistentJob,
    ScheduleSource,
    TickResult,
)
from django_persistent_jobs.runner.scheduler import fire_due
from django_persistent_jobs.schedules.definition import db_now
from django_persistent_jobs.schedules.firing import insert_run, sync_code_schedules
from tests.core_support import lose_prepared_inserts, pj_settings, wait_for

pytestmark = pytest.mark.django_db(transaction=True)

FAST = {"SCHEDULER_INTERVAL": 0.1, "POLL_INTERVAL": 0.1}


@pytest.fixture
def fast_scheduler(settings: Any) -> None:
    settings.PERSISTENT_JOBS = {**settings.PERSISTENT_JOBS, **FAST}


def runs(name: str) -> Any:
    return PersistentJob.objects.filter(schedule__name=name).order_by("created_at", "id")


def make_due(name: str, ago: timedelta = timedelta(0)) -> None:
    """Make the schedule's current tick due by the database clock."""
    JobSchedule.objects.filter(name=name).update(next_run_at=Now() - ago)


def seconds_past_next_run(name: str) -> float:
    with connection.cursor() as cursor:
        cursor.execute("SELECT EXTRACT(EPOCH FROM now() - next_run_at) FROM "
                       "persistent_jobs_schedules WHERE name = %s", [name])
        return float(cursor.fetchone()[0])


# ----------------------------------------------------------------------------- runtime API
def test_add_schedule_validates_and_stores() -> None:
    schedule = add_schedule("nightly", "test.recurring.work", cron="0 2 * * *",
                            timezone="Europe/Berlin", payload={"note": "n"}, priority=5)
    assert schedule.source == ScheduleSource.DATABASE and schedule.active and not schedule.paused
    assert schedule.payload == {"note": "n"} and schedule.priority == 5
    local = schedule.next_run_at.astimezone(ZoneInfo("Europe/Berlin"))
    assert (local.hour, local.minute) == (2, 0)
    assert schedule.next_run_at > db_now()

    default_zone = add_schedule("every-30s", "test.recurring.work", interval=timedelta(seconds=30))
    assert default_zone.timezone == "UTC"  # settings.TIME_ZONE
    assert default_zone.interval_seconds == 30
    assert timedelta(seconds=29) < default_zone.next_run_at - db_now() <= timedelta(seconds=30)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"cron": "0 2 * *"}, "has 4 fields"),
    ({"cron": "0 99 * * *"}, "not a valid cron"),
    ({"cron": "0 2 * * *", "interval": 60}, "not both"),
    ({}, "cron expression or an interval"),
    ({"interval": -5}, "positive"),
    ({"interval": timedelta(0)}, "positive"),
    ({"cron": "0 2 * * *", "timezone": "Europe/Atlantis"}, "unknown time zone"),
    ({"cron": "0 2 * * *", "timezone": "localtime"}, "this host's own zone"),
    ({"cron": "0 2 * * *", "payload": {"when": object()}}, "payload"),
    ({"cron": "0 2 * * *", "priority": 10**6}, "priority"),
])
def test_add_schedule_refuses_bad_definitions(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        add_schedule("bad", "test.recurring.work", **kwargs)
    assert not JobSchedule.objects.exists()


def test_add_schedule_refuses_unknown_job_type_and_duplicate_names() -> None:
    with pytest.raises(ScheduleError, match="No handler is registered for job type 'nope'"):
        add_schedule("x", "nope", interval=60)
    add_schedule("x", "test.recurring.work", interval=60)
    with pytest.raises(ScheduleError, match="already exists"):
        add_schedule("x", "test.recurring.tick", interval=60)


def test_add_schedule_joins_the_callers_transaction() -> None:
    with pytest.raises(RuntimeError), transaction.atomic():
        add_schedule("rolled-back", "test.recurring.work", interval=60)
        raise RuntimeError
    assert not JobSchedule.objects.exists()


def test_update_switches_timing_and_recomputes_next_run() -> None:
    add_schedule("s", "test.recurring.work", interval=3600)
    updated = update_schedule("s", cron="* * * * *", payload={"note": "v2"})
    assert updated.cron == "* * * * *" and updated.interval_seconds is None
    assert updated.payload == {"note": "v2"}
    assert timedelta(0) < updated.next_run_at - db_now() <= timedelta(minutes=1)
    back = update_schedule("s", interval=timedelta(hours=2))
    assert back.cron is None and back.interval_seconds == 7200
    with pytest.raises(ScheduleError, match="not a valid cron"):
        update_schedule("s", cron="nope nope nope nope nope")
    with pytest.raises(ScheduleError, match="unknown fields"):
        update_schedule("s", colour="red")
    with pytest.raises(ScheduleNotFoundError):
        update_schedule("missing", interval=5)


def test_pause_resume_skips_ticks_missed_while_paused() -> None:
    add_schedule("p", "test.recurring.tick", cron="* * * * *")
    pause_schedule("p")
    make_due("p", ago=timedelta(minutes=5))
    assert fire_due().enqueued == 0  # paused: nothing fires
    resumed = resume_schedule("p")
    assert not resumed.paused and resumed.next_run_at > db_now()
    assert fire_due().enqueued == 0 and not runs("p").exists()


def test_resuming_a_schedule_that_is_not_paused_keeps_its_due_tick() -> None:
    add_schedule("due", "test.recurring.tick", cron="0 * * * *")
    make_due("due", ago=timedelta(minutes=10))  # no runner was up: it waits to coalesce
    before = JobSchedule.objects.get(name="due").next_run_at
    assert resume_schedule("due").next_run_at == before
    assert fire_due().enqueued == 1


def test_a_burst_fires_every_due_schedule_not_one_batch() -> None:
    from django_persistent_jobs.runner.lifecycle import Lifecycle
    from django_persistent_jobs.runner.scheduler import BATCH, scheduler_loop

    for i in range(BATCH + 10):
        # Yearly: each schedule's next tick is far off once fired (an every-minute one could
        # come due again mid-test when the run crosses a minute boundary, and fire twice).
        add_schedule(f"b{i}", "test.recurring.tick", cron="0 0 1 1 *")
    JobSchedule.objects.filter(name__startswith="b").update(next_run_at=Now())
    scheduler_loop(connection.alias, "burst-runner", 1.0, Lifecycle(), burst=True)
    assert PersistentJob.objects.filter(schedule__name__startswith="b").count() == BATCH + 10


def test_changing_only_the_zone_of_an_interval_schedule_keeps_its_grid() -> None:
    add_schedule("iv", "test.recurring.tick", interval=timedelta(days=1))
    before = JobSchedule.objects.get(name="iv").next_run_at
    updated = update_schedule("iv", timezone="Europe/Berlin")
    assert (updated.timezone, updated.next_run_at) == ("Europe/Berlin", before)
    # A cron schedule's zone does move its ticks.
    add_schedule("cr", "test.recurring.tick", cron="0 3 * * *", timezone="UTC")
    cron_before = JobSchedule.objects.get(name="cr").next_run_at
    assert update_schedule("cr", timezone="Asia/Tokyo").next_run_at != cron_before


def test_a_schedule_added_late_in_a_long_transaction_starts_from_the_clock() -> None:
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SELECT pg_sleep(1.5)")
        add_schedule("late", "test.recurring.tick", interval=1)
    first = JobSchedule.objects.get(name="late").next_run_at
    assert first > db_now(), "the first tick was already past when the schedule committed"


def test_remove_schedule_keeps_history() -> None:
    add_schedule("r", "test.recurring.tick", interval=60)
    job = run_schedule_now("r")
    remove_schedule("r")
    assert not JobSchedule.objects.filter(name="r").exists()
    assert PersistentJob.objects.get(pk=job.pk).schedule["name"] == "r"
    with pytest.raises(ScheduleNotFoundError):
        remove_schedule("r")


def test_run_now_enqueues_a_manual_run_and_respects_skip_dedup() -> None:
    add_schedule("now", "test.recurring.work", cron="0 2 * * *")
    before = JobSchedule.objects.get(name="now").next_run_at
    job = run_schedule_now("now")
    assert job.schedule["trigger"] == "manual" and job.schedule["tick"] is None
    assert job.dedup_key == "now" and job.status == JobStatus.PENDING
    again = run_schedule_now("now")  # the first run is still pending: Skip returns it
    assert again.pk == job.pk
    schedule = JobSchedule.objects.get(name="now")
    assert schedule.last_result == TickResult.SKIPPED and schedule.last_job_id == job.pk
    assert schedule.next_run_at == before


def test_a_run_whose_prepared_insert_was_lost_is_inserted_as_text() -> None:
    """With ``PREPARED_STATEMENTS``, a run's insert that meets a pooler's lost statement aborts
    only its savepoint: the run is inserted again, as text, in the same call."""
    add_schedule("lost", "test.recurring.work", cron="0 2 * * *")
    try:
        with pj_settings(PREPARED_STATEMENTS=True):
            first = run_schedule_now("lost")  # its insert is prepared on this connection
            PersistentJob.objects.filter(pk=first.pk).update(
                status=JobStatus.COMPLETED, finished_at=Now())  # so the next run inserts
            lose_prepared_inserts()
            second = run_schedule_now("lost")
        assert second.pk != first.pk
        assert PersistentJob.objects.get(pk=second.pk).schedule["name"] == "lost"
        assert enqueuing._UNPREPARED  # the loss was met, and the run inserted anyway
        assert JobSchedule.objects.get(name="lost").last_job_id == second.pk
    finally:
        enqueuing._UNPREPARED.clear()


# ----------------------------------------------------------------------------- firing
def test_one_run_per_tick_is_enforced_by_the_database() -> None:
    add_schedule("once", "test.recurring.tick", interval=60)
    make_due("once")
    schedule = JobSchedule.objects.get(name="once")
    with transaction.atomic():
        first, result, _ = insert_run(schedule, tick=schedule.next_run_at, coalesced=0,
                                      fired_by="a")
        assert result == TickResult.ENQUEUED and first is not None
        # a second insert for the same tick (say, a runner that computed it from stale data)
        second, result, error = insert_run(schedule, tick=schedule.next_run_at, coalesced=0,
                                           fired_by="b")
        assert second is None and result == TickResult.SKIPPED and "already has a run" in error
    assert runs("once").count() == 1
    # and not only through our code path: the unique index refuses it outright
    with pytest.raises(IntegrityError), connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO persistent_jobs (id, job_type, payload, max_retries, schedule) "
            "SELECT gen_random_uuid(), job_type, payload, 0, schedule FROM persistent_jobs "
            "WHERE id = %s", [first.pk])


def test_firing_advances_and_a_second_pass_finds_nothing_due() -> None:
    add_schedule("adv", "test.recurring.tick", interval=60)
    make_due("adv")
    tick = JobSchedule.objects.get(name="adv").next_run_at
    assert fire_due(runner_id="r1").enqueued == 1
    assert fire_due(runner_id="r2").enqueued == 0
    (run,) = runs("adv")
    assert run.schedule["tick"] == tick.astimezone(UTC).isoformat(timespec="microseconds")
    assert run.schedule["fired_by"] == "r1" and run.schedule["interval_seconds"] == 60
    schedule = JobSchedule.objects.get(name="adv")
    assert schedule.next_run_at == tick + timedelta(seconds=60)
    assert schedule.last_job_id == run.pk and schedule.last_result == TickResult.ENQUEUED


def test_missed_cron_ticks_coalesce_into_one_run() -> None:
    add_schedule("minutely", "test.recurring.tick", cron="* * * * *")
    # The runners were down for ten minutes: ticks at -10 .. 0 minutes were all missed.
    with connection.cursor() as cursor:
        cursor.execute("UPDATE persistent_jobs_schedules SET next_run_at = "
                       "date_trunc('minute', now()) - interval '10 minutes' WHERE name = %s",
                       ["minutely"])
        cursor.execute("SELECT date_trunc('minute', now())")
        this_minute = cursor.fetchone()[0]
    report = fire_due()
    assert report.enqueued == 1 and fire_due().enqueued == 0
    (run,) = runs("minutely")
    assert run.schedule["coalesced_ticks"] == 10
    assert JobSchedule.objects.get(name="minutely").next_run_at == this_minute + timedelta(
        minutes=1)


def test_downtime_coalesces_for_a_starting_runner(start_runner: Callable[..., Runner],
                                                  fast_scheduler: None) -> None:
    add_schedule("grid", "test.recurring.tick", interval=60)
    schedule = JobSchedule.objects.get(name="grid")
    anchor = schedule.next_run_at - timedelta(seconds=390)  # now - 5.5 intervals
    JobSchedule.objects.filter(name="grid").update(next_run_at=anchor)
    start_runner()
    wait_for(lambda: runs("grid").filter(status=JobStatus.COMPLETED).exists(), 10,
             message="the coalesced run")
    schedule.refresh_from_db()
    assert runs("grid").count() == 1
    assert runs("grid").get().schedule["coalesced_ticks"] == 5
    assert schedule.next_run_at == anchor + timedelta(seconds=360)  # still on the 60 s grid


def test_skip_dedup_defers_ticks_while_a_slow_run_is_active(
    start_runner: Callable[..., Runner], fast_scheduler: None,
) -> None:
    """Default Skip: ticks that find the previous run pending or running insert nothing (the
    schedule still advances and says "skipped"); the next tick after it ends inserts again."""
    add_schedule("slow", "test.recurring.work", interval=0.5, payload={"sleep": 2})
    make_due("slow")
    start_runner(concurrency=4)
    first = wait_for(lambda: runs("slow").filter(status=JobStatus.RUNNING).first(), 10,
                     message="the first run to start")
    wait_for(lambda: JobSchedule.objects.filter(
        name="slow", last_result=TickResult.SKIPPED, last_job_id=first.pk).exists(), 10,
        message="a tick skipped because of the running run")
    assert runs("slow").count() == 1
    wait_for(lambda: runs("slow").count() >= 2, 10, message="a run after the slow one ended")
    pause_schedule("slow")
    wait_for(lambda: not runs("slow").exclude(status__in=JobStatus.terminal()).exists(), 15,
             message="runs to finish")
    attempts = list(JobAttempt.objects.filter(job__schedule__name="slow").order_by("started_at"))
    assert all(a.outcome == "completed" for a in attempts)
    for earlier, later in pairwise(attempts):
        assert earlier.finished_at <= later.started_at, "two runs overlapped"


def test_replace_dedup_never_interrupts_the_running_run(
    start_runner: Callable[..., Runner], fast_scheduler: None,
) -> None:
    """Replace: a tick cancels the waiting run it supersedes, never the running one; the newest
    waiting run starts only after the running one ends."""
    add_schedule("rep", "test.recurring.replace", interval=0.4, payload={"sleep": 1.6})
    make_due("rep")
    start_runner(concurrency=4)
    first = wait_for(lambda: runs("rep").filter(status=JobStatus.RUNNING).first(), 10,
                     message="the first run to start")
    wait_for(lambda: runs("rep").filter(last_error_code="REPLACED").exists(), 10,
             message="a waiting run replaced by a newer tick")
    wait_for(lambda: PersistentJob.objects.get(pk=first.pk).status == JobStatus.COMPLETED, 10,
             message="the first run to complete")
    wait_for(lambda: runs("rep").filter(status=JobStatus.COMPLETED).count() >= 2, 10,
             message="a later run to complete")
    pause_schedule("rep")
    wait_for(lambda: not runs("rep").exclude(status__in=JobStatus.terminal()).exists(), 15,
             message="runs to finish")
    assert PersistentJob.objects.get(pk=first.pk).attempts == 1
    attempts = list(JobAttempt.objects.filter(job__schedule__name="rep").order_by("started_at"))
    assert all(a.outcome == "completed" for a in attempts)
    for earlier, later in pairwise(attempts):
        assert earlier.finished_at <= later.started_at, "two runs overlapped"
    cancelled = runs("rep").filter(status=JobStatus.CANCELLED)
    assert cancelled.exists() and not JobAttempt.objects.filter(job__in=cancelled).exists()


def test_failed_and_dead_lettered_runs_do_not_stop_the_schedule(
    start_runner: Callable[..., Runner], fast_scheduler: None,
) -> None:
    add_schedule("doomed", "test.recurring.work", interval=0.3, payload={"permanent": True})
    make_due("doomed")
    start_runner()
    wait_for(lambda: runs("doomed").filter(status=JobStatus.DEAD_LETTERED).count() >= 3, 15,
             message="three dead-lettered runs")
    schedule = JobSchedule.objects.get(name="doomed")
    assert schedule.active and not schedule.paused


def test_runtime_add_pause_resume_remove_with_a_live_runner(
    start_runner: Callable[..., Runner], fast_scheduler: None,
) -> None:
    start_runner()
    add_schedule("live", "test.recurring.tick", interval=0.3)
    wait_for(lambda: runs("live").count() >= 2, 10, message="runs of a schedule added at runtime")
    pause_schedule("live")
    paused_at = runs("live").count()
    # Wait (on the database clock) until two ticks would have been due; nothing may fire.
    wait_for(lambda: seconds_past_next_run("live") > 0.7, 10, message="ticks to pass")
    assert runs("live").count() == paused_at
    resume_schedule("live")
    wait_for(lambda: runs("live").count() >= paused_at + 2, 10, message="runs after resume")
    remove_schedule("live")
    removed_at = runs("live").count()
    deadline = db_now() + timedelta(seconds=0.8)
    wait_for(lambda: db_now() > deadline, 5, message="time to pass")
    assert runs("live").count() == removed_at
    wait_for(lambda: not runs("live").exclude(status__in=JobStatus.terminal()).exists(), 10,
             message="runs to finish")


def test_an_error_in_one_schedule_does_not_stop_the_others(caplog: Any) -> None:
    add_schedule("fine", "test.recurring.tick", interval=60)
    add_schedule("broken", "test.recurring.tick", interval=60)
    # a zone this host cannot load (written behind the API's back, as a stale row might be)
    JobSchedule.objects.filter(name="broken").update(cron="0 2 * * *", interval_seconds=None,
                                                     timezone="Mars/Olympus")
    make_due("fine")
    make_due("broken")
    with caplog.at_level(logging.ERROR, logger="django_persistent_jobs.scheduler"):
        report = fire_due()
    assert report.enqueued == 1 and report.errors == 1
    broken = JobSchedule.objects.get(name="broken")
    assert not broken.active and broken.inactive_reason == InactiveReason.INVALID
    assert "Mars/Olympus" in broken.last_error
    assert fire_due().errors == 0  # deactivated: not retried every tick


# ----------------------------------------------------------------------------- code sync
def test_code_declared_schedule_syncs_fires_and_deactivates_when_its_handler_vanishes(
    start_runner: Callable[..., Runner], fast_scheduler: None, caplog: Any,
) -> None:
    with registry.isolated():
        @job_handler("test.recurring.declared", interval=timedelta(seconds=0.3), dedup="enqueue",
                     payload={"from": "code"})
        def declared(payload: Any) -> None: ...

        runner = start_runner()
        wait_for(lambda: runs("test.recurring.declared").count() >= 2, 10,
                 message="runs of a code-declared schedule")
        schedule = JobSchedule.objects.get(name="test.recurring.declared")
        assert schedule.source == ScheduleSource.CODE and schedule.job_type == schedule.name
        assert runs("test.recurring.declared").first().payload == {"from": "code"}
        with pytest.raises(ScheduleError, match="declared in code"):
            update_schedule("test.recurring.declared", interval=5)
        with pytest.raises(ScheduleError, match="declared in code"):
            remove_schedule("test.recurring.declared")
        paused = pause_schedule("test.recurring.declared")  # operators may pause it
        assert paused.paused
        resume_schedule("test.recurring.declared")
        runner.stop(timeout=10)
        # a restart with the same declaration keeps next_run_at (a deploy neither skips nor
        # repeats a run)
        before = JobSchedule.objects.get(name="test.recurring.declared").next_run_at
        assert sync_code_schedules().updated == []
        assert JobSchedule.objects.get(name="test.recurring.declared").next_run_at == before
    # The handler is gone from the code (the isolated registry dropped it).
    with caplog.at_level(logging.WARNING, logger="django_persistent_jobs.scheduler"):
        report = sync_code_schedules()
    assert report.deactivated == ["test.recurring.declared"]
    schedule = JobSchedule.objects.get(name="test.recurring.declared")
    assert not schedule.active and schedule.inactive_reason == InactiveReason.HANDLER_MISSING
    assert "deactivated" in caplog.text
    make_due("test.recurring.declared")
    count = runs("test.recurring.declared").count()
    assert fire_due().enqueued == 0 and runs("test.recurring.declared").count() == count


def test_sync_changes_deactivates_and_reactivates(caplog: Any) -> None:
    with registry.isolated():
        @job_handler("test.recurring.changing", cron="0 3 * * *", timezone="Europe/Berlin")
        def changing(payload: Any) -> None: ...

        assert sync_code_schedules().created == ["test.recurring.changing"]
    with registry.isolated():
        @job_handler("test.recurring.changing", cron="0 4 * * *", timezone="Europe/Berlin")
        def changing_v2(payload: Any) -> None: ...

        assert sync_code_schedules().updated == ["test.recurring.changing"]
        schedule = JobSchedule.objects.get(name="test.recurring.changing")
        assert schedule.cron == "0 4 * * *"
        local = schedule.next_run_at.astimezone(ZoneInfo("Europe/Berlin"))
        assert local.hour == 4
    with registry.isolated():
        @job_handler("test.recurring.changing")  # still handled, no longer scheduled
        def unscheduled(payload: Any) -> None: ...

        assert sync_code_schedules().deactivated == ["test.recurring.changing"]
        assert JobSchedule.objects.get(name="test.recurring.changing").inactive_reason == (
            InactiveReason.REMOVED_FROM_CODE)
        # A runtime schedule for a type nobody handles is deactivated too, with a warning...
        JobSchedule.objects.create(name="orphan", job_type="test.recurring.gone",
                                   interval_seconds=60, timezone="UTC", next_run_at=Now())
        with caplog.at_level(logging.WARNING, logger="django_persistent_jobs.scheduler"):
            assert sync_code_schedules().deactivated == ["orphan"]
        assert "orphan deactivated" in caplog.text

        # ...and comes back by itself once a runner with the handler starts.
        @job_handler("test.recurring.gone")
        def back(payload: Any) -> None: ...

        assert sync_code_schedules().reactivated == ["orphan"]
        orphan = JobSchedule.objects.get(name="orphan")
        assert orphan.active and orphan.next_run_at > db_now()


def test_a_schedule_this_host_cannot_compute_is_switched_off_at_sync_not_the_runner() -> None:
    """A runtime schedule switched off for a missing handler comes back when a runner with
    the handler syncs; if its zone is one this host's tzdata lacks (written from a host with
    newer tzdata), or names a directory, the sync switches it off as invalid and goes on
    with the other schedules, instead of raising out of the scheduler loop (which stopped
    the runner on every start)."""
    with registry.isolated():
        for name, zone in (("stale-zone", "Mars/Olympus"), ("zone-dir", "America")):
            JobSchedule.objects.create(
                name=name, job_type="test.recurring.back_again", cron="0 2 * * *",
                timezone=zone, next_run_at=Now(), active=False,
                inactive_reason=InactiveReason.HANDLER_MISSING)
        JobSchedule.objects.create(
            name="fine", job_type="test.recurring.back_again", interval_seconds=60,
            timezone="UTC", next_run_at=Now(), active=False,
            inactive_reason=InactiveReason.HANDLER_MISSING)

        @job_handler("test.recurring.back_again")
        def back_again(payload: Any) -> None: ...

        assert sync_code_schedules().reactivated == ["fine"]
    for name, zone in (("stale-zone", "Mars/Olympus"), ("zone-dir", "America")):
        broken = JobSchedule.objects.get(name=name)
        assert not broken.active and broken.inactive_reason == InactiveReason.INVALID
        assert zone in broken.last_error


def test_runtime_schedule_with_a_code_name_wins_and_is_reported(caplog: Any) -> None:
    add_schedule("test.recurring.clash", "test.recurring.work", interval=60)
    with registry.isolated():
        @job_handler("test.recurring.clash", interval=timedelta(seconds=5))
        def clash(payload: Any) -> None: ...

        with caplog.at_level(logging.WARNING, logger="django_persistent_jobs.scheduler"):
            assert sync_code_schedules().conflicts == ["test.recurring.clash"]
    assert JobSchedule.objects.get(name="test.recurring.clash").interval_seconds == 60


# ----------------------------------------------------------------------------- admin
@pytest.fixture
def admin_client_() -> Client:
    from django.contrib.auth.models import User

    client = Client()
    client.force_login(User.objects.create(username="admin", is_staff=True, is_superuser=True))
    return client


def test_admin_lists_and_steers_schedules(admin_client_: Client) -> None:
    add_schedule("berlin-nightly", "test.recurring.work", cron="30 2 * * *",
                 timezone="Europe/Berlin")
    add_schedule("ping", "test.recurring.tick", interval=30)
    job = run_schedule_now("ping")
    changelist = reverse("admin:django_persistent_jobs_jobschedule_changelist")
    page = admin_client_.get(changelist).content.decode()
    for text in ("berlin-nightly", "cron 30 2 * * *", "Europe/Berlin", "every 30s",
                 "CET" if "CET" in page else "CEST", "run", "pending"):
        assert text in page

    ids = list(JobSchedule.objects.values_list("pk", flat=True))
    admin_client_.post(changelist, {"action": "pause", "_selected_action": ids})
    assert set(JobSchedule.objects.values_list("paused", flat=True)) == {True}
    admin_client_.post(changelist, {"action": "resume", "_selected_action": ids})
    assert set(JobSchedule.objects.values_list("paused", flat=True)) == {False}
    nightly = JobSchedule.objects.get(name="berlin-nightly")
    admin_client_.post(changelist, {"action": "run_now", "_selected_action": [nightly.pk]})
    assert runs("berlin-nightly").get().schedule["trigger"] == "manual"

    # the job's detail page links back to its schedule
    job_page = admin_client_.get(reverse("admin:django_persistent_jobs_persistentjob_change",
                                         args=[job.pk])).content.decode()
    ping = JobSchedule.objects.get(name="ping")
    assert reverse("admin:django_persistent_jobs_jobschedule_change", args=[ping.pk]) in job_page
    detail = admin_client_.get(reverse("admin:django_persistent_jobs_jobschedule_change",
                                       args=[ping.pk]))
    assert detail.status_code == 200 and "runs of ping" in detail.content.decode()


def test_admin_add_form_validates_through_the_services(admin_client_: Client) -> None:
    add_url = reverse("admin:django_persistent_jobs_jobschedule_add")
    form = {"name": "from-admin", "job_type": "test.recurring.tick", "cron": "*/5 * * * *",
            "interval_seconds": "", "timezone": "America/New_York", "payload": "{}",
            "queue": "", "priority": ""}
    bad = admin_client_.post(add_url, {**form, "interval_seconds": "60"})
    assert bad.status_code == 200 and "not both" in bad.content.decode()
    good = admin_client_.post(add_url, form)
    assert good.status_code == 302, good.content.decode()[:2000]
    schedule = JobSchedule.objects.get(name="from-admin")
    assert schedule.timezone == "America/New_York" and schedule.next_run_at is not None


def test_code_schedules_are_read_only_in_the_admin(admin_client_: Client) -> None:
    with registry.isolated():
        @job_handler("test.recurring.admin_code", cron="0 5 * * *")
        def admin_code(payload: Any) -> None: ...

        sync_code_schedules()
        schedule = JobSchedule.objects.get(name="test.recurring.admin_code")
        url = reverse("admin:django_persistent_jobs_jobschedule_change", args=[schedule.pk])
        page = admin_client_.get(url).content.decode()
        assert 'name="cron"' not in page and "Declared in code" in page
        delete = reverse("admin:django_persistent_jobs_jobschedule_delete", args=[schedule.pk])
        assert admin_client_.get(delete).status_code == 403


def test_last_outcome_survives_cleanup_of_the_run(admin_client_: Client) -> None:
    add_schedule("gc", "test.recurring.tick", interval=30)
    job = run_schedule_now("gc")
    PersistentJob.objects.filter(pk=job.pk).delete()
    page = admin_client_.get(reverse("admin:django_persistent_jobs_jobschedule_changelist"))
    assert "deleted by cleanup" in page.content.decode()
    assert JobSchedule.objects.filter(name="gc", last_job_id=F("last_job_id")).exists()


def test_a_due_schedule_held_by_another_session_is_not_polled_in_a_tight_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another session holds a due schedule's row (``update_schedule`` inside a caller's long
    transaction): the scheduler skips it (SKIP LOCKED) and looks again a little later, not
    every few milliseconds; once the row is free, the tick fires."""
    import threading

    from django_persistent_jobs.runner import scheduler
    from django_persistent_jobs.runner.lifecycle import Lifecycle
    from tests.core_support import raw_connection

    add_schedule("held", "test.recurring.tick", interval=60)
    make_due("held")
    passes: list[float] = []
    real_fire_due = scheduler.fire_due

    def counting(*args: Any, **kwargs: Any) -> Any:
        passes.append(0)
        return real_fire_due(*args, **kwargs)

    monkeypatch.setattr(scheduler, "fire_due", counting)
    lifecycle = Lifecycle()

    def run_loop() -> None:
        try:
            scheduler.scheduler_loop(connection.alias, "r-held", 5.0, lifecycle)
        finally:
            connections.close_all()  # this thread's own connection

    loop = threading.Thread(target=run_loop, daemon=True)
    with raw_connection(autocommit=False) as holder:
        holder.execute("SELECT 1 FROM persistent_jobs_schedules WHERE name = 'held' FOR UPDATE")
        loop.start()
        wait_for(lambda: len(passes) >= 2, 10, message="the scheduler to pass twice")
        before = len(passes)
        held_for = 1.0
        lifecycle.stopping.wait(held_for)  # (a bounded observation window, not a sync point)
        during = len(passes) - before
        assert runs("held").count() == 0
        holder.rollback()
    try:
        assert during <= held_for / scheduler.DUE_BUT_HELD_SLEEP + 3, during
        wait_for(lambda: runs("held").count() == 1, 10, message="the tick to fire once free")
    finally:
        lifecycle.stopping.set()
        loop.join(10)
