"""Cron schedules and time slots for scheduled jobs (pure Python: no files, no Ray).

A schedule is a standard 5-field cron string, `minute hour day-of-month month day-of-week`
(`*`, `a`, `a-b`, `*/n`, `a-b/n`, `a/n`, comma lists; month and weekday names `jan`..`dec`,
`sun`..`sat`; weekday 0 or 7 = Sunday; when both day fields are restricted a day matching either
runs, as in Vixie cron), or one of `@hourly @daily @midnight @weekly @monthly @yearly @annually`.
It is read in a time zone (IANA name, zoneinfo).

A slot names one fire time by its wall-clock time in the schedule's zone:

- `YYYY-MM-DDTHH` (e.g. `2026-11-30T00`) when the minute field is one value, so the schedule fires
  at most once an hour (hourly, daily, weekly...): the slot is the hour the fire time falls in;
- `YYYY-MM-DDTHH-MM` when it fires several times an hour (e.g. `*/15 * * * *`).

The scheduler's slot at `now` is the most recent fire time <= now (hourly at 10:25 -> `...T10`,
the hour that just started). Daylight saving: wall-clock times repeated when clocks go back are
one slot (the second fire finds it already done); a fire time that clocks skip (spring forward)
fires at the same instant as the wall time one offset later (02:30 -> 03:30 new time), as cron
implementations that run skipped jobs after the jump do, and keeps its own label (`...T02`).

Knows nothing about jobs, files or Ray.
"""
from __future__ import annotations

import calendar
import re
from dataclasses import dataclass
from datetime import date, datetime, time, timedelta, timezone
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

CRON_FORMAT = ("5 fields 'minute hour day-of-month month day-of-week' (e.g. '0 * * * *' hourly, "
               "'30 2 * * 1-5', '*/15 * * * *') or one of @hourly @daily @weekly @monthly @yearly")
MACROS = {"@hourly": "0 * * * *", "@daily": "0 0 * * *", "@midnight": "0 0 * * *", "@weekly": "0 0 * * 0",
          "@monthly": "0 0 1 * *", "@yearly": "0 0 1 1 *", "@annually": "0 0 1 1 *"}
MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
DAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")
# (name, low, high, names) of the five fields; names map to low + index
FIELDS = (("minute", 0, 59, ()), ("hour", 0, 23, ()), ("day-of-month", 1, 31, ()),
          ("month", 1, 12, MONTHS), ("day-of-week", 0, 7, DAYS))
HOUR_SLOT, MINUTE_SLOT = "YYYY-MM-DDTHH", "YYYY-MM-DDTHH-MM"
SLOT_RE = {HOUR_SLOT: re.compile(r"(\d{4})-(\d{2})-(\d{2})T(\d{2})"),
           MINUTE_SLOT: re.compile(r"(\d{4})-(\d{2})-(\d{2})T(\d{2})-(\d{2})")}
SLOT_EXAMPLE = {HOUR_SLOT: "2026-11-30T00", MINUTE_SLOT: "2026-11-30T00-15"}
SEARCH_DAYS = 366 * 9          # any valid schedule fires within 8 years (Feb 29 across a skipped leap year)


class ScheduleError(ValueError):
    """A cron string, time zone or slot that cannot be used; the message gives the expected format."""


@dataclass(frozen=True)
class Cron:
    text: str
    minutes: tuple[int, ...]
    hours: tuple[int, ...]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]          # 0 = Sunday
    day_or: bool                      # both day fields restricted: either matches

    @property
    def slot_format(self) -> str:
        return HOUR_SLOT if len(self.minutes) == 1 else MINUTE_SLOT

    def matches_day(self, d: date) -> bool:
        if d.month not in self.months:
            return False
        dom, dow = d.day in self.days, (d.weekday() + 1) % 7 in self.weekdays
        return (dom or dow) if self.day_or else (dom and dow)

    def matches(self, wall: datetime) -> bool:
        return self.matches_day(wall.date()) and wall.hour in self.hours and wall.minute in self.minutes


def parse_cron(text: str) -> Cron:
    """A Cron, or ScheduleError naming the bad field and the expected format."""
    if not isinstance(text, str) or not text.strip():
        raise ScheduleError(f"expected {CRON_FORMAT}; got {text!r}")
    spec = MACROS.get(text.strip().lower(), text)
    parts = spec.split()
    if len(parts) != 5:
        raise ScheduleError(f"expected {CRON_FORMAT}; got {text!r} ({len(parts)} fields)")
    values = []
    for part, (name, low, high, names) in zip(parts, FIELDS):
        try:
            values.append(_field(part.lower(), low, high, names))
        except ValueError as e:
            raise ScheduleError(f"{name} field {part!r}: {e}; expected {CRON_FORMAT}; got {text!r}") from None
    minutes, hours, days, months, weekdays = values
    cron = Cron(text, tuple(sorted(minutes)), tuple(sorted(hours)), frozenset(days), frozenset(months),
                frozenset(d % 7 for d in weekdays),
                day_or=not parts[2].startswith("*") and not parts[4].startswith("*"))
    if not cron.day_or and not any(d <= _longest_month(m) for m in months for d in days):
        raise ScheduleError(f"{text!r} never fires (no month has those days); expected {CRON_FORMAT}")
    return cron


