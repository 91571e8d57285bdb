"""The runner's SQL. Every state change a runner makes is one statement, fenced by ``lock_token``.

``lock_token`` is the id of the attempt row created at claim time. Completion and every failure
transition require the job to still carry that token, so an execution that lost its claim
(rescued, timed out, handed back) changes nothing: its completion updates zero rows and the
handler's transaction, business writes included, rolls back.

Plans that cannot go stale. A prepared statement's generic plan is made once, from the table
sizes of the moment, and kept until a vacuum or analyze of a table it reads invalidates it. A
runner started on a fresh install (or after a benchmark's ``TRUNCATE``) makes it while the job
tables are empty, where a sequential scan costs nothing: every later claim or completion would
then scan the whole table, history included, and the cost per job would grow with it until
autovacuum happens to analyze the table. So only the claim is prepared, on a connection whose
planner may not choose sequential scans (``index_only_session``, which the runner applies to
its claiming connection), and every row it touches is found through an index condition; every
other statement is planned for each execution, from the table's current size (``prepare=False``,
or Django's client-side binding), which costs little for statements that look rows up by primary
key. The batched completion is planned per execution too, but on a connection of its own that
gets the same setting: a batch of a few hundred ids against a table of a few thousand rows is
cheaper to hash-join with a sequential scan, and one batch per claim would read the table whole
each time.
"""

from __future__ import annotations

import functools
import json
import math
import time
import uuid
import weakref
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import psycopg
from django.db import IntegrityError, transaction
from django.db.backends.postgresql.psycopg_any import register_tzloader
from django.db.models import QuerySet
from psycopg.pq import Format, TransactionStatus

from .. import conf

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.db.backends.utils import CursorWrapper as Cursor

TransitionKind = Literal["retry", "dead", "cancel", "handback", "release"]

@dataclass
class ClaimedJob:
    """What the runner knows about a job it owns."""

    id: uuid.UUID
    job_type: str
    payload: Any
    attempt: int
    max_retries: int
    timeout: float | None
    token: int
    queue: str
    priority: int
    cancel_requested: bool
    tenant: str | None = None
    #: ``next_run_at`` when claimed: when the job became due (the queue-wait metric).
    due_at: datetime | None = None
    #: Why the stored payload could not be decoded (the job is then dead-lettered, not run).
    payload_error: str | None = None
    #: Claimed to wait for a free worker: its attempt is recorded as started only when a
    #: worker is about to run it (``starts.StartGate``).
    waiting: bool = False
    #: The period of this runner's lease it was claimed in (``starts.Lease.period``), or None
    #: if the lease was not held then: a waiting job starts on the fast path only in the same
    #: period.
    lease_period: int | None = None
    #: When it started, if it waited and started on the fast path (``starts``): that start may
    #: not be on record yet, so the statement that settles the attempt records it too, and
    #: the attempt's ``started_at`` and ``duration`` are the run's, not the claim's.
    began: datetime | None = None
    #: The stored payload as the claim read it, not decoded yet (``payload`` is None then):
    #: ``execute`` decodes it where the handler runs, so with worker processes the supervisor
    #: does no per-payload work (no JSON parsing, and a string to pickle instead of objects).
    payload_text: str | None = None

    def decode_payload(self) -> None:
        """Decode ``payload_text`` into ``payload`` (or ``payload_error``), once."""
        if self.payload_text is not None:
            self.payload, self.payload_error = _decode_payload(self.payload_text)
            self.payload_text = None


_TIMESTAMPTZ_OID = psycopg.adapters.types["timestamptz"].oid


def server_binding_cursor(db: BaseDatabaseWrapper) -> psycopg.Cursor[Any]:
    """A psycopg cursor on ``db``'s open connection that sends parameters apart from the
    statement, reading timestamps as Django's own cursors would.

    Django's psycopg backend sets the time zone on each cursor it makes whenever the
    connection's disagrees (``USE_TZ`` or ``TIME_ZONE`` changed after it connected, as tests
    do); a bare ``psycopg.Cursor`` would read aware datetimes where Django reads naive ones.
    """
    raw = psycopg.Cursor(db.connection)
    loader = db.connection.adapters.get_loader(_TIMESTAMPTZ_OID, Format.TEXT)
    if db.timezone != getattr(loader, "timezone", None):
        register_tzloader(db.timezone, raw)
    return raw


@contextmanager
def prepared(cursor: Cursor) -> Iterator[psycopg.Cursor[Any]]:
    """A server-side-binding cursor on the same connection (so the same transaction).

    Django binds parameters client-side, so PostgreSQL parses and plans every statement again;
    for the claim, whose planning costs as much as its execution, a prepared statement halves
    its cost. Errors are translated exactly as Django's own cursor would (``django.db``
    exceptions, the connection marked for a health check), so callers see no difference.
    """
    connection = getattr(cursor, "cursor", cursor).connection
    if connection.prepare_threshold is None:
        # Django opens connections with prepare_threshold=None, which makes psycopg ignore
        # prepare=True. A threshold no query reaches allows explicit preparation only; Django's
        # own (client-side binding) cursors never prepare anything.
        connection.prepare_threshold = 2**31 - 1
    db = getattr(cursor, "db", None)
    if db is not None:
        # Django's cursors refuse a query in an ``atomic()`` block an error broke, saying so;
        # this cursor is not Django's, so it must refuse the same way (otherwise PostgreSQL's
        # "current transaction is aborted" is what the caller reads).
        db.validate_no_broken_transaction()
    if db is None:
        with psycopg.Cursor(connection) as bare:
            yield bare
        return
    with db.wrap_database_errors:
        yield _bound_cursor(db, connection)


def _bound_cursor(db: BaseDatabaseWrapper, connection: psycopg.Connection[Any]
                  ) -> psycopg.Cursor[Any]:
    """``db``'s server-binding cursor, one per connection, kept for the connection's life:
    making one costs tens of microseconds (its adapters, its time-zone loader), paid by every
    claim and every ``enqueue()`` otherwise. Each user runs a statement and reads its rows
    before the next one starts (a cursor holds one result), and Django's connections are not
    shared between threads.

    Made again when the connection, Django's time zone or the session's changes: a cursor that
    runs the same statement again keeps the loaders it made the first time, and a timestamp
    loader reads the session's ``TimeZone`` once, when it is made (with ``USE_TZ = False`` a
    ``TIME_ZONE`` change, or a ``SET TIME ZONE`` of the caller's, changes only the session's).
    """
    zones = (db.timezone, connection.pgconn.parameter_status(b"TimeZone"))
    kept = getattr(db, "_pj_bound_cursor", None)
    if (kept is not None and kept[0] is connection and kept[1] == zones
            and not kept[2].closed):
        cursor: psycopg.Cursor[Any] = kept[2]
        return cursor
    cursor = server_binding_cursor(db)
    db._pj_bound_cursor = (connection, zones, cursor)  # type: ignore[attr-defined]
    return cursor


