#!/usr/bin/env python
"""How the cost of one claim grows while a backlog drains, and why (buffers the claim touches).

Usage::

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres python bench/claim_cost.py \
        [--jobs 40000] [--every 5000] [--hold-snapshot] [--from-head]

Claims and completes ``--jobs`` no-op jobs one at a time on one connection (the runner's own
statements, no handler, no Python job code), and every ``--every`` jobs prints the mean claim
time of the last stretch and the shared buffers one claim touched (EXPLAIN ANALYZE, BUFFERS,
rolled back). Nothing vacuums the table. With ``--hold-snapshot`` another connection holds a
REPEATABLE READ snapshot for the whole run. Claims go through ``store.ClaimScan`` as the runner's
do (resuming after the last claimed job); ``--from-head`` makes every claim a full scan from the
head of the claim order, as before that existed.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402

from bench.run import fill, recreate_database, setup_django  # noqa: E402
from bench.settings import BENCH_DB_NAME, DEFAULT_SERVER_URL, bench_database_url  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=40000)
    parser.add_argument("--every", type=int, default=5000)
    parser.add_argument("--hold-snapshot", action="store_true")
    parser.add_argument("--from-head", action="store_true")
    args = parser.parse_args(argv)
    server_url = os.environ.get("DATABASE_URL") or DEFAULT_SERVER_URL
    os.environ.pop("PJ_BENCH_DATABASE_URL", None)
    url = bench_database_url()
    recreate_database(server_url, BENCH_DB_NAME)
    setup_django(url)
    from django_persistent_jobs.runner import store

    holder = psycopg.connect(url)
    if args.hold_snapshot:
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT 1 FROM persistent_jobs LIMIT 1")
    fill(args.jobs, one_transaction=True, analyze_before_commit=True)
    scan = store.ClaimScan(rescan=0.0 if args.from_head else 0.25)
    print("jobs done | mean claim ms (last stretch) | buffers hit by one claim")
    with psycopg.connect(url, autocommit=True) as conn, conn.cursor() as cur:
        store.register_runner(cur, "diag", "bench", os.getpid(), None, 1, "bench")
        done, spent = 0, 0.0
        while done < args.jobs:
            started = time.perf_counter()
            jobs = scan.claim(cur, "diag", 1, None)
            spent += time.perf_counter() - started
            if not jobs:
                break
            store.complete(cur, jobs[0])
            done += 1
            if done % args.every == 0:
                params: dict[str, object] = {"runner": "diag", "direct": 1, "started": [],
                                             "started_at": []}
                resumed = scan.key is not None and not args.from_head
                statement = store.claim_sql(1, after=resumed)
                if resumed and scan.key is not None:
                    params.update(zip(("after_priority", "after_at", "after_id"), scan.key,
                                      strict=True))
                with conn.transaction(force_rollback=True):
                    cur.execute("EXPLAIN (ANALYZE, BUFFERS) " + statement, params)
                    plan = "\n".join(r[0] for r in cur.fetchall())
                hits = re.search(r"Buffers: shared hit=(\d+)", plan)
                print(f"{done:9d} | {spent * 1000 / args.every:8.3f} | "
                      f"{hits.group(1) if hits else '?'}", flush=True)
                spent = 0.0
        plans = cur.execute("SELECT generic_plans, custom_plans, left(statement, 40) "
                            "FROM pg_prepared_statements WHERE statement LIKE '%%SKIP LOCKED%%'")
        for generic, custom, text in plans.fetchall():
            print(f"prepared claim statement: {generic} generic plans, {custom} custom plans "
                  f"({text.strip()!r}...)")
    holder.close()
    recreate_database(server_url, BENCH_DB_NAME)
    return 0


if __name__ == "__main__":
    sys.exit(main())
