"""The admin with ``PERSISTENT_JOBS["DATABASE"]`` naming another alias than ``default``.

The jobs live in the "jobs" alias (tests/settings.py); users, permissions and the admin's
history (``LogEntry``) stay in ``default``. No router sends the app's models anywhere, as in a
project that only sets the setting: every page must read the jobs alias itself. Both test
databases carry the tables (Django migrates every alias), so a page reading ``default`` shows
an empty list rather than failing, which is what an operator saw.
"""

from __future__ import annotations

import html
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse

from django_persistent_jobs import enqueue, job_handler
from django_persistent_jobs.models import JobAttempt, JobRunnerRecord, JobSchedule, PersistentJob
from django_persistent_jobs.schedules import services as schedules
from tests.admin.pages import (
    ACTION,
    ATTEMPT,
    ATTEMPTS,
    DASHBOARD,
    GROUP,
    JOB,
    JOBS,
    RUNNER,
    RUNNERS,
    SCHEDULE,
    SCHEDULE_ADD,
    SCHEDULES,
)
from tests.core_support import pj_settings

ALIAS = "jobs"

pytestmark = pytest.mark.django_db(databases={"default", ALIAS})


@job_handler("otherdb.report")
def report(payload: Any) -> None:
    return None


@pytest.fixture(autouse=True)
def _jobs_alias() -> Iterator[None]:
    with pj_settings(DATABASE=ALIAS):
        yield


def jobs() -> Any:
    return PersistentJob.objects.using(ALIAS)


def dead(tenant: str, code: str = "BOOM") -> PersistentJob:
    """A dead letter enqueued through the public API (into the jobs alias), with one attempt."""
    created = enqueue("otherdb.report", {"api_token": "t0k", "n": 1}, tenant=tenant)
    jobs().filter(pk=created.pk).update(status="dead_lettered", attempts=1,
                                        last_error_code=code, last_error=f"{code} happened")
    found = jobs().get(pk=created.pk)
    jobs().filter(pk=created.pk).update(finished_at=found.updated_at)
    JobAttempt.objects.using(ALIAS).create(
        job=found, attempt=1, runner_id="host:1:r", outcome="dead_lettered", error_code=code,
        error_message=f"{code} happened in attempt one", started_at=found.created_at,
        finished_at=found.created_at, duration=timedelta(seconds=1))
    return jobs().get(pk=found.pk)


@pytest.fixture
def client() -> Client:
    client = Client()
    client.force_login(User.objects.create_superuser("root", password=None))
    return client


def get(client: Client, url: str) -> Any:
    response = client.get(url)
    assert response.status_code == 200, (url, response.status_code)
    return response


def test_the_jobs_are_in_the_jobs_alias_only() -> None:
    """The setup this module relies on: enqueue wrote to "jobs", and "default" has no job."""
    job = dead("acme")
    assert jobs().filter(pk=job.pk).exists()
    assert not PersistentJob.objects.using("default").exists()


def test_the_job_list_filters_page_and_actions_read_the_jobs_alias(client: Client) -> None:
    job = dead("acme")
    other = dead("globex", "OTHER")
    listed = get(client, reverse(JOBS)).context["cl"]
    assert {j.pk for j in listed.result_list} == {job.pk, other.pk}
    assert listed.result_count == 2
    sidebar = get(client, reverse(JOBS)).content.decode()
    for choice in ("?tenant=acme", "?last_error_code=BOOM", "?job_type=otherdb.report"):
        assert choice in html.unescape(sidebar), choice  # the sidebar's choices come from there
    narrowed = get(client, reverse(JOBS) + "?tenant=acme").context["cl"].result_list
    assert [j.pk for j in narrowed] == [job.pk]
    found = get(client, reverse(JOBS) + f"?q={str(job.pk)[-8:]}").context["cl"].result_list
    assert [j.pk for j in found] == [job.pk]

    body = html.unescape(get(client, reverse(JOB, args=[job.pk])).content.decode())
    assert "BOOM happened in attempt one" in body  # the attempts on the job page
    assert '"api_token": "***"' in body and "t0k" not in body
    assert get(client, reverse("admin:django_persistent_jobs_persistentjob_history",
                               args=[job.pk])).status_code == 200

    done = client.post(reverse(ACTION, args=[job.pk, "retry_now"]), follow=True)
    assert [str(m) for m in done.context["messages"]] == ["Retry now: now pending."]
    assert jobs().get(pk=job.pk).status == "pending"
    bulk = client.post(reverse(JOBS), {"action": "cancel", "index": "0", "select_across": "0",
                                       "_selected_action": [str(job.pk)]}, follow=True)
    assert [str(m) for m in bulk.context["messages"]] == ["Cancelled (or asked to stop) 1 job(s)."]
    assert jobs().get(pk=job.pk).status == "cancelled"
    # The history (LogEntry) stays in default, where the admin keeps it.
    assert LogEntry.objects.using("default").filter(object_id=str(job.pk)).count() == 2


