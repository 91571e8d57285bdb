"""Prometheus metrics (optional: ``pip install django-persistent-jobs[metrics]``).

Two kinds of numbers, from two sources, because a deployment runs many processes:

* **State** (queue depth, oldest job's age, dead letters, live runners) is read from the
  database at scrape time. It is the same whichever process is scraped, so it is always right,
  and when several targets export it, aggregate with ``max``, never ``sum``.
* **Events** (attempts started, succeeded, failed, dead-lettered, rescued; duration and
  queue-wait histograms) are counted in the process where they happen, from the runner's
  signals. Each runner process is its own scrape target and Prometheus sums across targets.
  Deriving these from the database instead would break counter semantics: retention deletes
  old rows, and a counter read as ``count(*)`` would go down. Processes started by one command
  share one port through prometheus_client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``),
  which ``render`` honours and ``runjobs --metrics-port`` turns on for its worker processes.

A process counts events only once it exports metrics (``enable``: ``runjobs --metrics-port``,
the first request to ``metrics_view``, or multiprocess mode), so runners that are not scraped
pay nothing for them.
"""

from __future__ import annotations

import atexit
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

from django.db import connections
from django.http import HttpRequest, HttpResponse

from . import conf, signals

logger = logging.getLogger("django_persistent_jobs.metrics")

# prometheus_client is imported only when metrics are first used, never at app start: its
# multiprocess mode is decided by PROMETHEUS_MULTIPROC_DIR *when it is imported*, and
# ``runjobs --metrics-port`` sets that variable before this package imports it
# (``serve_for_command``); if another app imported it first, ``use_multiprocess_dir`` switches it.


def _prom() -> Any:
    import prometheus_client

    return prometheus_client


NAMESPACE = "persistent_jobs"
INSTALL_HINT = ("Prometheus metrics need prometheus-client: "
                "pip install 'django-persistent-jobs[metrics]'.")

#: Handler run times span milliseconds to the default 300 s timeout.
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300,
                    600, 1800, 3600)
#: Time from due to started: near zero for an idle runner, minutes or more in a backlog.
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120,
                300, 600, 1800, 3600, 7200)


def available() -> bool:
    return importlib.util.find_spec("prometheus_client") is not None


