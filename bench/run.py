#!/usr/bin/env python
"""Print the django-persistent-jobs performance figures, measured in one run, next to peers.

Usage (from a clone, with PostgreSQL reachable)::

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres python bench/run.py [--quick]
        [--jobs 10000] [--only drain,backlog] [--finished-rows 1000000] [--memory]

The database named in DATABASE_URL is only used to (re)create the benchmark database ``pj_bench``
(``PJ_BENCH_DB`` overrides the name) on the same server; everything else happens there, so the
figures never touch anyone's data. Why one run: on a small shared machine absolute numbers move
by tens of percent from minute to minute, so the figures that matter are ratios between
measurements taken minutes apart in the same run. Nothing VACUUMs the tables during a measurement.

Sections (the workload letters are those of the shared peer harness, ``shared/bench-peers``):

* reference - pgbench, 4 clients, the minimal one-statement claim-and-complete on a bare table
  (``UPDATE ... WHERE id = (SELECT ... FOR UPDATE SKIP LOCKED)``), durable commits: what one
  durable job transaction costs on this machine. Measured before and after the drains.
* drain - C: one ``runjobs`` at default settings drains ``--jobs`` committed no-op jobs (atomic
  handlers, the normal path), and again per extra ``--concurrency``; the same for the
  throughput mode (no-op handlers registered with ``atomic=False``); D: two ``runjobs``
  processes. jobs/s from the enqueuing commit to the last completion, CPU per job.
* backlog - C with ``--backlog-factor`` times more jobs, then the same while another session
  holds a REPEATABLE READ snapshot open for the whole drain.
* pickup (E) - an idle runner; one job committed at a time; latency = handler start - commit.
* enqueue (A, B) - ``enqueue()`` latency, each call its own transaction; ``enqueue_many()``.
* peers - when the shared harness and its venv (``PEERS_VENV``, default ~/.cache/peers-venv, with
  pgqueuer and procrastinate) exist, their runners are run with the same job count, and the
  table shows their figures with our ratio to them.
* rounds - the contested comparisons again, head to head: ``--rounds`` rounds, each measuring
  ours and then PgQueuer back to back (C default drain against its default, the throughput
  mode at defaults against its batch 500, ``enqueue()`` p99 against its single enqueue). A
  verdict is the median of the rounds' ratios, each ratio taken between measurements seconds
  apart, so a machine that slows down for a minute moves both sides of it.
* optional: drain rate with many finished rows in the table, and the runner's RSS over repeated
  drains.
"""

from __future__ import annotations

import argparse
import contextlib
import json
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
#: The throughput mode's no-op: a handler registered with ``atomic=False``.
NOOP_AUTOCOMMIT = "bench.noop_autocommit"
PICKUP = "bench.pickup"
PICKUP_CHANNEL = "pj_bench_pickup"
ENQUEUE_BATCH = 5000
PGBENCH_CLIENTS = 4
ACTIVE = "status IN ('pending', 'failed', 'running')"
SECTIONS = ("reference", "drain", "backlog", "pickup", "enqueue", "peers", "rounds")


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


def settle(threshold: float = 0.25, longest: float = 30.0) -> float:
    """CHECKPOINT, then wait (at most ``longest`` seconds) until the machine's CPUs were less
    than ``threshold`` busy over a second; returns the last reading.

    The peer harness does exactly this before each of its measurements (``quiet_gate``), so the
    head-to-head rounds do it before ours too: both sides then start from written-out buffers
    and a quiet machine, and neither pays for the other's leftovers.
    """
    execute("CHECKPOINT")
    deadline = time.monotonic() + longest
    while True:
        before = MachineBusy._read()
        time.sleep(1.0)
        after = MachineBusy._read()
        if before is None or after is None or after[1] == before[1]:
            return 0.0
        busy = (after[0] - before[0]) / (after[1] - before[1])
        if busy < threshold or time.monotonic() > deadline:
            return busy


def analyze() -> None:
    """Fresh planner statistics, as autovacuum would give a long-running deployment."""
    execute("ANALYZE persistent_jobs")
    execute("ANALYZE persistent_jobs_attempts")


def fill(jobs: int, *, one_transaction: bool, analyze_before_commit: bool = False,
         job_type: str = NOOP) -> float:
    """Enqueue ``jobs`` no-op jobs with ``enqueue_many`` in batches; returns the commit time.

    ``one_transaction`` makes every job visible at the same instant, so a drain starts at a
    well-defined moment however long the inserts took. ``analyze_before_commit`` gives the
    planner statistics that describe the backlog (as the pgbench reference gets), published by the
    same commit, so a live runner plans its claims against a table of this size, not an empty one.
    """
    from django.db import transaction

    from django_persistent_jobs import enqueue_many

    def batches() -> Iterator[list[tuple[str, dict[str, int]]]]:
        for start in range(0, jobs, ENQUEUE_BATCH):
            yield [(job_type, {"n": i})
                   for i in range(start, min(jobs, start + ENQUEUE_BATCH))]

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


