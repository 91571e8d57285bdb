"""The operator API through Django's test client: every endpoint, both auth modes, tenant
confinement, CSRF, and every error status, with responses checked against the OpenAPI document.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta, timezone
from typing import Any
from urllib.parse import quote

import pytest
from django.db import connection
from django.test import Client
from django.utils.timezone import now as timezone_now

from django_persistent_jobs.api.openapi import document
from django_persistent_jobs.api.tokens import ApiToken, hash_token
from django_persistent_jobs.metrics import available as metrics_available
from django_persistent_jobs.models import JobAttempt, PersistentJob
from tests.api_support import (
    ALL_PERMS,
    bearer,
    make_token,
    make_user,
    stage,
    table_fingerprint,
)
from tests.core_support import refusing_updates
from tests.openapi_check import assert_matches_schema

pytestmark = pytest.mark.django_db


@pytest.fixture
def operator_token() -> str:
    return make_token(make_user("operator", *ALL_PERMS))


def call(client: Client, method: str, path: str, secret: str | None = None,
         body: Any = None, **extra: Any) -> Any:
    headers = bearer(secret) if secret else {}
    kwargs: dict[str, Any] = {**headers, **extra}
    if body is not None:
        kwargs["data"] = body if isinstance(body, str | bytes) else json.dumps(body)
        kwargs["content_type"] = "application/json"
    elif method == "POST":
        kwargs.update(data=b"", content_type="application/json")  # no body at all
    response = getattr(client, method.lower())(path, **kwargs)
    assert response["Content-Type"].startswith("application/json"), response.content[:200]
    assert_matches_schema(method, path, response.status_code, response.json())
    return response


# ------------------------------------------------------------------ endpoints, token auth
def test_enqueue_creates_a_job_and_skip_dedup_returns_it(client: Client, operator_token: str):
    body = {"job_type": "test.noop", "payload": {"n": 1}, "dedup_key": "k1", "priority": 5,
            "queue": "mail", "delay": 30}
    first = call(client, "POST", "/jobs/", operator_token, body)
    assert first.status_code == 201
    data = first.json()
    assert data["created"] is True
    job = PersistentJob.objects.get(pk=data["job"]["id"])
    assert (job.payload, job.priority, job.queue, job.dedup_key) == ({"n": 1}, 5, "mail", "k1")
    assert job.next_run_at > job.created_at + timedelta(seconds=29)
    again = call(client, "POST", "/jobs/", operator_token, body)
    assert again.status_code == 200
    assert again.json() == {"created": False, "job": data["job"]}
    assert PersistentJob.objects.count() == 1


def test_enqueue_run_at(client: Client, operator_token: str):
    when = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
    response = call(client, "POST", "/jobs/", operator_token,
                    {"job_type": "test.noop", "run_at": when.isoformat()})
    assert response.status_code == 201
    assert PersistentJob.objects.get().next_run_at == when


@pytest.mark.parametrize("time_zone", ["America/New_York", "UTC"])
def test_times_are_utc_with_an_offset_with_use_tz_false(client: Client, operator_token: str,
                                                        settings: Any, time_zone: str):
    """With ``USE_TZ = False`` Django hands out naive datetimes in ``TIME_ZONE``: the API
    served them as they were, local times without an offset, which ``format: date-time``
    forbids and clients read as UTC. They are UTC with their offset, as with ``USE_TZ``."""
    settings.USE_TZ = False
    settings.TIME_ZONE = time_zone
    created = call(client, "POST", "/jobs/", operator_token,
                   {"job_type": "test.noop", "run_at": "2030-01-02T03:04:05Z"})
    assert created.status_code == 201
    job = created.json()["job"]
    assert job["next_run_at"] == "2030-01-02T03:04:05+00:00"
    with connection.cursor() as cursor:
        cursor.execute("SELECT now() AT TIME ZONE 'UTC'")
        utc_now = cursor.fetchone()[0].replace(tzinfo=UTC)
    PersistentJob.objects.filter(pk=job["id"]).update(status="failed", attempts=1)
    JobAttempt.objects.create(job_id=job["id"], attempt=1, runner_id="r", outcome="failed",
                              started_at=timezone_now(), finished_at=timezone_now())
    listed = call(client, "GET", "/jobs/", operator_token).json()["results"][0]
    detail = call(client, "GET", f"/jobs/{job['id']}", operator_token).json()
    for data in (job, listed, detail, detail["attempt_history"][0]):
        for name in ("created_at", "updated_at", "started_at", "finished_at"):
            if data.get(name) is not None:
                when = datetime.fromisoformat(data[name])
                assert when.utcoffset() == timedelta(0), (name, data[name])
                assert abs(when - utc_now) < timedelta(minutes=5), (name, data[name])
    assert listed["next_run_at"] == detail["next_run_at"] == "2030-01-02T03:04:05+00:00"


def test_get_job_shows_attempts_with_codes_and_timings(client: Client, operator_token: str):
    job = stage(status="failed", error_code="PLANNED", attempts=1, progress={"done": 3})
    started = datetime(2026, 1, 1, tzinfo=UTC)
    JobAttempt.objects.create(job=job, attempt=1, runner_id="r1", outcome="failed",
                              error_code="PLANNED", error_message="boom",
                              started_at=started, finished_at=started + timedelta(seconds=2),
                              duration=timedelta(seconds=2))
    response = call(client, "GET", f"/jobs/{job.id}", operator_token)
    assert response.status_code == 200
    data = response.json()
    assert data["status"] == "failed" and data["progress"] == {"done": 3}
    (attempt,) = data["attempt_history"]
    assert attempt["error_code"] == "PLANNED" and attempt["duration_seconds"] == 2.0
    assert attempt["outcome"] == "failed" and attempt["runner_id"] == "r1"


@pytest.mark.parametrize("mode", ["now", "later", "reset"])
def test_retry_modes(client: Client, operator_token: str, mode: str):
    job = stage(status="dead_lettered", error_code="X", attempts=4, max_retries=3)
    response = call(client, "POST", f"/jobs/{job.id}/retry", operator_token, {"mode": mode})
    assert response.status_code == 200
    job.refresh_from_db()
    assert job.status == "pending"
    assert job.attempts == (0 if mode == "reset" else 4)
    assert response.json()["status"] == "pending"


def test_api_actions_are_on_the_job_s_admin_history(client: Client):
    """The admin's job page says *History* lists every action taken on the job, by whom and
    when (operations.md): a retry or cancel through the API is an action by a Django user too,
    so it is recorded there, naming the user and the token, as the admin's own buttons are."""
    from django.contrib.admin.models import CHANGE, LogEntry

    user = make_user("oncall", *ALL_PERMS, staff=True)
    secret = make_token(user, name="pager-bot")
    job = stage(status="failed", attempts=1)
    assert call(client, "POST", f"/jobs/{job.id}/retry", secret,
                {"mode": "reset"}).status_code == 200
    assert call(client, "POST", f"/jobs/{job.id}/cancel", secret).status_code == 200
    refused = call(client, "POST", f"/jobs/{job.id}/cancel", secret)
    assert refused.status_code == 409
    entries = list(LogEntry.objects.filter(object_id=str(job.id)).order_by("id"))
    assert [(e.user_id, e.action_flag) for e in entries] == [(user.pk, CHANGE)] * 2
    assert "Retry from scratch" in entries[0].change_message
    assert "Cancel" in entries[1].change_message
    assert all("pager-bot" in e.change_message for e in entries)
    # The job's History page in the admin shows them.
    make_user("auditor", "view_persistentjob", staff=True)
    admin = Client()
    assert admin.login(username="auditor", password="pw-123456")
    page = admin.get(f"/admin/django_persistent_jobs/persistentjob/{job.id}/history/")
    assert page.status_code == 200
    assert page.content.decode().count("pager-bot") == 2


