"""``runner.heap``: while a process only runs jobs, the objects of its start-up are frozen out of
the garbage collector's sight and young collections are rarer; afterwards the collector is as it
was (``runjobs`` run through ``call_command`` returns to its caller's process)."""

from __future__ import annotations

import gc

import pytest
from django.core.management import call_command

from django_persistent_jobs import enqueue
from django_persistent_jobs.models import JobStatus
from django_persistent_jobs.runner import heap
from tests.runner_support import get_job


def test_settled_freezes_start_up_objects_and_gives_the_collector_back() -> None:
    thresholds = gc.get_threshold()
    frozen = gc.get_freeze_count()
    with heap.settled():
        assert gc.get_threshold() == (heap.YOUNG_THRESHOLD, *thresholds[1:])
        assert gc.get_freeze_count() > frozen  # the modules, classes and functions loaded so far
    assert gc.get_threshold() == thresholds
    assert gc.get_freeze_count() == 0


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(120)
def test_runjobs_called_in_process_leaves_the_callers_collector_as_it_was() -> None:
    job = enqueue("test.noop", {})
    thresholds = gc.get_threshold()
    call_command("runjobs", "--burst", "-v", "0")
    assert get_job(job.id).status == JobStatus.COMPLETED
    assert gc.get_threshold() == thresholds
    assert gc.get_freeze_count() == 0
