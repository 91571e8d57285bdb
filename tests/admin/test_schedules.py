"""The schedule pages: the link to a schedule's runs, and a form that was drawn before someone
else changed the schedule."""

from __future__ import annotations

import re

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse

import tests.testapp.recurring_jobs  # noqa: F401  (registers test.recurring.*)
from django_persistent_jobs import enqueue
from django_persistent_jobs.admin.schedules import runs_url
from django_persistent_jobs.models import JobSchedule
from django_persistent_jobs.schedules.services import (
    add_schedule,
    pause_schedule,
    run_schedule_now,
    update_schedule,
)

pytestmark = pytest.mark.django_db


@pytest.fixture
def root() -> Client:
    client = Client()
    client.force_login(User.objects.create_superuser("root", password=None))
    return client


def change_url(name: str) -> str:
    return reverse("admin:django_persistent_jobs_jobschedule_change",
                   args=[JobSchedule.objects.get(name=name).pk])


def drawn_form(client: Client, name: str) -> dict[str, str]:
    """The change form's fields as the page drew them (what the browser would post back)."""
    page = client.get(change_url(name)).content.decode()
    form = page[page.index('id="jobschedule_form"'):]
    data: dict[str, str] = {}
    for tag in re.findall(r"<(?:input|select|textarea)[^>]*>", form):
        name_ = re.search(r'name="([^"]+)"', tag)
        if not name_ or name_.group(1).startswith("_") or name_.group(1) == "csrfmiddlewaretoken":
            continue
        if 'type="checkbox"' in tag:
            if "checked" in tag:
                data[name_.group(1)] = "on"
            continue
        value = re.search(r'value="([^"]*)"', tag)
        data[name_.group(1)] = value.group(1) if value else ""
    for field, text in re.findall(r'<textarea[^>]*name="([^"]+)"[^>]*>(.*?)</textarea>', form,
                                  re.S):
        data[field] = text.strip()
    job_type = re.search(r'<select[^>]*name="job_type".*?<option value="([^"]+)"[^>]*selected',
                         form, re.S)
    if job_type:
        data["job_type"] = job_type.group(1)
    return data


def test_runs_of_a_schedule_lists_its_runs_only(root: Client) -> None:
    add_schedule("sync", "test.recurring.tick", interval=60)
    add_schedule("sync-users", "test.recurring.tick", interval=60)
    mine = run_schedule_now("sync")
    other = run_schedule_now("sync-users")
    by_hand = enqueue("test.recurring.tick", {}, dedup_key="sync")  # not a run of "sync"
    response = root.get(runs_url("sync"))
    assert response.status_code == 200
    assert {job.id for job in response.context["cl"].result_list} == {mine.id}
    assert other.id != by_hand.id
    page = root.get(change_url("sync")).content.decode()
    assert runs_url("sync").replace("&", "&amp;") in page


def test_a_form_drawn_before_a_pause_does_not_resume_the_schedule(root: Client) -> None:
    add_schedule("nightly", "test.recurring.tick", interval=60, payload={"a": 1})
    stale = drawn_form(root, "nightly")
    assert stale["interval_seconds"] == "60.0" and "paused" not in stale
    pause_schedule("nightly")  # someone else, during an incident
    response = root.post(change_url("nightly"), {**stale, "payload": '{"b": 2}'})
    assert response.status_code == 200  # the form again, with the error
    assert "changed since" in response.content.decode()
    schedule = JobSchedule.objects.get(name="nightly")
    assert schedule.paused and schedule.payload == {"a": 1}


def test_a_hand_made_post_without_what_it_saw_does_not_resume_a_paused_schedule(
    root: Client,
) -> None:
    add_schedule("nightly", "test.recurring.tick", interval=60)
    pause_schedule("nightly")
    response = root.post(change_url("nightly"), {
        "name": "nightly", "job_type": "test.recurring.tick", "cron": "",
        "interval_seconds": "60", "timezone": "UTC", "payload": '{"b": 2}', "queue": "",
        "priority": ""})
    assert response.status_code == 302, response.content.decode()[:3000]
    schedule = JobSchedule.objects.get(name="nightly")
    assert schedule.paused and schedule.payload == {"b": 2}


def test_a_fresh_form_resumes_when_its_box_is_unticked(root: Client) -> None:
    add_schedule("nightly", "test.recurring.tick", interval=60)
    pause_schedule("nightly")
    form = drawn_form(root, "nightly")
    assert form["paused"] == "on" and form["initial-paused"] == "True"
    del form["paused"]
    assert root.post(change_url("nightly"), form).status_code == 302
    assert not JobSchedule.objects.get(name="nightly").paused


def test_a_form_drawn_before_another_edit_does_not_overwrite_it(root: Client) -> None:
    add_schedule("nightly", "test.recurring.tick", interval=60)
    stale = drawn_form(root, "nightly")
    update_schedule("nightly", interval=120)
    response = root.post(change_url("nightly"), {**stale, "payload": '{"b": 2}'})
    assert response.status_code == 200 and "changed since" in response.content.decode()
    assert JobSchedule.objects.get(name="nightly").interval_seconds == 120


def test_a_fresh_form_saves_and_a_tick_meanwhile_does_not_refuse_it(root: Client) -> None:
    add_schedule("nightly", "test.recurring.tick", interval=60)
    form = drawn_form(root, "nightly")
    run_schedule_now("nightly")  # the schedule's bookkeeping changes, not its definition
    response = root.post(change_url("nightly"), {**form, "payload": '{"b": 2}', "paused": "on"})
    assert response.status_code == 302, response.content.decode()[:3000]
    schedule = JobSchedule.objects.get(name="nightly")
    assert schedule.paused and schedule.payload == {"b": 2}


def test_a_payload_with_an_integer_too_long_to_read_is_a_form_error(root: Client) -> None:
    url = reverse("admin:django_persistent_jobs_jobschedule_add")
    response = root.post(url, {"name": "big", "job_type": "test.recurring.tick", "cron": "",
                               "interval_seconds": "60", "timezone": "UTC",
                               "payload": '{"n": ' + "9" * 5000 + "}", "queue": "",
                               "priority": ""})
    assert response.status_code == 200
    assert "digits" in response.content.decode()
    assert not JobSchedule.objects.filter(name="big").exists()
