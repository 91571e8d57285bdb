"""``python manage.py jobs``, end to end against the test database: output (human and
``--json``), effects in the database, and the documented exit codes.

Each call goes through the command line's own path (``run_from_argv``: argument parsing, the
``CommandError`` to exit-code mapping, the output streams), in this process: a subprocess per
call cost a Django start-up each, most of this module's time. One test runs the real
``manage.py jobs`` in subprocesses, so the process boundary stays covered.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from contextlib import redirect_stderr, redirect_stdout
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import load_command_class
from django.test import override_settings
from django.utils import timezone

from django_persistent_jobs.models import JobAttempt, PersistentJob
from tests.api_support import stage
from tests.core_support import ROOT, run_without_database, subprocess_env

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]


def jobs(*args: str) -> tuple[int, str, str]:
    """``manage.py jobs ARGS`` as the command line runs it: (exit code, stdout, stderr)."""
    out, err = StringIO(), StringIO()
    code = 0
    with redirect_stdout(out), redirect_stderr(err):
        command = load_command_class("django_persistent_jobs", "jobs")
        try:
            command.run_from_argv(["manage.py", "jobs", *args])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return code, out.getvalue(), err.getvalue()


def jobs_process(*args: str) -> tuple[int, str, str]:
    """The real ``manage.py jobs ARGS``, in a subprocess."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), "jobs", *args], cwd=ROOT,
        env=subprocess_env(), capture_output=True, text=True, timeout=60,
    )
    return proc.returncode, proc.stdout, proc.stderr


def jobs_json(*args: str, expect: int = 0) -> Any:
    code, out, err = jobs(*args, "--json")
    assert code == expect, (code, out, err)
    return json.loads(out)


def test_list_with_filters_pages_and_json():
    a = stage(queue="mail", status="dead_lettered", error_code="SMTP")
    b = stage(queue="mail")
    c = stage(queue="other", tenant="acme")
    data = jobs_json("list")
    assert [j["id"] for j in data["results"]] == [str(c.id), str(b.id), str(a.id)]
    assert data["next_cursor"] is None
    assert [j["id"] for j in jobs_json("list", "--queue", "mail", "--status",
                                       "dead_lettered")["results"]] == [str(a.id)]
    assert [j["id"] for j in jobs_json("list", "--tenant", "acme")["results"]] == [str(c.id)]
    assert [j["id"] for j in jobs_json("list", "--error-code", "SMTP")["results"]] == [str(a.id)]
    first = jobs_json("list", "--limit", "2")
    rest = jobs_json("list", "--limit", "2", "--cursor", first["next_cursor"])
    assert [j["id"] for j in first["results"] + rest["results"]] == [str(c.id), str(b.id),
                                                                    str(a.id)]
    code, out, _ = jobs("list", "--queue", "mail")
    assert code == 0 and str(a.id) in out and "dead_lettered" in out and "SMTP" in out


def test_show_human_and_json_and_not_found():
    job = stage(payload={"to": "x@example.com"})
    data = jobs_json("show", str(job.id))
    assert data["id"] == str(job.id) and data["payload"] == {"to": "x@example.com"}
    assert data["attempt_history"] == []
    code, out, _ = jobs("show", str(job.id))
    assert code == 0 and "x@example.com" in out
    code, _, err = jobs("show", str(uuid.uuid4()))
    assert code == 3 and "No job" in err
    assert jobs("show", "nonsense")[0] == 3


def test_retry_by_id_modes_and_refusal():
    dead = stage(status="dead_lettered", attempts=4, max_retries=3, error_code="X")
    data = jobs_json("retry", str(dead.id), "--mode", "reset")
    assert data == {"results": [{"id": str(dead.id), "ok": True, "status": "pending"}],
                    "ok": 1, "refused": 0}
    dead.refresh_from_db()
    assert (dead.status, dead.attempts) == ("pending", 0)
    done = stage(status="completed")
    data = jobs_json("retry", str(done.id), expect=4)
    assert data["results"][0]["ok"] is False and data["refused"] == 1
    assert jobs("retry", str(uuid.uuid4()))[0] == 3


