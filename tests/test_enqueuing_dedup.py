"""Deduplication: Skip (default), Enqueue, Replace, against waiting and running jobs, under
real concurrency (two connections racing for the same key)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import pytest
from django.db import connection, connections, transaction

from django_persistent_jobs import Dedup, enqueue, enqueue_many, job_handler
from django_persistent_jobs.models import JobStatus, PersistentJob
from django_persistent_jobs.runner import store
from tests.core_support import (
    Rollback,
    claim_as,
    pj_settings,
    race_for_key,
)


@job_handler("core.dedup.replace", dedup=Dedup.REPLACE)
def replace_handler(payload: Any) -> None:
    return None


@job_handler("core.dedup.enqueue", dedup="enqueue")
def enqueue_handler(payload: Any) -> None:
    return None


def claim(limit: int = 10) -> list[store.ClaimedJob]:
    with connection.cursor() as cursor:
        return claim_as(cursor, "core-test-runner", limit, None)


def statuses(**filters: Any) -> list[tuple[Any, str, Any]]:
    return list(PersistentJob.objects.filter(**filters).order_by("id")
                .values_list("id", "status", "payload"))


# ------------------------------------------------------------------ Skip

@pytest.mark.django_db
def test_skip_is_the_default_and_returns_the_waiting_job() -> None:
    first = enqueue("test.noop", {"v": 1}, dedup_key="order-1")
    second = enqueue("test.noop", {"v": 2}, dedup_key="order-1")
    assert second.id == first.id and second.payload == {"v": 1}
    assert second.dedup == "skip"
    assert statuses() == [(first.id, "pending", {"v": 1})]
    # Keys are per job type, and jobs without a key never deduplicate.
    other_type = enqueue("test.ledger", {}, dedup_key="order-1")
    other_key = enqueue("test.noop", {}, dedup_key="order-2")
    keyless = [enqueue("test.noop", {}) for _ in range(2)]
    assert len({first.id, other_type.id, other_key.id, *(j.id for j in keyless)}) == 5


@pytest.mark.django_db
def test_skip_returns_a_job_awaiting_retry_and_a_running_job() -> None:
    job = enqueue("test.noop", {"v": 1}, dedup_key="k")
    (claimed,) = claim()
    assert enqueue("test.noop", {"v": 2}, dedup_key="k").id == job.id  # running
    with connection.cursor() as cursor:
        assert store.transition(cursor, job.id, claimed.token, kind="retry", code="X",
                                message="boom", delay=3600) == "failed"
    assert enqueue("test.noop", {"v": 3}, dedup_key="k").id == job.id  # awaiting retry
    assert PersistentJob.objects.count() == 1


@pytest.mark.django_db
def test_a_finished_job_does_not_block_its_key() -> None:
    job = enqueue("test.noop", dedup_key="k")
    (claimed,) = claim()
    with connection.cursor() as cursor:
        assert store.complete(cursor, claimed)
    fresh = enqueue("test.noop", {"again": True}, dedup_key="k")
    assert fresh.id != job.id and fresh.status == "pending"


# ------------------------------------------------------------------ Enqueue

@pytest.mark.django_db
def test_enqueue_strategy_keeps_every_job_and_stores_the_key() -> None:
    jobs = [enqueue("test.noop", {"i": i}, dedup_key="k", dedup="enqueue") for i in range(3)]
    jobs += [enqueue("core.dedup.enqueue", {"i": i}, dedup_key="k") for i in range(2)]
    assert len({j.id for j in jobs}) == 5
    assert PersistentJob.objects.filter(dedup_key="k", status="pending").count() == 5
    # Enqueue-strategy jobs do not hold the key against Skip either.
    skip = enqueue("test.noop", dedup_key="k")
    assert skip.id not in {j.id for j in jobs}
    with pj_settings(DEDUP="enqueue"):
        a = enqueue("test.ledger", dedup_key="x")
        b = enqueue("test.ledger", dedup_key="x")
    assert a.id != b.id


# ------------------------------------------------------------------ Replace

@pytest.mark.django_db
def test_replace_cancels_the_waiting_duplicate() -> None:
    old = enqueue("core.dedup.replace", {"v": 1}, dedup_key="k")
    new = enqueue("core.dedup.replace", {"v": 2}, dedup_key="k")
    assert new.id != old.id and new.payload == {"v": 2} and new.status == "pending"
    old.refresh_from_db()
    assert old.status == JobStatus.CANCELLED and old.last_error_code == "REPLACED"
    assert old.finished_at is not None
    assert "replaced by a newer job" in old.last_error
    # Per call: Replace on a handler whose default is Skip.
    a = enqueue("test.noop", {"v": 1}, dedup_key="z")
    b = enqueue("test.noop", {"v": 2}, dedup_key="z", dedup=Dedup.REPLACE)
    assert PersistentJob.objects.get(id=a.id).status == "cancelled"
    assert PersistentJob.objects.get(id=b.id).status == "pending"


@pytest.mark.django_db
def test_replace_cancels_a_duplicate_awaiting_retry() -> None:
    old = enqueue("core.dedup.replace", {"v": 1}, dedup_key="k")
    (claimed,) = claim()
    with connection.cursor() as cursor:
        store.transition(cursor, old.id, claimed.token, kind="retry", code="X", message="m",
                         delay=60)
    assert PersistentJob.objects.get(id=old.id).status == "failed"
    new = enqueue("core.dedup.replace", {"v": 2}, dedup_key="k")
    assert PersistentJob.objects.get(id=old.id).status == "cancelled"
    assert PersistentJob.objects.get(id=new.id).status == "pending"


@pytest.mark.django_db
def test_replace_never_interrupts_a_running_duplicate_and_waits_for_it() -> None:
    running = enqueue("core.dedup.replace", {"v": 1}, dedup_key="k")
    (claimed,) = claim()
    waiting = enqueue("core.dedup.replace", {"v": 2}, dedup_key="k")
    assert waiting.id != running.id
    running.refresh_from_db()
    assert running.status == "running" and running.lock_token == claimed.token
    assert not running.cancel_requested
    # Due, but the claim query will not start it while the duplicate runs.
    assert claim() == []
    newest = enqueue("core.dedup.replace", {"v": 3}, dedup_key="k")
    assert PersistentJob.objects.get(id=waiting.id).status == "cancelled"
    assert PersistentJob.objects.get(id=running.id).status == "running"
    assert claim() == []
    with connection.cursor() as cursor:
        assert store.complete(cursor, claimed)
    (next_one,) = claim()
    assert next_one.id == newest.id and next_one.payload == {"v": 3}


@pytest.mark.django_db
def test_replace_waits_for_a_running_duplicate_until_it_is_dead_lettered() -> None:
    running = enqueue("core.dedup.replace", {"v": 1}, dedup_key="k")
    (claimed,) = claim()
    waiting = enqueue("core.dedup.replace", {"v": 2}, dedup_key="k")
    with connection.cursor() as cursor:
        assert store.transition(cursor, running.id, claimed.token, kind="dead", code="P",
                                message="no") == "dead_lettered"
    assert [j.id for j in claim()] == [waiting.id]


@pytest.mark.django_db
def test_a_running_job_superseded_by_replace_is_not_retried() -> None:
    running = enqueue("core.dedup.replace", {"v": 1}, dedup_key="k")
    (claimed,) = claim()
    waiting = enqueue("core.dedup.replace", {"v": 2}, dedup_key="k")
    with connection.cursor() as cursor:
        status = store.transition(cursor, running.id, claimed.token, kind="retry",
                                  code="HANDLER_ERROR", message="boom")
    assert status == "cancelled"
    old = PersistentJob.objects.get(id=running.id)
    assert old.last_error_code == "REPLACED" and "boom" in old.last_error
    assert [j.id for j in claim()] == [waiting.id]


# ------------------------------------------------------------------ enqueue_many

@pytest.mark.django_db
def test_enqueue_many_deduplicates_within_the_batch_and_against_the_table() -> None:
    existing = enqueue("test.noop", {"v": "old"}, dedup_key="a")
    jobs = enqueue_many([
        ("test.noop", {"v": 1}),  # no key
        {"job_type": "test.noop", "payload": {"v": 2}, "dedup_key": "a"},  # skip -> existing
        {"job_type": "test.noop", "payload": {"v": 3}, "dedup_key": "b"},  # first b wins
        {"job_type": "test.noop", "payload": {"v": 4}, "dedup_key": "b"},
        {"job_type": "core.dedup.replace", "payload": {"v": 5}, "dedup_key": "c"},
        {"job_type": "core.dedup.replace", "payload": {"v": 6}, "dedup_key": "c"},  # last wins
    ])
    assert jobs[1].id == existing.id and jobs[1].payload == {"v": "old"}
    assert jobs[2].id == jobs[3].id and jobs[2].payload == {"v": 3}
    assert jobs[4].id == jobs[5].id and jobs[5].payload == {"v": 6}
    pending = PersistentJob.objects.filter(status="pending")
    assert sorted(str(p["v"]) for p in pending.values_list("payload", flat=True)) == [
        "1", "3", "6", "old"]
    assert PersistentJob.objects.count() == 4

    replaced = enqueue_many([{"job_type": "core.dedup.replace", "payload": {"v": 7},
                              "dedup_key": "c"}])
    assert PersistentJob.objects.get(id=jobs[5].id).status == "cancelled"
    assert PersistentJob.objects.get(id=replaced[0].id).status == "pending"


@pytest.mark.django_db
def test_enqueue_many_against_a_running_duplicate() -> None:
    skip_running = enqueue("test.noop", {"v": 1}, dedup_key="s")
    repl_running = enqueue("core.dedup.replace", {"v": 1}, dedup_key="r")
    assert len(claim()) == 2
    jobs = enqueue_many([
        {"job_type": "test.noop", "payload": {"v": 2}, "dedup_key": "s"},
        {"job_type": "core.dedup.replace", "payload": {"v": 2}, "dedup_key": "r"},
    ])
    assert jobs[0].id == skip_running.id  # Skip returns the running job
    assert jobs[1].id != repl_running.id  # Replace queues behind it
    assert PersistentJob.objects.get(id=jobs[1].id).status == "pending"
    assert PersistentJob.objects.get(id=repl_running.id).status == "running"
    assert PersistentJob.objects.count() == 3


# ------------------------------------------------------------------ concurrency

R = TypeVar("R")


def _run(fn: Callable[[], R]) -> Callable[[], R]:
    """Wrap a thread body so the thread's own Django connection is closed afterwards."""

    def body() -> R:
        try:
            return fn()
        finally:
            connections.close_all()

    return body


