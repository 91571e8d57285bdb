"""Prometheus metrics: scraped from a real ``runjobs --metrics-port`` during a real drain, they
match the database's counts; the mountable view reads queue state from the database, is
authenticated like the API, and every name follows Prometheus conventions."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from django_persistent_jobs import enqueue_many
from django_persistent_jobs.models import JobRunnerRecord, PersistentJob
from tests.api_support import ALL_PERMS, bearer, make_token, make_user, stage

Spawn = Callable[..., "subprocess.Popen[bytes]"]


def parse(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Samples by (name, sorted labels)."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(samples: dict[Any, float], name: str, **labels: str) -> float:
    return sum(v for (n, lbl), v in samples.items()
               if n == name and all(dict(lbl).get(k) == x for k, x in labels.items()))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def scrape(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            return str(response.read().decode())
    except OSError:
        return None


def db_counts() -> dict[str, int]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT (SELECT count(*) FROM persistent_jobs_attempts), "
            "(SELECT count(*) FROM persistent_jobs_attempts WHERE outcome = 'completed'), "
            "(SELECT count(*) FROM persistent_jobs_attempts WHERE outcome = 'failed'), "
            "(SELECT count(*) FROM persistent_jobs WHERE status = 'dead_lettered'), "
            "(SELECT count(*) FROM persistent_jobs WHERE status IN ('pending', 'failed', "
            "'running'))")
        started, completed, failed, dead, active = cursor.fetchone()
    return {"started": started, "succeeded": completed, "failed": failed, "dead": dead,
            "active": active}


def runjobs_accepts(option: str) -> bool:
    from django_persistent_jobs.management.commands.runjobs import Command

    parser = Command().create_parser("manage.py", "runjobs")
    return any(option in action.option_strings for action in parser._actions)


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(180)
@pytest.mark.parametrize("processes", [None, 2])
def test_metrics_scraped_during_a_real_drain_match_the_database(
        spawn_runner: Spawn, processes: int | None):
    """With worker processes, jobs run (and are counted) in processes other than the one
    serving the port: their counts must still all reach its exposition."""
    if processes is not None and not runjobs_accepts("--processes"):
        pytest.skip("this runjobs has no --processes")
    port = free_port()
    items: list[Any] = [("test.ledger", {"note": str(i), "sleep": 0.05}) for i in range(40)]
    items += [("test.ledger", {"fail_times": 1}) for _ in range(10)]
    items += [("test.ledger", {"permanent": True}) for _ in range(5)]
    items += [{"job_type": "test.ledger", "payload": {}, "queue": "side"} for _ in range(5)]
    enqueue_many(items)
    args = ["--metrics-port", str(port), "--concurrency", "4"]
    if processes is not None:
        args += ["--processes", str(processes)]
    proc = spawn_runner(*args)
    previous: dict[Any, float] = {}
    scrapes = 0
    mid_drain = 0  # scrapes that saw both finished attempts and jobs still to run
    deadline = time.monotonic() + 90
    while True:
        text = scrape(port)
        if text is not None:
            scrapes += 1
            samples = parse(text)
            after = db_counts()
            # A counter moves only after the outcome it counts committed, so a scrape can lag
            # the database but never lead it, and counters never go down.
            assert total(samples, "persistent_jobs_started_total") <= after["started"]
            assert total(samples, "persistent_jobs_succeeded_total") <= after["succeeded"]
            for key, value in samples.items():
                if key[0].endswith("_total"):
                    assert value >= previous.get(key, 0.0), key
            previous = samples
            if after["active"] and total(samples, "persistent_jobs_started_total"):
                mid_drain += 1
            if after["active"] == 0 and total(samples, "persistent_jobs_succeeded_total") == \
                    after["succeeded"] and total(samples, "persistent_jobs_dead_lettered_total") \
                    == after["dead"]:
                break
        assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
        assert time.monotonic() < deadline, "the drain did not finish"
        time.sleep(0.1)
    final = parse(scrape(port) or "")
    counts = db_counts()
    assert mid_drain >= 1, f"no scrape landed mid-drain ({scrapes} scrapes)"
    # 40 + 5 + 5 single attempts, 10 jobs failing once (two attempts each).
    assert counts == {"started": 70, "succeeded": 55, "failed": 10, "dead": 5, "active": 0}
    assert total(final, "persistent_jobs_started_total") == counts["started"]
    assert total(final, "persistent_jobs_succeeded_total") == counts["succeeded"]
    assert total(final, "persistent_jobs_succeeded_total", queue="side") == 5
    assert total(final, "persistent_jobs_failed_total", error_code="PLANNED") == counts["failed"]
    assert total(final, "persistent_jobs_dead_lettered_total",
                 job_type="test.ledger", error_code="PLANNED_PERMANENT") == counts["dead"]
    assert total(final, "persistent_jobs_duration_seconds_count") == counts["started"]
    assert total(final, "persistent_jobs_queue_wait_seconds_count") == counts["started"]
    assert total(final, "persistent_jobs_jobs", status="dead_lettered") == counts["dead"]
    assert total(final, "persistent_jobs_jobs", status="pending") == 0
    assert total(final, "persistent_jobs_runners") == JobRunnerRecord.objects.count() == 1
    assert total(final, "persistent_jobs_queue_runners", queue="default") == 1
    assert total(final, "persistent_jobs_database_up") == 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(180)
def test_worker_processes_are_counted_when_prometheus_client_was_imported_first(
        spawn_runner: Spawn):
    """An app in ``INSTALLED_APPS`` (django-prometheus) may import prometheus_client before
    ``runjobs --metrics-port`` can turn its multiprocess mode on: the events of the jobs run
    in worker processes must reach the exposition all the same."""
    if not runjobs_accepts("--processes"):
        pytest.skip("this runjobs has no --processes")
    port = free_port()
    enqueue_many([("test.ledger", {"note": str(i)}) for i in range(12)])
    proc = spawn_runner("--metrics-port", str(port), "--processes", "2", "--concurrency", "2",
                        "-v", "2",
                        env={"DJANGO_SETTINGS_MODULE": "tests.settings_prometheus_first",
                             "PJ_TEST_LOG": "INFO"})
    deadline = time.monotonic() + 90
    samples: dict[Any, float] = {}
    while True:
        text = scrape(port)
        if text is not None:
            samples = parse(text)
            if (db_counts()["active"] == 0
                    and total(samples, "persistent_jobs_succeeded_total") >= 12):
                break
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            output = proc.stdout.read().decode() if proc.stdout else ""
            raise AssertionError(f"counted {total(samples, 'persistent_jobs_started_total')} "
                                 f"of 12 starts; runner said:\n{output[-4000:]}")
        time.sleep(0.1)
    assert total(samples, "persistent_jobs_started_total") == 12
    assert total(samples, "persistent_jobs_succeeded_total") == 12
    assert total(samples, "persistent_jobs_duration_seconds_count") == 12
    proc.terminate()
    output = proc.communicate(timeout=60)[0].decode()
    assert "metrics made from now on in this process count in" in output, output


@pytest.fixture
def viewer_token() -> str:
    return make_token(make_user("prom", "view_persistentjob"))


@pytest.mark.django_db
def test_view_exports_queue_state_from_the_database(client: Client, viewer_token: str):
    stage(queue="mail", next_run_at=timezone.now() - timedelta(seconds=120))
    stage(queue="mail")
    stage(queue="mail", status="dead_lettered")
    stage(queue="bulk", status="running", locked_at=timezone.now() - timedelta(seconds=300),
          locked_by="gone")
    response = client.get("/metrics", **bearer(viewer_token))
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain")
    samples = parse(response.content.decode())
    assert total(samples, "persistent_jobs_jobs", queue="mail", status="pending") == 2
    assert total(samples, "persistent_jobs_jobs", queue="mail", status="dead_lettered") == 1
    assert total(samples, "persistent_jobs_jobs", queue="bulk", status="running") == 1
    wait = total(samples, "persistent_jobs_oldest_job_age_seconds", queue="mail",
                 status="pending")
    assert 119 <= wait < 600
    assert total(samples, "persistent_jobs_oldest_job_age_seconds", queue="bulk",
                 status="running") >= 299
    assert total(samples, "persistent_jobs_runners") == 0
    # No live runner serves either queue: the "no runner for a queue" alert's input.
    assert total(samples, "persistent_jobs_queue_runners", queue="mail") == 0
    assert ("persistent_jobs_queue_runners", (("queue", "bulk"),)) in samples


@pytest.mark.django_db
def test_every_known_queue_has_a_dead_letter_series_before_its_first_dead_letter(
        client: Client, viewer_token: str):
    """``delta``/``increase`` over a series that appears at 1 see no growth, so the documented
    "dead letters growing" alert would miss a queue's first dead letters: a queue with active
    jobs, one a live runner is dedicated to and a handler's default queue export 0 until then."""
    from django_persistent_jobs.handlers import registry

    stage(queue="mail")
    stage(queue="bulk", status="running", locked_by="r", locked_at=timezone.now())
    stage(queue="dl", status="dead_lettered")
    JobRunnerRecord.objects.create(id="r", hostname="h", pid=1, queues=["reserved"],
                                   concurrency=1)

    def dead_letters() -> dict[str, float]:
        samples = parse(client.get("/metrics", **bearer(viewer_token)).content.decode())
        return {dict(labels)["queue"]: value for (name, labels), value in samples.items()
                if name == "persistent_jobs_jobs" and dict(labels)["status"] == "dead_lettered"}

    handler_queues = {spec.effective_queue() for spec in registry}
    assert "default" in handler_queues
    assert dead_letters() == {**dict.fromkeys(handler_queues, 0.0), "mail": 0, "bulk": 0,
                              "reserved": 0, "dl": 1}
    mail = PersistentJob.objects.get(queue="mail")
    PersistentJob.objects.filter(pk=mail.pk).update(status="dead_lettered")
    assert dead_letters()["mail"] == 1  # the same series, from 0 to 1


