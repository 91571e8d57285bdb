#!/usr/bin/env python
"""Worker processes vs threads, measured in one run: what the hand-off costs, what it buys.

Usage (from a clone, with PostgreSQL reachable)::

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres python bench/processes.py
        [--jobs 20000] [--cpu-jobs 800] [--repeat 2] [--concurrency 4]

Like ``bench/run.py`` it (re)creates the ``pj_bench`` database (``PJ_BENCH_DB`` overrides the
name) on DATABASE_URL's server and works only there. Figures:

* hand-off: the supervisor-to-worker round trip alone (the protocol's ``RUN`` message with a
  claimed job, answered by ``DONE``, through the supervisor's non-blocking writer and bulk
  reader) between two processes, no database: the per-job price of process isolation, as
  latency and as CPU.
* no-op drain: ``runjobs --processes 0`` (threads), ``--processes 1`` and ``--processes 2``
  drain the same committed backlog of atomic no-op jobs; jobs/s and CPU per job over the
  whole process tree (supervisor plus workers).
* CPU-bound drain: the same with jobs doing ~5 ms of pure-Python work each (a fixed amount of
  work, calibrated here), where one interpreter's GIL is the limit.
* the machine's ceiling for the CPU-bound 2/1 ratio: the same arithmetic in two processes at
  once against one, no job system. A 2-core VM does not always give two busy processes two
  cores' worth; the runner's ratio is printed against it.

Ratios are what to read: the machine this runs on may be shared and busy, so absolute figures
move a lot between runs, and each configuration is run ``--repeat`` times, interleaved, keeping
the best. Targets: CPU-bound drain with 2 processes >= 1.7x one process; no-op drain with one
worker process >= 0.9x the thread runner.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.run import (  # noqa: E402
    ACTIVE,
    ENQUEUE_BATCH,
    SETTINGS_MODULE,
    recreate_database,
    reset_jobs,
    say,
    scalar,
    setup_django,
)
from bench.settings import BENCH_DB_NAME, DEFAULT_SERVER_URL, bench_database_url  # noqa: E402

NOOP = "bench.noop"
CPU = "bench.cpu"  # must match bench/jobs.py
CPU_MS = 5.0


# --------------------------------------------------------------------------- hand-off


def _echo_worker(conn: Any) -> None:
    """The worker side of the protocol, minus the job: answer each ``RUN`` with a ``DONE`` for
    its jobs, reading with the worker's reader (a worker reports a lane's session once per
    connection, so a short job costs these two messages)."""
    from django_persistent_jobs.runner.workers import protocol
    from django_persistent_jobs.runner.workers.channel import Reader

    reader = Reader(conn.fileno())
    while True:
        for message in reader.read():
            if message[0] == protocol.STOP:
                return
            conn.send((protocol.DONE, [packed[protocol.TOKEN] for packed, _ in message[1]]))


def measure_handoff(rounds: int) -> tuple[float, float]:
    """(microseconds per round trip, CPU microseconds per job over both processes): one job per
    ``RUN``, written and read as the supervisor does (non-blocking writer, bulk reader)."""
    import multiprocessing
    import selectors
    import uuid

    from django_persistent_jobs.runner.store import ClaimedJob
    from django_persistent_jobs.runner.workers import protocol
    from django_persistent_jobs.runner.workers.channel import Reader, Writer

    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    worker = context.Process(target=_echo_worker, args=(theirs,), daemon=True)
    worker.start()
    os.set_blocking(ours.fileno(), False)
    writer, reader = Writer(ours.fileno()), Reader(ours.fileno())
    selector = selectors.DefaultSelector()
    selector.register(ours.fileno(), selectors.EVENT_READ)
    job = ClaimedJob(id=uuid.uuid4(), job_type=NOOP, payload={"n": 1}, attempt=1,
                     max_retries=3, timeout=300.0, token=123456, queue="default", priority=0,
                     cancel_requested=False, tenant=None)

    def round_trip() -> None:
        writer.send((protocol.RUN, [(protocol.pack_job(job), False)], 0.0))
        while True:
            selector.select()
            if reader.read():
                return

    for _ in range(200):  # warm up
        round_trip()
    assert worker.pid is not None  # (started)
    cpu_before = time.process_time() + _cpu_of(worker.pid)
    started = time.perf_counter()
    for _ in range(rounds):
        round_trip()
    elapsed = time.perf_counter() - started
    cpu = time.process_time() + _cpu_of(worker.pid) - cpu_before
    writer.send((protocol.STOP,))
    worker.join(5)
    return elapsed / rounds * 1e6, cpu / rounds * 1e6


def _cpu_of(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _tree(pid: int) -> list[int]:
    pids = [pid]
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids = (task / "children").read_text().split()
        except OSError:
            continue
        for kid in kids:
            pids += _tree(int(kid))
    return pids


# --------------------------------------------------------------------------- drains


def _spin(loops: int) -> None:
    """The CPU job's arithmetic (``bench/jobs.py``), outside any job system."""
    total = 0
    for i in range(loops):
        total += i * i % 7