def _race(strategy: str, first_rolls_back: bool) -> tuple[Future[Any], Future[Any]]:
    """T1 enqueues and keeps its transaction open; T2 enqueues the same key and must block on
    the unique index until T1 commits or rolls back."""
    return race_for_key(
        lambda: enqueue("test.noop", {"who": 1}, dedup_key="race", dedup=strategy),
        lambda: enqueue("test.noop", {"who": 2}, dedup_key="race", dedup=strategy),
        hold_rolls_back=first_rolls_back)


@pytest.mark.django_db(transaction=True)
def test_concurrent_skip_enqueues_produce_one_job() -> None:
    f1, f2 = _race("skip", first_rolls_back=False)
    winner, loser = f1.result(), f2.result()
    assert loser.id == winner.id and loser.payload == {"who": 1}
    assert statuses() == [(winner.id, "pending", {"who": 1})]


@pytest.mark.django_db(transaction=True)
def test_concurrent_skip_enqueue_inserts_when_the_holder_rolls_back() -> None:
    f1, f2 = _race("skip", first_rolls_back=True)
    assert isinstance(f1.exception(), Rollback)
    job = f2.result()
    assert statuses() == [(job.id, "pending", {"who": 2})]


@pytest.mark.django_db(transaction=True)
def test_concurrent_replace_enqueues_leave_one_waiting_job_the_latest() -> None:
    f1, f2 = _race("replace", first_rolls_back=False)
    first, second = f1.result(), f2.result()
    assert first.id != second.id
    assert statuses(status="pending") == [(second.id, "pending", {"who": 2})]
    assert PersistentJob.objects.get(id=first.id).status == "cancelled"