@pytest.mark.django_db
def test_the_running_age_counts_from_the_attempts_start_not_the_claim(
        client: Client, viewer_token: str):
    """With ``PREFETCH`` a claimed job may wait in its runner for a free worker: the running
    age is the longest *run*, from the attempt's start, and a job that has not started yet
    (however long ago it was claimed) has not run at all."""
    from django_persistent_jobs.models import JobAttempt
    from tests.core_support import claim_as

    claimed = {}
    with connection.cursor() as cursor:
        for queue, direct in [("prefetched", 0), ("late", 1)]:
            job = stage(queue=queue)
            [claimed[queue]] = claim_as(cursor, "runner-1", 1, (queue,), direct=direct)
            assert claimed[queue].id == job.id
    long_ago = timezone.now() - timedelta(seconds=600)
    PersistentJob.objects.filter(pk__in=[c.id for c in claimed.values()]).update(
        locked_at=long_ago)
    JobAttempt.objects.filter(id=claimed["late"].token).update(
        started_at=timezone.now() - timedelta(seconds=20))
    samples = parse(client.get("/metrics", **bearer(viewer_token)).content.decode())
    assert total(samples, "persistent_jobs_jobs", queue="prefetched", status="running") == 1
    assert total(samples, "persistent_jobs_oldest_job_age_seconds", queue="prefetched",
                 status="running") == 0
    assert 19 <= total(samples, "persistent_jobs_oldest_job_age_seconds", queue="late",
                       status="running") < 300


