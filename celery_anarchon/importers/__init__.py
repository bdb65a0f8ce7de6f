"""Importers: move the entries of another scheduler into stored jobs.

* :func:`import_redbeat`: celery-redbeat's entries in its Redis;
* :func:`import_django_celery_beat`: django-celery-beat's ``PeriodicTask``
  rows, through Django's ORM or straight from its tables.

Each writes through :class:`~celery_anarchon.schedules.Schedules`, so every
entry is validated exactly as ``Schedules.add`` validates it; a name already
taken is skipped, an entry that cannot be expressed here is reported with
the reason, and ``dry_run=True`` writes nothing
(docs/migrating-redbeat.md, docs/migrating-django-celery-beat.md). The
``celery -A proj anarchon import redbeat|django-celery-beat`` commands are a
thin layer over these functions.
"""

from __future__ import annotations

from .common import EntryResult, ImportReport, ImportSourceError, SourceUnavailable
from .django import import_django_celery_beat
from .redbeat import import_redbeat

__all__ = [
    "EntryResult",
    "ImportReport",
    "ImportSourceError",
    "SourceUnavailable",
    "import_django_celery_beat",
    "import_redbeat",
]
