"""How many slots completions still being written take back (``executor.held_back``).

The rule both executors claim by: one completion per slot rides free (a handler that returned
is not running), and so does one whole batch per completion writer (the one being written while
the next fills; a worker process's ``DONE`` comes after its batch's commit). Beyond that, every
completion not landed is a slot less, so a runner whose completions stop landing stops
claiming.
"""

from __future__ import annotations

import pytest

from django_persistent_jobs.runner.completer import MAX_BATCH
from django_persistent_jobs.runner.executor import held_back


@pytest.mark.parametrize(("completing", "slots", "expected"), [
    (0, 10, 0), (10, 10, 0), (11, 10, 1), (60, 10, 50),
])
def test_without_a_batch_allowance_one_completion_per_slot(
        completing: int, slots: int, expected: int) -> None:
    assert held_back(completing, slots) == expected


def test_each_worker_process_may_have_a_batch_being_written() -> None:
    lanes = 4
    assert held_back(lanes + MAX_BATCH, lanes, batches=1) == 0
    assert held_back(lanes + MAX_BATCH + 1, lanes, batches=1) == 1
    assert held_back(2 * (lanes + MAX_BATCH), 2 * lanes, batches=2) == 0


def test_completions_that_stop_landing_end_up_taking_every_slot_back() -> None:
    # A stuck batch writer: completions pile up, and once they pass the allowance each one is
    # a slot less, without bound, so the claim loop stops.
    lanes, waiting_room = 4, 512
    stuck = lanes + MAX_BATCH + lanes + waiting_room
    assert held_back(stuck, lanes, batches=1) >= lanes + waiting_room
