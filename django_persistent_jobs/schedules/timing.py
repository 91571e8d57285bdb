"""Cron and interval schedules: validation and next-tick computation.

Everything here is a pure function of its arguments: no clock, no database. The scheduler loop
passes the *database's* ``now()`` in as ``after``, so the database clock decides what is due,
while tests pass any instant they like (a controllable clock for the DST cases).

Daylight-saving time (the policy ``docs/recurring.md`` documents, and ``tests`` pin down):

* An expression whose hour field is ``*`` fires every hour, so it follows *elapsed* time: in the
  skipped hour of spring-forward nothing is due (no real time is lost), and in the repeated hour
  of fall-back it fires again (``*/15 * * * *`` keeps firing every 15 minutes all night).
* Any other expression names wall-clock hours, so it follows the *wall clock*: a wall time that
  does not exist (spring-forward) fires once, at the moment the clocks jump (03:00 local in
  Europe/Berlin and America/New_York); a wall time that occurs twice (fall-back) fires once, at
  its first occurrence. A daily 02:30 job therefore runs exactly once every day in both zones.
* Interval schedules are elapsed time on a fixed grid and ignore time zones altogether.

Cron walls are computed by croniter on *naive* local datetimes and mapped to instants here, so the
policy does not depend on croniter's own DST heuristics, and every result is strictly after
``after`` (a scheduler can never loop on the same instant).
"""

from __future__ import annotations

import re
import zoneinfo
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, tzinfo
from typing import Any, Protocol

from croniter import CroniterBadCronError, CroniterBadDateError, croniter

from .. import bounds
from ..errors import ScheduleError as ScheduleError  # re-exported: callers catch it here

#: What computing a *stored* schedule's ticks can raise on this host: a definition the API
#: would refuse now, a zone this host's tzdata lacks (or a name that is a directory here).
#: Firing and the sync switch such a schedule off as invalid on any of these.
UNCOMPUTABLE: tuple[type[Exception], ...] = (
    ScheduleError, zoneinfo.ZoneInfoNotFoundError, ValueError, KeyError, OSError)

#: croniter candidates examined in one computation before we call the expression unusable.
MAX_SCAN = 100_000
#: Where ``count_ticks`` stops counting coalesced ticks (an operator only needs "many").
COUNT_CAP = 100
_ONE_SECOND = timedelta(seconds=1)
_MICROSECOND = timedelta(microseconds=1)


def cron_problem(expression: object) -> str | None:
    """Return why ``expression`` is not a usable cron expression, or ``None`` if it is.

    Five fields are standard cron; a sixth (croniter's optional seconds field, last) is accepted,
    and seven are the Quartz form the product brief names (seconds first, year last; ``?`` for
    "no specific value"), see ``croniter_form``. An expression that can never fire
    (``0 0 30 2 *``, a year that has passed) is refused too, because it would sit in
    the schedules table looking healthy while nothing ever runs.
    """
    if not isinstance(expression, str) or not expression.strip():
        return f"cron must be a non-empty string, got {bounds.show(expression)}."
    if len(expression) > bounds.CRON_MAX_LENGTH:
        return (f"cron must be at most {bounds.CRON_MAX_LENGTH} characters, "
                f"got {bounds.show(expression)}.")
    problem = bounds.text_problem(expression)
    if problem:
        return f"cron {bounds.show(expression)} contains {problem}."
    fields = expression.split()
    if len(fields) not in (5, 6, 7):
        return (f"cron {expression!r} has {len(fields)} fields; use 5 (minute hour day month "
                "weekday), 6 (with seconds last) or 7 (second minute hour day month weekday "
                "year).")
    problem = _quartz_weekday_problem(expression, fields)
    if problem:
        return problem
    written, expression = expression, croniter_form(expression)
    quartz = len(fields) == 7
    if quartz:
        fields = _quartz_in_croniter_order(fields)  # the days still numbered as written
    if any(token in ("R", "H") or token.startswith(("R(", "H(", "H/"))
           for token in re.split(r"[,\s]+", expression)):
        # croniter draws R afresh at every computation (a "daily" schedule would fire several
        # times a day), and H needs a per-schedule seed: neither gives a stable tick grid.
        return (f"cron {expression!r} uses croniter's random (R) or hashed (H) fields; give "
                "the minute or hour explicitly.")
    if not croniter.is_valid(expression):
        return f"cron {written!r} is not a valid cron expression."
    problem = _backwards_range_problem(written, fields, quartz) or _every_second_problem(
        written, fields)
    if problem:
        return problem
    try:
        # From now: a seven-field expression's year may have passed (it would never fire).
        start = datetime.now(UTC).replace(tzinfo=None, microsecond=0)
        croniter(expression, start, max_years_between_matches=30).get_next(datetime)
    except (CroniterBadDateError, CroniterBadCronError):
        return f"cron {written!r} never matches a date."
    return None


