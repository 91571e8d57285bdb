"""Worker processes start however ``runjobs`` was started.

A worker is a fresh interpreter running this package's own entry point: it never imports the
caller's ``__main__``. A plain script that sets Django up and calls ``call_command("runjobs")``
at module level, without an ``if __name__ == "__main__"`` guard (how benchmark harnesses,
deployment scripts and embedding hosts start it), must drain jobs through its workers exactly
like ``manage.py runjobs``. The script below also puts the project on ``sys.path`` itself and
runs from another directory: a settings module importable in the supervisor only because of
its ``sys.path`` must be importable in the workers too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
from django.db import transaction

from django_persistent_jobs import Runner, enqueue_many
from django_persistent_jobs.models import JobAttempt, JobStatus, PersistentJob
from django_persistent_jobs.runner.supervisor import EXIT_LOOP_DIED
from django_persistent_jobs.runner.workers.manager import MAX_FAILED_STARTS, ProcessExecutor
from tests.core_support import ROOT, subprocess_env
from tests.testapp.models import LedgerEntry

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

# No main guard, on purpose: a worker that imported this module would run ``runjobs`` again.
SCRIPT = textwrap.dedent("""\
    import os
    import sys

    sys.path.insert(0, {root!r})
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    import django

    django.setup()
    {after_setup}
    from django.core.management import call_command

    call_command("runjobs", *sys.argv[1:])
""")


def run_script(
    tmp_path: Path, *args: str, after_setup: str = "",
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "start_runner.py"
    script.write_text(SCRIPT.format(root=str(ROOT), after_setup=after_setup))
    env = subprocess_env()
    env.pop("PYTHONPATH", None)  # only the script's own sys.path finds the project
    env["PJ_TEST_LOG"] = "INFO"
    # Runs from a directory that is not the project, so the working directory finds nothing.
    return subprocess.run([sys.executable, str(script), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)


def test_a_script_without_a_main_guard_drains_jobs_through_worker_processes(
    tmp_path: Path,
) -> None:
    with transaction.atomic():
        jobs = enqueue_many([("test.ledger", {"n": i}) for i in range(20)])
    done = run_script(tmp_path, "--burst", "--processes", "1", "--concurrency", "2")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "bootstrapping phase" not in output
    # One worker, started once: a worker that failed to start would have been replaced.
    assert output.count("worker 1 started") == 1 and "worker 2 started" not in output, output
    assert "died" not in output, output
    ids = [job.id for job in jobs]
    assert PersistentJob.objects.filter(id__in=ids, status=JobStatus.COMPLETED).count() == 20
    assert LedgerEntry.objects.filter(job_id__in=ids).count() == 20
    assert set(JobAttempt.objects.filter(job_id__in=ids).values_list("outcome", flat=True)) == {
        "completed"}


def test_a_worker_that_cannot_set_django_up_fails_the_runner_instead_of_restarting_forever(
    tmp_path: Path,
) -> None:
    """The supervisor's settings loaded; a fresh interpreter's cannot (here the environment the
    workers inherit breaks them). ``runjobs`` exits non-zero at once, saying why, rather than
    starting one dying worker after another."""
    with transaction.atomic():
        jobs = enqueue_many([("test.ledger", {"n": 1})])
    done = run_script(tmp_path, "--burst", "--processes", "2",
                      after_setup='os.environ["PJ_TEST_SETTINGS"] = "not json"')
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "JSONDecodeError" in output, output  # the worker's own traceback
    assert "before it was ready" in output, output
    assert "worker 3 started" not in output, output  # no replacement was started
    assert PersistentJob.objects.get(id=jobs[0].id).status == JobStatus.PENDING


def test_a_worker_whose_code_differs_from_its_supervisor_s_exits_and_stops_the_runner(
    tmp_path: Path,
) -> None:
    """A deploy changed the package on disk while ``runjobs`` ran: a worker started from it
    packs jobs differently from its supervisor. It says so and exits before it is ready, and
    ``runjobs`` exits non-zero instead of handing it jobs it would read into the wrong fields.
    (Here the supervisor announces an older layout, one field short.)"""
    with transaction.atomic():
        jobs = enqueue_many([("test.ledger", {"n": 1})])
    older = ("from django_persistent_jobs.runner.workers import protocol; "
             "real = protocol.codec_signature(); "
             "protocol.codec_signature = lambda: real.rsplit(',', 1)[0]")
    done = run_script(tmp_path, "--burst", "--processes", "1", after_setup=older)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "its code differs from its supervisor's" in output, output
    assert "Restart runjobs" in output, output
    assert "before it was ready" in output, output
    assert PersistentJob.objects.get(id=jobs[0].id).status == JobStatus.PENDING


def test_replacement_workers_that_keep_dying_before_ready_stop_the_runner(
    start_runner: Callable[..., Runner], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After start-up, a worker is killed and its environment now breaks every fresh
    interpreter: after a few replacements that die before they are ready, the runner stops
    loudly (non-zero exit code) instead of starting processes forever."""
    runner = start_runner(processes=1, concurrency=1, liveness_sidecar=False)
    executor = runner.pool
    assert isinstance(executor, ProcessExecutor)
    [worker] = executor.workers
    monkeypatch.setenv("PJ_TEST_SETTINGS", "not json")  # inherited by the replacements only
    os.kill(worker.process.pid, signal.SIGKILL)
    assert runner.finished.wait(60), "the runner kept starting workers"
    assert runner.exit_code == EXIT_LOOP_DIED
    assert executor._numbers == 1 + MAX_FAILED_STARTS
    assert executor.workers == []
