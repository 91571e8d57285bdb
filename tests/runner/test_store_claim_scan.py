"""A claim resumes after the last job it claimed (so it does not walk the dead index entries that
earlier claims left at the head of the claim index), and still misses nothing: a job committed
late with an earlier key, a job of a higher priority, a job skipped while locked elsewhere are
found by the next full scan (on a wake-up, when the resumed scan finds nothing, and at least
every ``rescan`` seconds)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from django.db import connection
from django.db.models import Max
from django.utils import timezone

from django_persistent_jobs.enqueuing import enqueue_many
from django_persistent_jobs.models import JobStatus, PersistentJob
from django_persistent_jobs.runner import Runner, store
from tests.core_support import conninfo, register_runner, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]


def waiting(**fields: Any) -> PersistentJob:
    """A waiting job inserted by the ORM: no NOTIFY, so no runner is woken for it."""
    fields.setdefault("job_type", "test.noop")
    fields.setdefault("max_retries", 0)
    return PersistentJob.objects.create(**fields)


def claim_ids(scan: store.ClaimScan, limit: int) -> list[Any]:
    register_runner("scan")
    with connection.cursor() as cursor:
        return [j.id for j in scan.claim(cursor, "scan", limit, None)]


def test_resumed_claim_misses_no_late_or_higher_priority_job() -> None:
    now = timezone.now()
    backlog = [waiting(next_run_at=now - timedelta(minutes=10) + timedelta(seconds=i))
               for i in range(6)]
    scan = store.ClaimScan(rescan=3600)  # no time-based rescan: only the structural fallbacks
    assert claim_ids(scan, 2) == [j.id for j in backlog[:2]]  # a full scan from the head
    # Committed after the claim: one with an earlier key (a late-committing transaction), one of
    # a higher priority. The resumed scan cannot see either ...
    late = waiting(next_run_at=now - timedelta(hours=1))
    urgent = waiting(priority=5)
    assert claim_ids(scan, 2) == [j.id for j in backlog[2:4]]
    assert claim_ids(scan, 2) == [j.id for j in backlog[4:6]]
    # ... but once it runs dry the claim falls back to a full scan, in claim order.
    assert claim_ids(scan, 2) == [urgent.id, late.id]
    assert claim_ids(scan, 2) == []
    assert not PersistentJob.objects.filter(status__in=JobStatus.waiting()).exists()


def test_a_wake_up_or_the_rescan_interval_restarts_from_the_head() -> None:
    first = waiting(next_run_at=timezone.now() - timedelta(minutes=5))
    for _ in range(3):
        waiting(next_run_at=timezone.now() - timedelta(minutes=4))
    scan = store.ClaimScan(rescan=3600)
    assert claim_ids(scan, 1) == [first.id]
    urgent = waiting(priority=9)
    scan.forget()  # what the claim loop does when a NOTIFY woke it
    assert claim_ids(scan, 1) == [urgent.id]
    later_urgent = waiting(priority=9)
    scan.rescan = 0.0  # the interval has passed
    assert claim_ids(scan, 1) == [later_urgent.id]


def test_runner_picks_up_jobs_behind_its_resume_point_while_draining(
        start_runner: Callable[..., Runner]) -> None:
    """Jobs that appear behind where the runner's claims resume without any wake-up (every
    insert NOTIFYs, these do not: a job another session had locked while the claims passed it,
    a job whose priority is raised) are still run while the backlog drains, not only once it is
    empty: the periodic full scan finds them. The jobs take a millisecond or two each (a sleep
    and a write), so the backlog lasts a few seconds: no-op jobs drained it in about as long as
    one rescan interval, with up to 0.1 s of them claimed ahead, so whether the test passed
    depended on how fast the runner drained."""
    enqueue_many([("test.ledger", {"i": i, "sleep": 0.001}) for i in range(1500)])
    order = list(PersistentJob.objects.claimable().values_list("id", flat=True))
    with psycopg.connect(**conninfo()) as locker:
        locker.execute("SELECT id FROM persistent_jobs WHERE id = %s FOR UPDATE", [order[0]])
        start_runner(concurrency=1)
        wait_for(lambda: PersistentJob.objects.filter(status=JobStatus.COMPLETED).count() >= 100,
                 timeout=60)
        locker.commit()  # the skipped job is claimable again, far behind the resume point
    PersistentJob.objects.filter(id=order[-1]).update(priority=5)  # now first in claim order
    wait_for(lambda: not PersistentJob.objects.filter(status__in=JobStatus.active()).exists(),
             timeout=90)
    backlog_end = PersistentJob.objects.exclude(id__in=[order[0], order[-1]]).aggregate(
        Max("finished_at"))["finished_at__max"]
    for job_id in (order[0], order[-1]):
        job = PersistentJob.objects.get(id=job_id)
        assert job.status == JobStatus.COMPLETED
        assert job.finished_at is not None and job.finished_at < backlog_end, \
            "found only when the backlog ran dry"