@pytest.mark.django_db(transaction=True)
def test_replace_in_autocommit_is_all_or_nothing() -> None:
    """If inserting the replacement fails, the job it replaces must not stay cancelled."""
    old = enqueue("core.dedup.replace", {"v": 1}, dedup_key="k")
    with connection.cursor() as cursor:
        cursor.execute("""
            CREATE FUNCTION core_refuse_boom() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF NEW.payload ? 'boom' THEN RAISE EXCEPTION 'insert refused'; END IF;
                RETURN NEW;
            END $$;
            CREATE TRIGGER core_refuse_boom BEFORE INSERT ON persistent_jobs
            FOR EACH ROW EXECUTE FUNCTION core_refuse_boom();
        """)
    try:
        assert connection.get_autocommit()
        with pytest.raises(Exception, match="insert refused"):
            enqueue("core.dedup.replace", {"boom": True}, dedup_key="k")
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TRIGGER core_refuse_boom ON persistent_jobs; "
                           "DROP FUNCTION core_refuse_boom();")
    assert statuses() == [(old.id, "pending", {"v": 1})]


def _hammer(enqueue_one: Callable[[int, int], Any], threads: int,
            rounds: int) -> list[BaseException]:
    """Run ``enqueue_one(thread, round)`` from ``threads`` threads at once, ``rounds`` times
    each, every call in its own transaction that goes on to use the connection after enqueue
    (a doomed transaction would fail there); return what was raised."""
    start = threading.Barrier(threads)
    errors: list[BaseException] = []

    def worker(thread: int) -> None:
        try:
            start.wait(30)
            for i in range(rounds):
                with transaction.atomic():
                    enqueue_one(thread, i)
                    with connection.cursor() as cursor:
                        cursor.execute("SELECT 1")
        except BaseException as exc:
            errors.append(exc)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda t: _run(lambda: worker(t))(), range(threads)))
    return errors


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(180)
def test_contended_replace_enqueues_always_settle() -> None:
    """Twelve threads Replace one key fifteen times each: every enqueue succeeds (waiting its
    turn, never giving up), the callers' transactions stay usable, and exactly one job is left
    waiting: the others were replaced."""
    errors = _hammer(lambda t, i: enqueue("core.dedup.replace", {"t": t, "i": i},
                                          dedup_key="hot"), threads=12, rounds=15)
    assert errors == []
    assert PersistentJob.objects.count() == 12 * 15
    assert PersistentJob.objects.filter(status="pending").count() == 1
    assert PersistentJob.objects.filter(status="cancelled",
                                        last_error_code="REPLACED").count() == 12 * 15 - 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(180)