class _Events:
    """The per-process event metrics. Not registered in prometheus_client's global registry:
    ``render`` adds them to its own, so importing this module never clashes with an
    application's metrics."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Histogram

        self.started = Counter(
            "started", "Attempts a runner began executing.", ["job_type", "queue"],
            namespace=NAMESPACE, registry=None)
        self.succeeded = Counter(
            "succeeded", "Attempts that completed successfully.", ["job_type", "queue"],
            namespace=NAMESPACE, registry=None)
        self.failed = Counter(
            "failed", "Attempts that failed with a retry scheduled (including timeouts and "
            "rescues).", ["job_type", "error_code"], namespace=NAMESPACE, registry=None)
        self.dead_lettered = Counter(
            "dead_lettered", "Jobs dead-lettered.", ["job_type", "error_code"],
            namespace=NAMESPACE, registry=None)
        self.rescued = Counter(
            "rescued_attempts", "Attempts of dead runners that this process rescued.",
            ["job_type"], namespace=NAMESPACE, registry=None)
        self.duration = Histogram(
            "duration_seconds", "How long attempts ran, by job type.", ["job_type", "queue"],
            namespace=NAMESPACE, registry=None, buckets=DURATION_BUCKETS)
        self.queue_wait = Histogram(
            "queue_wait_seconds", "From when a job was due to when an attempt started.",
            ["job_type", "queue"], namespace=NAMESPACE, registry=None, buckets=WAIT_BUCKETS)

        # The labelled children of the per-job metrics, by (job_type, queue): ``labels()`` costs
        # more than the increment itself, and it would run twice for every job.
        self._children: dict[tuple[str, str], tuple[Any, Any, Any, Any]] = {}

    def children(self, job_type: str, queue: str) -> tuple[Any, Any, Any, Any]:
        """(started, queue_wait, succeeded, duration) for this job type and queue."""
        key = (job_type, queue)
        found = self._children.get(key)
        if found is None:
            found = (self.started.labels(job_type, queue), self.queue_wait.labels(job_type, queue),
                     self.succeeded.labels(job_type, queue), self.duration.labels(job_type, queue))
            self._children[key] = found
        return found

    def collect(self) -> Iterator[Any]:
        for metric in (self.started, self.succeeded, self.failed, self.dead_lettered,
                       self.rescued, self.duration, self.queue_wait):
            yield from metric.collect()


_events: _Events | None = None
#: Whether ``_count_in_files`` switched an already imported prometheus_client (``_OnlyOurs``).
_switched = False
_lock = threading.Lock()


def events() -> _Events:
    global _events
    if _events is None:
        with _lock:
            if _events is None:
                _events = _Events()
    return _events


def _on_started(sender: Any, *, job_type: str, queue: str | None, due_at: Any = None,
                **_: Any) -> None:
    if queue is None:  # (the runner always knows it; a foreign sender may not)
        return
    started, queue_wait, _, _ = events().children(job_type, queue)
    started.inc()
    if isinstance(due_at, datetime):
        # The runner's clock against the database's next_run_at: skew shows up here, so the
        # wait is clamped at zero rather than reported negative.
        queue_wait.observe(max(0.0, time.time() - due_at.timestamp()))


def _on_finished(sender: Any, *, job_type: str, queue: str | None, outcome: str, status: str,
                 error_code: str, duration: float | None, **_: Any) -> None:
    """Count a settled attempt. The per-queue children are looked up only when something is
    counted in them: a lookup creates all four series, and an attempt settled by another
    runner (rescued, handed back) observes no duration, so it would only add empty series
    (with an empty queue label, if its queue were not known)."""
    ev = events()
    if status == "failed":
        ev.failed.labels(job_type, error_code).inc()
    elif status == "dead_lettered":
        ev.dead_lettered.labels(job_type, error_code).inc()
    if outcome == "rescued":
        ev.rescued.labels(job_type).inc()
    if queue is None or (status != "completed" and duration is None):
        return
    _, _, succeeded, run_time = ev.children(job_type, queue)
    if status == "completed":
        succeeded.inc()
    if duration is not None:
        run_time.observe(duration)


def enable() -> bool:
    """Start counting this process's job events; False if prometheus-client is missing."""
    if not available():
        return False
    events()
    signals.job_started.connect(_on_started, weak=False, dispatch_uid="pj-metrics-started")
    signals.job_finished.connect(_on_finished, weak=False, dispatch_uid="pj-metrics-finished")
    return True


def connect_signals() -> None:
    """At app start: in multiprocess mode every process counts (another one exports)."""
    if available() and os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        enable()


# ----------------------------------------------------------------------------- state
_ACTIVE_SQL = """
SELECT queue, status, count(*),
       coalesce(extract(epoch FROM now() - min(next_run_at) FILTER (WHERE next_run_at <= now())),
                0)
FROM persistent_jobs WHERE status IN ('pending', 'failed') GROUP BY queue, status
UNION ALL
SELECT j.queue, j.status, count(*),
       coalesce(extract(epoch FROM now() - nullif(min(coalesce(
           (SELECT CASE WHEN a.started THEN a.started_at ELSE 'infinity'::timestamptz END
            FROM persistent_jobs_attempts a WHERE a.id = j.lock_token),
           j.locked_at)), 'infinity'::timestamptz)), 0)
FROM persistent_jobs j WHERE j.status = 'running' GROUP BY j.queue, j.status
UNION ALL
SELECT queue, status, count(*), NULL
FROM persistent_jobs WHERE status = 'dead_lettered' GROUP BY queue, status
"""
# Three statements, one per partial index (claim, running, finished), so a scrape reads only
# waiting, running and dead-lettered rows however much completed history the table holds.
# A running job's age counts from its current attempt's start, not from its claim: a job
# claimed to wait in its runner for a free worker (``PREFETCH``, its attempt not ``started``;
# 'infinity' here, so never the oldest) has not run at all, and one that waited is not that
# much closer to its timeout, which starts with the run. A running job without an attempt row
# (written by hand) counts from its claim. The attempt is read by a correlated sub-select on
# its primary key (``lock_token`` is its id), not a join: with statistics that expect many
# running jobs, a join was planned as a hash of the whole attempt history.

