"""Starting a job that waited for a worker: on record soon after, or before, it runs.

A job claimed to wait for a free worker (``PREFETCH``) is recorded as waiting (its attempt's
``started`` is false). Another runner hands a waiting job back when its runner is lost: at once
if that runner's lease lapsed (``heartbeat.hand_back_lapsed``), or once its heartbeat is stale.
Two ways to start one, chosen per job by the executor (``Lease.fresh``):

* **Fast** (``StartLog``), while this runner's LISTEN session holds its lease and was heard from
  within ``FRESH_SECONDS``: the worker starts the job at once and the start is noted; the next
  claim statement writes every noted start (``store.claim_sql``), or the claim loop writes them
  on their own after ``FLUSH_AFTER``; a start the job's settling statement carries (a batched
  completion on threads, any settling in a worker process) only once it is due. No statement
  of its own while the runner drains. Nobody
  hands back a job of a runner whose lease is held, and a lapse is acted on only after
  ``heartbeat.LEASE_GRACE_SECONDS``, longer than ``FRESH_SECONDS`` + ``FLUSH_AFTER``: by then
  the start is on record.
* **Gated** (``StartGate``), otherwise (the LISTEN session was lost, the process was frozen):
  the start is recorded with a fenced statement (``store.admit``) before the handler runs, and
  a job another runner handed back meanwhile is refused, never run here. The hand-back locks the
  attempt row and requires it unstarted (``store.release_waiting``), so the two exclude each
  other. The gate batches itself as the completer does: one statement for every start
  requested while the previous one was written.

A start noted but not yet written when the runner dies counts as waiting: the hand-back is then
counted against ``HANDBACK_LIMIT`` (which still ends a job that keeps killing its runner), not
charged.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from django.db import connections

from . import store
from .db import run_with_retry

if TYPE_CHECKING:
    from django.db.backends.utils import CursorWrapper as Cursor


#: How long a noted start may wait for a claim to carry it before it is written on its own.
FLUSH_AFTER = 0.1
#: How recently the LISTEN session must have been heard from, holding the lease, for a waiting
#: job to start on the fast path.
FRESH_SECONDS = 0.3


class Lease:
    """Whether this runner's LISTEN session holds its lease, since when without a break (its
    *period*), and when it was last heard from (``listener.listen_loop`` keeps it; the executors
    read it at each start).

    A job may start on the fast path only if its runner held the lease without a break from
    before the job was claimed until the start (the same period) and was heard from within
    ``FRESH_SECONDS``. A lease lost and taken again (the LISTEN session was terminated while
    this process was frozen, say) starts a new period: the jobs claimed in the old one may have
    been handed back in the gap, so they go through the gate, which refuses those.

    The state is one tuple, replaced whole, so a reader on another thread never pairs one
    period's number with another period's time; writers (the listener, and the heartbeat when
    it finds the row gone) take a lock, so an end of period cannot be lost between a read and
    a write of the listener's.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: (period, monotonic time last heard from holding it); the time is None while the
        #: lease is not held. Periods are numbered from 1; 0 means never held.
        self._state: tuple[int, float | None] = (0, None)
        #: Until when this runner's last heartbeat keeps its row safe from a reaper, which
        #: hands back waiting jobs whatever the lease says (``heartbeat.Liveness`` sets it):
        #: no fast start after it. Infinite for a lease no heartbeat feeds (unit tests).
        self._beat_until = math.inf

    def beaten(self, until: float, reregistered: bool = False) -> None:
        """A heartbeat went through: fast starts may go on until ``until``. ``reregistered``:
        the beat found this runner's row gone (it was presumed dead and its waiting jobs may
        have been handed back), so the current period ends here and the jobs claimed in it
        go through the gate."""
        with self._lock:
            if reregistered:
                self._state = (self._state[0], None)
            self._beat_until = until

    def held(self, owned: bool, at: float | None = None) -> None:
        """The session was heard from at ``at`` (default: now) holding the lease (``owned``)
        or not. ``at`` must be a time by which the session was known alive: the start of a
        wait on it that ended in time without an error, not the moment after a long gap."""
        when = time.monotonic() if at is None else at
        with self._lock:
            period, heard = self._state
            if not owned:
                self._state = (period, None)
                return
            self._state = (period if heard is not None else period + 1,
                           when if heard is None else max(heard, when))

    def lost(self) -> None:
        with self._lock:
            self._state = (self._state[0], None)

    def period(self) -> int | None:
        """The current period while the lease is held (stamp it on the jobs claimed now), else
        None (jobs claimed now never take the fast path)."""
        period, heard = self._state
        return period if heard is not None else None

    def fresh(self, period: int | None) -> bool:
        """Whether a job claimed in ``period`` may start on the fast path now."""
        return time.monotonic() < self.fresh_until(period)

    def fresh_until(self, period: int | None) -> float:
        """The monotonic time until which a start of a job claimed in ``period`` takes the fast
        path (0: none does). Worker processes get it with their jobs and apply ``fresh``'s rule
        at the real start: the clock is the system-wide ``CLOCK_MONOTONIC``, the same in every
        process."""
        current, heard = self._state
        if heard is None or period is None or period != current:
            return 0.0
        return min(heard + FRESH_SECONDS, self._beat_until)


