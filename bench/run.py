#!/usr/bin/env python
"""Print the django-persistent-jobs performance figures, measured in one run.

Usage (from a clone, with PostgreSQL reachable)::

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres python bench/run.py [--jobs 20000]
        [--quick] [--concurrency 2,4,8,16] [--finished-rows 1000000] [--memory]

The database named in DATABASE_URL is only used to (re)create the benchmark database ``pj_bench``
(``PJ_BENCH_DB`` overrides the name) on the same server; everything else happens there, so the
figures never touch anyone's data. Why one run: the development machine has two cores shared with
PostgreSQL (and with whatever else runs), so absolute numbers move by tens of percent from minute
to minute; the targets are therefore ratios between figures taken minutes apart in the same run.

Figures:

* pgbench ceiling - the one-job claim-and-complete transaction (the runner's own claim and
  completion statements, taken from ``runner/store.py``) run by 4 pgbench clients over the same
  number of prefilled jobs, durable commits. What PostgreSQL can do for this work with no Python.
* drain - one ``manage.py runjobs`` subprocess drains the same number of committed no-op jobs
  (atomic handlers, the normal path), for several ``--concurrency`` values; jobs/s from the
  enqueuing commit to the last completion, the runner's CPU per job, and the ratio to the ceiling.
* pickup latency - an idle runner; one job committed at a time; the handler notes the wall-clock
  time it started; latency = handler start - enqueuing commit.
* enqueue - ``enqueue()`` latency, each call its own autocommit transaction, and the
  ``enqueue_many()`` rate in batches and in one big batch.
* optional: drain rate with many finished rows in the table, and the runner's RSS over repeated
  drains.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
from psycopg import sql  # noqa: E402

from bench.settings import BENCH_DB_NAME, DEFAULT_SERVER_URL, bench_database_url  # noqa: E402

SETTINGS_MODULE = "bench.settings"
# These three must match bench/jobs.py, which can only be imported once Django is set up.
NOOP = "bench.noop"
PICKUP = "bench.pickup"
PICKUP_CHANNEL = "pj_bench_pickup"
ENQUEUE_BATCH = 5000
PGBENCH_CLIENTS = 4
ACTIVE = "status IN ('pending', 'failed', 'running')"
SECTIONS = ("ceiling", "drain", "pickup", "enqueue")


# --------------------------------------------------------------------------- output


def say(message: str) -> None:
    """Progress goes to stderr so that stdout holds only the results table."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass
class Row:
    figure: str
    value: str
    target: str = ""
    verdict: str = ""


class Report:
    """Collects result rows; printed once at the end as a fixed-width table."""

    def __init__(self) -> None:
        self.rows: list[Row] = []
        self.notes: list[str] = []

    def add(self, figure: str, value: str, target: str = "", verdict: str = "") -> None:
        self.rows.append(Row(figure, value, target, verdict))
        say(f"{figure}: {value} {verdict}".rstrip())

    def render(self, header: list[str]) -> str:
        widths = [
            max(len(getattr(r, name)) for r in [*self.rows, Row("figure", "value", "target")])
            for name in ("figure", "value", "target")
        ]
        lines = [*header, ""]
        head = Row("figure", "value", "target", "ratio / verdict")
        rule = Row("-" * widths[0], "-" * widths[1], "-" * widths[2], "-" * 15)
        for r in [head, rule, *self.rows]:
            lines.append(
                f"{r.figure:<{widths[0]}}  {r.value:>{widths[1]}}  {r.target:<{widths[2]}}  "
                f"{r.verdict}".rstrip()
            )
        if self.notes:
            lines.append("")
            lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


def verdict(ok: bool, text: str) -> str:
    return f"{text}  {'MET' if ok else 'MISSED'}"


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile: p99 of 200 samples is the 198th smallest, an observed value."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 100))))
    return ordered[rank - 1]


# --------------------------------------------------------------------------- database set-up