def test_retry_without_body_means_now(client: Client, operator_token: str):
    job = stage(status="failed")
    assert call(client, "POST", f"/jobs/{job.id}/retry", operator_token).status_code == 200


def test_cancel(client: Client, operator_token: str):
    job = stage()
    response = call(client, "POST", f"/jobs/{job.id}/cancel", operator_token)
    assert response.status_code == 200
    assert response.json()["status"] == "cancelled"
    job.refresh_from_db()
    assert job.status == "cancelled"


def test_list_filters_and_cursor_pagination(client: Client, operator_token: str):
    jobs = [stage(queue="q1" if i % 2 else "q2", status="dead_lettered" if i % 3 == 0 else None,
                  error_code="E1" if i % 3 == 0 else "") for i in range(7)]
    seen: list[str] = []
    cursor: str | None = None
    while True:
        path = "/jobs/?limit=3" + (f"&cursor={cursor}" if cursor else "")
        data = call(client, "GET", path, operator_token).json()
        seen.extend(j["id"] for j in data["results"])
        cursor = data["next_cursor"]
        if cursor is None:
            break
    assert seen == [str(j.id) for j in sorted(jobs, key=lambda j: j.id, reverse=True)]

    def ids(query: str) -> set[str]:
        return {j["id"] for j in call(client, "GET", f"/jobs/?{query}",
                                      operator_token).json()["results"]}

    assert ids("queue=q1") == {str(j.id) for j in jobs if j.queue == "q1"}
    assert ids("status=dead_lettered") == {str(j.id) for j in jobs[::3]}
    assert ids("status=dead_lettered,pending") == {str(j.id) for j in jobs}
    assert ids("status=dead_lettered&status=pending") == {str(j.id) for j in jobs}
    assert ids("error_code=E1&queue=q2") == {str(j.id) for j in jobs[::3] if j.queue == "q2"}
    assert ids("job_type=other") == set()
    future = (datetime.now(UTC) + timedelta(hours=1)).isoformat().replace("+00:00", "Z")
    assert ids(f"created_before={future}") == {str(j.id) for j in jobs}
    assert ids(f"created_after={future}") == set()
    # An offset PostgreSQL cannot read (it takes up to 15:59) is the same instant in UTC.
    far = (datetime.now(UTC) + timedelta(hours=30)).astimezone(
        timezone(timedelta(hours=17, minutes=12))).isoformat()
    assert ids(f"created_after={quote(far)}") == set()
    assert ids(f"created_before={quote(far)}") == {str(j.id) for j in jobs}


