"""A scripted operator in a real headless Chromium answers the five questions from the admin.

The database is staged the way production goes wrong: a ``runjobs`` process SIGKILLed while it
ran two jobs (one of them hung past its timeout), dead letters of three job types produced by a
real runner, and a job on a queue no runner serves. Starting from the admin index, each
question (what failed, why, how often, is it stuck, who owns it) must be answered in at most
three page loads, and the test asserts what the pages show. Screenshots of the dashboard and a
job page go to a temporary directory (printed), for the docs.

Needs Debian's ``chromium`` and ``chromium-driver``; without them the test is skipped, except
in CI (``CI=true``), where it fails instead: CI installs them. ``PJ_CHROMIUM`` and
``PJ_CHROMEDRIVER`` give other paths.
"""

from __future__ import annotations

import base64
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client

from django_persistent_jobs import enqueue
from django_persistent_jobs.models import JobRunnerRecord, JobStatus, PersistentJob
from tests.core_support import db_now, wait_for

# PJ_CHROMIUM / PJ_CHROMEDRIVER point elsewhere (other distributions install them elsewhere).
CHROMIUM = os.environ.get("PJ_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = (os.environ.get("PJ_CHROMEDRIVER") or shutil.which("chromedriver")
                or "/usr/bin/chromedriver")
MAX_LOADS = 3

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(240)]

Spawn = Callable[..., "subprocess.Popen[bytes]"]


def _browser_missing() -> str | None:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]')"
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.path.exists(path):
            return f"{path} is missing (apt-get install chromium chromium-driver)"
    return None


@pytest.fixture
def browser() -> Iterator[Any]:
    missing = _browser_missing()
    if missing:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"browser tests must run in CI: {missing}")
        pytest.skip(f"browser tests need a local Chromium: {missing}")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,900", "--hide-scrollbars"):
        options.add_argument(arg)
    os.environ.setdefault("SE_OFFLINE", "true")  # never let Selenium Manager download anything
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


class Operator:
    """Drives the browser and counts page loads per question."""

    def __init__(self, driver: Any, base_url: str, shots: Path) -> None:
        self.driver = driver
        self.base = base_url
        self.shots = shots
        self.loads = 0
        self.question = ""
        self.timings: dict[str, float] = {}
        self._started = 0.0

    def start(self, question: str) -> None:
        """Every question starts at the admin index; loads are counted from there."""
        self.question = question
        self.driver.get(self.base + "/admin/")
        assert "Site administration" in self.driver.title, self.driver.title
        self.loads = 0
        self._started = time.monotonic()

    def follow(self, link: Any) -> None:
        """Click a link and wait for the next page (one page load)."""
        old = self.driver.find_element("tag name", "html")
        link.click()
        wait_for(lambda: _stale(old), timeout=30, message="the next page")
        wait_for(lambda: self.driver.execute_script("return document.readyState") == "complete",
                 timeout=30, message="the page to load")
        self.loads += 1
        assert self.loads <= MAX_LOADS, f"{self.question}: more than {MAX_LOADS} page loads"

    def link(self, text: str) -> Any:
        return self.driver.find_element("link text", text)

    def css(self, selector: str) -> Any:
        return self.driver.find_element("css selector", selector)

    def all(self, selector: str) -> list[Any]:
        return list(self.driver.find_elements("css selector", selector))

    def text(self) -> str:
        return str(self.driver.find_element("tag name", "body").text)

    def done(self) -> None:
        self.timings[self.question] = time.monotonic() - self._started
        print(f"  {self.question}: {self.loads} page load(s), "
              f"{self.timings[self.question]:.2f}s")

    def screenshot(self, name: str) -> Path:
        """A full-page screenshot of the 1280 px wide page: the DevTools protocol makes the
        viewport as tall as the page for the capture."""
        height = min(int(self.driver.execute_script(
            "return document.documentElement.scrollHeight")), 8000)
        self.driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
            "width": 1280, "height": height, "deviceScaleFactor": 1, "mobile": False})
        try:
            shot = self.driver.execute_cdp_cmd("Page.captureScreenshot", {"format": "png"})
        finally:
            self.driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
        path = self.shots / f"{name}.png"
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    def no_sideways_scroll(self) -> None:
        """Neither the page nor any box in it (the admin wraps tables in scrolling boxes)
        is wider than the 1280 px window."""
        overflow = self.driver.execute_script("""
            let worst = document.documentElement.scrollWidth
                - document.documentElement.clientWidth;
            for (const el of document.querySelectorAll('#content *')) {
                const style = getComputedStyle(el);
                if (['auto', 'scroll'].includes(style.overflowX) && el.clientWidth > 0)
                    worst = Math.max(worst, el.scrollWidth - el.clientWidth);
            }
            return worst;""")
        if overflow > 0:
            shot = self.screenshot("overflow")
            raise AssertionError(
                f"{self.driver.current_url} scrolls sideways by {overflow}px (see {shot})")


