"""The operator console through the Django test client: dashboard, job page, attempts, runners,
and the audited actions with their permissions and history."""

from __future__ import annotations

import html
import logging
import re
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlencode

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import User
from django.core.checks import run_checks
from django.test import Client, override_settings
from django.urls import reverse

from django_persistent_jobs import enqueue, job_handler
from django_persistent_jobs.models import JobAttempt, JobRunnerRecord, JobStatus, PersistentJob
from tests.admin.pages import ATTEMPTS, DASHBOARD, GROUP, JOBS, RUNNERS
from tests.core_support import db_now, staff_client


@job_handler("console.a")
def console_a(payload: Any) -> None:
    return None


@job_handler("console.b")
def console_b(payload: Any) -> None:
    return None


def job(job_type: str, tenant: str | None = None, payload: Any = None, **fields: Any,
        ) -> PersistentJob:
    created = enqueue(job_type, payload or {}, tenant=tenant)
    if fields:
        PersistentJob.objects.filter(pk=created.pk).update(**fields)
    return PersistentJob.objects.get(pk=created.pk)


def dead(job_type: str, code: str, tenant: str | None = None, **fields: Any) -> PersistentJob:
    now = db_now()
    found = job(job_type, tenant, status="dead_lettered", attempts=1, last_error_code=code,
                last_error=f"{code} happened", finished_at=now, **fields)
    JobAttempt.objects.create(job=found, attempt=1, runner_id="host:1:r", outcome="dead_lettered",
                              error_code=code, error_message=f"{code} happened",
                              traceback="Traceback (most recent call last):\n  boom",
                              started_at=now - timedelta(seconds=2), finished_at=now,
                              duration=timedelta(seconds=2))
    return found


def staff(username: str, *codenames: str) -> Client:
    client: Client = staff_client(username, *codenames)
    return client


def page(client: Client, url: str, status: int = 200) -> str:
    response = client.get(url)
    assert response.status_code == status, (url, response.status_code)
    return response.content.decode()


def job_page(job: PersistentJob) -> str:
    return reverse("admin:django_persistent_jobs_persistentjob_change", args=[job.pk])


def action_url(job: PersistentJob, name: str) -> str:
    return reverse("admin:django_persistent_jobs_persistentjob_action", args=[job.pk, name])


def status(job: PersistentJob) -> str:
    return str(PersistentJob.objects.get(pk=job.pk).status)


def history(job: PersistentJob) -> list[tuple[str, str]]:
    return [(e.user.get_username(), e.get_change_message()) for e in
            LogEntry.objects.filter(object_id=str(job.pk)).order_by("action_time", "id")]


# ------------------------------------------------------------------ the dashboard

@pytest.mark.django_db
def test_the_dashboard_is_on_the_admin_index_and_needs_the_view_permission() -> None:
    dead("console.a", "BOOM", tenant="acme")
    viewer = staff("viewer", "view_persistentjob")
    index = page(viewer, reverse("admin:index"))
    assert reverse(DASHBOARD) in index and ">Dashboard<" in index
    body = page(viewer, reverse(DASHBOARD))
    for text in ("What failed", "console.a", "BOOM", "Is it stuck", "Runners", "Queues",
                 "Who owns it", "acme", "<svg"):
        assert text in body, text
    assert "<script" not in body.split('id="content-main"')[1]  # the page needs no JavaScript
    # The charts: one bar per hour and per day, each with its numbers as a tooltip.
    assert body.count("<g><title>") == 24 + 7
    assert "0 completed, 1 failed attempts, 1 dead-lettered</title>" in body
    nobody = staff("nobody")
    assert reverse(DASHBOARD) not in page(nobody, reverse("admin:index"))
    assert nobody.get(reverse(DASHBOARD)).status_code == 403