class StartLog:
    """Attempt ids (fencing tokens) of waiting jobs started on the fast path, with when, not
    yet written. Thread-safe: executors note from their threads, the claim loop takes.

    A job whose handler returns before the next claim is handed to the completer, and its
    start goes with it (``take``): the batch carrying its completion writes the start too, so
    that most jobs of a drain of short jobs need no update for their start at all. Such a
    start stays *carried* here until its batch is written (``carried_done``): if the batch
    has not been written by the time the start is due (``FLUSH_AFTER``), the claim loop writes
    it as well, so a slow batch never delays a start past its due time. (Written twice is
    harmless: the second write finds the attempt started, or settled.) With worker processes
    every fast start is carried from the moment it is noted (``note(carried=True)``): the
    statement that settles the job in its worker writes it, and the job's ``DONE`` is what
    says it was written.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: token -> (when it started, monotonic time it was noted), oldest first: starts only
        #: the claim loop will write, and starts the job's settling statement carries (a
        #: batch of completions, or a worker process's settling), written by the claim loop
        #: only once due.
        self._noted: dict[int, tuple[datetime, float]] = {}
        self._carried: dict[int, tuple[datetime, float]] = {}
        #: Starts a claim statement is writing right now (``taken``): a job that finishes
        #: meanwhile still gives its batch the time it started.
        self._writing: dict[int, tuple[datetime, float]] = {}

    def note(self, token: int, when: datetime | None = None, carried: bool = False
             ) -> datetime:
        """Note that the attempt ``token`` started at ``when`` (default: now); returns that
        time, which the job carries (``ClaimedJob.began``) for its settling statement.

        ``carried``: the statement that settles the job will write the start itself (a worker
        process's completions carry ``began``), so the next claim need not: it is written
        only once due, unless ``carried_done`` says its job was settled first. That spares
        a drain of short jobs in worker processes an update per job in its claims, which is
        what made them dearer for PostgreSQL than the thread runner's."""
        if when is None:
            when = datetime.now(UTC)
        with self._lock:
            (self._carried if carried else self._noted)[token] = (when, time.monotonic())
        return when

    def take(self, token: int) -> datetime | None:
        """The start of this attempt, for the batch carrying its completion to write (None if
        it is not noted: written already, or the job never waited)."""
        with self._lock:
            entry = self._noted.pop(token, None)
            if entry is None:
                # Being written by a claim (which goes on writing it: both writes agree), or
                # not noted at all.
                entry = self._writing.get(token)
                return None if entry is None else entry[0]
            self._carried[token] = entry
        return entry[0]

    def carried_done(self, tokens: Iterable[int]) -> None:
        """The batch carrying these starts was written, or gave them back (``restore``), or
        (worker processes) these jobs were settled: nothing left for a claim to write."""
        with self._lock:
            carried = self._carried
            for token in tokens:
                carried.pop(token, None)

    def restore(self, starts: dict[int, datetime]) -> None:
        """Note again starts taken but not written (a failed batch), or carried by a settling
        that failed (a worker's ``CRASHED``), due at once: the claim loop writes them with its
        next claim, or on their own."""
        if not starts:
            return
        due = time.monotonic() - FLUSH_AFTER
        with self._lock:
            for token in starts:
                self._carried.pop(token, None)
            self._noted = {**{token: (when, due) for token, when in starts.items()},
                           **self._noted}

    def _oldest_locked(self) -> float | None:
        """When the oldest unwritten start was noted. ``_noted`` is in the order of the
        starts, so its first entry will do; ``_carried`` is in the order the handlers returned
        (threads) or the jobs started (worker processes), and holds only jobs in flight or
        completing: a few hundred at most."""
        oldest = min((noted_at for _, noted_at in self._carried.values()), default=None)
        for _, noted_at in self._noted.values():
            return noted_at if oldest is None else min(oldest, noted_at)
        return oldest

    def due_in(self, limit: float) -> float:
        """Seconds until the oldest noted start must be written (``limit`` when none is)."""
        with self._lock:
            oldest = self._oldest_locked()
        if oldest is None:
            return limit
        return max(0.0, min(limit, oldest + FLUSH_AFTER - time.monotonic()))

    @property
    def overdue(self) -> bool:
        with self._lock:
            oldest = self._oldest_locked()
        return oldest is not None and time.monotonic() - oldest >= FLUSH_AFTER

    @contextmanager
    def taken(self, everything: bool = False) -> Iterator[tuple[list[int], list[datetime]]]:
        """The noted starts, and the carried ones that are due (``everything``: all of them,
        for the runner's last write), for one statement to write; noted again if it raises
        (the retry, or the next claim, writes them then)."""
        due = math.inf if everything else time.monotonic() - FLUSH_AFTER
        with self._lock:
            noted, self._noted = self._noted, {}
            carried = self._carried
            late = {token: entry for token, entry in carried.items() if entry[1] <= due}
            for token in late:
                del carried[token]
            writing = {**noted, **late}
            self._writing = writing
        try:
            yield list(writing), [when for when, _ in writing.values()]
        except BaseException:
            with self._lock:
                self._noted = {**writing, **self._noted}
            raise
        finally:
            with self._lock:
                self._writing = {}


class _Request:
    __slots__ = ("admitted", "done", "token")

    def __init__(self, token: int) -> None:
        self.token = token
        self.admitted: bool | None = None
        self.done = threading.Event()


class StartGate:
    """Records the starts of waiting jobs before they run, in batches, on a thread of its own
    (the slow path, see the module docstring)."""

    def __init__(self, alias: str, interrupt: threading.Event | None = None) -> None:
        self.alias = alias
        self.interrupt = interrupt if interrupt is not None else threading.Event()
        self._cond = threading.Condition()
        self._queue: list[_Request] = []
        self._thread: threading.Thread | None = None
        self._closing = False
        #: Statements written and starts admitted (for tests and benches).
        self.statements = 0
        self.admitted = 0

    def admit(self, token: int) -> bool | None:
        """Record the start of the waiting attempt ``token``; True once it is on record (run
        the job), False if the attempt is not this runner's any more (do not run it), None if
        the gate gave up (an error retrying does not fix, this thread died, or the runner is
        stopping while the database is away): do not run it; the caller hands it back
        (``execute``), or leaves it claimed to be handed back or rescued if that fails too."""
        request = _Request(token)
        with self._cond:
            self._queue.append(request)
            self._closing = False
            if self._thread is None or not self._thread.is_alive():
                thread = threading.Thread(target=self._run, name="pj-start-gate", daemon=True)
                try:
                    thread.start()
                except BaseException:
                    self._queue.remove(request)  # no thread to answer it: say so here
                    raise
                # Listed once running: a thread that failed to start must not stand for one.
                self._thread = thread
            self._cond.notify()
        request.done.wait()
        return request.admitted

    def close(self, timeout: float) -> None:
        """Let the gate's thread write what it holds and exit now, rather than idle out with
        its connection open after the runner stopped (a request after this starts a thread
        again)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(max(0.0, timeout))

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._queue:
                        if self._closing or (not self._cond.wait(5.0) and not self._queue):
                            # Closed, or idle: the next request starts a new thread. Said
                            # under the lock, so a request never waits on a thread that is
                            # leaving.
                            self._thread = None
                            return
                    batch, self._queue = self._queue, []
                self._write(batch)
        finally:
            with self._cond:
                if self._thread is threading.current_thread():
                    self._thread = None  # (died of an error: the next request starts one)
            connections.close_all()

    def _write(self, batch: list[_Request]) -> None:
        tokens = sorted({request.token for request in batch})

        tries = 0

        def write(cursor: Cursor) -> set[int]:
            # A retry may follow a try that committed and lost its answer: it admits what that
            # try started (``store.admit``'s ``again``).
            nonlocal tries
            tries += 1
            return store.admit(cursor, tokens, again=tries > 1)

        admitted: set[int] | None = None
        try:
            admitted = run_with_retry(self.alias, write, what=f"recording {len(tokens)} "
                                      "job start(s)", interrupt=self.interrupt)
        except Exception:
            admitted = None
        finally:
            # Every request is answered, even when this thread dies of a ``BaseException``:
            # its lanes would otherwise wait for ever ("gave up": the lanes do not run those
            # jobs, and hand them back, see ``admit``).
            if admitted is not None:
                self.statements += 1
                self.admitted += len(admitted)
            for request in batch:
                request.admitted = None if admitted is None else request.token in admitted
                request.done.set()
