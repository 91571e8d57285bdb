"""A recurring ``@task``, imported only by the test that uses it (so no other test's runner
syncs its schedule)."""

from __future__ import annotations

from tests.testapp.tasks_compat import task


@task(cron="0 3 * * *", timezone="Europe/Paris", max_retries=0)
def nightly() -> str:
    return "tick"
