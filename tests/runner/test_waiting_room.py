"""The adaptive ``PREFETCH`` (``claimer.WaitingRoom``): how many claimed jobs may wait for a
worker follows the pace at which workers finish jobs. Pure arithmetic on an executor's two
counters, with the clock passed in; the claim loop that uses it is exercised end to end in
``test_supervisor.py`` (long jobs: no job waits) and by the drains of ``bench/``."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from django_persistent_jobs.runner import Runner
from django_persistent_jobs.runner.claimer import (
    ADAPTIVE_PREFETCH_FACTOR,
    ADAPTIVE_PREFETCH_FLOOR,
    LOOKAHEAD_SECONDS,
    RAMP_MIN_SECONDS,
    WaitingRoom,
)
from tests.core_support import pj_settings


@dataclass
class Counters:
    waiting_room: int
    finished: int = 0


def test_nothing_waits_until_workers_finish_jobs() -> None:
    executor = Counters(waiting_room=40)
    room = WaitingRoom(executor)
    assert executor.waiting_room == 0  # a runner that finished nothing claims for idle workers
    room.adjust(now=100.0)
    assert executor.waiting_room == 0


def test_waiting_follows_the_jobs_finished_within_the_lookahead_up_to_the_cap() -> None:
    executor = Counters(waiting_room=40)
    room = WaitingRoom(executor)
    room.adjust(now=100.0)
    executor.finished = 7
    room.adjust(now=100.0 + LOOKAHEAD_SECONDS / 2)
    assert executor.waiting_room == 14  # half a lookahead of history: the pace, scaled
    executor.finished = 500  # tiny jobs: thousands a second
    room.adjust(now=100.0 + LOOKAHEAD_SECONDS)
    assert executor.waiting_room == 40  # capped
    # Long jobs from here on: one finished in the last lookahead, so one may wait.
    executor.finished = 501
    room.adjust(now=100.0 + 3 * LOOKAHEAD_SECONDS)
    assert executor.waiting_room == 1
    room.adjust(now=100.0 + 5 * LOOKAHEAD_SECONDS)
    assert executor.waiting_room == 0


def test_a_runner_that_just_started_waits_for_no_full_lookahead_to_claim_in_batches() -> None:
    """A drain's first claims: 40 jobs finished 10 ms after the start say the pace, scaled to a
    whole lookahead from no less than ``RAMP_MIN_SECONDS`` of history (so a few jobs finished
    in the first millisecond do not claim the whole cap)."""
    executor = Counters(waiting_room=1000)
    room = WaitingRoom(executor)
    room.adjust(now=100.0)
    executor.finished = 40
    room.adjust(now=100.0 + RAMP_MIN_SECONDS / 2)
    assert executor.waiting_room == 200  # 40 in (at least) 20 ms
    executor.finished = 140
    room.adjust(now=100.0 + LOOKAHEAD_SECONDS / 4)
    assert executor.waiting_room == 560  # 140 in a quarter of a lookahead
    executor.finished = 141
    room.adjust(now=100.0 + 2 * LOOKAHEAD_SECONDS)
    assert executor.waiting_room == 1  # a whole lookahead of history: counted, not scaled


@pytest.mark.django_db
def test_the_adaptive_cap_is_16_per_slot_or_the_floor_whichever_is_more() -> None:
    """A runner at a small concurrency still claims tiny jobs in batches of hundreds (the cap
    the claim loop's waiting room works under; the pace decides how much of it is used)."""
    assert Runner(concurrency=2).pool.waiting_room == ADAPTIVE_PREFETCH_FLOOR
    assert Runner(concurrency=64).pool.waiting_room == ADAPTIVE_PREFETCH_FACTOR * 64
    with pj_settings(PREFETCH=7):
        assert Runner(concurrency=2).pool.waiting_room == 7  # a number: that many
