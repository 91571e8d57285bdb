"""OpenTelemetry spans and metrics for job attempts (optional: the ``otel`` extra).

``instrument()`` connects receivers to the runner's signals: each attempt becomes a span (kind
CONSUMER, named after the job type) that is current while the handler runs, so spans the handler
or an instrumented library creates are its children; and two instruments record attempts and
their durations. Only the OpenTelemetry *API* is used: the application configures the SDK and
exporters, as OpenTelemetry intends for libraries.
"""

from __future__ import annotations

import threading
from typing import Any

from . import signals

INSTRUMENTATION_NAME = "django_persistent_jobs"

#: Open spans by (job id, attempt): the attempt's start and end may be seen by different threads.
_open: dict[tuple[Any, int], tuple[Any, Any, int]] = {}
_lock = threading.Lock()
_state: dict[str, Any] = {}


def instrument(tracer_provider: Any = None, meter_provider: Any = None) -> None:
    """Start tracing and measuring job attempts in this process (idempotent).

    Call it where the process starts (``AppConfig.ready()``, or a runner's entry point), with
    providers or with the globally configured ones.
    """
    from opentelemetry import metrics, trace

    tracer = trace.get_tracer(INSTRUMENTATION_NAME, tracer_provider=tracer_provider)
    meter = metrics.get_meter(INSTRUMENTATION_NAME, meter_provider=meter_provider)
    _state["tracer"] = tracer
    _state["attempts"] = meter.create_counter(
        "persistent_jobs.attempts", unit="{attempt}", description="Job attempts that ended.")
    _state["duration"] = meter.create_histogram(
        "persistent_jobs.attempt.duration", unit="s", description="How long attempts ran.")
    signals.job_started.connect(_started, weak=False, dispatch_uid="pj-otel-started")
    signals.job_finished.connect(_finished, weak=False, dispatch_uid="pj-otel-finished")


def uninstrument() -> None:
    signals.job_started.disconnect(dispatch_uid="pj-otel-started")
    signals.job_finished.disconnect(dispatch_uid="pj-otel-finished")
    _state.clear()
    with _lock:
        _open.clear()


def _attributes(kwargs: dict[str, Any]) -> dict[str, Any]:
    attributes = {
        "persistent_jobs.job.id": str(kwargs["job_id"]),
        "persistent_jobs.job.type": kwargs["job_type"],
        "persistent_jobs.attempt": kwargs["attempt"],
        "persistent_jobs.runner.id": kwargs["runner_id"],
    }
    if kwargs.get("queue") is not None:
        attributes["persistent_jobs.queue"] = kwargs["queue"]
    if kwargs.get("tenant") is not None:
        attributes["persistent_jobs.tenant"] = kwargs["tenant"]
    return attributes


def _started(sender: Any, **kwargs: Any) -> None:
    from opentelemetry import context, trace

    tracer = _state.get("tracer")
    if tracer is None:
        return
    span = tracer.start_span(kwargs["job_type"], kind=trace.SpanKind.CONSUMER,
                             attributes=_attributes(kwargs))
    # Current in this (the worker) thread while the handler runs; detached when the attempt
    # ends here. If another thread settles it (a timeout), the next attempt this thread starts
    # replaces it as current.
    token = context.attach(trace.set_span_in_context(span))
    with _lock:
        _open[(kwargs["job_id"], kwargs["attempt"])] = (span, token, threading.get_ident())


def _finished(sender: Any, **kwargs: Any) -> None:
    from opentelemetry import context, trace

    with _lock:
        found = _open.pop((kwargs["job_id"], kwargs["attempt"]), None)
    outcome, error_code = kwargs["outcome"], kwargs["error_code"]
    labels = {"persistent_jobs.job.type": kwargs["job_type"], "persistent_jobs.outcome": outcome}
    if error_code:
        labels["error.type"] = error_code
    if "attempts" in _state:
        _state["attempts"].add(1, labels)
        if kwargs.get("duration") is not None:
            _state["duration"].record(kwargs["duration"], labels)
    if found is None:
        return  # started elsewhere (a rescued attempt), or before instrument()
    span, token, thread_id = found
    span.set_attribute("persistent_jobs.outcome", outcome)
    span.set_attribute("persistent_jobs.status", kwargs["status"])
    if outcome == "completed":
        span.set_status(trace.Status(trace.StatusCode.OK))
    else:
        span.set_attribute("error.type", error_code or outcome)
        span.set_status(trace.Status(trace.StatusCode.ERROR, error_code or outcome))
    span.end()
    if thread_id == threading.get_ident():
        context.detach(token)
