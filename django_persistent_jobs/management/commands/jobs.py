"""``python manage.py jobs list|show|retry|cancel|stats|prune``: operate jobs from a shell.

A thin front end over the same modules as the HTTP API (``queries`` to read, ``services`` to
act, ``api.serialize`` for ``--json``), so a script gets the same answers either way.

Exit codes, for scripts: 0 success; 1 an error (the database, or unexpected); 2 bad usage or
input; 3 a job id not found; 4 the job's state did not allow the action (for several jobs: at
least one refused).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import uuid
from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DatabaseError

from django_persistent_jobs import bounds, queries, services
from django_persistent_jobs.api.serialize import job_detail, job_summary
from django_persistent_jobs.errors import (
    ConfigurationError,
    InvalidJobStateError,
    JobNotFoundError,
    database_error_text,
)
from django_persistent_jobs.models import JobStatus, PersistentJob

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_REFUSED = 4

def _add_filters(parser: CommandParser) -> None:
    parser.add_argument("--status", action="append", default=[],
                        help=f"Repeat or comma-separate; one of {', '.join(JobStatus.values)}.")
    parser.add_argument("--job-type", action="append", default=[])
    parser.add_argument("--queue", action="append", default=[])
    parser.add_argument("--tenant", action="append", default=[])
    parser.add_argument("--error-code", action="append", default=[])
    parser.add_argument("--created-after", help="ISO 8601 with a time zone.")
    parser.add_argument("--created-before", help="ISO 8601 with a time zone.")


def _filter_from(options: dict[str, Any]) -> queries.JobFilter:
    values: dict[str, list[str]] = {
        "status": options["status"], "job_type": options["job_type"],
        "queue": options["queue"], "tenant": options["tenant"],
        "error_code": options["error_code"],
    }
    for name in ("created_after", "created_before"):
        # ``is not None``: an empty value (an unset shell variable) must reach the check and be
        # refused, not be taken for no filter and widen a bulk retry or cancel to every date.
        if options.get(name) is not None:
            values[name] = [options[name]]
    try:
        return queries.build_filter(values)
    except queries.QueryError as exc:
        raise CommandError(f"--{exc.field.replace('_', '-')}: {exc.message}",
                           returncode=EXIT_USAGE) from None



#: The fewest hex digits of an id ``show``, ``retry`` and ``cancel`` accept instead of all of
#: it: the admin lists the last eight (``admin.display.short_id``: the random tail of a UUID v7;
#: its head is a timestamp that jobs enqueued together share).
MIN_ID_PART = 8
_HEX = frozenset("0123456789abcdef")


def _resolve_id(text: str) -> str:
    """A full job id as given, or the one job whose id ends with ``text`` (the short id the
    admin lists) or, failing that, starts with it: at least ``MIN_ID_PART`` hex digits. Two
    jobs matching is a usage error naming both. Anything else is passed on unchanged, for the
    service to refuse in its own words. (A tail is found by reading the ids, a head by a range
    of the primary key.)"""
    digits = text.strip().lower().replace("-", "")
    if len(digits) >= 32 or len(digits) < MIN_ID_PART or not set(digits) <= _HEX:
        return text
    found = list(queries.ids_ending_with(PersistentJob.objects.all(), digits)
                 .order_by("pk").values_list("pk", flat=True)[:2])
    if not found:
        low = uuid.UUID(digits.ljust(32, "0"))
        high = uuid.UUID(digits.ljust(32, "f"))
        found = list(PersistentJob.objects.filter(pk__gte=low, pk__lte=high)
                     .order_by("pk").values_list("pk", flat=True)[:2])
    if len(found) > 1:
        raise CommandError(f"{text!r} is part of several job ids ({found[0]}, {found[1]}, "
                           "...); give more of it.", returncode=EXIT_USAGE)
    return str(found[0]) if found else text


class Command(BaseCommand):
    help = ("Inspect and operate persistent jobs. Exit codes: 0 ok, 1 error, 2 bad usage, "
            "3 not found, 4 refused by the job's state.")

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")

        ls = sub.add_parser("list", help="List jobs, newest first.")
        _add_filters(ls)
        ls.add_argument("--limit", type=int, default=queries.DEFAULT_LIMIT)
        ls.add_argument("--cursor", help="next_cursor from a previous --json page.")
        ls.add_argument("--json", action="store_true")

        show = sub.add_parser("show", help="One job with its attempts.")
        show.add_argument("job_id")
        show.add_argument("--json", action="store_true")

        for name, text in (("retry", "Retry jobs by id, or the jobs matching filters (without "
                                     "--status: the failed and dead-lettered ones)."),
                           ("cancel", "Cancel jobs by id, or the jobs matching filters (without "
                                      "--status: the pending and failed ones).")):
            act = sub.add_parser(name, help=text)
            act.add_argument("job_ids", nargs="*", metavar="ID")
            _add_filters(act)
            if name == "retry":
                act.add_argument("--mode", choices=services.RETRY_MODES, default="now")
            act.add_argument("--dry-run", action="store_true",
                             help="With filters: print the matching ids, change nothing.")
            act.add_argument("--json", action="store_true")

        stats = sub.add_parser("stats", help="The dashboard's numbers.")
        stats.add_argument("--window", type=int, default=86400,
                           help="Seconds of history (default 86400).")
        stats.add_argument("--tenant")
        stats.add_argument("--json", action="store_true")

        prune = sub.add_parser("prune", help="Delete finished jobs older than RETENTION now.")
        prune.add_argument("--json", action="store_true")

    def handle(self, *args: Any, **options: Any) -> None:
        action = options["action"]
        try:
            code = getattr(self, f"do_{action}")(options)
        except DatabaseError as exc:
            # An unreachable or unmigrated database is an operator's problem, not a bug: one
            # line that says which, and the exit code scripts treat as an error.
            raise CommandError(database_error_text(exc), returncode=EXIT_ERROR) from exc
        except ConfigurationError as exc:
            # Settings the system checks would refuse, reached past ``--skip-checks``: the
            # setting's own message, as ``runjobs`` gives it, not a traceback.
            raise CommandError(str(exc), returncode=EXIT_ERROR) from exc
        if code:
            sys.exit(code)

    # ------------------------------------------------------------------ output
    def emit(self, options: dict[str, Any], data: Any, text: str) -> None:
        if options["json"]:
            self.stdout.write(json.dumps(data, indent=2, default=str))
        else:
            self.stdout.write(text)

    # ------------------------------------------------------------------ actions
    def do_list(self, options: dict[str, Any]) -> int:
        job_filter = _filter_from(options)
        try:
            limit = queries.parse_limit(options["limit"])
            page = queries.list_jobs(job_filter, limit=limit, cursor=options["cursor"])
        except queries.QueryError as exc:
            raise CommandError(f"--{exc.field}: {exc.message}", returncode=EXIT_USAGE) from None
        rows = [job_summary(j) for j in page.jobs]
        lines = [f"{'ID':36}  {'STATUS':13}  {'ATT':>3}  {'QUEUE':10}  {'ERROR':16}  JOB TYPE"]
        for row in rows:
            lines.append(f"{row['id']:36}  {row['status']:13}  {row['attempts']:>3}  "
                         f"{row['queue'][:10]:10}  {row['last_error_code'][:16]:16}  "
                         f"{row['job_type']}")
        if page.next_cursor:
            lines.append(f"(more: --cursor {page.next_cursor})")
        self.emit(options, {"results": rows, "next_cursor": page.next_cursor}, "\n".join(lines))
        return EXIT_OK

    def do_show(self, options: dict[str, Any]) -> int:
        try:
            job = queries.get_job(_resolve_id(options["job_id"]))
        except JobNotFoundError as exc:
            self.stderr.write(str(exc))
            return EXIT_NOT_FOUND
        data = job_detail(job, queries.attempts_of(job))
        lines = [f"{key}: {json.dumps(value, default=str)}" for key, value in data.items()
                 if key not in ("attempt_history",)]
        for attempt in data["attempt_history"]:
            lines.append(f"  attempt {attempt['attempt']}: {attempt['outcome']} "
                         f"{attempt['error_code']} {attempt['duration_seconds']}s "
                         f"on {attempt['runner_id']}")
            # What failed, not only its code: the first line of the message here, the whole
            # traceback from -v 2 on (both are in --json).
            message = (attempt.get("error_message") or "").strip()
            if message:
                first = message.splitlines()[0]
                lines.append(f"    {first[:300]}{' ...' if len(first) > 300 else ''}")
            traceback = (attempt.get("traceback") or "").rstrip()
            if traceback and options["verbosity"] >= 2:
                lines.extend(f"    {line}" for line in traceback.splitlines())
        self.emit(options, data, "\n".join(lines))
        return EXIT_OK

    def _targets(self, options: dict[str, Any]) -> list[Any]:
        ids = options["job_ids"]
        job_filter = _filter_from(options)
        if ids and not job_filter.is_empty:
            raise CommandError("Give job ids or filters, not both.", returncode=EXIT_USAGE)
        if ids:
            return [_resolve_id(job_id) for job_id in ids]
        if job_filter.is_empty:
            raise CommandError("Give job ids, or filters selecting the jobs (for example "
                               "--status dead_lettered --job-type emails.send).",
                               returncode=EXIT_USAGE)
        if not job_filter.statuses:
            job_filter = dataclasses.replace(
                job_filter, statuses=services.BULK_ACTION_STATUSES[options["action"]])
        return list(queries.iter_matching(job_filter))

    def _act(self, options: dict[str, Any], act: Any) -> int:
        targets = self._targets(options)
        if options["dry_run"]:
            self.emit(options, {"matched": [str(t) for t in targets]},
                      "\n".join(str(t) for t in targets) or "(no matching jobs)")
            return EXIT_OK
        results: list[dict[str, Any]] = []
        worst = EXIT_OK
        for target in targets:
            try:
                job = act(target)
                results.append({"id": str(job.id), "ok": True, "status": job.status})
            except JobNotFoundError as exc:
                results.append({"id": str(target), "ok": False,
                                "error": {"code": "not_found", "message": str(exc)}})
                worst = max(worst, EXIT_NOT_FOUND)
            except (InvalidJobStateError, ConfigurationError) as exc:
                results.append({"id": str(target), "ok": False,
                                "error": {"code": "invalid_state", "message": str(exc)}})
                worst = max(worst, EXIT_REFUSED)
            except DatabaseError as exc:
                # This job's update failed in the database (an outage, a trigger, a lock
                # timeout): said for this job, and the jobs already done are still listed.
                results.append({"id": str(target), "ok": False,
                                "error": {"code": "database_error",
                                          "message": database_error_text(exc)}})
                worst = max(worst, EXIT_ERROR)
        ok = sum(1 for r in results if r["ok"])
        lines = [f"{r['id']}: {r['status']}" if r["ok"] else
                 f"{r['id']}: refused ({r['error']['message']})" for r in results]
        lines.append(f"{ok} of {len(results)} job(s) {options['action']} done.")
        self.emit(options, {"results": results, "ok": ok, "refused": len(results) - ok},
                  "\n".join(lines))
        return worst

    def do_retry(self, options: dict[str, Any]) -> int:
        return self._act(
            options, lambda job_id: services.retry_job(job_id, options["mode"], actor="cli"))

    def do_cancel(self, options: dict[str, Any]) -> int:
        return self._act(options, lambda job_id: services.cancel_job(job_id, actor="cli"))

    def do_stats(self, options: dict[str, Any]) -> int:
        from django_persistent_jobs.stats import (
            WINDOW_MAX_SECONDS,
            WINDOW_MIN_SECONDS,
            dashboard_stats,
        )

        if not WINDOW_MIN_SECONDS <= options["window"] <= WINDOW_MAX_SECONDS:
            raise CommandError(f"--window must be {WINDOW_MIN_SECONDS}..{WINDOW_MAX_SECONDS} "
                               "seconds.", returncode=EXIT_USAGE)
        problem = bounds.tenant_problem(options["tenant"], "--tenant")
        if problem is not None:
            raise CommandError(problem, returncode=EXIT_USAGE)
        data = dashboard_stats(window=timedelta(seconds=options["window"]),
                               tenant=options["tenant"]).to_dict()
        self.emit(options, data, "\n".join(_stats_text(data)))
        return EXIT_OK

    def do_prune(self, options: dict[str, Any]) -> int:
        deleted = services.prune_finished()
        self.emit(options, {"deleted": deleted},
                  f"Deleted {deleted} finished job(s) older than their retention.")
        return EXIT_OK


#: At most this many stuck jobs and failure groups in the text of ``jobs stats``.
STATS_TEXT_ROWS = 20


def _stats_text(data: dict[str, Any]) -> list[str]:
    """``jobs stats`` for a person: the answers an operator looks for first (what is waiting
    or failing, is anything stuck, who runs it), one line each; the hourly and daily series and
    every other field are in ``--json``."""
    def seconds(value: Any) -> str:
        return "-" if value is None else f"{float(value):.0f}s"

    window_h = float(data["window"]) / 3600
    head = f"as of {data['now']}, failures over the last {window_h:g} h"
    lines = [head + (f", tenant {data['tenant']}" if data.get("tenant") else "")]
    counts = data["status_counts"]
    lines.append("jobs: " + ", ".join(f"{status} {counts.get(status, 0)}"
                                      for status in JobStatus.values))
    quiet = [q["queue"] for q in data["queues"] if not (q["waiting"] or q["running"])]
    for queue in data["queues"]:
        if queue["queue"] in quiet:
            continue
        lines.append(f"queue {queue['queue']}: {queue['waiting']} waiting ({queue['due']} due, "
                     f"oldest due for {seconds(queue['oldest_due_wait'])}), "
                     f"{queue['running']} running, "
                     + (f"served by {len(queue['runners'])} runner(s)" if queue["served"]
                        else "NOT served by any live runner"))
    if quiet:
        lines.append(f"queues with nothing waiting or running: {', '.join(quiet)}")
    runners = data["runners"]
    if not runners:
        lines.append("runners: none")
    for runner in runners:
        lines.append(f"runner {runner['id']}: {runner['state']}, heartbeat "
                     f"{seconds(runner['heartbeat_age'])} ago, {runner['jobs_held']} job(s) held")
    stuck = data["stuck"]
    kinds = ", ".join(f"{kind} {n}" for kind, n in data["stuck_counts"].items() if n)
    lines.append(f"stuck: {data['stuck_total']}" + (f" ({kinds})" if kinds else ""))
    for job in stuck[:STATS_TEXT_ROWS]:
        lines.append(f"  {job['id']} {job['job_type']} {job['status']}: {job['detail']}")
    if len(stuck) > STATS_TEXT_ROWS:
        lines.append(f"  ... and {len(stuck) - STATS_TEXT_ROWS} more (--json)")
    groups = data["failure_groups"]
    lines.append(f"failures: {len(groups)} group(s) by job type and error code")
    for group in groups[:STATS_TEXT_ROWS]:
        message = " ".join(str(group.get("last_message") or "").split())[:160]
        lines.append(f"  {group['job_type']} {group['error_code']}: {group['attempts']} "
                     f"attempt(s) of {group['jobs']} job(s), {group['dead_letters']} dead-"
                     f"lettered, last {group['last_seen']}: {message}")
    if len(groups) > STATS_TEXT_ROWS:
        lines.append(f"  ... and {len(groups) - STATS_TEXT_ROWS} more (--json)")
    lines.append("(--json for the hourly and daily series, job types and tenants)")
    return lines