def _pid_after(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def measure_ceiling(loops: int, pool: Any) -> tuple[float, float]:
    """(seconds for one process to do ``loops`` of the CPU job's arithmetic alone, seconds for
    two processes to do as much each at once): the machine's own ceiling for the CPU-bound
    2/1 ratio, measured beside the drains. A 2-core VM does not always give two processes two
    cores' worth (a host's sibling hyperthreads, a busy neighbour), and then no runner can."""
    started = time.perf_counter()
    pool.apply(_spin, (loops,))
    one = time.perf_counter() - started
    started = time.perf_counter()
    for waiting in [pool.apply_async(_spin, (loops,)) for _ in range(2)]:
        waiting.get()
    return one, time.perf_counter() - started


def calibrate_loops(ms: float) -> int:
    """Loops of the CPU job's arithmetic that take ``ms`` of CPU on this machine (best of
    several; CPU time, not wall time, so a busy machine does not shrink the job)."""
    def run(loops: int) -> float:
        started = time.process_time()
        _spin(loops)
        return time.process_time() - started

    probe = 2_000_000
    best = min(run(probe) for _ in range(5))
    return max(1, int(probe * (ms / 1000) / best))


@dataclass
class Drain:
    label: str
    jobs: int
    seconds: float
    cpu_ms_per_job: float

    @property
    def rate(self) -> float:
        return self.jobs / self.seconds


class Runjobs:
    def __init__(self, processes: int, concurrency: int, workdir: Path) -> None:
        self.processes = processes
        self.log_path = workdir / f"runjobs-p{processes}-{time.time_ns()}.log"
        self.log = self.log_path.open("wb")
        env = {**os.environ, "DJANGO_SETTINGS_MODULE": SETTINGS_MODULE}
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "manage.py"), "runjobs", "--processes", str(processes),
             "--concurrency", str(concurrency), "--no-scheduler"],
            cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        self._wait_until(lambda: scalar("SELECT count(*) FROM persistent_jobs_runners "
                                        "WHERE pid = %s", [self.proc.pid]) > 0,
                         deadline, "runjobs did not start")
        # Every lane (a thread, or a thread of a worker process) opens its connection as it
        # starts: once all are open, the workers are up. A drain must not time a worker
        # process's interpreter start and Django set-up (``runjobs``' start-up, not its rate).
        lanes = max(1, processes) * concurrency
        self._wait_until(lambda: scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid()") >= lanes + 1, deadline, "runjobs' workers did not start")
        time.sleep(0.5)  # idle, listening

    def _wait_until(self, ready: Callable[[], bool], deadline: float, failure: str) -> None:
        while not ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{failure}; see {self.log_path}")
            time.sleep(0.05)

    def cpu(self) -> float:
        return sum(_cpu_of(pid) for pid in _tree(self.proc.pid))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def fill(job_type: str, jobs: int, payload: dict[str, Any]) -> float:
    from django.db import transaction

    from django_persistent_jobs import enqueue_many

    with transaction.atomic():
        for start in range(0, jobs, ENQUEUE_BATCH):
            enqueue_many([(job_type, dict(payload, n=i))
                          for i in range(start, min(jobs, start + ENQUEUE_BATCH))])
    return time.time()


def drain(label: str, processes: int, concurrency: int, job_type: str, jobs: int,
          payload: dict[str, Any], workdir: Path) -> Drain:
    reset_jobs()
    runner = Runjobs(processes, concurrency, workdir)
    try:
        cpu_before = runner.cpu()
        committed = fill(job_type, jobs, payload)
        while scalar(f"SELECT count(*) FROM persistent_jobs WHERE {ACTIVE}"):
            if runner.proc.poll() is not None:
                raise RuntimeError(f"runjobs exited; see {runner.log_path}")
            time.sleep(0.1)
        cpu = runner.cpu() - cpu_before
        finished, done = scalar("SELECT ARRAY[extract(epoch FROM max(finished_at)), "
                                "count(*) FILTER (WHERE status = 'completed')] "
                                "FROM persistent_jobs")
        if int(done) != jobs:
            raise RuntimeError(f"only {done}/{jobs} completed; see {runner.log_path}")
        return Drain(label, jobs, float(finished) - committed, cpu * 1000 / jobs)
    finally:
        runner.stop()


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=20000, help="no-op jobs per drain")
    parser.add_argument("--cpu-jobs", type=int, default=800, help="CPU-bound jobs per drain")
    parser.add_argument("--repeat", type=int, default=2, help="runs per configuration")
    parser.add_argument("--concurrency", type=int, default=4, help="threads per process")
    parser.add_argument("--handoff-rounds", type=int, default=20000)
    args = parser.parse_args(argv)

    server_url = os.environ.get("DATABASE_URL") or DEFAULT_SERVER_URL
    say(f"recreating database {BENCH_DB_NAME}")
    recreate_database(server_url, BENCH_DB_NAME)
    setup_django(bench_database_url())
    workdir = Path(tempfile.mkdtemp(prefix="pj-bench-processes-"))

    say("hand-off round trip")
    handoff_us, handoff_cpu_us = measure_handoff(args.handoff_rounds)
    loops = calibrate_loops(CPU_MS)
    say(f"CPU job: {loops} loops ~ {CPU_MS:g} ms")
    configs = [("threads", 0), ("1 process", 1), ("2 processes", 2)]
    results: dict[tuple[str, str], list[Drain]] = {}
    ceilings: list[tuple[float, float]] = []
    import multiprocessing

    spinners = multiprocessing.get_context("spawn").Pool(2)
    # Both workers up before anything is timed (a worker still starting would take CPU from
    # the lone run): each answers with its pid while the other holds a job.
    while len(set(spinners.map(_pid_after, [0.2, 0.2], chunksize=1))) < 2:
        pass
    for round_ in range(args.repeat):
        # A quarter of one CPU-bound drain's work, outside any job system.
        ceilings.append(measure_ceiling(loops * max(1, args.cpu_jobs // 4), spinners))
        say(f"round {round_ + 1}: two processes of pure Python / one: "
            f"{2 * ceilings[-1][0] / ceilings[-1][1]:.2f}x")
        for kind, job_type, jobs, payload in (("no-op", NOOP, args.jobs, {}),
                                              ("cpu", CPU, args.cpu_jobs, {"loops": loops})):
            for label, processes in configs:
                say(f"round {round_ + 1}: {kind} drain, {label}")
                result = drain(label, processes, args.concurrency, job_type, jobs, payload,
                               workdir)
                results.setdefault((kind, label), []).append(result)
                say(f"  {result.rate:,.0f} jobs/s, {result.cpu_ms_per_job:.2f} ms CPU/job")

    spinners.close()
    spinners.join()

    def best(kind: str, label: str) -> Drain:
        return max(results[(kind, label)], key=lambda d: d.rate)

    load = os.getloadavg()
    print(f"\nworker processes vs threads  (cores: {os.cpu_count()}, load average "
          f"{load[0]:.1f}/{load[1]:.1f}; best of {args.repeat}, concurrency "
          f"{args.concurrency} per process)")
    print(f"hand-off round trip (RUN -> DONE), no database: {handoff_us:.0f} us, "
          f"{handoff_cpu_us:.0f} us CPU per job")
    for kind in ("no-op", "cpu"):
        for label, _ in configs:
            d = best(kind, label)
            spread = statistics.pstdev([r.rate for r in results[(kind, label)]])
            print(f"{kind:>6} drain, {label:<12} {d.rate:>8,.0f} jobs/s  (+/-{spread:,.0f})  "
                  f"{d.cpu_ms_per_job:6.2f} ms CPU/job")
    noop_ratio = best("no-op", "1 process").rate / best("no-op", "threads").rate
    noop2_ratio = best("no-op", "2 processes").rate / best("no-op", "threads").rate
    cpu_ratio = best("cpu", "2 processes").rate / best("cpu", "1 process").rate
    cpu_vs_threads = best("cpu", "2 processes").rate / best("cpu", "threads").rate
    # Best of the rounds, as for the drains: the fastest lone run against the fastest pair.
    ceiling = 2 * min(one for one, _ in ceilings) / min(two for _, two in ceilings)
    extra_cpu = best("no-op", "1 process").cpu_ms_per_job - best("no-op", "threads").cpu_ms_per_job
    print(f"no-op, 1 process / threads:    {noop_ratio:.2f}x  (target >= 0.9)  "
          f"{'OK' if noop_ratio >= 0.9 else 'BELOW'}")
    print(f"no-op, 2 processes / threads:  {noop2_ratio:.2f}x")
    print(f"CPU-bound, 2 / 1 process:      {cpu_ratio:.2f}x  (target >= 1.7)  "
          f"{'OK' if cpu_ratio >= 1.7 else 'BELOW'}")
    print(f"  the machine's ceiling for it:  {ceiling:.2f}x  (two processes of pure Python, no "
          f"job system, against one; the drain reaches {cpu_ratio / ceiling:.0%} of it)")
    print(f"CPU-bound, 2 processes / threads: {cpu_vs_threads:.2f}x")
    print(f"process mode's extra CPU per no-op job (whole tree): {extra_cpu:+.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
