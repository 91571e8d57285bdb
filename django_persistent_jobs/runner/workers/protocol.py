"""The messages between the supervisor and a worker process (pickled tuples on a pipe).

Tuples with a one-letter tag rather than classes, and jobs as tuples of plain values rather than
dataclasses: the hand-off is the whole per-job price of the process model, and pickling a
dataclass (or a ``uuid.UUID``) costs several times what a tuple of ints and strings does.

Messages carry batches: one ``RUN`` takes every job handed to a worker at once (a claim of ten
jobs is one message, not ten), and one ``DONE`` reports every job that finished while the
previous report was being written.

Jobs run in *lanes*: a lane is one thread of the worker with its own database connection. The
worker's ``CONCURRENCY`` lanes take jobs from one queue, so the supervisor may send a worker a
few jobs beyond its idle lanes (fast jobs only, see ``manager``): a lane that finishes one starts
the next at once instead of waiting for a round trip through the supervisor. A lane reports each
job it starts (``STARTED``) before the handler runs: the supervisor starts the job's timeout
clock at that moment, and knows, if the worker dies, which of its jobs ran (charged) and which
were still waiting (handed to another worker, uncharged). ``STARTED`` goes on a pipe of its own,
the *start log*, which the supervisor does not wait on: it reads the log after each read of the
message pipe and before handling what that read brought (so a job's start is known before its
``DONE``), at each housekeeping tick, and to the end when the worker dies, before settling its
jobs. A message per job start on the message pipe would wake the supervisor once per job. The
next ``STARTED`` on a lane also tells the supervisor that the lane's previous job returned. A
full start log (the supervisor has not read it lately) holds the lane until the supervisor reads
it, at its next housekeeping tick at the latest: a ``STARTED`` sent on the message pipe instead
could be handled after a newer one from the log, and take the lane's running job for returned.
A worker reports a lane's database session
(``SESSION``) once per connection, before the first handler on it starts, so the supervisor
knows every running job's session without a message per job, even for a handler that holds the
worker's GIL from its first instruction (a connection the server closed while the lane was
idle is replaced once the job has started, and reported then, on the start log). A lane whose
job the supervisor took over (timeout, shutdown) is retired: its thread may never return, so a
fresh lane takes its place.

A job's payload travels as the JSON text the claim read (``ClaimedJob.payload_text``): the
worker decodes it where the handler runs, so the supervisor never parses a payload. A worker
checks that it packs jobs as its supervisor does (``codec_signature``, in its start options)
before it is ready.

Supervisor to worker:
    ``(RUN, [(job, cancel_requested), ...], fresh_until)``  queue these claimed jobs (``job``
                                      from ``pack_job``) for the worker's lanes; a waiting job
                                      a lane starts before ``fresh_until`` (monotonic) takes
                                      the fast path (``starts``)
    ``(CANCEL, job_id)``              an operator asked to cancel it (``ctx.cancel_requested``)
    ``(INTERRUPT, job_id)``           the supervisor settled it (timeout, shutdown): stop it, or
                                      never start it if it is still queued (``UNSTARTED``
                                      then says so)
    ``(RECALL, [job_id, ...])``       give these back if they have not started (shutdown, a
                                      worker being recycled): each one still queued is
                                      answered ``UNSTARTED``; one a lane started already runs
                                      on (its ``STARTED`` is on its way or was sent)
    ``(STOP,)``                       exit now (nothing the supervisor cares about is running)

Worker to supervisor:
    ``(READY, pid)``                          set up, accepting jobs
    ``(SESSION, lane, n, backend_pid, start)``  the database session the lane's jobs run on,
                                              from now on (the supervisor terminates it at a
                                              timeout); ``n`` numbers the lane's reports, so
                                              an older one read late is ignored.
                                              On the start log instead when the lane's running
                                              job found its connection dropped and opened
                                              another (after its ``STARTED``)
    ``(STARTED, lane, job_id, fast, at)``     the lane is starting this job's handler at ``at``
                                              (``time.monotonic()``, one clock for all
                                              processes on Linux); ``fast``: a waiting job on
                                              the fast path, to be noted. On the start log
    ``(ADMITTED, job_id, at)``                a waiting job that started through the gate
                                              (not ``fast``) has its start on record, and its
                                              handler starts at ``at``: its timeout clock
                                              starts then. On the start log
    ``(RETURNED, [job_id, ...])``             these jobs' handlers returned and their
                                              completions were handed to the worker's batch
                                              writer: their lanes are free, a ``DONE`` follows
                                              once the completions are written
    ``(DONE, [job_id, ...])``                 these jobs are settled (or their threads
                                              returned after being interrupted)
    ``(UNSTARTED, [job_id, ...])``            these were still queued when an ``INTERRUPT``
                                              or ``RECALL`` came: they never start here (the
                                              supervisor settles them only on this answer, so a
                                              job that started meanwhile is never released as
                                              unstarted)
    ``(CRASHED, job_id, text)``               its outcome could not be recorded
"""

