"""The operator API over real HTTP against a real server (pytest-django's ``live_server``, a
threaded WSGI server on a socket): every endpoint, both auth modes (a session established by
logging in through the admin's form, with its CSRF cookie), tenant confinement and the error
statuses, responses checked against the OpenAPI document."""

from __future__ import annotations

import http.cookiejar
import json
import re
import urllib.error
import urllib.parse
import urllib.request
import uuid
from typing import Any

import pytest

from django_persistent_jobs.models import PersistentJob
from tests.api_support import ALL_PERMS, make_token, make_user, stage, table_fingerprint
from tests.openapi_check import assert_matches_schema

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]


class Http:
    """A tiny HTTP client with a cookie jar (so it can hold a session like a browser)."""

    def __init__(self, base: str, token: str | None = None) -> None:
        self.base = base
        self.token = token
        self.jar = http.cookiejar.CookieJar()
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.jar))

    def cookie(self, name: str) -> str | None:
        return next((c.value for c in self.jar if c.name == name), None)

    def raw(self, method: str, path: str, body: bytes | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        request = urllib.request.Request(self.base + path, data=body, method=method,
                                         headers=headers or {})
        try:
            with self.opener.open(request, timeout=30) as response:
                return response.status, dict(response.headers), response.read()
        except urllib.error.HTTPError as error:
            return error.code, dict(error.headers), error.read()

    def call(self, method: str, path: str, body: Any = None, *, csrf: bool = False,
             check: bool = True) -> tuple[int, Any, dict[str, str]]:
        headers = {"Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        if csrf and self.cookie("csrftoken"):
            headers["X-CSRFToken"] = self.cookie("csrftoken") or ""
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        status, response_headers, content = self.raw(method, path, data, headers)
        assert response_headers["Content-Type"].startswith("application/json")
        payload = json.loads(content)
        if check:
            assert_matches_schema(method, path, status, payload)
        return status, payload, response_headers

    def login(self, username: str, password: str = "pw-123456") -> None:
        """Log in through the admin's login form, as a browser would."""
        _, _, page = self.raw("GET", "/admin/login/")
        token = re.search(rb'name="csrfmiddlewaretoken" value="([^"]+)"', page)
        assert token is not None
        form = urllib.parse.urlencode({"username": username, "password": password,
                                       "csrfmiddlewaretoken": token.group(1).decode(),
                                       "next": "/admin/"}).encode()
        self.raw("POST", "/admin/login/", form,
                 {"Content-Type": "application/x-www-form-urlencoded"})
        assert self.cookie("sessionid"), "login failed"


@pytest.fixture
def base(live_server: Any) -> str:
    return str(live_server.url)


def test_every_endpoint_with_a_token(base: str):
    api = Http(base, make_token(make_user("op", *ALL_PERMS)))
    status, created, _ = api.call("POST", "/jobs/", {"job_type": "test.noop",
                                                     "payload": {"a": 1}, "queue": "q"})
    assert status == 201 and created["created"] is True
    job_id = created["job"]["id"]
    status, listed, _ = api.call("GET", "/jobs/?queue=q&status=pending")
    assert status == 200 and [j["id"] for j in listed["results"]] == [job_id]
    status, shown, _ = api.call("GET", f"/jobs/{job_id}")
    assert status == 200 and shown["payload"] == {"a": 1}
    status, cancelled, _ = api.call("POST", f"/jobs/{job_id}/cancel")
    assert status == 200 and cancelled["status"] == "cancelled"
    status, retried, _ = api.call("POST", f"/jobs/{job_id}/retry", {"mode": "reset"})
    assert status == 200 and retried["status"] == "pending"
    status, stats, _ = api.call("GET", "/jobs/stats")
    assert status == 200 and stats["status_counts"]["pending"] == 1
    status, doc, _ = Http(base).call("GET", "/jobs/openapi.json")
    assert status == 200 and doc["openapi"].startswith("3.")


def test_error_statuses_over_http(base: str):
    job = stage(status="completed")
    anonymous = Http(base)
    status, body, headers = anonymous.call("GET", "/jobs/")
    assert status == 401 and body["error"]["code"] == "not_authenticated"
    assert headers["WWW-Authenticate"].startswith("Bearer")
    assert Http(base, "pjt_not-a-real-token").call("GET", "/jobs/")[0] == 401
    viewer = Http(base, make_token(make_user("viewer", "view_persistentjob")))
    status, body, _ = viewer.call("POST", f"/jobs/{job.id}/retry")
    assert status == 403 and body["error"]["code"] == "permission_denied"
    op = Http(base, make_token(make_user("op", *ALL_PERMS)))
    before = table_fingerprint()
    status, body, _ = op.call("POST", "/jobs/", {"job_type": "test.noop", "priority": "x"})
    assert status == 400 and body["error"]["field"] == "priority"
    assert op.call("GET", f"/jobs/{uuid.uuid4()}")[0] == 404
    status, body, _ = op.call("POST", f"/jobs/{job.id}/cancel")
    assert status == 409 and body["error"]["code"] == "invalid_state"
    assert table_fingerprint() == before
    status, headers, content = op.raw("PUT", "/jobs/", b"{}",
                                      {"Authorization": f"Bearer {op.token}"})
    assert status == 405 and json.loads(content)["error"]["code"] == "method_not_allowed"


def test_session_auth_and_csrf_over_http(base: str):
    make_user("staffer", *ALL_PERMS, staff=True)  # the admin login form wants staff
    browser = Http(base)
    browser.login("staffer")
    job = stage()
    status, shown, _ = browser.call("GET", f"/jobs/{job.id}")
    assert status == 200 and shown["id"] == str(job.id)
    before = table_fingerprint()
    status, body, _ = browser.call("POST", f"/jobs/{job.id}/cancel")  # no X-CSRFToken
    assert status == 403 and body["error"]["code"] == "csrf_failed"
    assert table_fingerprint() == before
    status, body, _ = browser.call("POST", f"/jobs/{job.id}/cancel", csrf=True)
    assert status == 200 and body["status"] == "cancelled"
    status, body, _ = browser.call("POST", "/jobs/", {"job_type": "test.noop"}, csrf=True)
    assert status == 201


def test_tenant_bound_token_over_http(base: str):
    acme = Http(base, make_token(make_user("acme-op", *ALL_PERMS), tenant="acme"))
    mine = stage(tenant="acme", status="failed")
    theirs = stage(tenant="globex", status="failed")
    status, listed, _ = acme.call("GET", "/jobs/?tenant=globex")
    assert status == 200 and listed["results"] == []
    status, listed, _ = acme.call("GET", "/jobs/?status=failed")
    assert [j["id"] for j in listed["results"]] == [str(mine.id)]
    before = table_fingerprint()
    for method, path in (("GET", f"/jobs/{theirs.id}"), ("POST", f"/jobs/{theirs.id}/retry"),
                         ("POST", f"/jobs/{theirs.id}/cancel")):
        assert acme.call(method, path)[0] == 404
    assert table_fingerprint() == before
    assert PersistentJob.objects.get(pk=theirs.pk).status == "failed"
    assert acme.call("POST", f"/jobs/{mine.id}/retry")[0] == 200