def test_list_order_is_stable_while_jobs_are_added(client: Client, operator_token: str):
    for _ in range(4):
        stage()
    first = call(client, "GET", "/jobs/?limit=2", operator_token).json()
    newer = stage()  # newer than everything: must not shift the next page
    second = call(client, "GET", f"/jobs/?limit=2&cursor={first['next_cursor']}",
                  operator_token).json()
    page_ids = [j["id"] for j in first["results"] + second["results"]]
    assert len(set(page_ids)) == 4 and str(newer.id) not in page_ids


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize(("body", "field"), [
    ({}, "job_type"),
    ({"job_type": "no.such.type"}, "job_type"),
    ({"job_type": "test.noop", "priority": "high"}, "priority"),
    ({"job_type": "test.noop", "priority": 10**6}, "priority"),
    ({"job_type": "test.noop", "delay": -1}, "delay"),
    ({"job_type": "test.noop", "run_at": "yesterday"}, "run_at"),
    ({"job_type": "test.noop", "run_at": "2030-01-01T00:00:00"}, "run_at"),
    ({"job_type": "test.noop", "run_at": "2030-01-01T00:00:00Z", "delay": 1}, "delay"),
    ({"job_type": "test.noop", "dedup": "sometimes"}, "dedup"),
    ({"job_type": "test.noop", "queue": ""}, "queue"),
    ({"job_type": "test.noop", "dedup_key": "a\x00b"}, "dedup_key"),
    ({"job_type": "test.noop", "payload": {"k": "\x00"}}, "payload"),
    ({"job_type": "test.noop", "colour": "blue"}, "colour"),
    ({"job_type": "test.noop", "timeout": 0}, "timeout"),
    ({"job_type": "test.noop", "max_retries": -1}, "max_retries"),
    ("[1, 2]", "body"),
    ("{not json", "body"),
    ('{"job_type": "test.noop", "delay": NaN}', "body"),
])
def test_enqueue_400_names_the_field_and_writes_nothing(
        client: Client, operator_token: str, body: Any, field: str):
    before = table_fingerprint()
    response = call(client, "POST", "/jobs/", operator_token, body)
    assert response.status_code == 400, response.json()
    assert response.json()["error"]["field"] == field
    assert table_fingerprint() == before


@pytest.mark.parametrize(("query", "field"), [
    ("status=bogus", "status"), ("limit=0", "limit"), ("limit=x", "limit"),
    ("cursor=%21%21", "cursor"), ("created_after=soon", "created_after"),
    ("created_after=2030-01-01T00:00:00", "created_after"), ("sort=id", "sort"),
    ("created_after=2030-01-02T00:00:00Z&created_before=2030-01-01T00:00:00Z",
     "created_before"),
])
def test_list_400_names_the_parameter(client: Client, operator_token: str, query: str,
                                      field: str):
    response = call(client, "GET", f"/jobs/?{query}", operator_token)
    assert response.status_code == 400
    assert response.json()["error"]["field"] == field


@pytest.mark.parametrize("body", [{"job_type": "test.noop", "delay": 10 ** 400},
                                  {"job_type": "test.noop", "timeout": -(10 ** 400)},
                                  '{"job_type": "test.noop", "delay": 1e400}'])
def test_numbers_beyond_any_float_are_400(client: Client, operator_token: str, body: Any):
    before = table_fingerprint()
    response = call(client, "POST", "/jobs/", operator_token, body)
    assert response.status_code == 400
    assert response.json()["error"]["field"] in {"delay", "timeout", "body"}
    assert table_fingerprint() == before


@pytest.mark.parametrize("query", ["queue=,", "queue=", "tenant=%20,%20", "status=,"])
def test_a_filter_that_names_nothing_is_400(client: Client, operator_token: str, query: str):
    stage()
    response = call(client, "GET", f"/jobs/?{query}", operator_token)
    assert response.status_code == 400
    assert response.json()["error"]["field"] == query.split("=")[0]


