"""Completions of handlers that ran no SQL, committed together: one statement and one commit for
every such job that finished while the previous batch was being written.

A handler that touched no database has nothing to commit atomically with its completion. Its
thread hands the completion to its process's ``Completer`` with ``submit`` and goes back to work
at once (its slot is free for the next job: waiting for a commit is not running a handler); the
completer writes every completion waiting at that moment in one fenced statement
(``store.complete_many``), in autocommit on a connection of its own, and then calls each job's
callback with its answer: completed, or claim lost (rescued, timed out or handed back
meanwhile). The callback logs and signals exactly as for a completion the thread wrote itself,
after the commit. ``complete`` is the blocking form (submit, then wait for the answer).

Batches form by themselves, as group commit does: the busier the runner, the more threads finish
while one batch is written, and the fewer commits per job. ``linger`` adds a short wait for more
before writing a batch that is not full.

A completion that cannot be written is retried while the database reports a transient condition
(the job is not charged for an outage), so until it lands its job stays running under this
runner: if the runner dies meanwhile, the job is rescued and run again, as it would be after a
crash between a handler's return and its commit. When a batch fails with any other error, its
completions are written one at a time, so the error costs only the job that caused it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from django.db import connections

from . import store
from .db import run_with_retry

if TYPE_CHECKING:
    from datetime import datetime

    from django.db.backends.utils import CursorWrapper as Cursor

    from .starts import StartLog
    from .store import ClaimedJob

logger = logging.getLogger("django_persistent_jobs.runner")

#: Most completions one statement writes.
MAX_BATCH = 200
#: How long a batch that is not full waits for more completions before it is written (seconds).
LINGER = 0.0


#: Called on the completer's thread once a completion's batch was written (or given up):
#: ``(outcome, error)``, with the meanings of ``Completer.complete``'s result and exception.
Answer = Callable[[bool | None, BaseException | None], None]


class _Waiting:
    """One completion handed over, and who to tell once the batch carrying it was written."""

    __slots__ = ("alias", "answered", "completer", "job", "on_answer", "result", "started")

    def __init__(self, completer: Completer, alias: str, job: ClaimedJob, result: str | None,
                 on_answer: Answer, started: datetime | None) -> None:
        self.completer = completer
        self.alias = alias
        self.job = job
        self.result = result
        self.on_answer = on_answer
        self.answered = False
        #: When the job started, if that is not on record yet (see ``Completer.starts``).
        self.started = started

    def answer(self, outcome: bool | None, error: BaseException | None = None) -> None:
        if self.answered:
            return
        self.answered = True
        self.completer._answered()  # no longer pending, before whoever waits on it is told
        try:
            self.on_answer(outcome, error)
        except Exception:  # a failing callback must not cost the other jobs of the batch
            logger.exception("handling the completion of job %s failed", self.job.id,
                             extra={"event": "completion_callback_failed",
                                    "job_id": str(self.job.id)})


class Completer:
    """Writes the completions handed to ``complete`` in batches, on a thread of its own."""

    def __init__(self, *, max_batch: int = MAX_BATCH, linger: float = LINGER) -> None:
        self.max_batch = max(1, int(max_batch))
        self.linger = max(0.0, float(linger))
        self._cond = threading.Condition()
        self._queue: deque[_Waiting] = deque()
        self._closing = False
        self._give_up = threading.Event()
        self._thread: threading.Thread | None = None
        #: Called on the completer's thread after each batch's callbacks (and after the last
        #: answers when it stops): a worker process reports a batch's jobs in one message
        #: instead of one per job.
        self.after_batch: Callable[[], None] | None = None
        #: Where the fast path notes the starts of waiting jobs (the thread runner sets it).
        #: A job handed over takes its start with it (``StartLog.take``), and its batch writes
        #: the start with the completion: a job that finished before the next claim needs no
        #: update of its own for its start.
        self.starts: StartLog | None = None
        #: Statements that completed jobs, and the jobs they completed (for tests and benches).
        self.statements = 0
        self.completed = 0
        self._unanswered = 0

    def complete(self, alias: str, job: ClaimedJob, result: str | None = None) -> bool | None:
        """Complete ``job`` (fenced by its token) with the next batch and wait for it.

        True once the completion has committed; False if the claim was lost; None if the
        completer gave up before it could write it (closed while the database was away): the
        job then stays claimed and is rescued once this runner is gone. Raises what writing
        this job's completion raised, when that was not a transient condition.
        """
        done = threading.Event()
        answer: list[Any] = [None, None]

        def on_answer(outcome: bool | None, error: BaseException | None) -> None:
            answer[:] = [outcome, error]
            done.set()

        if not self.submit(alias, job, result, on_answer):
            return None
        done.wait()
        if answer[1] is not None:
            raise answer[1]
        outcome: bool | None = answer[0]
        return outcome

    def submit(self, alias: str, job: ClaimedJob, result: str | None,
               on_answer: Answer) -> bool:
        """Hand ``job``'s completion to the next batch without waiting for it: ``on_answer``
        is called on the completer's thread once it was written (see ``complete`` for what
        it is told). False (and ``on_answer`` is never called) once the completer is closing:
        the caller then treats the completion as abandoned."""
        starts = self.starts
        waiting = _Waiting(self, alias, job, result, on_answer,
                           starts.take(job.token) if starts is not None else None)
        with self._cond:
            if self._closing:
                if waiting.started is not None:
                    self._restore({job.token: waiting.started})
                return False
            self._queue.append(waiting)
            self._unanswered += 1
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="pj-completer",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()
        return True

    def pending(self) -> int:
        """Completions handed over and not answered yet (waiting or being written)."""
        return self._unanswered

    def _answered(self) -> None:
        with self._cond:
            self._unanswered -= 1

    def close(self, timeout: float, settle: float = 5.0) -> bool:
        """Write what is waiting, then stop; give up on it after ``timeout`` seconds (the
        database is away), and wait up to ``settle`` more for the thread to answer what is
        left. A thread inside a statement that waits for a row lock answers only when the
        statement ends: a forced stop passes a short ``settle`` rather than wait for it (the
        statement, fenced, may still commit on the server after the runner is gone). True if
        everything handed over was answered."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            thread = self._thread
        if thread is None:
            return True
        thread.join(max(0.0, timeout))
        if thread.is_alive():
            self._give_up.set()  # retries stop; what is left is answered "not written"
            thread.join(max(0.0, settle))
        return not thread.is_alive()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        try:
            while True:
                batch = self._next_batch()
                if batch is None:
                    return
                try:
                    self._write(batch)
                except BaseException as exc:  # a bug here must not leave threads waiting
                    logger.exception("writing %d completion(s) failed", len(batch),
                                     extra={"event": "completion_failed"})
                    for waiting in batch:
                        waiting.answer(None, exc)
                self._batch_answered()
        finally:
            with self._cond:
                left, self._queue = list(self._queue), deque()
            self._restore({waiting.job.token: waiting.started for waiting in left
                           if waiting.started is not None})
            for waiting in left:
                waiting.answer(None)
            self._batch_answered()
            connections.close_all()

    def _batch_answered(self) -> None:
        if self.after_batch is not None:
            try:
                self.after_batch()
            except Exception:
                logger.exception("reporting a batch of completions failed",
                                 extra={"event": "completion_callback_failed"})

    def _next_batch(self) -> list[_Waiting] | None:
        with self._cond:
            while not self._queue:
                if self._closing:
                    return None
                self._cond.wait()
            if self.linger and not self._closing:
                deadline = time.monotonic() + self.linger
                while len(self._queue) < self.max_batch and not self._closing:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._cond.wait(remaining)
            alias = self._queue[0].alias
            batch: list[_Waiting] = []
            kept: deque[_Waiting] = deque()
            while self._queue and len(batch) < self.max_batch:
                waiting = self._queue.popleft()
                (batch if waiting.alias == alias else kept).append(waiting)
            self._queue.extendleft(reversed(kept))
            return batch

    def _write(self, batch: list[_Waiting]) -> None:
        alias = batch[0].alias
        pairs = [(waiting.job, waiting.result) for waiting in batch]
        started = {waiting.job.token: waiting.started for waiting in batch
                   if waiting.started is not None}
        try:
            self._write_taken(batch, alias, pairs, started)
        except BaseException:
            self._restore(started)
            raise

    def _restore(self, started: dict[int, datetime]) -> None:
        """Starts this batch took but did not write go back to the log (the claim loop writes
        them); the jobs they belong to are still running under this runner."""
        if started and self.starts is not None:
            self.starts.restore(started)

    def _write_taken(self, batch: list[_Waiting], alias: str,
                     pairs: list[tuple[ClaimedJob, str | None]],
                     started: dict[int, datetime]) -> None:
        def complete(cursor: Cursor) -> set[int]:
            store.index_only_session(cursor)  # this thread's connection runs nothing else
            return store.complete_many(cursor, pairs, started)

        try:
            done = run_with_retry(alias, complete, keep_cursor=True,
                                  what=f"completing {len(batch)} job(s)",
                                  interrupt=self._give_up)
        except Exception as exc:
            if len(batch) == 1:
                self._restore(started)
                batch[0].answer(None, exc)
                return
            logger.warning("completing %d jobs in one statement failed (%s: %s); completing "
                           "them one at a time", len(batch), type(exc).__name__,
                           store.storable_text(exc, 500), extra={"event": "completion_split"})
            for waiting in batch:
                self._write([waiting])
            return
        if done is None:
            self._restore(started)
            for waiting in batch:
                waiting.answer(None)
            return
        if started and self.starts is not None:
            self.starts.carried_done(started)  # written (or the attempt is no longer ours)
        self.statements += 1
        self.completed += len(done)
        missing = [waiting.job.token for waiting in batch if waiting.job.token not in done]
        settled: dict[int, str] | None = {}
        if missing:
            # Not completed by this statement: lost, or completed by an earlier try whose
            # commit landed although its connection failed (the retry then found nothing to
            # do). The attempt row says which.
            def read(cursor: Cursor) -> dict[int, str]:
                return store.attempt_outcomes(cursor, missing)

            settled = run_with_retry(alias, read, what="reading attempt outcomes",
                                     interrupt=self._give_up)
        for waiting in batch:
            token = waiting.job.token
            if token in done:
                waiting.answer(True)
            elif settled is None:
                waiting.answer(None)
            else:
                waiting.answer(settled.get(token) == "completed")
