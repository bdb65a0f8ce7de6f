"""Errors raised by celery-anarchon.

One root, :class:`AnarchonError`, and a short tree under it. Messages name
the job, the setting and the fix wherever those are known.
"""

from __future__ import annotations

__all__ = [
    "AnarchonError",
    "ConfigurationError",
    "BackendUnavailable",
    "BackendMissing",
    "LeaseLost",
]


class AnarchonError(Exception):
    """Root of every error this package raises on purpose."""


class ConfigurationError(AnarchonError, ValueError):
    """A setting, a schedule entry or a backend URL is wrong.

    Raised at start-up (or when a job is added), never in the middle of a
    tick. The message names the job (where there is one), the setting and
    the fix.
    """


class BackendUnavailable(AnarchonError):
    """The claim backend could not be reached or did not answer in time.

    Always raised ``from`` the driver's own error. The scheduler treats it as
    a lost claim: it never sends a slot it could not claim.
    """


class BackendMissing(BackendUnavailable):
    """A read found no backend to read: its store was never created (a
    SQLite file that is not there yet). Reading does not create it; beat
    does, on its first start.
    """


class LeaseLost(AnarchonError):
    """The fencing token presented is no longer the slot's current one.

    Another instance took the slot over (its lease expired), so the caller
    must not act on the slot any further.
    """
