"""Tick computation and schedule declaration, with a controllable clock (no database).

The scheduler passes the database's ``now()`` into these pure functions; here we pass the
instants ourselves, which is how the DST days are reproduced: a simulated scheduler fires each
tick and asks for the next one, exactly as the loop does.
"""

from __future__ import annotations

from collections import Counter
from datetime import UTC, date, datetime, timedelta
from itertools import pairwise
from zoneinfo import ZoneInfo

import pytest
from django.core import checks

from django_persistent_jobs import ScheduleError, job_handler, next_tick
from django_persistent_jobs.errors import ConfigurationError
from django_persistent_jobs.handlers import registry
from django_persistent_jobs.runner import Runner
from django_persistent_jobs.schedules.timing import (
    Timing,
    cron_problem,
    croniter_form,
    next_cron_tick,
    next_interval_tick,
    tick_label,
    timezone_problem,
)

BERLIN = "Europe/Berlin"
NEW_YORK = "America/New_York"
# 2025 transitions: Berlin 30 Mar 02:00 CET -> 03:00 CEST, 26 Oct 03:00 CEST -> 02:00 CET;
# New York 9 Mar 02:00 EST -> 03:00 EDT, 2 Nov 02:00 EDT -> 01:00 EST.
DAYS = {
    (BERLIN, "spring"): date(2025, 3, 30), (BERLIN, "fall"): date(2025, 10, 26),
    (NEW_YORK, "spring"): date(2025, 3, 9), (NEW_YORK, "fall"): date(2025, 11, 2),
}


def simulate(expression: str, zone: str, start: datetime, end: datetime,
             lag: timedelta = timedelta(0)) -> list[datetime]:
    """Fire every tick in ``[start, end)`` like the scheduler: run, then ask for the next tick
    after the (database) clock, which reads the tick plus ``lag``."""
    fired: list[datetime] = []
    tick = next_cron_tick(expression, zone, start - timedelta(microseconds=1))
    while tick < end:
        fired.append(tick)
        following = next_cron_tick(expression, zone, tick + lag)
        assert following > tick + lag, "a next tick must be strictly after the clock"
        tick = following
        assert len(fired) < 100_000, "runaway schedule"
    return fired


def local_day(zone: str, day: date) -> tuple[datetime, datetime]:
    tz = ZoneInfo(zone)
    start = datetime(day.year, day.month, day.day, tzinfo=tz)
    return start.astimezone(UTC), (start + timedelta(days=1)).astimezone(UTC)


def local(value: datetime, zone: str) -> str:
    return value.astimezone(ZoneInfo(zone)).strftime("%H:%M %Z")


# ----------------------------------------------------------------------------- DST
@pytest.mark.parametrize(("zone", "season", "expected"), [
    # 02:30 does not exist on spring-forward day: it runs once, when the clocks jump to 03:00.
    (BERLIN, "spring", ["03:00 CEST"]),
    (NEW_YORK, "spring", ["03:00 EDT"]),
    # Berlin repeats 02:00-03:00 on fall-back day: 02:30 runs once, at its first occurrence.
    (BERLIN, "fall", ["02:30 CEST"]),
    # New York repeats 01:00-02:00, so 02:30 is an ordinary time there.
    (NEW_YORK, "fall", ["02:30 EST"]),
])
@pytest.mark.parametrize("lag", [timedelta(0), timedelta(seconds=3)])
def test_daily_0230_runs_once_on_dst_days(zone: str, season: str, expected: list[str],
                                          lag: timedelta) -> None:
    start, end = local_day(zone, DAYS[(zone, season)])
    fired = simulate("30 2 * * *", zone, start, end, lag)
    assert [local(t, zone) for t in fired] == expected


@pytest.mark.parametrize("zone", [BERLIN, NEW_YORK])
def test_daily_0230_runs_once_a_day_around_both_transitions(zone: str) -> None:
    for season in ("spring", "fall"):
        day = DAYS[(zone, season)]
        start, _ = local_day(zone, day - timedelta(days=3))
        _, end = local_day(zone, day + timedelta(days=3))
        fired = simulate("30 2 * * *", zone, start, end)
        per_day = Counter(t.astimezone(ZoneInfo(zone)).date() for t in fired)
        assert sorted(per_day.values()) == [1] * 7, per_day


def test_new_york_0130_runs_once_on_fall_back_day() -> None:
    start, end = local_day(NEW_YORK, DAYS[(NEW_YORK, "fall")])
    assert [local(t, NEW_YORK) for t in simulate("30 1 * * *", NEW_YORK, start, end)] == [
        "01:30 EDT"]


