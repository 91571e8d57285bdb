"""Liveness: the heartbeat loop proves this runner is alive; the rescue loop reaps dead runners,
rescues their jobs and relays cancel requests. Two threads with their own connections, so that
no rescue (which may find a job's row locked) and no slow query delays a heartbeat; and a rescue
never waits on a row lock for long (``run_bounded``): a locked job is tried again next round.
A handler that holds the GIL starves both threads; the liveness sidecar (``sidecar.py``) then
keeps the heartbeat fresh from outside the process.

Rescue follows liveness, not elapsed time: a job is put back in play only when the runner that
holds it has stopped heartbeating for ``STALE_LOCK_TIMEOUT`` by the database clock (its row is
then deleted), so a live runner's long job is never taken away from it.

A stale heartbeat proves death only if its owner *could* have beaten. After PostgreSQL was
unreachable (a restart, a network outage) or this process was frozen, every runner's heartbeat
looks stale at once, and the first runner back would otherwise "rescue" every other live
runner's jobs. So a runner reaps others only once it has itself been beating without a gap for
a whole ``STALE_LOCK_TIMEOUT``: by then every live runner has had the same chance to beat (they
retry their heartbeat every fraction of a second while the database is away). Fencing would make
a premature rescue safe, but it would still cost the job an attempt and throw away its work.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from django.db import DatabaseError

from .. import signals
from ..handlers import registry
from . import store
from .db import (
    Backoff,
    NotNow,
    error_line,
    is_refusal,
    run_bounded,
    run_with_retry,
)
from .execute import Outcome, _backoff_for, log_transition

if TYPE_CHECKING:
    from django.db.backends.utils import CursorWrapper as Cursor

    from ..conf import RunnerSettings
    from .executor import Executor
    from .lifecycle import Beating
    from .starts import Lease

logger = logging.getLogger("django_persistent_jobs.runner")

CANCEL_POLL_SECONDS = 0.5
#: A gap between two successful heartbeats longer than this many heartbeat intervals means
#: this runner was cut off (or frozen): its streak of good health starts again.
GAP_INTERVALS = 1.5
#: While the database is away the heartbeat retries at most this often, so that a live
#: runner's first beat follows the database's return within a fraction of a second.
RETRY_CAP_SECONDS = 0.25


class Liveness:
    """This runner's liveness as it knows it itself (monotonic clock), and the beat that keeps
    its row fresh: the last successful heartbeat, and since when beats have come without a gap.

    ``register`` writes the runner's row again; a beat calls it when it finds the row gone
    (another runner presumed this one dead).
    """

    def __init__(self, alias: str, runner_id: str, settings: RunnerSettings,
                 register: Callable[[Cursor], None], lease: Lease | None = None,
                 job_types: Callable[[], list[str]] | None = None) -> None:
        self.alias = alias
        self.runner_id = runner_id
        self.settings = settings
        self.register = register
        #: The job types to list on the runner's row (``store.heartbeat``): written when they
        #: differ from what the row was last given, so a beat stays one small update.
        self.job_types = job_types
        self._listed: list[str] | None = None
        #: Told of every beat: a waiting job starts on the fast path only while the last beat
        #: keeps this runner's row safe from a reaper (``starts.Lease.beaten``).
        self.lease = lease
        self.last_beat: float | None = None
        self.healthy_since: float | None = None
        #: Whether ``may_reap`` said yes since the streak began (its log line is written once).
        #: It, ``healthy_since`` and ``last_beat`` change under ``_streak``: the heartbeat
        #: thread writes them, the rescue thread reads them.
        self._reaping = False
        self._streak = threading.Lock()
        #: Notified after every successful beat (the claim loop waits on it when its
        #: heartbeat is too old to claim).
        self.beaten = threading.Condition()

    def note_beat(self, reregistered: bool = False, sent: float | None = None) -> None:
        """Record a successful heartbeat (registration counts as one); ``reregistered``: it
        found this runner's row gone and wrote it again. ``sent``: when the beat's statement
        was sent (the row's time is no earlier), which bounds the lease's fast path: a freeze
        between the statement and this call must not stretch it."""
        now = time.monotonic()
        with self._streak:
            last = self.last_beat
            broken = last is None or now - last > self.gap_seconds
            if broken:
                self.healthy_since = now
                self._reaping = False
            self.last_beat = now
        if broken and last is not None:
            logger.info(
                "runner %s: %.1fs between two heartbeats (the database was slow or away, or "
                "this process was frozen); it reaps no other runner until it has beaten "
                "without a gap for %gs", self.runner_id, now - last,
                self.settings.stale_lock_timeout,
                extra={"event": "heartbeat_gap", "runner_id": self.runner_id,
                       "gap_seconds": round(now - last, 3)})
        if self.lease is not None:
            self.lease.beaten((now if sent is None else sent) + fresh_limit(self.settings),
                              reregistered)
        with self.beaten:
            self.beaten.notify_all()

    @property
    def gap_seconds(self) -> float:
        """The longest time between two beats that does not break this runner's streak."""
        return GAP_INTERVALS * self.settings.heartbeat_interval

    def may_reap(self) -> bool:
        """Whether this runner has been beating, gap-free, for a whole stale-lock timeout. The
        first time it has after a start or a gap is logged: an operator asking why a dead
        runner was not reaped (and the fault suite) can see when this runner began to judge."""
        now = time.monotonic()
        with self._streak:
            since, last = self.healthy_since, self.last_beat
            # A gap is noticed only at the beat that ends it: until then (a thawed process, a
            # database just back) an overdue beat means the streak is already broken, even
            # though healthy_since still says otherwise.
            allowed = (since is not None and last is not None
                       and now - since >= self.settings.stale_lock_timeout
                       and now - last <= self.gap_seconds)
            first = allowed and not self._reaping
            if allowed:
                self._reaping = True
        if first:
            logger.info("runner %s has beaten without a gap for %gs: it now reaps runners whose "
                        "heartbeat is stale", self.runner_id, self.settings.stale_lock_timeout,
                        extra={"event": "reaping_allowed", "runner_id": self.runner_id})
        return allowed

    def fresh(self) -> bool:
        return heartbeat_fresh(self)

    def note_listed(self, types: list[str]) -> None:
        """The runner's row lists ``types`` (its registration wrote them)."""
        self._listed = types

    def beat(self, interrupt: threading.Event) -> None:
        sent = time.monotonic()

        types = self.job_types() if self.job_types is not None else None
        changed = types if types is not None and types != self._listed else None

        def do(cursor: Cursor) -> bool:
            nonlocal sent
            sent = time.monotonic()
            alive = store.heartbeat(cursor, self.runner_id, changed)
            if not alive and not interrupt.is_set():
                # (Halted: the runner is stopping and may have unregistered while this beat
                # was slow; a row put back now would stand for a runner that has gone.)
                self.register(cursor)
            return alive

        cap = min(RETRY_CAP_SECONDS, self.settings.heartbeat_interval / 2)
        alive = run_with_retry(self.alias, do, what="heartbeat", interrupt=interrupt,
                               backoff=Backoff(first=min(0.05, cap), cap=cap))
        if alive is None:
            return  # halted while the database was away
        if types is not None:
            self._listed = types  # (a registration lists them too)
        self.note_beat(reregistered=alive is False, sent=sent)
        if alive is False:
            logger.warning(
                "runner %s was presumed dead by another runner (heartbeat too old); its jobs "
                "were rescued and it has registered again", self.runner_id,
                extra={"event": "runner_reregistered", "runner_id": self.runner_id},
            )


def heartbeat_fresh(subject: Beating) -> bool:
    """Whether nobody can have reaped this runner lately: its last beat is well within the
    stale-lock timeout. A runner that was frozen or cut off beats (and re-registers if it was
    reaped) before it claims again, so it never claims jobs under a row others have deleted."""
    last = subject.last_beat
    return last is not None and time.monotonic() - last <= fresh_limit(subject.settings)


def fresh_limit(settings: RunnerSettings) -> float:
    """How long after a beat this runner counts as safe from a reaper (``heartbeat_fresh``)."""
    return max(settings.stale_lock_timeout / 2, GAP_INTERVALS * settings.heartbeat_interval)


def heartbeat_loop(liveness: Liveness, halt: threading.Event) -> None:
    """Beat, and nothing else: no other duty (rescue, cancel relay, cleanup) shares this thread
    or its connection, so none of them can delay the proof that this runner is alive."""
    interval = liveness.settings.heartbeat_interval
    while not halt.is_set():
        liveness.beat(halt)
        halt.wait(interval)


def rescue_loop(liveness: Liveness, executor: Executor, halt: threading.Event) -> None:
    """Reap dead runners and rescue their jobs every heartbeat interval; hand back the waiting
    jobs of runners whose lease lapsed every ``LEASE_CHECK_SECONDS``; relay cancellation
    requests to running handlers meanwhile. Its own thread, apart from the heartbeat: a rescue
    may have to wait for the database, and this runner must go on proving it is alive."""
    interval = liveness.settings.heartbeat_interval
    next_round = next_lease_check = 0.0
    lapses = LeaseWatch()
    while not halt.is_set():
        now = time.monotonic()
        if now >= next_round:
            rescue(liveness, halt)
            next_round = now + interval
        if now >= next_lease_check:
            hand_back_lapsed(liveness, lapses, halt)
            next_lease_check = now + LEASE_CHECK_SECONDS
        if executor.busy:
            relay_cancel_requests(liveness.alias, liveness.runner_id, executor, halt)
        halt.wait(min(CANCEL_POLL_SECONDS, interval))


def relay_cancel_requests(alias: str, runner_id: str, executor: Executor,
                          interrupt: threading.Event) -> None:
    """Tell the handlers of this runner's jobs that an operator asked to cancel them."""
    ids = run_with_retry(
        alias, lambda c: store.cancel_requests(c, runner_id),
        what="reading cancel requests", interrupt=interrupt,
    )
    for job_id, token in ids or ():
        item = executor.in_flight.get(token)
        if item is not None and not item.ctx.cancel_requested:
            executor.cancel(item)
            logger.info("job %s: cancellation requested by an operator", job_id,
                        extra={"event": "cancel_requested", "job_id": str(job_id)})


def reap_try(cursor: Cursor, liveness: Liveness) -> list[tuple[str, Any]]:
    """One try of a reap. It asks ``may_reap`` itself, at every try: the retries may outlast a
    database outage, and the beat that ends the outage (it retries more often, so it comes
    first) starts a new streak, which must stop a reap decided before the outage."""
    if not liveness.may_reap():
        return []
    return store.reap_dead_runners(
        cursor, liveness.settings.stale_lock_timeout, reaper=liveness.runner_id,
        reaper_fresh_seconds=fresh_limit(liveness.settings))


def rescue(liveness: Liveness, interrupt: threading.Event) -> int:
    """Delete runners that stopped heartbeating, then release every job no live runner holds."""
    alias = liveness.alias
    # (``reap_try`` asks ``may_reap`` at each try, and sends nothing when it may not.)
    dead = run_with_retry(alias, lambda c: reap_try(c, liveness),
                          what="reaping dead runners", interrupt=interrupt) or []
    for runner_id, last_beat in dead:
        logger.warning("runner %s presumed dead (last heartbeat %s)", runner_id, last_beat,
                       extra={"event": "runner_dead", "dead_runner_id": runner_id})
    orphans = run_with_retry(alias, store.orphaned_jobs, what="finding orphaned jobs",
                             interrupt=interrupt) or []
    rescued = 0
    for held in orphans:
        if interrupt.is_set():
            break
        why = (f"runner {held.locked_by} stopped heartbeating while running attempt "
               f"{held.attempts}" if held.started else
               f"runner {held.locked_by} stopped heartbeating before it started attempt "
               f"{held.attempts}")
        if _rescue_job(alias, liveness.runner_id, held, f"{why}; rescued by "
                       f"{liveness.runner_id}"):
            rescued += 1
    return rescued


#: How often a runner looks for other runners whose lease lapsed, and how long a lease must
#: stay lapsed before their waiting jobs are handed back: a live runner whose LISTEN session
#: dropped takes its lease again well within that (and takes its waiting jobs back at once).
LEASE_CHECK_SECONDS = 0.5
LEASE_GRACE_SECONDS = 1.0


class LeaseWatch:
    """Since when each runner's lease has been seen lapsed, by this runner's clock."""

    def __init__(self) -> None:
        self.since: dict[str, float] = {}

    def confirm(self, lapsed: list[str], now: float) -> list[str]:
        """The runners seen lapsed now that were already lapsed ``LEASE_GRACE_SECONDS`` ago."""
        self.since = {runner: self.since.get(runner, now) for runner in lapsed}
        return [runner for runner, since in self.since.items()
                if now - since >= LEASE_GRACE_SECONDS]


def hand_back_lapsed(liveness: Liveness, lapses: LeaseWatch, interrupt: threading.Event) -> int:
    """Hand back the waiting jobs of runners whose lease lapsed: they never started, so they
    are not charged, and they need not wait for the stale-lock timeout. A runner that is only
    cut off from the server keeps its started jobs (its heartbeat decides about those); a
    waiting job it still holds is refused at its start (``starts.StartGate``), so none runs
    twice. Only a runner that has beaten without a gap for a stale-lock timeout does this,
    as for any rescue: right after a server restart every lease is lapsed at once."""
    if not liveness.may_reap():
        lapses.since.clear()
        return 0
    alias, me = liveness.alias, liveness.runner_id
    asked = time.monotonic()
    lapsed = run_with_retry(alias, lambda c: store.lapsed_leases(c, me),
                            what="checking runner leases", interrupt=interrupt) or []
    took = time.monotonic() - asked
    if took > LEASE_CHECK_SECONDS:
        # The database was slow or away: sightings across it prove nothing.
        if lapses.since:
            logger.info("runner %s: checking the other runners' leases took %.1fs; the lapsed "
                        "leases it had seen are watched again from now", me, took,
                        extra={"event": "lease_check_slow", "runner_id": me})
        lapses.since.clear()
        return 0
    confirmed = lapses.confirm(lapsed, time.monotonic())
    if not confirmed:
        return 0
    waiting = run_with_retry(alias, lambda c: store.waiting_jobs_of(c, confirmed),
                             what="finding waiting jobs of lost runners",
                             interrupt=interrupt) or []
    handed = 0
    for held in waiting:
        if interrupt.is_set() or not liveness.may_reap():  # the database went away meanwhile
            break
        if _rescue_job(alias, me, held, f"the lease of runner {held.locked_by} lapsed before "
                       f"it started attempt {held.attempts}; handed back by {me}",
                       lease_of=held.locked_by):
            handed += 1
    return handed


def _rescue_job(alias: str, runner_id: str, held: store.HeldJob, message: str,
                lease_of: str | None = None) -> bool:
    """Settle a job a lost runner held. A started attempt is charged (a job that kills its
    runner runs out of retries); one still recorded as waiting is handed back, not charged but
    counted against ``HANDBACK_LIMIT`` (see ``starts``), unless a worker's start got there
    first."""
    job_id, token, job_type, attempts = held.id, held.token, held.job_type, held.attempts
    outcome = Outcome("retry" if held.started else "handback", "RUNNER_LOST", message,
                      delay=_backoff_for(registry.get(job_type), attempts))

    def apply(cursor: Cursor) -> str | None:
        if not held.started:
            return store.release_waiting(cursor, held, outcome.code, outcome.message,
                                         lease_of=lease_of, charge_delay=outcome.delay)
        return store.transition(
            cursor, job_id, token, kind="retry", code=outcome.code,
            message=outcome.message, delay=outcome.delay, outcome="rescued",
        )

    try:
        # Bounded: the row may be locked by the dead runner's still-open transaction (a frozen
        # process between its completion UPDATE and COMMIT) or by user code. Waiting for it
        # would stall this loop; the job is tried again next round.
        status = run_bounded(alias, apply, what=f"rescuing job {job_id}")
    except NotNow:
        return False
    except DatabaseError as exc:
        if not is_refusal(exc):
            raise  # a pooler's setting, not this job: the loop stops and says what to change
        # The database refuses this job's settling (a trigger or constraint of the project's
        # own): nothing this runner can write will release it. It stays as it is, for an
        # operator, and is tried again next round; the other jobs are rescued meanwhile, and
        # the rescuer goes on (one such job used to stop every runner that tried it, in turn).
        logger.error("could not rescue job %s from runner %s: the database refused it (%s); "
                     "left as it is, tried again next round", job_id, held.locked_by,
                     error_line(exc), extra={"event": "rescue_refused", "job_id": str(job_id),
                                             "dead_runner_id": held.locked_by})
        return False
    if status is None:
        return False
    code = outcome.code
    if not held.started and status in ("failed", "dead_lettered"):
        code = "INTERRUPTED"  # handed back once too often: charged as the statement recorded
    signals.rescued(job_id, token, job_type, attempts, runner_id, status, code,
                    outcome.message, queue=held.queue, tenant=held.tenant,
                    started=held.started)
    logger.warning(
        "job %s %s from runner %s -> %s", job_id,
        "rescued" if held.started else "handed back unstarted", held.locked_by, status,
        extra={"event": "rescue", "job_id": str(job_id), "job_type": job_type,
               "dead_runner_id": held.locked_by, "status": status, "attempt": attempts,
               "started": held.started},
    )
    return True


__all__ = [
    "LeaseWatch", "Liveness", "hand_back_lapsed", "heartbeat_fresh", "heartbeat_loop",
    "log_transition", "reap_try", "rescue", "rescue_loop",
]
