"""The Python API for operators: jobs, history, last run, run now.

::

    from celery_anarchon.control import Control

    with Control(app) as control:
        control.history("nightly-report", limit=10)
        control.last_run("nightly-report")
        control.run_now("nightly-report")        # refused if one ran < 5 s ago
        control.run_now("nightly-report", key="deploy-42")  # once per key

The jobs are this app's ``beat_schedule`` entries and, on a backend that
keeps them, the stored jobs (docs/runtime-schedules.md), read once from the
backend when first asked for; a code entry wins over a stored job of the
same name, as on a beat that has both. The ``celery anarchon`` commands are
a thin layer over this class.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from .backends import backend_from_settings
from .backends.base import Backend, InstanceInfo, RunRecord, State
from .backends.store import StoredJobsStore
from .beat.registry import new_instance_id
from .exceptions import BackendMissing, ConfigurationError
from .message import manual_task_id, send_slot
from .model import Entry, Job, app_zone, build_jobs, jobs_from_stored
from .settings import Settings
from .stored import StoredState

__all__ = ["Control", "RunNowResult"]

logger = logging.getLogger(__name__)

#: How long a run-now key is remembered, milliseconds.
MANUAL_KEY_KEEP_MS = 24 * 3600 * 1000


@dataclass(frozen=True)
class RunNowResult:
    """What :meth:`Control.run_now` did.

    Attributes:
        job: the job's name.
        key: the run-now key used (without a key: the claim time, epoch ms).
        sent: True when this call sent the task; False when a call with the
            same key already did (on any host), or (``guarded``) a call
            without a key came less than ``anarchon_run_now_guard`` ago.
        task_id: the task id of the run (the same for every call with one
            key); when ``guarded``, the previous run's, or "" if unknown.
        slot_ms: the run's slot (the backend's now when it was claimed),
            epoch ms, or None when not sent by this call.
        guarded: True when refused by the run-now guard.
    """

    job: str
    key: str
    sent: bool
    task_id: str
    slot_ms: int | None
    guarded: bool = False


class Control:
    """Operator access to one app's jobs and their history.

    Attributes:
        code_jobs: the ``beat_schedule`` entries, by name (built without
            connecting).
        stored_problems: ``{name: error}`` of stored jobs this host cannot
            build or read (filled when :attr:`jobs` is first read).

    Args:
        app: the Celery app (its ``beat_schedule`` and ``anarchon_*``
            settings).
        schedule_filename: beat's ``-s`` file, when the default SQLite
            backend is used and beat runs with a non-default one.
        backend: an already-built backend (tests); default from settings.
    Raises:
        ConfigurationError: bad settings or schedules (as beat would refuse).
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
        self.instance_id = new_instance_id()
        self.backend = backend or backend_from_settings(self.settings, instance=self.instance_id)
        entries = {
            name: Entry(**dict(spec, name=name, app=app))
            for name, spec in (app.conf.beat_schedule or {}).items()
        }
        self.code_jobs: dict[str, Job] = build_jobs(entries, self.settings, app_zone(app))
        self.stored_problems: dict[str, str] = {}
        self._jobs: dict[str, Job] | None = None
        self._opened = False

    def __enter__(self) -> Control:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _open(self, *, create: bool = False) -> Backend:
        """The backend, opened; a read (``create=False``) never creates
        its store (see :meth:`require_backend`)."""
        if not self._opened:
            if not create:
                self.require_backend()
            self.backend.open()
            self._opened = True
        return self.backend

    def require_backend(self) -> None:
        """Check that the backend's store exists, without creating it.

        Raises:
            BackendMissing: a SQLite file that is not there: beat creates
                it on its first start; a command run from another folder
                than beat's reads another default path.
        """
        if not self.backend.exists():
            raise BackendMissing(
                f"{self.backend.describe()} does not exist: beat creates it on its first "
                "start. Run the command where beat runs, with beat's -s file "
                "(`celery -A proj anarchon -s FILE ...`), or set anarchon_backend to the "
                "shared backend beat uses."
            )

    @property
    def keeps_stored_jobs(self) -> bool:
        """True when the backend keeps stored jobs (every lease backend;
        RabbitMQ, claim-only, keeps none)."""
        return isinstance(self.backend, StoredJobsStore)

    @property
    def jobs(self) -> dict[str, Job]:
        """Every job by name: the code entries, then the stored jobs whose
        names no code entry has, each with its pause state.

        The first read reads the stored jobs and pause states from the
        backend, when it keeps them; it creates nothing (no SQLite file:
        the code entries alone). A stored job this host cannot build is
        left out and named in :attr:`stored_problems`.

        Raises:
            BackendUnavailable: the backend keeps stored jobs and does not
                answer.
        """
        if self._jobs is None:
            self._jobs = self._read_jobs()
        return self._jobs

    def read_jobs(self) -> dict[str, Job]:
        """:attr:`jobs` read again from the backend, for a long-lived
        caller (the web page) that must see stored jobs and pauses changed
        since its last read; :attr:`jobs` answers this read from then on.

        Raises:
            BackendUnavailable: as :attr:`jobs`.
        """
        self._jobs = self._read_jobs()
        return self._jobs

    def _read_jobs(self) -> dict[str, Job]:
        jobs = dict(self.code_jobs)
        if not self.keeps_stored_jobs or (not self._opened and not self.backend.exists()):
            return jobs
        store = self._open()
        assert isinstance(store, StoredJobsStore)
        state = StoredState()
        state.apply(store.stored_changes(0))
        zone = app_zone(self.app)
        # The code entry wins, as on a beat that has both.
        stored = [s for name, s in sorted(state.jobs.items()) if name not in jobs]
        built, problems = jobs_from_stored(stored, self.app, self.settings, zone)
        problems.update(state.unreadable)
        jobs.update(built)
        for name, pause in state.pauses.items():
            if name in jobs:
                jobs[name].pause = pause
        self.stored_problems = problems
        return jobs

    def job(self, name: str) -> Job:
        """The job called ``name``: a code entry, else a stored job.

        Raises:
            ConfigurationError: no code entry nor stored job has the name.
            BackendUnavailable: the stored jobs cannot be read.
        """
        try:
            return self.jobs[name]
        except KeyError:
            known = ", ".join(sorted(self.jobs)) or "none"
            raise ConfigurationError(
                f"no job named {name!r} in beat_schedule nor among the stored jobs "
                f"(known: {known})."
            ) from None

    def history(self, job: str, limit: int | None = None) -> list[RunRecord]:
        """``job``'s history, newest slot first, at most ``limit`` records.

        Works for a job no longer in ``beat_schedule`` or removed from the
        stored jobs too (its history stays).

        Empty, and nothing created, when the SQLite file does not exist yet.

        Raises:
            BackendUnavailable: the backend does not answer.
        """
        if not self._opened and not self.backend.exists():
            return []
        return self._open().history(job, limit)

    def last_run(self, job: str) -> RunRecord | None:
        """The newest run of ``job`` that was really sent, or None.

        None, and nothing created, when the SQLite file does not exist yet.

        Raises:
            BackendUnavailable: the backend does not answer.
        """
        if not self._opened and not self.backend.exists():
            return None
        return self._open().last_run(job)

    def run_now(self, job: str, key: str | None = None) -> RunNowResult:
        """Send ``job``'s task now, once per ``key`` across all hosts.

        Args:
            job: the job's name: a ``beat_schedule`` entry or a stored job.
            key: calls with the same key send once. Without a key, the call
                is refused while the job's previous call without a key is
                younger than ``anarchon_run_now_guard`` (5 s by default),
                judged atomically in the backend, so a double click sends
                once whatever second each click falls in.
        Returns:
            a :class:`RunNowResult`.
        Raises:
            ConfigurationError: unknown job, or an empty ``key``.
            BackendUnavailable: the backend does not answer (nothing sent).
            Exception: the broker refused the send (recorded as ``lost``).
        """
        target = self.job(job)
        if key == "":
            raise ConfigurationError(f"run_now({job!r}): the key must not be empty.")
        backend = self._open(create=True)
        if key is None:
            guard_ms = round(self.settings.run_now_guard * 1000)
            if guard_ms > 0 and not backend.take_run_now_guard(job, guard_ms):
                previous = next((r for r in backend.history(job, 20) if r.manual_key), None)
                task_id = (previous.task_id or "") if previous else ""
                key = previous.manual_key or "" if previous else ""
                return RunNowResult(job, key, False, task_id, slot_ms=None, guarded=True)
            key = str(backend.now_ms())
        task_id = manual_task_id(job, key, namespace=backend.namespace)
        claim = backend.claim_manual(job, key, backend.now_ms() + MANUAL_KEY_KEEP_MS)
        if not claim.won:
            return RunNowResult(job, key, sent=False, task_id=task_id, slot_ms=None)
        try:
            send_slot(
                self.app,
                target.entry,
                job=job,
                slot_ms=claim.slot_ms,
                token=claim.token,
                task_id=task_id,
            )
        except Exception as exc:
            backend.mark(claim, State.LOST, task_id=task_id, error=f"send failed: {exc!r}")
            raise
        backend.mark(claim, State.SENT, task_id=task_id)
        logger.info("anarchon: run-now sent %s (key %s, id %s)", job, key, task_id)
        return RunNowResult(job, key, sent=True, task_id=task_id, slot_ms=claim.slot_ms)

    def instances(self) -> list[InstanceInfo]:
        """The live scheduler instances (lease backends keep a registry)."""
        return self._open().instances()

    def definitions(self, instance: str) -> dict[str, str]:
        """The per-job definition hashes a live instance stored in the
        registry, ``{job: hash}`` (empty when none)."""
        return self._open().definitions(instance)

    def close(self) -> None:
        """Close the backend connection. Safe to call twice."""
        self.backend.close()
        self._opened = False