@pytest.mark.django_db
def test_the_scrapes_state_statement_reads_the_partial_indexes() -> None:
    """The scrape reads waiting, running and dead-lettered jobs through the partial indexes,
    and each running job's attempt by its primary key, not a scan of the attempt history."""
    from django_persistent_jobs.metrics import _ACTIVE_SQL
    from django_persistent_jobs.models import JobAttempt

    # Statistics that expect many running jobs: a join to the attempts was then planned as a
    # hash of the whole attempt table.
    running = PersistentJob.objects.bulk_create([
        PersistentJob(job_type="test.noop", payload={}, status="running", locked_by="r",
                      lock_token=n) for n in range(1, 401)])
    JobAttempt.objects.bulk_create([JobAttempt(id=job.lock_token, job=job, attempt=1,
                                               runner_id="r") for job in running])
    # And a history, as a real table has: pj_type_status_idx also holds cancelled jobs, so
    # reading the waiting ones through it would read that history too. (Without one, the
    # planner's choice between the two partial indexes of waiting jobs turned on the dead
    # index entries earlier tests had left.)
    PersistentJob.objects.bulk_create([
        PersistentJob(job_type="test.noop", payload={}, status="cancelled")
        for _ in range(2000)])
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE persistent_jobs")
        cursor.execute("ANALYZE persistent_jobs_attempts")
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute(f"EXPLAIN {_ACTIVE_SQL}")
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "pj_claim_idx" in plan and "pj_locked_by_idx" in plan, plan
    assert "Index Cond: (id = j.lock_token)" in plan and "Hash Cond" not in plan, plan