@pytest.mark.django_db
def test_the_dashboard_window_and_tenant_narrow_what_it_shows() -> None:
    dead("console.a", "ACME_BOOM", tenant="acme")
    dead("console.b", "GLOBEX_BOOM", tenant="globex")
    viewer = staff("viewer", "view_persistentjob")
    everything = page(viewer, reverse(DASHBOARD))
    assert "ACME_BOOM" in everything and "GLOBEX_BOOM" in everything
    acme = page(viewer, reverse(DASHBOARD) + "?tenant=acme&window=1h")
    assert "ACME_BOOM" in acme and "GLOBEX_BOOM" not in acme
    assert "tenant acme" in acme
    stats = viewer.get(reverse(DASHBOARD) + "?tenant=acme&window=7d").context["stats"]
    assert stats.tenant == "acme" and stats.window == timedelta(days=7)
    assert viewer.get(reverse(DASHBOARD) + "?window=bogus").context["window_key"] == "24h"


@pytest.mark.django_db
def test_runner_links_survive_odd_names_and_keep_the_tenant() -> None:
    """A ``runjobs --name`` may hold ``_5F``, which the admin unquotes: links quote it. The
    "jobs held" link of a tenant's dashboard lists that tenant's jobs only."""
    now = db_now()
    name = "etl_5Fbox:42:aa"
    JobRunnerRecord.objects.create(id=name, hostname="h", pid=1, concurrency=2,
                                   heartbeat_at=now, started_at=now)
    mine = job("console.a", tenant="acme", status="running", locked_by=name, locked_at=now)
    job("console.a", tenant="globex", status="running", locked_by=name, locked_at=now)
    viewer = staff("viewer", "view_persistentjob")
    response = viewer.get(reverse(DASHBOARD) + "?tenant=acme")
    [row] = response.context["runners"]
    assert page(viewer, row["url"]).count(html.escape(name)) >= 1
    held = viewer.get(row["held_url"])
    assert [j.pk for j in held.context["cl"].result_list] == [mine.pk]
    detail = viewer.get(job_page(mine))
    assert detail.context["runner_url"] == row["url"]


# ------------------------------------------------------------------ permissions

@pytest.mark.django_db
def test_view_only_staff_see_everything_and_can_do_nothing() -> None:
    failed = dead("console.a", "BOOM")
    waiting = job("console.a")
    JobRunnerRecord.objects.create(id="r1", hostname="h", pid=1, concurrency=2)
    viewer = staff("viewer", "view_persistentjob")  # enough to see attempts and runners too
    for url in (reverse(DASHBOARD), reverse(JOBS), job_page(failed), reverse(ATTEMPTS),
                reverse(RUNNERS),
                reverse("admin:django_persistent_jobs_jobrunnerrecord_change", args=["r1"]),
                reverse("admin:django_persistent_jobs_persistentjob_history", args=[failed.pk])):
        page(viewer, url)
    index = page(viewer, reverse("admin:index"))
    assert reverse(ATTEMPTS) in index and reverse(RUNNERS) in index
    detail = page(viewer, job_page(failed))
    assert "BOOM happened" in detail and "Retry now" not in detail
    assert '<div class="pj-buttons">' not in detail
    assert "retry all" not in page(viewer, reverse(DASHBOARD))
    for name in ("retry_now", "retry_later", "retry_reset"):
        assert viewer.post(action_url(failed, name)).status_code == 403
    assert viewer.post(action_url(waiting, "cancel")).status_code == 403
    assert viewer.get(reverse(GROUP) + "?job_type=console.a&error_code=BOOM").status_code == 403
    assert viewer.post(reverse(GROUP), {"job_type": "console.a", "error_code": "BOOM",
                                        "confirm": "yes"}).status_code == 403
    assert (status(failed), status(waiting)) == ("dead_lettered", "pending")
    assert not LogEntry.objects.exists()


