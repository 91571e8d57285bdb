"""Tenants: ``enqueue(..., tenant=...)`` stores the owner on the row, the handler sees it as
``ctx.tenant``, retries keep it, and a schedule gives its tenant to every run it enqueues."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import transaction
from django.db.models.functions import Now

from django_persistent_jobs import (
    Dedup,
    EnqueueError,
    JobContext,
    Runner,
    ScheduleError,
    TransientJobError,
    add_schedule,
    enqueue,
    enqueue_many,
    job_handler,
    run_schedule_now,
    update_schedule,
)
from django_persistent_jobs.backoff import constant
from django_persistent_jobs.handlers import Registry, registry
from django_persistent_jobs.models import JobAttempt, JobSchedule, JobStatus, PersistentJob
from django_persistent_jobs.runner.scheduler import fire_due
from django_persistent_jobs.schedules.firing import sync_code_schedules
from tests.runner_support import isolated_registry, wait_status

__all__ = ["isolated_registry"]  # a fixture, used by name

BAD_TENANTS: list[Any] = ["", "t" * 201, "acme\x00", "acme\ud800", 42, b"acme"]


def tenants(*jobs: PersistentJob) -> list[str | None]:
    stored = dict(PersistentJob.objects.values_list("id", "tenant"))
    return [stored[job.id] for job in jobs]


@pytest.mark.django_db
def test_enqueue_stores_the_tenant_and_defaults_to_none() -> None:
    owned = enqueue("test.noop", {"a": 1}, tenant="acme")
    plain = enqueue("test.noop", {"a": 2})
    longest = enqueue("test.noop", tenant="t" * 200)
    assert (owned.tenant, plain.tenant) == ("acme", None)
    assert tenants(owned, plain, longest) == ["acme", None, "t" * 200]


@pytest.mark.django_db
def test_enqueue_many_stores_common_and_per_item_tenants_on_the_copy_path() -> None:
    jobs = enqueue_many(
        [("test.noop", {"i": 0}), {"job_type": "test.noop", "payload": {"i": 1},
                                   "tenant": "globex"}],
        tenant="acme",
    )
    assert [j.tenant for j in jobs] == ["acme", "globex"]
    assert tenants(*jobs) == ["acme", "globex"]
    assert tenants(*enqueue_many([("test.noop", {})])) == [None]


@pytest.mark.django_db
def test_tenant_on_every_dedup_path() -> None:
    # enqueue_many with keys goes through the deduplicating INSERT, not COPY.
    keyed = enqueue_many([("test.noop", {"i": i}) for i in range(3)], dedup_key="k",
                         tenant="acme")
    assert len({j.id for j in keyed}) == 1 and tenants(keyed[0]) == ["acme"]
    # Skip returns the job holding the key, with that job's tenant: keys are not per tenant.
    skipped = enqueue("test.noop", dedup_key="k", tenant="globex")
    assert skipped.id == keyed[0].id and skipped.tenant == "acme"
    # Replace inserts the new job with the new tenant.
    first = enqueue("test.noop", dedup_key="r", dedup=Dedup.REPLACE, tenant="acme")
    second = enqueue("test.noop", dedup_key="r", dedup=Dedup.REPLACE, tenant="globex")
    assert tenants(first, second) == ["acme", "globex"]
    assert PersistentJob.objects.get(id=first.id).status == JobStatus.CANCELLED
    replaced = enqueue_many([("test.noop", {})], dedup_key="r", dedup="replace", tenant="initech")
    assert tenants(*replaced) == ["initech"]


@pytest.mark.django_db
@pytest.mark.parametrize("tenant", BAD_TENANTS, ids=repr)
def test_bad_tenants_are_refused_before_anything_is_written(tenant: Any) -> None:
    with pytest.raises(EnqueueError, match="tenant") as info:
        enqueue("test.noop", tenant=tenant)
    assert info.value.code == "ENQUEUE_INVALID"
    with pytest.raises(EnqueueError, match=r"item 1: .*tenant"):
        enqueue_many([("test.noop", {}), {"job_type": "test.noop", "tenant": tenant}])
    with pytest.raises(EnqueueError, match="tenant"):
        enqueue_many([("test.noop", {})], tenant=tenant)
    with pytest.raises(ScheduleError, match="tenant"):
        add_schedule("bad-tenant", "test.recurring.work", cron="0 2 * * *", tenant=tenant)
    assert PersistentJob.objects.count() == 0
    assert JobSchedule.objects.count() == 0


@pytest.mark.django_db(transaction=True)
def test_the_handler_sees_the_tenant_on_every_attempt(
    isolated_registry: Registry, start_runner: Callable[..., Runner],
) -> None:
    seen: list[tuple[int, str | None]] = []

    @job_handler("tn.probe", max_retries=2, backoff=constant(0))
    def probe(payload: Any, ctx: JobContext) -> None:
        seen.append((ctx.attempt, ctx.tenant))
        if ctx.attempt == 1:
            raise TransientJobError("once more")

    with transaction.atomic():
        owned = enqueue("tn.probe", tenant="acme")
        plain = enqueue("tn.probe")
    start_runner(concurrency=2)
    for job in (owned, plain):
        done = wait_status(job.id, JobStatus.COMPLETED)
        assert done.attempts == 2
    assert sorted(seen, key=lambda s: (s[1] or "", s[0])) == [
        (1, None), (2, None), (1, "acme"), (2, "acme")]
    assert tenants(owned, plain) == ["acme", None]
    assert JobAttempt.objects.filter(job_id=owned.id).count() == 2


@pytest.mark.django_db(transaction=True)
def test_a_runtime_schedule_gives_its_tenant_to_every_run() -> None:
    schedule = add_schedule("tn-nightly", "test.recurring.tick", cron="0 2 * * *",
                            tenant="acme")
    assert schedule.tenant == "acme"
    manual = run_schedule_now("tn-nightly")
    JobSchedule.objects.filter(name="tn-nightly").update(next_run_at=Now())
    assert fire_due().enqueued == 1
    runs = PersistentJob.objects.filter(schedule__name="tn-nightly")
    assert manual.tenant == "acme"
    assert sorted(runs.values_list("tenant", flat=True)) == ["acme", "acme"]
    update_schedule("tn-nightly", tenant="globex")
    assert run_schedule_now("tn-nightly").tenant == "globex"
    update_schedule("tn-nightly", tenant=None)
    assert run_schedule_now("tn-nightly").tenant is None
    with pytest.raises(ScheduleError, match="tenant"):
        update_schedule("tn-nightly", tenant="")
    assert JobSchedule.objects.get(name="tn-nightly").tenant is None


@pytest.mark.django_db(transaction=True)
def test_a_code_schedule_takes_a_tenant() -> None:
    with registry.isolated():
        @job_handler("tn.code.tick", interval=timedelta(hours=1), tenant="acme", dedup="enqueue")
        def tick(payload: Any) -> None:
            return None

        sync_code_schedules()
        assert JobSchedule.objects.get(name="tn.code.tick").tenant == "acme"
        JobSchedule.objects.filter(name="tn.code.tick").update(next_run_at=Now())
        assert fire_due().enqueued == 1
        run = PersistentJob.objects.get(schedule__name="tn.code.tick")
        assert run.tenant == "acme"


def test_a_tenant_on_a_handler_that_is_not_recurring_is_a_check_error() -> None:
    with registry.isolated():
        @job_handler("tn.code.plain", tenant="acme")
        def plain(payload: Any) -> None:
            return None

        @job_handler("tn.code.bad", interval=timedelta(hours=1), tenant="x\x00")
        def bad(payload: Any) -> None:
            return None

        plain_spec, bad_spec = registry.get("tn.code.plain"), registry.get("tn.code.bad")
        assert plain_spec is not None and bad_spec is not None
        assert any("give cron or interval" in e for e in plain_spec.errors)
        assert any("tenant" in e and "NUL" in e for e in bad_spec.errors)