@pytest.mark.django_db
def test_view_counts_due_jobs_no_live_runner_serving_their_queue_handles(
        client: Client, viewer_token: str):
    """The alert input for "a job type nobody runs" (runners claim only the types they have
    handlers for): per queue and type, due waiting jobs whose queue a live runner serves but
    whose type none of the runners serving it lists."""
    past = timezone.now() - timedelta(seconds=5)
    for runner_id, queues, types in [("mail", ["mail"], ["test.noop"]),
                                     ("any", None, ["test.other"])]:
        JobRunnerRecord.objects.create(id=runner_id, hostname="h", pid=1, queues=queues,
                                       job_types=types, concurrency=2)
    stage(queue="mail", next_run_at=past)  # test.noop on mail: "mail" has it
    stage(queue="bulk", next_run_at=past)  # test.noop on bulk: only "any" serves it, without
    stage(queue="bulk", status="failed", next_run_at=past)  # a due retry waits the same way
    stage(queue="bulk", next_run_at=timezone.now() + timedelta(hours=1))  # not due yet
    gone = stage(queue="mail", next_run_at=past)
    PersistentJob.objects.filter(pk=gone.pk).update(job_type="test.gone")  # nobody has it
    samples = parse(client.get("/metrics", **bearer(viewer_token)).content.decode())
    unhandled = {dict(labels)["queue"] + "/" + dict(labels)["job_type"]: value
                 for (name, labels), value in samples.items()
                 if name == "persistent_jobs_unhandled_jobs"}
    assert unhandled == {"bulk/test.noop": 2, "mail/test.gone": 1}
    # A live runner whose row lists no types may handle any.
    JobRunnerRecord.objects.create(id="old", hostname="h", pid=1, queues=None, concurrency=2)
    samples = parse(client.get("/metrics", **bearer(viewer_token)).content.decode())
    assert total(samples, "persistent_jobs_unhandled_jobs") == 0


@pytest.mark.django_db
def test_view_is_authenticated_and_refuses_tenant_bound_tokens(client: Client):
    assert client.get("/metrics").status_code == 401
    nobody = make_token(make_user("nobody"))
    assert client.get("/metrics", **bearer(nobody)).status_code == 403
    bound = make_token(make_user("acme", *ALL_PERMS), tenant="acme")
    response = client.get("/metrics", **bearer(bound))
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "tenant_forbidden"
    assert client.post("/metrics", **bearer(bound)).status_code == 405