_RUNNERS_SQL = """
SELECT queues, job_types, count(*), coalesce(sum(concurrency), 0) FROM persistent_jobs_runners
WHERE heartbeat_at > now() - %s * interval '1 second' GROUP BY queues, job_types
"""
# Due waiting jobs per queue and type (the claim index's rows), to tell which of them no live
# runner will claim: a runner claims only the types it has handlers for.
_DUE_TYPES_SQL = """
SELECT queue, job_type, count(*) FROM persistent_jobs
WHERE status IN ('pending', 'failed') AND next_run_at <= now() GROUP BY queue, job_type
"""


class DatabaseCollector:
    """Reads queue state from the database at each scrape."""

    def __init__(self, close_connection: bool = False) -> None:
        # The standalone HTTP server runs each scrape in a new thread: its connection must be
        # closed after the scrape or every scrape would leave one behind.
        self.close_connection = close_connection

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        alias = conf.settings.DATABASE
        up = GaugeMetricFamily(f"{NAMESPACE}_database_up",
                               "1 if the last scrape could read the job tables.")
        try:
            with connections[alias].cursor() as cursor:
                cursor.execute(_ACTIVE_SQL)
                active = cursor.fetchall()
                cursor.execute(_RUNNERS_SQL, [conf.settings.STALE_LOCK_TIMEOUT])
                runners = cursor.fetchall()
                cursor.execute(_DUE_TYPES_SQL)
                due_types = cursor.fetchall()
        except Exception as exc:
            logger.warning("metrics: cannot read the job tables: %s", exc,
                           extra={"event": "metrics_db_error"})
            up.add_metric([], 0)
            yield up
            return
        finally:
            if self.close_connection:
                connections[alias].close()
        up.add_metric([], 1)
        yield up
        jobs = GaugeMetricFamily(
            f"{NAMESPACE}_jobs", "Jobs waiting (pending, failed), running or dead-lettered.",
            labels=["queue", "status"])
        age = GaugeMetricFamily(
            f"{NAMESPACE}_oldest_job_age_seconds",
            "pending/failed: how long the oldest due job has been due; running: how long the "
            "longest-running attempt has run.", labels=["queue", "status"])
        queues: set[str] = set()
        dead_lettered: set[str] = set()
        for queue, status, count, oldest in active:
            queues.add(queue)
            if status == "dead_lettered":
                dead_lettered.add(queue)
            jobs.add_metric([queue, status], count)
            if oldest is not None:
                age.add_metric([queue, status], float(oldest))
        live = GaugeMetricFamily(f"{NAMESPACE}_runners",
                                 "Runner processes with a fresh heartbeat.")
        per_queue = GaugeMetricFamily(
            f"{NAMESPACE}_queue_runners",
            "Live runners serving each queue that has jobs or a dedicated runner.",
            labels=["queue"])
        total = 0
        all_queue_runners = 0
        dedicated: dict[str, int] = {}
        for served, _types, count, _slots in runners:
            total += count
            names = _queue_list(served)
            if names is None:
                all_queue_runners += count
            else:
                for name in names:
                    dedicated[name] = dedicated.get(name, 0) + count
        # Every known queue has a dead-letter series, 0 until its first dead letter: a series
        # that appears at 1 has no earlier sample, so ``delta``/``increase`` over it (the
        # "dead letters growing" alert) would miss a queue's first dead letters. Known: a queue
        # with active jobs (a job is active before it is dead-lettered), one a live runner
        # is dedicated to, or a handler's default queue.
        for queue in sorted((queues | set(dedicated) | _handler_queues()) - dead_lettered):
            jobs.add_metric([queue, "dead_lettered"], 0)
        yield jobs
        yield age
        live.add_metric([], total)
        for queue in sorted(queues | set(dedicated)):
            per_queue.add_metric([queue], all_queue_runners + dedicated.get(queue, 0))
        yield live
        yield per_queue
        yield _unhandled(runners, due_types)


def _handler_queues() -> set[str]:
    """The default queues of the handlers this process registers."""
    from .handlers import registry

    return {spec.effective_queue() for spec in registry}


