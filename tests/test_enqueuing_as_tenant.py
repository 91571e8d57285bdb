"""``enqueue_as_tenant``: a caller confined to one tenant shares dedup keys with its own jobs
only. A key held by another tenant's active job (or by a job without a tenant) is refused, with
nothing written, whatever the strategy and even when the other job appears concurrently."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection, transaction

from django_persistent_jobs import (
    Dedup,
    DedupKeyTakenError,
    EnqueueError,
    enqueue,
    enqueue_as_tenant,
)
from django_persistent_jobs.models import JobStatus, PersistentJob
from tests.core_support import race_for_key


def rows() -> list[tuple[Any, ...]]:
    return list(PersistentJob.objects.order_by("id").values_list(
        "id", "status", "tenant", "payload", "updated_at"))


@pytest.mark.django_db
@pytest.mark.parametrize("holder_tenant", ["globex", None])
@pytest.mark.parametrize("holder_status", ["pending", "failed", "running"])
@pytest.mark.parametrize("strategy", ["skip", "replace"])
def test_a_key_held_outside_the_tenant_is_refused_and_nothing_is_written(
    holder_tenant: str | None, holder_status: str, strategy: str,
) -> None:
    holder = enqueue("test.noop", {"secret": 1}, dedup_key="k", dedup=strategy,
                     tenant=holder_tenant)
    PersistentJob.objects.filter(id=holder.id).update(status=holder_status)
    before = rows()
    with transaction.atomic():
        with pytest.raises(DedupKeyTakenError, match="dedup_key 'k'") as info:
            enqueue_as_tenant("test.noop", {"mine": 1}, tenant="acme", dedup_key="k",
                              dedup=strategy)
        # The caller's transaction is still usable, as after any EnqueueError.
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    assert isinstance(info.value, EnqueueError) and info.value.code == "DEDUP_KEY_TAKEN"
    assert str(holder.id) not in str(info.value) and "secret" not in str(info.value)
    assert rows() == before


@pytest.mark.django_db
def test_the_tenants_own_key_behaves_as_in_enqueue() -> None:
    mine = enqueue("test.noop", {"v": 1}, dedup_key="s", tenant="acme")
    again = enqueue_as_tenant("test.noop", {"v": 2}, tenant="acme", dedup_key="s")
    assert again.id == mine.id and again._pj_created is False  # type: ignore[attr-defined]
    old = enqueue_as_tenant("test.noop", {"v": 1}, tenant="acme", dedup_key="r",
                            dedup=Dedup.REPLACE)
    new = enqueue_as_tenant("test.noop", {"v": 2}, tenant="acme", dedup_key="r",
                            dedup=Dedup.REPLACE)
    assert PersistentJob.objects.get(id=old.id).status == JobStatus.CANCELLED
    assert (new.tenant, PersistentJob.objects.get(id=new.id).status) == ("acme", "pending")
    # A key that another tenant stores for search only (Enqueue) holds nothing, and an Enqueue
    # of the confined caller takes no key at all.
    enqueue("test.noop", dedup_key="e", dedup="enqueue", tenant="globex")
    assert enqueue_as_tenant("test.noop", tenant="acme", dedup_key="e").tenant == "acme"
    enqueue("test.noop", dedup_key="x", tenant="globex")
    assert enqueue_as_tenant("test.noop", tenant="acme", dedup_key="x",
                             dedup="enqueue").tenant == "acme"


@pytest.mark.django_db
def test_a_finished_foreign_job_does_not_hold_its_key() -> None:
    done = enqueue("test.noop", dedup_key="k", tenant="globex")
    PersistentJob.objects.filter(id=done.id).update(status="completed")
    assert enqueue_as_tenant("test.noop", tenant="acme", dedup_key="k").id != done.id


@pytest.mark.django_db
def test_the_tenant_is_required_and_checked() -> None:
    with pytest.raises(TypeError):
        enqueue_as_tenant("test.noop", dedup_key="k")  # type: ignore[call-arg]
    with pytest.raises(EnqueueError, match="tenant"):
        enqueue_as_tenant("test.noop", tenant="")
    assert PersistentJob.objects.count() == 0


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("strategy", ["skip", "replace"])
def test_a_foreign_job_that_appears_concurrently_is_neither_returned_nor_cancelled(
    strategy: str,
) -> None:
    """Another tenant's enqueue holds the key in an open transaction; the confined enqueue
    cannot see it yet, meets it on the unique index, waits, and must refuse once it commits
    (a plain ``enqueue`` would return it with Skip, or cancel it with Replace)."""
    first, second = race_for_key(
        lambda: enqueue("test.noop", {"who": "globex"}, dedup_key="race", dedup=strategy,
                        tenant="globex"),
        lambda: enqueue_as_tenant("test.noop", {"who": "acme"}, tenant="acme",
                                  dedup_key="race", dedup=strategy))
    holder = first.result()
    assert isinstance(second.exception(), DedupKeyTakenError)
    assert list(PersistentJob.objects.values_list("id", "status", "tenant")) == [
        (holder.id, "pending", "globex")]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("strategy", ["skip", "replace"])
def test_refused_in_autocommit_too(strategy: str) -> None:
    holder = enqueue("test.noop", dedup_key="k", dedup=strategy, tenant="globex")
    assert connection.get_autocommit()
    with pytest.raises(DedupKeyTakenError):
        enqueue_as_tenant("test.noop", tenant="acme", dedup_key="k", dedup=strategy)
    assert list(PersistentJob.objects.values_list("id", "status")) == [(holder.id, "pending")]
