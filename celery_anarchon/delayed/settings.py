"""The delayed tasks' settings, ``anarchon_delayed_*`` keys of ``app.conf``
(docs/delayed-tasks.md lists them with their defaults)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..exceptions import ConfigurationError
from ..settings import DELAYED_SETTINGS, flag
from ..times import seconds

__all__ = ["DelayedSettings", "SETTINGS"]

#: Every ``anarchon_delayed_*`` setting (kept with the others in
#: :mod:`celery_anarchon.settings`, which refuses unknown ones).
SETTINGS = DELAYED_SETTINGS


@dataclass(frozen=True)
class DelayedSettings:
    """The delayed tasks' settings, read once.

    Attributes:
        backend: the URL of the backend that keeps parked tasks
            (``anarchon_delayed_backend``), or None: the claim backend
            (``anarchon_backend``) keeps them.
        release: whether beat runs a releaser (``anarchon_delayed_release``,
            default True where the backend has a delayed store).
        lease_s: how long a releaser holds what it took before another may
            take it over, seconds (``anarchon_delayed_lease``, 30).
        batch: tasks taken per store call (``anarchon_delayed_batch``, 1000).
        poll_s: the longest a releaser sleeps without looking, seconds; the
            bound on lateness when a push is missed (``anarchon_delayed_poll``,
            2).
        max_bytes: the largest payload ``park`` accepts, bytes
            (``anarchon_delayed_max_bytes``, 262144).
        retries: how often a failed publish is retried before the task is
            marked stuck (``anarchon_delayed_retries``, 5): after 1, 2, 4, 8
            and 16 s; the 6th failure marks it.
        stuck_retry_s: how often a stuck task is tried again, seconds
            (``anarchon_delayed_stuck_retry``, 300).
        dedupe_ttl_s: how long the worker gate remembers a started task id,
            seconds (``anarchon_delayed_dedupe_ttl``, 7 days).
    """

    backend: str | None = None
    release: bool = True
    lease_s: float = 30.0
    batch: int = 1000
    poll_s: float = 2.0
    max_bytes: int = 262144
    retries: int = 5
    stuck_retry_s: float = 300.0
    dedupe_ttl_s: float = 7 * 86400.0

    @classmethod
    def from_app(cls, app: Any) -> DelayedSettings:
        """Read ``app.conf``.

        Raises:
            ConfigurationError: a value of the wrong type or out of range,
                naming the setting.
        """
        conf = app.conf

        def get(name: str, default: Any) -> Any:
            value = conf.get(f"anarchon_delayed_{name}")
            return default if value is None else value

        def positive(name: str, default: float) -> float:
            value = seconds(get(name, default), setting=f"anarchon_delayed_{name}")
            if value <= 0:
                raise ConfigurationError(f"anarchon_delayed_{name} must be above 0 seconds.")
            return value

        def count(name: str, default: int, least: int) -> int:
            value = get(name, default)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigurationError(
                    f"anarchon_delayed_{name}={value!r}: must be a whole number of at least "
                    f"{least}."
                )
            return value

        return cls(
            backend=_backend_url(conf.get("anarchon_delayed_backend")),
            release=flag(get("release", True), setting="anarchon_delayed_release"),
            lease_s=positive("lease", 30.0),
            batch=count("batch", 1000, 1),
            poll_s=positive("poll", 2.0),
            max_bytes=count("max_bytes", 262144, 1024),
            retries=count("retries", 5, 0),
            stuck_retry_s=positive("stuck_retry", 300.0),
            dedupe_ttl_s=positive("dedupe_ttl", 7 * 86400.0),
        )


def _backend_url(value: Any) -> str | None:
    """``anarchon_delayed_backend``: None (or empty: the claim backend), or a
    backend URL.

    Raises:
        ConfigurationError: anything but a string.
    """
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ConfigurationError(
            f"anarchon_delayed_backend must be a backend URL (a string such as "
            f"'redis://host:6379/0' or 'postgresql://user@host/db'), got "
            f"{type(value).__name__}."
        )
    return value.strip()