@pytest.mark.django_db
def test_each_button_needs_its_permission() -> None:
    failed = dead("console.a", "BOOM")
    waiting = job("console.a")
    retrier = staff("retrier", "view_persistentjob", "retry_persistentjob")
    canceller = staff("canceller", "view_persistentjob", "cancel_persistentjob")

    retrier_page = page(retrier, job_page(failed))
    assert all(label in retrier_page for label in (
        "Retry now", "Retry later (after backoff)", "Retry from scratch (reset attempts)"))
    assert 'value="Cancel"' not in page(retrier, job_page(waiting))
    assert retrier.post(action_url(waiting, "cancel")).status_code == 403
    assert status(waiting) == "pending"

    canceller_page = page(canceller, job_page(waiting))
    assert 'value="Cancel"' in canceller_page and "Retry now" not in canceller_page
    assert canceller.post(action_url(failed, "retry_now")).status_code == 403
    assert status(failed) == "dead_lettered"

    assert retrier.post(action_url(failed, "retry_now")).status_code == 302
    assert canceller.post(action_url(waiting, "cancel")).status_code == 302
    assert (status(failed), status(waiting)) == ("pending", "cancelled")
    # A GET never acts, and an unknown action is a 404.
    other = dead("console.a", "BOOM")
    assert retrier.get(action_url(other, "retry_now")).status_code == 302
    assert status(other) == "dead_lettered"
    assert retrier.post(action_url(other, "explode")).status_code == 404


# ------------------------------------------------------------------ the audit trail

@pytest.mark.django_db
def test_every_action_appears_in_the_jobs_history_with_the_user(
    caplog: pytest.LogCaptureFixture,
) -> None:
    root = User.objects.create_superuser("root", password=None)
    client = Client()
    client.force_login(root)
    target = dead("console.a", "BOOM")
    caplog.set_level(logging.INFO, logger="django_persistent_jobs.services")

    client.post(action_url(target, "retry_later"))
    client.post(action_url(target, "cancel"))
    client.post(action_url(target, "retry_reset"))
    client.post(reverse(JOBS), {"action": "cancel", "index": "0", "select_across": "0",
                                "_selected_action": [str(target.pk)]})
    client.post(reverse(JOBS), {"action": "retry_now", "index": "0", "select_across": "0",
                                "_selected_action": [str(target.pk)]})
    PersistentJob.objects.filter(pk=target.pk).update(status="dead_lettered",
                                                      last_error_code="BOOM")
    shown_at = client.get(reverse(GROUP) + "?job_type=console.a&error_code=BOOM").context[
        "shown_at"]
    client.post(reverse(GROUP), {"job_type": "console.a", "error_code": "BOOM",
                                 "confirm": "yes", "shown_at": shown_at})

    entries = history(target)
    assert [user for user, _ in entries] == ["root"] * 6
    messages = [message for _, message in entries]
    assert messages == [
        "Retry later (after backoff): now pending.",
        "Cancel: now cancelled.",
        "Retry from scratch (reset attempts): now pending.",
        "Cancel: now cancelled.",
        "Retry now: now pending.",
        "Retried now with every dead letter of failure group console.a / BOOM.",
    ]
    shown = page(client, reverse("admin:django_persistent_jobs_persistentjob_history",
                                 args=[target.pk]))
    for message in messages:
        assert message in shown, message
    actors = {(getattr(r, "event", ""), getattr(r, "actor", None)) for r in caplog.records
              if getattr(r, "event", "").startswith("operator_")}
    assert actors == {("operator_retry", "admin user 'root'"),
                      ("operator_cancel", "admin user 'root'")}, actors
    assert "retried by admin user 'root' (mode=later)" in caplog.text
    assert "cancelled by admin user 'root'" in caplog.text
    assert PersistentJob.objects.get(pk=target.pk).status == "pending"