# --------------------------------------------------------------------------- pgbench reference


REFERENCE_TABLE = "pj_bench_reference"


def reference_script() -> str:
    """The least work a durable job queue can do per job: one statement that picks the oldest
    pending row with ``FOR UPDATE SKIP LOCKED`` and marks it done, committed on its own.

    Deliberately not the runner's statements: the reference must not get slower when the
    project's SQL gets heavier, or the drain ratio would flatter us.
    """
    return (
        f"UPDATE {REFERENCE_TABLE} SET status = 'completed', finished_at = now() WHERE id = ("
        f"SELECT id FROM {REFERENCE_TABLE} WHERE status = 'pending' ORDER BY id "
        "LIMIT 1 FOR UPDATE SKIP LOCKED);\n"
    )


def pgbench_reference(bench_url: str, jobs: int, workdir: Path) -> float:
    """tps of ``PGBENCH_CLIENTS`` clients running the reference over ``jobs`` fresh rows.

    Same conditions as the drains: the rows are committed and analysed just before, and nothing
    vacuums the table during the run, so the reference also pays for the dead index entries its
    own claims leave behind.
    """
    pgbench = shutil.which("pgbench") or "/usr/bin/pgbench"
    per_client = max(1, jobs // PGBENCH_CLIENTS)
    execute(f"DROP TABLE IF EXISTS {REFERENCE_TABLE}")
    execute(f"CREATE TABLE {REFERENCE_TABLE} (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, "
            "status text NOT NULL DEFAULT 'pending', payload jsonb NOT NULL DEFAULT '{}', "
            "finished_at timestamptz)")
    execute(f"CREATE INDEX {REFERENCE_TABLE}_pending ON {REFERENCE_TABLE} (id) "
            "WHERE status = 'pending'")
    execute(f"INSERT INTO {REFERENCE_TABLE} (status) SELECT 'pending' "
            "FROM generate_series(1, %s)", [per_client * PGBENCH_CLIENTS + 200])
    execute(f"ANALYZE {REFERENCE_TABLE}")
    script = workdir / "reference.sql"
    script.write_text(reference_script())
    cmd = [
        pgbench, "-n", "-f", str(script), "-c", str(PGBENCH_CLIENTS),
        "-j", str(min(PGBENCH_CLIENTS, os.cpu_count() or 1)), "-t", str(per_client),
        "-M", "prepared", bench_url,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    match = re.search(r"tps = ([\d.]+) \(without initial connection time\)", done.stdout)
    if done.returncode != 0 or match is None:
        raise RuntimeError(f"pgbench failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    completed = scalar(f"SELECT count(*) FROM {REFERENCE_TABLE} WHERE status = 'completed'")
    execute(f"DROP TABLE {REFERENCE_TABLE}")
    if completed != per_client * PGBENCH_CLIENTS:
        raise RuntimeError(f"pgbench completed {completed} rows, expected "
                           f"{per_client * PGBENCH_CLIENTS}")
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
    job_type: str = NOOP
    #: Share of the machine's CPU time busy during the drain (``MachineBusy``).
    machine_busy: float | None = None

    @property
    def rate(self) -> float:
        return self.jobs / self.seconds

    @property
    def how(self) -> str:
        """The runjobs settings and handler this drain used, for the report."""
        settings = (f"--concurrency {self.concurrency}" if self.concurrency is not None
                    else "defaults")
        return f"atomic=False, {settings}" if self.job_type == NOOP_AUTOCOMMIT else settings


class MachineBusy:
    """How busy the machine's CPUs were over a stretch of wall time, from ``/proc/stat``
    sampled every 20 ms on a thread (Linux only; ``None`` elsewhere). Read over the drain
    alone (from the enqueuing commit to the last ``finished_at``), not over the polling that
    follows it: it tells whether a drain left cores idle, and so whether a second runner
    could add anything."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _read() -> tuple[int, int] | None:
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return None
        fields = fields[:8]  # (guest time is counted in user and nice already)
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields) - idle, sum(fields)

    def _run(self) -> None:
        while not self._stop.is_set():
            read = self._read()
            if read is None:
                return
            self.samples.append((time.time(), *read))
            self._stop.wait(0.02)

    def __enter__(self) -> MachineBusy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, start: float, end: float) -> float | None:
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2 or inside[-1][2] == inside[0][2]:
            return None
        return (inside[-1][1] - inside[0][1]) / (inside[-1][2] - inside[0][2])


def drain_once(procs: list[RunnerProcess], jobs: int, *, hold_snapshot: bool = False,
               stall_timeout: float = 60.0, job_type: str = NOOP) -> Drain:
    """Commit ``jobs`` no-op jobs at once under live, idle runners and time them to the last.

    The clock starts at the enqueuing commit (so Django's start-up is not counted) and stops at
    the last job's ``finished_at``, written by the database in the completing transaction.
    Polling for the end is coarse on purpose: it only decides when to read ``max(finished_at)``.
    Nothing vacuums the tables meanwhile (autovacuum wakes at most once a minute, and cannot
    remove anything a held snapshot may still see). ``hold_snapshot`` keeps a REPEATABLE READ
    transaction open on another connection for the whole drain, as a report query or a long
    job elsewhere would.
    """
    cpu_before = sum(p.cpu_seconds() for p in procs)
    server_before = server_cpu()
    with contextlib.ExitStack() as stack:
        machine = stack.enter_context(MachineBusy())
        if hold_snapshot:
            holder = stack.enter_context(psycopg.connect(bench_database_url()))
            holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            holder.execute("SELECT count(*) FROM persistent_jobs_runners")  # takes the snapshot
        committed = fill(jobs, one_transaction=True, analyze_before_commit=True,
                         job_type=job_type)
        remaining, last_change, last_remaining = jobs, time.monotonic(), jobs
        while remaining:
            time.sleep(0.2)
            for p in procs:
                p.check_alive()
            remaining = scalar(f"SELECT count(*) FROM persistent_jobs WHERE {ACTIVE}")
            if remaining != last_remaining:
                last_remaining, last_change = remaining, time.monotonic()
            elif time.monotonic() - last_change > stall_timeout:
                raise RuntimeError(f"drain stalled with {remaining} jobs left:\n{procs[0].tail()}")
    cpu_after = sum(p.cpu_seconds() for p in procs)
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
        raise RuntimeError(f"only {completed}/{jobs} jobs completed: {bad}\n{procs[0].tail()}")
    return Drain(
        concurrency=procs[0].concurrency, jobs=jobs, seconds=float(finished) - committed,
        cpu_ms_per_job=(cpu_after - cpu_before) * 1000 / jobs,
        first_claim_ms=(float(first_start) - committed) * 1000, server_cpu_ms_per_job=server_ms,
        job_type=job_type, machine_busy=machine.between(committed, float(finished)),
    )


def measure_drain(concurrency: int | None, jobs: int, workdir: Path, *, processes: int = 1,
                  hold_snapshot: bool = False, job_type: str = NOOP,
                  quiet: bool = False) -> Drain:
    """A drain by ``processes`` separate ``runjobs`` processes, started on empty tables
    (``quiet``: once the runners are up, ``settle`` before the jobs are committed)."""
    reset_jobs()
    with contextlib.ExitStack() as stack:
        procs = [stack.enter_context(runner(concurrency, workdir)) for _ in range(processes)]
        if quiet:
            settle()
        return drain_once(procs, jobs, hold_snapshot=hold_snapshot, job_type=job_type)


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


def measure_enqueue(samples: int, *, quiet: bool = False) -> list[float]:
    """``enqueue()`` wall time in ms, each call its own autocommit transaction (commit included;
    ``quiet``: ``settle`` after the warm-up)."""
    from django_persistent_jobs import enqueue

    reset_jobs()
    for i in range(50):  # warm the connection, the plan cache and the code paths
        enqueue(NOOP, {"n": i})
    if quiet:
        settle()
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
    busy = f"; machine {d.machine_busy:.0%} busy" if d.machine_busy is not None else ""
    return f"CPU ms/job: runner {d.cpu_ms_per_job:.2f}{server}{busy}"


def best_of(runs: list[Drain]) -> Drain:
    return max(runs, key=lambda d: d.rate)


def measure_reference(args: argparse.Namespace, ctx: Context, when: str) -> float:
    say(f"pgbench reference {when}: {args.jobs} jobs, {PGBENCH_CLIENTS} clients")
    tps = pgbench_reference(ctx.bench_url, args.jobs, ctx.workdir)
    ctx.report.add(f"pgbench one-statement claim+complete {when}", f"{tps:,.0f} tps")
    return tps


def section_reference(args: argparse.Namespace, ctx: Context) -> None:
    """The reference is measured before the drains here and again after them (in section_drain).

    On a shared two-core machine the load changes from one minute to the next, so a reference
    taken only before the drains would compare figures from different minutes; the mean of the
    two brackets the drains.
    """
    if not (shutil.which("pgbench") or Path("/usr/bin/pgbench").exists()):
        ctx.report.notes.append("pgbench not found: no reference, drain ratios not computed")
        return
    ctx.references.append(measure_reference(args, ctx, "before the drains"))


def _vs_reference(ctx: Context, rate: float) -> str:
    return f"{rate / ctx.reference:.2f}x pgbench; " if ctx.reference else ""


def section_drain(args: argparse.Namespace, ctx: Context) -> None:
    """C: one runjobs at default settings (and at each ``--concurrency``); D: two of them."""
    say(f"C: drain of {args.jobs} no-op jobs, one runjobs, default settings")
    ctx.drain_c = measure_drain(None, args.jobs, ctx.workdir)
    variants = []
    for concurrency in args.concurrency:
        say(f"C: drain of {args.jobs} no-op jobs, one runjobs --concurrency {concurrency}")
        variants.append(measure_drain(concurrency, args.jobs, ctx.workdir))
    # The throughput mode: handlers registered with atomic=False (no transaction of the
    # runner's around them, every completion batched), at the same settings.
    for concurrency in [None, *args.concurrency]:
        say(f"C: drain of {args.jobs} atomic=False no-op jobs, one runjobs "
            + (f"--concurrency {concurrency}" if concurrency is not None else "default settings"))
        variants.append(measure_drain(concurrency, args.jobs, ctx.workdir,
                                      job_type=NOOP_AUTOCOMMIT))
    say(f"D: drain of {args.jobs} no-op jobs, two runjobs processes, default settings")
    ctx.drain_d = measure_drain(None, args.jobs, ctx.workdir, processes=2)
    if ctx.references:
        ctx.references.append(measure_reference(args, ctx, "after the drains"))
        ctx.reference = statistics.mean(ctx.references)
        ctx.report.add("pgbench reference (mean of before and after)", f"{ctx.reference:,.0f} tps")
    c, d = ctx.drain_c, ctx.drain_d
    # The throughput-mode figure set against PgQueuer's batch 500: the fastest one-process drain
    # (atomic=False or not, whichever concurrency).
    ctx.drain_best = max([c, *variants], key=lambda drain: drain.rate)
    ctx.report.add(f"C drain {args.jobs:,} no-op jobs, runjobs defaults", f"{c.rate:,.0f} jobs/s",
                   "", f"{_vs_reference(ctx, c.rate)}{cpu_text(c)}")
    for v in variants:
        ctx.report.add(f"C drain, {v.how}", f"{v.rate:,.0f} jobs/s",
                       "", f"{_vs_reference(ctx, v.rate)}{cpu_text(v)}")
    ratio = d.rate / c.rate
    # A second process adds throughput only where the first left CPU idle: the machine's busy
    # share during C and during D says how much there was, and whether D used it.
    ctx.report.add("D drain, two runjobs processes, defaults", f"{d.rate:,.0f} jobs/s",
                   ">= 1.6x C", verdict(ratio >= 1.6, f"{ratio:.2f}x C; {cpu_text(d)}"))


def section_backlog(args: argparse.Namespace, ctx: Context) -> None:
    """Flat cost: ``--backlog-factor`` times the jobs, then the same with a snapshot held."""
    base = ctx.drain_c
    if base is None:
        say(f"C: drain of {args.jobs} no-op jobs, default settings (backlog baseline)")
        base = ctx.drain_c = measure_drain(None, args.jobs, ctx.workdir)
    big = args.jobs * args.backlog_factor
    say(f"backlog: drain of {big} no-op jobs, default settings")
    large = measure_drain(None, big, ctx.workdir)
    say(f"backlog: drain of {big} no-op jobs with a REPEATABLE READ snapshot held")
    held = measure_drain(None, big, ctx.workdir, hold_snapshot=True)
    ratio = large.rate / base.rate
    ctx.report.add(f"C drain {big:,} jobs (vs {args.jobs:,})", f"{large.rate:,.0f} jobs/s",
                   f">= 0.9x {args.jobs:,}", verdict(ratio >= 0.9, f"{ratio:.2f}x"))
    ratio = held.rate / large.rate
    ctx.report.add(f"C drain {big:,} jobs, snapshot held throughout", f"{held.rate:,.0f} jobs/s",
                   ">= 0.8x unheld", verdict(ratio >= 0.8, f"{ratio:.2f}x; {cpu_text(held)}"))


def section_pickup(args: argparse.Namespace, ctx: Context) -> None:
    say(f"pickup latency, {args.pickup_samples} samples")
    from_commit, from_call = measure_pickup(ctx.bench_url, args.pickup_samples, ctx.workdir)
    p50, p99 = pct(from_commit, 50), pct(from_commit, 99)
    ctx.ours["E"] = (p50, p99)
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
    ctx.ours["A"] = e99
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
    ctx.ours["B"] = whole
    ctx.report.add(f"enqueue_many() {args.many_total:,} in batches of {ENQUEUE_BATCH:,}",
                   f"{batched:,.0f} jobs/s", ">= 30,000 jobs/s",
                   verdict(batched >= 30000, f"{batched / 30000:.2f}x target"))
    ctx.report.add(f"enqueue_many() {args.many_total:,} in one batch", f"{whole:,.0f} jobs/s",
                   ">= 30,000 jobs/s", verdict(whole >= 30000, f"{whole / 30000:.2f}x target"))


def peers_dir() -> Path | None:
    """The shared peer harness (``BENCH_PEERS_DIR``, else ``shared/bench-peers`` beside the
    checkout or one level up), if present."""
    candidates = [os.environ.get("BENCH_PEERS_DIR", ""),
                  str(ROOT.parent / "shared" / "bench-peers"),
                  str(ROOT.parent.parent / "shared" / "bench-peers")]
    for c in candidates:
        if c and (Path(c) / "common.py").exists():
            return Path(c)
    return None


def peers_python() -> Path | None:
    """The bench venv's interpreter, if PgQueuer and Procrastinate are installed there."""
    venv = Path(os.environ.get("PEERS_VENV", os.path.expanduser("~/.cache/peers-venv")))
    python = venv / "bin" / "python"
    if not python.exists():
        return None
    probe = subprocess.run([str(python), "-c", "import pgqueuer, procrastinate"],
                           capture_output=True, timeout=60)
    return python if probe.returncode == 0 else None


def run_peer(script: str, workloads: str, env: dict[str, str], harness: Path, python: Path,
             out: Path) -> None:
    """One of the harness's runners (it creates and drops its own ``bench_*`` database)."""
    full_env = {**os.environ, **env, "BENCH_OUT": str(out), "BENCH_REPS": "1"}
    for key in ("DJANGO_SETTINGS_MODULE", "PJ_BENCH_DATABASE_URL"):
        full_env.pop(key, None)
    log = out / f"{script}.log"
    with log.open("ab") as sink:
        done = subprocess.run([str(python), script, workloads], cwd=harness, env=full_env,
                              stdout=sink, stderr=subprocess.STDOUT, timeout=3600)
    if done.returncode:
        raise RuntimeError(f"{script} {workloads} failed ({done.returncode}); see {log}")


def peer_records(out: Path) -> dict[tuple[str, str, str], dict[str, Any]]:
    found: dict[tuple[str, str, str], dict[str, Any]] = {}
    for path in (out / "raw").glob("*.jsonl"):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            found[(rec["system"], rec["workload"], rec["variant"])] = rec
    return found


def section_peers(args: argparse.Namespace, ctx: Context) -> None:
    """PgQueuer and Procrastinate, same workloads, same run, through the shared harness."""
    harness, python = peers_dir(), peers_python()
    if harness is None or python is None:
        ctx.report.notes.append("peer harness or peers venv (pgqueuer, procrastinate) not found: "
                                "no peer comparison")
        return
    out = ctx.workdir / "peers"
    out.mkdir(exist_ok=True)
    n = str(args.jobs)
    base = {"BENCH_N": n, "BENCH_PICKUP_SAMPLES": str(args.peer_pickup_samples)}
    say(f"PgQueuer via {harness}: workloads {args.peer_workloads}, {n} jobs")
    run_peer("run_pgqueuer.py", args.peer_workloads, {**base, "BENCH_PGQ_BATCHES": "500"},
             harness, python, out)
    if "backlog" in args.only and "C" in args.peer_workloads:
        big = str(args.jobs * args.backlog_factor)
        say(f"PgQueuer backlog: {big} jobs")
        run_peer("run_pgqueuer.py", "C", {**base, "BENCH_N": big, "BENCH_PGQ_BATCHES": "",
                                          "BENCH_VARIANT_SUFFIX": " backlog"},
                 harness, python, out)
    if args.procrastinate:
        say(f"Procrastinate: workloads {args.peer_workloads.replace('A', '').replace('B', '')}")
        run_peer("run_procrastinate.py", args.peer_workloads.replace("A", "").replace("B", ""),
                 base, harness, python, out)
    recs = peer_records(out)

    def rec(system: str, workload: str, variant: str) -> dict[str, Any] | None:
        return recs.get((system, workload, variant))

    pgq_c = rec("pgqueuer", "C", "default: batch_size=10")
    pgq_c500 = rec("pgqueuer", "C", "batch_size=500")
    pgq_d = rec("pgqueuer", "D", "default: batch_size=10")
    pgq_big = rec("pgqueuer", "C", "default: batch_size=10 backlog")
    ours_c = ctx.drain_c.rate if ctx.drain_c else None
    judge = _one_shot_verdict(args)
    if pgq_c:
        rate = pgq_c["jobs_per_s"]
        ctx.report.add("PgQueuer C drain, default (batch 10)", f"{rate:,.0f} jobs/s",
                       "ours >= 1.0x", judge(bool(ours_c and ours_c >= rate),
                                             f"ours {ours_c / rate:.2f}x") if ours_c else "")
    if pgq_c500:
        rate = pgq_c500["jobs_per_s"]
        ours_best, best_text = ctx.drain_best, ""
        if ours_best is not None:
            best_text = judge(ours_best.rate >= rate,
                                f"ours at its best ({ours_best.how}) "
                                f"{ours_best.rate / rate:.2f}x")
        ctx.report.add("PgQueuer C drain, batch 500", f"{rate:,.0f} jobs/s",
                       "throughput mode >= 1.0x", best_text)
    if pgq_d:
        d_rate = pgq_d["jobs_per_s"]
        ctx.report.add("PgQueuer D drain, 2 workers, default", f"{d_rate:,.0f} jobs/s",
                       "", f"{d_rate / pgq_c['jobs_per_s']:.2f}x its C" if pgq_c else "")
    if pgq_big and pgq_c:
        ctx.report.add(f"PgQueuer C drain {int(n) * args.backlog_factor:,} jobs",
                       f"{pgq_big['jobs_per_s']:,.0f} jobs/s", "",
                       f"{pgq_big['jobs_per_s'] / pgq_c['jobs_per_s']:.2f}x its {int(n):,}")
    for system, variant in (("pgqueuer", "default: batch_size=10, continuous"),
                            ("procrastinate", "concurrency=1,listen_notify")):
        e = rec(system, "E", variant)
        if e:
            ours = ctx.ours.get("E")
            ctx.report.add(f"{system} E pickup p50 / p99",
                           f"{e['p50_ms']:.2f} / {e['p99_ms']:.2f} ms",
                           "", f"ours {ours[0]:.2f} / {ours[1]:.2f} ms" if ours else "")
    pgq_a, pgq_b = rec("pgqueuer", "A", "default"), rec("pgqueuer", "B", "default")
    if pgq_a:
        ours_a = ctx.ours.get("A")
        ctx.report.add("PgQueuer A enqueue p50 / p99",
                       f"{pgq_a['p50_ms']:.2f} / {pgq_a['p99_ms']:.2f} ms", "ours p99 <= it",
                       judge(ours_a <= pgq_a["p99_ms"], f"ours p99 {ours_a:.2f} ms")
                       if ours_a is not None else "")
    if pgq_b:
        ours_b = ctx.ours.get("B")
        ctx.report.add("PgQueuer B bulk enqueue", f"{pgq_b['jobs_per_s']:,.0f} jobs/s",
                       "ours >= 1.0x", verdict(ours_b >= pgq_b["jobs_per_s"],
                                               f"ours {ours_b / pgq_b['jobs_per_s']:.2f}x")
                       if ours_b is not None else "")
    for wl in ("C", "D"):
        best = max((r for (sysname, w, _), r in recs.items()
                    if sysname == "procrastinate" and w == wl),
                   key=lambda r: r["jobs_per_s"], default=None)
        if best:
            ctx.report.add(f"Procrastinate {wl} drain, best ({best['variant']})",
                           f"{best['jobs_per_s']:,.0f} jobs/s")
    busy = [r for r in recs.values() if r.get("foreign_cpu_frac", 0) > 0.1]
    if busy:
        ctx.report.notes.append(f"{len(busy)} peer measurements ran while other processes used "
                                ">10% of the CPU; raw records in " + str(out / "raw"))


def _one_shot_verdict(args: argparse.Namespace) -> Any:
    """``verdict``, or only the ratio when the rounds section will judge the same comparison
    from the median of several head-to-head rounds (one pair minutes apart is not evidence)."""
    if "rounds" in args.only and args.rounds > 0:
        return lambda ok, text: f"{text} (one shot; see the rounds)"
    return verdict


@dataclass
class Round:
    """One head-to-head round: our figures and PgQueuer's, measured back to back."""

    ours_c: float
    #: The throughput mode at defaults: the one configuration set against batch 500, chosen
    #: before the run (the best of several noisy drains would be biased upwards).
    ours_fast: float
    #: The throughput mode at each extra ``--concurrency``, printed for information.
    ours_fast_other: list[Drain]
    ours_enqueue_p99: float
    pgq_c: float | None
    pgq_c500: float | None
    pgq_enqueue_p99: float | None


def _median_ratio(pairs: list[tuple[float, float | None]]) -> tuple[float, list[float]] | None:
    ratios = [ours / theirs for ours, theirs in pairs if theirs]
    return (statistics.median(ratios), ratios) if ratios else None


def section_rounds(args: argparse.Namespace, ctx: Context) -> None:
    """Ours and PgQueuer back to back, ``--rounds`` times: C default, the throughput mode at
    defaults against batch 500, and ``enqueue()`` p99 against PgQueuer's single enqueue."""
    harness, python = peers_dir(), peers_python()
    if args.rounds <= 0 or harness is None or python is None:
        if args.rounds > 0:
            ctx.report.notes.append("no head-to-head rounds: peer harness or venv not found")
        return
    n = str(args.jobs)
    rounds: list[Round] = []
    for number in range(1, args.rounds + 1):
        out = ctx.workdir / f"round-{number}"
        out.mkdir(exist_ok=True)

        def theirs(number: int = number, out: Path = out) -> None:
            say(f"round {number}/{args.rounds}: PgQueuer (C default and batch 500, A)")
            run_peer("run_pgqueuer.py", "C", {"BENCH_N": n, "BENCH_PGQ_BATCHES": "500"},
                     harness, python, out)
            run_peer("run_pgqueuer.py", "A", {"BENCH_N": str(args.enqueue_samples),
                                              "BENCH_PGQ_BATCHES": ""}, harness, python, out)

        # ABBA order (ours first in odd rounds, PgQueuer first in even ones): a machine that
        # drifts slower or faster through the run does not favour whoever always goes first.
        if number % 2 == 0:
            theirs()
        say(f"round {number}/{args.rounds}: ours (C defaults, atomic=False drains, enqueue())")
        c = measure_drain(None, args.jobs, ctx.workdir, quiet=True)
        fast, *others = [measure_drain(concurrency, args.jobs, ctx.workdir,
                                       job_type=NOOP_AUTOCOMMIT, quiet=True)
                         for concurrency in [None, *args.concurrency]]
        e99 = pct(measure_enqueue(args.enqueue_samples, quiet=True), 99)
        if number % 2 == 1:
            theirs()
        recs = peer_records(out)

        def value(workload: str, variant: str, key: str, recs: dict[Any, Any] = recs) -> Any:
            rec = recs.get(("pgqueuer", workload, variant))
            return rec[key] if rec else None

        rounds.append(Round(
            ours_c=c.rate, ours_fast=fast.rate, ours_fast_other=others, ours_enqueue_p99=e99,
            pgq_c=value("C", "default: batch_size=10", "jobs_per_s"),
            pgq_c500=value("C", "batch_size=500", "jobs_per_s"),
            pgq_enqueue_p99=value("A", "default", "p99_ms"),
        ))
    label = f"median of {len(rounds)} rounds"
    c_ratio = _median_ratio([(r.ours_c, r.pgq_c) for r in rounds])
    if c_ratio:
        ctx.report.add(f"head to head: C defaults vs PgQueuer default, {label}",
                       f"{c_ratio[0]:.2f}x", "ours >= 1.0x",
                       verdict(c_ratio[0] >= 1.0, _each(c_ratio[1])))
    fast_ratio = _median_ratio([(r.ours_fast, r.pgq_c500) for r in rounds])
    if fast_ratio:
        ctx.report.add(f"head to head: atomic=False at defaults vs PgQueuer batch 500, {label}",
                       f"{fast_ratio[0]:.2f}x", "throughput mode >= 1.0x",
                       verdict(fast_ratio[0] >= 1.0, _each(fast_ratio[1])))
    # For latency the ratio is theirs / ours, so that >= 1.0 means ours is at most theirs.
    a_ratio = _median_ratio([(r.pgq_enqueue_p99 or 0.0, r.ours_enqueue_p99) for r in rounds
                             if r.pgq_enqueue_p99])
    if a_ratio:
        ctx.report.add(f"head to head: PgQueuer enqueue p99 / ours, {label}",
                       f"{a_ratio[0]:.2f}x", "ours p99 <= it (>= 1.0x)",
                       verdict(a_ratio[0] >= 1.0, _each(a_ratio[1])))
    for number, r in enumerate(rounds, 1):
        extra = "".join(f"; atomic=False {d.how.split(', ', 1)[1]} {d.rate:,.0f}"
                        for d in r.ours_fast_other)
        ctx.report.add(
            f"  round {number}: ours C / atomic=False / enqueue p99",
            f"{r.ours_c:,.0f} / {r.ours_fast:,.0f} / {r.ours_enqueue_p99:.2f} ms", "",
            f"PgQueuer C {_num(r.pgq_c)} / batch 500 {_num(r.pgq_c500)} / enqueue p99 "
            + (f"{r.pgq_enqueue_p99:.2f} ms" if r.pgq_enqueue_p99 else "-") + extra)


def _each(ratios: list[float]) -> str:
    return "rounds " + ", ".join(f"{x:.2f}x" for x in ratios)


def _num(rate: float | None) -> str:
    return f"{rate:,.0f}" if rate else "-"


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
        full = drain_once([proc], args.jobs)
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
            drain_once([proc], args.jobs)
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
    reference: float | None = None
    references: list[float] = field(default_factory=list)
    drain_c: Drain | None = None
    drain_best: Drain | None = None
    drain_d: Drain | None = None
    best_concurrency: int | None = None
    #: Our figures the peer section compares with: "A" enqueue p99 ms, "B" bulk jobs/s,
    #: "E" pickup (p50, p99) ms.
    ours: dict[str, Any] = field(default_factory=dict)


def run(args: argparse.Namespace) -> int:
    server_url = os.environ.get("DATABASE_URL") or DEFAULT_SERVER_URL
    os.environ.pop("PJ_BENCH_DATABASE_URL", None)
    bench_url = bench_database_url()
    say(f"recreating database {BENCH_DB_NAME} on {urlsplit(server_url).hostname}")
    recreate_database(server_url, BENCH_DB_NAME)
    setup_django(bench_url)
    facts = server_facts()
    ctx = Context(bench_url=bench_url, workdir=Path(tempfile.mkdtemp(prefix="pj-bench-")),
                  report=Report())
    load_start = os.getloadavg()
    started = datetime.now(UTC)
    sections = {"reference": section_reference, "drain": section_drain,
                "backlog": section_backlog, "pickup": section_pickup,
                "enqueue": section_enqueue, "peers": section_peers,
                "rounds": section_rounds}
    for name, section in sections.items():
        if name in args.only:
            section(args, ctx)
    if args.finished_rows:
        section_history(args, ctx)
    if args.memory:
        section_memory(args, ctx)
    load_end = os.getloadavg()
    header = [
        f"django-persistent-jobs bench, {started:%Y-%m-%d %H:%M} UTC, {platform.node()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}",
        f"PostgreSQL {facts['version']} (synchronous_commit={facts['synchronous_commit']}, "
        f"fsync={facts['fsync']}, autovacuum={facts['autovacuum']}), database {BENCH_DB_NAME}; "
        f"{args.jobs:,} jobs per drain; no VACUUM during any measurement",
        f"load average (1 min) at start {load_start[0]:.2f}, at end {load_end[0]:.2f}; "
        f"runner logs in {ctx.workdir}",
        "command: " + " ".join(["bench/run.py", *sys.argv[1:]]),
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
                        help="jobs per drain and pgbench run (default 10000; 2000 with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="smaller run for a smoke check: fewer jobs and samples, PgQueuer's "
                             "drain only")
    parser.add_argument("--concurrency", type=_int_list, default=None,
                        help="extra runjobs --concurrency values for C (default 32; none quick)")
    parser.add_argument("--backlog-factor", type=int, default=4,
                        help="the backlog case drains this many times --jobs (default 4)")
    parser.add_argument("--pickup-samples", type=int, default=None)
    parser.add_argument("--enqueue-samples", type=int, default=None)
    parser.add_argument("--many-total", type=int, default=None,
                        help="jobs for the enqueue_many rate (default --jobs)")
    parser.add_argument("--only", type=_sections, default=set(SECTIONS),
                        help=f"comma-separated sections to run, of {','.join(SECTIONS)}")
    parser.add_argument("--peer-workloads", default=None,
                        help="harness workloads for the peers (default ABCDE; C quick)")
    parser.add_argument("--peer-pickup-samples", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None,
                        help="head-to-head rounds against PgQueuer (default 3; 0 with --quick)")
    parser.add_argument("--no-procrastinate", dest="procrastinate", action="store_false",
                        default=None, help="skip Procrastinate (skipped by --quick)")
    parser.add_argument("--finished-rows", type=int, default=0,
                        help="also drain with this many finished rows in the table")
    parser.add_argument("--memory", action="store_true",
                        help="also drain repeatedly through one runner and print its RSS")
    parser.add_argument("--memory-rounds", type=int, default=5)
    parser.add_argument("--keep-db", action="store_true",
                        help=f"leave {BENCH_DB_NAME} as the run left it, for inspection")
    args = parser.parse_args(argv)
    quick = args.quick
    defaults: dict[str, Any] = {
        "jobs": 2000 if quick else 10000,
        "concurrency": [] if quick else [32],
        "pickup_samples": 100 if quick else 300,
        "enqueue_samples": 500 if quick else 2000,
        "peer_workloads": "C" if quick else "ABCDE",
        "peer_pickup_samples": 10 if quick else 50,
        "procrastinate": not quick,
        "rounds": 0 if quick else 3,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.many_total is None:
        args.many_total = args.jobs
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
