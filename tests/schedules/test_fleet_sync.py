"""Code schedules across a fleet of runners of two releases (a rolling deploy), against real
PostgreSQL.

A sync must not let a runner whose code lacks a schedule switch it off while another live
runner declares it (or, for a missing handler, can run its job type), and a rewrite by a runner
that started last is undone by the runners left once it stops. Each "runner" here is a real row
in the runners table (the same ``store.register_runner`` a runner uses) plus the sync its
scheduler runs with its own code (an isolated handler registry); the last test uses a real
runner thread for the periodic re-sync.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
from django.core import checks
from django.db import connection
from django.db.models.functions import Now

from django_persistent_jobs import (
    ConfigurationError,
    Runner,
    ScheduleError,
    add_schedule,
    job_handler,
    remove_schedule,
)
from django_persistent_jobs.handlers import registry
from django_persistent_jobs.models import InactiveReason, JobRunnerRecord, JobSchedule
from django_persistent_jobs.runner import store
from django_persistent_jobs.schedules.definition import db_now
from django_persistent_jobs.schedules.firing import SyncReport, sync_code_schedules
from tests.core_support import pj_settings, wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def register(runner_id: str, job_types: list[str] | None = None, *,
             scheduler: bool = True) -> None:
    """A live runner row, started now (later than every row registered before it). One with
    a scheduler lists the schedules it declares once it syncs (``sync_as``); one without
    (``--no-scheduler``) lists none."""
    with connection.cursor() as cursor:
        store.register_runner(cursor, runner_id, "test-host", os.getpid(), None, 1, "test",
                              job_types=job_types, schedules=[] if scheduler else None)


def stop(runner_id: str) -> None:
    with connection.cursor() as cursor:
        store.unregister_runner(cursor, runner_id)


@contextmanager
def code(*declarations: tuple[str, dict[str, Any]]) -> Iterator[None]:
    """Run the block with only these handlers registered (one release's code)."""
    with registry.isolated():
        for job_type, options in declarations:
            job_handler(job_type, **options)(lambda payload: None)
        yield


def sync_as(runner_id: str, *declarations: tuple[str, dict[str, Any]]) -> SyncReport:
    with code(*declarations):
        return sync_code_schedules(runner_id)


def row(name: str) -> JobSchedule:
    return JobSchedule.objects.get(name=name)


NEW = ("fleet.new", {"interval": timedelta(minutes=5)})
KEPT_V1 = ("fleet.kept", {"cron": "0 3 * * *", "timezone": "UTC"})
KEPT_V2 = ("fleet.kept", {"cron": "0 4 * * *", "timezone": "UTC"})
KEPT_UNSCHEDULED = ("fleet.kept", {})


def test_an_old_runner_starting_last_leaves_a_schedule_only_new_code_declares() -> None:
    register("new-1", ["fleet.new", "fleet.kept"])
    assert sorted(sync_as("new-1", NEW, KEPT_V2).created) == ["fleet.kept", "fleet.new"]
    # An old runner (no handler for fleet.new) restarts in the middle of the deploy.
    register("old-1", ["fleet.kept"])
    report = sync_as("old-1", KEPT_V1)
    assert report.deactivated == []
    assert row("fleet.new").active
    # Its declaration of fleet.kept is the newest live one, so it stands while it runs...
    assert report.updated == ["fleet.kept"] and row("fleet.kept").cron == "0 3 * * *"
    # ...and a sync by the new runner meanwhile leaves it (no flip-flop).
    assert sync_as("new-1", NEW, KEPT_V2).updated == []
    # Once the old runner stops, the new runner's next sync applies its own code again.
    stop("old-1")
    assert sync_as("new-1", NEW, KEPT_V2).updated == ["fleet.kept"]
    assert row("fleet.kept").cron == "0 4 * * *" and row("fleet.new").active


def test_a_schedule_removed_from_code_stays_while_a_live_runner_declares_it() -> None:
    register("old-1", ["fleet.kept"])
    assert sync_as("old-1", KEPT_V1).created == ["fleet.kept"]
    register("new-1", ["fleet.kept"])
    assert sync_as("new-1", KEPT_UNSCHEDULED).deactivated == []
    assert row("fleet.kept").active
    stop("old-1")
    assert sync_as("new-1", KEPT_UNSCHEDULED).deactivated == ["fleet.kept"]
    assert row("fleet.kept").inactive_reason == InactiveReason.REMOVED_FROM_CODE


def runtime_schedule(name: str, job_type: str) -> None:
    """A runtime schedule of a job type only some runners have (``add_schedule`` would want
    its handler registered in this process)."""
    JobSchedule.objects.create(name=name, job_type=job_type, interval_seconds=60,
                               timezone="UTC", next_run_at=Now() + timedelta(minutes=1))


def test_a_missing_handler_deactivates_only_when_no_live_runner_has_it() -> None:
    runtime_schedule("report", "fleet.report")
    register("with-handler", ["fleet.report"])
    register("without", ["other"])
    assert sync_as("without", ("other", {})).deactivated == []
    assert row("report").active
    stop("with-handler")
    assert sync_as("without", ("other", {})).deactivated == ["report"]
    assert row("report").inactive_reason == InactiveReason.HANDLER_MISSING
    # A runner that predates the job-types column counts as handling every type.
    runtime_schedule("report2", "fleet.report2")
    register("legacy", None)
    assert sync_as("without", ("other", {})).deactivated == []
    assert row("report2").active


def test_a_runner_records_what_its_code_declares() -> None:
    register("new-1")
    sync_as("new-1", NEW, KEPT_V2, ("fleet.plain", {}))
    assert JobRunnerRecord.objects.get(id="new-1").schedules == ["fleet.kept", "fleet.new"]


def test_a_runner_declares_its_schedules_from_registration(
    start_runner: Callable[..., Runner],
) -> None:
    """Before its first sync too (and when it registers again after being presumed dead), so
    no other runner's sync meanwhile takes a schedule only it declares for gone."""
    with code(KEPT_V2):
        with_scheduler = start_runner()
        without = start_runner(scheduler=False)
        with connection.cursor() as cursor:  # as if reaped and registering again
            store.unregister_runner(cursor, with_scheduler.runner_id)
            with_scheduler.register(cursor)
        record = JobRunnerRecord.objects.get(id=with_scheduler.runner_id)
        assert "fleet.kept" in record.schedules
        assert JobRunnerRecord.objects.get(id=without.runner_id).schedules is None


def test_a_runner_registering_again_keeps_when_it_started(
    start_runner: Callable[..., Runner],
) -> None:
    """Which live runner started last decides between two releases' declarations; a runner
    reaped (presumed dead) and registering again must not become "the newest"."""
    runner = start_runner()
    first = JobRunnerRecord.objects.get(id=runner.runner_id).started_at
    with connection.cursor() as cursor:
        store.unregister_runner(cursor, runner.runner_id)
        runner.register(cursor)
    assert JobRunnerRecord.objects.get(id=runner.runner_id).started_at == first


def test_a_running_runner_takes_its_schedules_back_when_an_old_runner_stops(
    start_runner: Callable[..., Runner],
) -> None:
    with pj_settings(STALE_LOCK_TIMEOUT=2, SCHEDULER_INTERVAL=0.2, POLL_INTERVAL=0.2), \
            code(KEPT_V2):
        start_runner()
        wait_for(lambda: JobSchedule.objects.filter(name="fleet.kept").exists(), 15,
                 message="the runner's start sync")
        # An old runner starts and rewrites the schedule to its code (what its sync does).
        register("old-1", ["fleet.kept"])
        with connection.cursor() as cursor:
            cursor.execute("UPDATE persistent_jobs_runners SET schedules = '[\"fleet.kept\"]' "
                           "WHERE id = 'old-1'")
        JobSchedule.objects.filter(name="fleet.kept").update(cron="0 3 * * *", updated_at=Now())
        stop("old-1")
        wait_for(lambda: row("fleet.kept").cron == "0 4 * * *", 15,
                 message="the running runner's periodic sync to restore its declaration")


# ----------------------------------------------------------------------------- removal, payloads
def test_a_code_schedule_gone_from_code_can_be_removed_and_its_name_reused() -> None:
    register("new-1", ["fleet.kept"])
    sync_as("new-1", KEPT_V1)
    with pytest.raises(ScheduleError, match="declared in code"):
        remove_schedule("fleet.kept")  # still declared: the next sync would bring it back
    sync_as("new-1", KEPT_UNSCHEDULED)
    assert not row("fleet.kept").active
    remove_schedule("fleet.kept")
    assert add_schedule("fleet.kept", "test.recurring.work", interval=60).is_code is False


def _refuse(payload: Any) -> None:
    raise ValueError("needs a region")


@pytest.mark.parametrize(("options", "message"), [
    ({"payload": {"blob": "x" * 2000}}, "payload is 2"),
    ({"payload": {"when": object()}}, "payload"),
    ({"payload": {}, "validator": _refuse}, "needs a region"),
])
def test_a_schedule_payload_the_enqueue_path_refuses_is_a_check_error(
    options: dict[str, Any], message: str,
) -> None:
    declaration = ("fleet.bad", {"interval": timedelta(minutes=1), **options})
    with pj_settings(PAYLOAD_MAX_BYTES=1000), code(declaration):
        errors = [e for e in checks.run_checks() if e.id == "persistent_jobs.E102"]
        assert len(errors) == 1 and "'fleet.bad'" in errors[0].msg
        assert message in errors[0].msg
        with pytest.raises(ConfigurationError, match="schedule payload is refused"):
            Runner()
        Runner(scheduler=False)  # a runner that fires no schedules may still run the jobs


# ----------------------------------------------------------------------------- clock set back
def test_a_schedule_stranded_by_a_clock_set_back_is_brought_back() -> None:
    add_schedule("hourly", "test.recurring.work", cron="0 * * * *", timezone="UTC")
    add_schedule("grid", "test.recurring.work", interval=600)
    # As if the clock had run a day ahead while they fired: next ticks a day away, written
    # (updated_at) by that clock.
    JobSchedule.objects.update(next_run_at=Now() + timedelta(days=1, seconds=7),
                               updated_at=Now() + timedelta(days=1))
    before = {s.name: s.next_run_at for s in JobSchedule.objects.all()}
    assert sorted(sync_code_schedules().rescheduled) == ["grid", "hourly"]
    now = db_now()
    hourly, grid = row("hourly"), row("grid")
    assert now < hourly.next_run_at <= now + timedelta(hours=1)
    assert hourly.next_run_at.minute == 0 and hourly.next_run_at.second == 0
    assert now < grid.next_run_at <= now + timedelta(seconds=600)
    assert (before["grid"] - grid.next_run_at) % timedelta(seconds=600) == timedelta(0)
    assert sync_code_schedules().rescheduled == []  # a tick in its place is left alone
