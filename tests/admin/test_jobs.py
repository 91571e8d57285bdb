"""The Django admin for jobs: filters, search, the detail page with attempts, and the retry /
cancel actions gated by their custom permissions."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from django.contrib import messages
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.test import Client
from django.urls import reverse

from django_persistent_jobs import enqueue, job_handler
from django_persistent_jobs.backoff import constant
from django_persistent_jobs.models import JobAttempt, PersistentJob
from tests.core_support import db_now

CHANGELIST = "admin:django_persistent_jobs_persistentjob_changelist"


@job_handler("core.adm.alpha", backoff=constant(300))
def alpha(payload: Any) -> None:
    return None


@job_handler("core.adm.beta", queue="mail")
def beta(payload: Any) -> None:
    return None


@dataclass
class Jobs:
    failed: PersistentJob
    dead: PersistentJob
    done: PersistentJob
    pending: PersistentJob

    def status(self, job: PersistentJob) -> str:
        return str(PersistentJob.objects.get(id=job.id).status)


def _set(job: PersistentJob, **fields: Any) -> PersistentJob:
    PersistentJob.objects.filter(id=job.id).update(**fields)
    return PersistentJob.objects.get(id=job.id)


@pytest.fixture
def jobs() -> Jobs:
    now = db_now()
    failed = _set(enqueue("core.adm.alpha", {"n": 1}), status="failed", attempts=1,
                  last_error_code="TIMEOUT", last_error="too slow",
                  next_run_at=now + timedelta(hours=1))
    dead = _set(enqueue("core.adm.beta", {"n": 2}, dedup_key="order-42"),
                status="dead_lettered", attempts=4, last_error_code="BOOM",
                last_error="it exploded", finished_at=now)
    JobAttempt.objects.create(job=dead, attempt=1, runner_id="host:1:aa", outcome="failed",
                              error_code="BOOM", error_message="attempt one exploded")
    JobAttempt.objects.create(job=dead, attempt=2, runner_id="host:1:aa",
                              outcome="dead_lettered", error_code="BOOM",
                              error_message="attempt two exploded",
                              traceback="Traceback (most recent call last): ...")
    done = _set(enqueue("core.adm.alpha", {"n": 3}), status="completed", attempts=1,
                finished_at=now)
    pending = enqueue("core.adm.beta", {"n": 4}, dedup_key="order-43")
    return Jobs(failed=failed, dead=dead, done=done, pending=pending)


def staff(username: str, *codenames: str) -> User:
    user = User.objects.create_user(username, is_staff=True)  # no password: no slow hashing
    perms = Permission.objects.filter(content_type__app_label="django_persistent_jobs",
                                      codename__in=codenames)
    assert perms.count() == len(codenames), codenames
    user.user_permissions.add(*perms)
    return user


def client_for(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def admin_client_() -> Client:
    return client_for(User.objects.create_superuser("root", password=None))


def listed(client: Client, query: str = "") -> set[Any]:
    response = client.get(reverse(CHANGELIST) + query)
    assert response.status_code == 200, response
    return {job.id for job in response.context["cl"].result_list}


def run_action(client: Client, action: str, *selected: PersistentJob) -> list[tuple[int, str]]:
    response = client.post(reverse(CHANGELIST), {
        "action": action, "index": "0", "select_across": "0",
        "_selected_action": [str(job.id) for job in selected],
    }, follow=True)
    assert response.status_code == 200
    return [(m.level, m.message) for m in response.context["messages"]]


# ------------------------------------------------------------------ finding jobs

@pytest.mark.django_db
def test_changelist_filters_return_the_right_rows(admin_client_: Client, jobs: Jobs) -> None:
    everything = {jobs.failed.id, jobs.dead.id, jobs.done.id, jobs.pending.id}
    assert listed(admin_client_) == everything
    assert listed(admin_client_, "?status__exact=failed") == {jobs.failed.id}
    assert listed(admin_client_, "?status__exact=dead_lettered") == {jobs.dead.id}
    assert listed(admin_client_, "?job_type=core.adm.alpha") == {jobs.failed.id, jobs.done.id}
    assert listed(admin_client_, "?queue=mail") == {jobs.dead.id, jobs.pending.id}
    assert listed(admin_client_, "?last_error_code=BOOM") == {jobs.dead.id}
    assert listed(admin_client_, "?job_type=core.adm.beta&status__exact=pending") == {
        jobs.pending.id}
    page = admin_client_.get(reverse(CHANGELIST)).content.decode()
    for choice in ("?status__exact=dead_lettered", "?job_type=core.adm.beta", "?queue=mail",
                   "?last_error_code=TIMEOUT"):
        assert choice in page, choice  # the filter sidebar offers each value


@pytest.mark.django_db
def test_search_by_exact_id_and_by_dedup_key(admin_client_: Client, jobs: Jobs) -> None:
    assert listed(admin_client_, f"?q={jobs.dead.id}") == {jobs.dead.id}
    assert listed(admin_client_, f"?q={jobs.done.id.hex}") == {jobs.done.id}
    assert listed(admin_client_, "?q=order-42") == {jobs.dead.id}
    assert listed(admin_client_, "?q=order-") == {jobs.dead.id, jobs.pending.id}
    assert listed(admin_client_, "?q=00000000-0000-0000-0000-000000000000") == set()
    assert listed(admin_client_, "?q=nothing-like-this") == set()


@pytest.mark.django_db
def test_detail_page_shows_the_job_and_its_attempts(admin_client_: Client, jobs: Jobs) -> None:
    url = reverse("admin:django_persistent_jobs_persistentjob_change", args=[jobs.dead.id])
    response = admin_client_.get(url)
    assert response.status_code == 200
    page = response.content.decode()
    for text in ("it exploded", "order-42", "attempt one exploded", "attempt two exploded",
                 "host:1:aa", "Traceback (most recent call last)"):
        assert text in page, text
    assert [row["a"].attempt for row in response.context["attempt_rows"]] == [2, 1]


@pytest.mark.django_db
def test_attempts_are_newest_first_after_a_reset_and_huge_progress_renders(
    admin_client_: Client,
) -> None:
    """A reset retry restarts attempt numbers, so "newest first" is by id; a progress number
    beyond any float is valid JSON and must not break the page."""
    job = enqueue("core.adm.alpha", {})
    now = db_now()
    for n, code in ((1, "OLD"), (2, "OLD"), (3, "OLD"), (1, "NEW")):
        JobAttempt.objects.create(job=job, attempt=n, runner_id="r", outcome="failed",
                                  error_code=code, started_at=now, finished_at=now,
                                  duration=timedelta(seconds=1))
    _set(job, progress={"done": 10 ** 400, "of": 10})
    url = reverse("admin:django_persistent_jobs_persistentjob_change", args=[job.id])
    response = admin_client_.get(url)
    assert response.status_code == 200
    rows = [(r["a"].attempt, r["a"].error_code) for r in response.context["attempt_rows"]]
    assert rows == [(1, "NEW"), (3, "OLD"), (2, "OLD"), (1, "OLD")]
    _set(job, progress=10 ** 400)
    assert admin_client_.get(url).status_code == 200


@pytest.mark.django_db
def test_jobs_cannot_be_added_edited_or_deleted_in_the_admin(
    admin_client_: Client, jobs: Jobs,
) -> None:
    assert admin_client_.get(
        reverse("admin:django_persistent_jobs_persistentjob_add")).status_code == 403
    assert admin_client_.get(reverse("admin:django_persistent_jobs_persistentjob_delete",
                                     args=[jobs.pending.id])).status_code == 403
    url = reverse("admin:django_persistent_jobs_persistentjob_change", args=[jobs.pending.id])
    admin_client_.post(url, {"status": "completed", "job_type": "x"})
    assert jobs.status(jobs.pending) == "pending"


# ------------------------------------------------------------------ actions and permissions

@pytest.mark.django_db
def test_view_only_staff_sees_no_actions_and_cannot_run_them(jobs: Jobs) -> None:
    client = client_for(staff("viewer", "view_persistentjob"))
    response = client.get(reverse(CHANGELIST))
    assert response.status_code == 200
    assert 'name="action"' not in response.content.decode()
    assert listed(client) == {jobs.failed.id, jobs.dead.id, jobs.done.id, jobs.pending.id}
    for action in ("retry_now", "retry_later", "retry_reset", "cancel"):
        run_action(client, action, jobs.dead, jobs.pending)
    assert (jobs.status(jobs.dead), jobs.status(jobs.pending)) == ("dead_lettered", "pending")


@pytest.mark.django_db
def test_retry_permission_grants_only_the_retry_actions(jobs: Jobs) -> None:
    client = client_for(staff("retrier", "view_persistentjob", "retry_persistentjob"))
    page = client.get(reverse(CHANGELIST)).content.decode()
    assert 'value="retry_now"' in page and 'value="retry_later"' in page
    assert 'value="retry_reset"' in page and 'value="cancel"' not in page
    assert run_action(client, "cancel", jobs.pending) == [(messages.WARNING,
                                                           "No action selected.")]
    assert jobs.status(jobs.pending) == "pending"
    result = run_action(client, "retry_now", jobs.dead, jobs.failed, jobs.done)
    assert (messages.SUCCESS, "Retried (now) 2 job(s).") in result
    assert (messages.WARNING, "Skipped 1 job(s) (1 completed): Retry now applies only to "
                              "failed, dead-lettered, cancelled, pending jobs.") in result
    assert [jobs.status(j) for j in (jobs.dead, jobs.failed, jobs.done)] == [
        "pending", "pending", "completed"]


@pytest.mark.django_db
def test_retry_later_and_reset_actions(admin_client_: Client, jobs: Jobs) -> None:
    assert run_action(admin_client_, "retry_later", jobs.failed) == [
        (messages.SUCCESS, "Scheduled retry (later) of 1 job(s).")]
    later = PersistentJob.objects.get(id=jobs.failed.id)
    with connection.cursor() as cursor:
        cursor.execute("SELECT next_run_at - now() FROM persistent_jobs WHERE id = %s",
                       [later.id])
        wait = cursor.fetchone()[0]
    assert later.status == "pending" and timedelta(seconds=295) < wait <= timedelta(seconds=300)
    assert run_action(admin_client_, "retry_reset", jobs.dead) == [
        (messages.SUCCESS, "Reset and retried 1 job(s).")]
    reset = PersistentJob.objects.get(id=jobs.dead.id)
    assert (reset.status, reset.attempts, reset.last_error_code) == ("pending", 0, "")


@pytest.mark.django_db
def test_cancel_permission_grants_only_the_cancel_action(jobs: Jobs) -> None:
    client = client_for(staff("canceller", "view_persistentjob", "cancel_persistentjob"))
    page = client.get(reverse(CHANGELIST)).content.decode()
    assert 'value="cancel"' in page and 'value="retry_now"' not in page
    assert run_action(client, "retry_now", jobs.dead) == [(messages.WARNING,
                                                           "No action selected.")]
    assert jobs.status(jobs.dead) == "dead_lettered"
    result = run_action(client, "cancel", jobs.pending, jobs.failed, jobs.done)
    assert (messages.SUCCESS, "Cancelled (or asked to stop) 2 job(s).") in result
    assert (messages.WARNING, "Skipped 1 job(s) (1 completed): Cancel applies only to "
                              "pending, failed, running jobs.") in result
    assert [jobs.status(j) for j in (jobs.pending, jobs.failed, jobs.done)] == [
        "cancelled", "cancelled", "completed"]


@pytest.mark.django_db
def test_a_bulk_action_reports_a_database_error_per_job_and_what_it_did(
    admin_client_: Client, jobs: Jobs,
) -> None:
    """One selected job's update fails in the database (here a trigger refuses it; an outage
    or a lock timeout does the same): the operator sees which job and why, and that the
    others were retried, instead of an error page that hides what was applied."""
    from tests.core_support import refusing_updates

    with refusing_updates("pj_test_refuse_retry", "persistent_jobs",
                          f"OLD.id = '{jobs.dead.id}'", "this job is frozen for an audit"):
        result = run_action(admin_client_, "retry_now", jobs.dead, jobs.failed)
    assert (messages.SUCCESS, "Retried (now) 1 job(s).") in result
    [warning] = [text for level, text in result if level == messages.WARNING]
    assert warning.startswith(f"Job {jobs.dead.id}: database error: ")
    assert "frozen for an audit" in warning
    assert [jobs.status(j) for j in (jobs.dead, jobs.failed)] == ["dead_lettered", "pending"]


@pytest.mark.django_db
def test_a_bulk_action_over_every_row_calls_the_service_only_for_jobs_it_applies_to(
    admin_client_: Client, jobs: Jobs,
) -> None:
    """"Select all" on a list of many finished jobs: they are skipped in one query and
    counted in one message, not read and refused one by one (a query or more each)."""
    from django.test.utils import CaptureQueriesContext

    for _ in range(30):
        _set(enqueue("core.adm.alpha", {}), status="completed", attempts=1,
             finished_at=db_now())

    def select_all() -> tuple[list[tuple[int, str]], int]:
        with CaptureQueriesContext(connection) as queries:
            response = admin_client_.post(reverse(CHANGELIST), {
                "action": "retry_now", "index": "0", "select_across": "1",
                "_selected_action": [str(jobs.dead.id)]}, follow=True)
        assert response.status_code == 200
        return [(m.level, m.message) for m in response.context["messages"]], len(
            queries.captured_queries)

    result, few = select_all()
    assert (messages.SUCCESS, "Retried (now) 3 job(s).") in result
    assert (messages.WARNING, "Skipped 31 job(s) (31 completed): Retry now applies only to "
                              "failed, dead-lettered, cancelled, pending jobs.") in result
    for _ in range(30):
        _set(enqueue("core.adm.alpha", {}), status="completed", attempts=1,
             finished_at=db_now())
    result, more = select_all()
    assert (messages.WARNING, "Skipped 61 job(s) (61 completed): Retry now applies only to "
                              "failed, dead-lettered, cancelled, pending jobs.") in result
    assert more == few  # (the three jobs retried before are pending now: retried again)
