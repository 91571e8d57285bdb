"""What the list pages accept in their query string: only the filters the console itself writes.

Django's admin accepts any lookup on a model's own fields, JSON key lookups included. On these
pages that let a view-only operator read a redacted payload value back prefix by prefix
(``?payload__api_token__startswith=s3``), and let hand-written lookups reach PostgreSQL with
values it refuses (a 500). Each page now names the parameters it writes; anything else is a bad
request, and a time outside what a UTC timestamp can hold is a bad filter (``?e=1``).
"""

from __future__ import annotations

import html
import re
from datetime import timedelta
from typing import Any
from urllib.parse import quote

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse

import tests.testapp.recurring_jobs  # noqa: F401  (registers test.recurring.*)
from django_persistent_jobs import enqueue, job_handler
from django_persistent_jobs.models import JobAttempt, PersistentJob
from django_persistent_jobs.schedules.services import add_schedule
from tests.admin.pages import ATTEMPTS, DASHBOARD, JOBS, RUNNERS, SCHEDULES
from tests.core_support import db_now, staff_client


@job_handler("params.a")
def params_a(payload: Any) -> None:
    return None


def dead(tenant: str = "acme", payload: Any = None) -> PersistentJob:
    now = db_now()
    job = enqueue("params.a", payload or {}, tenant=tenant)
    PersistentJob.objects.filter(pk=job.pk).update(status="dead_lettered", attempts=1,
                                                   last_error_code="BOOM", finished_at=now)
    JobAttempt.objects.create(job_id=job.pk, attempt=1, runner_id="h:1:r",
                              outcome="dead_lettered", error_code="BOOM", error_message="x",
                              started_at=now, finished_at=now, duration=timedelta(seconds=1))
    return PersistentJob.objects.get(pk=job.pk)


def viewer() -> Client:
    client: Client = staff_client("viewer", "view_persistentjob", "view_jobschedule")
    return client


@pytest.mark.django_db
@pytest.mark.parametrize("query", [
    "payload__api_token__startswith=s3",
    "result__api_token__startswith=s3",
    "progress__api_token__startswith=s3",
    "payload__contains=%7B",
    "job_type__regex=%5B",
    "last_error__regex=%28",
    "locked_at__year=99999",
    "id__startswith=zz",
    "priority__gt=99999999",
    "attempts=99999999999999999999",
])
def test_a_job_list_lookup_the_console_does_not_write_is_a_bad_request(query: str) -> None:
    dead(payload={"api_token": "s3cr3t"})
    assert viewer().get(reverse(JOBS) + "?" + query).status_code == 400


@pytest.mark.django_db
def test_a_redacted_payload_value_cannot_be_guessed_through_the_list() -> None:
    dead(payload={"api_token": "s3cr3t-value"})
    client = viewer()
    hit = client.get(reverse(JOBS) + "?payload__api_token__startswith=s3cr")
    miss = client.get(reverse(JOBS) + "?payload__api_token__startswith=zzzz")
    assert hit.status_code == miss.status_code == 400
    assert hit.content == miss.content


@pytest.mark.django_db
@pytest.mark.parametrize("query", [
    "error_message__regex=%28",
    "started_at__year=0",
    "duration__gt=abc",
    "traceback__contains=boom",
    "job__payload__api_token__startswith=s3",
])
def test_an_attempt_list_lookup_the_console_does_not_write_is_a_bad_request(query: str) -> None:
    dead()
    assert viewer().get(reverse(ATTEMPTS) + "?" + query).status_code == 400


@pytest.mark.django_db
@pytest.mark.parametrize("query", ["payload__password__startswith=hun", "cron__regex=%28"])
def test_a_schedule_list_lookup_the_console_does_not_write_is_a_bad_request(query: str) -> None:
    add_schedule("nightly", "test.recurring.tick", interval=60, payload={"password": "hunter2"})
    assert viewer().get(reverse(SCHEDULES) + "?" + query).status_code == 400


@pytest.mark.django_db
def test_a_runner_list_takes_no_lookup() -> None:
    assert viewer().get(reverse(RUNNERS) + "?hostname__regex=%28").status_code == 400