@pytest.mark.parametrize(("zone", "season", "runs"), [
    (BERLIN, "spring", 23), (NEW_YORK, "spring", 23), (BERLIN, "fall", 25), (NEW_YORK, "fall", 25),
])
def test_hourly_expressions_follow_elapsed_time(zone: str, season: str, runs: int) -> None:
    """An hour field of ``*`` runs every real hour: 23 runs on the short day, 25 on the long one,
    one hour apart, with no catch-up run at the jump and no pause in the repeated hour."""
    start, end = local_day(zone, DAYS[(zone, season)])
    fired = simulate("0 * * * *", zone, start, end)
    assert len(fired) == runs
    assert {b - a for a, b in pairwise(fired)} == {timedelta(hours=1)}


def test_every_15_minutes_keeps_going_through_the_repeated_hour() -> None:
    start, end = local_day(BERLIN, DAYS[(BERLIN, "fall")])
    fired = simulate("*/15 * * * *", BERLIN, start, end)
    assert len(fired) == 25 * 4
    assert {b - a for a, b in pairwise(fired)} == {timedelta(minutes=15)}


def test_skipped_hour_ticks_of_a_fixed_hour_expression_collapse_into_one_run() -> None:
    start, end = local_day(BERLIN, DAYS[(BERLIN, "spring")])
    assert [local(t, BERLIN) for t in simulate("*/20 2 * * *", BERLIN, start, end)] == [
        "03:00 CEST"]


@pytest.mark.parametrize(("zone", "season"), list(DAYS))
@pytest.mark.parametrize("expression", ["30 2 * * *", "*/7 * * * *", "* 2 * * *",
                                        "0 1-3 * * *", "*/10 * * * * 30"])
def test_no_tick_is_ever_at_or_before_the_clock(zone: str, season: str, expression: str) -> None:
    """Sweep the clock across the transition a minute at a time (and at odd seconds): the next
    tick is always strictly later, so a scheduler can never fire the same instant twice or spin."""
    day = DAYS[(zone, season)]
    tz = ZoneInfo(zone)
    clock = datetime(day.year, day.month, day.day, tzinfo=tz).astimezone(UTC)
    end = clock + timedelta(hours=6)
    while clock < end:
        tick = next_cron_tick(expression, zone, clock)
        assert clock < tick <= clock + timedelta(days=1, hours=1)
        clock += timedelta(seconds=61)


def test_seconds_field_and_controllable_clock() -> None:
    after = datetime(2025, 1, 1, 12, 0, 0, 400_000, tzinfo=UTC)
    assert next_cron_tick("* * * * * *", "UTC", after) == after.replace(second=1, microsecond=0)
    assert next_cron_tick("* * * * * 30", "UTC", after) == after.replace(second=30, microsecond=0)
    assert next_cron_tick("0 2 * * *", BERLIN, after) == datetime(2025, 1, 2, 1, 0, tzinfo=UTC)


def test_next_tick_needs_an_aware_clock() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        next_cron_tick("* * * * *", "UTC", datetime(2025, 1, 1))


# ----------------------------------------------------------------------------- intervals
def test_interval_ticks_stay_on_their_grid() -> None:
    anchor = datetime(2025, 1, 1, tzinfo=UTC)
    step = timedelta(seconds=30)
    assert next_interval_tick(step, anchor, anchor) == anchor + step
    # a late run (clock 95 s past the anchor) coalesces and keeps the 30 s grid
    assert next_interval_tick(step, anchor, anchor + timedelta(seconds=95)) == (
        anchor + timedelta(seconds=120))
    assert next_interval_tick(step, anchor, anchor - timedelta(seconds=5)) == anchor
    # intervals are elapsed time: DST does not exist for them
    timing = Timing(interval_seconds=3600, timezone=BERLIN)
    start, _ = local_day(BERLIN, DAYS[(BERLIN, "spring")])
    assert timing.next_after(start + timedelta(hours=2), anchor=start) == start + timedelta(hours=3)


def test_count_ticks_reports_coalesced_ticks() -> None:
    base = datetime(2025, 1, 1, tzinfo=UTC)
    assert Timing(cron="* * * * *").count_ticks(base, base + timedelta(minutes=10)) == 10
    assert Timing(interval_seconds=60).count_ticks(base, base + timedelta(seconds=599)) == 9
    assert Timing(cron="* * * * * *").count_ticks(base, base + timedelta(days=1), cap=50) == 50


def test_next_tick_accepts_schedule_rows() -> None:
    base = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)
    assert next_tick(Timing(cron="0 * * * *"), base) == base + timedelta(hours=1)
    assert next_tick(Timing(interval_seconds=5), base, anchor=base) == base + timedelta(seconds=5)