@pytest.mark.django_db
def test_cancelling_a_running_job_is_recorded_as_a_request_and_shown_on_its_page() -> None:
    running = job("console.a", status="running", locked_by="r1", locked_at=db_now(),
                  progress={"done": 1, "of": 4})
    root = User.objects.create_superuser("root", password=None)
    client = Client()
    client.force_login(root)
    client.post(action_url(running, "cancel"))
    assert history(running) == [("root", "Cancellation requested (the job is running; its "
                                         "handler is told to stop).")]
    body = page(client, job_page(running))
    assert "cancellation requested" in body and 'value="Cancel"' not in body
    assert 'aria-valuenow="25"' in body
    assert "cancel requested" in page(client, reverse(JOBS))


# ------------------------------------------------------------------ failure groups

@pytest.mark.django_db
def test_retry_every_dead_letter_of_a_group_after_a_confirmation_showing_the_count() -> None:
    group = [dead("console.a", "BOOM", tenant="acme") for _ in range(3)]
    other_tenant = dead("console.a", "BOOM", tenant="globex")
    other_code = dead("console.a", "OTHER")
    other_type = dead("console.b", "BOOM")
    retrier = staff("retrier", "view_persistentjob", "retry_persistentjob")

    dashboard = page(retrier, reverse(DASHBOARD) + "?tenant=acme")
    assert reverse(GROUP) + "?job_type=console.a&amp;error_code=BOOM&amp;tenant=acme" in dashboard
    confirm = retrier.get(reverse(GROUP) + "?job_type=console.a&error_code=BOOM&tenant=acme")
    assert confirm.context["count"] == 3
    assert 'id="pj-count">3<' in confirm.content.decode()
    assert all(status(j) == "dead_lettered" for j in group)  # showing the page changes nothing

    done = retrier.post(reverse(GROUP), {"job_type": "console.a", "error_code": "BOOM",
                                         "tenant": "acme", "confirm": "yes",
                                         "shown_at": confirm.context["shown_at"]}, follow=True)
    assert [str(m) for m in done.context["messages"]] == ["Retried (now) 3 job(s)."]
    assert [status(j) for j in group] == ["pending"] * 3
    assert [status(j) for j in (other_tenant, other_code, other_type)] == ["dead_lettered"] * 3
    again = retrier.get(reverse(GROUP) + "?job_type=console.a&error_code=BOOM&tenant=acme")
    assert again.context["count"] == 0 and "is left" in again.content.decode()


@pytest.mark.django_db
def test_a_failure_groups_links_open_exactly_what_it_counts() -> None:
    """The group counts failed attempts *finished* in the window and the jobs behind them; its
    links used to open attempts *started* in the window and every job whose last error has the
    code, at any time."""
    now = db_now()

    def failed(of: PersistentJob, n: int, code: str, started: timedelta,
               finished: timedelta) -> JobAttempt:
        return JobAttempt.objects.create(
            job=of, attempt=n, runner_id="r", outcome="failed", error_code=code,
            error_message=code, started_at=now - started, finished_at=now - finished)

    # Failed with BOOM in the window, then otherwise: counted, though its last error differs.
    moved_on = job("console.a", status="failed", last_error_code="OTHER")
    failed(moved_on, 1, "BOOM", timedelta(hours=2), timedelta(hours=2))
    failed(moved_on, 2, "OTHER", timedelta(hours=1), timedelta(hours=1))
    # Started before the window, finished inside it: counted.
    slow = job("console.a", status="failed", last_error_code="BOOM")
    failed(slow, 1, "BOOM", timedelta(hours=25), timedelta(hours=23))
    # Failed with BOOM two days ago only: not counted, though its last error is BOOM.
    old = job("console.a", status="dead_lettered", last_error_code="BOOM")
    failed(old, 1, "BOOM", timedelta(days=2), timedelta(days=2))

    client = staff("viewer", "view_persistentjob", "view_jobattempt")
    groups = client.get(reverse(DASHBOARD) + "?window=24h").context["groups"]
    row = next(r for r in groups if (r["g"].job_type, r["g"].error_code) == ("console.a", "BOOM"))
    assert (row["g"].attempts, row["g"].jobs) == (2, 2)
    jobs_list = client.get(html.unescape(row["jobs_url"]))
    assert jobs_list.status_code == 200
    assert {j.pk for j in jobs_list.context["cl"].result_list} == {moved_on.pk, slow.pk}
    assert "failed attempts" in jobs_list.content.decode()  # the sidebar says it is narrowed
    attempts = client.get(html.unescape(row["attempts_url"]))
    assert attempts.status_code == 200
    assert attempts.context["cl"].result_count == row["g"].attempts
    # A hand-made link with a time that is not one is a bad filter, not a 500.
    assert client.get(reverse(JOBS) + "?failed_since=yesterday").status_code == 302