def _stale(element: Any) -> bool:
    from selenium.common.exceptions import StaleElementReferenceException

    try:
        element.is_enabled()
    except StaleElementReferenceException:
        return True
    return False


def stage(spawn_runner: Spawn) -> dict[str, Any]:
    """Build the broken production the operator must diagnose; return what to look for."""
    # 1. A runner killed mid-job: it claims a hung transcode (timeout 4 s) and a long reindex.
    hung = enqueue("media.transcode", {"video": 991, "api_token": "tok-SECRET"}, tenant="acme")
    reindex = enqueue("search.reindex", {"index": "products"}, tenant="globex")
    doomed = spawn_runner("--queues", "media,search", "--concurrency", "2")
    wait_for(lambda: PersistentJob.objects.filter(
        id__in=[hung.id, reindex.id], status=JobStatus.RUNNING, progress__isnull=False,
    ).count() == 2, timeout=60, message="the doomed runner to run both jobs")
    killed_runner = PersistentJob.objects.get(id=hung.id).locked_by
    doomed.send_signal(signal.SIGKILL)
    doomed.wait(10)

    # 2. A live runner (that will not reap the dead one during the test) makes dead letters of
    #    three job types. Its long stale timeout keeps the killed runner's jobs where they are.
    failing = [
        enqueue("billing.charge_card", {"invoice": "INV-1", "card_token": "x"}, tenant="acme"),
        enqueue("billing.charge_card", {"invoice": "INV-2"}, tenant="acme"),
        enqueue("emails.send_receipt", {"to": "a@example.com"}, tenant="globex"),
        enqueue("reports.render_pdf", {"pages": None}, tenant="initech"),
    ]
    live = spawn_runner("--queues", "default,billing,emails,reports", "--concurrency", "2",
                        env={"PJ_TEST_SETTINGS": '{"STALE_LOCK_TIMEOUT": 600, '
                                                 '"HEARTBEAT_INTERVAL": 0.5}'})
    wait_for(lambda: PersistentJob.objects.filter(
        id__in=[j.id for j in failing], status=JobStatus.DEAD_LETTERED).count() == len(failing),
        timeout=60, message="four dead letters")

    # 3. A job on a queue no runner serves, due for ten minutes already.
    unserved = enqueue("exports.nightly", {"day": "2026-11-22"},
                                   run_at=db_now() - timedelta(minutes=10), tenant="initech")

    # The killed runner's heartbeat must be stale (3 s in the test settings) and the hung job
    # past its 4 s timeout, by the database clock.
    def broken_enough() -> bool:
        job = PersistentJob.objects.get(id=hung.id)
        runner = JobRunnerRecord.objects.get(id=killed_runner)
        now = db_now()
        return (job.locked_at is not None and now - job.locked_at > timedelta(seconds=5)
                and now - runner.heartbeat_at > timedelta(seconds=4))

    wait_for(broken_enough, timeout=30, message="the killed runner to look dead")
    return {"hung": hung, "reindex": reindex, "killed_runner": killed_runner,
            "unserved": unserved, "card": failing[0], "live_pid": live.pid}