class _Placeholder(list[str]):
    """Stands for a statement parameter while the ORM compiles the claim (see ``inline``)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name


def _literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(int(value))
    if isinstance(value, str):
        return "'" + str(value).replace("'", "''").replace("%", "%%") + "'"
    raise TypeError(f"cannot inline {value!r} into the claim statement")


def inline(query_sql: str, params: Sequence[Any]) -> str:
    """The ORM's ``(sql, params)`` as one text: constants as literals, placeholders named.

    Constants must be literals, not parameters: the runner prepares the claim and PostgreSQL
    settles on a generic plan, which can use the partial ``pj_claim_idx`` only if it can prove
    ``status IN ('pending', 'failed')`` from the statement's text.
    """
    pieces = query_sql.split("%s")
    if len(pieces) != len(params) + 1:
        raise ValueError("unexpected %s in compiled SQL")
    out = [pieces[0]]
    for value, piece in zip(params, pieces[1:], strict=True):
        out.append(f"%({value.name})s" if isinstance(value, _Placeholder) else _literal(value))
        out.append(piece)
    return "".join(out)


def compile_queryset(qs: QuerySet[Any]) -> str:
    """``inline`` applied to ``qs``; compiled inside a transaction because Django refuses to
    compile ``select_for_update`` outside one (nothing is sent to the server)."""
    with transaction.atomic(using=qs.db, savepoint=False):
        query_sql, params = qs.query.sql_with_params()
    return inline(query_sql, params)


def picked_sql(limit: int, with_queues: bool = False, with_types: bool = False,
               after: bool = False) -> str:
    """The ``picked`` part of the claim: ``PersistentJob.objects.claimable()`` locked with
    ``SKIP LOCKED`` and limited, as the ORM compiles it; with ``after``, only jobs after the key
    in parameters ``after_priority``, ``after_at``, ``after_id`` (``ClaimKey``)."""
    from ..models import PersistentJob

    qs = PersistentJob.objects.claimable(
        queues=_Placeholder("queues") if with_queues else None,
        job_types=_Placeholder("types") if with_types else None,
    )
    if after:
        qs = qs.after_key(_Placeholder("after_priority"), _Placeholder("after_at"),
                          _Placeholder("after_id"))
    return compile_queryset(qs.values("id", "attempts", "priority", "next_run_at")
                            .select_for_update(skip_locked=True)[: int(limit)])


@functools.lru_cache(maxsize=64)
def claim_sql(limit: int, with_queues: bool = False, with_types: bool = False,
              after: bool = False) -> str:
    """The claim statement for ``limit`` jobs (parameters ``runner``, ``direct``, ``started``,
    ``started_at``, and ``queues`` and ``types`` if asked): lock the picked jobs, insert their
    attempt rows, mark them running.

    The first ``direct`` jobs in claim order go to a free worker at once: their attempts are
    recorded as started. The others wait in the runner for a worker (``PREFETCH``) and are
    recorded as waiting (``started`` false) until a worker starts them (``starts``), so that a
    runner that dies before starting them has them handed back uncharged. Each row returns its
    attempt's ``started``: the database's order decides which jobs are direct, not a re-sort in
    Python. The same statement records the starts of earlier waiting jobs (attempt ids
    ``started``, times ``started_at``): one round trip per claim, not one per job.

    The LIMIT is a literal: with ``LIMIT $n`` PostgreSQL keeps re-planning instead of settling
    on the generic plan of the prepared statement (a runner only ever uses a few values), so
    there is one text per limit, compiled once.

    Its generic plan must not depend on the table sizes of the moment it is made (see the
    module docstring), so no join in it involves a table: the jobs are updated through
    ``id = ANY(...)`` of the picked ids (one primary-key lookup each), each taking its fencing
    token from the attempt sequence as it is updated (the sequence is looked up once per
    statement, in a sub-select, not once per row), and the attempt rows are inserted from
    the updated rows with those tokens as their ids. The only join, for each row's ``started``,
    is between two CTEs. (Joining the attempt CTE to the job table instead let a generic plan
    made on empty tables, which expects one row from every CTE, pick a nested loop that probed
    the whole id array once per claimed job: a claim of 100 jobs made 10,000 index lookups.)

    A runner claims only while its row exists (one primary-key probe, evaluated once per
    statement): a runner that was frozen past the stale-lock timeout and reaped checks its own
    heartbeat's freshness in Python before it claims, but a freeze between that check and the
    claim would otherwise let it claim under a deleted row, jobs that the next rescue takes
    back at once. Now such a runner claims nothing until its heartbeat has registered it again.
    """
    return f"""
WITH picked AS (
    {picked_sql(limit, with_queues, with_types, after)}
), marked AS (
    {_MARK_STARTED}
), claimed AS (
    UPDATE persistent_jobs j SET status = 'running', attempts = j.attempts + 1,
        locked_by = %(runner)s, locked_at = now(),
        lock_token = nextval((SELECT pg_get_serial_sequence('persistent_jobs_attempts', 'id')
                              ::regclass)),
        updated_at = now()
    WHERE j.id = ANY(ARRAY(SELECT id FROM picked))
        AND EXISTS (SELECT 1 FROM persistent_jobs_runners r WHERE r.id = %(runner)s)
    RETURNING j.id, j.job_type, j.payload::text AS payload, j.attempts, j.max_retries,
        j.timeout_seconds, j.lock_token, j.queue, j.priority, j.cancel_requested,
        j.next_run_at, j.tenant
), attempt AS (
    INSERT INTO persistent_jobs_attempts (id, job_id, attempt, runner_id, started)
    SELECT c.lock_token, c.id, c.attempts, %(runner)s,
        row_number() OVER (ORDER BY c.priority DESC, c.next_run_at, c.id) <= %(direct)s
    FROM claimed c
    RETURNING id, started
)
SELECT c.id, c.job_type, c.payload, c.attempts, c.max_retries, c.timeout_seconds,
    c.lock_token, c.queue, c.priority, c.cancel_requested, c.next_run_at, c.tenant, a.started
