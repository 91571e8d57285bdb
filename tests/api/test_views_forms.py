"""POST bodies sent as forms (``application/x-www-form-urlencoded`` or ``multipart/form-data``):
what Django's test client sends by default (``client.post(path)`` is an empty multipart form,
``client.post(path, {"mode": "now"})`` a multipart one), what an HTML ``<form>`` or ``curl -d``
sends. They mean the same as the JSON body with the same fields: values arrive as text, so the
enqueue fields the JSON API takes as numbers or objects are parsed from it, with the same checks
and the same 400s.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import jsonschema_rs
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client

from django_persistent_jobs.api.openapi import document
from django_persistent_jobs.models import PersistentJob
from tests.api_support import ALL_PERMS, bearer, make_token, make_user, stage, table_fingerprint
from tests.openapi_check import assert_matches_schema

pytestmark = pytest.mark.django_db

FORM = "application/x-www-form-urlencoded"


@pytest.fixture
def operator_token() -> str:
    return make_token(make_user("operator", *ALL_PERMS))


def checked(method: str, path: str, response: Any) -> Any:
    assert response["Content-Type"].startswith("application/json"), response.content[:300]
    assert_matches_schema(method, path, response.status_code, response.json())
    return response


def test_the_test_clients_default_bodies_are_accepted(client: Client, operator_token: str):
    """``client.post(path)`` sends an empty multipart form: no fields, as an empty body."""
    waiting = stage(status="failed")
    path = f"/jobs/{waiting.id}/cancel"
    response = checked("POST", path, client.post(path, **bearer(operator_token)))
    assert response.status_code == 200, response.content[:300]
    assert response.json()["status"] == "cancelled"
    path = f"/jobs/{waiting.id}/retry"
    response = checked("POST", path, client.post(path, **bearer(operator_token)))
    assert response.status_code == 200, response.content[:300]
    assert PersistentJob.objects.get(pk=waiting.pk).status == "pending"


@pytest.mark.parametrize("mode", ["now", "later", "reset"])
def test_retry_takes_its_mode_from_a_form(client: Client, operator_token: str, mode: str):
    job = stage(status="dead_lettered", attempts=4, max_retries=3, error_code="BOOM")
    response = client.post(f"/jobs/{job.id}/retry", {"mode": mode}, **bearer(operator_token))
    checked("POST", f"/jobs/{job.id}/retry", response)
    assert response.status_code == 200, response.content[:300]
    job.refresh_from_db()
    assert job.status == "pending"
    assert job.attempts == (0 if mode == "reset" else 4)
    urlencoded = stage(status="failed", attempts=2)
    response = client.post(f"/jobs/{urlencoded.id}/retry", "mode=reset", content_type=FORM,
                           **bearer(operator_token))
    assert response.status_code == 200, response.content[:300]
    assert PersistentJob.objects.get(pk=urlencoded.pk).attempts == 0


def test_enqueue_from_a_form_parses_each_field_from_its_text(client: Client,
                                                             operator_token: str):
    run_at = (datetime.now(UTC) + timedelta(hours=2)).replace(microsecond=0)
    for body, content_type in (
        ({"job_type": "test.noop", "payload": '{"to": "a@example.com", "n": [1, 2]}',
          "priority": "5", "max_retries": "2", "timeout": "1.5", "queue": "mail",
          "run_at": run_at.isoformat(), "dedup_key": "form-1", "dedup": "enqueue",
          "tenant": "acme"}, None),
        ("job_type=test.noop&payload=%7B%22to%22%3A+%22a%40example.com%22%2C+%22n%22%3A+"
         "%5B1%2C+2%5D%7D&priority=5&max_retries=2&timeout=1.5&queue=mail&run_at="
         + run_at.isoformat().replace("+", "%2B") + "&dedup_key=form-1&dedup=enqueue"
         "&tenant=acme", FORM),
    ):
        kwargs: dict[str, Any] = {"content_type": content_type} if content_type else {}
        response = checked("POST", "/jobs/", client.post("/jobs/", body, **kwargs,
                                                         **bearer(operator_token)))
        assert response.status_code == 201, response.content[:300]
        job = PersistentJob.objects.get(pk=response.json()["job"]["id"])
        assert job.payload == {"to": "a@example.com", "n": [1, 2]}
        assert (job.priority, job.max_retries, job.timeout_seconds) == (5, 2, 1.5)
        assert (job.queue, job.dedup_key, job.tenant) == ("mail", "form-1", "acme")
        assert job.next_run_at == run_at
    delayed = client.post("/jobs/", {"job_type": "test.noop", "delay": "30", "priority": "-3"},
                          **bearer(operator_token))
    assert delayed.status_code == 201, delayed.content[:300]
    job = PersistentJob.objects.get(pk=delayed.json()["job"]["id"])
    assert job.payload == {}
    assert job.priority == -3
    assert job.next_run_at - job.created_at >= timedelta(seconds=29)


def test_a_blank_form_field_counts_as_not_given(client: Client, operator_token: str):
    """An HTML form sends its empty inputs as empty strings."""
    response = client.post("/jobs/", {"job_type": "test.noop", "payload": "", "priority": "",
                                      "delay": "", "dedup_key": "", "queue": ""},
                           **bearer(operator_token))
    assert response.status_code == 201, response.content[:300]
    job = PersistentJob.objects.get(pk=response.json()["job"]["id"])
    assert (job.payload, job.priority, job.dedup_key, job.queue) == ({}, 0, None, "default")


@pytest.mark.parametrize(("form", "field", "says"), [
    ({"job_type": "test.noop", "payload": "{not json"}, "payload", "JSON"),
    ({"job_type": "test.noop", "payload": "NaN"}, "payload", "JSON"),
    ({"job_type": "test.noop", "priority": "high"}, "priority", "integer"),
    ({"job_type": "test.noop", "priority": "5.0"}, "priority", "integer"),
    ({"job_type": "test.noop", "priority": "\uff11"}, "priority", "integer"),
    ({"job_type": "test.noop", "priority": "99999"}, "priority", "integer"),
    ({"job_type": "test.noop", "max_retries": "-1"}, "max_retries", "integer"),
    ({"job_type": "test.noop", "delay": "soon"}, "delay", "seconds"),
    ({"job_type": "test.noop", "delay": "1_000"}, "delay", "seconds"),
    ({"job_type": "test.noop", "delay": "Infinity"}, "delay", "seconds"),
    ({"job_type": "test.noop", "timeout": "0"}, "timeout", "> 0"),
    ({"job_type": "test.noop", "run_at": "tomorrow"}, "run_at", "ISO 8601"),
    ({"job_type": "test.noop", "dedup": "sometimes"}, "dedup", "dedup"),
    ({"job_type": "test.noop", "colour": "red"}, "colour", "Unknown field"),
    ({"job_type": "test.noop", "queue": "a\x00b"}, "queue", "NUL"),
    ({"job_type": ""}, "job_type", "required"),
    ({"payload": "{}"}, "job_type", "required"),
    ({"job_type": ["test.noop", "test.noop"]}, "job_type", "once"),
])
def test_bad_form_values_are_400_naming_the_field(client: Client, operator_token: str,
                                                  form: dict[str, Any], field: str, says: str):
    before = table_fingerprint()
    for kwargs in ({}, {"data": None}):  # multipart, then url-encoded
        if "data" in kwargs:
            from urllib.parse import urlencode
            response = client.post("/jobs/", urlencode(form, doseq=True), content_type=FORM,
                                   **bearer(operator_token))
        else:
            response = client.post("/jobs/", form, **bearer(operator_token))
        checked("POST", "/jobs/", response)
        assert response.status_code == 400, response.content[:300]
        error = response.json()["error"]
        assert error["field"] == field, error
        assert says in error["message"], error
    assert table_fingerprint() == before


def test_retry_and_cancel_refuse_unknown_form_fields_and_files(client: Client,
                                                               operator_token: str):
    job = stage(status="failed")
    before = table_fingerprint()
    for path, form, field in (
        (f"/jobs/{job.id}/retry", {"mode": "sometime"}, "mode"),
        (f"/jobs/{job.id}/retry", {"mood": "now"}, "mood"),
        (f"/jobs/{job.id}/retry", {"mode": ["now", "reset"]}, "mode"),
        (f"/jobs/{job.id}/cancel", {"reason": ""}, "reason"),
        (f"/jobs/{job.id}/cancel", {"attachment": SimpleUploadedFile("a.txt", b"x")},
         "attachment"),
        ("/jobs/", {"job_type": "test.noop", "payload": SimpleUploadedFile("p.json", b"{}")},
         "payload"),
    ):
        response = checked("POST", path, client.post(path, form, **bearer(operator_token)))
        assert response.status_code == 400, (path, response.content[:300])
        assert response.json()["error"]["field"] == field
    assert table_fingerprint() == before


def test_a_session_form_post_passes_the_csrf_check_with_its_token_and_fails_without():
    """An HTML ``<form>`` carries ``csrfmiddlewaretoken`` (not a field of the API's); without it
    (nor the header) the session's POST is refused, and nothing is done."""
    make_user("staffer", *ALL_PERMS)
    browser = Client(enforce_csrf_checks=True)
    assert browser.login(username="staffer", password="pw-123456")
    browser.get("/admin/login/")
    csrf = browser.cookies["csrftoken"].value
    job = stage(status="failed", attempts=2)
    before = table_fingerprint()
    for form in ({"mode": "reset"}, {"mode": "reset", "csrfmiddlewaretoken": "x" * 32}):
        response = checked("POST", f"/jobs/{job.id}/retry",
                           browser.post(f"/jobs/{job.id}/retry", form))
        assert response.status_code == 403
        assert response.json()["error"]["code"] == "csrf_failed"
    assert table_fingerprint() == before
    response = browser.post(f"/jobs/{job.id}/retry", {"csrfmiddlewaretoken": csrf,
                                                      "mode": "reset"})
    assert response.status_code == 200, response.content[:300]
    assert PersistentJob.objects.get(pk=job.pk).attempts == 0
    response = browser.post("/jobs/", f"csrfmiddlewaretoken={csrf}&job_type=test.noop"
                                      "&payload=%7B%22n%22%3A+1%7D", content_type=FORM)
    assert response.status_code == 201, response.content[:300]
    assert response.json()["job"]["payload"] == {"n": 1}
    response = browser.post(f"/jobs/{job.id}/cancel", {"csrfmiddlewaretoken": csrf})
    assert response.status_code == 200, response.content[:300]


def test_the_document_declares_the_form_bodies():
    """Every POST takes JSON and both form encodings, each with a schema of its fields."""
    paths = document()["paths"]
    for path in ("/", "/{job_id}/retry", "/{job_id}/cancel"):
        content = paths[path]["post"]["requestBody"]["content"]
        assert set(content) == {"application/json", FORM, "multipart/form-data"}, path
    enqueue_form = paths["/"]["post"]["requestBody"]["content"][FORM]["schema"]
    schemas = document()["components"]["schemas"]
    name = enqueue_form["$ref"].rsplit("/", 1)[1]
    assert (set(schemas[name]["properties"]) - {"csrfmiddlewaretoken"}
            == set(schemas["EnqueueRequest"]["properties"]))
    validator = jsonschema_rs.Draft202012Validator({**schemas[name], "components": schemas},
                                                   validate_formats=True)
    assert validator.is_valid({"job_type": "test.noop", "payload": '{"n": 1}', "priority": "-3",
                               "delay": "1.5", "run_at": "2030-01-01T00:00:00Z", "queue": "",
                               "dedup": ""})
    for bad in ({"priority": "high"}, {"delay": "1_000"}, {"run_at": "tomorrow"},
                {"dedup": "sometimes"}, {"colour": "red"}, {"job_type": ""}):
        assert not validator.is_valid({"job_type": "test.noop", **bad}), bad


def test_an_unreadable_form_is_a_json_400_and_does_nothing(client: Client,
                                                           operator_token: str):
    """A multipart body without a boundary, or a url-encoded one in another charset than
    UTF-8: Django refuses to parse it; the API says so in JSON instead of acting on no fields
    (an empty form would cancel)."""
    job = stage(status="failed")
    before = table_fingerprint()
    for content_type, body in (("multipart/form-data", b"x"),
                               (f"{FORM}; charset=latin-1", b"mode=now")):
        path = f"/jobs/{job.id}/cancel"
        response = checked("POST", path, client.generic(
            "POST", path, body, content_type=content_type, **bearer(operator_token)))
        assert response.status_code == 400, (content_type, response.content[:300])
        assert response.json()["error"]["field"] == "body"
    assert table_fingerprint() == before