def test_an_operator_answers_the_five_questions_in_three_page_loads_each(
    live_server: Any, spawn_runner: Spawn, browser: Any,
) -> None:
    staged = stage(spawn_runner)
    user = User.objects.create_superuser("operator", email="op@example.com", password=None)
    client = Client()
    client.force_login(user)
    browser.get(live_server.url + "/admin/login/")
    browser.add_cookie({"name": "sessionid", "value": client.cookies["sessionid"].value,
                        "path": "/"})
    shots = Path(tempfile.mkdtemp(prefix="pj-console-shots-"))
    op = Operator(browser, live_server.url, shots)
    began = time.monotonic()
    print("\nscripted operator:")

    # What failed? The dashboard lists the failure groups.
    op.start("what failed")
    op.follow(op.link("Dashboard"))
    groups = {(row.get_attribute("data-job-type"), row.get_attribute("data-code"))
              for row in op.all("#pj-failures tr.pj-group")}
    assert groups == {("billing.charge_card", "CARD_DECLINED"),
                      ("emails.send_receipt", "SMTP_UNAVAILABLE"),
                      ("reports.render_pdf", "HANDLER_ERROR")}, groups
    op.no_sideways_scroll()
    dashboard_shot = op.screenshot("dashboard")
    op.done()

    # Why? From the group to one of its jobs: the banner says why, the attempts show the trace.
    op.start("why")
    op.follow(op.link("Dashboard"))
    op.follow(op.css('tr.pj-group[data-code="CARD_DECLINED"] a.pj-jobs-link'))
    rows = op.all("#result_list tbody tr")
    assert len(rows) == 2, op.text()
    assert "card declined by issuer" in rows[0].text
    op.no_sideways_scroll()
    op.screenshot("job-list")
    op.follow(rows[0].find_element("css selector", "th a, td a"))
    banner = op.css("#pj-banner").text
    assert "Dead-lettered" in banner and "CARD_DECLINED" in banner, banner
    assert "card declined by issuer" in op.css("#pj-last-error").text
    traceback = op.css("#pj-attempts details")
    assert not traceback.find_element("css selector", "pre").is_displayed()
    traceback.find_element("tag name", "summary").click()
    assert "PermanentJobError" in traceback.find_element("css selector", "pre").text
    op.screenshot("job-page-dead-letter")
    op.done()

    # How often? Failed attempts per group in the window, and the attempt list behind a count.
    op.start("how often")
    op.follow(op.link("Dashboard"))
    receipts = op.css('tr.pj-group[data-code="SMTP_UNAVAILABLE"]')
    assert receipts.find_element("css selector", "a.pj-attempts-link").text == "2"
    assert op.css("#pj-chart-hourly svg rect") is not None
    hourly = op.css("#pj-chart-hourly h3").text
    assert "5 dead-lettered" not in hourly and "4 dead-lettered" in hourly, hourly
    op.follow(receipts.find_element("css selector", "a.pj-attempts-link"))
    assert "2 results" in op.text() or "2 job attempts" in op.text(), op.text()[:500]
    assert len(op.all("#result_list tbody tr")) == 2
    op.no_sideways_scroll()
    op.screenshot("attempts")
    op.done()

    # Is it stuck? The hung job, the killed runner's other job, the unserved queue; the runner
    # is flagged dead.
    # The dashboard calls a runner live while its heartbeat is at most two intervals (1 s)
    # old: begin just after the live runner's beat, so that a loaded machine delaying one beat
    # while the page renders does not show it as late (a CI flake).
    def live_runner_just_beat() -> bool:
        record = JobRunnerRecord.objects.filter(pid=staged["live_pid"]).first()
        return record is not None and db_now() - record.heartbeat_at < timedelta(seconds=0.3)

    wait_for(live_runner_just_beat, timeout=10, message="a fresh beat of the live runner")
    op.start("is it stuck")
    op.follow(op.link("Dashboard"))
    stuck = {row.get_attribute("data-job"): row.text for row in op.all("#pj-stuck tr.pj-stuck-row")}
    hung_row = stuck[str(staged["hung"].id)]
    assert "running past its timeout" in hung_row and "stale" in hung_row, hung_row
    assert "held by a runner whose heartbeat is stale" in stuck[str(staged["reindex"].id)]
    assert "on a queue no live runner serves" in stuck[str(staged["unserved"].id)]
    assert "due but unclaimed" in stuck[str(staged["unserved"].id)]
    dead = op.css(f'#pj-runners tr[data-runner="{staged["killed_runner"]}"]').text
    assert "DEAD" in dead and " 2 " in f" {dead} ", dead
    assert "NO live runner" in op.css('#pj-queues tr[data-queue="exports"]').text
    assert "live" in op.css("#pj-runners tr.pj-runner-live").text
    op.follow(op.css(f'#pj-stuck tr[data-job="{staged["hung"].id}"] a'))
    banner = op.css("#pj-banner").text
    assert "Running" in banner and "dead" in op.css("#pj-runner").text.lower(), banner
    assert "past its timeout" in banner
    assert op.css("#pj-progress .pj-progress").get_attribute("aria-valuenow") == "30"
    assert "tok-SECRET" not in op.text() and '"api_token": "***"' in op.text()
    op.no_sideways_scroll()
    job_shot = op.screenshot("job-page")
    op.done()

    # Who owns it? The stuck job's page names the tenant and the runner; the dashboard's tenant
    # table breaks everything down by owner.
    op.start("who owns it")
    op.follow(op.link("Dashboard"))
    tenants = op.css("#pj-tenants").text
    assert "acme" in tenants and "globex" in tenants and "initech" in tenants
    op.follow(op.css(f'#pj-stuck tr[data-job="{staged["reindex"].id}"] a'))
    assert "tenant globex" in op.css("#pj-tenant").text
    assert staged["killed_runner"] in op.css("#pj-runner").text
    op.done()

    total = time.monotonic() - began
    print(f"  total: {total:.2f}s for five questions; screenshots in {shots}")
    assert dashboard_shot.stat().st_size > 10_000 and job_shot.stat().st_size > 10_000
    if os.environ.get("PJ_DOCS_SCREENSHOTS"):
        target = Path(os.environ["PJ_DOCS_SCREENSHOTS"])
        target.mkdir(parents=True, exist_ok=True)
        for shot in shots.glob("*.png"):
            shutil.copy(shot, target / shot.name)
