"""The fast path's log of starts not yet written (``starts.StartLog``): the claim loop takes all
of them for its next claim, a job handed to the completer takes its own, and whatever a
writer could not write is noted again and due at once. Pure bookkeeping, no database; the
statements that write them are exercised in ``test_store_waiting.py`` and ``test_completer.py``."""

from __future__ import annotations

import time

import pytest

from django_persistent_jobs.runner.starts import FLUSH_AFTER, StartLog


def test_a_job_handed_to_the_completer_takes_only_its_own_start() -> None:
    log = StartLog()
    for token in (1, 2, 3):
        log.note(token)
    assert log.take(3) is not None and log.take(1) is not None
    assert log.take(99) is None  # its start was written already, or it never waited
    with log.taken() as (tokens, times):
        assert tokens == [2] and len(times) == 1  # the claim writes the rest
    assert log.take(2) is None
    log.carried_done([1, 3])


def test_nothing_noted_means_nothing_due() -> None:
    log = StartLog()
    assert log.due_in(5.0) == 5.0 and not log.overdue
    log.note(7)
    assert 0 < log.due_in(5.0) <= FLUSH_AFTER
    log.take(7)
    log.carried_done([7])
    assert log.due_in(5.0) == 5.0 and not log.overdue  # its completion wrote it


def test_starts_a_writer_could_not_write_are_due_at_once() -> None:
    log = StartLog()
    log.note(1)
    began = log.take(1)
    assert began is not None
    log.restore({1: began})
    assert log.overdue and log.due_in(5.0) == 0.0
    with log.taken() as (tokens, times):
        assert tokens == [1] and times == [began]  # the time it started, not the restore's


def test_a_claim_that_fails_notes_its_starts_again() -> None:
    log = StartLog()
    log.note(1)
    with pytest.raises(RuntimeError), log.taken() as (tokens, _):
        assert tokens == [1]
        raise RuntimeError("the claim failed")
    log.note(2)
    with log.taken() as (tokens, _):
        assert tokens == [1, 2]


def test_a_start_whose_completion_batch_is_late_is_written_by_the_claim_too() -> None:
    """A start a batch carries leaves the claim's share at once, but stays due: if the batch
    has not been written when the start falls due, the claim loop writes it as well."""
    log = StartLog()
    log.note(1)
    log.note(2)
    assert log.take(1) is not None
    with log.taken() as (tokens, _):
        assert tokens == [2]  # 1 is carried by its batch, not due yet
    assert 0 < log.due_in(5.0) <= FLUSH_AFTER  # ... but still counts as unwritten
    log.carried_done([1])
    assert log.due_in(5.0) == 5.0 and not log.overdue


def test_a_carried_start_falls_due_like_any_other(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])  # the clock starts.py reads
    log = StartLog()
    log.note(1)
    began = log.take(1)
    now[0] += FLUSH_AFTER
    assert log.overdue and log.due_in(5.0) == 0.0
    with log.taken() as (tokens, times):
        assert tokens == [1] and times == [began]  # the claim writes it too
    log.carried_done([1])  # the batch, written after all: nothing left
    assert not log.overdue


def test_a_job_finishing_while_a_claim_writes_its_start_gives_its_batch_the_time() -> None:
    """The claim took the start and has not written it yet; the job's batch may commit first,
    and must not fall back to the claim's time (both writes then agree)."""
    log = StartLog()
    log.note(1)
    with log.taken() as (tokens, times):
        assert tokens == [1]
        assert log.take(1) == times[0]
    assert log.take(1) is None  # written by the claim: nothing more to carry
    assert not log.overdue


def test_the_claim_loops_last_write_takes_every_carried_start() -> None:
    """At shutdown nobody writes after the claim loop's last write: a batch that may yet fail
    must not be left holding the only record of a start."""
    log = StartLog()
    log.note(1)
    log.note(2)
    log.take(1)
    with log.taken() as (tokens, _):
        assert tokens == [2]  # 1 is carried and not due
    log.note(3)
    with log.taken(everything=True) as (tokens, _):
        assert sorted(tokens) == [1, 3]


def test_a_start_its_settling_statement_carries_waits_for_its_due_time() -> None:
    """A worker process's lane settles its job with the start (``note(carried=True)``): the
    next claim leaves it out until it is due, and the job's ``DONE`` clears it."""
    log = StartLog()
    log.note(1, carried=True)
    log.note(2)
    with log.taken() as (tokens, _):
        assert tokens == [2]
    assert 0 < log.due_in(5.0) <= FLUSH_AFTER  # still unwritten, so still due in time
    log.carried_done([1])
    assert log.due_in(5.0) == 5.0 and not log.overdue


def test_a_carried_start_whose_settling_failed_is_due_at_once_and_stays() -> None:
    """The worker said its job's settling failed (``CRASHED``): the start may not be on record,
    so it is due now, and the ``DONE`` that follows does not clear it."""
    log = StartLog()
    began = log.note(1, carried=True)
    log.restore({1: began})
    log.carried_done([1])
    assert log.overdue
    with log.taken() as (tokens, times):
        assert tokens == [1] and times == [began]
