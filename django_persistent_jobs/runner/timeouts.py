"""The timeout enforcer: takes jobs back from the executor and settles them, fenced.

Three things end an attempt from outside its handler: its deadline passes, the process running
it dies (worker processes only: ``lost``), or the runner shuts down (the supervisor calls
``take_over``). In each case the job is first taken from the executor, which frees its slot at
once whatever the handler is doing; then its database session is terminated (so nothing the
handler still does can commit), the handler is interrupted, and the outcome is recorded with the
attempt's fencing token.

Nothing here waits on a row lock for long: the job's row may be locked by user code (a handler
that touched another running job in its own transaction) or by another runner, and waiting
would hold up every other timeout and the shutdown. A job whose row is locked stays in
``unsettled`` and is tried again on the next tick; meanwhile its handler is already cut off, so
it cannot complete late. While the database is unreachable, a job is tried again every
``UNSETTLED_RETRY_SECONDS``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

from ..handlers import registry
from . import store
from .db import NotNow, run_bounded
from .execute import InFlight, JobInterrupted, Outcome, _backoff_for, record_outcome
from .executor import Executor

logger = logging.getLogger("django_persistent_jobs.runner")

#: While the database is unreachable, how often an outcome is tried again.
UNSETTLED_RETRY_SECONDS = 0.5


@dataclass
class Unsettled:
    """A job taken from its executor whose outcome is not recorded yet."""

    item: InFlight
    outcome: Outcome
    attempt_outcome: str | None
    terminated: bool = False
    locked: bool = False  # the last try found the job's row locked (not the database away)
    retry_at: float = 0.0  # while the database is away, not before this (monotonic)
    #: Taken from a worker process that died (``lost``): nothing else will report a completion
    #: it wrote, so a settling that finds the attempt completed reports it here. Otherwise a
    #: live worker process reports its own completion, and with threads the enforcer and the
    #: handler's thread share one report (``InFlight.claim_report``).
    orphaned: bool = False


class TimeoutEnforcer:
    """Settles the jobs the runner takes back from ``executor``; ``enforce()`` is its tick."""

    def __init__(self, alias: str, runner_id: str, executor: Executor,
                 forced: threading.Event) -> None:
        self.alias = alias
        self.runner_id = runner_id
        self.executor = executor
        self.forced = forced
        self.unsettled: list[Unsettled] = []
        self._lost: queue.SimpleQueue[tuple[InFlight, str]] = queue.SimpleQueue()
        #: Take-overs between freeing the job's slot and listing it in ``unsettled``.
        self._taking = 0
        self._taking_lock = threading.Lock()

    @property
    def settling(self) -> int:
        """Jobs taken from the executor (or about to be: lost ones) whose outcome is not
        written yet. Their slots are free already, so the executor looks idle, but a retry
        due at once may yet be written: burst mode must not decide "nothing is due" before
        it is. Counted before the executor frees the slot (``take_over``), so a reader that
        looks at the executor first and at this second never misses a job in between."""
        return self._taking + len(self.unsettled) + self._lost.qsize()

    def lost(self, item: InFlight, why: str) -> None:
        """A worker process died under this job. Called from the executor's thread: the job
        is settled on the next tick, by the thread that settles everything else."""
        self._lost.put((item, why))

    def enforce(self) -> None:
        """Settle lost jobs, take over overdue ones, and try again what could not be settled."""
        self._settle_lost()
        now = time.monotonic()
        for item in self.executor.snapshot():
            if item.deadline is not None and now >= item.deadline:
                self.take_over(item, Outcome(
                    "retry", "TIMEOUT",
                    f"attempt {item.job.attempt} exceeded its timeout of {item.job.timeout:g}s",
                    delay=_backoff_for(registry.get(item.job.job_type), item.job.attempt),
                ), "timed_out")
        self.settle_pending()

    def _settle_lost(self) -> None:
        """The attempt is charged (``WORKER_LOST``), so a job that kills its worker every time
        ends dead-lettered after its retries, like any poison pill."""
        while not self._lost.empty():
            item, why = self._lost.get()
            self.take_over(item, Outcome(
                "retry", "WORKER_LOST", why,
                delay=_backoff_for(registry.get(item.job.job_type), item.job.attempt),
            ), None, orphaned=True)

    def take_over(self, item: InFlight, outcome: Outcome, attempt_outcome: str | None, *,
                  orphaned: bool = False) -> None:
        """Take a job from the executor, then settle it: kill the handler's connection (so it
        can commit nothing), interrupt its thread, record the outcome (fenced). ``orphaned``:
        the process that ran it is gone (see ``Unsettled.orphaned``)."""
        with self._taking_lock:
            self._taking += 1
        try:
            if not self.executor.take_over(item):
                return  # it finished on its own
            self.unsettled.append(Unsettled(item, outcome, attempt_outcome, orphaned=orphaned))
        finally:
            with self._taking_lock:
                self._taking -= 1
        self.settle_pending()

    def settle_pending(self) -> None:
        now = time.monotonic()
        for entry in list(self.unsettled):
            if entry.retry_at > now:
                continue
            if self._settle(entry):
                self.unsettled.remove(entry)
            elif not entry.locked:
                entry.retry_at = now + UNSETTLED_RETRY_SECONDS

    def _settle(self, entry: Unsettled) -> bool:
        item = entry.item
        if not entry.terminated:
            pid, started = item.backend_pid, item.backend_start
            if pid:
                try:
                    run_bounded(self.alias, lambda c: store.terminate_backend(c, pid, started),
                                what="terminating a timed-out handler's connection")
                except NotNow as exc:
                    entry.locked = exc.locked
                    return False
            entry.terminated = True
            self.executor.interrupt(item, JobInterrupted)
        # A completion it finds written is reported once: here or by the handler's thread,
        # whichever claims it first (threads, and a dead worker's jobs, whose reports were
        # lost with it); a live worker process reports its own.
        shared = entry.orphaned or self.executor.shares_items
        try:
            status = record_outcome(self.alias, item.job, entry.outcome, self.runner_id,
                                    self.forced, attempt_outcome=entry.attempt_outcome,
                                    bounded=True,
                                    claim_report=item.claim_report if shared else _not_here)
        except NotNow as exc:
            entry.locked = exc.locked
            return False
        if status is None:
            # Its handler returned just in time and its completion (or its failure) landed
            # first (one ``job_finished`` per attempt, see above).
            logger.info("job %s finished just as it was taken over", item.job.id)
        return True


def _not_here() -> bool:
    """``record_outcome``'s ``claim_report`` for a job a live worker process runs: the worker
    reports a completion it wrote, not its supervisor."""
    return False
