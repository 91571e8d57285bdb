"""``python manage.py demo``: enqueue the example jobs, run ``runjobs`` until they settle, report.

It starts the real ``manage.py runjobs`` as a child process (what you would run in production),
waits until every demo job is in a terminal state, stops the runner with SIGTERM (a graceful
shutdown) and prints what happened to each job.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction
from django.utils import timezone

from django_persistent_jobs import enqueue, run_schedule_now
from django_persistent_jobs.models import JobAttempt, JobSchedule, JobStatus, PersistentJob
from example_project.demo.tasks import order_total

MANAGE = Path(__file__).resolve().parents[4] / "manage.py"


def _interrupt(signum: int, frame: Any) -> None:
    """SIGTERM stops ``--serve`` the way Ctrl-C does."""
    raise KeyboardInterrupt


class Command(BaseCommand):
    help = "Enqueue the example jobs, run the job runner until they settle, print a summary."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--timeout", type=float, default=60.0,
                            help="Give up if the jobs have not settled after this many seconds.")
        parser.add_argument("--serve", action="store_true",
                            help="Afterwards keep a runner and the admin (runserver) running "
                                 "until Ctrl-C, with a demo superuser, for a look around.")
        parser.add_argument("--port", type=int, default=8000,
                            help="Port for --serve (default 8000).")

    def handle(self, *args: Any, **options: Any) -> None:
        with transaction.atomic():  # enqueue joins the transaction: all or none
            jobs = [
                enqueue("demo.health_check", {"source": "demo"}),
                enqueue("demo.flaky", {"order_id": 42}),
                enqueue("demo.always_fails", {"customer_id": 7}),
            ]
            # A django.tasks task, through the durable backend: the same transaction, table
            # and runner as the jobs above.
            total = order_total.enqueue(42, [{"qty": 2, "price": 9.5}, {"qty": 1, "price": 3.0}])
        ids = [job.id for job in jobs] + [uuid.UUID(total.id)]
        self.stdout.write(f"Enqueued {len(ids)} jobs; starting `manage.py runjobs`...\n")
        runner = subprocess.Popen(
            # -v 2: a line per completed job too, which runjobs leaves out by default.
            [sys.executable, str(MANAGE), "runjobs", "--concurrency", "4", "-v", "2"],
            env=os.environ.copy()
        )
        try:
            # The runner syncs HealthCheckJob's cron schedule into the schedules table when it
            # starts; fire one run of it now rather than wait for the next minute boundary.
            schedule = self._wait_for_schedule(runner)
            scheduled = run_schedule_now(schedule.name)
            ids.append(scheduled.id)
            self.stdout.write(
                f"Schedule {schedule.name!r} ({schedule.cron}, {schedule.timezone}) is synced; "
                f"next tick {schedule.next_run_at:%H:%M:%S}; fired one run now.\n"
            )
            settled = self._wait(ids, options["timeout"], runner)
        finally:
            if runner.poll() is None:
                runner.send_signal(signal.SIGTERM)
                try:
                    runner.wait(30)
                except subprocess.TimeoutExpired:
                    runner.kill()
        self._report(ids)
        total.refresh()
        self.stdout.write(
            f"\ndjango.tasks: order_total.enqueue(42, ...) -> {total.status}, return value "
            f"{total.return_value if total.status == 'SUCCESSFUL' else '-'} "
            f"(get_result({total.id[:8]}...), {total.attempts} attempt(s))"
        )
        if not settled:
            raise CommandError(f"jobs did not settle within {options['timeout']}s")
        self.stdout.write(self.style.SUCCESS(
            f"\nDemo finished; runner exited with code {runner.returncode}."))
        if options["serve"]:
            self._serve(options["port"])
        else:
            self.stdout.write(self._admin_hint())

    def _python(self) -> str:
        """The interpreter running us (the venv's), as a path the user can paste."""
        relative = os.path.relpath(sys.executable)
        return relative if not relative.startswith("..") else sys.executable

    def _admin_hint(self) -> str:
        python = self._python()
        url = os.environ.get("DATABASE_URL", "")
        return (
            "\nLook at it in the admin (dashboard, failures, attempts, runners):\n"
            "  scripts/demo.sh --serve        # runner + admin, a demo superuser; Ctrl-C stops\n"
            "or by hand, from this directory:\n"
            f"  export DATABASE_URL={url} DJANGO_SETTINGS_MODULE=example_project.settings\n"
            f"  {python} manage.py createsuperuser\n"
            f"  {python} manage.py runjobs &    # a runner, so the dashboard shows one\n"
            f"  {python} manage.py runserver    # then open http://127.0.0.1:8000/admin/\n"
        )

    def _serve(self, port: int) -> None:
        """Keep a runner and the admin running for a look; Ctrl-C (or SIGTERM) stops both."""
        from django.contrib.auth import get_user_model

        password = os.environ.get("DEMO_ADMIN_PASSWORD") or secrets.token_urlsafe(9)
        users = get_user_model()
        admin = users.objects.filter(username="admin").first() or users(
            username="admin", email="admin@example.com")
        admin.is_staff = admin.is_superuser = True
        admin.set_password(password)
        admin.save()
        python = sys.executable
        procs = [
            subprocess.Popen([python, str(MANAGE), "runjobs", "--concurrency", "4"],
                             env=os.environ.copy()),
            subprocess.Popen([python, str(MANAGE), "runserver", f"127.0.0.1:{port}",
                              "--noreload"], env=os.environ.copy()),
        ]
        base = f"http://127.0.0.1:{port}/admin/"
        self.stdout.write(self.style.SUCCESS(
            f"\nA runner and the admin are running. Open {base} and log in as admin / "
            f"{password}\n  dashboard: {base}django_persistent_jobs/jobdashboard/\n"
            "Ctrl-C stops both."))
        signal.signal(signal.SIGTERM, _interrupt)
        interrupted = False
        try:
            while all(proc.poll() is None for proc in procs):
                time.sleep(0.5)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in procs:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        # Ctrl-C reaches the children too; only a real failure of one of them is an error.
        stopped_by_signal = (0, 130, -signal.SIGINT, -signal.SIGTERM)
        failed = [f"{name} exited with {proc.returncode}"
                  for name, proc in zip(("runjobs", "runserver"), procs, strict=True)
                  if proc.returncode not in stopped_by_signal]
        if failed and not interrupted:
            raise CommandError("; ".join(failed))
        self.stdout.write("Stopped the runner and the admin.")

    def _wait_for_schedule(self, runner: subprocess.Popen[bytes]) -> JobSchedule:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            schedule = JobSchedule.objects.filter(job_type="demo.health_check", active=True).first()
            # Synced, and any tick missed while no runner was up has been fired (coalesced).
            if schedule is not None and schedule.next_run_at is not None and (
                schedule.next_run_at > timezone.now()
            ):
                return schedule
            if runner.poll() is not None:
                raise CommandError(f"runjobs exited early with code {runner.returncode}")
            time.sleep(0.1)
        raise CommandError("the runner did not sync the demo.health_check schedule within 30s")

    def _wait(self, ids: list[Any], timeout: float, runner: subprocess.Popen[bytes]) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pending = PersistentJob.objects.filter(id__in=ids).exclude(
                status__in=JobStatus.terminal()
            ).count()
            if pending == 0:
                return True
            if runner.poll() is not None:
                raise CommandError(f"runjobs exited early with code {runner.returncode}")
            time.sleep(0.2)
        return False

    def _report(self, ids: list[Any]) -> None:
        header = ("job type", "status", "attempts", "error code", "attempt outcomes")
        self.stdout.write("\n" + "{:<31} {:<14} {:<9} {:<12} {}".format(*header))
        for job in PersistentJob.objects.filter(id__in=ids).order_by("id"):
            outcomes = ", ".join(
                f"{a.attempt}:{a.outcome}" for a in JobAttempt.objects.filter(job=job)
            )
            kind = "scheduled" if job.schedule else "one-shot"
            name = job.job_type
            if name == "demo.health_check":
                name = f"{name} ({kind})"
            elif name.startswith("example_project."):
                name = f"task {name.rsplit('.', 1)[-1]}"  # a django.tasks task (module path)
            self.stdout.write("{:<31} {:<14} {:<9} {:<12} {}".format(
                name, job.status, f"{job.attempts}/{job.max_retries + 1}",
                job.last_error_code or "-", outcomes))
