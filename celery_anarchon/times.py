"""Durations and instants as the rest of the package reads and shows them.

One duration parser for settings (:func:`seconds`: a setting's value to
float seconds), one for backend options (:func:`option_seconds`, which also
takes the numeric strings of a URL's query), and one formatter of
instants (:func:`iso`: epoch milliseconds to ISO 8601 UTC), so a setting
means the same everywhere and every log line and description shows a time
the same way.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone
from typing import Any

from .exceptions import ConfigurationError

__all__ = ["iso", "ms", "option_seconds", "seconds", "utc"]


def seconds(value: Any, *, setting: str, job: str | None = None) -> float:
    """``value`` (a number of seconds or a timedelta) as float seconds >= 0.

    Args:
        value: the setting's value.
        setting: its name, for the error message.
        job: the job whose ``'anarchon'`` options hold it, or None for a
            global setting.
    Raises:
        ConfigurationError: not a number or timedelta, or negative.
    """
    where = f"beat_schedule[{job!r}]['anarchon']: " if job else ""
    if isinstance(value, timedelta):
        result = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        result = float(value)
    else:
        raise ConfigurationError(
            f"{where}{setting} must be a number of seconds or a timedelta, got {value!r}."
        )
    if result < 0:
        raise ConfigurationError(f"{where}{setting} must not be negative, got {value!r}.")
    return result


def option_seconds(name: str, value: Any, *, most: float | None = None) -> float:
    """A backend option's duration: ``value`` (a number, a numeric string as
    a URL's query gives it, or a timedelta) as float seconds, positive and
    finite (and at most ``most`` when given).

    Raises:
        ConfigurationError: anything else, naming
            ``anarchon_backend_options[name]`` and an example.
    """
    try:
        result = value.total_seconds() if isinstance(value, timedelta) else float(value)
    except (TypeError, ValueError):
        result = math.nan
    if isinstance(value, bool) or not 0 < result < math.inf or (most is not None and result > most):
        bound = f" and at most {most:g}" if most is not None else ""
        raise ConfigurationError(
            f"anarchon_backend_options[{name!r}]: expected a positive number of seconds"
            f"{bound}, got {value!r}; e.g. {{{name!r}: 5}}."
        )
    return result


def ms(value_s: float) -> int:
    """``value_s`` seconds as whole milliseconds (rounded to the nearest)."""
    return int(round(value_s * 1000))


def utc(ms_: int) -> datetime:
    """Epoch milliseconds as an aware UTC datetime."""
    return datetime.fromtimestamp(ms_ / 1000, tz=timezone.utc)


def iso(ms_: int, *, exact: bool = False) -> str:
    """Epoch milliseconds as ISO 8601 UTC text, ``...Z``.

    Args:
        ms_: the instant, epoch milliseconds.
        exact: the shortest exact form (``1970-01-01T00:00:00Z``, with
            milliseconds only when there are some), as schedule descriptions
            use it (they are hashed into definitions: keep it stable);
            default: always with milliseconds, as log lines show it.
    """
    spec = "seconds" if exact and not ms_ % 1000 else "milliseconds"
    return utc(ms_).replace(tzinfo=None).isoformat(timespec=spec) + "Z"