@pytest.mark.django_db
def test_retrying_a_group_retries_what_the_confirmation_showed_not_later_dead_letters() -> None:
    shown = [dead("console.a", "BOOM") for _ in range(2)]
    retrier = staff("retrier", "view_persistentjob", "retry_persistentjob")
    confirm = retrier.get(reverse(GROUP) + "?job_type=console.a&error_code=BOOM")
    assert confirm.context["count"] == 2
    shown_at = confirm.context["shown_at"]
    assert f'name="shown_at" value="{shown_at}"' in confirm.content.decode()
    # Dead-lettered while the operator reads the page (the test's transaction has one now(),
    # so "later" is written out).
    late = dead("console.a", "BOOM")
    PersistentJob.objects.filter(pk=late.pk).update(
        finished_at=datetime.fromisoformat(shown_at) + timedelta(seconds=1))
    form = {"job_type": "console.a", "error_code": "BOOM", "confirm": "yes"}

    # A confirmation that does not say what it showed retries nothing: the page again.
    again = retrier.post(reverse(GROUP), form)
    assert again.status_code == 200 and 'id="pj-confirm"' in again.content.decode()
    assert retrier.post(reverse(GROUP), {**form, "shown_at": "soon"}).status_code == 400
    assert {status(j) for j in [*shown, late]} == {"dead_lettered"}

    done = retrier.post(reverse(GROUP), {**form, "shown_at": shown_at}, follow=True)
    assert [str(m) for m in done.context["messages"]] == ["Retried (now) 2 job(s)."]
    assert [status(j) for j in shown] == ["pending", "pending"]
    assert status(late) == "dead_lettered"


NUL_URLS = [  # (url, status): never a 500
    (reverse(DASHBOARD) + "?tenant=a%00", 400),
    (reverse(DASHBOARD) + "?window=24h&x%00=1", 400),
    (reverse(GROUP) + "?job_type=console.a%00&error_code=BOOM", 400),
    (reverse(GROUP) + "?job_type=console.a&error_code=BO%00OM", 400),
    (reverse(JOBS) + "?tenant=%00", 302),  # the admin's "bad filter" page (?e=1)
    (reverse(JOBS) + "?q=%00", 302),
    (reverse(JOBS) + "?failed_with=%00", 302),
    (reverse(ATTEMPTS) + "?error_code=%00", 302),
    (reverse(RUNNERS) + "?q=%00", 302),
    (reverse("admin:django_persistent_jobs_jobschedule_changelist") + "?q=%00", 302),
    ("/admin/django_persistent_jobs/jobrunnerrecord/a%00/change/", 302),  # "does not exist"
    ("/admin/django_persistent_jobs/persistentjob/a%00/change/", 302),
]


@pytest.mark.django_db
@pytest.mark.parametrize(("url", "expected"), NUL_URLS)
def test_a_nul_character_in_a_parameter_is_a_bad_request_not_a_500(url: str,
                                                                    expected: int) -> None:
    """PostgreSQL refuses NUL in text: a query with one raised (500) instead of answering."""
    dead("console.a", "BOOM")
    JobRunnerRecord.objects.create(id="a", hostname="h", pid=1, concurrency=1,
                                   heartbeat_at=db_now())
    client = Client(raise_request_exception=False)
    client.force_login(User.objects.create_superuser("root", password=None))
    assert client.get(url).status_code == expected
    posted = client.post(reverse(GROUP), {"job_type": "console.a\x00", "error_code": "BOOM",
                                          "confirm": "yes", "shown_at": db_now().isoformat()})
    assert posted.status_code == 400


