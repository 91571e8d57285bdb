"""Claim loop: fills free worker slots with due jobs.

It claims as many jobs as there are free slots, plus room for jobs waiting for a worker
(``PREFETCH``; by default as many as the workers finished in the last ``LOOKAHEAD_SECONDS``), so
that one claim statement serves a batch of short jobs. A waiting job's timeout clock starts when
a worker starts it, and its start is recorded as ``starts`` describes.
It sleeps until a NOTIFY, a freed slot or the poll interval, whichever comes first.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import conf
from ..handlers import registry
from . import store
from .db import run_with_retry
from .heartbeat import heartbeat_fresh

if TYPE_CHECKING:
    from django.db.backends.utils import CursorWrapper as Cursor

    from ..conf import RunnerSettings
    from .executor import Executor
    from .heartbeat import Liveness
    from .starts import Lease, StartLog

logger = logging.getLogger("django_persistent_jobs.runner")


@dataclass(frozen=True, eq=False)
class Claiming:
    """Everything the claim loop uses, and nothing else: the supervisor (the composition root)
    builds it, and this module never sees the runner.

    ``dispatch_many`` hands a claim to the executor (returns how many it took: fewer once the
    runner is stopping), ``hand_back_unstarted`` releases claimed jobs uncharged, and
    ``settling`` counts jobs taken over (a timeout, a lost worker process) whose outcome is not
    written yet: their slots are free already, and burst mode must wait for them."""

    alias: str
    runner_id: str
    settings: RunnerSettings
    pool: Executor
    starts: StartLog
    lease: Lease
    liveness: Liveness
    stopping: threading.Event
    wake: threading.Event
    forced: threading.Event
    burst: bool
    dispatch_many: Callable[[list[store.ClaimedJob]], int]
    hand_back_unstarted: Callable[[list[store.ClaimedJob]], None]
    burst_done: Callable[[], None]
    settling: Callable[[], int]


def claim_loop(claiming: Claiming) -> None:
    settings = claiming.settings
    pool = claiming.pool
    poll = settings.poll_interval
    scan = store.ClaimScan()
    room = WaitingRoom(pool) if settings.prefetch is None else None
    starts = claiming.starts
    unknown = UnknownTypes(claiming)
    rescue_wait = RescueWait(claiming)
    while not claiming.stopping.is_set():
        if room is not None:
            room.adjust()
        free = pool.wait_for_free_slot(timeout=starts.due_in(poll), at_least=refill_at(pool))
        if claiming.stopping.is_set():
            break
        if free <= 0:
            if starts.overdue:
                _write_starts(claiming)  # no claim is coming to carry them
            continue
        if not heartbeat_fresh(claiming.liveness):
            # Frozen or cut off for a while: others may have declared this runner dead. Let the
            # heartbeat prove it alive (registering again if need be) before claiming more.
            with claiming.liveness.beaten:
                claiming.liveness.beaten.wait(poll)
            continue
        limit = claim_limit(min(free, settings.batch_size or free))
        if claiming.wake.is_set():
            scan.forget()  # something was committed: it may sit before where the last claim ended
        claiming.wake.clear()
        # Burst mode may believe "nothing is due" only from a claim that began with none of our
        # jobs in flight or completing. A job finishing *during* the claim commits after the
        # claim's snapshot (its follow-ups, or a waiting job its dedup key held back, stay
        # unseen), and a SQL-less job leaves its slot before its batched completion commits;
        # a job taken over (timeout, lost worker) leaves its slot before its retry is written.
        idle_before_claim = _outstanding(claiming) == 0

        def do_claim(cursor: Cursor, limit: int = limit) -> list[store.ClaimedJob]:
            if not heartbeat_fresh(claiming.liveness):
                return []  # the database came back after a long while: beat first (see above)
            store.index_only_session(cursor)
            # Only types this process has handlers for, read at each claim (a sorted list of a
            # few names): during a rolling deploy a type only the new release knows waits for a
            # new runner instead of being dead-lettered as unknown by an old one. Jobs beyond
            # the idle workers are recorded as waiting; the claim also records the starts of
            # earlier waiting jobs.
            with starts.taken() as (tokens, times):
                return scan.claim(cursor, claiming.runner_id, limit, settings.queues,
                                  job_types=registry.job_types(), direct=pool.idle(),
                                  started=tokens, started_at=times,
                                  decode=pool.decode_at_claim)

        # Read before the claim: a lease lost and taken again during it starts a new period,
        # and these jobs must not take the fast path then (``starts.Lease``).
        period = claiming.lease.period()
        jobs = run_with_retry(claiming.alias, do_claim, what="claiming jobs", keep_cursor=True,
                              interrupt=claiming.stopping)
        if jobs is None:
            break
        for job in jobs:
            job.lease_period = period
        if not jobs and not heartbeat_fresh(claiming.liveness):
            continue  # skipped, not "nothing due": burst mode must not stop on it
        if jobs and not _hand_over(claiming, jobs):
            break
        if logger.isEnabledFor(logging.DEBUG) and jobs:
            logger.debug("claimed %d job(s)", len(jobs),
                         extra={"event": "claim", "count": len(jobs),
                                "job_ids": [str(j.id) for j in jobs],
                                "runner_id": claiming.runner_id})
        if len(jobs) == limit:
            continue  # there may be more due right now
        # Caught up with the types it knows: jobs no live runner can ever run are next.
        unknown_jobs = unknown.claim(limit - len(jobs), force=claiming.burst and not jobs)
        if unknown_jobs:
            if not _hand_over(claiming, unknown_jobs):
                break
            continue
        if claiming.burst:
            if not jobs and idle_before_claim:
                if rescue_wait.pending():
                    claiming.wake.wait(min(poll, RESCUE_CHECK_SECONDS))
                    continue
                claiming.burst_done()
                break
            # Wait for a running job to finish (it may enqueue more) or a wake-up, then look again
            # (at once if they all finished meanwhile: that claim decides).
            busy_now = _outstanding(claiming)
            if busy_now:
                _wait_for(claiming,
                          lambda busy_now=busy_now: _outstanding(claiming) < busy_now, 0.01)
            continue
        claiming.wake.wait(starts.due_in(poll))
    _write_starts(claiming, last=True)  # the last starts, before the runner settles what it holds


#: How often a runner that has caught up with its own due jobs looks for due jobs of types no
#: live runner has a handler for (a burst runner also looks before it decides it is done).
UNKNOWN_TYPES_CHECK_SECONDS = 2.0


class UnknownTypes:
    """Claims due jobs of a type that no live runner serving their queue has a handler for, so
    that ``execute`` dead-letters them (``UNKNOWN_JOB_TYPE``, with an attempt record and the
    usual signals) instead of leaving them ``pending`` for ever: a row written by hand or by
    another tool, or a type whose handler a release removed.

    Not with ``ALLOW_UNREGISTERED``: that project enqueues types that another service's
    runners handle, and such a job waits for them however long they are away. A type that
    some live runner lists is left to it: during a rolling deploy, a job type only the new
    release knows waits while a new runner is up (deploy runners first: a type no runner has
    is dead-lettered, and the admin's "retry group" runs those again after the deploy)."""

    def __init__(self, claiming: Claiming) -> None:
        self.claiming = claiming
        self.looked_at = -math.inf

    def claim(self, room: int, force: bool = False) -> list[store.ClaimedJob]:
        """Claim up to ``room`` such jobs, for the claim loop to hand over (``_hand_over``).
        Looks at most every ``UNKNOWN_TYPES_CHECK_SECONDS`` unless ``force``."""
        claiming = self.claiming
        if room <= 0 or conf.settings.ALLOW_UNREGISTERED or not len(registry):
            # (A runner with no handler at all is misconfigured, a wrong settings module or
            # an app missing: it must not judge every job in the table unknown.)
            return []
        now = time.monotonic()
        if not force and now - self.looked_at < UNKNOWN_TYPES_CHECK_SECONDS:
            return []
        self.looked_at = now
        settings = claiming.settings
        period = claiming.lease.period()  # before the claim, as the main claim reads it
        own = registry.job_types()

        def do_claim(cursor: Cursor) -> list[store.ClaimedJob]:
            types = store.unhandled_due_types(cursor, settings.queues, own,
                                              settings.stale_lock_timeout)
            if not types or registry.job_types() != own:
                return []  # (a handler registered meanwhile: the next look decides)
            return store.claim(cursor, claiming.runner_id, claim_limit(room), settings.queues,
                               job_types=types, direct=claiming.pool.idle(),
                               decode=claiming.pool.decode_at_claim)

        jobs = run_with_retry(claiming.alias, do_claim, what="claiming jobs of unknown types",
                              interrupt=claiming.stopping) or []
        for job in jobs:
            job.lease_period = period
        return jobs


#: How often a burst runner that waits for a rescue looks again.
RESCUE_CHECK_SECONDS = 0.2


class RescueWait:
    """Keeps a burst runner from stopping while another runner's jobs wait for a rescue.

    A runner rescues the jobs of a dead runner only once it has beaten without a gap for a
    stale-lock timeout (``Liveness.may_reap``), and a burst run is usually over sooner: in a
    deployment that only runs ``runjobs --burst`` (cron), a job whose runner died would then
    stay ``running`` for ever. So before it decides that nothing is due, a burst runner
    waits while some running job is held by a runner that has no row or whose lease no
    session holds (a live runner keeps its lease, and takes it back within a second after a
    dropped connection): its rescue loop settles those jobs once it may. Bounded: after two
    stale-lock timeouts and a few seconds more it stops anyway (a rescue that keeps failing
    is logged by the rescue loop)."""

    def __init__(self, claiming: Claiming) -> None:
        self.claiming = claiming
        self.deadline: float | None = None

    def pending(self) -> bool:
        claiming = self.claiming
        held = run_with_retry(
            claiming.alias, lambda c: store.held_by_lost_runners(c, claiming.runner_id),
            what="looking for jobs of lost runners", interrupt=claiming.stopping) or 0
        if not held:
            return False
        now = time.monotonic()
        if self.deadline is None:
            self.deadline = now + 2 * claiming.settings.stale_lock_timeout + 5.0
            logger.info("burst: %d job(s) of lost runners wait for a rescue; waiting for it",
                        held, extra={"event": "burst_waits_for_rescue", "count": held,
                                     "runner_id": claiming.runner_id})
        return now < self.deadline


def _hand_over(claiming: Claiming, jobs: list[store.ClaimedJob]) -> bool:
    """Give a claim to the executor whole: one lock (threads) or one message per worker
    (processes). False when the runner is stopping: SIGTERM arrived while the claim was in
    flight, or the supervisor sealed the pool meanwhile; the jobs it did not take were
    claimed before anyone noticed, so they are handed straight back, and the loop ends."""
    if claiming.stopping.is_set():
        claiming.hand_back_unstarted(jobs)
        return False
    accepted = claiming.dispatch_many(jobs)
    if accepted < len(jobs):
        claiming.hand_back_unstarted(jobs[accepted:])
        return False
    return True


def _write_starts(claiming: Claiming, last: bool = False) -> None:
    """Record the starts noted on the fast path (``starts.StartLog``) on their own (``last``:
    the claim loop's final write, which also takes the starts a completion batch carries, due
    or not: the batch may yet fail, and nobody would write them after this)."""
    def write(cursor: Cursor) -> None:
        with claiming.starts.taken(everything=last) as (tokens, times):
            if tokens:
                store.mark_started(cursor, tokens, times)

    run_with_retry(claiming.alias, write, what="recording job starts", interrupt=claiming.forced)


#: With the adaptive ``PREFETCH`` (``None``), at most this many claimed jobs per worker slot wait
#: (the lookahead below is what bounds it for any job slower than a few milliseconds).
ADAPTIVE_PREFETCH_FACTOR = 16
#: ... but at least this many whatever the slots, so that a runner at the default concurrency
#: claims tiny jobs in batches as large as one at ``--concurrency 32`` does (fewer, larger
#: claims: the claim statement's cost per job falls with its size).
ADAPTIVE_PREFETCH_FLOOR = 512
#: ... and no more than the workers finished in this many seconds: at the recent pace, a job
#: waits about this long for a worker.
LOOKAHEAD_SECONDS = 0.1
#: The shortest history the pace is scaled up from (a few jobs finished within a millisecond
#: of the start say little about the next tenth of a second).
RAMP_MIN_SECONDS = 0.02


class WaitingRoom:
    """The adaptive ``PREFETCH``: let as many claimed jobs wait for a worker as the workers
    finished in the last ``LOOKAHEAD_SECONDS``, up to the executor's cap.

    Tiny jobs (thousands a second) get the whole cap, so one claim statement serves a batch;
    long jobs get next to none, so a runner busy with them does not hold jobs that another,
    idle runner could start now. A runner that has finished nothing yet claims only for idle
    workers.
    """

    def __init__(self, executor: Any) -> None:
        self.executor = executor
        self.cap = executor.waiting_room
        self.history: deque[tuple[float, int]] = deque()
        executor.waiting_room = 0

    def adjust(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        finished = self.executor.finished
        history = self.history
        history.append((now, finished))
        while len(history) > 1 and history[1][0] <= now - LOOKAHEAD_SECONDS:
            history.popleft()
        since, finished_then = history[0]
        done = finished - finished_then
        span = now - since
        if done and span < LOOKAHEAD_SECONDS:
            # Less than a lookahead of history (the runner just started): the pace so far,
            # scaled to a whole lookahead. Waiting for a full lookahead of history kept the
            # first tenth of a second of a drain to small claims.
            done = round(done * LOOKAHEAD_SECONDS / max(span, RAMP_MIN_SECONDS))
        self.executor.waiting_room = min(self.cap, done)


#: The claim sizes a runner uses: each size is a statement text of its own (its LIMIT is a
#: literal, see ``store.claim_sql``), prepared once per connection, so a runner keeps to a few.
CLAIM_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


def refill_at(executor: Executor) -> int:
    """How many free slots the claim loop waits for before it claims, while no worker is idle:
    half the waiting room. Claiming the moment one slot frees would spend a claim statement
    (and its round trip, which the waiting jobs hide anyway) on one or two jobs; refilling
    the room when it is half empty claims in batches. An idle worker is fed at once
    (``wait_for_free_slot`` returns as soon as one is), so a quiet runner's pickup latency is
    unchanged."""
    return max(1, executor.waiting_room // 2)


def claim_limit(wanted: int) -> int:
    """The largest claim size not above ``wanted`` (the loop claims again at once when a claim
    came back full, so rounding down costs a round trip at most, never a job)."""
    if wanted >= CLAIM_SIZES[-1]:
        return CLAIM_SIZES[-1]
    return CLAIM_SIZES[bisect.bisect_right(CLAIM_SIZES, wanted) - 1]


def _outstanding(claiming: Claiming) -> int:
    """Jobs of this runner that may still lead to more due work: running, completing, or
    taken over and not settled yet. ``settling`` is read last, on purpose: a take-over counts
    there before it frees the job's slot, so no job slips between the two reads."""
    pool = claiming.pool
    busy = pool.busy + pool.completing
    return busy + claiming.settling()


def _wait_for(claiming: Claiming, condition: Any, step: float) -> None:
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline and not claiming.stopping.is_set():
        if claiming.wake.wait(step) or condition():
            return