def croniter_form(expression: str) -> str:
    """``expression`` as croniter reads it. Five and six fields are croniter's own (seconds
    last). Seven are the Quartz / Rust ``cron`` crate form the product brief specifies:
    ``second minute hour day month weekday year``, with ``?`` ("no specific value") allowed in
    the day fields and the days numbered 1 (Sunday) to 7; croniter's own seven-field order puts
    the seconds sixth, so they are moved there, and its days run 0 to 6. The stored expression
    stays as written; every computation reads it through this."""
    fields = expression.split()
    if len(fields) != 7:
        return expression
    fields = _quartz_in_croniter_order(fields)
    fields[4] = _quartz_weekday(fields[4])
    return " ".join(fields)


def _quartz_in_croniter_order(fields: list[str]) -> list[str]:
    """A seven-field (Quartz) expression's fields in croniter's order (the seconds sixth), with
    ``?`` as ``*``; the days of the week still numbered as Quartz numbers them."""
    second, minute, hour, day, month, weekday, year = (
        "*" if field == "?" else field for field in fields)
    return [minute, hour, day, month, weekday, second, year]


#: A day-of-week number in a Quartz field: not a step (``/2``) or an nth (``#3``), which are
#: counts, not days; ``6L`` is Quartz's last Friday of the month.
_QUARTZ_DAY_NUMBER = re.compile(r"(?<![/#\d])(\d+)(L?)", re.IGNORECASE)


def _quartz_weekday(field: str) -> str:
    """A Quartz day-of-week field as croniter reads it. Quartz (and the Rust ``cron`` crate)
    number the days 1 (Sunday) to 7 (Saturday), croniter 0 to 6: ``1`` copied as is would
    fire on Monday. Names need nothing. Quartz's ``nL`` (the month's last such day) is
    croniter's ``L(n-1)``; a bare ``L`` there means Saturday."""
    if field.upper() == "L":
        return "6"

    def shift(match: re.Match[str]) -> str:
        day = int(match.group(1)) - 1
        return f"L{day}" if match.group(2) else str(day)

    return _QUARTZ_DAY_NUMBER.sub(shift, field)


def _quartz_weekday_problem(expression: str, fields: list[str]) -> str | None:
    """A seven-field day-of-week number outside Quartz's 1-7 (``0``, which croniter would
    read as Sunday, is Quartz's error too)."""
    if len(fields) != 7:
        return None
    for match in _QUARTZ_DAY_NUMBER.finditer(fields[5]):
        if not 1 <= int(match.group(1)) <= 7:
            return (f"cron {expression!r}: in the seven-field (Quartz) form the day-of-week "
                    f"numbers run from 1 (Sunday) to 7 (Saturday), got {match.group(1)}; "
                    "names (SUN-SAT) work too.")
    return None


#: Each field's name and smallest and largest value, in croniter's order (seconds last).
_FIELDS = (("minute", 0, 59), ("hour", 0, 23), ("day-of-month", 1, 31), ("month", 1, 12),
           ("day-of-week", 0, 6), ("second", 0, 59), ("year", 1970, 2099))
_NAMES = {
    3: {m: i for i, m in enumerate(("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug",
                                    "sep", "oct", "nov", "dec"), start=1)},
    4: {d: i for i, d in enumerate(("sun", "mon", "tue", "wed", "thu", "fri", "sat"))},
}
_RANGE = re.compile(r"^([0-9a-z]+)-([0-9a-z]+)(/[0-9]+)?$", re.IGNORECASE)


def _backwards_range_problem(expression: str, fields: list[str], quartz: bool = False
                            ) -> str | None:
    """A range whose start is after its end (``1-0``, ``22-6``, ``sat-sun``): croniter wraps
    it around the field, so ``1-0`` fires every minute. Refused, with the parts to write.
    ``fields`` in croniter's order; ``quartz``: the days numbered 1 (Sunday) to 7."""
    for index, field in enumerate(fields):
        name, low, high = _FIELDS[index]
        if quartz and index == 4:
            low, high = 1, 7
        for item in field.split(","):
            match = _RANGE.match(item)
            if match is None:
                continue
            start, end = (_field_value(index, token) for token in match.group(1, 2))
            if quartz and index == 4:
                start = _quartz_day(match.group(1), start)
                end = _quartz_day(match.group(2), end)
            elif index == 4 and start == 7:
                start = 0  # Sunday, as croniter reads a range starting at 7 ("7-1": Sun-Mon)
            if start is None or end is None or start <= end:
                continue
            step = match.group(3) or ""
            head = f"{start}{step}" if start == high else f"{start}-{high}{step}"
            tail = f"{low}{step}" if end == low else f"{low}-{end}{step}"
            return (f"cron {expression!r}: the range {item!r} in the {name} field runs "
                    f"backwards, which croniter wraps around the field (so '1-0' in the minute "
                    f"field would fire every minute). To mean the wrap, write '{head},{tail}'.")
    return None


