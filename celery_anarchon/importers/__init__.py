"""Importers: move the entries of another scheduler into stored jobs.

* :func:`import_redbeat`: celery-redbeat's entries in its Redis.

Each writes through :class:`~celery_anarchon.schedules.Schedules`, so every
entry is validated exactly as ``Schedules.add`` validates it; a name already
taken is skipped, an entry that cannot be expressed here is reported with
the reason, and ``dry_run=True`` writes nothing
(docs/migrating-redbeat.md). The ``celery -A proj anarchon import redbeat``
command is a thin layer over it.
"""

from __future__ import annotations

from .common import EntryResult, ImportReport, ImportSourceError, SourceUnavailable
from .redbeat import import_redbeat

__all__ = [
    "EntryResult",
    "ImportReport",
    "ImportSourceError",
    "SourceUnavailable",
    "import_redbeat",
]
