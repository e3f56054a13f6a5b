"""The night window (`--hours 22:00-06:00`): when work may run. Pure: parsing and clock arithmetic on given
datetimes, no sleeping and no reading of the clock (callers pass `now`), so every edge is a unit test.

A window is a daily interval of wall-clock time, [start, end), in one timezone (the machine's local one unless
`--timezone` names another). It may wrap midnight (22:00-06:00 is open from 22:00 to 06:00 the next morning).
`start == end` is refused: it would be either never or always open, and neither needs a window.

Wall-clock times are combined with dates in the window's timezone (zoneinfo), so a window keeps its local hours
across a DST change; on the change night itself an hour that does not exist or exists twice is resolved the way
zoneinfo resolves it (fold=0).

`window(hours, timezone)` is how `run`, `resume` and the server (its --hours / hours: setting) read a window, so
each says the same thing about the same mistake.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

_CLOCK = re.compile(r"^([01]?\d|2[0-3]):([0-5]\d)$")


class HoursError(ValueError):
    """A --hours or --timezone value that cannot be used, with what to give instead."""


def window(hours: str | None, timezone: str | None = None) -> Hours | None:
    """The window given as --hours (and --timezone), or None when no --hours was given: then work runs at any
    hour. A timezone without hours is refused, not ignored: it is the window's and says a window was meant."""
    if hours is None:
        if timezone is not None:
            raise HoursError(
                "--timezone is the window's timezone: give --hours too (in a config file: give hours beside "
                "timezone)"
            )
        return None
    return Hours.parse(hours, timezone)


def _clock(text: str, whole: str) -> dt.time:
    match = _CLOCK.match(text.strip())
    if not match:
        raise HoursError(f"--hours {whole!r}: {text.strip()!r} is not a time of day HH:MM (00:00 to 23:59)")
    return dt.time(int(match.group(1)), int(match.group(2)))


def _zone(name: str | None) -> dt.tzinfo | None:
    if not name:
        return None
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise HoursError(
            f"--timezone {name!r} is not a known timezone: give an IANA name such as Europe/Berlin or UTC"
        ) from exc


@dataclass(frozen=True)
class Hours:
    start: dt.time
    end: dt.time
    tz: dt.tzinfo | None = None  # None: the machine's local timezone
    text: str = ""

    @classmethod
    def parse(cls, text: str, timezone: str | None = None) -> Hours:
        """`HH:MM-HH:MM`, e.g. `22:00-06:00` (wraps midnight) or `01:00-05:30`."""
        parts = text.split("-")
        if len(parts) != 2:
            raise HoursError(f"--hours {text!r}: give START-END as HH:MM-HH:MM, e.g. 22:00-06:00")
        start, end = _clock(parts[0], text), _clock(parts[1], text)
        if start == end:
            raise HoursError(
                f"--hours {text!r}: the window starts and ends at the same time; leave --hours out to run "
                "at any hour"
            )
        return cls(start, end, _zone(timezone), text.strip())

    @property
    def wraps(self) -> bool:
        """Open across midnight (start later in the day than end)."""
        return self.start > self.end

    def _local(self, now: dt.datetime) -> dt.datetime:
        if now.tzinfo is None:
            raise ValueError("now must be timezone-aware")
        return now.astimezone(self.tz) if self.tz is not None else now.astimezone()

    def _at(self, day: dt.date, clock: dt.time, like: dt.datetime) -> dt.datetime:
        """`clock` on `day` in the window's timezone (an aware datetime)."""
        if self.tz is not None:
            return dt.datetime.combine(day, clock, tzinfo=self.tz)
        # Local time: the offset of that moment, not of `like` (a DST change may lie between them).
        return dt.datetime.combine(day, clock).astimezone()

    def is_open(self, now: dt.datetime) -> bool:
        t = self._local(now).time()
        if self.wraps:
            return t >= self.start or t < self.end
        return self.start <= t < self.end

    def _opening(self, now: dt.datetime) -> dt.datetime:
        """The start of the window that is open at `now`, or of the next one."""
        local = self._local(now)
        today = local.date()
        if self.is_open(now):
            # Open: it started today, or (a wrapping window before its end) yesterday.
            day = today if local.time() >= self.start else today - dt.timedelta(days=1)
            return self._at(day, self.start, local)
        day = today if local.time() < self.start else today + dt.timedelta(days=1)
        return self._at(day, self.start, local)

    def next_open(self, now: dt.datetime) -> dt.datetime:
        """When work may next run: `now` itself when the window is open."""
        return now if self.is_open(now) else self._opening(now)

    def closes_at(self, now: dt.datetime) -> dt.datetime:
        """The end of the window open at `now` (or, when closed, of the next one)."""
        opening = self._local(self._opening(now))
        day = opening.date() + dt.timedelta(days=1) if self.wraps else opening.date()
        return self._at(day, self.end, opening)

    def describe(self) -> str:
        zone = getattr(self.tz, "key", None) or "local time"
        return f"{self.start:%H:%M}-{self.end:%H:%M} ({zone})"