# ------------------------------------------------------------------ the job page and list

@pytest.mark.django_db
@override_settings(PERSISTENT_JOBS={"REDACT_KEYS": ["password", "token", "card"]})
def test_the_job_page_redacts_secret_looking_keys_and_reads_as_a_summary() -> None:
    target = dead("console.a", "BOOM", payload={
        "user": "ann", "Password": "hunter2", "auth": {"api_token": "t0k", "scope": "read"},
        "cards": [{"card_number": "4111"}], "note": "keep",
    }, tenant="acme")
    client = staff("viewer", "view_persistentjob")
    body = html.unescape(page(client, job_page(target)))
    for secret in ("hunter2", "t0k", "4111"):
        assert secret not in body, secret
    for visible in ('"user": "ann"', '"Password": "***"', '"api_token": "***"', '"scope": "read"',
                    '"cards": "***"', '"note": "keep"', "BOOM", "BOOM happened", "tenant",
                    "acme", " UTC", " ago", "<details><summary>traceback</summary>"):
        assert visible in body, visible
    assert "next run" not in body  # a dead letter will not run again by itself


@pytest.mark.django_db
def test_progress_and_schedule_payloads_are_redacted_like_the_job_payload() -> None:
    from django_persistent_jobs.schedules.services import add_schedule

    target = job("console.a", progress={"done": 1, "of": 2, "api_token": "pr0gress-t0k"})
    schedule = add_schedule("nightly", "console.a", interval=3600,
                            payload={"password": "sch3dule-pw", "keep": "visible"})
    viewer = staff("viewer", "view_persistentjob", "view_jobschedule")
    body = html.unescape(page(viewer, job_page(target)))
    assert "pr0gress-t0k" not in body and '"api_token": "***"' in body
    shown = html.unescape(page(viewer, reverse("admin:django_persistent_jobs_jobschedule_change",
                                               args=[schedule.pk])))
    assert "sch3dule-pw" not in shown
    assert '"password": "***"' in shown and '"keep": "visible"' in shown
    # Who may change the schedule edits its payload whole (the form saves what it shows).
    editor = staff("editor", "view_jobschedule", "change_jobschedule")
    form = editor.get(reverse("admin:django_persistent_jobs_jobschedule_change",
                              args=[schedule.pk]))
    assert "payload" in form.context["adminform"].form.fields
    edited = html.unescape(form.content.decode())
    assert "sch3dule-pw" in edited and '"password": "***"' not in edited  # not shown twice


@pytest.mark.django_db
def test_the_redact_keys_setting_is_checked() -> None:
    with override_settings(PERSISTENT_JOBS={"REDACT_KEYS": "password"}):
        ids = {m.id for m in run_checks() if (m.id or "").startswith("persistent_jobs")}
    assert "persistent_jobs.E030" in ids
    with override_settings(PERSISTENT_JOBS={"REDACT_KEYS": ["password", ""]}):
        ids = {m.id for m in run_checks() if (m.id or "").startswith("persistent_jobs")}
    assert "persistent_jobs.E030" in ids
    with override_settings(PERSISTENT_JOBS={"REDACT_KEYS": []}):
        ids = {m.id for m in run_checks() if (m.id or "").startswith("persistent_jobs")}
    assert "persistent_jobs.E030" not in ids


