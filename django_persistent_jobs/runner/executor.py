"""What the supervisor needs from whatever runs job code: the executor interface.

Two implementations exist. ``threads.ThreadExecutor`` runs handlers on threads of the runner's
own process (the embedded runner, ``runjobs --processes 0``). ``workers.ProcessExecutor`` runs
them in worker processes, so the supervisor (heartbeat, LISTEN, claiming, timeouts, rescue)
runs no job code at all. The supervisor and its loops see only this interface; which one runs is
decided in one place, the runner's composition root.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

from .completer import MAX_BATCH
from .execute import InFlight

#: Completions a completer may have waiting or being written, beyond one per slot, before they
#: take slots back (``held_back``): five full batches.
COMPLETING_ALLOWANCE = 5 * MAX_BATCH


def held_back(completing: int, slots: int) -> int:
    """Slots that one completer's completions still being written take back: those beyond one
    per slot and ``COMPLETING_ALLOWANCE``. If completions stop landing (a row lock, a slow
    disk), the runner stops claiming instead of piling up jobs that ran but are not completed.
    The thread runner has one completer; worker processes have one each, so their supervisor
    sums this over its workers (one stuck worker does not borrow another's allowance).

    Why several batches and not one: under load a completer always has one batch being written
    while the next fills, and the one filling outgrows a batch whenever a write takes longer
    than usual (a slow commit). Each time that crossed the allowance, the claim loop stopped
    refilling until the batch landed, and the handler threads ran dry meanwhile. The thread
    runner drained ``atomic=False`` no-op jobs (60,000, four threads, interleaved runs on a
    2-core VM, 2026-11-28) at 6,540-6,850 jobs/s with one batch (200), 7,420-7,530 with two,
    7,680-7,980 with three, 7,990-8,140 with five and 8,130-8,210 with ten. Five keeps most of
    the gain while bounding what a crash re-runs: jobs whose handlers returned but whose
    completions never committed run again (guarantees.md).
    Counting none of them made a worker process's supervisor (which hears a batch landed only
    from the worker's ``DONE``, after the commit) wait with nothing to send about once in five
    reports of returned jobs."""
    return max(0, completing - slots - COMPLETING_ALLOWANCE)


class SlotWaits:
    """``wait_for_free_slot`` for an executor that counts its slots under ``changed`` (both
    executors do: ``_free_locked``, ``_idle_locked`` and ``_closed`` are theirs)."""

    changed: threading.Condition
    in_flight: dict[int, InFlight]
    _closed: bool

    def _free_locked(self) -> int:
        raise NotImplementedError

    def _idle_locked(self) -> int:
        raise NotImplementedError

    #: What the claim loop waits for in ``wait_for_free_slot`` (0 while it does not wait).
    _slots_wanted: int = 0

    def _slots_ready_locked(self, at_least: int) -> bool:
        free = self._free_locked()
        return free >= at_least or (free > 0 and self._idle_locked() > 0)

    def _worth_waking_locked(self) -> bool:
        """Whether a job leaving a slot should wake the waiters on ``changed``.

        The claim loop waits for half of the waiting room to be free before it refills it; a
        wake-up for every job that leaves (each one a thread switch, and a GIL hand-off) cost
        a drain of short jobs more than their claims did. Anyone else waiting on ``changed``
        waits for the executor to empty or to stop, and is woken for that.
        """
        wanted = self._slots_wanted
        return (wanted == 0 or self._closed or not self.in_flight
                or self._slots_ready_locked(wanted))

    def wait_for_free_slot(self, timeout: float, at_least: int = 1) -> int:
        deadline = time.monotonic() + timeout
        with self.changed:
            try:
                while not self._closed:
                    if self._slots_ready_locked(at_least):
                        break
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._slots_wanted = max(1, at_least)
                    self.changed.wait(remaining)
            finally:
                self._slots_wanted = 0
            return self._free_locked()


class Executor(Protocol):
    """Slots for claimed jobs, and the means to take a job back from whoever runs it."""

    #: Notified whenever a job leaves the executor (finished, taken over, lost).
    changed: threading.Condition
    #: Claimed jobs the executor holds, by their attempt's token (the cancel relay looks jobs
    #: up here). Not by job id: a runner that was presumed dead and claims a job's retry while
    #: the old attempt's handler still runs here holds both, and neither may hide the other
    #: from the timeout enforcer or from shutdown.
    in_flight: dict[int, InFlight]
    #: Called when a job that waited for a worker (``job.waiting``) is about to start, from
    #: whichever thread starts it; it must not block. It chooses how the start is recorded
    #: (``starts``): it clears ``job.waiting`` for the fast path; a job still waiting after it
    #: passes the gate where it runs.
    on_start: Callable[[InFlight], None] | None
    #: How many claimed jobs may wait for a worker now, on top of the slots (the claim loop
    #: sets it when ``PREFETCH`` is adaptive).
    waiting_room: int
    #: Jobs that have left a slot so far (the claim loop reads the pace from it).
    finished: int
    #: Whether the claim loop decodes payloads as it claims (``store.ClaimedJob.payload_text``):
    #: yes for handler threads in this process; no for worker processes, which decode their
    #: own, so that the supervisor does no per-payload work.
    decode_at_claim: bool
    #: Whether the handlers run with the very ``InFlight`` objects the supervisor holds
    #: (threads) or with copies of their own (worker processes). Where they do, the timeout
    #: enforcer may report a completion it finds written (``InFlight.claim_report`` decides
    #: which of it and the handler's thread does); where not, the worker reports its own.
    shares_items: bool

    def start(self) -> None:
        """Start the threads or processes; returns once jobs can be accepted."""

    @property
    def busy(self) -> int:
        """Jobs held (started or waiting to start)."""

    @property
    def completing(self) -> int:
        """Jobs whose handler returned and whose batched completion is not written yet: they
        hold no slot, but a stopping runner waits for them within its grace period."""

    def free_slots(self) -> int: ...

    def idle(self) -> int:
        """Workers (threads, or lanes of worker processes) that would start a job at once."""

    def wait_for_free_slot(self, timeout: float, at_least: int = 1) -> int:
        """Block until ``at_least`` slots are free, or one is and a worker is idle, or
        ``timeout``; return the number of free slots."""

    def submit_many(self, items: list[InFlight]) -> int:
        """Accept claimed jobs in order; how many were accepted (the caller hands the rest
        back). Handing over a whole claim at once lets the worker-process executor send it
        as one message."""

    def seal(self) -> None:
        """Accept no more jobs: the runner is stopping."""

    def unstarted(self) -> list[InFlight]:
        """Jobs accepted but not started (after ``seal()`` none will start)."""

    def await_recalls(self, timeout: float) -> None:
        """After ``seal()``: wait, at most ``timeout``, until no job is both unstarted and
        unaccounted for (a worker process asked to give back its queue has not answered yet),
        so that the final hand-back does not charge a job that never started."""

    def snapshot(self) -> list[InFlight]: ...

    def cancel(self, item: InFlight) -> None:
        """An operator asked to cancel the job: make ``ctx.cancel_requested`` true for its
        handler, wherever that runs."""

    def take_over(self, item: InFlight) -> bool:
        """Detach a job so the supervisor can settle it and free its slot; False if it already
        finished."""

    def interrupt(self, item: InFlight, exc_type: type[BaseException]) -> bool:
        """Stop the handler still running a taken-over job, as far as the executor can."""

    def close(self) -> None:
        """No more work: let threads or processes exit."""

    def join(self, timeout: float, settle: float = 5.0) -> None:
        """Wait up to ``timeout`` for the threads or processes to end; then stop what is left
        (give up on completions still being written, kill workers) and wait up to ``settle``
        more for that to take effect."""