def test_unknown_query_parameters_are_400_on_every_endpoint(client: Client,
                                                            operator_token: str):
    job = stage(status="failed", attempts=1, last_error="boom")
    before = table_fingerprint()
    for method, path, body in [
        ("POST", f"/jobs/{job.id}/retry?mode=reset", None),
        ("POST", f"/jobs/{job.id}/cancel?force=1", None),
        ("POST", "/jobs/?dry_run=1", {"job_type": "test.noop"}),
        ("GET", f"/jobs/{job.id}?expand=attempts", None),
        ("GET", "/jobs/stats?tenant=acme", None),
        ("GET", "/jobs/openapi.json?foo=1", None),  # was 200: the document ignored it
    ]:
        response = call(client, method, path, operator_token, body)
        assert response.status_code == 400, (path, response.json())
        assert response.json()["error"]["field"] == path.split("?")[1].split("=")[0]
    assert table_fingerprint() == before


def test_other_paths_under_the_prefix_are_json_404(client: Client, operator_token: str):
    job = stage(status="failed")
    before = table_fingerprint()
    for method, path in [("GET", f"/jobs/{job.id}/"), ("POST", f"/jobs/{job.id}/retry/"),
                         ("POST", f"/jobs/{job.id}/cancel/"), ("GET", "/jobs/stats/"),
                         ("GET", f"/jobs/{job.id}/attempts")]:
        response = getattr(client, method.lower())(path, **bearer(operator_token))
        assert response.status_code == 404, path
        assert response["Content-Type"].startswith("application/json")
        error = response.json()["error"]
        assert error["code"] == "not_found" and "/jobs/<id>/retry" in error["message"]
    assert table_fingerprint() == before


def test_paths_under_the_prefix_stay_json_behind_the_csrf_middleware(operator_token: str,
                                                                   settings: Any):
    """Every real project runs ``CsrfViewMiddleware``. A bearer client that POSTs to a path the
    API does not have (``<id>/retry/`` with a slash) must get the JSON 404 naming the routes,
    not the middleware's HTML "CSRF verification failed" page: a token client sends no CSRF
    cookie, so that page would send it hunting for a CSRF problem it does not have."""
    settings.MIDDLEWARE = [*settings.MIDDLEWARE, "django.middleware.csrf.CsrfViewMiddleware"]
    client = Client(enforce_csrf_checks=True)
    job = stage(status="failed")
    before = table_fingerprint()
    for path in (f"/jobs/{job.id}/retry/", f"/jobs/{job.id}/cancel/", "/jobs/stats/"):
        response = client.post(path, data=b"{}", content_type="application/json",
                               **bearer(operator_token))
        assert response.status_code == 404, (path, response.content[:200])
        assert response["Content-Type"].startswith("application/json")
        assert response.json()["error"]["code"] == "not_found"
    # The real endpoints, for comparison: a bearer POST needs no CSRF token there either.
    response = client.post(f"/jobs/{job.id}/retry", data=b"", content_type="application/json",
                           **bearer(operator_token))
    assert response.status_code == 200
    assert table_fingerprint() != before


def test_a_body_over_the_upload_limit_is_json_413(client: Client, operator_token: str,
                                                  settings: Any):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    job = stage(status="failed")
    before = table_fingerprint()
    big = json.dumps({"job_type": "test.noop", "payload": {"pad": "x" * 2000}})
    for path in ("/jobs/", f"/jobs/{job.id}/retry", f"/jobs/{job.id}/cancel"):
        response = call(client, "POST", path, operator_token, big)
        assert response.status_code == 413, path
        assert response.json()["error"]["code"] == "body_too_large"
    assert table_fingerprint() == before


def test_more_fields_than_django_reads_is_a_json_400(client: Client, operator_token: str,
                                                     settings: Any):
    """Past ``DATA_UPLOAD_MAX_NUMBER_FIELDS`` (a query string, or a session's form whose CSRF
    check reads it) Django raises ``TooManyFieldsSent``: its HTML 400 page, not the API's JSON
    400 naming the body."""
    settings.DATA_UPLOAD_MAX_NUMBER_FIELDS = 50
    job = stage(status="failed")
    before = table_fingerprint()
    many = "&".join("status=failed" for _ in range(51))
    for method, path in (("GET", f"/jobs/?{many}"), ("GET", f"/jobs/stats?{many}"),
                         ("GET", f"/jobs/{job.id}?{many}"),
                         ("POST", f"/jobs/{job.id}/cancel?{many}")):
        response = call(client, method, path, operator_token)
        assert response.status_code == 400, (path, response.content[:300])
        assert response.json()["error"]["field"] == "query"
    fields = "&".join(f"f{i}=1" for i in range(51))
    response = client.post(f"/jobs/{job.id}/cancel", fields,
                           content_type="application/x-www-form-urlencoded",
                           **bearer(operator_token))
    assert response.status_code == 400, response.content[:300]
    make_user("staffer", *ALL_PERMS)
    browser = Client(enforce_csrf_checks=True)
    assert browser.login(username="staffer", password="pw-123456")
    browser.get("/admin/login/")
    csrf = browser.cookies["csrftoken"].value
    for content_type, body in (
            ("application/x-www-form-urlencoded", f"csrfmiddlewaretoken={csrf}&{fields}"),
            ("multipart/form-data; boundary=B",
             "".join(f'--B\r\nContent-Disposition: form-data; name="f{i}"\r\n\r\n1\r\n'
                     for i in range(51)) + "--B--\r\n")):
        response = browser.generic("POST", f"/jobs/{job.id}/cancel", body,
                                   content_type=content_type)
        assert response["Content-Type"].startswith("application/json"), response.content[:300]
        assert response.status_code == 400, response.content[:300]
        assert response.json()["error"] == {
            "code": "invalid_form", "field": "body", "message": response.json()["error"][
                "message"]}
        assert_matches_schema("POST", f"/jobs/{job.id}/cancel", 400, response.json())
    assert table_fingerprint() == before