def test_contended_skip_and_replace_settle_while_jobs_finish() -> None:
    """Skip and Replace enqueues of one key race while another session keeps claiming and
    completing whatever holds the key, so holders come and go between every statement: every
    enqueue still settles, and never two jobs wait with the key."""
    stop = threading.Event()
    finished: list[int] = []

    def churn() -> None:
        done = 0
        while not stop.is_set():
            with transaction.atomic(), connection.cursor() as cursor:
                for job in claim_as(cursor, "core-churn", 5, None):
                    assert store.complete(cursor, job)
                    done += 1
        finished.append(done)

    with ThreadPoolExecutor(1) as pool:
        churner = pool.submit(_run(churn))
        try:
            errors = _hammer(
                lambda t, i: enqueue("test.noop", {"t": t, "i": i}, dedup_key="hot",
                                     dedup="replace" if t % 2 else "skip"),
                threads=8, rounds=15)
        finally:
            stop.set()
            churner.result(60)
    assert errors == []
    assert finished and finished[0] > 0  # the holders really did come and go
    assert PersistentJob.objects.filter(status__in=["pending", "failed"]).count() <= 1


@pytest.mark.django_db(transaction=True)
def test_uncontended_keyed_enqueues_take_no_locks() -> None:
    """Only a key that met a concurrent enqueue waits for its turn: a transaction that enqueues
    thousands of distinct keys must not fill PostgreSQL's shared lock table with advisory
    locks (it would break other sessions too)."""

    def advisory_locks() -> int:
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                           "AND pid = pg_backend_pid()")
            return int(cursor.fetchone()[0])

    with transaction.atomic():
        for i in range(300):
            enqueue("test.noop", {"i": i}, dedup_key=f"skip-{i}")
            enqueue("core.dedup.replace", {"i": i}, dedup_key=f"replace-{i}")
        enqueue_many([("test.noop", {"i": i}) for i in range(300)],
                     dedup_key=None)  # keyless, COPY
        enqueue_many([{"job_type": "test.noop", "dedup_key": f"skip-{i}"} for i in range(600)])
        enqueue_many([{"job_type": "core.dedup.replace", "dedup_key": f"many-{i}"}
                      for i in range(300)])
        assert advisory_locks() == 0
    assert PersistentJob.objects.filter(status="pending").count() == 300 + 300 + 300 + 300 + 300


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(180)
def test_contended_enqueue_many_batches_settle() -> None:
    """Batches sharing Replace and Skip keys, each naming them in its own order, race each
    other and single enqueues: every call settles, and each key ends with one waiting job."""
    keys = [f"k{i}" for i in range(4)]

    def batch(thread: int, i: int) -> None:
        order = keys[thread % 4:] + keys[:thread % 4]
        if thread % 3 == 0:
            enqueue("core.dedup.replace", {"t": thread}, dedup_key=order[0])
            return
        enqueue_many([{"job_type": "core.dedup.replace", "payload": {"t": thread, "i": i},
                       "dedup_key": key} for key in order]
                     + [{"job_type": "test.noop", "dedup_key": key} for key in reversed(order)])

    errors = _hammer(batch, threads=8, rounds=10)
    assert errors == []
    for key in keys:
        assert PersistentJob.objects.filter(job_type="core.dedup.replace", dedup_key=key,
                                            status="pending").count() == 1
        assert PersistentJob.objects.filter(job_type="test.noop", dedup_key=key,
                                            status="pending").count() == 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(180)
