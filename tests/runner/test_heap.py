"""``runner.heap``: while a process only runs jobs, the objects of its start-up are frozen out of
the garbage collector's sight and young collections are rarer; afterwards the collector is as it
was (``runjobs`` run through ``call_command`` returns to its caller's process). And the runner's
own per-job objects never need the collector: they form no reference cycles."""

from __future__ import annotations

import gc
from collections.abc import Callable

import pytest
from django.core.management import call_command

from django_persistent_jobs import enqueue, enqueue_many
from django_persistent_jobs.models import JobStatus, PersistentJob
from django_persistent_jobs.runner import Runner, heap
from django_persistent_jobs.runner.execute import InFlight
from django_persistent_jobs.runner.store import ClaimedJob
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


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(120)
def test_a_drained_job_leaves_no_reference_cycle_behind(
        start_runner: Callable[..., Runner]) -> None:
    """Every job's objects are freed by reference counting as soon as it is done: none is left
    for the cyclic collector (a callback stored on the job that referred back to it made each
    job a cycle, and the collections of a drain of short jobs a tenth of its time). With the
    collector off during the drain, a collection afterwards finds no job among the garbage."""
    enqueue_many([("test.noop", {"i": i}) for i in range(200)])
    collector_was_on = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        runner = start_runner(concurrency=4, burst=True)
        assert runner.finished.wait(60), "the burst did not finish"
        assert not PersistentJob.objects.exclude(status=JobStatus.COMPLETED).exists()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        stranded = [obj for obj in gc.garbage if isinstance(obj, (InFlight, ClaimedJob))]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if collector_was_on:
            gc.enable()
    assert stranded == []
