"""The fault suite's machinery: runner processes we can kill, a private PostgreSQL we can restart,
and the checks every scenario ends with.

Synchronisation is by events with deadlines only: a runner's log line (runners log one line per
event to stdout, see ``PJ_TEST_LOG`` in ``tests/settings.py``) or a database state polled until a
deadline. Fixed sleeps appear only as *fault parameters* (how long an outage lasts, how often a
runner is killed), never as a stand-in for "wait until X happened".
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from django.db import InterfaceError, OperationalError, connection, transaction

from django_persistent_jobs import enqueue_many
from tests.conftest import test_database_env

from .handlers import LEDGER_DDL

ROOT = Path(__file__).resolve().parents[2]

#: Runner timings for the suite: short enough for CI, with the production ratios kept
#: (heartbeat well under half the stale-lock timeout).
STALE = 2.0
HEARTBEAT = 0.4
POLL = 0.5
FAST_SETTINGS: dict[str, Any] = {
    "STALE_LOCK_TIMEOUT": STALE,
    "HEARTBEAT_INTERVAL": HEARTBEAT,
    "POLL_INTERVAL": POLL,
    "SHUTDOWN_GRACE": 3,
    "CLEANUP_INTERVAL": 3600,
}
#: Where the suite's runners run job code: ``0`` on threads of the runner process, ``N`` in N
#: worker processes. CI runs the suite both ways (``PJ_TEST_PROCESSES=1`` for the second).
PROCESSES = os.environ.get("PJ_TEST_PROCESSES", "0")
JOB_TYPE = "faults.ledger"
TERMINAL = ("completed", "dead_lettered", "cancelled")
APP_PREFIX = "pjfaults-"
_STARTED = re.compile(r"runner (\S+) started")


# --------------------------------------------------------------------------- runner processes
class RunnerProcess:
    """A ``manage.py runjobs`` subprocess whose log lines we collect and can wait for."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        self.lines: list[str] = []
        self.eof = False
        self.cond = threading.Condition()
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._log = open(log_path, "w", encoding="utf-8")  # noqa: SIM115 (closed by the reader)
        self.runner_id: str | None = None  # from its "runner ... started" line
        self.killed = False
        self._reader = threading.Thread(target=self._read, name=f"log-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self._log.write(line + "\n")
            if self.runner_id is None:
                started = _STARTED.search(line)
                if started:
                    self.runner_id = started.group(1)
            with self.cond:
                self.lines.append(line)
                self.cond.notify_all()
        self._log.close()
        with self.cond:
            self.eof = True
            self.cond.notify_all()

    # -- process
    @property
    def pid(self) -> int:
        """The runner's own pid (inside a pid namespace it is 1 to itself; this is the host's)."""
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, sig: int) -> None:
        if sig in (signal.SIGSTOP, signal.SIGCONT):
            # Freeze or thaw the whole runner: its worker processes too, if it has any (they
            # share its process group; it leads one of its own).
            os.killpg(self.pid, sig)
        else:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL and reap: no handler runs, no shutdown code, sockets just close."""
        self.killed = True
        if self.alive:
            self.send(signal.SIGKILL)
        self.proc.wait(10)

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"runner {self.name} did not exit within {timeout}s\n{self.tail()}"
            ) from None

    # -- log
    def mark(self) -> int:
        """A position in the log; ``wait_line(..., since=mark)`` only looks at later lines."""
        with self.cond:
            return len(self.lines)

    def find(self, pattern: str, since: int = 0) -> list[re.Match[str]]:
        regex = re.compile(pattern)
        with self.cond:
            lines = self.lines[since:]
        return [m for m in (regex.search(line) for line in lines) if m]

    def wait_line(self, pattern: str, timeout: float = 15.0, since: int = 0,
                  count: int = 1) -> re.Match[str]:
        """Wait until ``count`` log lines after ``since`` match ``pattern``; return the last."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen: list[re.Match[str]] = []
        position = since
        with self.cond:
            while True:
                for line in self.lines[position:]:
                    match = regex.search(line)
                    if match:
                        seen.append(match)
                        if len(seen) >= count:
                            return match
                position = len(self.lines)
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self.eof:
                    break
                self.cond.wait(min(remaining, 0.5))
        state = "exited" if self.eof else "still running"
        raise AssertionError(
            f"runner {self.name} ({state}): {len(seen)}/{count} lines matching {pattern!r} "
            f"after {timeout}s\n{self.tail()}"
        )

    def tail(self, lines: int = 40) -> str:
        with self.cond:
            return "\n".join(f"    [{self.name}] {line}" for line in self.lines[-lines:])