@pytest.mark.django_db
def test_an_attempt_settled_elsewhere_creates_no_series_with_an_empty_queue() -> None:
    """A receiver of ``job_finished`` may be sent no queue (a foreign sender; rescues used
    to): the failure is counted, and no per-queue series appears with ``queue=""``; nor does
    an attempt that observed no duration create empty per-queue series."""
    from django_persistent_jobs import metrics, signals
    from django_persistent_jobs.models import PersistentJob as Sender

    assert metrics.enable()
    signals.job_finished.send(
        sender=Sender, job_id=None, job_type="t.elsewhere", queue=None, tenant=None, attempt=1,
        runner_id="r", due_at=None, outcome="rescued", status="failed",
        error_code="RUNNER_LOST", duration=None)
    signals.job_finished.send(
        sender=Sender, job_id=None, job_type="t.elsewhere", queue="q", tenant=None, attempt=1,
        runner_id="r", due_at=None, outcome="interrupted", status="pending",
        error_code="RUNNER_LOST", duration=None)
    samples = parse(metrics.render().decode())
    assert total(samples, "persistent_jobs_failed_total", job_type="t.elsewhere",
                 error_code="RUNNER_LOST") == 1
    assert total(samples, "persistent_jobs_rescued_attempts_total", job_type="t.elsewhere") == 1
    per_queue = [key for key in samples
                 if dict(key[1]).get("job_type") == "t.elsewhere" and "queue" in dict(key[1])]
    assert per_queue == []


@pytest.mark.django_db
def test_names_follow_prometheus_conventions(client: Client, viewer_token: str):
    from django_persistent_jobs import metrics

    metrics.enable()
    ev = metrics.events()
    ev.started.labels("t", "q").inc(0)
    ev.succeeded.labels("t", "q").inc(0)
    ev.failed.labels("t", "E").inc(0)
    ev.dead_lettered.labels("t", "E").inc(0)
    ev.rescued.labels("t").inc(0)
    ev.duration.labels("t", "q").observe(0.0)
    ev.queue_wait.labels("t", "q").observe(0.0)
    stage()
    text = client.get("/metrics", **bearer(viewer_token)).content.decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    expected = {
        "persistent_jobs_started": "counter", "persistent_jobs_succeeded": "counter",
        "persistent_jobs_failed": "counter", "persistent_jobs_dead_lettered": "counter",
        "persistent_jobs_rescued_attempts": "counter",
        "persistent_jobs_duration_seconds": "histogram",
        "persistent_jobs_queue_wait_seconds": "histogram", "persistent_jobs_jobs": "gauge",
        "persistent_jobs_oldest_job_age_seconds": "gauge", "persistent_jobs_runners": "gauge",
        "persistent_jobs_queue_runners": "gauge", "persistent_jobs_database_up": "gauge",
        "persistent_jobs_unhandled_jobs": "gauge",
    }
    assert {name: families[name].type for name in expected} == expected
    for family in families.values():
        assert family.name.startswith("persistent_jobs_")
        assert family.documentation
        for sample in family.samples:
            if family.type == "counter":
                assert sample.name.endswith(("_total", "_created"))
            for label in sample.labels:
                assert label.islower() and not label.startswith("__")


def test_the_view_answers_503_when_the_database_is_unreachable() -> None:
    """Credentials cannot be checked without the database: a JSON 503 (Prometheus: up == 0),
    not a 500 HTML page."""

    from tests.core_support import run_without_database

    script = (
        "import django; django.setup()\n"
        "from django.test import Client\n"
        "r = Client().get('/metrics', HTTP_AUTHORIZATION='Bearer pjt_x')\n"
        "print(r.status_code, r['Content-Type'], r.get('Retry-After'), r.json()['error']['code'])\n"
        "print(r.json()['error']['message'])\n"
    )
    done = run_without_database("-c", script)
    assert done.returncode == 0, done.stderr
    first, message = done.stdout.splitlines()[:2]
    assert first.split() == ["503", "application/json", "15", "database_unavailable"]
    # The cause (which names the database's host) is logged, not told to an unchecked caller.
    assert "127.0.0.1" not in message and "port" not in message, message