@pytest.mark.django_db
@pytest.mark.parametrize(("name", "query"), [
    (JOBS, "failed_since=0001-01-01T00:00:00%2B05:00"),
    (JOBS, "failed_until=9999-12-31T23:59:59-05:00"),
    (JOBS, "failed_since=2024-13-45T00:00:00"),
    (ATTEMPTS, "started_at__gte=0001-01-01T00:00:00%2B05:00"),
    (ATTEMPTS, "started_at__lt=9999-12-31T23:59:59-05:00"),
    (ATTEMPTS, "finished_at__lte=9999-12-31T23:59:59-05:00"),
    (ATTEMPTS, "finished_at__gte=2024-13-45"),
])
def test_a_time_outside_what_utc_can_hold_is_a_bad_filter_not_a_500(name: str,
                                                                    query: str) -> None:
    dead()
    response = viewer().get(reverse(name) + "?" + query)
    assert response.status_code == 302 and response["Location"].endswith("?e=1")


@pytest.mark.django_db
def test_the_filters_the_console_writes_still_work() -> None:
    """Every parameter the sidebar, the dashboard, the job page and the runner page write."""
    job = dead()
    now = db_now()
    since, until = (quote((now - timedelta(hours=1)).isoformat()),
                    quote((now + timedelta(hours=1)).isoformat()))
    client = viewer()
    for query in ("status__exact=dead_lettered", "job_type=params.a",
                  "job_type__exact=params.a", "queue=default", "queue__exact=default",
                  "tenant=acme", "tenant__exact=acme", "last_error_code=BOOM",
                  "last_error_code__exact=BOOM",
                  f"failed_with=BOOM&failed_since={since}&failed_until={until}",
                  "q=params", "o=1", "p=1"):
        response = client.get(reverse(JOBS) + "?" + query)
        assert response.status_code == 200, query
        assert job in response.context["cl"].result_list, query
    for query in ("tenant__isnull=True", "locked_by=nobody&status__exact=running"):
        response = client.get(reverse(JOBS) + "?" + query)
        assert response.status_code == 200, query
        assert job not in response.context["cl"].result_list, query
    for query in ("outcome__exact=dead_lettered", "error_code=BOOM", "error_code__exact=BOOM",
                  "job_type=params.a", "tenant=acme", "runner_id__exact=h:1:r",
                  "outcome__in=failed,dead_lettered",
                  f"finished_at__gte={since}&finished_at__lte={until}",
                  f"started_at__gte={since}&started_at__lt={until}", "q=x"):
        response = client.get(reverse(ATTEMPTS) + "?" + query)
        assert response.status_code == 200, query
        assert [a.job_id for a in response.context["cl"].result_list] == [job.pk], query
    add_schedule("nightly", "test.recurring.tick", interval=60)
    for query in ("source__exact=admin", "active__exact=1", "paused__exact=0", "q=night"):
        response = client.get(reverse(SCHEDULES) + "?" + query)
        assert response.status_code == 200, query


@pytest.mark.django_db
def test_every_link_of_the_dashboard_opens_a_list() -> None:
    dead()
    client = Client()
    client.force_login(User.objects.create_superuser("root", password=None))
    page = client.get(reverse(DASHBOARD) + "?tenant=acme").content.decode()
    links = {html.unescape(href) for href in re.findall(r'href="([^"]+\?[^"]+)"', page)
             if "/admin/django_persistent_jobs/" in href}
    assert links
    for link in links:
        assert client.get(link).status_code == 200, link


@pytest.mark.django_db
def test_a_bulk_action_on_an_id_that_is_no_job_id_is_a_message_not_a_500() -> None:
    dead()
    client: Client = staff_client("op", "view_persistentjob", "cancel_persistentjob")
    response = client.post(reverse(JOBS), {"action": "cancel", "_selected_action": ["zzz"],
                                           "index": "0"}, follow=True)
    assert response.status_code == 200
    shown = [str(m) for m in response.context["messages"]]
    assert any("zzz" in m for m in shown), shown