from __future__ import annotations

import dataclasses
import operator
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..store import ClaimedJob

#: The messages' version, part of ``codec_signature``: raised whenever a message is added or
#: changes meaning. 2: ``ADMITTED``. 3: ``SESSION`` on the start log too. 4: a job's wire id
#: is its attempt's token, not its id.
VERSION = 4

RUN = "r"
CANCEL = "c"
INTERRUPT = "i"
RECALL = "b"
STOP = "s"

READY = "R"
SESSION = "S"
STARTED = "T"
ADMITTED = "A"
DONE = "D"
RETURNED = "F"
UNSTARTED = "U"
CRASHED = "X"

_codec: tuple[type[ClaimedJob], Callable[[ClaimedJob], tuple[Any, ...]]] | None = None
_DUE_AT = 11  # ClaimedJob.due_at's position (checked by ``_load_codec``)
#: ClaimedJob.token's position (checked by ``_load_codec``): a packed job's wire id.
TOKEN = 6
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)


def wire_id(job: ClaimedJob) -> int:
    """What messages name a job by: its attempt's fencing token, unique to this run of it
    (``packed[TOKEN]`` for a packed job). Not the job's id: a timed-out attempt whose thread
    returns late reports itself while the job's retry may already run on the same worker,
    and that report must not be taken for the retry's (which would then go unwatched, its
    timeout not enforced)."""
    return job.token


def pack_job(job: ClaimedJob) -> tuple[Any, ...]:
    """A claimed job as the tuple of its fields, the id as an int and an aware ``due_at`` as
    microseconds since the epoch (exact, unlike a float timestamp): a ``UUID``, and an aware
    ``datetime`` (its ``timezone`` goes through ``copyreg``), pickle several times slower than
    numbers, on both sides of the pipe. A naive ``due_at`` (``USE_TZ = False``) goes as is."""
    values = (_codec or _load_codec())[1](job)
    due_at = values[_DUE_AT]
    if due_at is not None and due_at.tzinfo is not None:  # (naive with USE_TZ = False: as is)
        due_at = (due_at - _EPOCH) // _MICROSECOND
    job_id = values[0]
    return (job_id.int if isinstance(job_id, uuid.UUID) else job_id, *values[1:_DUE_AT], due_at,
            *values[_DUE_AT + 1:])


def unpack_job(values: tuple[Any, ...]) -> ClaimedJob:
    """The ``ClaimedJob`` that ``pack_job`` packed. Runs once per job in a worker's lane."""
    fields = list(values)
    if isinstance(fields[0], int):
        fields[0] = uuid.UUID(int=fields[0])
    if isinstance(fields[_DUE_AT], int):
        fields[_DUE_AT] = _EPOCH + timedelta(microseconds=fields[_DUE_AT])
    return (_codec or _load_codec())[0](*fields)


def codec_signature() -> str:
    """The fields a job travels with, in order. A worker is a fresh interpreter that imports
    the package from disk: after a deploy that changed the files while ``runjobs`` ran, a
    replacement worker may run other code than its supervisor and would unpack jobs into the
    wrong fields (or, with another meaning of a field, run handlers with wrong payloads). The
    supervisor sends its signature; a worker whose own differs exits before it is ready.

    It starts with ``VERSION``, the protocol's messages: a worker that never sends a message
    its supervisor relies on (``ADMITTED``) must not be taken on either."""
    fields = ",".join(f.name for f in dataclasses.fields((_codec or _load_codec())[0]))
    return f"v{VERSION}:{fields}"


def _load_codec() -> tuple[type[ClaimedJob], Callable[[ClaimedJob], tuple[Any, ...]]]:
    """``ClaimedJob`` and a getter of its fields in order, looked up once (not on import: a
    worker imports this module before Django is set up; and an ``import`` statement in
    ``pack_job`` or ``unpack_job`` cost a third of the call)."""
    global _codec
    from ..store import ClaimedJob

    names = [f.name for f in dataclasses.fields(ClaimedJob)]
    if names[_DUE_AT] != "due_at" or names[TOKEN] != "token":
        raise RuntimeError(f"ClaimedJob's fields moved: {names}")
    _codec = (ClaimedJob, operator.attrgetter(*names))
    return _codec