def test_retry_by_filter_touches_only_matching_failed_jobs():
    dl = [stage(job_type="test.ledger", status="dead_lettered", error_code="SMTP")
          for _ in range(3)]
    other_code = stage(job_type="test.ledger", status="dead_lettered", error_code="DNS")
    completed = stage(job_type="test.ledger", status="completed", error_code="SMTP")
    dry = jobs_json("retry", "--job-type", "test.ledger", "--error-code", "SMTP", "--dry-run")
    assert set(dry["matched"]) == {str(j.id) for j in dl}
    assert PersistentJob.objects.filter(status="pending").count() == 0
    data = jobs_json("retry", "--job-type", "test.ledger", "--error-code", "SMTP")
    assert data["ok"] == 3 and data["refused"] == 0
    assert set(PersistentJob.objects.filter(status="pending").values_list("id", flat=True)) == {
        j.id for j in dl}
    other_code.refresh_from_db()
    completed.refresh_from_db()
    assert other_code.status == "dead_lettered" and completed.status == "completed"


def test_cancel_by_id_and_by_filter():
    one = stage()
    data = jobs_json("cancel", str(one.id))
    assert data["results"][0]["status"] == "cancelled"
    waiting = [stage(queue="bulk") for _ in range(2)]
    code, out, _ = jobs("cancel", "--queue", "bulk")
    assert code == 0 and "2 of 2" in out
    assert all(PersistentJob.objects.get(pk=j.pk).status == "cancelled" for j in waiting)
    assert jobs("cancel", str(one.id))[0] == 4  # already cancelled


@pytest.mark.parametrize("args", [
    ["retry"],  # neither ids nor filters: would mean "everything"
    ["retry", str(uuid.uuid4()), "--status", "failed"],
    ["list", "--status", "bogus"],
    ["list", "--created-after", "tomorrow"],
    ["list", "--limit", "0"],
    ["frobnicate"],
    ["retry", str(uuid.uuid4()), "--mode", "sometime"],
    # A filter that names nothing would match every job.
    ["cancel", "--queue", ","],
    ["list", "--tenant", " , "],
    # An empty date (``--created-after "$SINCE"`` with the variable unset) is no date: ignoring
    # it would cancel every job of the type, whenever created.
    ["cancel", "--job-type", "test.noop", "--created-after", ""],
    ["list", "--created-before", ""],
    # Not UTF-8 on the command line (a lone surrogate in Python): refused, not a traceback.
    ["stats", "--tenant", "\udcff"],
    ["list", "--tenant", "\udcff"],
])
def test_usage_errors_exit_2(args: list[str]):
    waiting = stage()
    code, _, err = jobs(*args)
    assert code == 2, err
    assert err.strip() and "Traceback" not in err
    assert PersistentJob.objects.get(pk=waiting.pk).status == "pending"


def test_invalid_settings_past_skip_checks_are_one_line_and_exit_1():
    """``--skip-checks`` lets the command start with settings the checks would refuse; the
    setting's own message then ends it, as ``runjobs`` does, rather than a traceback."""
    stage(status="completed", finished_at=timezone.now() - timedelta(days=30))
    with override_settings(PERSISTENT_JOBS={"RETENTION": {"completed": -5}}):
        code, out, err = jobs("--skip-checks", "prune")
    assert code == 1, (out, err)
    assert err.startswith("CommandError: ") and "RETENTION" in err, err
    assert "Traceback" not in err and not out
    assert PersistentJob.objects.count() == 1


def test_prune_deletes_expired_finished_jobs_now():
    old = stage(status="completed", finished_at=timezone.now() - timedelta(days=30))
    recent = stage(status="completed", finished_at=timezone.now())
    dead = stage(status="dead_lettered", finished_at=timezone.now() - timedelta(days=30))
    data = jobs_json("prune")
    assert data == {"deleted": 1}
    assert not PersistentJob.objects.filter(pk=old.pk).exists()
    assert PersistentJob.objects.filter(pk__in=[recent.pk, dead.pk]).count() == 2


def test_stats_json_and_human():
    stage(status="dead_lettered", error_code="SMTP", tenant="acme")
    stage(tenant="globex")
    data = jobs_json("stats")
    assert data["status_counts"]["dead_lettered"] == 1 and data["status_counts"]["pending"] == 1
    assert jobs_json("stats", "--tenant", "globex")["status_counts"]["dead_lettered"] == 0
    code, out, _ = jobs("stats")
    # For a person: the counts, the failure groups and the stuck list, one line each, not a
    # dump of every field (the hourly series alone is a line of kilobytes).
    assert code == 0 and "jobs: pending 1, running 0, completed 0, failed 0" in out, out
    assert "failures: 0 group(s)" in out, out  # (groups are read from attempts)
    assert "stuck: " in out and "runners: none" in out and '"hourly"' not in out
    assert max(len(line) for line in out.splitlines()) < 400
    assert jobs("stats", "--window", "5")[0] == 2