def test_an_unreachable_database_is_a_json_503_on_every_endpoint() -> None:
    """Every answer is JSON, errors included (docs/api.md): with the database down (a failover,
    a restart) a client gets a JSON 503 with ``Retry-After``, what HTTP clients and load
    balancers retry, not Django's HTML 500 page. The message does not name the database's
    host: an unauthenticated caller gets it too."""

    from tests.core_support import run_without_database

    script = (
        "import django, json; django.setup()\n"
        "from django.test import Client\n"
        "c = Client(raise_request_exception=False)\n"
        "h = {'HTTP_AUTHORIZATION': 'Bearer pjt_x'}\n"
        "id = '01a225aa-0000-7000-8000-000000000000'\n"
        "for method, path in [('get', '/jobs/'), ('post', '/jobs/'), ('get', '/jobs/' + id),\n"
        "                     ('post', '/jobs/' + id + '/retry'),\n"
        "                     ('post', '/jobs/' + id + '/cancel'), ('get', '/jobs/stats')]:\n"
        "    r = getattr(c, method)(path, **h)\n"
        "    print(json.dumps([method.upper(), path, r.status_code, r['Content-Type'],\n"
        "                      r.get('Retry-After'), r.content.decode()]))\n"
    )
    done = run_without_database("-c", script)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(lines) == 6, done.stdout
    for method, path, status, content_type, retry_after, content in lines:
        assert (status, content_type, retry_after) == (503, "application/json", "15"), (
            method, path, status, content[:300])
        body = json.loads(content)
        assert body["error"]["code"] == "database_unavailable"
        assert "127.0.0.1" not in content and "port 1" not in content
        assert_matches_schema(method, path, status, body)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("atomic_requests", [False, True])
def test_a_read_only_database_still_answers_reads_and_refuses_writes_with_json_503(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        atomic_requests: bool) -> None:
    """A database that turned read-only (a standby after a failover: PostgreSQL's 25006,
    "cannot execute UPDATE in a read-only transaction", which Django raises as InternalError)
    answered every endpoint, reads included, with Django's HTML 500: checking a token first
    records its use (an UPDATE). Recording use is now best-effort, reads answer, and writes are
    the documented JSON 503 ``database_unavailable``, whether or not each request runs in a
    transaction of its own (``ATOMIC_REQUESTS``)."""
    from django.db import connections

    monkeypatch.setitem(connections.settings[connection.alias], "ATOMIC_REQUESTS",
                        atomic_requests)
    secret = make_token(make_user("operator", *ALL_PERMS))
    job = stage(status="failed")
    before = table_fingerprint()
    client = Client(raise_request_exception=False)
    with connection.cursor() as cursor:
        cursor.execute("SET default_transaction_read_only = on")
    try:
        for path in ("/jobs/", f"/jobs/{job.id}", "/jobs/stats"):
            response = call(client, "GET", path, secret)
            assert response.status_code == 200, (path, response.content[:300])
        assert "could not record" in caplog.text
        metrics = client.get("/metrics", **bearer(secret))  # reads only: served
        assert metrics.status_code == (200 if metrics_available() else 501), metrics.content[:300]
        for path, body in ((f"/jobs/{job.id}/retry", None), (f"/jobs/{job.id}/cancel", None),
                           ("/jobs/", {"job_type": "test.noop"})):
            response = call(client, "POST", path, secret, body)
            assert response.status_code == 503, (path, response.content[:300])
            assert response.json()["error"]["code"] == "database_unavailable"
            assert response["Retry-After"] == "15"
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SET default_transaction_read_only = off")
    assert table_fingerprint() == before


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("atomic_requests", [False, True])
def test_a_statement_the_database_refuses_is_a_json_500_with_its_reason(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        atomic_requests: bool) -> None:
    """A trigger (or a constraint) refusing the retry's UPDATE is not "unavailable": it was
    re-raised to Django, which answered its HTML 500 page ("every response is JSON, errors
    included"). Now a JSON 500 ``database_error`` with the database's one-line reason, as the
    ``jobs`` command reports it, logged with its traceback; nothing changed."""
    from django.db import connections

    monkeypatch.setitem(connections.settings[connection.alias], "ATOMIC_REQUESTS",
                        atomic_requests)
    secret = make_token(make_user("operator", *ALL_PERMS))
    job = stage(status="dead_lettered")
    client = Client(raise_request_exception=False)
    with refusing_updates("pj_api_refuses", "persistent_jobs", f"OLD.id = '{job.id}'",
                          "refused by the sites trigger"):
        before = table_fingerprint()
        response = call(client, "POST", f"/jobs/{job.id}/retry", secret)
        assert table_fingerprint() == before
    assert response.status_code == 500, response.content[:300]
    assert response["Content-Type"].startswith("application/json")
    error = response.json()["error"]
    assert error["code"] == "database_error"
    assert "refused by the sites trigger" in error["message"]
    assert_matches_schema("POST", f"/jobs/{job.id}/retry", 500, response.json())
    assert any(getattr(r, "event", None) == "api_database_error" and r.exc_info
               for r in caplog.records)
    assert call(client, "POST", f"/jobs/{job.id}/retry", secret).status_code == 200