def _host_pid_of_child(pid: int) -> int | None:
    """The first child of ``pid`` (the runner that ``unshare --fork`` started)."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return None
    return int(children[0]) if children else None


class Fleet:
    """Starts runner processes for one test and kills whatever is left at the end."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.runners: list[RunnerProcess] = []
        self._count = 0

    def database_url(self, name: str, base: str | None = None) -> str:
        url = base or test_database_env()["DATABASE_URL"]
        separator = "&" if "?" in url else "?"
        return f"{url}{separator}application_name={quote(APP_PREFIX + name)}"

    def spawn(
        self, name: str | None = None, *, concurrency: int = 4,
        settings: dict[str, Any] | None = None, args: Sequence[str] = (),
        database_url: str | None = None, wait_started: bool = True,
        pid_namespace: bool = False, timeout: float = 30.0, command: Sequence[str] | None = None,
    ) -> RunnerProcess:
        """Start ``manage.py runjobs`` with the suite's short timings (``settings`` on top).

        ``command`` replaces ``runjobs ...`` (another management command that runs a runner);
        ``pid_namespace`` runs it as pid 1 of a new pid namespace, so every such runner has the
        same pid: the pid-reuse case, for real.
        """
        self._count += 1
        name = name or f"r{self._count}"
        env = test_database_env()
        env.update({
            "DATABASE_URL": self.database_url(name, database_url),
            "PJ_TEST_SETTINGS": json.dumps({**FAST_SETTINGS, **(settings or {})}),
            "PJ_TEST_LOG": "INFO",
        })
        if command is None and "--processes" not in args:
            args = [*args, "--processes", PROCESSES]
        argv = [sys.executable, str(ROOT / "manage.py"), *(command or [
            "runjobs", "--no-scheduler", "--concurrency", str(concurrency), *args])]
        if pid_namespace:
            argv = ["unshare", "--pid", "--fork", "--kill-child", *argv]
        runner = RunnerProcess(name, argv, env, self.log_dir / f"{name}-{self._count}.log")
        self.runners.append(runner)
        if wait_started:
            self.wait_started(runner, timeout)
        return runner

    def spawn_many(self, count: int, **options: Any) -> list[RunnerProcess]:
        """Start ``count`` runners side by side (Django boots in parallel), then wait for all."""
        runners = [self.spawn(wait_started=False, **options) for _ in range(count)]
        for runner in runners:
            self.wait_started(runner, options.get("timeout", 30.0))
        return runners

    @staticmethod
    def wait_started(runner: RunnerProcess, timeout: float = 30.0) -> str:
        match = runner.wait_line(_STARTED.pattern, timeout=timeout)
        runner.runner_id = match.group(1)
        return runner.runner_id

    def close(self) -> None:
        for runner in self.runners:
            if runner.alive:
                try:
                    runner.send(signal.SIGCONT)  # a frozen process cannot close its sockets
                    runner.send(signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for runner in self.runners:
            with suppress(subprocess.TimeoutExpired):
                runner.proc.wait(10)
            runner._reader.join(5)

    def logs(self) -> str:
        return "\n".join(f"--- {r.name} (pid {r.pid}, exit {r.proc.returncode})\n{r.tail(60)}"
                         for r in self.runners)


def database_url() -> str:
    """The URL of the database this test process uses (the shared server's test database)."""
    return test_database_env()["DATABASE_URL"]


def runner_pid_from_id(runner_id: str) -> int:
    """Runner ids are ``host:pid:random``."""
    return int(runner_id.split(":")[-2])


# --------------------------------------------------------------------------- database helpers
def db_retrying(fn: Callable[[], Any]) -> Any:
    """Run a test-side query, reconnecting once if the server restarted under us."""
    try:
        return fn()
    except (OperationalError, InterfaceError):
        connection.close()
        return fn()


def sql(query: str, params: Sequence[Any] | dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
    with connection.cursor() as cursor:
        cursor.execute(query, params)
        return list(cursor.fetchall()) if cursor.description else []


def sql_value(query: str, params: Sequence[Any] | dict[str, Any] | None = None) -> Any:
    rows = sql(query, params)
    return rows[0][0] if rows else None


def wait_until(predicate: Callable[[], Any], timeout: float, message: str,
               interval: float = 0.05) -> Any:
    """Poll ``predicate`` until truthy or the deadline; a dropped connection counts as "not yet"
    (the scenarios restart PostgreSQL under the test's feet)."""
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except (OperationalError, InterfaceError) as exc:
            last_error = exc
            connection.close()
        if time.monotonic() >= deadline:
            extra = f" (last database error: {last_error})" if last_error else ""
            raise AssertionError(f"timed out after {timeout}s waiting for {message}{extra}")
        time.sleep(interval)


def create_ledger() -> None:
    """The ledger table (no unique constraint, on purpose; see handlers.py), emptied per test."""
    with connection.cursor() as cursor:
        cursor.execute(LEDGER_DDL)
        cursor.execute("TRUNCATE faults_ledger")


def enqueue_jobs(count: int, payload: dict[str, Any] | None = None, **options: Any) -> list[Any]:
    """Enqueue ``count`` ``faults.ledger`` jobs through the public API; return their ids."""
    items = [(JOB_TYPE, dict(payload or {}, n=i)) for i in range(count)]
    ids: list[Any] = []
    with transaction.atomic():
        for start in range(0, count, 1000):
            ids.extend(job.id for job in enqueue_many(items[start:start + 1000], **options))
    return ids


def enqueue_one(payload: dict[str, Any] | None = None, **options: Any) -> Any:
    return enqueue_jobs(1, payload, **options)[0]


def status_counts(ids: Sequence[Any]) -> Counter[str]:
    rows = sql("SELECT status, count(*) FROM persistent_jobs WHERE id = ANY(%s) GROUP BY status",
               [list(ids)])
    return Counter({status: n for status, n in rows})


def job_row(job_id: Any) -> dict[str, Any]:
    rows = sql(
        "SELECT status, attempts, locked_by, last_error_code, progress, lock_token "
        "FROM persistent_jobs WHERE id = %s", [job_id],
    )
    assert rows, f"job {job_id} does not exist"
    status, attempts, locked_by, code, progress, token = rows[0]
    if isinstance(progress, str):
        progress = json.loads(progress)
    return {"status": status, "attempts": attempts, "locked_by": locked_by, "code": code,
            "progress": progress, "token": token}


def wait_status(job_id: Any, statuses: str | Iterable[str],
                timeout: float = 20.0) -> dict[str, Any]:
    wanted = (statuses,) if isinstance(statuses, str) else tuple(statuses)
    return wait_until(lambda: (row := job_row(job_id))["status"] in wanted and row,
                      timeout, f"job {job_id} to be {'/'.join(wanted)}")


def wait_all_terminal(ids: Sequence[Any], timeout: float) -> Counter[str]:
    def done() -> Counter[str] | None:
        counts = status_counts(ids)
        return counts if sum(counts[s] for s in TERMINAL) == len(ids) else None

    try:
        return wait_until(done, timeout, f"{len(ids)} jobs to reach a terminal state",
                          interval=0.2)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; statuses: {dict(db_retrying(lambda: status_counts(ids)))}") \
            from None


@dataclass
class Attempt:
    job_id: Any
    attempt: int
    runner_id: str
    outcome: str
    error_code: str


def attempts_of(ids: Sequence[Any]) -> list[Attempt]:
    rows = sql("SELECT job_id, attempt, runner_id, outcome, error_code FROM "
               "persistent_jobs_attempts WHERE job_id = ANY(%s) ORDER BY job_id, id", [list(ids)])
    return [Attempt(*row) for row in rows]


def ledger_of(job_id: Any) -> list[tuple[int, str]]:
    return [(a, r) for a, r in sql(
        "SELECT attempt, runner_id FROM faults_ledger WHERE job_id = %s ORDER BY id", [job_id])]


@dataclass
class Verdict:
    """What the end-of-scenario check found (for scenario-specific assertions and the report)."""

    statuses: Counter[str]
    outcomes: Counter[tuple[str, str]]
    ledger_rows: int
    attempts: list[Attempt] = field(repr=False)

    def by_job(self) -> dict[Any, list[Attempt]]:
        result: dict[Any, list[Attempt]] = {}
        for attempt in self.attempts:
            result.setdefault(attempt.job_id, []).append(attempt)
        return result


def verify(ids: Sequence[Any], *, require_completed: bool = True) -> Verdict:
    """The checks every scenario ends with.

    * every job is terminal (and, unless told otherwise, completed);
    * the ledger holds exactly one row per completed job and none for any other job, and that
      row was written by the attempt the job records as completed (same attempt, same runner);
    * ``JobAttempt`` rows add up: none left ``running``, every one finished, one ``completed``
      attempt per completed job, and as many charged attempts (everything but ``interrupted``
      hand-backs) as the job's ``attempts`` counter.
    """
    ids = list(ids)
    statuses = status_counts(ids)
    assert sum(statuses[s] for s in TERMINAL) == len(ids), f"not all terminal: {dict(statuses)}"
    if require_completed:
        assert statuses["completed"] == len(ids), f"not all completed: {dict(statuses)}"
    problems: list[str] = []
    duplicates = sql("SELECT job_id, count(*) FROM faults_ledger WHERE job_id = ANY(%s) "
                     "GROUP BY job_id HAVING count(*) > 1", [ids])
    if duplicates:
        problems.append(f"jobs committed more than once: {duplicates[:10]}")
    strays = sql("SELECT l.job_id, j.status FROM faults_ledger l JOIN persistent_jobs j "
                 "ON j.id = l.job_id WHERE l.job_id = ANY(%s) AND j.status <> 'completed'", [ids])
    if strays:
        problems.append(f"ledger rows for jobs that did not complete: {strays[:10]}")
    missing = sql("SELECT j.id FROM persistent_jobs j WHERE j.id = ANY(%s) AND "
                  "j.status = 'completed' AND NOT EXISTS (SELECT 1 FROM faults_ledger l "
                  "WHERE l.job_id = j.id)", [ids])
    if missing:
        problems.append(f"completed jobs without their ledger row: {missing[:10]}")
    mismatched = sql(
        "SELECT l.job_id, l.attempt, l.runner_id, a.attempt, a.runner_id FROM faults_ledger l "
        "JOIN persistent_jobs_attempts a ON a.job_id = l.job_id AND a.outcome = 'completed' "
        "WHERE l.job_id = ANY(%s) AND (a.attempt <> l.attempt OR a.runner_id <> l.runner_id)",
        [ids])
    if mismatched:
        problems.append(f"ledger rows written by an attempt that did not complete the job: "
                        f"{mismatched[:10]}")
    accounting = sql(
        """
        SELECT j.id, j.status, j.attempts,
               count(a.id) FILTER (WHERE a.outcome <> 'interrupted') AS charged,
               count(a.id) FILTER (WHERE a.outcome = 'completed') AS completed,
               count(a.id) FILTER (WHERE a.outcome = 'running' OR a.finished_at IS NULL) AS open
        FROM persistent_jobs j LEFT JOIN persistent_jobs_attempts a ON a.job_id = j.id
        WHERE j.id = ANY(%s) GROUP BY j.id
        HAVING j.attempts <> count(a.id) FILTER (WHERE a.outcome <> 'interrupted')
            OR count(a.id) FILTER (WHERE a.outcome = 'completed')
               <> (CASE WHEN j.status = 'completed' THEN 1 ELSE 0 END)
            OR count(a.id) FILTER (WHERE a.outcome = 'running' OR a.finished_at IS NULL) > 0
        """, [ids])
    if accounting:
        problems.append("attempt rows disagree with the jobs (id, status, attempts, charged, "
                        f"completed, open): {accounting[:10]}")
    assert not problems, "\n".join(problems)
    attempts = attempts_of(ids)
    ledger_rows = sql_value("SELECT count(*) FROM faults_ledger WHERE job_id = ANY(%s)", [ids])
    return Verdict(statuses=statuses,
                   outcomes=Counter((a.outcome, a.error_code) for a in attempts),
                   ledger_rows=ledger_rows, attempts=attempts)


def backends(app_name: str, where: str = "TRUE") -> list[tuple[Any, ...]]:
    """``(pid, state, wait_event, query)`` of one runner's connections (by application_name),
    in our own database only: the suite never touches other sessions on a shared server."""
    return sql(
        "SELECT pid, state, wait_event, query FROM pg_stat_activity WHERE datname = "
        f"current_database() AND application_name = %s AND pid <> pg_backend_pid() AND {where}",
        [APP_PREFIX + app_name],
    )


def terminate(pid: int) -> bool:
    """Terminate one of *our* runners' backends (checked by database and application name)."""
    return bool(sql_value(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid = %s AND "
        "datname = current_database() AND application_name LIKE %s", [pid, APP_PREFIX + "%"]))


def report(scenario: str, **numbers: Any) -> None:
    """Print a scenario's numbers; also append them to $PJ_FAULTS_REPORT (JSON lines) if set."""
    def plain(value: Any) -> Any:
        if isinstance(value, dict):
            return {"/".join(k) if isinstance(k, tuple) else str(k): plain(v)
                    for k, v in value.items()}
        return value

    line = json.dumps({"scenario": scenario, **{k: plain(v) for k, v in numbers.items()}},
                      default=str)
    print(line)
    path = os.environ.get("PJ_FAULTS_REPORT")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(line + "\n")


def cpu_seconds(pid: int) -> float:
    """User+system CPU time of a process so far (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------------- private PostgreSQL
def _postgres_bindir() -> Path | None:
    candidates = [os.environ.get("PJ_PG_BINDIR", "")]
    with suppress(OSError):
        candidates.append(subprocess.run(["pg_config", "--bindir"], capture_output=True,
                                         text=True, check=False).stdout.strip())
    candidates += sorted((str(p) for p in Path("/usr/lib/postgresql").glob("*/bin")),
                         reverse=True)
    for candidate in candidates:
        if candidate and (Path(candidate) / "initdb").exists():
            return Path(candidate)
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class PrivateCluster:
    """A throw-away PostgreSQL instance the suite may stop, restart and misconfigure at will.

    The development server is shared, so scenarios that take PostgreSQL down run against one of
    these instead. ``initdb`` refuses to run as root, so as root it runs as the ``postgres`` user.
    The cluster has a synchronous standby that never connects (``synchronous_standby_names =
    'ghost'``) while commits default to ``synchronous_commit = local``: a transaction that opts
    in to ``on`` then commits locally and waits forever, which is how a test makes a COMMIT
    whose outcome the client never hears.
    """

    def __init__(self) -> None:
        bindir = _postgres_bindir()
        if bindir is None:
            raise FileNotFoundError("no PostgreSQL server binaries (initdb) found; set "
                                    "PJ_PG_BINDIR")
        self.bindir = bindir
        self.base = Path(tempfile.mkdtemp(prefix="pj-faults-pg-"))
        self.data = self.base / "data"
        self.logfile = self.base / "server.log"
        self.port = _free_port()
        self.as_postgres: list[str] = (["runuser", "-u", "postgres", "--"]
                                       if os.geteuid() == 0 else [])
        if self.as_postgres:
            shutil.chown(self.base, "postgres", "postgres")
        self.base.chmod(0o700)

    def _run(self, *args: str, timeout: float = 60.0) -> str:
        result = subprocess.run([*self.as_postgres, *args], capture_output=True, text=True,
                                timeout=timeout, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({result.returncode}):\n"
                               f"{result.stdout}\n{result.stderr}\n{self.server_log()}")
        return result.stdout

    def init(self) -> None:
        self._run(str(self.bindir / "initdb"), "-D", str(self.data), "-U", "postgres",
                  "-A", "trust", "-E", "UTF8", "--no-sync", "--no-instructions")
        settings = {
            "port": self.port, "listen_addresses": "'127.0.0.1'",
            "unix_socket_directories": f"'{self.base}'", "max_connections": 100,
            "shared_buffers": "'32MB'", "fsync": "off", "full_page_writes": "off",
            "synchronous_standby_names": "'ghost'", "synchronous_commit": "local",
            "log_min_messages": "warning",
        }
        with open(self.data / "postgresql.conf", "a", encoding="utf-8") as conf:
            for key, value in settings.items():
                conf.write(f"{key} = {value}\n")

    def pg_ctl(self, *args: str) -> None:
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l", str(self.logfile),
                  "-w", "-t", "60", *args)
        connection.close()  # the test's own session did not survive either

    def start(self) -> None:
        self.pg_ctl("start")

    def stop(self, mode: str = "fast") -> None:
        self.pg_ctl("stop", "-m", mode)

    def restart(self, mode: str = "fast") -> None:
        self.pg_ctl("restart", "-m", mode)

    def url(self, dbname: str) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{dbname}"

    def execute(self, query: str, dbname: str = "postgres") -> None:
        import psycopg

        with psycopg.connect(host="127.0.0.1", port=self.port, user="postgres", dbname=dbname,
                             autocommit=True) as conn:
            conn.execute(query.encode())

    def server_log(self) -> str:
        try:
            return self.logfile.read_text()[-3000:]
        except OSError:
            return ""

    def destroy(self) -> None:
        with suppress(Exception):
            self.pg_ctl("stop", "-m", "immediate")
        shutil.rmtree(self.base, ignore_errors=True)


def migrate(database_url: str) -> None:
    """``manage.py migrate`` against another database, as a deployment would."""
    env = test_database_env()
    env["DATABASE_URL"] = database_url
    result = subprocess.run([sys.executable, str(ROOT / "manage.py"), "migrate", "--noinput",
                             "-v", "0"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


@contextmanager
def using_database(database_url: str) -> Iterator[None]:
    """Point this process's default connection at another database for a while.

    The test process talks to the private cluster through the same public API and ORM as
    everywhere else; only this thread uses the connection, and the original settings (the
    shared test database) are restored afterwards so pytest-django tears down as usual.
    """
    import environ

    target = environ.Env.db_url_config(database_url)
    settings = connection.settings_dict
    saved = dict(settings)
    connection.close()
    settings.update({key: target[key] for key in ("NAME", "USER", "PASSWORD", "HOST", "PORT")})
    try:
        yield
    finally:
        connection.close()
        settings.clear()
        settings.update(saved)


def new_id() -> str:
    return uuid.uuid4().hex[:8]
