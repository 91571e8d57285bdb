"""Fixtures for the fault-injection suite: runner processes, the ledger, a private PostgreSQL."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .harness import Fleet, PrivateCluster, create_ledger, migrate


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Iterator[None]:
    """Remember each phase's outcome so the fleet can print runner logs when a scenario fails."""
    outcome = yield
    setattr(item, f"rep_{call.when}", outcome.get_result())  # type: ignore[attr-defined]


@pytest.fixture
def ledger(db: Any) -> None:
    create_ledger()


@pytest.fixture
def fleet(request: pytest.FixtureRequest, ledger: None) -> Iterator[Fleet]:
    """Runner processes for one scenario; on failure their logs are printed (and kept on disk)."""
    log_dir = Path(tempfile.mkdtemp(prefix=f"pj-faults-{request.node.name[:40]}-"))
    fleet = Fleet(log_dir)
    yield fleet
    fleet.close()
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        print(f"\nrunner logs (full logs in {log_dir}):\n{fleet.logs()}")


@pytest.fixture(scope="module")
def private_cluster() -> Iterator[PrivateCluster]:
    """A PostgreSQL of our own, migrated, that scenarios may restart or stop."""
    try:
        cluster = PrivateCluster()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    try:
        cluster.init()
        cluster.start()
        cluster.execute("CREATE DATABASE pj_faults")
        migrate(cluster.url("pj_faults"))
        yield cluster
    finally:
        cluster.destroy()