def _quartz_day(token: str, value: int | None) -> int | None:
    """A Quartz day's number (1-7): a name's is one more than croniter's."""
    return value if value is None or token.isdigit() else value + 1


def _field_value(index: int, token: str) -> int | None:
    if token.isdigit():
        return int(token)
    return _NAMES.get(index, {}).get(token.lower())


def _every_second_problem(expression: str, fields: list[str]) -> str | None:
    """A sixth field that matches every second. croniter's seconds field is the last one, so
    ``*/10 * * * * *`` (written seconds-first) fires every second, not every ten. Only six
    stars is left alone: it fires every second whichever field is taken for the seconds."""
    if len(fields) != 6 or all(field == "*" for field in fields):
        return None
    try:
        seconds = croniter.expand(expression)[0][5]
    except (CroniterBadCronError, ValueError, IndexError):  # (is_valid said it parses)
        return None
    if seconds != ["*"]:
        return None
    rotated = " ".join(fields[1:] + fields[:1])
    meant = (f" If the first field was meant as the seconds, write {rotated!r}."
             if fields[5] == "*" else "")
    return (f"cron {expression!r} has 6 fields: the sixth field is the seconds (croniter "
            f"puts them last, not first), and {fields[5]!r} there fires every second.{meant} "
            "To run every second, use interval=timedelta(seconds=1) (or six '*').")


def interval_problem(interval: object) -> str | None:
    """Return why ``interval`` is not a usable interval, or ``None`` if it is."""
    if not isinstance(interval, timedelta) or interval <= timedelta(0):
        return f"interval must be a positive timedelta, got {bounds.show(interval)}."
    if interval < _MICROSECOND * 1000:
        return f"interval must be at least 1 ms, got {interval!r}."
    if interval.total_seconds() > bounds.MAX_SECONDS:
        return (f"interval must be at most {bounds.MAX_SECONDS:.0f} seconds, "
                f"got {bounds.show(interval)}.")
    return None


#: Names the time zone database of some hosts resolves that are not one zone everywhere: a
#: web process and a runner (or two runners) would read the same schedule in different zones,
#: or one of them not at all. (Lower case: a case-insensitive file system finds them too.)
_HOST_ZONES = {
    "localtime": "is this host's own zone (/etc/localtime), which differs from host to host",
    "posixrules": ("is a file of this host's time zone database (the rules for POSIX TZ "
                   "strings), not a zone every host has alike"),
    "factory": ("is the time zone database's placeholder for machines not yet set up (its "
                "abbreviation is -00), not a real zone"),
}


def _host_zone_problem(name: str) -> str | None:
    """Why ``name`` would not mean the same zone on every host, or ``None``."""
    why = _HOST_ZONES.get(name.lower())
    if why is not None:
        return (f"time zone {name!r} {why}: name the zone itself, for example "
                "'Europe/Berlin' or 'UTC'.")
    prefix, _, rest = name.partition("/")
    if prefix.lower() == "right" and rest:
        return (f"time zone {name!r} counts leap seconds (its clock is about half a minute "
                "off everyone else's) and only some hosts' time zone databases have it: use "
                f"{rest!r}.")
    if prefix.lower() == "posix" and rest:
        return (f"time zone {name!r} is a copy that only some hosts' time zone databases "
                f"keep: use {rest!r}.")
    return None


def timezone_problem(name: object) -> str | None:
    """Why ``name`` is not a time zone a schedule can be read in on every host, or ``None``.

    The API, the admin form and the handler check all ask here."""
    if not isinstance(name, str) or not name:
        return f"time zone must be a non-empty string, got {bounds.show(name)}."
    if len(name) > bounds.TIMEZONE_MAX_LENGTH or bounds.text_problem(name):
        return f"unknown time zone {bounds.show(name)}."
    host_problem = _host_zone_problem(name)
    if host_problem is not None:
        return host_problem
    try:
        zoneinfo.ZoneInfo(name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, TypeError, OSError):
        return f"unknown time zone {bounds.show(name)}."
    return None