@pytest.mark.django_db
def test_the_list_shows_short_ids_ages_last_errors_and_no_next_run_when_finished() -> None:
    now = db_now()
    done = job("console.a", status="completed", finished_at=now - timedelta(minutes=4),
               next_run_at=now + timedelta(hours=5))
    later = job("console.a", next_run_at=now + timedelta(hours=2))
    failed = dead("console.a", "BOOM", tenant="acme")
    client = staff("viewer", "view_persistentjob")
    body = page(client, reverse(JOBS))
    assert str(done.pk)[-8:] in body and f">{done.pk}<" not in body
    assert "ended <span" in body and "4 min ago" in body
    assert "runs <span" in body and ("in 1 h 59 min" in body or "in 2 h" in body)
    assert "BOOM</code>" in body and "BOOM happened" in body
    # The finished job's row says when it ended, never when it would run.
    row = body.split(f">{str(done.pk)[-8:]}<")[1].split("</tr>")[0]
    assert "ended" in row and "runs" not in row and "due" not in row
    # Search by the short id shown, by tenant; filter by tenant.
    found = client.get(reverse(JOBS) + f"?q={str(later.pk)[-8:]}").context["cl"].result_list
    assert [j.pk for j in found] == [later.pk]
    assert [j.pk for j in client.get(reverse(JOBS) + "?q=acme").context["cl"].result_list] == [
        failed.pk]
    assert [j.pk for j in client.get(reverse(JOBS) + "?tenant=acme").context["cl"].result_list
            ] == [failed.pk]


# ------------------------------------------------------------------ attempts and runners

@pytest.mark.django_db
def test_attempts_filter_by_outcome_code_type_runner_date_and_search_the_message() -> None:
    now = db_now()
    a = job("console.a", tenant="acme")
    b = job("console.b")

    def attempt(of: PersistentJob, n: int, outcome: str, code: str, runner: str,
                age: timedelta, message: str) -> JobAttempt:
        return JobAttempt.objects.create(
            job=of, attempt=n, runner_id=runner, outcome=outcome, error_code=code,
            error_message=message, started_at=now - age, finished_at=now - age)

    a1 = attempt(a, 1, "failed", "SMTP", "r1", timedelta(hours=1), "smtp refused")
    a2 = attempt(a, 2, "dead_lettered", "SMTP", "r2", timedelta(minutes=1), "smtp refused again")
    b1 = attempt(b, 1, "timed_out", "TIMEOUT", "r1", timedelta(days=10), "too slow")
    b2 = attempt(b, 2, "completed", "", "r2", timedelta(minutes=2), "")
    client = staff("viewer", "view_persistentjob", "view_jobattempt")

    def listed(query: str) -> set[int]:
        response = client.get(reverse(ATTEMPTS) + query)
        assert response.status_code == 200, query
        return {row.pk for row in response.context["cl"].result_list}

    assert listed("") == {a1.pk, a2.pk, b1.pk, b2.pk}
    assert listed("?outcome__exact=dead_lettered") == {a2.pk}
    assert listed("?error_code=SMTP") == {a1.pk, a2.pk}
    assert listed("?job_type=console.b") == {b1.pk, b2.pk}
    assert listed("?runner_id=r1") == {a1.pk, b1.pk}
    assert listed("?tenant=acme") == {a1.pk, a2.pk}
    week_ago = urlencode({"started_at__gte": (now - timedelta(days=7)).isoformat()})
    assert listed(f"?{week_ago}") == {a1.pk, a2.pk, b2.pk}
    assert listed("?q=refused") == {a1.pk, a2.pk}
    assert listed("?job_type=console.a&error_code=SMTP&outcome__in=failed,dead_lettered") == {
        a1.pk, a2.pk}
    response = client.get(reverse(ATTEMPTS) + "?q=refused")
    assert response.context["cl"].result_count == 2  # "how often": an exact count
    attempt_page = page(client, reverse("admin:django_persistent_jobs_jobattempt_change",
                                        args=[a2.pk]))
    assert "smtp refused again" in attempt_page and job_page(a) in attempt_page


