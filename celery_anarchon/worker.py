"""Worker integration: the start gate, run states and lease heartbeats.

Install it with one line in the module that creates the Celery app (the
module ``celery -A proj worker`` imports), after the app exists::

    app = Celery("proj")
    celery_anarchon.worker.install(app)

Celery offers no clean way to run code in every worker of one app without
a line in the app's module: worker bootsteps and signal receivers are both
registered by user code, and an import-time hook through our ``celery``
command plugin would act on every worker of every app on the machine. So the
line is explicit; it costs nothing where no task runs (beat, web processes):
the backend is built lazily, at the first worker start or the first run.

What it does, for each message that carries the ``anarchon_job``,
``anarchon_slot`` (epoch ms) and ``anarchon_token`` headers that the
scheduler adds (:func:`celery_anarchon.scheduler.send_slot`); other messages
are untouched:

* **Start gate.** Before the task body runs, ``mark(claim, RUNNING)`` on the
  claim backend, fenced by the message's token. False means the slot
  already started (a second publish of one slot, see docs/exactly-once.md) or the
  token was superseded by a backup runner: the delivery is discarded, the
  body does not run, a WARNING is logged, and history keeps the first run's
  state. The gate raises :class:`celery.exceptions.Ignore` from the task's
  ``before_start`` (inside Celery's trace, where ``Ignore`` acks the message
  and stores nothing; a signal receiver cannot stop a task, since
  ``Signal.send`` swallows its exceptions). :func:`install` puts that
  ``before_start`` on the class of every task of the app (each
  ``@app.task`` has a class of its own), wrapping any ``before_start`` the
  task defines, so custom ``base=`` classes are covered too.
* **States.** ``succeeded`` (``task_success``) or ``failed`` with the error
  as ``"<exception type>: <message>"``, at most :data:`ERROR_MAX_CHARS`
  characters (``task_failure``; also sent by the worker's main process when
  a pool process dies mid-task or hits its hard time limit, so those runs
  are recorded ``failed`` with ``WorkerLostError``/``TimeLimitExceeded``).
  A body that raises ``Ignore`` itself (``self.replace()``, say) is recorded
  ``succeeded``: its own work is done.
* **Per delivery.** Start, heartbeats and finish belong to the delivery
  that passed the gate: its request holds the run. Two deliveries of one
  slot share the task id (and, for a second publish by the same owner, the
  token), so in a pool that runs several tasks in one process (threads,
  gevent, eventlet) a discarded duplicate's ``task_postrun`` must not, and
  does not, touch the original still running beside it.
* **Revoked.** ``task_revoked`` (worker's main process): a message that
  expired before a worker took it, or was revoked by id before it ran, never
  runs; its run is recorded ``lost`` with the reason, if its record is still
  ``claimed`` or ``sent`` under the message's token (another delivery of the
  slot that started is left alone). ``revoke(terminate=True)`` of a running
  task records ``failed`` (``Terminated: ...``).
* **Heartbeat.** While a gated run executes, a daemon thread in that worker
  process calls :meth:`~celery_anarchon.backends.base.Backend.extend` every
  ``lease_ttl / 3`` seconds, keeping the run's lease ``lease_ttl`` ahead of
  the backend's clock. A run whose lease expires (its worker died or froze)
  is treated as dead by the scheduler's overlap logic (recorded ``lost``).
* **Fork safety.** Each process builds its own backend client: after the
  prefork pool forks a child (``worker_process_init``), the inherited
  client is dropped without touching the parent's connections and a new
  one is made on first use; a process id check catches any other fork.
  The prefork pool's main process (which records revokes and pool
  process deaths) closes its client after each use, so a pool process it
  forks later (a replacement) never inherits an open one.

Released parked tasks (the ``anarchon_delayed`` header,
docs/delayed-tasks.md): the first delivery of a task id passes the gate and
later ones are discarded (:meth:`WorkerIntegration._gate_released`); each
retry of it is marked apart (:func:`released_mark`), so a retry parked by
:class:`~celery_anarchon.delayed.parking.ParkingTask` runs once. A parked
retry of a scheduled run carries both headers: it passes the released
gate, then the run's retry gate below.

Retry (``self.retry()``): the same slot, not a new run. The retried message
keeps the headers, so the plain gate would refuse it as a duplicate.
A delivery with ``request.retries > 0`` passes the gate when the run is
still ``running`` with its token (:meth:`Backend.extend`, i.e. running to
running for that token), or, if the first attempt was never recorded,
when ``mark(RUNNING)`` passes. A *redelivered* retry message (its worker
died, or a Redis ``visibility_timeout`` ran out while it ran) is gated like
any ``acks_late`` redelivery below, so it never runs beside a live attempt.
While the retry waits for its countdown the lease is extended by that
countdown plus ``lease_ttl``. A retry that reaches a worker after the run
was recorded ``lost`` (the lease ran out, e.g. the retry sat in a busy queue
for longer) is discarded.

``acks_late`` redelivery (a worker died mid-task; the broker delivers the
message again, to the same slot): the run is recorded ``running`` and the
plain gate refuses it. For a task with ``acks_late``, the delivery then
restarts the run when its lease has expired by the backend's clock (the
worker that ran it stopped heartbeating: it is dead), atomically, so of two
redeliveries one wins (:meth:`Backend.extend` with ``restart=True``), and
is discarded while the lease is live (the first worker is still running it:
e.g. a Redis broker's ``visibility_timeout`` shorter than the task). A Redis
broker redelivers after ``visibility_timeout`` (1 hour by default), long
after the lease expired: the run is restarted. RabbitMQ redelivers at once
when the consumer's connection drops; if the worker's main process died,
the lease is usually still live then, so the delivery is discarded and the
run ends up ``lost``. Without ``acks_late`` a message is acked before it
runs, so a crash loses the run (``lost``), as in plain Celery.

Backend unavailable at the gate: the task runs and a WARNING is logged
(availability; the default). A duplicate publish only happens in the rare
window where a scheduler froze for longer than ``lease_ttl`` between its
claim and its publish; refusing to run during a backend outage would turn
every outage into missed runs instead. ``anarchon_worker_strict = True``
discards the delivery instead (a missed run over a possible duplicate).

Message expiry (``anarchon_expires``) is computed by :func:`expires_for`
when the scheduler sends; Celery's worker then revokes a message that
arrives after its expiry, and the run is recorded ``lost`` (above). The
scheduler's overlap check stops counting a ``sent`` run as in flight once
its message expired (:func:`message_expiry_ms`, plus ``max_skew``).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, TypeVar

from celery import signals
from celery.exceptions import Ignore

from .backends import backend_from_settings
from .backends.base import Backend, Claim, LeaseBackend, State
from .exceptions import AnarchonError, ConfigurationError
from .message import (
    HEADER_DELAYED,
    HEADER_JOB,
    HEADER_PARKING,
    HEADER_SLOT,
    HEADER_TOKEN,
    expires_for,
    message_expiry_ms,
)
from .settings import Settings
from .times import iso as _iso

__all__ = [
    "ERROR_MAX_CHARS",
    "HEADER_JOB",
    "HEADER_SLOT",
    "HEADER_TOKEN",
    "WorkerIntegration",
    "claim_of",
    "expires_for",
    "install",
    "integration_of",
    "message_expiry_ms",
    "released_mark",
]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


#: Longest error text recorded for a failed run, characters.
ERROR_MAX_CHARS = 1000

#: Longest the start gate of a released parked task waits for its store to
#: answer, seconds; past it the task runs unchecked (or, strict, is
#: discarded). A duplicate publish needs the store back, so within this wait
#: two deliveries of one task never both run.
RELEASED_GATE_WAIT_S = 300.0

#: Heartbeats per lease: a run's lease is extended every ``lease_ttl / 3``.
HEARTBEATS_PER_LEASE = 3

#: Marks the ``before_start`` functions :func:`install` puts on task classes.
_GATE_MARK = "_anarchon_gate"

#: Request attributes: set once the gate looked at a request; the
#: :class:`_Run` of a request that passed it (None once finished).
_GATED_ATTR = "_anarchon_gated"
_RUN_ATTR = "_anarchon_run"

#: Integrations by app (an app has at most one; apps live as long as their
#: process, and so do their integrations).
_INSTALLED: dict[Any, WorkerIntegration] = {}


def install(app: Any) -> WorkerIntegration:
    """Install the worker integration on Celery ``app``; idempotent.

    Connects Celery's worker and task signals (filtered to ``app``) and puts
    the start gate on every task's class once the app is finalized. Reads
    the ``anarchon_*`` settings lazily, at worker start.

    Returns:
        the app's :class:`WorkerIntegration`.
    """
    integration = _INSTALLED.get(app)
    if integration is None:
        integration = WorkerIntegration(app)
        _INSTALLED[app] = integration
        integration.connect()
    return integration


def integration_of(app: Any) -> WorkerIntegration | None:
    """The integration installed on ``app``, or None."""
    return _INSTALLED.get(app)


def claim_of(request: Any) -> Claim | None:
    """The won claim a task request's anarchon headers describe, or None.

    Celery puts a message's custom headers on the request context, both as
    attributes and in ``request.headers``. A message without the headers, or
    with a token of None, gives None (untouched by the integration); a
    malformed slot is logged and gives None.
    """
    job, slot, token = (_header(request, name) for name in (HEADER_JOB, HEADER_SLOT, HEADER_TOKEN))
    if job is None or slot is None or token is None:
        return None
    try:
        slot_ms = int(slot)
    except (TypeError, ValueError):
        logger.warning(
            "anarchon: task %s has a malformed %s header %r; running it unchecked",
            getattr(request, "id", None),
            HEADER_SLOT,
            slot,
        )
        return None
    return Claim(job=str(job), slot_ms=slot_ms, won=True, token=token)


def _header(request: Any, name: str) -> Any:
    """A custom header of a task request: Celery puts them on the request
    as attributes and in ``request.headers``."""
    value = getattr(request, name, None)
    if value is None:
        value = (getattr(request, "headers", None) or {}).get(name)
    return value


def error_text(exc: BaseException | None) -> str:
    """``"<exception type>: <message>"``, at most :data:`ERROR_MAX_CHARS`."""
    if exc is None:
        return "unknown error"
    text = f"{type(exc).__name__}: {exc}"
    if len(text) > ERROR_MAX_CHARS:
        text = text[: ERROR_MAX_CHARS - 1] + "\u2026"
    return text


@dataclass(frozen=True, eq=False)
class _Run:
    """A delivery that passed the start gate and executes in this process.

    Compared and hashed by identity: two deliveries of one slot carry the
    same task id and often the same token, and only the one that passed the
    gate owns the run. The request it runs under holds it as
    ``request._anarchon_run`` (:data:`_RUN_ATTR`).
    """

    claim: Claim
    lease_ms: int
    task_id: str


class WorkerIntegration:
    """The worker side of one Celery app: start gate, states, heartbeats.

    Made by :func:`install`; one per app. Thread-safe: the heartbeat thread
    and the task thread share the backend (redis-py and SQLAlchemy clients
    are thread-safe).
    """

    def __init__(self, app: Any) -> None:
        self.app = app
        self._backend: Backend | None = None
        self._backend_pid: int | None = None
        self._backend_ready = False
        self._settings: Settings | None = None
        self._lease_ms: dict[str, int] = {}
        self._runs: set[_Run] = set()
        #: The worker's main process when its pool forks children (prefork),
        #: else None: a backend client that process opens is closed after
        #: use, so no pool process it forks later inherits an open one.
        self._forking_main_pid: int | None = None
        self._backend_lock = threading.RLock()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._threads_pid = os.getpid()
        self._stopping = False

    # -- wiring --------------------------------------------------------------

    def connect(self) -> None:
        """Connect the signal receivers; put the gate on the tasks when the
        app is (or once it is) finalized."""
        uid = f"celery_anarchon.worker:{id(self)}"
        signals.celeryd_after_setup.connect(self._on_worker_start, weak=False, dispatch_uid=uid)
        signals.worker_process_init.connect(self._on_fork, weak=False, dispatch_uid=uid)
        signals.worker_process_shutdown.connect(self._on_shutdown, weak=False, dispatch_uid=uid)
        signals.worker_shutdown.connect(self._on_shutdown, weak=False, dispatch_uid=uid)
        signals.task_success.connect(self._on_success, weak=False, dispatch_uid=uid)
        signals.task_failure.connect(self._on_failure, weak=False, dispatch_uid=uid)
        signals.task_retry.connect(self._on_retry, weak=False, dispatch_uid=uid)
        signals.task_postrun.connect(self._on_postrun, weak=False, dispatch_uid=uid)
        signals.task_revoked.connect(self._on_revoked, weak=False, dispatch_uid=uid)
        self.app.on_after_finalize.connect(self._gate_tasks, weak=False, dispatch_uid=uid)
        if self.app.finalized:
            self._gate_tasks()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._forget_threads)

    def _gate_tasks(self, *args: Any, **kwargs: Any) -> None:
        """Put the start gate on the class of every task of the app."""
        for task in list(self.app.tasks.values()):
            _add_gate(type(task))

    # -- the backend ---------------------------------------------------------

    @property
    def settings(self) -> Settings:
        """The app's settings, read once.

        Raises:
            ConfigurationError: a bad setting.
        """
        if self._settings is None:
            self._settings = Settings.from_app(self.app)
        return self._settings

    @property
    def backend_pid(self) -> int | None:
        """The process that built the current backend client, or None."""
        return self._backend_pid

    def backend(self) -> Backend:
        """This process's backend, built (and opened) on first use; built
        again in a process forked since.

        Raises:
            BackendUnavailable: it cannot be reached.
            ConfigurationError: a bad setting or backend URL.
        """
        with self._backend_lock:
            return self._open_backend()

    def _open_backend(self) -> Backend:
        if self._backend_pid != os.getpid():
            self._drop_backend()
        if self._backend is None:
            settings = self.settings
            self._backend = backend_from_settings(
                settings, instance=f"worker:{socket.gethostname()}:{os.getpid()}"
            )
            self._backend_pid = os.getpid()
            self._backend_ready = False
        if not self._backend_ready:
            self._backend.open()
            self._backend_ready = True
        return self._backend

    def _drop_backend(self) -> None:
        """Forget the backend client. One inherited from another process is
        closed the fork-safe way each backend documents (a forked child's
        ``close`` leaves the parent's sockets alone)."""
        backend, self._backend = self._backend, None
        self._backend_pid, self._backend_ready = None, False
        if backend is not None:
            try:
                backend.close()
            except Exception:  # pragma: no cover - best effort on a stale client
                logger.debug("anarchon: closing an inherited backend failed", exc_info=True)

    def lease_ms(self, job: str) -> int:
        """The lease of ``job``'s runs, milliseconds: its ``lease_ttl`` from
        ``beat_schedule[job]['anarchon']`` when the worker's config has the
        entry, else ``anarchon_lease_ttl``."""
        cached = self._lease_ms.get(job)
        if cached is not None:
            return cached
        settings = self.settings
        options = settings.defaults
        entry = (self.app.conf.beat_schedule or {}).get(job)
        if isinstance(entry, Mapping) and entry.get("anarchon"):
            try:
                options = settings.job_options(job, entry["anarchon"])
            except AnarchonError as exc:
                logger.warning("anarchon: %s; using the global lease_ttl", exc)
        self._lease_ms[job] = value = max(1, int(round(options.lease_ttl * 1000)))
        return value

    # -- the start gate ------------------------------------------------------

    def gate(self, task: Any) -> None:
        """The start gate for the current request of ``task``.

        Returns when the body may run (registering the run for heartbeats);
        raises :class:`~celery.exceptions.Ignore` to discard the delivery.
        A request without anarchon headers, an eager call, or a request
        gated once already, passes untouched.

        Raises:
            Ignore: the slot already started, its token was superseded, or
                (``anarchon_worker_strict``) the backend could not be asked.
        """
        request = task.request
        if request is None or getattr(request, "is_eager", False):
            return
        if getattr(request, _GATED_ATTR, False):
            return
        setattr(request, _GATED_ATTR, True)
        if _header(request, HEADER_DELAYED) is not None:
            self._gate_released(task, request)
        claim = claim_of(request)
        if claim is None:
            return
        task_id = str(request.id)
        try:
            lease_ms = self.lease_ms(claim.job)
            started = self._pass_gate(claim, task, request, lease_ms)
        except Exception as exc:  # backend down, bad setting, or a bug of ours
            if self._strict():
                logger.error(
                    "anarchon: discarded %s @ %s (task %s): the start gate could not be "
                    "checked (%s) and anarchon_worker_strict is set",
                    claim.job,
                    _iso(claim.slot_ms),
                    task_id,
                    exc,
                )
                raise Ignore() from None
            logger.warning(
                "anarchon: running %s @ %s (task %s) unchecked: the start gate could not "
                "be checked (%s); a second delivery of this slot would run too",
                claim.job,
                _iso(claim.slot_ms),
                task_id,
                exc,
            )
            self._start(request, _Run(claim, self._fallback_lease_ms(), task_id))
            return
        if not started:
            logger.warning(
                "anarchon: discarded a delivery of %s @ %s (task %s, token %s): %s; "
                "history keeps the first run's state",
                claim.job,
                _iso(claim.slot_ms),
                task_id,
                claim.token,
                self._why_refused(claim),
            )
            raise Ignore()
        self._start(request, _Run(claim, lease_ms, task_id))

    def _gate_released(self, task: Any, request: Any) -> None:
        """The start gate of a released parked task: the first delivery of
        its task id passes, any later one is discarded: a duplicate publish
        (a releaser's take-over), or the broker's redelivery of a message
        whose task started (its ack lost), unless the task has
        ``acks_late``, whose redelivery runs again as in plain Celery.

        A retry (``self.retry()``) keeps the task id, so the gate marks each
        attempt on its own, by :func:`released_mark` (the id and
        ``request.retries``): a retry runs once, whether Celery's countdown
        or a parked release delivered it, and a second delivery of that
        retry is discarded like any other.

        While the store does not answer, the gate waits for it, asking again
        with backoff, up to :data:`RELEASED_GATE_WAIT_S`: a second delivery
        can only be published once the store answers again, and then the
        two race on one mark, so exactly one runs. Past that wait the task
        runs unchecked (WARNING), or is discarded under
        ``anarchon_worker_strict``.

        Raises:
            Ignore: a later delivery, or (``anarchon_worker_strict``) the
                store could not be asked within the wait.
        """
        task_id = released_mark(str(request.id), request.retries, _header(request, HEADER_PARKING))
        first = self._mark_released(task_id)
        if first is None:
            if self._strict():
                logger.error(
                    "anarchon: discarded released task %s: the start gate could not be "
                    "checked within %gs and anarchon_worker_strict is set",
                    task_id,
                    RELEASED_GATE_WAIT_S,
                )
                raise Ignore()
            logger.warning(
                "anarchon: running released task %s unchecked: the start gate could not be "
                "checked within %gs; a second delivery of it would run too",
                task_id,
                RELEASED_GATE_WAIT_S,
            )
            return
        if first:
            return
        if _redelivered(request) and getattr(task, "acks_late", False):
            logger.warning(
                "anarchon: running released task %s again: the broker redelivered it and "
                "the task has acks_late",
                task_id,
            )
            return
        logger.warning(
            "anarchon: discarded a second delivery of released task %s (%s): it started already",
            task_id,
            getattr(request, "task", None) or "?",
        )
        raise Ignore()

    def _mark_released(self, task_id: str) -> bool | None:
        """``mark_started`` of a released task id, asked again with backoff
        while the store fails; None when it did not answer within
        :data:`RELEASED_GATE_WAIT_S`."""
        from .delayed import store_for

        deadline = time.monotonic() + RELEASED_GATE_WAIT_S
        pause = 0.1
        # One owner across the retries: a mark whose answer was lost (the
        # store wrote it, then the connection dropped) is found to be ours.
        owner = uuid.uuid4().hex
        while True:
            try:
                store, delayed = store_for(self.app)
                return store.mark_started(task_id, int(delayed.dedupe_ttl_s * 1000), owner)
            except ConfigurationError as exc:
                # Asking again cannot help: this worker's settings name no
                # store (a releaser elsewhere was configured with one).
                logger.error(
                    "anarchon: the start gate of released task %s has no store to ask: %s "
                    "Give this worker the same anarchon_backend / anarchon_delayed_backend "
                    "as the beats that release it.",
                    task_id,
                    exc,
                )
                return None
            except Exception as exc:  # the store is down
                left = deadline - time.monotonic()
                if left <= 0:
                    logger.warning("anarchon: the start gate of %s failed: %s", task_id, exc)
                    return None
                logger.warning(
                    "anarchon: the start gate of released task %s waits for the store (%s); "
                    "asking again in %.1fs",
                    task_id,
                    exc,
                    min(pause, left),
                )
                time.sleep(min(pause, left))
                pause = min(pause * 2, 5.0)

    def _pass_gate(self, claim: Claim, task: Any, request: Any, lease_ms: int) -> bool:
        backend = self.backend()
        if request.retries and not _redelivered(request):
            # A retry of a run that started: running -> running, same token.
            if not isinstance(backend, LeaseBackend) or backend.extend(claim, lease_ms):
                return True
            return backend.mark(claim, State.RUNNING)
        if backend.mark(claim, State.RUNNING):
            return True
        if (
            getattr(task, "acks_late", False)
            and isinstance(backend, LeaseBackend)
            and backend.extend(claim, lease_ms, restart=True)
        ):
            logger.warning(
                "anarchon: restarted %s @ %s (task %s): the run was recorded running but "
                "its lease expired (the worker that started it stopped), and the task "
                "has acks_late",
                claim.job,
                _iso(claim.slot_ms),
                request.id,
            )
            return True
        return False

    def _why_refused(self, claim: Claim) -> str:
        """Best effort, for the log: what the slot's record says."""
        try:
            records = [r for r in self.backend().history(claim.job) if r.slot_ms == claim.slot_ms]
        except Exception:
            return "the run already started or its token was superseded"
        if not records:
            return "the slot has no record (trimmed or released)"
        current = records[0]
        if current.token != claim.token:
            return f"token superseded by {current.token} (record {current.state})"
        if current.state in (State.MISSED, State.SKIPPED, State.LOST, State.SUPERSEDED):
            why = f": {current.error}" if current.error else ""
            return f"the slot is recorded {current.state}{why}, not to be run"
        return f"the run already started (record {current.state})"

    def _strict(self) -> bool:
        try:
            return self.settings.worker_strict
        except AnarchonError:
            return False

    def _fallback_lease_ms(self) -> int:
        try:
            return max(1, int(round(self.settings.defaults.lease_ttl * 1000)))
        except AnarchonError:
            return 30_000

    # -- runs and heartbeats -------------------------------------------------

    def _start(self, request: Any, run: _Run) -> None:
        """``request`` passed the gate: it owns ``run``; heartbeat it."""
        setattr(request, _RUN_ATTR, run)
        with self._lock:
            self._runs.add(run)
            self._ensure_thread()
        self._extend(run)
        self._wake.set()

    def _finish(self, request: Any) -> _Run | None:
        """The run ``request`` owns, now finished (no more heartbeats); None
        when the request owns none: it was discarded by the gate, carries no
        anarchon headers, was never gated in this process (the worker's main
        process reporting a pool process's death), or finished already."""
        run: _Run | None = getattr(request, _RUN_ATTR, None)
        if run is None:
            return None
        setattr(request, _RUN_ATTR, None)
        with self._lock:
            self._runs.discard(run)
        return run

    def _ensure_thread(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stopping = False
        self._thread = threading.Thread(
            target=self._heartbeat_loop, name="anarchon-heartbeat", daemon=True
        )
        self._thread.start()

    def _heartbeat_loop(self) -> None:
        while not self._stopping:
            with self._lock:
                runs = list(self._runs)
            interval = min(r.lease_ms for r in runs) / HEARTBEATS_PER_LEASE / 1000 if runs else None
            if self._wake.wait(interval):
                self._wake.clear()
                continue
            for run in runs:
                self._extend(run)

    def _extend(self, run: _Run) -> None:
        """Extend one run's lease; forget the run when it is no longer ours."""
        with self._lock:
            if run not in self._runs:
                return  # finished meanwhile
        try:
            backend = self.backend()
            if not isinstance(backend, LeaseBackend) or backend.extend(run.claim, run.lease_ms):
                return
        except Exception as exc:
            logger.warning(
                "anarchon: heartbeat of %s @ %s failed: %s",
                run.claim.job,
                _iso(run.claim.slot_ms),
                exc,
            )
            return
        with self._lock:
            if run not in self._runs:
                return  # finished meanwhile
            self._runs.discard(run)
        logger.warning(
            "anarchon: %s @ %s (task %s) is no longer running under token %s (its lease "
            "expired and it was recorded lost, or the slot was taken over); the task "
            "goes on, its outcome will not be recorded",
            run.claim.job,
            _iso(run.claim.slot_ms),
            run.task_id,
            run.claim.token,
        )

    # -- signal receivers ----------------------------------------------------

    def _ours(self, task: Any) -> bool:
        return getattr(task, "app", None) is self.app

    def _on_worker_start(self, instance: Any = None, **kwargs: Any) -> None:
        """Worker start (main process, ``celeryd_after_setup``: logging is
        set up, the pool not started yet): gate every task, including any
        registered after the app was finalized, then build and open the
        backend so a bad setting shows at start-up, not at the first run.
        """
        if getattr(instance, "app", None) is not self.app:
            return
        self._gate_tasks()
        if _forks_children(getattr(instance, "pool_cls", None)):
            self._forking_main_pid = os.getpid()
        try:
            description = self.backend().describe()
        except Exception as exc:
            logger.error("anarchon: worker integration: backend not ready: %s", exc)
            return
        finally:
            # Checked; closed again so that no connection is open when the
            # pool (or an embedded beat, -B) forks: a SQLite file opened
            # before a fork fails in the child ("locking protocol"). The
            # client is opened again on first use, in the process using it.
            self._drop_backend()
        logger.info("anarchon: worker integration ready: %s", description)

    def _on_fork(self, **kwargs: Any) -> None:
        """A pool process started: never use the parent's client here (the
        solo pool sends this signal in the worker's own process: no-op)."""
        if self._threads_pid != os.getpid():
            self._forget_threads()
        if self._backend_pid not in (None, os.getpid()):
            self._drop_backend()

    def _forget_threads(self) -> None:
        """In a forked child: the parent's threads do not exist here, and a
        lock one of them held would stay held."""
        self._backend_lock = threading.RLock()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread = None
        self._threads_pid = os.getpid()
        self._runs = set()

    def _on_shutdown(self, **kwargs: Any) -> None:
        self._stopping = True
        self._wake.set()
        if self._backend_pid == os.getpid():
            self._drop_backend()

    def _on_success(self, sender: Any = None, **kwargs: Any) -> None:
        if self._ours(sender):
            self._record(sender.request, State.SUCCEEDED)

    def _on_failure(
        self, sender: Any = None, exception: BaseException | None = None, **kwargs: Any
    ) -> None:
        if self._ours(sender):
            self._record(sender.request, State.FAILED, error=error_text(exception))

    def _on_retry(
        self, sender: Any = None, request: Any = None, reason: Any = None, **kwargs: Any
    ) -> None:
        """A retry is coming: keep the run's lease until it can start. Only
        the delivery that owns the run may (a retry signal for any other
        request, such as the main process cancelling a task when the broker
        connection is lost, leaves the lease to run out)."""
        if not self._ours(sender) or request is None:
            return
        run = self._finish(request)  # no heartbeat may shorten the lease now
        if run is None:
            return
        delay_ms = _retry_delay_ms(getattr(reason, "when", None))
        try:
            backend = self.backend()
            if isinstance(backend, LeaseBackend):
                backend.extend(run.claim, run.lease_ms + delay_ms)
        except Exception as exc:
            logger.warning(
                "anarchon: could not keep %s @ %s running for its retry: %s",
                run.claim.job,
                _iso(run.claim.slot_ms),
                exc,
            )

    def _on_postrun(self, sender: Any = None, state: str | None = None, **kw: Any) -> None:
        """The trace ends (its request is still the current one). A run that
        ``task_success``/``task_failure``/``task_retry`` did not finish is
        finished here; a discarded delivery owns none, so it touches nothing."""
        if not self._ours(sender):
            return
        run = self._finish(sender.request)
        if run is not None and state == "IGNORED":
            # The body raised Ignore itself (self.replace(), say): its part is done.
            self._mark(run.claim, State.SUCCEEDED, run.task_id)

    def _on_revoked(
        self,
        sender: Any = None,
        request: Any = None,
        terminated: bool = False,
        signum: Any = None,
        expired: bool = False,
        **kwargs: Any,
    ) -> None:
        """Celery revoked a delivery (worker's main process).

        Expired (``expires`` passed before a worker took the message) or
        revoked by id before it ran: the run never starts, so a record still
        ``claimed`` or ``sent`` under the message's token becomes ``lost``
        with the reason; a record that another delivery of the slot moved on
        (``running``, finished) is left alone. Revoked with
        ``terminate=True`` while running: the body was killed, recorded
        ``failed`` (fenced by the token, like a pool process's death).
        """
        if not self._ours(sender) or request is None:
            return
        claim = claim_of(request)
        if claim is None:
            return
        task_id = str(getattr(request, "id", None))
        if terminated:
            error = f"Terminated: revoked with terminate=True (signal {signum})"
            self._mark_from_main(claim, State.FAILED, task_id, error)
            return
        if expired:
            reason = f"expired before a worker took it (expires {_expires_text(request)})"
        else:
            reason = "revoked before a worker ran it"
        try:
            recorded = self._main_process_call(lambda b: _lose_unstarted(b, claim, reason))
        except Exception as exc:
            logger.error(
                "anarchon: could not record %s @ %s (task %s) lost (%s): %s",
                claim.job,
                _iso(claim.slot_ms),
                task_id,
                reason,
                exc,
            )
            return
        if recorded is None:
            logger.warning(
                "anarchon: %s @ %s (task %s) %s: recorded lost",
                claim.job,
                _iso(claim.slot_ms),
                task_id,
                reason,
            )
        else:
            logger.info(
                "anarchon: a delivery of %s @ %s (task %s) was %s; the run is %s, left alone",
                claim.job,
                _iso(claim.slot_ms),
                task_id,
                "expired" if expired else "revoked",
                recorded,
            )

    def _record(self, request: Any, state: State, error: str | None = None) -> None:
        """A finished state for ``request``: for the run it owns when it
        passed the gate in this process; for a request this process never
        gated (the worker's main process reporting a pool process's death or
        hard time limit), for the claim its headers name, fenced by token."""
        if request is None or getattr(request, "is_eager", False):
            return
        run = self._finish(request)
        if run is not None:
            self._mark(run.claim, state, run.task_id, error)
            return
        if getattr(request, _GATED_ATTR, False):
            return  # discarded by the gate, or no anarchon headers
        claim = claim_of(request)
        if claim is not None:
            self._mark_from_main(claim, state, str(request.id), error)

    def _main_process_call(self, call: Callable[[Backend], _T]) -> _T:
        """``call(backend)`` from the worker's main process. Where that
        process forks pool processes (prefork), its client is closed again
        right after, so a pool process forked later (a replacement, say)
        never inherits an open one (SQLite fails in such a child)."""
        if self._forking_main_pid != os.getpid():
            return call(self.backend())
        with self._backend_lock:
            try:
                return call(self._open_backend())
            finally:
                self._drop_backend()

    def _mark_from_main(
        self, claim: Claim, state: State, task_id: str, error: str | None = None
    ) -> None:
        try:
            done = self._main_process_call(lambda b: b.mark(claim, state, error=error))
        except Exception as exc:
            self._mark_failed(claim, state, task_id, exc)
            return
        if not done:
            self._mark_refused(claim, state, task_id)

    def _mark(self, claim: Claim, state: State, task_id: str, error: str | None = None) -> None:
        try:
            done = self.backend().mark(claim, state, error=error)
        except Exception as exc:
            self._mark_failed(claim, state, task_id, exc)
            return
        if not done:
            self._mark_refused(claim, state, task_id)

    @staticmethod
    def _mark_failed(claim: Claim, state: State, task_id: str, exc: Exception) -> None:
        logger.error(
            "anarchon: could not record %s for %s @ %s (task %s): %s",
            state,
            claim.job,
            _iso(claim.slot_ms),
            task_id,
            exc,
        )

    @staticmethod
    def _mark_refused(claim: Claim, state: State, task_id: str) -> None:
        logger.warning(
            "anarchon: %s @ %s (task %s) finished %s, but its record no longer "
            "takes it (recorded lost, or the token was superseded)",
            claim.job,
            _iso(claim.slot_ms),
            task_id,
            state,
        )


def _lose_unstarted(backend: Backend, claim: Claim, reason: str) -> str | None:
    """Record ``claim``'s run ``lost`` with ``reason`` when its record is
    still ``claimed`` or ``sent`` under ``claim.token``. Returns None when
    written, else what the record says (left alone), for the log.

    Read, then a fenced ``mark``: a second delivery of the slot passing the
    start gate between the two would be recorded ``lost`` while it runs
    (its heartbeat then logs that its outcome is not recorded); it never
    makes anything run twice.
    """
    records = [r for r in backend.history(claim.job) if r.slot_ms == claim.slot_ms]
    if not records:
        return "without a record (trimmed or released)"
    current = records[0]
    if current.token != claim.token:
        return f"{current.state} under token {current.token}"
    if current.state not in (State.CLAIMED, State.SENT):
        return str(current.state)
    if backend.mark(claim, State.LOST, error=reason):
        return None
    return "moved on meanwhile"


def _forks_children(pool_cls: Any) -> bool:
    """Whether a worker pool class forks pool processes (prefork)."""
    try:
        from celery.concurrency.prefork import TaskPool
    except Exception:  # pragma: no cover - billiard missing
        return False
    return isinstance(pool_cls, type) and issubclass(pool_cls, TaskPool)


def _expires_text(request: Any) -> str:
    expires = getattr(request, "expires", None)
    if isinstance(expires, datetime):
        return expires.isoformat()
    return str(expires)


def _add_gate(cls: type) -> None:
    """Put the start gate in front of ``cls.before_start`` (once)."""
    if getattr(cls.__dict__.get("before_start"), _GATE_MARK, False):
        return
    original = cls.before_start  # type: ignore[attr-defined]

    def before_start(self: Any, task_id: str, args: Any, kwargs: Any) -> Any:
        integration = _INSTALLED.get(self.app)
        if integration is not None:
            integration.gate(self)
        return original(self, task_id, args, kwargs)

    setattr(before_start, _GATE_MARK, True)
    before_start.__doc__ = original.__doc__
    before_start.__qualname__ = f"{cls.__qualname__}.before_start"
    cls.before_start = before_start  # type: ignore[attr-defined]


def released_mark(task_id: str, retries: Any, parking: Any = None) -> str:
    """What the start gate marks for one attempt of a released task:
    ``"<task id>#<parking>"`` (the random id of the parking, header
    :data:`~celery_anarchon.message.HEADER_PARKING`) for its first attempt,
    with ``"#retry<n>"`` after it for retry ``n`` (``request.retries``).
    So a task id parked again after it ran is marked anew (Celery runs a
    reused id again), the attempts of one parking are told apart, and no
    task id can be made to match another task's mark. A task parked before
    the parking id existed is marked ``"<task id>"`` (``#retry<n>``)."""
    count = retries if isinstance(retries, int) and not isinstance(retries, bool) else 0
    mark = f"{task_id}#{parking}" if isinstance(parking, str) and parking else task_id
    return mark if count <= 0 else f"{mark}#retry{count}"


def _redelivered(request: Any) -> bool:
    """Whether the broker delivers this message again (after a consumer
    died, or a Redis ``visibility_timeout``), not for the first time."""
    delivery_info = getattr(request, "delivery_info", None) or {}
    return bool(delivery_info.get("redelivered") or getattr(request, "redelivered", False))


def _retry_delay_ms(when: Any) -> int:
    """A retry's countdown (seconds) or eta (datetime) as ms from now."""
    if isinstance(when, datetime):
        target = when if when.tzinfo else when.replace(tzinfo=timezone.utc)
        return max(0, int((target - datetime.now(timezone.utc)).total_seconds() * 1000))
    if isinstance(when, (int, float)) and not isinstance(when, bool):
        return max(0, int(when * 1000))
    return 0
