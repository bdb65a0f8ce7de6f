"""What both importers share: an entry as mapped from the old scheduler,
the report of an import, and the writing of stored jobs through
:class:`~celery_anarchon.schedules.Schedules`.

An importer reads the old scheduler's entries and maps each to a
:class:`Mapped` entry: the fields :meth:`Schedules.add` takes, or the
reason it cannot be expressed here. :func:`store` then skips names already
taken, validates the rest exactly as ``add`` does, and adds them (nothing
with ``dry_run``).
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..backends import backend_from_url
from ..beat.registry import new_instance_id
from ..exceptions import AnarchonError, ConfigurationError
from ..schedules import JobExists, Schedules
from ..stored import Definition

__all__ = [
    "ALREADY_IMPORTED",
    "IMPORTED",
    "NOT_MAPPED",
    "SKIPPED",
    "WOULD_IMPORT",
    "iso",
    "EntryResult",
    "ImportReport",
    "ImportSourceError",
    "Mapped",
    "SourceUnavailable",
    "store",
]

logger = logging.getLogger(__name__)

#: An entry's outcome (:attr:`EntryResult.status`).
IMPORTED = "imported"
#: ``dry_run``: it would be imported.
WOULD_IMPORT = "would_import"
#: A stored job of the name holds exactly this definition: an earlier run
#: of the import stored it (a second run changes nothing).
ALREADY_IMPORTED = "already_imported"
#: The name is taken (a code entry, or a stored job with another definition).
SKIPPED = "skipped"
#: It cannot be expressed here, or validation refused it; the reason says which.
NOT_MAPPED = "not_mapped"

#: The outcomes that leave nothing for the operator to do.
DONE = frozenset({IMPORTED, WOULD_IMPORT, ALREADY_IMPORTED})


class SourceUnavailable(AnarchonError):
    """The old scheduler's store (its Redis, its database) could not be
    reached. Raised ``from`` the driver's error."""


class ImportSourceError(ConfigurationError):
    """The old scheduler's store cannot be read as given: not a Redis URL,
    a key that is not redbeat's index, a database without
    django-celery-beat's tables, Django not configured and no database URL.
    The message names the option that fixes it."""


@dataclass
class Mapped:
    """One entry of the old scheduler, as :meth:`Schedules.add` takes it.

    Attributes:
        name: the entry's name, kept as the job's name.
        source: the entry's schedule as the old scheduler described it
            (``"interval 60s"``, ``"rrule ..."``), for the report.
        task, schedule, args, kwargs, options: as ``add`` takes them.
        anarchon: per-job options (``anchor``, ``start_at``, ``end_at``,
            ``max_runs``).
        paused: store it paused (the entry was disabled).
        note: the pause note.
        notes: how the meaning differs here, one sentence each.
        problem: why it cannot be imported (then the fields above are not
            used), or None.
        skip: why it is left where it is although it could be imported
            (a redbeat entry that came from ``beat_schedule``), or None.
    """

    name: str
    source: str
    task: str = ""
    schedule: Any = None
    args: Any = ()
    kwargs: Any = None
    options: Any = None
    anarchon: dict[str, Any] = field(default_factory=dict)
    paused: bool = False
    note: str = ""
    notes: list[str] = field(default_factory=list)
    problem: str | None = None
    skip: str | None = None

    def definition(self) -> Definition:
        """The definition ``add`` would store.

        Raises:
            ConfigurationError: a shape :meth:`Definition.build` refuses.
        """
        return Definition.build(
            self.name,
            self.task,
            self.schedule,
            self.args,
            self.kwargs,
            self.options,
            self.anarchon or None,
        )


@dataclass
class EntryResult:
    """What the import did with one entry.

    Attributes:
        name: the entry's (and job's) name.
        status: :data:`IMPORTED`, :data:`WOULD_IMPORT`,
            :data:`ALREADY_IMPORTED`, :data:`SKIPPED` or :data:`NOT_MAPPED`.
        source: the entry's schedule as the old scheduler described it.
        schedule: the stored schedule (``every 60s``, ``crontab '0 3 * * *'
            Europe/Berlin``), or None when not mapped.
        paused: stored paused (the entry was disabled).
        reason: why it was skipped or not mapped, or None.
        notes: how the meaning differs here, one sentence each.
        definition: the stored definition's JSON fields (``task``,
            ``schedule``, ``args``, ``kwargs``, ``options``, ``anarchon``),
            or None when not mapped.
    """

    name: str
    status: str
    source: str
    schedule: str | None = None
    paused: bool = False
    reason: str | None = None
    notes: list[str] = field(default_factory=list)
    definition: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        """The result as JSON values."""
        return {
            "name": self.name,
            "status": self.status,
            "source": self.source,
            "schedule": self.schedule,
            "paused": self.paused,
            "reason": self.reason,
            "notes": list(self.notes),
            "definition": self.definition,
        }


@dataclass
class ImportReport:
    """The outcome of one import.

    Attributes:
        source: ``"redbeat"`` or ``"django-celery-beat"``.
        read_from: where the entries were read (credentials masked).
        target: the claim backend the stored jobs went to.
        dry_run: nothing was written.
        entries: one result per entry read, by name.
    """

    source: str
    read_from: str
    target: str
    dry_run: bool
    entries: list[EntryResult] = field(default_factory=list)

    def with_status(self, *statuses: str) -> list[EntryResult]:
        """The entries whose status is one of ``statuses``."""
        return [e for e in self.entries if e.status in statuses]

    @property
    def ok(self) -> bool:
        """True when every entry was imported (or would be, or already was)."""
        return all(e.status in DONE for e in self.entries)

    def counts(self) -> dict[str, int]:
        """``{status: how many}`` over every status."""
        statuses = (IMPORTED, WOULD_IMPORT, ALREADY_IMPORTED, SKIPPED, NOT_MAPPED)
        return {s: len(self.with_status(s)) for s in statuses}

    def as_dict(self) -> dict[str, Any]:
        """The report as JSON values."""
        return {
            "source": self.source,
            "read_from": self.read_from,
            "target": self.target,
            "dry_run": self.dry_run,
            "ok": self.ok,
            "counts": self.counts(),
            "entries": [e.as_dict() for e in self.entries],
        }


