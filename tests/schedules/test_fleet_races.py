"""The rolling-deploy schedule sync against what runs beside it, on real PostgreSQL: rows
committed by another connection while a sync runs (a schedule added, a tick fired), a runner
presumed dead or registering again, a runner started with ``--no-scheduler``, and the admin's
delete of a code schedule gone from code. (From a review; each failed on the first version.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, connections
from django.db.models.functions import Now

from django_persistent_jobs import add_schedule
from django_persistent_jobs.models import JobRunnerRecord, JobSchedule
from django_persistent_jobs.runner import store
from django_persistent_jobs.runner.scheduler import fire_due
from django_persistent_jobs.schedules import firing
from django_persistent_jobs.schedules.definition import db_now
from django_persistent_jobs.schedules.firing import sync_code_schedules
from tests.schedules.test_fleet_sync import (
    KEPT_V1,
    KEPT_V2,
    code,
    register,
    row,
    runtime_schedule,
    stop,
    sync_as,
)

pytestmark = pytest.mark.django_db(transaction=True)


def in_other_connection(body: Callable[[], Any]) -> Any:
    """Run ``body`` in another thread (its own connection, its own transaction), as another
    process (a web request, another runner) would, and wait for it."""
    result: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(body())
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    if errors:
        raise errors[0]
    return result[0] if result else None


def slow_sync(monkeypatch: pytest.MonkeyPatch, meanwhile: Callable[[], Any]) -> None:
    """Make the sync take a moment between its ``now`` and ``_unstrand`` (as reading and
    checking many schedules does), while ``meanwhile`` commits in another connection."""
    real = firing._unstrand

    def unstrand(report: Any) -> None:
        in_other_connection(meanwhile)
        real(report)

    monkeypatch.setattr(firing, "_unstrand", unstrand)


# ----------------------------------------------------------------------------- _unstrand races
def test_an_interval_schedule_added_during_a_sync_does_not_fire_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """_unstrand compares a row written after the sync's ``now`` with that ``now``: a daily
    schedule added meanwhile (next_run_at = its own now + 1 day, so "gap" > 1 day) is taken
    for stranded and moved back one step, to the moment it was added: it fires at once."""

    def add() -> None:
        time.sleep(0.05)  # the sync's now lies a little in the past
        add_schedule("daily", "test.recurring.work", interval=timedelta(days=1))

    slow_sync(monkeypatch, add)
    sync_code_schedules()
    monkeypatch.undo()
    assert row("daily").next_run_at > db_now() + timedelta(hours=23), (
        f"next_run_at moved to {row('daily').next_run_at} (now {db_now()})")
    assert fire_due().enqueued == 0


def test_a_tick_fired_by_another_runner_during_a_sync_is_not_moved_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another runner fires tick T after the sync took its ``now`` (< T): the new next_run_at
    (T + step) is more than one step after that ``now``, so _unstrand moves it back to T, and
    the next pass fires T a second time (refused by the tick index: skipped, last_result
    overwritten)."""
    add_schedule("fast", "test.recurring.tick", interval=timedelta(seconds=1))
    first_tick = row("fast").next_run_at

    def fire() -> None:
        while db_now() <= first_tick:
            time.sleep(0.02)
        assert fire_due("other-runner").enqueued == 1

    # The sync takes its now just before the tick is due.
    while db_now() < first_tick - timedelta(milliseconds=300):
        time.sleep(0.02)
    slow_sync(monkeypatch, fire)
    sync_code_schedules()
    monkeypatch.undo()
    assert row("fast").next_run_at > first_tick, "the fired tick was put back"
    second = fire_due("this-runner")
    assert second.skipped == 0 and row("fast").last_result != "skipped", row("fast").last_error


# ----------------------------------------------------------------------------- authority
def test_a_runner_presumed_dead_does_not_speak_for_the_fleet() -> None:
    """An old-release runner whose row was reaped (a GC pause, a network blip) syncs as if it
    had "started last" (``Fleet.started is None`` -> speaks_for everything, is_newest) and
    rewrites what the newer release declared."""
    register("old-1", ["fleet.kept"])
    sync_as("old-1", KEPT_V1)
    register("new-1", ["fleet.kept"])
    sync_as("new-1", KEPT_V2)
    assert row("fleet.kept").cron == "0 4 * * *"
    stop("old-1")  # reaped by another runner; its scheduler thread runs on
    sync_as("old-1", KEPT_V1)
    assert row("fleet.kept").cron == "0 4 * * *", "the reaped old runner rewrote it"


def test_a_runner_registering_again_does_not_become_the_newest() -> None:
    """Registering again after being reaped inserts a new row; with ``started_at = now()``
    the old runner would count as started last, its declaration would stand and the new
    runners' syncs would defer to it until it stopped. A runner registers again with the
    start it first registered with (``Runner.register``, tested with a real runner in
    ``test_fleet_sync``)."""
    register("old-1", ["fleet.kept"])
    first_start = JobRunnerRecord.objects.get(id="old-1").started_at
    sync_as("old-1", KEPT_V1)
    register("new-1", ["fleet.kept"])
    sync_as("new-1", KEPT_V2)
    stop("old-1")  # reaped...
    with connection.cursor() as cursor:  # ...and its next beat registers it again
        store.register_runner(cursor, "old-1", "test-host", 1, None, 1, "test",
                              job_types=["fleet.kept"], schedules=["fleet.kept"],
                              started_at=first_start)
    sync_as("old-1", KEPT_V1)
    sync_as("new-1", KEPT_V2)
    assert row("fleet.kept").cron == "0 4 * * *", "the old release's declaration won"


# ----------------------------------------------------------------------------- handlers
def test_a_schedule_only_a_no_scheduler_runner_can_run_is_not_left_active_and_silent() -> None:
    """Fleet.handled counts the job types of every live runner, also those started with
    --no-scheduler, which never fire schedules. A runtime schedule whose type only such a
    worker handles is no longer deactivated, and no scheduler ever fires it: it shows as
    active and due forever, with no error (before the change: HANDLER_MISSING)."""
    runtime_schedule("report", "fleet.report")
    JobSchedule.objects.filter(name="report").update(next_run_at=Now())
    register("worker", ["fleet.report"], scheduler=False)  # runjobs --no-scheduler
    register("sched", ["other"])
    sync_as("sched", ("other", {}))
    with code(("other", {})):
        fired = fire_due("sched")
    schedule = row("report")
    assert fired.enqueued == 1 or not schedule.active, (
        "active, due, and no runner that fires schedules can fire it")


# ----------------------------------------------------------------------------- removal via admin
def test_the_admin_can_remove_a_code_schedule_gone_from_code() -> None:
    """CHANGELOG and recurring.md: a code schedule switched off because the code no longer
    has it "can be removed (remove_schedule, the admin)". The admin's has_delete_permission
    still says no to every code schedule (admin/schedules.py:189-192)."""
    from django.contrib.auth.models import User
    from django.test import Client
    from django.urls import reverse

    register("new-1", ["fleet.kept"])
    sync_as("new-1", KEPT_V1)
    sync_as("new-1", ("fleet.kept", {}))
    schedule = row("fleet.kept")
    assert not schedule.active
    client = Client()
    client.force_login(User.objects.create_superuser("root", password=None))
    url = reverse("admin:django_persistent_jobs_jobschedule_delete", args=[schedule.pk])
    response = client.post(url, {"post": "yes"})
    assert response.status_code == 302, f"admin refused: {response.status_code}"
    assert not JobSchedule.objects.filter(name="fleet.kept").exists()