FROM claimed c JOIN attempt a ON a.id = c.lock_token
"""


#: Skips a locked attempt row rather than wait for it: it is being completed or settled (which
#: makes the record moot), and waiting would deadlock with a batched completion, which locks job
#: rows and then attempt rows.
#:
#: Its arrays, like those of ``_COMPLETE_MANY``, are sent in binary (``%b``, so only through
#: ``prepared``'s server-binding cursor): psycopg builds a text array literal in Python, element
#: by element, at 1.3 us per integer and 5 us per datetime, against under 1 us in binary. A claim
#: and a completion batch carry one element per job in each array, which made the text form
#: about a tenth of a no-op job's whole cost in the runner.
_MARK_STARTED = """UPDATE persistent_jobs_attempts a SET started = true, started_at = s.at
    FROM unnest(%(started)b::bigint[], %(started_at)b::timestamptz[]) AS s(id, at)
    WHERE a.id = s.id AND a.id IN (
        SELECT w.id FROM persistent_jobs_attempts w WHERE w.id = ANY(%(started)b::bigint[])
        AND NOT w.started AND w.outcome = 'running' FOR UPDATE SKIP LOCKED)"""


def mark_started(cursor: Cursor, tokens: Sequence[int], times: Sequence[datetime]) -> None:
    """Record the starts noted on the fast path (``starts.StartLog``) when no claim comes
    soon enough to carry them (see ``claim_sql``)."""
    with prepared(cursor) as fast:  # (binary parameters: see ``_MARK_STARTED``)
        fast.execute(_MARK_STARTED, {"started": list(tokens), "started_at": list(times)},
                     prepare=False)


def admit(cursor: Cursor, tokens: Sequence[int], *, again: bool = False) -> set[int]:
    """Record the start of these waiting attempts, now; the ones that were still waiting under
    this runner's claim (the others were handed back or settled meanwhile: not ours to run).

    Fenced by the attempt row itself: a hand-back of a waiting job locks that row and requires
    it unstarted (``release_waiting``), so of the two, exactly one succeeds.

    ``again``: this write is a retry of one that may have committed although its answer was
    lost (the connection dropped after the server committed). An attempt already started and
    still running is then admitted too, with its first start time: refusing it would leave it
    started and ``running`` under a live runner that no longer runs it, never rescued while
    that runner lives. Only the gate's first try is strict (an attempt started by anything
    else, a claim, is not admitted twice).
    """
    cursor.execute(
        "UPDATE persistent_jobs_attempts SET started = true, "
        "started_at = CASE WHEN started THEN started_at ELSE now() END "
        "WHERE id = ANY(%s) AND outcome = 'running' AND (%s OR NOT started) RETURNING id",
        [list(tokens), again],
    )
    return {int(row[0]) for row in cursor.fetchall()}


#: Connections ``index_only_session`` has set up (weakly held: a closed connection just goes away).
_INDEX_ONLY_SESSIONS: weakref.WeakSet[Any] = weakref.WeakSet()


def index_only_session(cursor: Cursor | psycopg.Cursor[Any]) -> None:
    """Let the planner of a connection that claims or writes batched completions choose no
    sequential scan.

    The claim is prepared, so its generic plan outlives the table sizes it was made from; on a
    near-empty table a sequential scan and a sort cost nothing, and that plan would then scan
    the whole job table on every claim. With sequential scans off, only the index paths compete,
    and every access in the claim statement is an index condition, so its plan walks
    ``pj_claim_idx`` and looks rows up by key whatever the statistics said (the foreign-key
    check on the attempt insert, planned in the same session, too). Set once per connection,
    in autocommit only (a ``SET`` inside a transaction that rolls back would be undone): the
    runner claims on a connection of its own, in autocommit, that runs no handler code, and
    calls this before each claim (a reconnected session starts with the server's defaults);
    the completer does the same before each batch, on its own thread's connection.
    """
    raw = getattr(cursor, "cursor", cursor).connection
    if raw in _INDEX_ONLY_SESSIONS or not raw.autocommit:
        return
    if raw.info.transaction_status != TransactionStatus.IDLE:
        return
    cursor.execute("SET enable_seqscan = off")
    _INDEX_ONLY_SESSIONS.add(raw)


def _where(qs: QuerySet[Any], alias: str) -> str:
    """The WHERE clause the ORM compiles for ``qs``, constants inlined, columns on ``alias``."""
    text = compile_queryset(qs.values("id").order_by())
    return text.split(" WHERE ", 1)[1].replace('"persistent_jobs".', f"{alias}.")


@functools.cache
def waiting_sibling_sql() -> str:
    """Row ``p`` holds an enforced dedup key and another job waits with that key: settling ``p``
    back to waiting would break the waiting-dedup unique index, so ``p`` is replaced instead.

    Built from the same ``Q`` objects as the index (``models.WAITING_DEDUP``), so the two cannot
    drift apart.
    """
    from ..models import DEDUP_ENFORCED, WAITING_DEDUP, PersistentJob

    own = _where(PersistentJob.objects.filter(DEDUP_ENFORCED), "p")
    sibling = _where(PersistentJob.objects.filter(WAITING_DEDUP), "s")
    return (f"{own} AND EXISTS (SELECT 1 FROM persistent_jobs s WHERE {sibling} "
            "AND s.job_type = p.job_type AND s.dedup_key = p.dedup_key AND s.id <> p.id)")


ClaimKey = tuple[int, Any, Any]
"""A job's place in claim order: ``(priority, next_run_at, id)``."""


def claim(
    cursor: Cursor, runner_id: str, limit: int, queues: tuple[str, ...] | None,
    job_types: Collection[str] | None = None, after: ClaimKey | None = None,
    direct: int | None = None, started: Sequence[int] = (),
    started_at: Sequence[datetime] = (), decode: bool = True,
) -> list[ClaimedJob]:
    """Claim up to ``limit`` due jobs: highest priority first, then oldest ``next_run_at``.

    The attempt is counted here, at claim time, so a job that kills its runner still uses up its
    retries and ends dead-lettered instead of looping forever. With ``job_types`` only jobs of
    those types are claimed: a runner passes the types it has handlers for, so during a rolling
    deploy a job type only the new release knows waits for a new runner instead of being
    dead-lettered as unknown by an old one. ``None`` claims every type. With ``after`` only jobs
    of its priority after it in claim order are considered (see ``ClaimScan``). ``direct`` jobs
    (default: all) start at once, the rest are recorded as waiting; ``started`` and
    ``started_at`` record the starts of earlier waiting attempts (see ``claim_sql``). With
    ``decode=False`` payloads stay as claimed (``ClaimedJob.payload_text``), for ``execute``
    to decode (the claim loop: see ``ClaimedJob.payload_text``).
    """
    params: dict[str, Any] = {
        "runner": runner_id, "direct": limit if direct is None else direct,
        "started": list(started), "started_at": list(started_at),
    }
    if queues:
        params["queues"] = list(queues)
    if job_types is not None:
        params["types"] = list(job_types)
    if after is not None:
        params["after_priority"], params["after_at"], params["after_id"] = after
    with prepared(cursor) as fast:
        fast.execute(claim_sql(limit, bool(queues), job_types is not None, after is not None),
                     params, prepare=True)
        rows = fast.fetchall()
    rows.sort(key=lambda r: (-r[8], r[10], r[0]))
    jobs = []
    for r in rows:
        job = ClaimedJob(
            id=r[0], job_type=r[1], payload=None, attempt=r[3], max_retries=r[4],
            timeout=r[5], token=r[6], queue=r[7], priority=r[8], cancel_requested=r[9],
            tenant=r[11], due_at=r[10], waiting=not r[12], payload_text=r[2],
        )
        if decode:
            job.decode_payload()
        jobs.append(job)
    return jobs


class ClaimScan:
    """Where a runner's next claim starts: after the last job it claimed, with a full scan from
    the head of the claim order at least every ``rescan`` seconds and whenever asked.

    Every claimed job leaves a dead entry at the head of ``pj_claim_idx`` until a vacuum removes
    it (and nothing can while any session holds an older snapshot), so a claim that starts at
    the head walks further with every job drained: the cost per job grows with the backlog.
    Resuming after the last claimed key starts the index scan past those entries. What the
    resumed scan cannot see (a job committed late with an earlier key, a higher priority, a job
    skipped while another session had it locked, a job handed back) is found by the next full
    scan: at once when the runner is woken (every enqueue NOTIFYs on commit), otherwise within
    ``rescan`` seconds, and whenever the resumed scan finds nothing. So no job is missed; a job
    of a higher priority that becomes due without a wake-up waits at most ``rescan`` seconds.
    """

    def __init__(self, rescan: float = 0.25) -> None:
        self.rescan = rescan
        self.key: ClaimKey | None = None
        self.full_at = 0.0

    def forget(self) -> None:
        """Make the next claim a full scan (call on every wake-up)."""
        self.key = None

    def claim(self, cursor: Cursor, runner_id: str, limit: int, queues: tuple[str, ...] | None,
              job_types: Collection[str] | None = None, direct: int | None = None,
              started: Sequence[int] = (), started_at: Sequence[datetime] = (),
              decode: bool = True) -> list[ClaimedJob]:
        now = time.monotonic()
        if self.key is not None and now - self.full_at < self.rescan:
            jobs = claim(cursor, runner_id, limit, queues, job_types, after=self.key,
                         direct=direct, started=started, started_at=started_at, decode=decode)
            if jobs:
                self.key = _key(jobs[-1])
                return jobs
            started, started_at = (), ()  # recorded by the claim that found nothing
        jobs = claim(cursor, runner_id, limit, queues, job_types, direct=direct,
                     started=started, started_at=started_at, decode=decode)
        self.full_at = now
        self.key = _key(jobs[-1]) if jobs else None
        return jobs


def _key(job: ClaimedJob) -> ClaimKey:
    return (job.priority, job.due_at, job.id)


def _decode_payload(raw: Any) -> tuple[Any, str | None]:
    """The payload, or why it cannot be decoded.

    The claim has committed by now: an exception here would leave the job (or, decoded in the
    claim loop, every job of the batch) claimed by a runner that can no longer settle it. A
    stored payload Python cannot read (an integer of more digits than
    ``sys.int_max_str_digits``, nesting deeper than the recursion limit: rows written by raw
    SQL or an older release) must cost its own job only: it is dead-lettered.
    """
    if not isinstance(raw, str):
        return raw, None
    try:
        return json.loads(raw), None
    except (ValueError, RecursionError) as exc:
        return None, f"{type(exc).__name__}: {exc}"


def _settled_start(began: str, now: str) -> str:
    """The attempt row's ``started_at`` and ``duration`` as a settling statement writes them:
    the start on record, else ``began`` (a fast-path start no claim has written yet,
    ``ClaimedJob.began``), else the claim's time. One definition for every settling statement
    (an UPDATE's SET sees the row as it was, so the start is spelled out in both items).
    ``now`` is the end the attempt's ``finished_at`` gets too: one clock reading (the job
    row's ``finished_at``, or the transaction's ``now()``), so that ``duration`` is exactly
    ``finished_at - started_at`` (two ``clock_timestamp()`` calls could differ by a
    microsecond)."""
    start = f"CASE WHEN a.started THEN a.started_at ELSE coalesce({began}, a.started_at) END"
    return f"started_at = {start},\n    duration = {now} - {start}"


_COMPLETE = f"""
WITH done AS (
    UPDATE persistent_jobs SET status = 'completed', locked_by = NULL, locked_at = NULL,
        lock_token = NULL, finished_at = clock_timestamp(), updated_at = clock_timestamp(),
        result = %s::jsonb
    WHERE id = %s AND lock_token = %s
    RETURNING id, finished_at, %s::timestamptz AS began
)
UPDATE persistent_jobs_attempts a SET started = true, finished_at = done.finished_at,
    {_settled_start("done.began", "done.finished_at")},
    outcome = 'completed'
FROM done WHERE a.id = %s
RETURNING a.id
"""


def complete(cursor: Cursor, job: ClaimedJob, result: str | None = None) -> bool:
    """Mark the job completed inside the handler's transaction; False if the claim was lost.

    ``result`` is the handler's return value as JSON text (django.tasks results), or None.
    Planned at each execution, not prepared: it runs on the handler's connection, where the
    planner settings ``index_only_session`` uses are not ours to change, and a generic plan made
    while the attempts table was nearly empty would scan that whole table for every job.

    A job that waited and started on the fast path (``job.began``) has its start recorded
    here if no claim has written it yet: a completed attempt is started.
    """
    with prepared(cursor) as fast:
        fast.execute(_COMPLETE, [result, job.id, job.token, job.began, job.token],
                     prepare=False)
        return fast.fetchone() is not None


_COMPLETE_MANY = f"""
WITH done AS (
    UPDATE persistent_jobs j SET status = 'completed', locked_by = NULL, locked_at = NULL,
        lock_token = NULL, finished_at = clock_timestamp(), updated_at = clock_timestamp(),
        result = d.result::jsonb
    FROM unnest(%b::uuid[], %b::bigint[], %b::text[], %b::timestamptz[])
        AS d(id, token, result, began)
    WHERE j.id = d.id AND j.lock_token = d.token
    RETURNING d.token, d.began, j.finished_at
)
UPDATE persistent_jobs_attempts a SET started = true, finished_at = done.finished_at,
    {_settled_start("done.began", "done.finished_at")},
    outcome = 'completed'
FROM done WHERE a.id = done.token
RETURNING a.id
"""


def complete_many(
    cursor: Cursor, jobs: Sequence[tuple[ClaimedJob, str | None]],
    started: Mapping[int, datetime] | None = None,
) -> set[int]:
    """Mark several jobs completed in one statement; the tokens of those whose claim held.

    Each row is fenced by its own token, exactly as ``complete`` fences one job: a job rescued,
    timed out or handed back in the meantime is left as it is, and the others complete. The
    ids are sent in order, so batches lock their rows in one order; a deadlock with another
    session's statement is a transient error, retried like any other. Planned at each
    execution (see ``complete``).

    ``started``: when waiting jobs of the batch started (by token), noted on the fast path and
    not written yet (``starts.StartLog``). The statement writes them with the completion, so a
    job that finished before the next claim costs no update of its own for its start; a
    completed attempt is started whatever was on record.
    """
    ordered = sorted(jobs, key=lambda pair: str(pair[0].id))
    began = started or {}
    params = [[job.id for job, _ in ordered], [job.token for job, _ in ordered],
              [result for _, result in ordered],
              [began.get(job.token, job.began) for job, _ in ordered]]
    with prepared(cursor) as fast:
        fast.execute(_COMPLETE_MANY, params, prepare=False)
        return {int(row[0]) for row in fast.fetchall()}


def attempt_outcomes(cursor: Cursor, tokens: Collection[int]) -> dict[int, str]:
    """The recorded outcome of several attempts, by token (see ``attempt_outcome``)."""
    cursor.execute("SELECT id, outcome FROM persistent_jobs_attempts WHERE id = ANY(%s)",
                   [list(tokens)])
    return {int(row[0]): str(row[1]) for row in cursor.fetchall()}


def configured_handback_limit() -> int:
    """``HANDBACK_LIMIT`` as the settling statement needs it (validated when a runner starts)."""
    return conf.settings.HANDBACK_LIMIT


#: Column widths the settling statement writes into (see models/jobs.py and models/attempts.py).
CODE_MAX_LENGTH = 64
MESSAGE_MAX_LENGTH = 10_000
TRACEBACK_MAX_LENGTH = 50_000
#: The longest retry delay stored: a handler's ``retry_after`` or a backoff function may return
#: anything (``inf``, ``1e300``) and ``next_run_at`` must stay a timestamp PostgreSQL can add.
MAX_DELAY_SECONDS = 10 * 365 * 86400.0


def storable_text(text: Any, limit: int) -> str:
    """``text`` as PostgreSQL can store it, at most ``limit`` characters.

    A ``text`` column cannot hold NUL and UTF-8 cannot encode a lone surrogate (a file name
    decoded with surrogateescape, bytes quoted in a message). Both are written as backslash
    escapes (``\\x00``, ``\\udcff``) so the stored text still says what the error said.
    """
    value: str = text if isinstance(text, str) else str(text)
    if "\x00" in value:
        value = value.replace("\x00", "\\x00")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        value = value.encode("utf-8", "backslashreplace").decode("utf-8")
    return value[:limit]


def storable_delay(delay: Any) -> float:
    """A retry delay PostgreSQL can add to ``now()``: finite, 0 .. ``MAX_DELAY_SECONDS``."""
    try:
        value = float(delay)
    except (TypeError, ValueError, OverflowError):
        return 0.0
    if not math.isfinite(value):
        return MAX_DELAY_SECONDS if value > 0 else 0.0
    return min(max(value, 0.0), MAX_DELAY_SECONDS)


#: The settling statement. Its fence is ``IS NOT DISTINCT FROM`` and its answer is the job's new
#: status, not the attempt row's: a ``running`` row written by hand (a test simulating a crash,
#: a restored backup, an operator's UPDATE) may have no token or no attempt record behind it,
#: and a rescue must still settle it rather than find it "not ours" at every round.
_TRANSITION = """
WITH cur AS (
    SELECT p.id, p.charged, p.handbacks,
        CASE
            WHEN %(kind)s = 'cancel' OR p.cancel_requested THEN 'cancelled'
            WHEN %(kind)s = 'dead' OR (p.charged AND p.attempts >= p.max_retries + 1)
                THEN 'dead_lettered'
            WHEN {waiting_sibling} THEN 'replaced'
            WHEN NOT p.charged THEN 'pending'
            ELSE 'failed'
        END AS verdict
    FROM (
        SELECT p.*, (%(kind)s = 'retry' OR (%(kind)s = 'handback'
                     AND p.handbacks >= %(handback_limit)s)) AS charged
        FROM persistent_jobs p
        WHERE p.id = %(id)s AND p.lock_token IS NOT DISTINCT FROM %(token)s::bigint
          AND p.status = 'running'
        FOR UPDATE
    ) p
), settled AS (
    SELECT cur.id, cur.verdict,
        CASE WHEN %(kind)s = 'handback' AND cur.charged THEN 'INTERRUPTED'
             ELSE %(code)s END AS code,
        CASE WHEN %(kind)s = 'handback' AND cur.charged
             THEN %(message)s || ' (handed back ' || (cur.handbacks + 1)
                  || ' times; this hand-back is charged as an attempt)'
             ELSE %(message)s END AS message,
        CASE WHEN %(kind)s = 'handback' AND cur.charged THEN %(charge_delay)s
             ELSE %(delay)s END AS delay,
        cur.charged AND %(kind)s = 'handback' AS charged_handback
    FROM cur
), moved AS (
    UPDATE persistent_jobs p SET
        status = CASE s.verdict WHEN 'replaced' THEN 'cancelled' ELSE s.verdict END,
        attempts = CASE WHEN s.verdict = 'pending' THEN greatest(p.attempts - 1, 0)
                   ELSE p.attempts END,
        handbacks = CASE WHEN %(kind)s = 'handback' THEN p.handbacks + 1 ELSE p.handbacks END,
        next_run_at = CASE WHEN s.verdict IN ('failed', 'pending')
                      THEN now() + s.delay * interval '1 second' ELSE p.next_run_at END,
        locked_by = NULL, locked_at = NULL, lock_token = NULL,
        last_error = CASE WHEN s.verdict = 'replaced'
                     THEN 'retry superseded by a newer job with the same dedup key: '
                          || s.message
                     ELSE s.message END,
        last_error_code = CASE WHEN s.verdict = 'replaced' THEN 'REPLACED' ELSE s.code END,
        finished_at = CASE WHEN s.verdict IN ('failed', 'pending') THEN NULL ELSE now() END,
        updated_at = now()
    FROM settled s WHERE p.id = s.id
    RETURNING p.status, s.code, s.message, s.charged_handback
), recorded AS (
UPDATE persistent_jobs_attempts a SET finished_at = now(),
    started = a.started OR %(began)s::timestamptz IS NOT NULL,
    {settled_start},
    outcome = CASE WHEN moved.charged_handback THEN moved.status
        ELSE COALESCE(%(outcome)s, CASE moved.status
            WHEN 'failed' THEN 'failed' WHEN 'dead_lettered' THEN 'dead_lettered'
            WHEN 'cancelled' THEN 'cancelled' ELSE 'interrupted' END) END,
    error_code = moved.code, error_message = moved.message, traceback = %(traceback)s,
    error_class = %(error_class)s
FROM moved WHERE a.id = %(token)s
)
SELECT status FROM moved
"""


@functools.cache
def transition_sql() -> str:
    """The settling statement, with the dedup predicate compiled from the models."""
    return _TRANSITION.replace("{waiting_sibling}", waiting_sibling_sql()).replace(
        "{settled_start}", _settled_start("%(began)s::timestamptz", "now()"))


def transition(
    cursor: Cursor, job_id: uuid.UUID, token: int, *, kind: TransitionKind, code: str, message: str,
    traceback: str = "", delay: float = 0.0, outcome: str | None = None,
    handback_limit: int | None = None, charge_delay: float = 0.0,
    error_class: str = "", began: datetime | None = None,
) -> str | None:
    """Move a running job out of ``running``; return its new status, or None if not ours.

    ``retry`` goes to ``failed`` (due after ``delay``) or, with retries used up, to
    ``dead_lettered``; ``dead`` dead-letters; ``cancel`` cancels. ``handback`` returns a job
    whose attempt was interrupted (the runner is stopping) to ``pending`` without charging the
    attempt, and counts it in ``handbacks``: once a job has been handed back ``handback_limit``
    times, a further hand-back is charged like a failed attempt (code ``INTERRUPTED``, retried
    after ``charge_delay``, or dead-lettered with its retries used up), so a job that gets its
    runner stopped every time cannot loop forever. ``release`` returns a claimed job that never
    started: not charged, not counted. ``handback_limit`` defaults to the ``HANDBACK_LIMIT``
    setting. A cancellation request always wins, and a job that
    would go back to waiting next to a newer waiting job holding the same dedup key is
    cancelled as ``REPLACED`` instead.

    Text is made storable (see ``storable_text``) and the delay bounded here, so nothing a
    handler raises can make the settling statement itself fail. ``began``: when a job that
    waited started on the fast path (``ClaimedJob.began``), recorded here if no claim has
    written it yet, so the attempt is started and its duration is the run's.
    """
    params: dict[str, Any] = {
        "began": began,
        "id": job_id, "token": token, "kind": kind,
        "code": storable_text(code, CODE_MAX_LENGTH),
        "message": storable_text(message, MESSAGE_MAX_LENGTH),
        "traceback": storable_text(traceback, TRACEBACK_MAX_LENGTH),
        "delay": storable_delay(delay), "charge_delay": storable_delay(charge_delay),
        "outcome": outcome, "error_class": storable_text(error_class, 255),
        "handback_limit": configured_handback_limit() if handback_limit is None
        else int(handback_limit),
    }
    for round_ in range(DEDUP_CONFLICT_ROUNDS):
        try:
            cursor.execute(transition_sql(), params)
            break
        except (IntegrityError, psycopg.errors.UniqueViolation) as exc:
            # A Replace enqueue of the same key committed its new waiting job while this
            # statement waited on its index entry: the statement's snapshot predates that job,
            # so it chose to put this one back to waiting too, and lost the unique index. Run
            # again (in autocommit a fresh statement sees the newer job, and settles this one as
            # replaced); inside a transaction the caller's transaction is aborted: let it decide.
            in_transaction = getattr(getattr(cursor, "db", None), "in_atomic_block", True)
            if (round_ + 1 == DEDUP_CONFLICT_ROUNDS or in_transaction
                    or not _is_waiting_dedup_conflict(exc)):
                raise
    row = cursor.fetchone()
    return None if row is None else str(row[0])


#: Rounds of the settling statement against concurrent Replace enqueues of the job's key. One
#: retry settles it (the conflicting job has committed); more cover several enqueues in a row.
DEDUP_CONFLICT_ROUNDS = 5


def _is_waiting_dedup_conflict(exc: BaseException) -> bool:
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    diag = getattr(cause, "diag", None)
    return (getattr(cause, "sqlstate", None) == "23505"
            and getattr(diag, "constraint_name", None) == "pj_dedup_waiting_uniq")


def register_runner(
    cursor: Cursor, runner_id: str, hostname: str, pid: int, queues: tuple[str, ...] | None,
    concurrency: int, version: str, name: str = "", job_types: Sequence[str] | None = None,
    schedules: Sequence[str] | None = None, started_at: datetime | None = None,
) -> datetime:
    """Insert (or refresh) a runner's row; return its ``started_at``.

    ``schedules``: the schedules its code declares, for a runner with a scheduler (its syncs
    keep the list current). ``started_at``: when it first registered, for a runner registering
    again after being presumed dead: which live runner started last decides between two
    releases' declarations of a schedule (``schedules.firing.Fleet``), and a runner does not
    become "the newest" by being reaped.
    """
    cursor.execute(
        "INSERT INTO persistent_jobs_runners (id, name, hostname, pid, queues, concurrency, "
        "version, job_types, schedules, started_at) "
        "VALUES (%s, %s, %s, %s, %s::jsonb, %s, %s, %s::jsonb, %s::jsonb, coalesce(%s, now())) "
        "ON CONFLICT (id) DO UPDATE SET heartbeat_at = now(), job_types = EXCLUDED.job_types, "
        "schedules = coalesce(EXCLUDED.schedules, persistent_jobs_runners.schedules) "
        "RETURNING started_at",
        [runner_id, name, hostname, pid, json.dumps(list(queues) if queues else None),
         concurrency, version, None if job_types is None else json.dumps(list(job_types)),
         None if schedules is None else json.dumps(sorted(schedules)), started_at],
    )
    started: datetime = cursor.fetchone()[0]
    return started


#: At most this many job types are named by one look for unhandled ones (the next look, a
#: moment later, finds the rest).
UNHANDLED_TYPES_LIMIT = 50


def unhandled_due_types(
    cursor: Cursor, queues: Sequence[str] | None, own_types: Collection[str],
    stale_seconds: float,
) -> list[str]:
    """Job types of due waiting jobs (in ``queues``, or any) that neither this runner
    (``own_types``) nor any live runner serving the job's queue has a handler for.

    A runner whose row lists no types (written before the column existed) counts as handling
    every type, and a runner counts as live while its heartbeat is younger than the stale-lock
    timeout (a runner restarting between two beats is still live to this). The waiting jobs
    are read through ``pj_claim_idx``'s partial index; the caller looks only when it has
    caught up with its own due jobs, and not more than every few seconds."""
    queue_filter = "AND j.queue = ANY(%(queues)s) " if queues else ""
    cursor.execute(
        "SELECT DISTINCT j.job_type FROM persistent_jobs j "
        "WHERE j.status IN ('pending', 'failed') AND j.next_run_at <= now() "
        + queue_filter +
        "AND j.job_type <> ALL(%(own)s) AND NOT EXISTS ("
        "  SELECT 1 FROM persistent_jobs_runners r "
        "  WHERE r.heartbeat_at >= now() - %(stale)s * interval '1 second' "
        "    AND (r.queues IS NULL OR jsonb_typeof(r.queues) <> 'array' OR r.queues ? j.queue) "
        "    AND (r.job_types IS NULL OR jsonb_typeof(r.job_types) <> 'array' "
        "         OR r.job_types ? j.job_type)) "
        "LIMIT %(limit)s",
        {"queues": list(queues or ()), "own": list(own_types), "stale": stale_seconds,
         "limit": UNHANDLED_TYPES_LIMIT},
    )
    return sorted(row[0] for row in cursor.fetchall())


def live_namesakes(
    cursor: Cursor, runner_id: str, name: str, stale_seconds: float,
) -> list[tuple[str, str, int]]:
    """Other runners registered under ``name`` whose heartbeat is fresh: ``(id, host, pid)``."""
    cursor.execute(
        "SELECT id, hostname, pid FROM persistent_jobs_runners WHERE name = %s AND id <> %s "
        "AND heartbeat_at >= now() - %s * interval '1 second' ORDER BY id",
        [name, runner_id, stale_seconds],
    )
    return [(row[0], row[1], row[2]) for row in cursor.fetchall()]


def heartbeat(cursor: Cursor, runner_id: str, job_types: Sequence[str] | None = None) -> bool:
    """Refresh the heartbeat (and, if given, the job types the runner has handlers for: a
    handler registered after the runner started is claimed from then on, and listed from the
    next beat); False means another runner declared us dead and removed our row."""
    cursor.execute(
        "UPDATE persistent_jobs_runners SET heartbeat_at = now(), "
        "job_types = coalesce(%s::jsonb, job_types) WHERE id = %s",
        [None if job_types is None else json.dumps(list(job_types)), runner_id],
    )
    return bool(cursor.rowcount)


def unregister_runner(cursor: Cursor, runner_id: str) -> None:
    cursor.execute("DELETE FROM persistent_jobs_runners WHERE id = %s", [runner_id])


def cancel_requests(cursor: Cursor, runner_id: str) -> list[tuple[Any, int]]:
    """The jobs of this runner an operator asked to cancel: (job id, the current attempt's
    token), so that the request reaches that attempt and not an older one still running."""
    cursor.execute(
        "SELECT id, lock_token FROM persistent_jobs WHERE locked_by = %s AND status = 'running' "
        "AND cancel_requested AND lock_token IS NOT NULL",
        [runner_id],
    )
    return [(row[0], int(row[1])) for row in cursor.fetchall()]


def reap_dead_runners(cursor: Cursor, stale_seconds: float, *, reaper: str | None,
                      reaper_fresh_seconds: float | None = None) -> list[tuple[str, Any]]:
    """Delete runners whose heartbeat is older than ``stale_seconds`` by the database clock.

    With ``reaper`` (keyword and required, so a caller chooses ``None`` knowingly), only while
    the reaper's own heartbeat is at most ``reaper_fresh_seconds`` (default ``stale_seconds``)
    old by the same clock: a statement that reaches the server long after the reaper decided
    to send it (this runner frozen in between, the network holding it) finds every runner's
    heartbeat as stale as the reaper's own, and deletes nothing. The reaper's in-process rule
    (``heartbeat.Liveness.may_reap``) cannot see that delay. (``now()`` is the time the
    statement's transaction began, so a statement held up inside the server judges as of its
    arrival, which is safe already.)"""
    cursor.execute(
        "DELETE FROM persistent_jobs_runners WHERE heartbeat_at < now() - %(stale)s * "
        "interval '1 second' AND (%(reaper)s::text IS NULL OR EXISTS (SELECT 1 FROM "
        "persistent_jobs_runners me WHERE me.id = %(reaper)s "
        "AND me.heartbeat_at >= now() - %(fresh)s * interval '1 second')) "
        "RETURNING id, heartbeat_at",
        {"stale": stale_seconds, "reaper": reaper,
         "fresh": stale_seconds if reaper_fresh_seconds is None else reaper_fresh_seconds},
    )
    return [(row[0], row[1]) for row in cursor.fetchall()]


class HeldJob(NamedTuple):
    """A running job as a rescuer sees it; ``started`` is false while its attempt was only
    waiting in its runner for a worker (see ``claim_sql``). ``queue`` and ``tenant`` go with
    the ``job_finished`` signal the rescuer sends (a metric labelled by queue needs it)."""

    id: Any
    token: int
    job_type: str
    attempts: int
    locked_by: str | None
    started: bool
    queue: str | None = None
    tenant: str | None = None


_HELD = ("SELECT j.id, j.lock_token, j.job_type, j.attempts, j.locked_by, "
         "coalesce(a.started, true), j.queue, j.tenant FROM persistent_jobs j "
         "LEFT JOIN persistent_jobs_attempts a ON a.id = j.lock_token ")


def orphaned_jobs(cursor: Cursor, limit: int = 1000) -> list[HeldJob]:
    """Running jobs whose runner row is gone.

    Runners insert their row before they claim anything and delete it only on exit, so a running
    job without a live runner row has nobody executing it (or only a zombie, which fencing stops).
    """
    cursor.execute(
        _HELD + "WHERE j.status = 'running' AND NOT EXISTS (SELECT 1 FROM "
        "persistent_jobs_runners r WHERE r.id = j.locked_by) LIMIT %s",
        [limit],
    )
    return [HeldJob(*row) for row in cursor.fetchall()]


def running_jobs_of(cursor: Cursor, runner_id: str) -> list[HeldJob]:
    """Running jobs locked by ``runner_id``."""
    cursor.execute(_HELD + "WHERE j.status = 'running' AND j.locked_by = %s", [runner_id])
    return [HeldJob(*row) for row in cursor.fetchall()]


#: The first key of every runner's lease (``pg_advisory_lock(int, int)``): "pj" in ASCII, so
#: the leases are told apart from an application's own advisory locks in ``pg_locks``.
LEASE_NAMESPACE = 0x706A


def take_lease(cursor: Cursor | psycopg.Cursor[Any], runner_id: str) -> bool:
    """Take this runner's lease on the current session: a session-level advisory lock the
    server releases the moment the session ends, however the runner died. False if another
    session holds it (this runner's previous session, not yet gone on the server side)."""
    cursor.execute("SELECT pg_try_advisory_lock(%s, hashtext(%s))",
                   [LEASE_NAMESPACE, runner_id])
    row = cursor.fetchone()
    return bool(row and row[0])


def lapsed_leases(cursor: Cursor, runner_id: str) -> list[str]:
    """Other registered runners no session holds the lease of: dead, or cut off from the
    server (a caller must see a lease lapsed twice, some time apart, before acting on it).
    Advisory locks are per database, so only this database's count: another project's runner
    of the same id hash on the same server holds a different lock."""
    cursor.execute(
        "SELECT r.id FROM persistent_jobs_runners r WHERE r.id <> %s AND NOT EXISTS ("
        "SELECT 1 FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted "
        "AND l.objsubid = 2 AND l.classid = %s "
        "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
        "AND l.objid = (hashtext(r.id)::bigint & 4294967295)::text::oid) ORDER BY r.id",
        [runner_id, LEASE_NAMESPACE],
    )
    return [row[0] for row in cursor.fetchall()]


def held_by_lost_runners(cursor: Cursor, runner_id: str) -> int:
    """Running jobs (other than this runner's) whose runner has no row, or whose runner no
    session holds the lease of: jobs a rescue will settle once the rescuer may act. A burst
    runner waits for them before it decides that nothing is due (``claimer``)."""
    lapsed = lapsed_leases(cursor, runner_id)
    cursor.execute(
        "SELECT count(*) FROM persistent_jobs j WHERE j.status = 'running' "
        "AND j.locked_by IS DISTINCT FROM %s AND (j.locked_by = ANY(%s) OR NOT EXISTS ("
        "SELECT 1 FROM persistent_jobs_runners r WHERE r.id = j.locked_by))",
        [runner_id, lapsed],
    )
    return int(cursor.fetchone()[0])


def release_waiting(cursor: Cursor, held: HeldJob, code: str, message: str,
                    lease_of: str | None = None, charge_delay: float = 0.0) -> str | None:
    """Hand a lost runner's waiting job back to ``pending``, not charged: as far as the
    database knows it never ran (counted against ``HANDBACK_LIMIT``: a start noted just before
    the runner died may not be on record yet, see ``starts``). Inside a transaction (the
    caller's): the attempt row is locked first and must still be waiting, so a worker's gated
    start (``admit``) and this hand-back exclude each other.
    With ``lease_of``, only while that runner's lease is still lapsed (held here until commit,
    so the runner cannot take it back meanwhile). The new status, or None if not done."""
    if lease_of is not None:
        cursor.execute("SELECT pg_try_advisory_xact_lock(%s, hashtext(%s))",
                       [LEASE_NAMESPACE, lease_of])
        row = cursor.fetchone()
        if not (row and row[0]):
            return None
    cursor.execute("SELECT 1 FROM persistent_jobs_attempts WHERE id = %s AND NOT started "
                   "AND outcome = 'running' FOR UPDATE", [held.token])
    if cursor.fetchone() is None:
        return None
    return transition(cursor, held.id, held.token, kind="handback", code=code, message=message,
                      charge_delay=charge_delay)


def waiting_jobs_of(cursor: Cursor, runner_ids: Sequence[str]) -> list[HeldJob]:
    """Running jobs of these runners whose attempt never started (they waited for a worker)."""
    cursor.execute(
        _HELD + "WHERE j.status = 'running' AND j.locked_by = ANY(%s) AND NOT a.started",
        [list(runner_ids)],
    )
    return [HeldJob(*row) for row in cursor.fetchall()]


#: Finished jobs whose age puts them past their retention: the rows cleanup deletes. A row
#: without ``finished_at`` (written by hand or by an older release: the runner and the services
#: always set it) is aged by ``updated_at``, or it would be kept for ever. Both conditions are
#: served by ``pj_finished_idx`` (a B-tree finds NULLs too).
_PAST_RETENTION = (
    "SELECT id FROM persistent_jobs WHERE status = %s "
    "AND (finished_at < now() - %s * interval '1 second' "
    "OR (finished_at IS NULL AND updated_at < now() - %s * interval '1 second')) "
    "AND id <> ALL(%s) LIMIT %s FOR UPDATE SKIP LOCKED"
)


def cleanup(cursor: Cursor, status: str, older_than_seconds: float, batch: int = 5000,
            exclude: Collection[uuid.UUID] = ()) -> int:
    """Delete one batch of ``status`` jobs finished more than ``older_than_seconds`` ago (and
    their attempts), but for ``exclude`` (rows the database refused to delete before)."""
    cursor.execute(
        f"""
        WITH doomed AS ({_PAST_RETENTION}), gone_attempts AS (
            DELETE FROM persistent_jobs_attempts WHERE job_id IN (SELECT id FROM doomed)
        )
        DELETE FROM persistent_jobs WHERE id IN (SELECT id FROM doomed)
        """,
        [status, older_than_seconds, older_than_seconds, list(exclude), batch],
    )
    return int(cursor.rowcount)


def past_retention(cursor: Cursor, status: str, older_than_seconds: float, batch: int,
                   exclude: Collection[uuid.UUID] = ()) -> list[uuid.UUID]:
    """The ids ``cleanup`` would delete next, to delete one at a time."""
    cursor.execute(_PAST_RETENTION, [status, older_than_seconds, older_than_seconds,
                                     list(exclude), batch])
    return [row[0] for row in cursor.fetchall()]


def delete_finished(cursor: Cursor, job_id: uuid.UUID) -> None:
    """Delete one finished job and its attempts."""
    cursor.execute("DELETE FROM persistent_jobs_attempts WHERE job_id = %s", [job_id])
    cursor.execute("DELETE FROM persistent_jobs WHERE id = %s", [job_id])


def terminate_backend(cursor: Cursor, pid: int, backend_start: Any = None) -> bool:
    """Terminate one server session. With ``backend_start``, only if the pid still belongs to
    the session that started then: the OS recycles pids, and after a restart or a dropped
    connection the same number may be someone else's backend."""
    if backend_start is None:
        cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
    else:
        cursor.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid = %s "
            "AND backend_start = %s", [pid, backend_start],
        )
    row = cursor.fetchone()
    return bool(row and row[0])


def attempt_outcome(cursor: Cursor, token: int) -> str | None:
    """The recorded outcome of one attempt (its id is the job's fencing token)."""
    cursor.execute("SELECT outcome FROM persistent_jobs_attempts WHERE id = %s", [token])
    row = cursor.fetchone()
    return None if row is None else str(row[0])


def report_progress(cursor: Cursor, job_id: uuid.UUID, token: int, progress: Any) -> bool:
    cursor.execute(
        "UPDATE persistent_jobs SET progress = %s::jsonb, updated_at = now() "
        "WHERE id = %s AND lock_token = %s AND status = 'running'",
        [json.dumps(progress), job_id, token],
    )
    return bool(cursor.rowcount)