def test_retry_400_for_a_bad_mode(client: Client, operator_token: str):
    job = stage(status="failed")
    response = call(client, "POST", f"/jobs/{job.id}/retry", operator_token, {"mode": "soon"})
    assert response.status_code == 400 and response.json()["error"]["field"] == "mode"


def test_404_for_unknown_and_malformed_ids(client: Client, operator_token: str):
    for path in (f"/jobs/{uuid.uuid4()}", "/jobs/not-a-uuid", f"/jobs/{uuid.uuid4()}/retry",
                 f"/jobs/{uuid.uuid4()}/cancel"):
        method = "GET" if path.count("/") == 2 else "POST"
        response = call(client, method, path, operator_token)
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "not_found"


def test_409_when_the_state_does_not_allow_the_action(client: Client, operator_token: str):
    done = stage(status="completed")
    before = table_fingerprint()
    for action in ("retry", "cancel"):
        response = call(client, "POST", f"/jobs/{done.id}/{action}", operator_token)
        assert response.status_code == 409
        assert response.json()["error"]["code"] == "invalid_state"
    assert table_fingerprint() == before


def test_405_is_json_with_allow(client: Client, operator_token: str):
    response = client.delete("/jobs/", **bearer(operator_token))
    assert response.status_code == 405
    assert response["Allow"] == "GET, POST, HEAD"
    assert response.json()["error"]["code"] == "method_not_allowed"


def test_head_answers_like_get_without_a_body(client: Client, operator_token: str):
    job = stage()
    for path in ("/jobs/", f"/jobs/{job.id}", "/jobs/stats", "/jobs/openapi.json"):
        got = client.get(path, **bearer(operator_token))
        head = client.head(path, **bearer(operator_token))
        assert (head.status_code, head["Content-Type"]) == (200, got["Content-Type"]), path
        assert head.content == b"" and int(head["Content-Length"]) > 0, path
    missing = client.head(f"/jobs/{uuid.uuid4()}", **bearer(operator_token))
    assert (missing.status_code, missing.content) == (404, b"")
    assert client.head("/jobs/", **bearer("pjt_not-a-token")).status_code == 401
    refused = client.head(f"/jobs/{job.id}/retry", **bearer(operator_token))
    assert (refused.status_code, refused["Allow"], refused.content) == (405, "POST", b"")


# ------------------------------------------------------------------ authentication
def test_401_without_credentials_and_with_bad_tokens(client: Client):
    job = stage()
    user = make_user("revoked", *ALL_PERMS)
    secret = make_token(user)
    ApiToken.objects.get(key_hash=hash_token(secret)).revoke()
    for headers in ({}, bearer("pjt_wrong"), bearer(secret), {"HTTP_AUTHORIZATION": "Basic x"}):
        response = client.get(f"/jobs/{job.id}", **headers)
        assert response.status_code == 401, headers
        assert response["WWW-Authenticate"].startswith("Bearer")
        assert_matches_schema("GET", f"/jobs/{job.id}", 401, response.json())


def test_token_of_an_inactive_user_is_refused(client: Client):
    user = make_user("gone", *ALL_PERMS)
    secret = make_token(user)
    user.is_active = False
    user.save()
    assert client.get("/jobs/", **bearer(secret)).status_code == 401


def test_tokens_are_stored_hashed_and_record_use(client: Client):
    user = make_user("u", "view_persistentjob")
    secret = make_token(user)
    token = ApiToken.objects.get()
    assert secret not in (token.key_hash, token.key_prefix) and token.key_hash == hash_token(
        secret)
    assert token.last_used_at is None
    assert client.get("/jobs/", **bearer(secret)).status_code == 200
    token.refresh_from_db()
    assert token.last_used_at is not None