def store(
    app: Any,
    mapped: Iterable[Mapped],
    *,
    source: str,
    read_from: str,
    dry_run: bool,
    schedule_filename: str | None = None,
) -> ImportReport:
    """Add every mapped entry as a stored job, through :class:`Schedules`.

    A name that a code entry has (in ``app``'s ``beat_schedule`` or on a
    live instance) or that a stored job has is skipped, unless that stored
    job holds exactly the mapped definition (already imported). Each entry
    is validated as :meth:`Schedules.add` validates it; a refusal is
    reported with its message and the import goes on.

    Args:
        app: the Celery app whose claim backend keeps the stored jobs.
        mapped: the entries, as an importer mapped them.
        source: the old scheduler's name, for the report.
        read_from: where they were read, credentials masked.
        dry_run: write nothing; validate and report what would happen (a
            SQLite store that does not exist yet is not created: the
            entries are checked against an empty one in a temporary folder).
        schedule_filename: beat's ``-s`` file, when the default SQLite
            backend is used with another file than the default.
    Returns:
        the report, entries by name.
    Raises:
        StoredJobsRefused: the claim backend is claim-only (RabbitMQ).
        BackendUnavailable: the claim backend did not answer.
    """
    entries = sorted(mapped, key=lambda m: m.name)
    with _schedules(app, schedule_filename, dry_run) as (target, described):
        report = ImportReport(source, read_from, described, dry_run)
        # Connect (creating the store, as add does) before the first entry:
        # a backend that is misconfigured or away ends the import here,
        # instead of being reported against every entry.
        target.backend_now_ms()
        taken = _taken_names(app, target)
        stored = target.state().jobs
        for entry in entries:
            report.entries.append(_store_one(target, entry, taken, stored, dry_run))
    return report


@contextmanager
def _schedules(
    app: Any, schedule_filename: str | None, dry_run: bool
) -> Iterator[tuple[Schedules, str]]:
    """The :class:`Schedules` to write through, and the target's description."""
    with Schedules(app, schedule_filename=schedule_filename) as schedules:
        described = schedules.backend.describe()
        if not dry_run or schedules.backend.exists():
            yield schedules, described
            return
        # A dry run must not create the user's SQLite file: check against
        # an empty store of the same kind, which nobody else reads.
        with tempfile.TemporaryDirectory(prefix="anarchon-import-") as folder:
            url = f"sqlite:///{Path(folder) / 'dry-run.db'}"
            scratch = backend_from_url(url, instance=new_instance_id())
            with Schedules(app, backend=scratch) as empty:
                yield empty, f"{described} (does not exist yet: checked against an empty store)"


def _taken_names(app: Any, schedules: Schedules) -> dict[str, str]:
    """``{name: what has it}`` for the code entries here and on every live
    instance (the registry keeps their names)."""
    taken = {name: "a beat_schedule entry of this app" for name in app.conf.beat_schedule or {}}
    if schedules.backend.exists():
        for info in schedules.backend.instances():
            for name in schedules.backend.definitions(info.instance):
                taken.setdefault(name, f"a beat_schedule entry of live instance {info.instance}")
    return taken


def _store_one(
    schedules: Schedules,
    entry: Mapped,
    taken: dict[str, str],
    stored: dict[str, Any],
    dry_run: bool,
) -> EntryResult:
    result = EntryResult(entry.name, NOT_MAPPED, entry.source, notes=list(entry.notes))
    if entry.problem is not None:
        result.reason = entry.problem
        return result
    if entry.skip is not None:
        result.status, result.reason = SKIPPED, entry.skip
        return result
    try:
        definition = entry.definition()
    except ConfigurationError as exc:
        result.reason = str(exc)
        return result
    result.schedule = definition.describe_schedule()
    result.paused = entry.paused
    result.definition = definition.fields()
    if entry.name in taken:
        result.status = SKIPPED
        result.reason = f"{taken[entry.name]} has the name: code entries stay code-defined"
        return result
    existing = stored.get(entry.name)
    if existing is not None:
        if existing.definition.body() == definition.body():
            result.status = ALREADY_IMPORTED
        else:
            result.status = SKIPPED
            result.reason = (
                f"a stored job with another definition ({existing.definition.describe_schedule()}, "
                f"task {existing.definition.task}) has the name"
            )
        return result
    try:
        schedules.validate(definition)
        if not dry_run:
            schedules.add(
                entry.name,
                entry.task,
                entry.schedule,
                entry.args,
                entry.kwargs,
                entry.options,
                anarchon=entry.anarchon or None,
                paused=entry.paused,
                note=entry.note if entry.paused else None,
            )
    except JobExists as exc:  # added meanwhile, by someone else
        result.status = SKIPPED
        result.reason = str(exc)
        return result
    except ConfigurationError as exc:
        result.reason = str(exc)
        return result
    result.status = WOULD_IMPORT if dry_run else IMPORTED
    return result


def iso(at: datetime) -> str:
    """An aware datetime as the reports show it: ``2026-12-03T06:57:12Z`` (UTC)."""
    return at.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")
