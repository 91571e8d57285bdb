"""How many slots one completer's completions still being written take back
(``executor.held_back``).

The rule both executors claim by: one completion per slot rides free (a handler that returned
is not running), and so do a few whole batches (one being written while the next fills, and
outgrows a batch when a write is slow; a worker process's ``DONE`` comes after its batch's
commit). Beyond that, every completion not
landed is a slot less, so a runner whose completions stop landing stops claiming. The thread
runner has one completer; a worker process's supervisor applies the rule to each worker.
"""

from __future__ import annotations

import pytest

from django_persistent_jobs.runner.completer import MAX_BATCH
from django_persistent_jobs.runner.executor import COMPLETING_ALLOWANCE, held_back

ALLOWANCE = COMPLETING_ALLOWANCE


def test_the_allowance_is_whole_batches_more_than_one() -> None:
    assert ALLOWANCE % MAX_BATCH == 0 and ALLOWANCE >= 2 * MAX_BATCH


@pytest.mark.parametrize(("completing", "slots", "expected"), [
    (0, 10, 0), (10, 10, 0), (10 + ALLOWANCE, 10, 0), (11 + ALLOWANCE, 10, 1),
    (60 + ALLOWANCE, 10, 50),
])
def test_one_completion_per_slot_and_the_allowance_ride_free(
        completing: int, slots: int, expected: int) -> None:
    assert held_back(completing, slots) == expected


def test_a_worker_process_may_have_the_allowance_being_written() -> None:
    lanes = 4
    assert held_back(lanes + ALLOWANCE, lanes) == 0
    assert held_back(lanes + ALLOWANCE + 1, lanes) == 1


def test_completions_that_stop_landing_end_up_taking_every_slot_back() -> None:
    # A stuck batch writer: completions pile up, and once they pass the allowance each one is
    # a slot less, without bound, so the claim loop stops.
    lanes, waiting_room = 4, 512
    stuck = lanes + ALLOWANCE + lanes + waiting_room
    assert held_back(stuck, lanes) >= lanes + waiting_room