@pytest.mark.django_db
def test_runners_show_heartbeat_age_state_and_jobs_held() -> None:
    now = db_now()
    JobRunnerRecord.objects.create(id="live-1", hostname="h", pid=1, concurrency=4,
                                   queues=["mail"], version="9.9", heartbeat_at=now)
    JobRunnerRecord.objects.create(id="dead-1", hostname="h", pid=2, concurrency=2,
                                   heartbeat_at=now - timedelta(minutes=3))
    job("console.a", status="running", locked_by="dead-1", locked_at=now)
    client = staff("viewer", "view_persistentjob", "view_jobrunnerrecord")
    body = page(client, reverse(RUNNERS))
    live_row = body.split(">live-1<")[1].split("</tr>")[0]
    dead_row = body.split(">dead-1<")[1].split("</tr>")[0]
    assert ">live<" in live_row and "mail" in live_row and "9.9" in live_row
    assert "DEAD (stale heartbeat)" in dead_row and "3 min ago" in dead_row
    assert "locked_by=dead-1" in dead_row and ">1</a>" in dead_row
    detail = page(client, reverse("admin:django_persistent_jobs_jobrunnerrecord_change",
                                  args=["dead-1"]))
    assert "DEAD (stale heartbeat)" in detail
    assert JobStatus.RUNNING in {j.status for j in PersistentJob.objects.all()}


# ------------------------------------------------------------------ the demo

@override_settings(ROOT_URLCONF="example_project.urls", DEBUG=False)
def test_the_example_project_serves_the_admins_static_files_with_debug_off() -> None:
    response = Client().get("/static/admin/css/base.css")
    assert response.status_code == 200
    assert b"".join(response.streaming_content).startswith(b"/*")  # type: ignore[attr-defined]


def test_the_demos_admin_hint_uses_the_venvs_python_and_offers_serve() -> None:
    import os
    import sys

    from example_project.demo.management.commands.demo import Command

    hint = Command()._admin_hint()
    # The interpreter running the demo (the venv's), relative to here when it lives below.
    relative = os.path.relpath(sys.executable)
    python = sys.executable if relative.startswith("..") else relative
    assert f"{python} manage.py runserver" in hint and f"{python} manage.py createsuperuser" in hint
    assert "scripts/demo.sh --serve" in hint
    assert "DJANGO_SETTINGS_MODULE=example_project.settings" in hint


@pytest.mark.django_db
def test_a_job_waiting_in_its_runner_for_a_worker_is_not_shown_running_or_overdue() -> None:
    """With ``PREFETCH`` a runner claims jobs that wait in it for a free worker: the job page
    and the list count a running job's time (and its timeout) from its attempt's start, so a
    job that waited long is neither "running" that long nor "past its timeout"."""
    from django.db import connection

    from django_persistent_jobs.runner import store
    from tests.core_support import claim_as

    with connection.cursor() as cursor:
        store.register_runner(cursor, "host:1:r", "host", 1, None, 1, "test")
        waiting, started = (job("console.a"), job("console.a"))
        [claimed_waiting] = claim_as(cursor, "host:1:r", 1, None, direct=0)
        [claimed_started] = claim_as(cursor, "host:1:r", 1, None, direct=1)
    assert (claimed_waiting.id, claimed_started.id) == (waiting.id, started.id)
    long_ago = db_now() - timedelta(minutes=10)
    PersistentJob.objects.filter(pk__in=[waiting.pk, started.pk]).update(
        locked_at=long_ago, timeout_seconds=300)
    JobAttempt.objects.filter(id=claimed_started.token).update(
        started_at=db_now() - timedelta(seconds=30))
    client = staff("ops", "view_persistentjob")

    body = page(client, job_page(waiting))
    assert "waiting for a free worker" in body and "past its timeout" not in body
    assert "times out" not in body
    body = page(client, job_page(started))
    assert "running since" in body and "past its timeout" not in body
    assert "times out" in body and "waiting for a free worker" not in body
    listing = page(client, reverse(JOBS) + "?status__exact=running")
    text = html.unescape(re.sub(r"<[^>]+>", "", listing))
    assert "claimed 10 min ago, not started" in text
    assert re.search(r"started 3\d s ago", text)
