"""Ends reported by another runner, redaction of reported progress, and what runjobs' metrics
port exports after switching an already imported prometheus_client, against real PostgreSQL.
(From a review of the metrics and admin changes; each failed on the code it reviewed.)"""

from __future__ import annotations

import html
import threading
from typing import Any

import pytest
from django.db import connection
from django.urls import reverse

from django_persistent_jobs import enqueue, job_handler
from django_persistent_jobs.models import JobStatus, PersistentJob
from tests.core_support import claim_as, staff_client


@job_handler("mends.noop")
def mends_noop(payload: Any) -> None:
    return None


# ---------------------------------------------------------------- a charged unstarted hand-back

@pytest.mark.django_db(transaction=True)
def test_task_dead_lettered_by_a_rescuers_charged_hand_back_still_sends_task_finished() -> None:
    """A task that waited in a runner that vanished, handed back by a rescuer past
    ``HANDBACK_LIMIT`` (charged, dead-lettered), never ran: its own code reported nothing, so
    the backend's relay must send ``task_finished`` (the rescue reports ``interrupted``)."""
    from django_persistent_jobs.backends.compat import TaskResultStatus, task_finished
    from django_persistent_jobs.runner import heartbeat, store
    from tests.testapp import tasks

    heard: list[Any] = []
    got = threading.Event()

    def receiver(sender: Any, task_result: Any, **kwargs: Any) -> None:
        heard.append((task_result.id, task_result.status))
        got.set()

    result = tasks.fails_for_good.enqueue()  # max_retries=0
    PersistentJob.objects.filter(pk=result.id).update(handbacks=3)  # HANDBACK_LIMIT reached
    with connection.cursor() as cursor:  # waiting in a runner that then vanished
        [claimed] = claim_as(cursor, "ghost-r2", 1, None, direct=0, ghost=True)
        assert claimed.waiting
        [held] = store.orphaned_jobs(cursor)
    assert not held.started
    task_finished.connect(receiver)
    try:
        assert heartbeat._rescue_job("default", "rescuer-r2", held, "lost")
        job = PersistentJob.objects.get(pk=result.id)
        assert job.status == JobStatus.DEAD_LETTERED and job.last_error_code == "INTERRUPTED"
        got.wait(5)
    finally:
        task_finished.disconnect(receiver)
    assert heard == [(str(result.id), TaskResultStatus.FAILED)]


# ---------------------------------------------------------------- redaction

@pytest.mark.django_db
def test_progress_caption_does_not_bypass_redaction() -> None:
    """The job page's progress caption comes from the redacted progress: a dict under
    ``message``/``stage`` must not show its secret keys' values in clear."""
    created = enqueue("mends.noop", {})
    PersistentJob.objects.filter(pk=created.pk).update(
        status="running", locked_by="r", progress={"message": {"api_token": "l3aked-t0k"}})
    viewer = staff_client("viewer", "view_persistentjob")
    body = html.unescape(viewer.get(reverse("admin:django_persistent_jobs_persistentjob_change",
                                            args=[created.pk])).content.decode())
    assert "l3aked-t0k" not in body


# ---------------------------------------------------------------- the metrics port after a switch

_SPLIT_SCRIPT = r"""
import os, sys
os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
import prometheus_client  # an app imports it first (django-prometheus)
app = prometheus_client.Counter("pj_r2_app_requests", "An app's labelled metric.", ["path"])
app.labels("/before").inc()           # a child made before runjobs' switch
import django
django.setup()
from django_persistent_jobs import metrics
assert metrics.use_multiprocess_dir()
app.labels("/after").inc()            # a child of the same metric made after it
metrics.enable()
metrics.events().children("r2.job", "default")[0].inc()   # one of ours, counted after it
from prometheus_client import generate_latest
sys.stdout.write(generate_latest(metrics.registry()).decode())  # what runjobs' port exports
"""


def test_a_metric_made_before_the_multiprocess_switch_is_not_half_exported() -> None:
    """A labelled metric another app made before runjobs switched prometheus_client to its
    directory gets its later children there (``values.ValueClass`` is read per child):
    runjobs' port must not export such a metric in part, and still exports ours."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings",
           "PYTHONPATH": os.getcwd()}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    done = subprocess.run([sys.executable, "-c", _SPLIT_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    exported = {line.split("{")[1].split("}")[0] for line in done.stdout.splitlines()
                if line.startswith("pj_r2_app_requests_total{")}
    # Either the metric is not exported on this port at all (as documented), or whole.
    assert exported in (set(), {'path="/before"', 'path="/after"'}), exported
    assert 'persistent_jobs_started_total{job_type="r2.job",queue="default"} 1.0' in (
        done.stdout), done.stdout[-2000:]
