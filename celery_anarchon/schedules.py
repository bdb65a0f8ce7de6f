"""The Python API for stored jobs: schedules that change at runtime.

::

    from celery_anarchon import Schedules

    with Schedules(app) as schedules:
        schedules.add("report", "proj.tasks.report", crontab(minute=0))
        schedules.update("report", schedule="*/30 * * * *")
        schedules.pause("report", note="billing freeze")
        schedules.resume("report")
        schedules.remove("report")

Stored jobs live in the claim backend (SQLite, PostgreSQL, MySQL or Redis)
and every running beat instance applies a change within a second of its
commit; a change holds from the first slot due at least 1 s after its
commit (docs/runtime-schedules.md). Each call validates what it is given
exactly as beat validates ``beat_schedule``, and writes nothing when it
refuses. The ``celery anarchon add|update|remove|pause|resume`` commands
are a thin layer over this class.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import logging
from dataclasses import dataclass
from typing import Any

from .backends import backend_from_settings
from .backends.base import Backend
from .backends.store import JOB, PAUSE, StoredJobsStore, StoredWrite
from .beat.registry import new_instance_id
from .checks import args_problem, check_backend_supports
from .exceptions import BackendMissing, ConfigurationError
from .model import Entry, app_zone, job_from_stored
from .settings import Settings
from .stored import (
    APPLY_DELAY_MS,
    Definition,
    Pause,
    StoredJob,
    StoredState,
    decode_schedule,
    stored_where,
)
from .times import iso

__all__ = ["JobExists", "NoSuchJob", "Schedules", "StoredJobsRefused", "JobView"]

#: A definition's bounds, kept with its per-job options (``'anarchon'``).
BOUNDS = ("start_at", "end_at", "max_runs")

logger = logging.getLogger(__name__)

#: The fields :meth:`Schedules.update` may change.
UPDATABLE = ("task", "schedule", "args", "kwargs", "options", "anarchon", *BOUNDS)


class JobExists(ConfigurationError):
    """``add`` of a name already taken by a stored job or a code entry."""


class NoSuchJob(ConfigurationError):
    """A call about a job that is not there."""


class StoredJobsRefused(ConfigurationError):
    """The claim backend cannot keep stored jobs (RabbitMQ, claim only)."""


def _stored_exists(name: str) -> JobExists:
    return JobExists(
        f"stored job {name!r} exists: update it (`celery anarchon update`, Schedules.update) "
        "or remove it first."
    )


@dataclass(frozen=True)
class JobView:
    """One job as :meth:`Schedules.get` and :meth:`Schedules.list` show it.

    Attributes:
        name: the job's name.
        source: ``"code"`` (``beat_schedule`` of this app, or of a live
            instance) or ``"stored"``.
        definition: a stored job's definition (None for code entries).
        version: a stored job's version, else 0.
        committed_ms: when a stored job was last written, epoch ms, else None.
        pause: its pause state, or None when never paused.
    """

    name: str
    source: str
    definition: Definition | None
    version: int = 0
    committed_ms: int | None = None
    pause: Pause | None = None

    @property
    def paused(self) -> bool:
        return self.pause is not None and self.pause.paused


class Schedules:
    """Add, update, pause, resume and remove jobs at runtime.

    Args:
        app: the Celery app (its ``anarchon_*`` settings and ``beat_schedule``).
        schedule_filename: beat's ``-s`` file, when the default SQLite backend
            is used and beat runs with a non-default one.
        backend: an already-built backend (tests); default from settings.
    Raises:
        StoredJobsRefused: the claim backend is RabbitMQ (claim only): stored
            jobs need a lease backend (Redis, PostgreSQL, MySQL or SQLite).
        ConfigurationError: bad settings.
    """

    def __init__(
        self,
        app: Any,
        *,
        schedule_filename: str | None = None,
        backend: Backend | None = None,
    ) -> None:
        self.app = app
        self.settings = Settings.from_app(app, schedule_filename=schedule_filename)
        self.backend = backend or backend_from_settings(self.settings, instance=new_instance_id())
        if not isinstance(self.backend, StoredJobsStore):
            source = (
                "anarchon_backend"
                if app.conf.get("anarchon_backend")
                else "the broker (anarchon_backend is unset)"
            )
            raise StoredJobsRefused(
                f"{self.backend.describe()}, taken from {source}, is claim-only and keeps no "
                "stored jobs or pause states. To add, update, pause or remove jobs at runtime, "
                "set anarchon_backend to a shared Redis, PostgreSQL or MySQL URL (claims move "
                "there too), e.g. anarchon_backend = 'redis://redis-host:6379/0'."
            )
        self._store: StoredJobsStore = self.backend
        self._zone = app_zone(app)
        self._opened = False

    def __enter__(self) -> Schedules:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the backend connection. Safe to call twice."""
        self.backend.close()
        self._opened = False

    def _open(self, *, create: bool) -> StoredJobsStore:
        if not self._opened:
            if not create and not self.backend.exists():
                raise BackendMissing(
                    f"{self.backend.describe()} does not exist: beat creates it on its first "
                    "start, and so does the first `add`."
                )
            self.backend.open()
            self._opened = True
        return self._store

    # -- validation -------------------------------------------------------------

    def _pinned(self, definition: Definition) -> Definition:
        """``definition`` with the app's zone written into a cron or crontab
        schedule that names none, so every host reads its wall clock in the
        same zone whatever its own ``timezone`` setting."""
        if "tz" in definition.schedule and not definition.schedule["tz"]:
            zone = str(getattr(self._zone, "key", "") or "UTC")
            return dataclasses.replace(definition, schedule={**definition.schedule, "tz": zone})
        return definition

    def validate(self, definition: Definition) -> None:
        """Refuse ``definition`` as beat would refuse it in ``beat_schedule``.

        Raises:
            ConfigurationError: a bad schedule, per-job option, a schedule
                that never fires, an option the backend cannot give, or
                arguments the task's signature or serializer refuses, naming
                the job and the fix.
        """
        name = definition.name
        job = job_from_stored(StoredJob(definition, 0, 0), self.app, self.settings, self._zone)
        check_backend_supports(self.backend, self.settings, job)
        entry = Entry(**dict(definition.entry_fields(), name=name, app=self.app))
        # The task's signature is checked only when it is registered: import
        # the modules a worker imports first, so a task of Celery's include
        # is checked in a fresh process too.
        registered = _registered(self.app, definition.task)
        problem = args_problem(self.app, name, entry)
        if problem is not None:
            where = f"beat_schedule[{name!r}]"
            raise ConfigurationError(problem.replace(where, stored_where(name)))
        # Its first slot is at or after the instant the change holds.
        now_ms = self.backend_now_ms() + APPLY_DELAY_MS
        if job.slots.next_after(now_ms - 1) is None:
            end = job.options.end_at_ms
            if end is not None and job.slots.next_after(-(2**62)) is not None:
                raise ConfigurationError(
                    f"{stored_where(name)}['anarchon']['end_at']: {iso(end)} leaves no slot "
                    f"after the change holds ({APPLY_DELAY_MS // 1000} s after it commits), so "
                    "it would never run. Fix: give a later end_at, or none."
                )
            raise ConfigurationError(
                f"{stored_where(name)}['schedule']: {definition.describe_schedule()} has no "
                f"slot after the change holds ({APPLY_DELAY_MS // 1000} s after it commits), so "
                "it would never run. Fix: give a time further in the future."
            )
        if not registered:
            logger.warning(
                "anarchon: stored job %s: task %r is not registered in this app (a typo?); "
                "beat sends it by name, and a worker without it refuses it",
                name,
                definition.task,
            )

    def backend_now_ms(self) -> int:
        """The backend's clock, epoch ms."""
        self._open(create=True)
        return self.backend.now_ms()

    def _code_names(self) -> set[str]:
        """Names of code entries: this app's ``beat_schedule`` and every live
        instance's (the registry keeps their definitions)."""
        names = set(self.app.conf.beat_schedule or {})
        for info in self.backend.instances():
            names.update(self.backend.definitions(info.instance))
        return names

    # -- writes -----------------------------------------------------------------

    def add(
        self,
        name: str,
        task: str,
        schedule: Any,
        args: Any = (),
        kwargs: Any = None,
        options: Any = None,
        anarchon: Any = None,
        paused: bool = False,
        note: str | None = None,
        start_at: Any = None,
        end_at: Any = None,
        max_runs: int | None = None,
    ) -> StoredJob:
        """Store a new job; every instance runs it from its first slot at or
        after 1 s past the commit.

        Args:
            name: the job's name (not a code entry's, nor a stored job's).
            task: the task's registered name.
            schedule: what ``beat_schedule`` takes: seconds, ``timedelta``,
                ``crontab``, a cron string, ``cron(..., tz=)``, ``solar``, an
                aware datetime.
            args, kwargs, options, anarchon: as in ``beat_schedule``.
            paused: store it paused (nothing runs until :meth:`resume`).
            note: the pause note, with ``paused``.
            start_at, end_at: no slot before ``start_at`` nor after
                ``end_at`` (aware datetimes, or ISO 8601 texts with a zone);
                kept under ``anarchon``, as a code entry keeps them.
            max_runs: most runs the cluster sends; then the job is finished.
        Returns:
            the stored job, with its version and commit time.
        Raises:
            ConfigurationError: a bad definition (:meth:`validate`).
            JobExists: a stored job or a code entry has the name.
            BackendUnavailable: no answer (retry: an add that committed
                answers JobExists).
        """
        bounds = {"start_at": start_at, "end_at": end_at, "max_runs": max_runs}
        anarchon = _with_bounds(anarchon, bounds)
        definition = Definition.build(name, task, schedule, args, kwargs, options, anarchon)
        definition = self._pinned(definition)
        store = self._open(create=True)
        self.validate(definition)
        if name in self._code_names():
            raise JobExists(
                f"{name!r} is a beat_schedule entry (in this app's code, or on a live "
                "instance): code entries stay code-defined. Pick another name, or change "
                "the code entry."
            )
        # One atomic step: the pause state (or the clearing of a removed
        # job's leftover) first, so no slot runs between the two, and
        # neither is written when the name is taken.
        pause_body = Pause(name, True, note or "").body() if paused else None
        written = store.write_stored_many(
            [StoredWrite(PAUSE, name, pause_body), StoredWrite(JOB, name, definition.body(), False)]
        )
        record = written[1] if written is not None else None
        if record is None:
            raise _stored_exists(name)
        logger.info("anarchon: stored job %s added (version %d)", name, record.version)
        return StoredJob(definition, record.version, record.committed_ms)

    def update(self, name: str, **changes: Any) -> StoredJob:
        """Change a stored job's fields; the rest stay.

        Args:
            name: the stored job.
            **changes: any of ``task``, ``schedule``, ``args``, ``kwargs``,
                ``options``, ``anarchon``, ``start_at``, ``end_at``,
                ``max_runs`` (None removes a bound).
        Returns:
            the stored job as written.
        Raises:
            ConfigurationError: an unknown field or a bad definition; the
                old definition stays in force.
            NoSuchJob: no stored job has the name (a code entry is changed
                in the code).
            BackendUnavailable: no answer.
        """
        unknown = sorted(set(changes) - set(UPDATABLE))
        if unknown:
            raise ConfigurationError(
                f"update({name!r}): unknown field(s) {', '.join(unknown)}; "
                f"give any of {', '.join(UPDATABLE)}."
            )
        store = self._open(create=False)
        current = store.stored_records([name], JOB).get(name)
        if current is None or current.body is None:
            raise self._no_such_job(name, "update")
        old = Definition.from_body(name, current.body)
        fields = {
            "task": old.task,
            "schedule": decode_schedule(old.schedule, job=name),
            "args": old.args,
            "kwargs": old.kwargs,
            "options": old.options,
            "anarchon": old.anarchon,
        }
        bounds = {key: changes.pop(key) for key in BOUNDS if key in changes}
        fields.update(changes)
        fields["anarchon"] = _with_bounds(fields["anarchon"], bounds, clear=True)
        definition = self._pinned(Definition.build(name, **fields))
        self.validate(definition)
        record = store.write_stored(JOB, name, definition.body(), exists=True)
        if record is None:
            raise self._no_such_job(name, "update")
        logger.info("anarchon: stored job %s updated (version %d)", name, record.version)
        return StoredJob(definition, record.version, record.committed_ms)

    def remove(self, name: str) -> int:
        """Remove a stored job; no slot at or after 1 s past the commit runs.
        Its history stays readable.

        Returns:
            the version of the removal.
        Raises:
            NoSuchJob: no stored job has the name.
            BackendUnavailable: no answer.
        """
        store = self._open(create=False)
        written = store.write_stored_many(
            [StoredWrite(JOB, name, None, True), StoredWrite(PAUSE, name, None)]
        )
        record = written[0] if written is not None else None
        if record is None:
            raise self._no_such_job(name, "remove")
        logger.info("anarchon: stored job %s removed (store version %d)", name, record.version)
        return record.version

    def pause(self, name: str, note: str | None = None) -> Pause:
        """Pause a job, code entry or stored job: from the first slot due at
        least 1 s after the commit, no instance claims or sends it, and its
        history records the pause once (with ``note``), not once per slot.
        Pausing a paused job changes nothing.

        Raises:
            NoSuchJob: neither a code entry (here or on a live instance)
                nor a stored job has the name.
            BackendUnavailable: no answer.
        """
        if note is not None and not isinstance(note, str):
            raise ConfigurationError(f"pause({name!r}): the note must be a string, got {note!r}.")
        store = self._open(create=True)
        current = self._pause_of(name)
        if current is not None and current.paused:
            return current
        self._require_job(name, "pause")
        record = store.write_stored(PAUSE, name, Pause(name, True, note or "").body())
        assert record is not None and record.body is not None
        logger.info("anarchon: job %s paused (store version %d)", name, record.version)
        return Pause.from_record(name, record.body, record.version, record.committed_ms)

    def resume(self, name: str) -> Pause:
        """Resume a paused job: its first slot is the first due at least 1 s
        after the commit; slots that passed while it was paused are not sent
        (unless its ``catch_up`` policy asks for them, docs/runtime-schedules.md).
        Resuming a running job changes nothing.

        Raises:
            NoSuchJob: no job has the name.
            BackendUnavailable: no answer.
        """
        store = self._open(create=True)
        current = self._pause_of(name)
        if current is None or not current.paused:
            self._require_job(name, "resume")
            return current or Pause(name, False)
        body = Pause(name, False, current.note, current.paused_ms).body()
        record = store.write_stored(PAUSE, name, body)
        assert record is not None and record.body is not None
        logger.info("anarchon: job %s resumed (store version %d)", name, record.version)
        return Pause.from_record(name, record.body, record.version, record.committed_ms)

    # -- reads ------------------------------------------------------------------

    def get(self, name: str) -> JobView:
        """One job, code entry or stored.

        Raises:
            NoSuchJob: no job has the name.
            BackendUnavailable: no answer.
        """
        for view in self.list(names=[name]):
            return view
        raise self._no_such_job(name, "get")

    def list(self, names: Any = None) -> list[JobView]:
        """Every job: this app's code entries and the stored jobs, by name.
        A name both in the code and stored shows the code entry (it wins on
        hosts that have it).

        Raises:
            BackendUnavailable: no answer.
        """
        state = self.state()
        code = set(self.app.conf.beat_schedule or {})
        views = {}
        for name in code:
            views[name] = JobView(name, "code", None, pause=state.pauses.get(name))
        for name, stored in state.jobs.items():
            if name not in views:
                views[name] = JobView(
                    name,
                    "stored",
                    stored.definition,
                    stored.version,
                    stored.committed_ms,
                    state.pauses.get(name),
                )
        wanted = sorted(views) if names is None else [n for n in names if n in views]
        return [views[n] for n in wanted]

    def state(self) -> StoredState:
        """The stored jobs and pause states as of now (empty, and nothing
        created, when the SQLite file does not exist yet).

        Raises:
            BackendUnavailable: no answer.
        """
        state = StoredState()
        if not self._opened and not self.backend.exists():
            return state
        state.apply(self._open(create=False).stored_changes(0))
        return state

    # -- helpers ----------------------------------------------------------------

    def _pause_of(self, name: str) -> Pause | None:
        record = self._store.stored_records([name], PAUSE).get(name)
        if record is None or record.body is None:
            return None
        return Pause.from_record(name, record.body, record.version, record.committed_ms)

    def _require_job(self, name: str, what: str) -> None:
        if self._store.stored_records([name], JOB):
            return
        if name in self._code_names():
            return
        raise self._no_such_job(name, what)

    def _no_such_job(self, name: str, what: str) -> NoSuchJob:
        if what in ("update", "remove") and name in (self.app.conf.beat_schedule or {}):
            return NoSuchJob(
                f"{what} {name!r}: {name!r} is a beat_schedule entry; code entries "
                "change in the code (pause and resume work on them)."
            )
        known = set(self.app.conf.beat_schedule or {})
        with contextlib.suppress(Exception):  # a suggestion is not worth a second error
            known |= set(self.state().jobs)
        close = difflib.get_close_matches(name, sorted(known), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        return NoSuchJob(f"{what} {name!r}: no stored job or code entry has that name.{hint}")


def _with_bounds(anarchon: Any, bounds: dict[str, Any], *, clear: bool = False) -> Any:
    """``anarchon`` with ``bounds`` set (None leaves a bound out; with
    ``clear``, None removes it)."""
    if not any(v is not None for v in bounds.values()) and not clear:
        return anarchon
    if anarchon is not None and not isinstance(anarchon, dict):
        return anarchon  # Definition.build refuses it, naming the job
    merged = dict(anarchon or {})
    for key, value in bounds.items():
        if value is not None:
            merged[key] = value
        elif clear and key in bounds:
            merged.pop(key, None)
    return merged


def _registered(app: Any, task: str) -> bool:
    """Whether ``task`` is registered in ``app`` once the modules a worker
    imports (``include``, ``imports``) are imported, as a worker imports
    them (``app.loader.import_default_modules``); True when they cannot
    be imported here (nothing to judge by)."""
    if task in app.tasks:
        return True
    try:
        app.loader.import_default_modules()
    except Exception:  # the user's modules: a worker would report it
        return True
    return task in app.tasks
