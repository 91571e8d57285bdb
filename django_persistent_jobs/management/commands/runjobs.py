"""``python manage.py runjobs``: a thin wrapper around ``Runner``."""

from __future__ import annotations

import logging
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_persistent_jobs import conf
from django_persistent_jobs.errors import ConfigurationError
from django_persistent_jobs.runner import Runner, heap
from django_persistent_jobs.runner.db import DatabaseUnreachable
from django_persistent_jobs.runner.execute import COMPLETIONS_LOGGER


class Command(BaseCommand):
    help = ("Run persistent jobs. SIGTERM/SIGINT stop claiming and let running jobs finish "
            "within the grace period; a second signal stops at once.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--processes", type=int,
            help="Worker processes that run the jobs, each with --concurrency threads; 0 runs "
                 "them on threads of this process (default: PROCESSES setting, else "
                 f"{conf.RUNJOBS_DEFAULT_PROCESSES}).")
        parser.add_argument("--concurrency", type=int,
                            help="Jobs run at once (per worker process; default: setting).")
        parser.add_argument("--queues", help="Comma-separated queues to serve (default: all).")
        parser.add_argument("--burst", action="store_true",
                            help="Process every job that is due, then exit 0.")
        parser.add_argument("--poll-interval", type=float,
                            help="Seconds between polls when no NOTIFY arrives.")
        parser.add_argument("--grace", type=float, help="Shutdown grace period in seconds.")
        parser.add_argument("--no-scheduler", action="store_true",
                            help="Do not run the recurring-job scheduler in this process.")
        parser.add_argument("--name",
                            help="A name for this runner, shown in the runners table and the "
                                 "logs (default: host:pid). The runner's identity is the name "
                                 "plus a random suffix, so several runners may share a name.")
        parser.add_argument("--database-wait", type=float, metavar="SECONDS",
                            help="Give up (exit 1) if the database stays unreachable this long "
                                 "at start-up (default: 30 with --burst, forever otherwise).")
        parser.add_argument("--metrics-port", type=int,
                            help="Serve Prometheus metrics on this port (needs the 'metrics' "
                                 "extra); see docs/metrics.md.")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["concurrency"] is not None and options["concurrency"] < 1:
            raise CommandError("--concurrency must be at least 1.")
        if options["processes"] is not None and options["processes"] < 0:
            raise CommandError("--processes must be 0 or more.")
        processes = options["processes"]
        if options["poll_interval"] is not None and options["poll_interval"] <= 0:
            raise CommandError("--poll-interval must be greater than 0.")
        if options["poll_interval"] is not None and options[
                "poll_interval"] < conf.MIN_LOOP_INTERVAL:
            raise CommandError(f"--poll-interval must be at least {conf.MIN_LOOP_INTERVAL:g} "
                               "seconds (a shorter one makes an idle runner busy-loop).")
        if options["database_wait"] is not None and not options["database_wait"] >= 0:
            raise CommandError("--database-wait must be a number of seconds, 0 or more.")
        queues = None
        if options["queues"] is not None:  # ``--queues ""`` (an unset variable) is no "all"
            queues = [q.strip() for q in options["queues"].split(",") if q.strip()]
            if not queues:
                raise CommandError("--queues needs at least one queue name.")
        package_logger = logging.getLogger("django_persistent_jobs")
        package_logger.setLevel(
            logging.DEBUG if options["verbosity"] >= 3 else logging.INFO
            if options["verbosity"] >= 1 else logging.WARNING
        )
        # A line per completed job from -v 2 on: at thousands of jobs a second it costs a fifth
        # of the rate, and the database keeps every attempt anyway.
        logging.getLogger(COMPLETIONS_LOGGER).setLevel(
            logging.NOTSET if options["verbosity"] >= 2 else logging.WARNING)
        if not package_logger.hasHandlers():
            # No LOGGING configured for us: a silent runner is worse than a plain one.
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter(
                "%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
            package_logger.addHandler(handler)
        if options["metrics_port"] is not None:
            from django_persistent_jobs.metrics import serve_for_command

            serve_for_command(options["metrics_port"])
        try:
            if processes is None:
                configured = conf.settings.PROCESSES  # checked: ConfigurationError if invalid
                processes = conf.RUNJOBS_DEFAULT_PROCESSES if configured is None else configured
            runner = Runner(
                concurrency=options["concurrency"], queues=queues,
                poll_interval=options["poll_interval"], burst=options["burst"],
                shutdown_grace=options["grace"], scheduler=not options["no_scheduler"],
                processes=processes,
                name=options["name"], database_wait=options["database_wait"],
            )
            with heap.settled():  # this process only runs jobs now: see ``runner.heap``
                code = runner.run(install_signal_handlers=True)
        except (ConfigurationError, DatabaseUnreachable) as exc:
            raise CommandError(str(exc)) from exc
        if code:
            sys.exit(code)
