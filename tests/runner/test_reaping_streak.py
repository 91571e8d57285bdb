"""When a runner may reap others (``heartbeat.Liveness.may_reap`` and the reap statement's own
guard): only after beating without a gap for a whole stale-lock timeout, and never while a gap
is still going on. A gap is noticed in-process only at the beat that ends it; a thawed process
or a database that just came back must not reap in between, when every runner's heartbeat
looks stale at once. The fault suite's waiting-job scenarios wait for the log line these pin.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

import pytest
from django.db import connection

from django_persistent_jobs.conf import RunnerSettings
from django_persistent_jobs.runner import store
from django_persistent_jobs.runner.heartbeat import Liveness, reap_try, rescue


def _liveness() -> Liveness:
    settings = RunnerSettings.load(stale_lock_timeout=10.0, heartbeat_interval=1.0)
    return Liveness("default", "me", settings, register=lambda cursor: None)


def test_a_runner_reaps_only_after_a_gap_free_streak_and_says_so_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    liveness = _liveness()
    assert not liveness.may_reap()  # never beaten
    liveness.note_beat()
    assert not liveness.may_reap()  # beaten, but not for a stale-lock timeout yet
    now = time.monotonic()
    liveness.healthy_since = now - 10.5
    with caplog.at_level(logging.INFO, "django_persistent_jobs.runner"):
        assert liveness.may_reap() and liveness.may_reap()
    said = [r.getMessage() for r in caplog.records if "it now reaps" in r.getMessage()]
    assert len(said) == 1, said


def test_an_overdue_beat_stops_reaping_before_the_beat_that_ends_the_gap(
    caplog: pytest.LogCaptureFixture,
) -> None:
    liveness = _liveness()
    liveness.note_beat()
    liveness.healthy_since = time.monotonic() - 60
    assert liveness.may_reap()
    # Frozen (or the database away) for 5 s: the heartbeat thread has not beaten since, and the
    # rescue thread asks first.
    liveness.last_beat = time.monotonic() - 5.0
    assert not liveness.may_reap()
    with caplog.at_level(logging.INFO, "django_persistent_jobs.runner"):
        liveness.note_beat()  # the beat that ends the gap starts a new streak
    assert any("between two heartbeats" in r.getMessage() for r in caplog.records)
    assert not liveness.may_reap()
    liveness.healthy_since = time.monotonic() - 10.5
    caplog.clear()
    with caplog.at_level(logging.INFO, "django_persistent_jobs.runner"):
        assert liveness.may_reap()  # a new streak is announced again
    assert any("it now reaps" in r.getMessage() for r in caplog.records)


def _register(runner_id: str, heartbeat_age: timedelta) -> None:
    with connection.cursor() as cursor:
        store.register_runner(cursor, runner_id, "host", 1, None, 4, "test")
        cursor.execute("UPDATE persistent_jobs_runners SET heartbeat_at = now() - %s "
                       "WHERE id = %s", [heartbeat_age, runner_id])


@pytest.mark.django_db
def test_the_reap_statement_reaps_nobody_while_its_reapers_own_heartbeat_is_stale() -> None:
    """As for a statement that reached the server long after it was sent (its runner frozen in
    between): the reaper's own heartbeat, by the database clock, is as stale as everybody
    else's."""
    _register("dead", timedelta(minutes=5))
    _register("reaper", timedelta(seconds=40))
    with connection.cursor() as cursor:
        def reap(reaper: str) -> list[str]:
            return [runner for runner, _ in store.reap_dead_runners(
                cursor, 30, reaper=reaper, reaper_fresh_seconds=1.5)]

        assert reap("reaper") == []
        assert reap("unknown") == []
        cursor.execute("UPDATE persistent_jobs_runners SET heartbeat_at = now() - "
                       "interval '2 seconds' WHERE id = 'reaper'")
        assert reap("reaper") == []  # a beat overdue
        cursor.execute("UPDATE persistent_jobs_runners SET heartbeat_at = now() "
                       "WHERE id = 'reaper'")
        assert reap("reaper") == ["dead"]
        cursor.execute("SELECT id FROM persistent_jobs_runners")
        assert cursor.fetchall() == [("reaper",)]


@pytest.mark.django_db
def test_a_rescue_round_reaps_only_while_the_reapers_row_is_fresh_too() -> None:
    """The round passes its runner's id to the reap statement: a runner that believes its
    streak (in-process) but whose row the database saw beat long ago reaps nobody."""
    liveness = _liveness()
    liveness.runner_id = "reaper"
    liveness.note_beat()
    liveness.healthy_since = time.monotonic() - 60
    assert liveness.may_reap()
    _register("dead", timedelta(minutes=5))
    _register("reaper", timedelta(seconds=40))
    halt = threading.Event()
    liveness.note_beat()  # (just now: the in-process rule says yes, only the row's age says no)
    assert liveness.may_reap()
    rescue(liveness, halt)
    with connection.cursor() as cursor:
        cursor.execute("SELECT id FROM persistent_jobs_runners ORDER BY id")
        assert cursor.fetchall() == [("dead",), ("reaper",)]
        cursor.execute("UPDATE persistent_jobs_runners SET heartbeat_at = now() "
                       "WHERE id = 'reaper'")
    liveness.note_beat()
    assert liveness.may_reap()
    rescue(liveness, halt)
    with connection.cursor() as cursor:
        cursor.execute("SELECT id FROM persistent_jobs_runners ORDER BY id")
        assert cursor.fetchall() == [("reaper",)]


@pytest.mark.django_db
def test_each_try_of_a_reap_asks_again_whether_it_may() -> None:
    """A reap retried through an outage: by the try that reaches the database, the reaper's own
    beat may have ended the outage and started a new streak (or still be overdue)."""
    liveness = _liveness()
    liveness.runner_id = "reaper"
    liveness.note_beat()
    liveness.healthy_since = time.monotonic() - 60
    _register("dead", timedelta(minutes=5))
    _register("reaper", timedelta(0))
    with connection.cursor() as cursor:
        liveness.last_beat = time.monotonic() - 5.0  # overdue when this try runs
        assert reap_try(cursor, liveness) == []
        liveness.note_beat()  # the beat that ends the gap: a new streak, not long enough yet
        assert reap_try(cursor, liveness) == []
        liveness.healthy_since = time.monotonic() - 10.5
        assert [runner for runner, _ in reap_try(cursor, liveness)] == ["dead"]
