"""Property-based fuzzing of the operator API from its own OpenAPI document (schemathesis).

Schemathesis loads the document the API serves and generates requests for every operation, both
valid ones and ones the document forbids. For every response: no 5xx, the status, content type,
headers and body are ones the document declares, input the document forbids is rejected (4xx),
and a rejected request changed nothing in the job tables.

To reach more than "404 for a random id", some generated cases are pointed at real jobs (in
every state) and at a registered job type, so retries, cancels, 409s and enqueues happen too.
Bounded to a few hundred examples in total.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from django.core import signals
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from hypothesis import HealthCheck, settings
from schemathesis import checks

from django_persistent_jobs.models import JobStatus
from tests.api_support import ALL_PERMS, make_token, make_user, stage, table_fingerprint

schema = schemathesis.openapi.from_wsgi("/jobs/openapi.json", get_wsgi_application())

CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_headers_conformance,
    checks.response_schema_conformance,
    checks.negative_data_rejection,
]

pytestmark = [pytest.mark.django_db, pytest.mark.timeout(300)]


@pytest.fixture
def keep_connection() -> Iterator[None]:
    """Requests go straight into Django's WSGI handler, which would close the database
    connection at each request's end, and with it the test's transaction. Django's own test
    client disconnects the same handlers."""
    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    yield
    signals.request_started.connect(close_old_connections)
    signals.request_finished.connect(close_old_connections)


@pytest.fixture(params=["unbound", "tenant-bound"])
def fuzz_env(request: Any, keep_connection: None) -> dict[str, Any]:
    """A token with every permission (unbound, or bound to tenant "acme"), and a job in every
    status, of tenant "acme" and of another tenant, to aim generated ids at."""
    tenant = "acme" if request.param == "tenant-bound" else None
    secret = make_token(make_user("fuzzer", *ALL_PERMS), tenant=tenant)
    jobs = [str(stage(status=status, tenant=owner).id)
            for status in JobStatus.values for owner in ("acme", "globex")]
    return {"headers": {"Authorization": f"Bearer {secret}"}, "jobs": jobs, "tenant": tenant,
            "rng": random.Random(1234)}


def _jobs_in(body: Any) -> list[dict[str, Any]]:
    """Every job object in a response body."""
    if not isinstance(body, dict):
        return []
    if isinstance(body.get("results"), list):
        return [j for j in body["results"] if isinstance(j, dict)]
    if isinstance(body.get("job"), dict):
        return [body["job"]]
    return [body] if "job_type" in body and "id" in body else []


@schema.parametrize()
@settings(max_examples=20, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_api_conforms_to_its_openapi_document(case: Any, fuzz_env: dict[str, Any]) -> None:
    rng: random.Random = fuzz_env["rng"]
    # Aim only valid (positive) cases at real data: a negative case must stay invalid.
    negative = case.meta is not None and case.meta.generation.mode.is_negative
    if "job_id" in (case.path_parameters or {}) and not negative and rng.random() < 0.6:
        case.path_parameters["job_id"] = rng.choice(fuzz_env["jobs"])
    if (case.method == "POST" and case.path == "/" and isinstance(case.body, dict)
            and not negative and rng.random() < 0.5):
        case.body["job_type"] = "test.noop"
    before = table_fingerprint()
    response = case.call_and_validate(headers=fuzz_env["headers"], checks=CHECKS)
    if response.status_code >= 400:
        assert table_fingerprint() == before, (
            f"{case.method} {case.path} answered {response.status_code} but changed the "
            f"job tables:\n{response.text[:500]}")
    tenant = fuzz_env["tenant"]
    if tenant is not None and response.status_code < 400 and case.path != "/openapi.json":
        body = response.json()
        # Confinement, whatever the generated filters or ids: nothing of another tenant leaks.
        assert all(job.get("tenant") == tenant for job in _jobs_in(body)), body
        if case.path == "/stats":
            assert body["tenant"] == tenant