def default_timezone() -> str:
    """``settings.TIME_ZONE`` (read lazily), falling back to UTC when it is unset."""
    from django.conf import settings

    return str(getattr(settings, "TIME_ZONE", None) or "UTC")


def fires_every_hour(expression: str) -> bool:
    """True when the hour field is ``*``: the schedule then follows elapsed time across DST."""
    return croniter_form(expression).split()[1] in ("*", "*/1")


def _aware(value: datetime, name: str) -> datetime:
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{name} must be timezone-aware, got naive {value!r}.")
    return value


def _transition(lo: datetime, hi: datetime, zone: tzinfo) -> datetime:
    """The first instant in ``(lo, hi]`` that already has ``hi``'s UTC offset.

    ``zoneinfo`` does not expose its transitions, so bisect on whole seconds (tzdata transitions
    fall on whole seconds, and DST gaps and folds span at most a few hours: ~15 steps).
    """
    target = hi.astimezone(zone).utcoffset()
    low, high = int(lo.timestamp()), int(hi.timestamp())
    while high - low > 1:
        mid = (low + high) // 2
        if datetime.fromtimestamp(mid, UTC).astimezone(zone).utcoffset() == target:
            high = mid
        else:
            low = mid
    return datetime.fromtimestamp(high, UTC)


def _instants(wall: datetime, zone: tzinfo, every_hour: bool) -> list[datetime]:
    """The UTC instants at which a matching naive ``wall`` time fires, per the DST policy."""
    first = wall.replace(tzinfo=zone, fold=0).astimezone(UTC)
    second = wall.replace(tzinfo=zone, fold=1).astimezone(UTC)
    if first == second:  # an ordinary wall time
        return [first]
    if first < second:  # fall-back: the wall time occurs twice
        return [first, second] if every_hour else [first]
    # spring-forward: the wall time does not exist (fold=0 lands after the jump, fold=1 before)
    return [] if every_hour else [_transition(second, first, zone)]


def next_cron_tick(expression: str, zone: tzinfo | str, after: datetime) -> datetime:
    """The first instant strictly after ``after`` at which ``expression`` fires in ``zone``."""
    _aware(after, "after")
    tz = zoneinfo.ZoneInfo(zone) if isinstance(zone, str) else zone
    every_hour = fires_every_hour(expression)
    local_after = after.astimezone(tz)
    wall_after = local_after.replace(tzinfo=None)
    starts = [wall_after]
    if every_hour and local_after.fold == 0:
        first = wall_after.replace(tzinfo=tz, fold=0).astimezone(UTC)
        second = wall_after.replace(tzinfo=tz, fold=1).astimezone(UTC)
        if first < second:
            # ``after`` is in the first pass of a repeated hour; the second pass repeats wall
            # times we are already past, so also scan from where the repeat begins.
            repeat = _transition(first, second, tz).astimezone(tz).replace(tzinfo=None)
            starts.append(repeat - _ONE_SECOND)
    best: datetime | None = None
    for start in starts:
        found = _scan(expression, tz, every_hour, start, after)
        if best is None or found < best:
            best = found
    assert best is not None
    return best


def _scan(expression: str, tz: tzinfo, every_hour: bool, start: datetime,
          after: datetime) -> datetime:
    iterator = croniter(croniter_form(expression), start.replace(microsecond=0))
    for _ in range(MAX_SCAN):
        try:
            wall: datetime = iterator.get_next(datetime)
        except CroniterBadDateError as exc:
            raise ScheduleError(f"cron {expression!r} never fires after {after}.") from exc
        if wall <= start:
            continue
        instants = [i for i in _instants(wall, tz, every_hour) if i > after]
        if instants:
            return min(instants)
    raise ScheduleError(
        f"cron {expression!r} in {tz} has no tick within {MAX_SCAN} candidates after {after}."
    )