@pytest.mark.parametrize("action", [["list"], ["prune"]])
def test_a_database_it_cannot_reach_is_one_line_and_exit_1(action: list[str]) -> None:
    """Every action answers at once, ``prune`` too: it shares the runner's cleanup, whose loop
    waits out an outage, and a cron job or a shell must get its error instead of waiting."""
    done = run_without_database("manage.py", "jobs", *action)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("CommandError: database error: ") and "port 1" in done.stderr


def test_the_real_command_line_in_subprocesses():
    job = stage(queue="mail", status="dead_lettered", error_code="SMTP")
    code, out, err = jobs_process("list", "--queue", "mail", "--json")
    assert code == 0, err
    assert [j["id"] for j in json.loads(out)["results"]] == [str(job.id)]
    code, _, err = jobs_process("retry", str(job.id), "--mode", "reset")
    assert code == 0, err
    assert PersistentJob.objects.get(pk=job.pk).status == "pending"
    code, _, err = jobs_process("show", str(uuid.uuid4()))
    assert code == 3 and "No job" in err
    code, _, err = jobs_process("list", "--limit", "0")
    assert code == 2 and err.strip()


def test_a_database_error_on_one_job_is_reported_for_it_and_the_rest_still_listed():
    """One job's update fails in the database (a trigger refuses it; an outage or a lock
    timeout does the same): ``jobs retry`` lists it with the error and the others as done,
    and exits 1, rather than one "database error" line that hides what was applied."""
    from tests.core_support import refusing_updates

    frozen = stage(status="dead_lettered", attempts=4, max_retries=3, error_code="X")
    other = stage(status="dead_lettered", attempts=4, max_retries=3, error_code="X")
    with refusing_updates("pj_test_refuse_cli", "persistent_jobs", f"OLD.id = '{frozen.id}'",
                          "this job is frozen for an audit"):
        data = jobs_json("retry", str(frozen.id), str(other.id), expect=1)
    by_id = {result["id"]: result for result in data["results"]}
    assert by_id[str(other.id)] == {"id": str(other.id), "ok": True, "status": "pending"}
    assert by_id[str(frozen.id)]["ok"] is False
    assert by_id[str(frozen.id)]["error"]["code"] == "database_error"
    assert "frozen for an audit" in by_id[str(frozen.id)]["error"]["message"]
    assert (data["ok"], data["refused"]) == (1, 1)


def test_show_takes_the_short_id_the_admin_lists_and_says_what_failed() -> None:
    from django_persistent_jobs.admin.display import short_id

    job = stage(status="dead_lettered", attempts=1, error_code="SMTP")
    sibling = stage()  # enqueued together: the head of its id (a timestamp) is the same
    JobAttempt.objects.create(job_id=job.id, attempt=1, runner_id="r", outcome="dead_lettered",
                              error_code="SMTP", error_message="SMTPError: 550 mailbox full\nmore",
                              traceback="Traceback (most recent call last):\n  boom")
    short = short_id(job.id)  # what the admin's list shows
    code, out, err = jobs("show", short)
    assert code == 0, err
    assert str(job.id) in out and "    SMTPError: 550 mailbox full" in out
    assert "Traceback" not in out  # from -v 2 on
    assert "Traceback (most recent call last)" in jobs("-v", "2", "show", short)[1]
    # retry takes it too
    assert jobs_json("retry", short)["results"][0] == {"id": str(job.id), "ok": True,
                                                       "status": "pending"}
    # the head of an id works while it is unique; shared, it is refused naming the ids
    code, _, err = jobs("show", str(job.id)[:8])
    assert code == 2 and "several job ids" in err and str(sibling.id) in err
    assert jobs("show", str(job.id)[:23])[0] == 0
    assert jobs("show", short[:7])[0] == 3  # too short to look for


def test_a_database_that_was_never_migrated_is_named() -> None:
    from django.db import ProgrammingError

    from django_persistent_jobs.errors import database_error_text

    message = database_error_text(ProgrammingError(
        'relation "persistent_jobs" does not exist\nLINE 1: SELECT ...'))
    assert message.startswith("The persistent_jobs tables are missing; run `python manage.py "
                              "migrate` first")