def test_tick_label_is_canonical() -> None:
    berlin = datetime(2025, 3, 30, 3, 0, tzinfo=ZoneInfo(BERLIN))
    assert tick_label(berlin) == "2025-03-30T01:00:00.000000+00:00"
    assert tick_label(berlin) == tick_label(berlin.astimezone(UTC))


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize(("expression", "fragment"), [
    ("* * * *", "has 4 fields"),
    ("* * * * * * * *", "has 8 fields"),
    ("0 61 * * * ? *", "not a valid"),  # seven fields: the minute is the second one
    ("0 0 0 30 2 ? *", "never matches"),
    ("0 0 12 * * ? 2020", "never matches"),  # a year that has passed
    ("61 * * * *", "not a valid"),
    ("0 0 30 2 *", "never matches"),
    # croniter's random and hashed fields: no stable tick grid ("R 3" fired up to 4x a day).
    ("R 3 * * *", "random (R)"),
    ("0 H * * *", "random (R)"),
    ("H(0-29) * * * *", "random (R)"),
    ("0,R 3 * * *", "random (R)"),
    ("", "non-empty"),
    (None, "non-empty"),
    # croniter's seconds field is the LAST one: written seconds-first, or with '*' there, the
    # schedule fired every second.
    ("*/10 * * * * *", "the sixth field is the seconds"),
    ("0 */5 * * * *", "'*' there fires every second"),
    ("0 3 * * * */1", "'*/1' there fires every second"),
    ("0 3 * * * 0-59", "'0-59' there fires every second"),
    # Ranges that run backwards: croniter wraps them ("1-0" became every minute).
    ("1-0 * * * *", "the range '1-0' in the minute field runs backwards"),
    ("0 22-6 * * *", "write '22-23,0-6'"),
    ("0 0 * * sat-sun", "the range 'sat-sun' in the day-of-week field runs backwards"),
    ("0 0 1 dec-feb *", "write '12,1-2'"),
    ("0 0 * * * 50-10/5", "the range '50-10/5' in the second field runs backwards"),
])
def test_cron_problem(expression: object, fragment: str) -> None:
    problem = cron_problem(expression)
    assert problem is not None and fragment in problem


def test_valid_cron_expressions() -> None:
    for expression in ("0 2 * * *", "*/5 * * * *", "0 9 * * mon-fri", "* * * * * 15",
                       "*/10 * * * * 30", "0 0 * * * */2", "0 1-3 * * *", "0 0 * * 5-7",
                       "0 0 1 jan-mar *", "0 0 * * fri-sat", "5-5 * * * *", "0 0 * * 7-1",
                       "* * * * * *"):  # every field '*': every second, whichever is first
        assert cron_problem(expression) is None, expression


@pytest.mark.parametrize(("name", "fragment"), [
    # Names that resolve to something different on each host: a web process and a runner
    # (or two runners) could fire the same schedule at different wall times.
    ("localtime", "is this host's own zone (/etc/localtime)"),
    ("LocalTime", "is this host's own zone (/etc/localtime)"),
    ("posixrules", "is a file of this host's time zone database"),
    ("Factory", "is the time zone database's placeholder"),
    ("right/UTC", "counts leap seconds"),
    ("right/Europe/Berlin", "use 'Europe/Berlin'"),
    ("posix/Europe/Berlin", "use 'Europe/Berlin'"),
    ("Mars/Olympus", "unknown time zone 'Mars/Olympus'."),
])
def test_time_zones_that_differ_between_hosts_are_refused(name: str, fragment: str) -> None:
    problem = timezone_problem(name)
    assert problem is not None and fragment in problem, problem


def test_portable_time_zones_are_accepted() -> None:
    for name in ("UTC", BERLIN, NEW_YORK, "Etc/GMT+5", "EST5EDT", "Asia/Kolkata"):
        assert timezone_problem(name) is None, name


def test_bad_schedules_are_system_check_errors_naming_the_handler() -> None:
    with registry.isolated():
        @job_handler("test.recurring.bad_cron", cron="0 25 * * *")
        def bad_cron(payload: object) -> None: ...

        @job_handler("test.recurring.both", cron="0 2 * * *", interval=timedelta(minutes=5))
        def both(payload: object) -> None: ...

        @job_handler("test.recurring.bad_zone", cron="0 2 * * *", timezone="Mars/Olympus")
        def bad_zone(payload: object) -> None: ...

        errors = [e for e in checks.run_checks() if e.id == "persistent_jobs.E102"]
        text = "\n".join(e.msg for e in errors)
        assert len(errors) == 3
        assert "'test.recurring.bad_cron'" in text and "not a valid cron" in text
        assert "'test.recurring.both'" in text and "not both" in text
        assert "'test.recurring.bad_zone'" in text and "Mars/Olympus" in text
        assert all(__name__ in str(e.obj) for e in errors)
        with pytest.raises(ConfigurationError, match="bad_cron"):
            Runner()


