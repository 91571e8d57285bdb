"""A runner's name is a label; its identity is unique per process (real runner threads)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from django_persistent_jobs.errors import ConfigurationError
from django_persistent_jobs.models import JobRunnerRecord
from django_persistent_jobs.runner import Runner

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(60)]


def test_a_named_runner_gets_a_unique_id_and_keeps_its_name(
    start_runner: Callable[..., Runner],
) -> None:
    first = start_runner(name="billing", scheduler=False)
    second = start_runner(name="billing", scheduler=False)
    assert first.runner_id.startswith("billing:") and second.runner_id.startswith("billing:")
    assert first.runner_id != second.runner_id
    rows = dict(JobRunnerRecord.objects.filter(id__in=[first.runner_id, second.runner_id])
                .values_list("id", "name"))
    assert rows == {first.runner_id: "billing", second.runner_id: "billing"}


def test_the_default_name_is_host_and_pid(start_runner: Callable[..., Runner]) -> None:
    runner = start_runner(scheduler=False)
    record = JobRunnerRecord.objects.get(id=runner.runner_id)
    assert record.name == f"{record.hostname}:{record.pid}"
    assert runner.runner_id.startswith(record.name + ":")


@pytest.mark.parametrize("name", ["", "   ", "x" * 181, "tab\there"])
def test_an_unusable_name_is_refused(name: str) -> None:
    with pytest.raises(ConfigurationError, match="runner name"):
        Runner(name=name)


def test_database_wait_must_not_be_negative() -> None:
    with pytest.raises(ConfigurationError, match="database_wait"):
        Runner(database_wait=-1)


@pytest.mark.parametrize("poll_interval", [0, 1e-6, 0.009])
def test_poll_interval_has_the_settings_minimum(poll_interval: float) -> None:
    """As ``POLL_INTERVAL``: a tinier one makes an idle runner busy-loop."""
    with pytest.raises(ConfigurationError, match=r"poll_interval must be .*>= 0\.01"):
        Runner(poll_interval=poll_interval)
    assert Runner(poll_interval=0.01).settings.poll_interval == 0.01