def next_interval_tick(interval: timedelta, anchor: datetime, after: datetime) -> datetime:
    """The first ``anchor + k * interval`` (k >= 0) strictly after ``after``.

    Anchoring to the previous tick keeps an interval schedule on a fixed grid: a late or
    coalesced run does not make later runs drift.
    """
    _aware(anchor, "anchor")
    _aware(after, "after")
    step = interval // _MICROSECOND
    if step <= 0:
        raise ScheduleError(f"interval must be positive, got {interval!r}.")
    if anchor > after:
        return anchor
    k = ((after - anchor) // _MICROSECOND) // step + 1
    return anchor + _MICROSECOND * (k * step)


class HasTiming(Protocol):
    """Anything shaped like a schedule row: ``JobSchedule`` or ``Timing``."""

    cron: str | None
    interval_seconds: float | None
    timezone: str


@dataclass(frozen=True)
class Timing:
    """When a schedule fires: a cron expression in a zone, or an interval."""

    cron: str | None = None
    interval_seconds: float | None = None
    timezone: str = "UTC"

    @classmethod
    def of(cls, schedule: HasTiming) -> Timing:
        return cls(schedule.cron or None, schedule.interval_seconds, schedule.timezone or "UTC")

    def same_ticks(self, other: Timing) -> bool:
        """Whether both give the same ticks: an interval ignores its zone, so changing only
        the zone (or ``settings.TIME_ZONE``, for a code schedule) must not move its grid."""
        if self.cron is None and other.cron is None:
            return self.interval_seconds == other.interval_seconds
        return self == other

    @property
    def interval(self) -> timedelta | None:
        if self.interval_seconds is None:
            return None
        return timedelta(seconds=self.interval_seconds)

    def first_after(self, now: datetime) -> datetime:
        """The first tick of a new (or resumed) schedule: cron's next match, or now + interval."""
        if self.cron is not None:
            return next_cron_tick(self.cron, self.timezone, now)
        assert self.interval is not None
        return _aware(now, "now") + self.interval

    def next_after(self, after: datetime, anchor: datetime | None = None) -> datetime:
        """The first tick strictly after ``after``; intervals stay on ``anchor``'s grid."""
        if self.cron is not None:
            return next_cron_tick(self.cron, self.timezone, after)
        assert self.interval is not None
        return next_interval_tick(self.interval, anchor or after, after)

    def stranded(self, next_run_at: datetime, now: datetime) -> datetime | None:
        """The tick to use instead of ``next_run_at`` if it lies beyond the first tick after
        ``now``, else None.

        Every ``next_run_at`` was computed from a moment no later than ``now``, so one further
        away can only come from a clock that ran ahead and was set back (or a tzdata change):
        left alone, the schedule would sit silent until that far tick. Intervals keep their grid.
        """
        if self.cron is not None:
            first = next_cron_tick(self.cron, self.timezone, now)
            return first if next_run_at > first else None
        assert self.interval is not None
        step = self.interval // _MICROSECOND
        gap = (next_run_at - now) // _MICROSECOND
        if step <= 0 or gap <= step:
            return None
        return next_run_at - _MICROSECOND * (((gap - 1) // step) * step)

    def count_ticks(self, start: datetime, end: datetime, cap: int = COUNT_CAP) -> int:
        """Ticks ``t`` with ``start < t <= end`` (at most ``cap``): the runs a coalesced run stood
        in for, reported on the job so operators can see how much was missed."""
        if end <= start:
            return 0
        if self.cron is None:
            assert self.interval is not None
            return min(cap, (end - start) // self.interval)
        count, tick = 0, start
        while count < cap:
            tick = next_cron_tick(self.cron, self.timezone, tick)
            if tick > end:
                break
            count += 1
        return count

    def describe(self) -> str:
        if self.cron is not None:
            return f"cron {self.cron} ({self.timezone})"
        seconds = self.interval_seconds or 0
        return f"every {format_seconds(seconds)}"

    def as_json(self) -> dict[str, Any]:
        if self.cron is not None:
            return {"cron": self.cron, "timezone": self.timezone}
        return {"interval_seconds": self.interval_seconds}


def next_tick(schedule: HasTiming, after: datetime, anchor: datetime | None = None) -> datetime:
    """The first tick of ``schedule`` strictly after ``after`` (see the module's DST policy)."""
    return Timing.of(schedule).next_after(after, anchor)


def format_seconds(seconds: float) -> str:
    """``90`` -> ``1m30s``; for labels in the admin and logs."""
    if seconds < 1:
        return f"{seconds * 1000:g}ms"
    whole = int(seconds)
    frac = seconds - whole
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if whole >= size:
            parts.append(f"{whole // size}{unit}")
            whole %= size
    if whole or frac or not parts:
        parts.append(f"{whole + frac:g}s")
    return "".join(parts)


def tick_label(tick: datetime) -> str:
    """The canonical text of a tick stored in a run's ``schedule`` JSON.

    Every runner formats the same ``next_run_at`` identically, which is what lets the unique index
    on ``(schedule->>'name', schedule->>'tick')`` reject a second run for the same tick.
    """
    return _aware(tick, "tick").astimezone(UTC).isoformat(timespec="microseconds")
