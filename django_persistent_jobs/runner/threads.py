"""The in-process executor: handlers run on threads of the runner's own process.

It is the thread pool (``pool.WorkerPool``) under the executor's name. It needs no start-up time
and no hand-off, which suits a runner embedded in a web process and ``runjobs --processes 0``;
the price is that handler code shares the interpreter (and its GIL) with the supervisor's loops.
"""

from __future__ import annotations

from .execute import InFlight
from .pool import WorkerPool


class ThreadExecutor(WorkerPool):
    """``Executor`` on threads; see ``pool.WorkerPool`` for how a hung handler is taken over."""

    kind = "threads"

    def cancel(self, item: InFlight) -> None:
        item.ctx._cancel_event.set()  # the handler's own context: it runs here