def test_403_when_the_user_lacks_the_permission(client: Client):
    viewer = make_token(make_user("viewer", "view_persistentjob"))
    job = stage(status="failed")
    assert call(client, "GET", f"/jobs/{job.id}", viewer).status_code == 200
    before = table_fingerprint()
    for method, path, body in (("POST", "/jobs/", {"job_type": "test.noop"}),
                               ("POST", f"/jobs/{job.id}/retry", None),
                               ("POST", f"/jobs/{job.id}/cancel", None)):
        response = call(client, method, path, viewer, body)
        assert response.status_code == 403
        assert response.json()["error"]["code"] == "permission_denied"
    assert table_fingerprint() == before
    nobody = make_token(make_user("nobody"))
    assert call(client, "GET", "/jobs/", nobody).status_code == 403


def test_session_auth_requires_csrf_on_post(operator_token: str):
    make_user("staffer", *ALL_PERMS)
    browser = Client(enforce_csrf_checks=True)
    assert browser.login(username="staffer", password="pw-123456")
    job = stage()
    assert call(browser, "GET", f"/jobs/{job.id}").status_code == 200
    before = table_fingerprint()
    response = call(browser, "POST", f"/jobs/{job.id}/cancel")
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "csrf_failed"
    assert table_fingerprint() == before
    # A page that renders a CSRF token (the admin login) sets the cookie; the header carries it.
    browser.get("/admin/login/")
    csrf = browser.cookies["csrftoken"].value
    response = call(browser, "POST", f"/jobs/{job.id}/cancel", HTTP_X_CSRFTOKEN=csrf)
    assert response.status_code == 200
    # Bearer requests need no CSRF token, even from a client that enforces it.
    other = stage()
    plain = Client(enforce_csrf_checks=True)
    assert call(plain, "POST", f"/jobs/{other.id}/cancel", operator_token).status_code == 200


def test_a_session_post_of_a_form_is_served_and_an_oversized_one_is_json_413(settings: Any):
    """A browser form posted with the session (an HTML ``<form>`` with its
    ``csrfmiddlewaretoken``) is read as the same fields in JSON would be (it once was a 500: the
    CSRF check had read the multipart stream, and reading the body then raised; then a 400);
    an oversized one is the API's JSON 413, not Django's HTML 400. (More in
    ``test_views_forms.py``.)"""
    make_user("staffer", *ALL_PERMS)
    browser = Client(enforce_csrf_checks=True)
    assert browser.login(username="staffer", password="pw-123456")
    browser.get("/admin/login/")
    csrf = browser.cookies["csrftoken"].value
    job = stage(status="failed", attempts=3)
    response = browser.post(f"/jobs/{job.id}/retry", {"csrfmiddlewaretoken": csrf,
                                                      "mode": "reset"})  # multipart
    assert response.status_code == 200, response.content[:300]
    assert_matches_schema("POST", f"/jobs/{job.id}/retry", 200, response.json())
    assert PersistentJob.objects.get(pk=job.pk).attempts == 0
    response = browser.post("/jobs/", {"csrfmiddlewaretoken": csrf, "job_type": "test.noop"})
    assert response.status_code == 201, response.content[:300]
    before = table_fingerprint()
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    response = browser.post(
        f"/jobs/{job.id}/cancel", f"csrfmiddlewaretoken={csrf}&pad={'x' * 2000}",
        content_type="application/x-www-form-urlencoded", HTTP_X_CSRFTOKEN=csrf)
    assert response.status_code == 413, response.content[:300]
    assert response.json()["error"]["code"] == "body_too_large"
    assert table_fingerprint() == before


# ------------------------------------------------------------------ tenant confinement
def test_tenant_bound_token_is_confined_by_id_and_by_filter(client: Client):
    user = make_user("tenant-op", *ALL_PERMS)
    acme = make_token(user, tenant="acme")
    mine = stage(tenant="acme", status="failed")
    theirs = stage(tenant="globex", status="failed")
    untagged = stage(status="failed")
    listed = call(client, "GET", "/jobs/", acme).json()["results"]
    assert [j["id"] for j in listed] == [str(mine.id)]
    for query in ("tenant=globex", "tenant=globex,acme", "status=failed&tenant=globex"):
        listed = call(client, "GET", f"/jobs/?{query}", acme).json()["results"]
        assert str(theirs.id) not in {j["id"] for j in listed}
    before = table_fingerprint()
    for other in (theirs, untagged):
        assert call(client, "GET", f"/jobs/{other.id}", acme).status_code == 404
        assert call(client, "POST", f"/jobs/{other.id}/retry", acme).status_code == 404
        assert call(client, "POST", f"/jobs/{other.id}/cancel", acme).status_code == 404
    assert table_fingerprint() == before
    assert call(client, "GET", f"/jobs/{mine.id}", acme).status_code == 200
    assert call(client, "POST", f"/jobs/{mine.id}/retry", acme).status_code == 200
    assert call(client, "POST", f"/jobs/{mine.id}/cancel", acme).status_code == 200