def _unhandled(runners: list[tuple[Any, ...]], due_types: list[tuple[Any, ...]]) -> Any:
    """Due waiting jobs on a queue some live runner serves, of a type none of the runners
    serving that queue has a handler for: they wait until a runner with the handler starts
    (the dashboard's ``unhandled_type``). Unserved queues are ``queue_runners``' business; a
    runner whose row lists no types (from before runners listed them) may handle any."""
    from prometheus_client.core import GaugeMetricFamily

    from .stats import type_unhandled

    family = GaugeMetricFamily(
        f"{NAMESPACE}_unhandled_jobs",
        "Due waiting jobs whose type no live runner serving their queue has a handler for.",
        labels=["queue", "job_type"])
    serving = [(_queue_list(queues), _type_list(types)) for queues, types, *_ in runners]
    for queue, job_type, count in due_types:
        if type_unhandled(serving, queue, job_type):
            family.add_metric([queue, job_type], count)
    return family


def _json_column(value: Any) -> Any:
    """A jsonb column of the runners table as read here (text on some drivers' paths)."""
    if isinstance(value, str):
        import json

        return json.loads(value)
    return value


def _type_list(value: Any) -> set[str] | None:
    """The job types a runner's row lists (JSON; null: not listed, so any)."""
    value = _json_column(value)
    return None if value is None else {str(v) for v in value}


def _queue_list(value: Any) -> list[str] | None:
    """The runners table stores served queues as JSON (null: every queue)."""
    value = _json_column(value)
    return [str(v) for v in value] if value else None


class _EventsCollector:
    def collect(self) -> Iterator[Any]:
        if _events is not None:
            yield from _events.collect()


