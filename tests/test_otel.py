"""OpenTelemetry: a real runner's attempts become spans (current while the handler runs) and
measurements, through the SDK's in-memory exporter and reader."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from django_persistent_jobs import enqueue, job_handler, otel
from django_persistent_jobs.models import JobStatus
from django_persistent_jobs.runner import Runner
from tests.core_support import wait_for
from tests.runner_support import isolated_registry, wait_status

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

__all__ = ["isolated_registry"]  # a fixture, used by name


@pytest.fixture
def telemetry() -> Iterator[tuple[InMemorySpanExporter, InMemoryMetricReader, Any]]:
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    otel.instrument(tracer_provider=tracer_provider,
                    meter_provider=MeterProvider(metric_readers=[reader]))
    yield exporter, reader, tracer_provider
    otel.uninstrument()


def test_attempts_become_spans_and_measurements(
        telemetry: Any, isolated_registry: Any, start_runner: Callable[..., Runner]):
    exporter, reader, tracer_provider = telemetry
    inner = tracer_provider.get_tracer("handler")

    @job_handler("otel.traced", max_retries=1, backoff=lambda attempt: 0)
    def traced(payload: dict[str, Any]) -> None:
        with inner.start_as_current_span("inside the handler"):
            pass
        if payload.get("fail"):
            raise RuntimeError("boom")

    ok = enqueue("otel.traced", {}, tenant="acme")
    bad = enqueue("otel.traced", {"fail": True})
    start_runner(concurrency=1)
    wait_status(ok.id, JobStatus.COMPLETED)
    wait_status(bad.id, JobStatus.DEAD_LETTERED)
    # A job's status commits before its span ends (the span ends after the completion is
    # written), so wait for all six spans rather than trusting the status alone.
    spans = wait_for(lambda: (s := exporter.get_finished_spans()) and len(s) >= 6 and s,
                     message="six spans (three attempts, three inside their handlers)")
    jobs = [s for s in spans if s.name == "otel.traced"]
    handler_spans = [s for s in spans if s.name == "inside the handler"]
    assert len(jobs) == 3 and len(handler_spans) == 3
    assert all(s.kind == trace.SpanKind.CONSUMER for s in jobs)
    # Spans made inside the handler are children of the attempt's span.
    job_span_ids = {s.context.span_id for s in jobs}
    assert {s.parent.span_id for s in handler_spans} == job_span_ids
    [done] = [s for s in jobs if s.attributes["persistent_jobs.job.id"] == str(ok.id)]
    assert done.status.status_code == trace.StatusCode.OK
    assert done.attributes["persistent_jobs.tenant"] == "acme"
    assert done.attributes["persistent_jobs.outcome"] == "completed"
    failed = sorted((s for s in jobs if s.attributes["persistent_jobs.job.id"] == str(bad.id)),
                    key=lambda s: s.attributes["persistent_jobs.attempt"])
    assert [s.attributes["persistent_jobs.outcome"] for s in failed] == ["failed",
                                                                         "dead_lettered"]
    assert all(s.status.status_code == trace.StatusCode.ERROR for s in failed)
    assert failed[0].attributes["error.type"] == "HANDLER_ERROR"

    data = reader.get_metrics_data()
    points = {m.name: m.data.data_points for rm in data.resource_metrics
              for sm in rm.scope_metrics for m in sm.metrics}
    attempts = {(p.attributes["persistent_jobs.outcome"]): p.value
                for p in points["persistent_jobs.attempts"]}
    assert attempts == {"completed": 1, "failed": 1, "dead_lettered": 1}
    assert sum(p.count for p in points["persistent_jobs.attempt.duration"]) == 3