def test_schedule_error_is_a_value_error() -> None:
    assert issubclass(ScheduleError, ValueError)


@pytest.mark.parametrize(("quartz", "classic"), [
    ("0 */5 * * * ? *", "*/5 * * * *"),          # every five minutes, at second 0
    ("0 30 9 ? * MON-FRI *", "30 9 * * mon-fri"),  # 09:30 on weekdays
    ("0 0 2 1 * ? *", "0 2 1 * *"),                # 02:00 on the 1st
    ("15 0 12 * * ? 2031", "0 12 * * * 15"),       # 12:00:15 daily, in 2031 only
])
def test_seven_field_cron_is_the_quartz_form_seconds_first_and_year_last(
    quartz: str, classic: str,
) -> None:
    """The product brief specifies "standard 7-field cron syntax" (the Rust ``cron`` crate's
    and Quartz's: second minute hour day month weekday year, ``?`` for "no specific value");
    croniter's own seven fields put the seconds sixth. Both forms give the same ticks."""
    assert cron_problem(quartz) is None
    zone = ZoneInfo(BERLIN)
    after = datetime(2031, 3, 29, 23, 58, 7, tzinfo=UTC)  # across a DST change in Berlin
    quartz_ticks, classic_ticks = [after], [after]
    for _ in range(5):
        quartz_ticks.append(next_cron_tick(quartz, zone, quartz_ticks[-1]))
        classic_ticks.append(next_cron_tick(classic, zone, classic_ticks[-1]))
    assert quartz_ticks == classic_ticks
    assert croniter_form("0 */5 * * * ? *") == "*/5 * * * * 0 *"


@pytest.mark.parametrize(("quartz", "weekdays"), [
    ("0 0 12 ? * 1 *", {"Sun"}),                 # Quartz and the Rust cron crate: 1 = Sunday
    ("0 0 12 ? * 7 *", {"Sat"}),
    ("0 0 12 ? * 2-6 *", {"Mon", "Tue", "Wed", "Thu", "Fri"}),
    ("0 0 12 ? * 1,7 *", {"Sun", "Sat"}),
    ("0 0 12 ? * 2/2 *", {"Mon", "Wed", "Fri"}),  # from Monday, every second day
    ("0 0 12 ? * MON-FRI *", {"Mon", "Tue", "Wed", "Thu", "Fri"}),
])
def test_seven_field_day_of_week_numbers_are_quartz_numbers(quartz: str, weekdays: set[str]
                                                             ) -> None:
    """Copied from a Quartz or Rust ``cron`` schedule, ``1`` means Sunday; read with croniter's
    numbering (0 = Sunday) it would fire a day late, silently."""
    assert cron_problem(quartz) is None
    tick = datetime(2031, 3, 2, tzinfo=UTC)
    seen = set()
    for _ in range(14):
        tick = next_cron_tick(quartz, ZoneInfo("UTC"), tick)
        seen.add(tick.strftime("%a"))
    assert seen == weekdays


def test_seven_field_nth_and_last_weekday_are_quartz_days() -> None:
    """``6#3`` is the third Friday and ``6L`` the last Friday of the month in Quartz."""
    utc = ZoneInfo("UTC")
    after = datetime(2025, 6, 1, tzinfo=UTC)
    assert next_cron_tick("0 0 12 ? * 6#3 *", utc, after) == datetime(2025, 6, 20, 12,
                                                                       tzinfo=UTC)
    assert next_cron_tick("0 0 12 ? * 6L *", utc, after) == datetime(2025, 6, 27, 12,
                                                                      tzinfo=UTC)


@pytest.mark.parametrize(("quartz", "needle"), [
    ("0 0 12 ? * 0 *", "from 1 (Sunday) to 7 (Saturday), got 0"),
    ("0 0 12 ? * 2-8 *", "got 8"),
    ("0 0 12 ? * 7-1 *", "write '7,1'"),
    ("0 0 12 ? * SAT-SUN *", "write '7,1'"),
])
def test_seven_field_day_of_week_outside_quartz_numbers_is_refused(quartz: str, needle: str
                                                                    ) -> None:
    problem = cron_problem(quartz)
    assert problem is not None and needle in problem