def test_tenant_bound_token_enqueues_only_for_its_tenant(client: Client):
    acme = make_token(make_user("tenant-op", *ALL_PERMS), tenant="acme")
    before = table_fingerprint()
    refused = call(client, "POST", "/jobs/", acme, {"job_type": "test.noop", "tenant": "globex"})
    assert refused.status_code == 403 and refused.json()["error"]["field"] == "tenant"
    assert table_fingerprint() == before
    response = call(client, "POST", "/jobs/", acme, {"job_type": "test.noop"})
    assert response.status_code == 201
    assert response.json()["job"]["tenant"] == "acme"
    assert PersistentJob.objects.get().tenant == "acme"


@pytest.mark.parametrize("dedup", ["skip", "replace"])
def test_tenant_bound_token_cannot_reach_another_tenants_job_by_its_dedup_key(
    client: Client, dedup: str,
):
    acme = make_token(make_user("tenant-op", *ALL_PERMS), tenant="acme")
    theirs = stage(tenant="globex", payload={"secret": "globex-data"}, dedup_key="shared",
                   dedup=dedup)
    untagged = stage(payload={"secret": "untagged"}, dedup_key="plain", dedup=dedup,
                     status="running")
    before = table_fingerprint()
    for key in ("shared", "plain"):
        refused = call(client, "POST", "/jobs/", acme,
                       {"job_type": "test.noop", "dedup_key": key, "dedup": dedup})
        assert refused.status_code == 409
        error = refused.json()["error"]
        assert (error["code"], error["field"]) == ("dedup_key_taken", "dedup_key")
        assert "secret" not in refused.content.decode()
        assert str(theirs.id) not in error["message"] and str(untagged.id) not in error["message"]
    assert table_fingerprint() == before
    # The tenant's own key deduplicates as usual.
    first = call(client, "POST", "/jobs/", acme,
                 {"job_type": "test.noop", "dedup_key": "acme-1", "dedup": dedup})
    again = call(client, "POST", "/jobs/", acme,
                 {"job_type": "test.noop", "dedup_key": "acme-1", "dedup": dedup})
    assert first.status_code == 201
    assert again.status_code == (200 if dedup == "skip" else 201)


def test_unbound_token_sees_every_tenant_and_filters_by_tenant(client: Client,
                                                               operator_token: str):
    a = stage(tenant="acme")
    g = stage(tenant="globex")
    listed = call(client, "GET", "/jobs/?tenant=globex", operator_token).json()["results"]
    assert [j["id"] for j in listed] == [str(g.id)]
    assert call(client, "GET", f"/jobs/{a.id}", operator_token).status_code == 200


# ------------------------------------------------------------------ OpenAPI
def test_openapi_document_is_served_and_covers_every_route(client: Client):
    response = client.get("/jobs/openapi.json")
    assert response.status_code == 200
    doc = response.json()
    assert doc["openapi"].startswith("3.")
    assert doc["servers"] == [{"url": "/jobs"}]
    assert doc == json.loads(json.dumps(document("/jobs")))
    from django_persistent_jobs import urls

    routes = {"/" + str(p.pattern).replace("<str:job_id>", "{job_id}") for p in urls.urlpatterns
              if p.name is not None}  # the last, nameless one answers 404 for anything else
    assert routes == set(doc["paths"])
    assert urls.urlpatterns[-1].name is None


# ------------------------------------------------------------------ stats
def test_stats_serves_the_dashboard_numbers(client: Client, operator_token: str):
    stage(status="dead_lettered", error_code="SMTP")
    stage(queue="mail")
    response = call(client, "GET", "/jobs/stats?window=3600", operator_token)
    assert response.status_code == 200
    data = response.json()
    assert data["status_counts"]["dead_lettered"] == 1
    assert data["status_counts"]["pending"] == 1
    assert data["window"] == 3600.0 and data["tenant"] is None
    assert {q["queue"] for q in data["queues"]} >= {"mail"}


def test_stats_of_a_tenant_bound_token_cover_its_tenant_only(client: Client):
    acme = make_token(make_user("acme", "view_persistentjob"), tenant="acme")
    stage(tenant="acme")
    stage(tenant="globex", status="dead_lettered")
    stage(status="dead_lettered")
    data = call(client, "GET", "/jobs/stats", acme).json()
    assert data["tenant"] == "acme"
    assert data["status_counts"]["pending"] == 1
    assert data["status_counts"]["dead_lettered"] == 0
    assert [t["tenant"] for t in data["tenants"]] in (["acme"], [])


@pytest.mark.parametrize("query", ["window=10", "window=x", "window=", "colour=red",
                                   "window=x&window=3600", "window=60&window=3600"])
def test_stats_400(client: Client, operator_token: str, query: str):
    response = call(client, "GET", f"/jobs/stats?{query}", operator_token)
    assert response.status_code == 400
    assert response.json()["error"]["field"] in ("window", "colour")


def test_stats_need_view_permission(client: Client):
    nobody = make_token(make_user("nobody"))
    assert call(client, "GET", "/jobs/stats", nobody).status_code == 403
    assert call(client, "GET", "/jobs/stats").status_code == 401