class _OnlyOurs:
    """This app's families of a multiprocess collector, after ``_count_in_files`` switched a
    process whose other metrics were made before the switch: their children made since count
    in the directory too, and exporting those would show such a metric in part (the series
    first used after the switch, not the others)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def collect(self) -> Iterator[Any]:
        return (family for family in self.inner.collect()
                if family.name.startswith(f"{NAMESPACE}_"))


def registry(*, close_connection: bool = False) -> Any:
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry(auto_describe=False)
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        files = multiprocess.MultiProcessCollector(None)  # type: ignore[no-untyped-call]  # unannotated upstream
        reg.register(_OnlyOurs(files) if _switched else files)
    else:
        reg.register(_EventsCollector())
    reg.register(DatabaseCollector(close_connection))
    return reg


def render(*, close_connection: bool = False) -> bytes:
    """The exposition text: this process's events and the database's state."""
    return bytes(_prom().generate_latest(registry(close_connection=close_connection)))


def metrics_view(request: HttpRequest) -> HttpResponse:
    """Mount anywhere (``path("metrics", metrics_view)``). Authenticated like the API: a bearer
    token (Prometheus ``authorization`` config) or a session whose user can view jobs; a
    tenant-bound token is refused, since these numbers cover every tenant."""
    from django.db import DatabaseError

    from .api import auth
    from .api.http import ApiError, database_unavailable, error_response

    try:
        if request.method not in ("GET", "HEAD"):
            raise ApiError(405, "method_not_allowed", "Use GET.", headers={"Allow": "GET"})
        try:
            caller = auth.authenticate(request)
        except DatabaseError as exc:
            # Checking the credentials needs the database; without it nobody can be told
            # apart, so no numbers. A 503 is what Prometheus records as the target being down
            # (``up == 0``), which the documented alert for this case watches. The API's own
            # answer: the cause is logged, not shown to a caller nobody could authenticate.
            raise database_unavailable(exc) from None
        caller.require(auth.VIEW)
        caller.require_unconfined()
        if not enable():
            raise ApiError(501, "metrics_unavailable", INSTALL_HINT)
    except ApiError as error:
        return error_response(error)
    return HttpResponse(render(), content_type=_prom().CONTENT_TYPE_LATEST)


def public_metrics_view(request: HttpRequest) -> HttpResponse:
    """The same numbers without authentication, for endpoints that only the network's own
    scraper can reach. Job types, queues and error codes are visible to whoever can."""
    if not enable():
        return HttpResponse(INSTALL_HINT, status=501, content_type="text/plain")
    return HttpResponse(render(), content_type=_prom().CONTENT_TYPE_LATEST)


def serve(port: int, addr: str = "0.0.0.0") -> Any:
    """Serve ``/metrics`` on ``port`` from a daemon thread (``runjobs --metrics-port``)."""
    from .conf import ConfigurationError

    if not enable():
        raise ConfigurationError(INSTALL_HINT)
    server, _thread = _prom().start_http_server(
        port, addr=addr, registry=registry(close_connection=True))
    logger.info("metrics served on %s:%d/metrics", addr, port,
                extra={"event": "metrics_serving", "port": port})
    return server


def serve_for_command(port: int) -> Any:
    """``serve`` for a management command: bad ports and a missing extra become CommandError."""
    from django.core.management.base import CommandError

    from .conf import ConfigurationError

    if not 0 < port < 65536:
        raise CommandError(f"--metrics-port must be a TCP port (1..65535), got {port}.")
    use_multiprocess_dir()
    try:
        return serve(port)
    except ConfigurationError as exc:
        raise CommandError(str(exc)) from exc
    except OSError as exc:
        raise CommandError(f"Cannot serve metrics on port {port}: {exc}") from exc


def use_multiprocess_dir() -> str | None:
    """Count events in prometheus_client's multiprocess mode, in a private directory, unless
    the environment already chose a directory; returns the directory, or None if this process
    could not be put in that mode (said in a warning).

    A ``runjobs`` may run jobs in worker processes it spawns (``--processes``): they inherit the
    environment, count into the same directory, and this process's scrape sums them all. With
    one process the numbers are the same either way.

    prometheus_client picks its mode when it is first imported, from ``PROMETHEUS_MULTIPROC_DIR``
    (``values.ValueClass``), and each metric's value reads that class when it is made. An app
    in ``INSTALLED_APPS`` may have imported it before this runs (django-prometheus does): then
    the value class is made again for the directory (``values.get_value_class()``, what
    prometheus_client's own tests do), so every metric made from now on in this process,
    ours included, counts in the directory. The port then exports only this app's metrics
    from the directory: another app's metric made before the switch would get only its
    later series there, a partial metric.
    """
    existing = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    path = existing or tempfile.mkdtemp(prefix="persistent-jobs-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    if "prometheus_client" in sys.modules and not _count_in_files(path):
        logger.warning(
            "metrics: prometheus_client was imported before runjobs could turn on its "
            "multiprocess mode, and this version of it cannot be switched: %s. Set "
            "PROMETHEUS_MULTIPROC_DIR to an empty directory in runjobs' environment.",
            "this process's own events (rescues, timeouts) are not exported" if existing else
            "jobs run in worker processes (--processes) are not counted",
            extra={"event": "metrics_multiprocess_unavailable"})
        if existing:
            return existing
        # Without the mode here, the directory's exposition would have the workers' counts
        # but not this process's own: count everything in memory, as the warning says.
        del os.environ["PROMETHEUS_MULTIPROC_DIR"]
        shutil.rmtree(path, ignore_errors=True)
        return None
    if not existing:
        atexit.register(shutil.rmtree, path, True)
    return path


def _count_in_files(path: str) -> bool:
    """Put an already imported prometheus_client in multiprocess mode (see
    ``use_multiprocess_dir``); False if its version offers no way to."""
    from prometheus_client import values

    if getattr(values.ValueClass, "_multiprocess", False):
        return True
    make = getattr(values, "get_value_class", None)
    if make is None:
        return False
    value_class = make()
    if not getattr(value_class, "_multiprocess", False):
        return False
    global _events, _switched
    with _lock:
        values.ValueClass = value_class
        _switched = True
        # Events made before counted in memory, which the directory's exposition does not
        # read: made again, from the new class (nothing has been counted yet at start-up).
        _events = None
    logger.info("metrics: prometheus_client was imported before runjobs chose its mode (an "
                "app such as django-prometheus imports it); metrics made from now on in this "
                "process count in %s, with the worker processes'", path,
                extra={"event": "metrics_multiprocess_switched"})
    return True