def test_the_dashboard_and_the_failure_group_retry_read_the_jobs_alias(client: Client) -> None:
    group = [dead("acme") for _ in range(2)]
    dead("globex")
    body = get(client, reverse(DASHBOARD)).content.decode()
    assert "BOOM" in body and "otherdb.report" in body
    assert get(client, reverse(DASHBOARD)).context["known_tenants"] == ["acme", "globex"]
    query = "?job_type=otherdb.report&error_code=BOOM&tenant=acme"
    confirm = get(client, reverse(GROUP) + query).context
    assert confirm["count"] == 2
    client.post(reverse(GROUP), {"job_type": "otherdb.report", "error_code": "BOOM",
                                 "tenant": "acme", "confirm": "yes",
                                 "shown_at": confirm["shown_at"]})
    assert [jobs().get(pk=j.pk).status for j in group] == ["pending", "pending"]


def test_attempts_read_the_jobs_alias(client: Client) -> None:
    job = dead("acme")
    attempt = JobAttempt.objects.using(ALIAS).get(job=job)
    listed = get(client, reverse(ATTEMPTS)).context["cl"].result_list
    assert [a.pk for a in listed] == [attempt.pk]
    sidebar = html.unescape(get(client, reverse(ATTEMPTS)).content.decode())
    for choice in ("?job_type=otherdb.report", "?tenant=acme", "?error_code=BOOM"):
        assert choice in sidebar, choice
    assert [a.pk for a in get(client, reverse(ATTEMPTS) + "?job_type=otherdb.report&tenant=acme")
            .context["cl"].result_list] == [attempt.pk]
    page = get(client, reverse(ATTEMPT, args=[attempt.pk])).content.decode()
    assert "BOOM happened in attempt one" in page


def test_runners_read_the_jobs_alias(client: Client) -> None:
    job = dead("acme")
    runner = JobRunnerRecord.objects.using(ALIAS).create(
        id="box:7:aa", hostname="box", pid=7, concurrency=2, heartbeat_at=job.updated_at)
    jobs().filter(pk=job.pk).update(status="running", locked_by=runner.id,
                                    locked_at=job.updated_at)
    listed = get(client, reverse(RUNNERS))
    assert [r.pk for r in listed.context["cl"].result_list] == [runner.id]
    row = listed.content.decode().split(">box:7:aa<")[1].split("</tr>")[0]
    assert "locked_by=box%3A7%3Aaa" in row and ">1</a>" in row  # jobs held
    assert "box" in get(client, reverse(RUNNER, args=[runner.id])).content.decode()


def test_schedules_read_the_jobs_alias(client: Client) -> None:
    schedules.add_schedule("nightly", "otherdb.report", interval=3600)
    run = schedules.run_schedule_now("nightly")
    schedule = JobSchedule.objects.using(ALIAS).get(name="nightly")
    assert not JobSchedule.objects.using("default").exists()
    listed = get(client, reverse(SCHEDULES))
    assert [s.pk for s in listed.context["cl"].result_list] == [schedule.pk]
    assert "pending</a>" in listed.content.decode()  # the last run's status, from the jobs alias
    assert "nightly" in get(client, reverse(SCHEDULE, args=[schedule.pk])).content.decode()
    job_page = get(client, reverse(JOB, args=[run.pk])).content.decode()
    assert reverse(SCHEDULE, args=[schedule.pk]) in job_page  # "enqueued by this schedule"
    now = client.post(reverse(SCHEDULES), {"action": "run_now", "index": "0",
                                           "select_across": "0",
                                           "_selected_action": [str(schedule.pk)]}, follow=True)
    # The handler's dedup (Skip) keeps the first run: the message reads the schedule's result.
    assert [str(m) for m in now.context["messages"]] == [
        f"nightly: skipped, run {run.pk} is still pending (the handler's dedup is Skip)."]
    taken = client.post(reverse(SCHEDULE_ADD), {
        "name": "nightly", "job_type": "otherdb.report", "interval_seconds": "60",
        "timezone": "UTC", "payload": "{}", "priority": "0", "queue": "default"})
    assert taken.status_code == 200  # the form again, with the error; not a 500
    assert "already exists" in taken.content.decode()
    assert JobSchedule.objects.using(ALIAS).count() == 1
    delete = reverse("admin:django_persistent_jobs_jobschedule_delete", args=[schedule.pk])
    assert get(client, delete).status_code == 200
    assert client.post(delete, {"post": "yes"}).status_code == 302
    assert not JobSchedule.objects.using(ALIAS).exists()
