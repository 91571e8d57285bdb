"""The adaptive ``PREFETCH`` (``claimer.WaitingRoom``): how many claimed jobs may wait for a
worker follows the pace at which workers finish jobs. Pure arithmetic on an executor's two
counters, with the clock passed in; the claim loop that uses it is exercised end to end in
``test_supervisor.py`` (long jobs: no job waits) and by the drains of ``bench/``."""

from __future__ import annotations

from dataclasses import dataclass

from django_persistent_jobs.runner.claimer import LOOKAHEAD_SECONDS, WaitingRoom


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
    assert executor.waiting_room == 7
    executor.finished = 500  # tiny jobs: thousands a second
    room.adjust(now=100.0 + LOOKAHEAD_SECONDS)
    assert executor.waiting_room == 40  # capped
    # Long jobs from here on: one finished in the last lookahead, so one may wait.
    executor.finished = 501
    room.adjust(now=100.0 + 3 * LOOKAHEAD_SECONDS)
    assert executor.waiting_room == 1
    room.adjust(now=100.0 + 5 * LOOKAHEAD_SECONDS)
    assert executor.waiting_room == 0
