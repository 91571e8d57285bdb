"""The checks every fault scenario ends with, and the numbers it reports."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .sql import TERMINAL, sql, sql_value, status_counts


@dataclass
class Attempt:
    job_id: Any
    attempt: int
    runner_id: str
    outcome: str
    error_code: str


def attempts_of(ids: Sequence[Any]) -> list[Attempt]:
    rows = sql("SELECT job_id, attempt, runner_id, outcome, error_code FROM "
               "persistent_jobs_attempts WHERE job_id = ANY(%s) ORDER BY job_id, id", [list(ids)])
    return [Attempt(*row) for row in rows]


def ledger_of(job_id: Any) -> list[tuple[int, str]]:
    return [(a, r) for a, r in sql(
        "SELECT attempt, runner_id FROM faults_ledger WHERE job_id = %s ORDER BY id", [job_id])]


@dataclass
class Verdict:
    """What the end-of-scenario check found (for scenario-specific assertions and the report)."""

    statuses: Counter[str]
    outcomes: Counter[tuple[str, str]]
    ledger_rows: int
    attempts: list[Attempt] = field(repr=False)

    def by_job(self) -> dict[Any, list[Attempt]]:
        result: dict[Any, list[Attempt]] = {}
        for attempt in self.attempts:
            result.setdefault(attempt.job_id, []).append(attempt)
        return result


def verify(ids: Sequence[Any], *, require_completed: bool = True) -> Verdict:
    """The checks every scenario ends with.

    * every job is terminal (and, unless told otherwise, completed);
    * the ledger holds exactly one row per completed job and none for any other job, and that
      row was written by the attempt the job records as completed (same attempt, same runner);
    * ``JobAttempt`` rows add up: none left ``running``, every one finished, one ``completed``
      attempt per completed job, and as many charged attempts (everything but ``interrupted``
      hand-backs) as the job's ``attempts`` counter.
    """
    ids = list(ids)
    statuses = status_counts(ids)
    assert sum(statuses[s] for s in TERMINAL) == len(ids), f"not all terminal: {dict(statuses)}"
    if require_completed:
        assert statuses["completed"] == len(ids), f"not all completed: {dict(statuses)}"
    problems: list[str] = []
    duplicates = sql("SELECT job_id, count(*) FROM faults_ledger WHERE job_id = ANY(%s) "
                     "GROUP BY job_id HAVING count(*) > 1", [ids])
    if duplicates:
        problems.append(f"jobs committed more than once: {duplicates[:10]}")
    strays = sql("SELECT l.job_id, j.status FROM faults_ledger l JOIN persistent_jobs j "
                 "ON j.id = l.job_id WHERE l.job_id = ANY(%s) AND j.status <> 'completed'", [ids])
    if strays:
        problems.append(f"ledger rows for jobs that did not complete: {strays[:10]}")
    missing = sql("SELECT j.id FROM persistent_jobs j WHERE j.id = ANY(%s) AND "
                  "j.status = 'completed' AND NOT EXISTS (SELECT 1 FROM faults_ledger l "
                  "WHERE l.job_id = j.id)", [ids])
    if missing:
        problems.append(f"completed jobs without their ledger row: {missing[:10]}")
    mismatched = sql(
        "SELECT l.job_id, l.attempt, l.runner_id, a.attempt, a.runner_id FROM faults_ledger l "
        "JOIN persistent_jobs_attempts a ON a.job_id = l.job_id AND a.outcome = 'completed' "
        "WHERE l.job_id = ANY(%s) AND (a.attempt <> l.attempt OR a.runner_id <> l.runner_id)",
        [ids])
    if mismatched:
        problems.append(f"ledger rows written by an attempt that did not complete the job: "
                        f"{mismatched[:10]}")
    accounting = sql(
        """
        SELECT j.id, j.status, j.attempts,
               count(a.id) FILTER (WHERE a.outcome <> 'interrupted') AS charged,
               count(a.id) FILTER (WHERE a.outcome = 'completed') AS completed,
               count(a.id) FILTER (WHERE a.outcome = 'running' OR a.finished_at IS NULL) AS open
        FROM persistent_jobs j LEFT JOIN persistent_jobs_attempts a ON a.job_id = j.id
        WHERE j.id = ANY(%s) GROUP BY j.id
        HAVING j.attempts <> count(a.id) FILTER (WHERE a.outcome <> 'interrupted')
            OR count(a.id) FILTER (WHERE a.outcome = 'completed')
               <> (CASE WHEN j.status = 'completed' THEN 1 ELSE 0 END)
            OR count(a.id) FILTER (WHERE a.outcome = 'running' OR a.finished_at IS NULL) > 0
        """, [ids])
    if accounting:
        problems.append("attempt rows disagree with the jobs (id, status, attempts, charged, "
                        f"completed, open): {accounting[:10]}")
    assert not problems, "\n".join(problems)
    attempts = attempts_of(ids)
    ledger_rows = sql_value("SELECT count(*) FROM faults_ledger WHERE job_id = ANY(%s)", [ids])
    return Verdict(statuses=statuses,
                   outcomes=Counter((a.outcome, a.error_code) for a in attempts),
                   ledger_rows=ledger_rows, attempts=attempts)


def report(scenario: str, **numbers: Any) -> None:
    """Print a scenario's numbers; also append them to $PJ_FAULTS_REPORT (JSON lines) if set."""
    def plain(value: Any) -> Any:
        if isinstance(value, dict):
            return {"/".join(k) if isinstance(k, tuple) else str(k): plain(v)
                    for k, v in value.items()}
        return value

    line = json.dumps({"scenario": scenario, **{k: plain(v) for k, v in numbers.items()}},
                      default=str)
    print(line)
    path = os.environ.get("PJ_FAULTS_REPORT")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(line + "\n")
