"""Exactly one run per tick across real runner processes (invariant 9).

Three ``manage.py runjobs`` processes all run the scheduler against one every-second schedule.
No leader is elected: each tick must still yield exactly one job row, and no tick may be lost.
"""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from collections.abc import Callable
from datetime import datetime, timedelta
from itertools import pairwise

import pytest

from django_persistent_jobs import add_schedule, pause_schedule
from django_persistent_jobs.models import JobRunnerRecord, JobStatus, PersistentJob
from tests.core_support import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

TICKS = 6
RUNNER_SETTINGS = json.dumps({"SCHEDULER_INTERVAL": 0.2, "POLL_INTERVAL": 0.2})


def test_three_runner_processes_fire_each_second_tick_exactly_once(
    spawn_runner: Callable[..., subprocess.Popen[bytes]],
) -> None:
    for _ in range(3):
        spawn_runner("--concurrency", "2", env={"PJ_TEST_SETTINGS": RUNNER_SETTINGS})
    wait_for(lambda: JobRunnerRecord.objects.count() == 3, 60, "three runners to register",
             interval=0.1)

    add_schedule("every-second", "test.recurring.tick", cron="* * * * * *")
    runs = PersistentJob.objects.filter(schedule__name="every-second")
    wait_for(lambda: runs.count() >= TICKS, 30, f"{TICKS} ticks", interval=0.1)
    # Pausing waits for any pass holding the row; after it returns no runner fires again.
    pause_schedule("every-second")
    rows = list(runs.values_list("schedule", flat=True))

    ticks = Counter(row["tick"] for row in rows)
    assert all(count == 1 for count in ticks.values()), ticks
    instants = sorted(datetime.fromisoformat(t) for t in ticks)
    # No tick was lost (or coalesced) either: the runs cover consecutive seconds.
    assert all(b - a == timedelta(seconds=1) for a, b in pairwise(instants)), instants
    assert all(row["coalesced_ticks"] == 0 for row in rows)
    firers = Counter(row["fired_by"] for row in rows)
    print(f"{len(rows)} ticks fired by {len(firers)} runner(s): {dict(firers)}")
    wait_for(lambda: runs.filter(status=JobStatus.COMPLETED).count() == len(rows), 20,
             "every run to complete", interval=0.1)