def test_contended_replace_in_autocommit_settles() -> None:
    """The same race without the callers' transactions: each Replace enqueue is then its own
    transaction, and still settles."""
    start = threading.Barrier(8)
    errors: list[BaseException] = []

    def worker(thread: int) -> None:
        try:
            start.wait(30)
            for i in range(15):
                assert connection.get_autocommit()
                enqueue("core.dedup.replace", {"t": thread, "i": i}, dedup_key="auto")
        except BaseException as exc:
            errors.append(exc)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda t: _run(lambda: worker(t))(), range(8)))
    assert errors == []
    assert PersistentJob.objects.filter(status="pending").count() == 1
    assert PersistentJob.objects.filter(last_error_code="REPLACED").count() == 8 * 15 - 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("many", [False, True])
def test_replace_keys_enqueued_in_opposite_orders_raise_a_deadlock_not_hang(many: bool) -> None:
    """Two transactions each enqueue Replace keys K1 and K2, in opposite orders: each holds the
    row of its first key while the other's second insert waits on it, and PostgreSQL breaks
    the cycle by failing one side's round. Retrying that round cannot succeed (its own
    transaction still holds the row the other waits for), so after a few deadlocks the
    enqueue raises it; that transaction rolls back and the other one commits. Before, both
    retried for ever, holding their locks."""
    from django.db import OperationalError

    barrier = threading.Barrier(2, timeout=20)
    outcomes: dict[str, str] = {}

    def one_side(name: str, keys: tuple[str, str]) -> None:
        try:
            with transaction.atomic():
                for n, key in enumerate(keys):
                    if many:
                        enqueue_many([("core.dedup.replace", {"side": name})], dedup_key=key)
                    else:
                        enqueue("core.dedup.replace", {"side": name}, dedup_key=key)
                    if n == 0:
                        barrier.wait()
            outcomes[name] = "committed"
        except OperationalError as exc:
            outcomes[name] = "deadlock" if "deadlock" in str(exc) else repr(exc)
        finally:
            connections.close_all()

    sides = [threading.Thread(target=one_side, args=("a", ("K1", "K2")), daemon=True),
             threading.Thread(target=one_side, args=("b", ("K2", "K1")), daemon=True)]
    for side in sides:
        side.start()
    for side in sides:
        side.join(60)
    assert not any(side.is_alive() for side in sides), "the enqueues hung"
    assert sorted(outcomes.values()) == ["committed", "deadlock"], outcomes
    winner = next(name for name, outcome in outcomes.items() if outcome == "committed")
    rows = PersistentJob.objects.filter(job_type="core.dedup.replace", status="pending")
    assert sorted((job.dedup_key, job.payload["side"]) for job in rows) == [
        ("K1", winner), ("K2", winner)]