def _longest_month(month: int) -> int:
    return calendar.monthrange(2024, month)[1]          # a leap year: Feb 29 exists


def _field(part: str, low: int, high: int, names: tuple) -> set[int]:
    out: set[int] = set()
    for item in part.split(","):
        rng, _, step_text = item.partition("/")
        step = _number(step_text, (), 1, high) if step_text else 1
        if rng == "*":
            first, last = low, high
        elif "-" in rng:
            a, b = rng.split("-", 1)
            first, last = _number(a, names, low, high), _number(b, names, low, high)
            if first > last:
                raise ValueError(f"range {rng} runs backwards")
        else:
            first = _number(rng, names, low, high)
            last = high if step_text else first
        out.update(range(first, last + 1, step))
    return out


def _number(text: str, names: tuple, low: int, high: int) -> int:
    if text in names:
        return low + names.index(text)
    if not text.isdigit():
        raise ValueError(f"{text!r} is not a number" + (f" or a name ({', '.join(names)})" if names else ""))
    value = int(text)
    if not low <= value <= high:
        raise ValueError(f"{value} is outside {low}-{high}")
    return value


def zone(name: str) -> ZoneInfo:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, TypeError):
        raise ScheduleError(f"unknown time zone {name!r}; expected an IANA name such as 'UTC' or "
                            f"'Europe/Berlin'") from None


def _instants(wall: datetime, tz: ZoneInfo) -> list[datetime]:
    """The instants (UTC) a wall-clock time stands for: two in a repeated hour, one otherwise; a
    skipped wall time stands for the instant with the offset from before the jump (02:30 -> 03:30
    new time). UTC because aware datetimes sharing a tzinfo compare by wall time, ignoring fold."""
    first = wall.replace(tzinfo=tz, fold=0).astimezone(timezone.utc)
    second = wall.replace(tzinfo=tz, fold=1).astimezone(timezone.utc)
    if first.astimezone(tz).replace(tzinfo=None) != wall:     # skipped by a jump forward
        return [first]
    return [first] if first == second else [first, second]


def last_fire(cron: Cron, tz: ZoneInfo, now: datetime) -> datetime:
    """The wall-clock time (naive, in tz) of the most recent fire time <= now (aware)."""
    now = now.astimezone(timezone.utc)
    day = now.astimezone(tz).date() + timedelta(days=1)
    for _ in range(SEARCH_DAYS):
        if cron.matches_day(day):
            fired = [(instant, wall) for h in cron.hours for m in cron.minutes
                     for wall in [datetime.combine(day, time(h, m))] for instant in _instants(wall, tz)
                     if instant <= now]
            if fired:
                return max(fired)[1]
        day -= timedelta(days=1)
    raise ScheduleError(f"{cron.text!r} has not fired in the {SEARCH_DAYS} days before {now.isoformat()}")


def format_slot(wall: datetime, slot_format: str) -> str:
    return wall.strftime("%Y-%m-%dT%H" if slot_format == HOUR_SLOT else "%Y-%m-%dT%H-%M")


def current_slot(cron: Cron, tz: ZoneInfo, now: datetime | None = None) -> str:
    """The slot of the most recent fire time <= now (default: the clock)."""
    now = now or datetime.now(timezone.utc)
    return format_slot(last_fire(cron, tz, now), cron.slot_format)


def parse_slot(text: str, cron: Cron | None) -> datetime:
    """A given slot's wall-clock time; it must have the schedule's format and be one of its fire
    times (without a schedule, either format). ScheduleError gives the expected format."""
    formats = [cron.slot_format] if cron else [HOUR_SLOT, MINUTE_SLOT]
    for fmt in formats:
        m = SLOT_RE[fmt].fullmatch(text or "")
        if m:
            break
    else:
        expected = " or ".join(f"{f} (e.g. {SLOT_EXAMPLE[f]})" for f in formats)
        raise ScheduleError(f"slot {text!r}: expected {expected}"
                            + (f" for schedule {cron.text!r}" if cron else ""))
    numbers = [int(g) for g in m.groups()]
    if fmt == HOUR_SLOT:
        numbers.append(cron.minutes[0] if cron else 0)
    try:
        wall = datetime(*numbers)
    except ValueError as e:
        raise ScheduleError(f"slot {text!r}: {e}; expected {fmt}") from None
    if cron and not cron.matches(wall):
        raise ScheduleError(f"slot {text!r} is not a fire time of schedule {cron.text!r}")
    return wall