def recreate_database(server_url: str, name: str) -> None:
    """Drop and create ``name`` on ``server_url``'s server (never the database we connect to)."""
    parts = urlsplit(server_url)
    if parts.path.lstrip("/") == name:
        server_url = parts._replace(path="/postgres").geturl()
    with psycopg.connect(server_url, autocommit=True) as conn:
        drop = sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)")
        conn.execute(drop.format(sql.Identifier(name)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


def setup_django(bench_url: str) -> None:
    os.environ["PJ_BENCH_DATABASE_URL"] = bench_url
    os.environ["DJANGO_SETTINGS_MODULE"] = SETTINGS_MODULE
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0, interactive=False)


def execute(query: str, params: list[Any] | None = None) -> list[tuple[Any, ...]]:
    """Run one statement on the bench process's Django connection (autocommit)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(query, params)
        return list(cursor.fetchall()) if cursor.description else []


def scalar(query: str, params: list[Any] | None = None) -> Any:
    return execute(query, params)[0][0]


def reset_jobs() -> None:
    """Empty the job tables (not the runners table: a live runner's registration stays)."""
    execute("TRUNCATE persistent_jobs, persistent_jobs_attempts")


def analyze() -> None:
    """Fresh planner statistics, as autovacuum would give a long-running deployment."""
    execute("ANALYZE persistent_jobs")
    execute("ANALYZE persistent_jobs_attempts")


def fill(jobs: int, *, one_transaction: bool, analyze_before_commit: bool = False) -> float:
    """Enqueue ``jobs`` no-op jobs with ``enqueue_many`` in batches; returns the commit time.

    ``one_transaction`` makes every job visible at the same instant, so a drain starts at a
    well-defined moment however long the inserts took. ``analyze_before_commit`` gives the
    planner statistics that describe the backlog (as the pgbench ceiling gets), published by the
    same commit, so a live runner plans its claims against a table of this size, not an empty one.
    """
    from django.db import transaction

    from django_persistent_jobs import enqueue_many

    def batches() -> Iterator[list[tuple[str, dict[str, int]]]]:
        for start in range(0, jobs, ENQUEUE_BATCH):
            yield [(NOOP, {"n": i}) for i in range(start, min(jobs, start + ENQUEUE_BATCH))]

    if one_transaction:
        with transaction.atomic():
            for batch in batches():
                enqueue_many(batch)
            if analyze_before_commit:
                analyze()
    else:
        for batch in batches():
            with transaction.atomic():
                enqueue_many(batch)
    return time.time()


def prefill_finished(rows: int) -> None:
    """Insert ``rows`` completed jobs, each with its attempt row, older than anything new.

    Their ids are UUIDv7 built from a past timestamp, as the app's own ids would have been, so
    they sit at the left of the primary-key index exactly like real history.
    """
    execute(f"""
        INSERT INTO persistent_jobs (id, job_type, payload, status, queue, priority, attempts,
            max_retries, next_run_at, timeout_seconds, dedup, created_at, updated_at,
            finished_at)
        SELECT (lpad(to_hex((extract(epoch FROM t) * 1000)::bigint), 12, '0') || '7'
                || substr(h, 1, 3) || '8' || substr(h, 4, 15))::uuid,
            '{NOOP}', jsonb_build_object('n', i), 'completed', 'default', 0, 1, 0, t, 300,
            'skip', t, t, t + interval '5 ms'
        FROM generate_series(1, %s) AS i,
            LATERAL (SELECT now() - interval '30 days' + i * interval '1 ms' AS t,
                            md5(i::text) AS h) AS x
    """, [rows])
    execute("""
        INSERT INTO persistent_jobs_attempts (job_id, attempt, runner_id, started_at,
            finished_at, duration, outcome)
        SELECT id, 1, 'prefill', created_at, finished_at, finished_at - created_at, 'completed'
        FROM persistent_jobs WHERE status = 'completed'
    """)
    execute("VACUUM ANALYZE persistent_jobs")
    execute("VACUUM ANALYZE persistent_jobs_attempts")


def server_facts() -> dict[str, str]:
    return {
        "version": str(scalar("SHOW server_version")),
        "synchronous_commit": str(scalar("SHOW synchronous_commit")),
        "fsync": str(scalar("SHOW fsync")),
        "autovacuum": str(scalar("SHOW autovacuum")),
    }


# --------------------------------------------------------------------------- vacuuming


class Vacuumer:
    """VACUUMs the job tables every ``interval`` seconds from its own connection, while active.

    Every claimed job leaves a dead row version and dead entries in the claim index; until a
    VACUUM removes them, each claim steps over all of them, so a queue table that is not
    vacuumed gets slower with every job it processes (measured on this project's server, which
    runs with ``autovacuum = off``: a 20,000-job drain fell to 32 jobs/s and 29 ms of PostgreSQL
    CPU per job). Production servers run autovacuum; this thread stands in for it, identically
    for the pgbench ceiling and for the drains, so that their ratio compares like with like.
    """

    def __init__(self, url: str, interval: float) -> None:
        self.url = url
        self.interval = interval
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None
        self.runs = 0

    def __enter__(self) -> Vacuumer:
        if self.interval > 0:
            self.thread = threading.Thread(target=self._loop, name="bench-vacuum", daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join()

    def _loop(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            while not self.stop_event.wait(self.interval):
                conn.execute("VACUUM persistent_jobs")
                conn.execute("VACUUM persistent_jobs_attempts")
                self.runs += 1


VACUUM_EVERY = 5.0  # seconds; set from --vacuum-every


def vacuuming() -> Vacuumer:
    return Vacuumer(bench_database_url(), VACUUM_EVERY)


# --------------------------------------------------------------------------- pgbench ceiling


def pgbench_script(prepared: bool) -> str:
    """One transaction: the runner's claim statement (limit 1) then its completion statement.

    Both are taken from ``runner/store.py`` at run time, so the ceiling follows the runner's SQL
    when it changes. In simple-protocol mode pgbench pastes variables into the text, so the job
    id travels as a quoted literal; in prepared mode it is a bound parameter.
    """
    from django_persistent_jobs.runner import store

    claim = store.claim_sql(1) % {"runner": "'pgbench'"}
    claim = claim.rstrip().rstrip(";")
    if "RETURNING" not in claim[-400:]:
        raise RuntimeError("runner/store.py's claim statement no longer ends with RETURNING")
    claim += ", quote_literal(j.id::text) AS pj_qid \\gset"
    job_ref = ":id" if prepared else ":pj_qid"
    complete = store._COMPLETE.strip().rstrip(";").replace("%s", "{}", 3)
    if "%s" in complete:
        raise RuntimeError("runner/store.py's completion statement has unexpected parameters")
    complete = complete.format(job_ref, ":lock_token", ":lock_token")
    return f"BEGIN;\n{claim}\n{complete};\nCOMMIT;\n"


def pgbench_ceiling(bench_url: str, jobs: int, prepared: bool, workdir: Path) -> float:
    """tps of ``PGBENCH_CLIENTS`` clients claiming and completing ``jobs`` prefilled jobs."""
    pgbench = shutil.which("pgbench") or "/usr/bin/pgbench"
    per_client = max(1, jobs // PGBENCH_CLIENTS)
    reset_jobs()
    fill(per_client * PGBENCH_CLIENTS + 200, one_transaction=False)  # a margin: never run dry
    analyze()
    script = workdir / f"claim_complete_{'prepared' if prepared else 'simple'}.sql"
    script.write_text(pgbench_script(prepared))
    cmd = [
        pgbench, "-n", "-f", str(script), "-c", str(PGBENCH_CLIENTS),
        "-j", str(min(PGBENCH_CLIENTS, os.cpu_count() or 1)), "-t", str(per_client),
        "-M", "prepared" if prepared else "simple", bench_url,
    ]
    with vacuuming():
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    match = re.search(r"tps = ([\d.]+) \(without initial connection time\)", done.stdout)
    if done.returncode != 0 or match is None:
        raise RuntimeError(f"pgbench failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    completed = scalar("SELECT count(*) FROM persistent_jobs WHERE status = 'completed'")
    if completed != per_client * PGBENCH_CLIENTS:
        raise RuntimeError(f"pgbench completed {completed} jobs, expected "
                           f"{per_client * PGBENCH_CLIENTS}; script: {script}")
    return float(match.group(1))


# --------------------------------------------------------------------------- runner subprocess


class RunnerProcess:
    """One ``manage.py runjobs`` subprocess, with its CPU time and RSS read from /proc."""

    def __init__(self, concurrency: int | None, workdir: Path, verbosity: int = 0) -> None:
        self.concurrency = concurrency
        self.log_path = workdir / f"runjobs-c{concurrency or 'default'}-{time.time_ns()}.log"
        args = [sys.executable, str(ROOT / "manage.py"), "runjobs", "--verbosity", str(verbosity)]
        if concurrency is not None:
            args += ["--concurrency", str(concurrency)]
        env = {**os.environ, "DJANGO_SETTINGS_MODULE": SETTINGS_MODULE}
        self.log = self.log_path.open("wb")
        self.proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        try:
            self._wait_ready()
        except BaseException:  # including Ctrl-C: never leave a runner behind
            self.stop()
            raise

    def _wait_ready(self, timeout: float = 60.0) -> None:
        """Registered in the runners table and LISTENing, so a commit now wakes it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            registered = scalar("SELECT count(*) FROM persistent_jobs_runners WHERE pid = %s",
                                [self.proc.pid])
            listening = scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND query LIKE 'LISTEN %%'"
            )
            if registered and listening:
                time.sleep(0.3)  # let the first poll settle: measure an idle runner
                return
            time.sleep(0.05)
        raise RuntimeError(f"runjobs did not start within {timeout:.0f}s; see {self.log_path}")

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"runjobs exited with {self.proc.returncode}:\n{self.tail()}"
            )

    def tail(self, lines: int = 30) -> str:
        self.log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@contextmanager
def runner(concurrency: int | None, workdir: Path, verbosity: int = 0) -> Iterator[RunnerProcess]:
    """A runner at ``verbosity`` 0 (WARNING) unless asked: INFO logs a line per job."""
    proc = RunnerProcess(concurrency, workdir, verbosity)
    try:
        yield proc
    finally:
        proc.stop()


# --------------------------------------------------------------------------- drain


def _proc_cpu_seconds(pid: int) -> float | None:
    """utime + stime of a local process, or None if it is gone or not ours to see."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_cpu() -> dict[int, float]:
    """CPU seconds of every other backend of the bench database, keyed by pid.

    Only meaningful when PostgreSQL runs on this machine (its backends are then visible in
    /proc); elsewhere it is empty and the figure is left out. With two cores shared between the
    runner and PostgreSQL, the server's CPU per job limits the drain as much as the runner's.
    """
    pids = execute("SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                   "AND pid <> pg_backend_pid()")
    found = {pid: _proc_cpu_seconds(pid) for (pid,) in pids}
    return {pid: cpu for pid, cpu in found.items() if cpu is not None}


@dataclass
class Drain:
    concurrency: int | None
    jobs: int
    seconds: float
    cpu_ms_per_job: float
    first_claim_ms: float
    server_cpu_ms_per_job: float | None = None

    @property
    def rate(self) -> float:
        return self.jobs / self.seconds


def drain_once(proc: RunnerProcess, jobs: int, *, stall_timeout: float = 60.0) -> Drain:
    """Commit ``jobs`` no-op jobs at once under a live, idle runner and time them to the last.

    The clock starts at the enqueuing commit (so Django's start-up is not counted) and stops at
    the last job's ``finished_at``, written by the database in the completing transaction.
    Polling for the end is coarse on purpose: it only decides when to read ``max(finished_at)``.
    """
    cpu_before = proc.cpu_seconds()
    server_before = server_cpu()
    with vacuuming():
        committed = fill(jobs, one_transaction=True, analyze_before_commit=True)
        remaining, last_change, last_remaining = jobs, time.monotonic(), jobs
        while remaining:
            time.sleep(0.2)
            proc.check_alive()
            remaining = scalar(f"SELECT count(*) FROM persistent_jobs WHERE {ACTIVE}")
            if remaining != last_remaining:
                last_remaining, last_change = remaining, time.monotonic()
            elif time.monotonic() - last_change > stall_timeout:
                raise RuntimeError(f"drain stalled with {remaining} jobs left:\n{proc.tail()}")
    cpu_after = proc.cpu_seconds()
    server_after = server_cpu()
    server_ms = (
        sum(cpu - server_before.get(pid, 0.0) for pid, cpu in server_after.items()) * 1000 / jobs
        if server_after else None
    )
    finished, first_start, completed = execute(
        "SELECT extract(epoch FROM max(j.finished_at)), "
        "(SELECT extract(epoch FROM min(a.started_at)) FROM persistent_jobs_attempts a "
        " WHERE a.started_at >= to_timestamp(%s) - interval '1 minute'), "
        "count(*) FROM persistent_jobs j WHERE j.status = 'completed' "
        "AND j.finished_at >= to_timestamp(%s) - interval '1 minute'",
        [committed, committed],
    )[0]
    if completed < jobs:
        bad = execute("SELECT status, last_error_code, count(*) FROM persistent_jobs "
                      "WHERE status <> 'completed' GROUP BY 1, 2")
        raise RuntimeError(f"only {completed}/{jobs} jobs completed: {bad}\n{proc.tail()}")
    return Drain(
        concurrency=proc.concurrency, jobs=jobs, seconds=float(finished) - committed,
        cpu_ms_per_job=(cpu_after - cpu_before) * 1000 / jobs,
        first_claim_ms=(float(first_start) - committed) * 1000, server_cpu_ms_per_job=server_ms,
    )


def measure_drain(concurrency: int | None, jobs: int, workdir: Path) -> Drain:
    reset_jobs()
    with runner(concurrency, workdir) as proc:
        return drain_once(proc, jobs)


# --------------------------------------------------------------------------- pickup latency


def measure_pickup(bench_url: str, samples: int, workdir: Path) -> tuple[list[float], list[float]]:
    """Latencies (ms) from the enqueuing commit, and from the start of ``enqueue()``, to the
    handler's first line, one job at a time against an idle runner at default settings."""
    from django_persistent_jobs import enqueue

    reset_jobs()
    warmup = 10
    from_commit: list[float] = []
    from_call: list[float] = []
    with psycopg.connect(bench_url, autocommit=True) as listener, runner(None, workdir) as proc:
        listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(PICKUP_CHANNEL)))
        for i in range(samples + warmup):
            time.sleep(random.uniform(0.02, 0.05))  # let the runner go idle again
            called = time.time()
            job = enqueue(PICKUP, {"n": i})  # autocommit: returns once the INSERT committed
            committed = time.time()
            started = None
            for note in listener.notifies(timeout=10):
                job_id, _, when = note.payload.partition(" ")
                if job_id == str(job.id):
                    started = float(when)
                    break
            if started is None:
                proc.check_alive()
                raise RuntimeError(f"no pickup notification for job {job.id}:\n{proc.tail()}")
            if i >= warmup:
                from_commit.append((started - committed) * 1000)
                from_call.append((started - called) * 1000)
    return from_commit, from_call


# --------------------------------------------------------------------------- enqueue


def measure_enqueue(samples: int) -> list[float]:
    """``enqueue()`` wall time in ms, each call its own autocommit transaction (commit included)."""
    from django_persistent_jobs import enqueue

    reset_jobs()
    for i in range(50):  # warm the connection, the plan cache and the code paths
        enqueue(NOOP, {"n": i})
    durations = []
    for i in range(samples):
        started = time.perf_counter()
        enqueue(NOOP, {"n": i})
        durations.append((time.perf_counter() - started) * 1000)
    return durations


def measure_commit_floor(bench_url: str, samples: int) -> list[float]:
    """Wall time (ms) of a one-row INSERT in its own transaction on a bare psycopg connection.

    The floor under ``enqueue()``: the round trip plus the WAL flush of a commit, with no Python
    job code, measured right next to it so that a slow disk shows up in both.
    """
    durations = []
    with psycopg.connect(bench_url, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS pj_bench_commit_floor")
        conn.execute("CREATE TABLE pj_bench_commit_floor (x int)")
        for i in range(samples + 50):
            started = time.perf_counter()
            conn.execute("INSERT INTO pj_bench_commit_floor VALUES (%s)", [i])
            if i >= 50:
                durations.append((time.perf_counter() - started) * 1000)
        conn.execute("DROP TABLE pj_bench_commit_floor")
    return durations


def measure_enqueue_many(total: int, batch: int) -> float:
    """Jobs/s of ``enqueue_many`` for ``total`` jobs in batches of ``batch``, one transaction each.

    Building the item list is the caller's work and is not timed; validation, the insert and the
    commit are.
    """
    from django.db import transaction

    from django_persistent_jobs import enqueue_many

    reset_jobs()
    analyze()
    chunks = [[(NOOP, {"n": i}) for i in range(s, min(total, s + batch))]
              for s in range(0, total, batch)]
    started = time.perf_counter()
    for chunk in chunks:
        with transaction.atomic():
            enqueue_many(chunk)
    return total / (time.perf_counter() - started)


# --------------------------------------------------------------------------- main


def cpu_text(d: Drain) -> str:
    server = (f", PostgreSQL {d.server_cpu_ms_per_job:.2f}"
              if d.server_cpu_ms_per_job is not None else "")
    return f"CPU ms/job: runner {d.cpu_ms_per_job:.2f}{server}"


def best_of(runs: list[Drain]) -> Drain:
    return max(runs, key=lambda d: d.rate)


def measure_ceiling(args: argparse.Namespace, ctx: Context, when: str) -> tuple[float, float]:
    """One pgbench run per protocol; returns ``(simple, prepared)`` tps and reports them."""
    say(f"pgbench ceiling {when}: {args.jobs} jobs, {PGBENCH_CLIENTS} clients")
    simple = pgbench_ceiling(ctx.bench_url, args.jobs, prepared=False, workdir=ctx.workdir)
    prepared = pgbench_ceiling(ctx.bench_url, args.jobs, prepared=True, workdir=ctx.workdir)
    ctx.report.add(f"pgbench claim+complete {when}, simple protocol / prepared",
                   f"{simple:,.0f} / {prepared:,.0f} tps")
    return simple, prepared


def section_ceiling(args: argparse.Namespace, ctx: Context) -> None:
    """The ceiling is measured before the drains here and again after them (in section_drain).

    On a shared two-core machine the load changes from one minute to the next, so a ceiling
    taken only before the drains would compare figures from different minutes; the mean of the
    two brackets the drains. The better protocol counts, so the ratio is never flattered.
    """
    if not (shutil.which("pgbench") or Path("/usr/bin/pgbench").exists()):
        ctx.report.notes.append("pgbench not found: no ceiling, drain ratios not computed")
        return
    ctx.ceilings.append(measure_ceiling(args, ctx, "before the drains"))


def section_drain(args: argparse.Namespace, ctx: Context) -> None:
    drains: list[Drain] = []
    for concurrency in args.concurrency:
        say(f"drain of {args.jobs} no-op jobs, concurrency {concurrency}")
        drains.append(measure_drain(concurrency, args.jobs, ctx.workdir))
    if ctx.ceilings:
        ctx.ceilings.append(measure_ceiling(args, ctx, "after the drains"))
        ctx.ceiling_simple = statistics.mean(simple for simple, _ in ctx.ceilings)
        ctx.ceiling = statistics.mean(max(pair) for pair in ctx.ceilings)
        ctx.report.add("pgbench ceiling (better protocol, mean of before and after)",
                       f"{ctx.ceiling:,.0f} tps")
    for d in drains:
        ratio = (f"{d.rate / ctx.ceiling:.2f}x ceiling ({d.rate / ctx.ceiling_simple:.2f}x "
                 "simple-protocol pgbench); " if ctx.ceiling and ctx.ceiling_simple else "")
        ctx.report.add(f"drain {args.jobs:,} no-op jobs, runjobs --concurrency {d.concurrency}",
                       f"{d.rate:,.0f} jobs/s", "", f"{ratio}{cpu_text(d)}")
    best = best_of(drains)
    ctx.best_concurrency = best.concurrency
    if ctx.ceiling:
        share = best.rate / ctx.ceiling
        met = "0.8x MET" if share >= 0.8 else (
            "0.8x MISSED, milestone 0.5x MET" if share >= 0.5 else "0.8x and 0.5x MISSED")
        ctx.report.add(f"drain, best (concurrency {best.concurrency})",
                       f"{best.rate:,.0f} jobs/s", ">= 0.8x ceiling (0.5x first)",
                       f"{share:.2f}x  {met}")
    ctx.report.add("runner CPU per job at the best drain", f"{best.cpu_ms_per_job:.2f} ms",
                   "(PgQueuer 0.24, Procrastinate 1.9)")


def section_pickup(args: argparse.Namespace, ctx: Context) -> None:
    say(f"pickup latency, {args.pickup_samples} samples")
    from_commit, from_call = measure_pickup(ctx.bench_url, args.pickup_samples, ctx.workdir)
    p50, p99 = pct(from_commit, 50), pct(from_commit, 99)
    ctx.report.add("pickup latency p50 (commit -> handler start)", f"{p50:.2f} ms",
                   "<= 1.5 ms", verdict(p50 <= 1.5, f"{p50 / 1.5:.2f}x target"))
    ctx.report.add("pickup latency p99 (commit -> handler start)", f"{p99:.2f} ms", "<= 8 ms",
                   verdict(p99 <= 8, f"{p99 / 8:.2f}x target"))
    ctx.report.add("pickup latency p50 / p99 from the enqueue() call",
                   f"{pct(from_call, 50):.2f} / {pct(from_call, 99):.2f} ms")


def section_enqueue(args: argparse.Namespace, ctx: Context) -> None:
    say(f"enqueue() x {args.enqueue_samples}")
    durations = measure_enqueue(args.enqueue_samples)
    floor = measure_commit_floor(ctx.bench_url, args.enqueue_samples)
    e99 = pct(durations, 99)
    ctx.report.add("enqueue() p50 (own transaction, commit included)",
                   f"{pct(durations, 50):.2f} ms")
    ctx.report.add("enqueue() p99 (own transaction, commit included)", f"{e99:.2f} ms",
                   "<= 1.5 ms", verdict(e99 <= 1.5, f"{e99 / 1.5:.2f}x target"))
    ctx.report.add("floor: bare one-row INSERT + commit, p50 / p99",
                   f"{pct(floor, 50):.2f} / {pct(floor, 99):.2f} ms", "",
                   f"enqueue() p99 is {e99 / pct(floor, 99):.2f}x the floor's p99")
    say(f"enqueue_many() {args.many_total} jobs")
    batched = measure_enqueue_many(args.many_total, ENQUEUE_BATCH)
    whole = measure_enqueue_many(args.many_total, args.many_total)
    ctx.report.add(f"enqueue_many() {args.many_total:,} in batches of {ENQUEUE_BATCH:,}",
                   f"{batched:,.0f} jobs/s", ">= 30,000 jobs/s",
                   verdict(batched >= 30000, f"{batched / 30000:.2f}x target"))
    ctx.report.add(f"enqueue_many() {args.many_total:,} in one batch", f"{whole:,.0f} jobs/s",
                   ">= 30,000 jobs/s", verdict(whole >= 30000, f"{whole / 30000:.2f}x target"))


def section_history(args: argparse.Namespace, ctx: Context) -> None:
    """Empty table and then ``--finished-rows`` finished rows, back to back, same concurrency."""
    concurrency = ctx.best_concurrency
    say(f"drain with an empty table again, concurrency {concurrency}")
    empty = measure_drain(concurrency, args.jobs, ctx.workdir)
    say(f"prefilling {args.finished_rows} finished jobs (and their attempts)")
    reset_jobs()
    prefill_finished(args.finished_rows)
    say("drain with the finished rows in place")
    with runner(concurrency, ctx.workdir) as proc:
        full = drain_once(proc, args.jobs)
    ratio = full.rate / empty.rate
    ctx.report.add(f"drain, empty table (again, concurrency {concurrency})",
                   f"{empty.rate:,.0f} jobs/s")
    ctx.report.add(f"drain with {args.finished_rows:,} finished rows", f"{full.rate:,.0f} jobs/s",
                   ">= 0.8x empty", verdict(ratio >= 0.8, f"{ratio:.2f}x empty"))


def section_memory(args: argparse.Namespace, ctx: Context) -> None:
    """RSS of one runner after each drain; the first drain warms caches, so growth is from it."""
    reset_jobs()
    rss: list[float] = []
    with runner(ctx.best_concurrency, ctx.workdir) as proc:
        rss.append(proc.rss_mib())
        for round_no in range(args.memory_rounds):
            say(f"memory: drain {round_no + 1}/{args.memory_rounds}")
            reset_jobs()
            drain_once(proc, args.jobs)
            rss.append(proc.rss_mib())
    growth = rss[-1] - rss[1]
    ctx.report.add(f"runner RSS idle, then after each of {args.memory_rounds} drains",
                   " ".join(f"{v:.0f}" for v in rss) + " MiB")
    ctx.report.add("RSS growth from drain 1 to the last", f"{growth:+.1f} MiB", "flat",
                   verdict(abs(growth) <= max(2.0, 0.05 * rss[1]), "within 5% or 2 MiB"))


@dataclass
class Context:
    bench_url: str
    workdir: Path
    report: Report
    ceiling: float | None = None
    ceiling_simple: float | None = None
    ceilings: list[tuple[float, float]] = field(default_factory=list)
    best_concurrency: int | None = None


def run(args: argparse.Namespace) -> int:
    global VACUUM_EVERY
    VACUUM_EVERY = args.vacuum_every
    server_url = os.environ.get("DATABASE_URL") or DEFAULT_SERVER_URL
    os.environ.pop("PJ_BENCH_DATABASE_URL", None)
    bench_url = bench_database_url()
    say(f"recreating database {BENCH_DB_NAME} on {urlsplit(server_url).hostname}")
    recreate_database(server_url, BENCH_DB_NAME)
    setup_django(bench_url)
    facts = server_facts()
    ctx = Context(bench_url=bench_url, workdir=Path(tempfile.mkdtemp(prefix="pj-bench-")),
                  report=Report(), best_concurrency=args.concurrency[0])
    load_start = os.getloadavg()
    started = datetime.now(UTC)
    sections = {"ceiling": section_ceiling, "drain": section_drain, "pickup": section_pickup,
                "enqueue": section_enqueue}
    for name, section in sections.items():
        if name in args.only:
            section(args, ctx)
    if args.finished_rows:
        section_history(args, ctx)
    if args.memory:
        section_memory(args, ctx)
    load_end = os.getloadavg()
    vacuum_note = (f"bench VACUUMs the job tables every {args.vacuum_every:g}s during the "
                   "ceiling and the drains" if args.vacuum_every else "no bench VACUUM")
    header = [
        f"django-persistent-jobs bench, {started:%Y-%m-%d %H:%M} UTC, {platform.node()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}",
        f"PostgreSQL {facts['version']} (synchronous_commit={facts['synchronous_commit']}, "
        f"fsync={facts['fsync']}, autovacuum={facts['autovacuum']}), database {BENCH_DB_NAME}; "
        f"{args.jobs:,} jobs per drain; {vacuum_note}",
        f"load average (1 min) at start {load_start[0]:.2f}, at end {load_end[0]:.2f}; "
        f"runner logs in {ctx.workdir}",
    ]
    print(ctx.report.render(header), flush=True)
    if not args.keep_db:
        from django.db import connections

        connections.close_all()
        recreate_database(server_url, BENCH_DB_NAME)  # leave an empty database, not gigabytes
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=None,
                        help="jobs per drain and pgbench run (default 20000; 5000 with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="smaller run for a smoke check: fewer jobs, samples and concurrencies")
    parser.add_argument("--concurrency", type=_int_list, default=None,
                        help="runjobs --concurrency values to try (default 4,8,16,32)")
    parser.add_argument("--pickup-samples", type=int, default=None)
    parser.add_argument("--enqueue-samples", type=int, default=None)
    parser.add_argument("--many-total", type=int, default=None,
                        help="jobs for the enqueue_many rate (default 50000)")
    parser.add_argument("--only", type=_sections, default=set(SECTIONS),
                        help=f"comma-separated sections to run, of {','.join(SECTIONS)}")
    parser.add_argument("--finished-rows", type=int, default=0,
                        help="also drain with this many finished rows in the table")
    parser.add_argument("--memory", action="store_true",
                        help="also drain repeatedly through one runner and print its RSS")
    parser.add_argument("--memory-rounds", type=int, default=5)
    parser.add_argument("--vacuum-every", type=float, default=VACUUM_EVERY,
                        help="seconds between the bench's own VACUUMs of the job tables during "
                             "the ceiling and the drains (0: none; default %(default)s)")
    parser.add_argument("--keep-db", action="store_true",
                        help=f"leave {BENCH_DB_NAME} as the run left it, for inspection")
    args = parser.parse_args(argv)
    quick = args.quick
    defaults: dict[str, Any] = {
        "jobs": 5000 if quick else 20000,
        "concurrency": [4, 16] if quick else [4, 8, 16, 32],
        "pickup_samples": 100 if quick else 300,
        "enqueue_samples": 500 if quick else 2000,
        "many_total": 20000 if quick else 50000,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def _sections(text: str) -> set[str]:
    chosen = {v.strip() for v in text.split(",") if v.strip()}
    unknown = chosen - set(SECTIONS)
    if not chosen or unknown:
        raise argparse.ArgumentTypeError(f"sections are {','.join(SECTIONS)}")
    return chosen


def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("give positive integers, e.g. 2,4,8")
    return values


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
