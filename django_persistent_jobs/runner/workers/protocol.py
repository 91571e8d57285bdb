"""The messages between the supervisor and a worker process (pickled tuples on a pipe).

Tuples with a one-letter tag rather than classes: the hand-off of every job costs one message
each way, and the per-job cost of the process model is mostly this.

Supervisor to worker:
    ``(RUN, job, cancel_requested)``  start this claimed job now, on a thread
    ``(CANCEL, job_id)``              an operator asked to cancel it (``ctx.cancel_requested``)
    ``(INTERRUPT, job_id)``           the supervisor settled it (timeout, shutdown): stop it
    ``(STOP,)``                       exit now (nothing the supervisor cares about is running)

Worker to supervisor:
    ``(READY, pid)``                          set up, accepting jobs
    ``(STARTED, job_id, backend_pid, start)`` the session of a job running for a while (the
                                              supervisor terminates it at the timeout)
    ``(DONE, job_id)``                        the job's thread returned (settled or interrupted)
    ``(CRASHED, job_id, text)``               its outcome could not be recorded
"""

from __future__ import annotations

RUN = "r"
CANCEL = "c"
INTERRUPT = "i"
STOP = "s"

READY = "R"
STARTED = "S"
DONE = "D"
CRASHED = "X"
