"""The releaser: the thread in every beat instance that publishes parked
tasks when they are due (docs/delayed-tasks.md).

Every live instance releases every shard, with no preferred owner: the
store hands each due task to one taker at a time, under a lease and a
fencing token. A releaser

1. takes up to ``anarchon_delayed_batch`` due tasks (:meth:`DelayedStore.take_due`),
2. publishes them as ordinary Celery messages on a broker connection of its
   own, through the batched send path (:class:`~celery_anarchon.beat.batch.BatchWriter`),
3. deletes the published ones (:meth:`DelayedStore.finish`, fenced), and
   gives the others back with a backoff (:meth:`DelayedStore.give_back`),

and otherwise sleeps until the store's earliest due time, woken early by
the backend's push when a task is parked earlier than that; it never sleeps
longer than ``anarchon_delayed_poll`` (the bound on lateness when a push is
missed). A releaser that dies between taking and deleting loses its lease
when it expires, and another takes the tasks over: those may be published
twice (counted as ``taken_over``), and the worker integration discards the
second delivery.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from kombu.exceptions import EncodeError

from ..beat.batch import UNSENDABLE, UNSENT, BatchWriter, Outcome, publish_failure
from ..exceptions import BackendUnavailable
from ..message import HEADER_DELAYED, HEADER_PARKING, bounded_connection
from ..metrics import Metrics
from .model import ParkedTask, Taken
from .settings import DelayedSettings
from .store import DelayedStore, Listener

__all__ = ["Releaser", "ReleaseCounts", "send_parked", "backoff_s"]

logger = logging.getLogger(__name__)


#: Longest single wait on the push connection, seconds: how soon a stop is
#: noticed (a blocking read on an idle socket costs no CPU).
STOP_CHECK_S = 1.0

#: How long after the earliest due time a releaser wakes, seconds: the
#: tasks due meanwhile go in the same round (at a steady 1,000 due a second,
#: about 10 per round instead of one), for that much lateness.
COALESCE_S = 0.01

#: Shortest wait after a round that took nothing while something is due
#: (another releaser holds it, uncommitted), seconds: no busy loop.
MIN_WAIT_S = 0.01

#: While the broker cannot be reached, the releaser takes nothing and tries
#: the broker again this often, seconds (tasks a broken connection stopped
#: mid-batch are given back, not counted, for as long).
BROKER_RETRY_S = 1.0

#: No publish starts past this share of a batch's lease: the rest is given
#: back, so a slow releaser never publishes what another may take over.
PUBLISH_BY = 0.8


def backoff_s(attempts: int, settings: DelayedSettings) -> float:
    """Seconds before a task whose publish failed ``attempts`` times (at
    least 1) is tried again: 1, 2, 4, ... up to ``retries`` attempts, then
    ``stuck_retry`` (the task is marked stuck, and still parked)."""
    if attempts > settings.retries:
        return settings.stuck_retry_s
    return float(min(2 ** (attempts - 1), settings.stuck_retry_s))


def send_parked(
    app: Any,
    task: ParkedTask,
    producer: Any,
    namespace: str,
    *,
    body: dict[str, Any] | None = None,
    declare: Any = None,
) -> Any:
    """Publish one parked task through Celery (``apply_async`` of the
    registered task, else ``send_task``), with its task id, its kept
    options, and the :data:`HEADER_DELAYED` header; kombu's own retries
    off (the releaser retries, with backoff).

    Raises:
        Exception: what ``apply_async`` raises (broker errors; the
            serializer's ``EncodeError``; ``TypeError`` from the task's
            argument check).

    ``body`` is ``task.decoded()`` when the caller has it; ``declare``
    (when not None) is Celery's option of that name (``[]``: declare
    nothing, the route's queue was declared on this connection already).
    """
    body = task.decoded() if body is None else body
    options = dict(body.get("options") or {})
    headers = dict(options.pop("headers", None) or {})
    headers[HEADER_DELAYED] = namespace
    parking = body.get("parking")
    if parking:
        headers[HEADER_PARKING] = parking
    else:  # parked by a version before the parking id: the task id alone
        headers.pop(HEADER_PARKING, None)
    expires = options.get("expires")
    if isinstance(expires, str):
        options["expires"] = datetime.fromisoformat(expires)
    options["retry"] = False
    if declare is not None:
        options["declare"] = declare
    registered = app.tasks.get(task.task)
    if registered is not None:
        return registered.apply_async(
            body["args"],
            body["kwargs"],
            task_id=task.id,
            producer=producer,
            headers=headers,
            **options,
        )
    return app.send_task(
        task.task,
        body["args"],
        body["kwargs"],
        task_id=task.id,
        producer=producer,
        headers=headers,
        **options,
    )


@dataclass
class ReleaseCounts:
    """What one releaser did since it started (also in the metrics)."""

    released: int = 0
    taken_over: int = 0
    #: published, then found taken over by another releaser before the
    #: delete: the other may publish it too (a duplicate publish)
    superseded: int = 0
    failed: int = 0
    in_doubt: int = 0
    lateness_ms: list[int] = field(default_factory=list)


class Releaser:
    """One releaser thread (:meth:`start`, :meth:`stop`).

    Args:
        app: the Celery app (its broker, its tasks).
        store: the delayed store (the releaser's own, not beat's backend).
        settings: the delayed settings.
        owner: this instance's id (kept with each lease).
        metrics: where counts and lateness go.
        namespace: the store's namespace (the :data:`HEADER_DELAYED` value).
    """

    def __init__(
        self,
        app: Any,
        store: DelayedStore,
        settings: DelayedSettings,
        owner: str,
        metrics: Metrics | None = None,
        namespace: str = "",
    ) -> None:
        self.app = app
        self.store = store
        self.settings = settings
        self.owner = owner
        self.metrics = metrics or Metrics()
        self.namespace = namespace
        self.counts = ReleaseCounts()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._listener: Listener | None = None
        self._connection: Any = None
        self._producer: Any = None
        self._writer = BatchWriter(self._publish)
        self._declared: set[tuple[str, ...]] = set()
        self._down_since: float | None = None
        self._broker_down_since: float | None = None
        #: rounds in a row that took nothing while something was due
        self._empty_rounds = 0

    # -- the thread ----------------------------------------------------------

    def start(self) -> None:
        """Start the thread (a daemon: it never holds a process open)."""
        self._thread = threading.Thread(target=self._run, name="anarchon-delayed", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread and close its connections; a batch being
        published is finished first. Safe to call twice."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
        self._close_listener()
        self._drop_connection()
        self.store.close()

    def _run(self) -> None:
        logger.info(
            "anarchon: releasing parked tasks from %s (poll at most %gs)",
            self.store.describe(),
            self.settings.poll_s,
        )
        while not self._stop.is_set():
            try:
                if self.release_once():
                    self._empty_rounds = 0
                    if self._broker_down_since is None:
                        continue  # more may be due at once
                if self._broker_down_since is not None:
                    self._sleep(BROKER_RETRY_S)  # no broker: try it again, take nothing
                    continue
                wait_s = self._wait_s()
                if wait_s <= COALESCE_S:
                    # Due, yet nothing taken: another releaser holds it (a
                    # PostgreSQL row locked by its open transaction). Back
                    # off, doubling up to the poll bound: no busy loop.
                    wait_s = min(self.settings.poll_s, MIN_WAIT_S * 2**self._empty_rounds)
                    self._empty_rounds = min(self._empty_rounds + 1, 16)
                else:
                    self._empty_rounds = 0
                self._up()
            except BackendUnavailable as exc:
                self._down(exc)
                wait_s = min(self.settings.poll_s, 1.0)
            except Exception:
                logger.exception("anarchon: the releaser failed; again in 1 s")
                wait_s = 1.0
            self._sleep(wait_s)

    def _wait_s(self) -> float:
        """Seconds until the store's earliest due time (by its clock) plus
        :data:`COALESCE_S`, at most ``poll``."""
        due_in_ms = self.store.due_in_ms()
        if due_in_ms is None:
            return self.settings.poll_s
        return max(0.0, min(self.settings.poll_s, due_in_ms / 1000 + COALESCE_S))

    def _sleep(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        while not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                if self._listener is None:
                    self._listener = self.store.listener()
                if self._listener.wait(min(left, STOP_CHECK_S)):
                    return
            except BackendUnavailable as exc:
                logger.debug("anarchon: the releaser's push connection failed: %s", exc)
                self._close_listener()
                self._stop.wait(min(left, STOP_CHECK_S))

    def _close_listener(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()

    def _up(self) -> None:
        if self._down_since is not None:
            logger.warning(
                "anarchon: the delayed store answers again after %.1fs",
                time.monotonic() - self._down_since,
            )
            self._down_since = None

    def _down(self, exc: Exception) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
            logger.warning("anarchon: the releaser cannot reach the delayed store: %s", exc)

    # -- one round -----------------------------------------------------------

    def release_once(self) -> int:
        """Take what is due, publish it, delete or give back each; how many
        tasks were taken.

        Raises:
            BackendUnavailable: the store did not answer the take (nothing
                taken); a failed delete or give-back is left to lease expiry.
        """
        lease_ms = int(self.settings.lease_s * 1000)
        try:
            # The broker first: a releaser that cannot publish takes nothing,
            # so it never holds back what the other releasers would send.
            self._ensure_producer()
        except Exception as exc:
            self._drop_connection()
            self._broker_down(exc)
            return 0
        self._broker_up()
        taken = self.store.take_due(self.settings.batch, lease_ms, self.owner)
        if not taken:
            return 0
        started = time.monotonic()
        over = sum(1 for t in taken if t.taken_over)
        if over:
            self.counts.taken_over += over
            logger.warning(
                "anarchon: took over %d parked task(s) whose releaser's lease expired; "
                "they may have been published already (the worker gate discards a second "
                "delivery)",
                over,
            )
        outcomes = self._publish_all(taken, started, lease_ms)
        sent = [t for t, (o, _) in zip(taken, outcomes, strict=True) if o is Outcome.SENT]
        sent_at_ms = taken[0].now_ms + int((time.monotonic() - started) * 1000)
        try:
            kept = self.store.finish(sent)
        except BackendUnavailable as exc:
            logger.warning(
                "anarchon: %d published task(s) could not be deleted (%s); they are "
                "published again when their lease expires, and the worker gate discards that",
                len(sent),
                exc,
            )
            kept = [True] * len(sent)
        for task, still in zip(sent, kept, strict=True):
            if not still:
                self.counts.superseded += 1
            if not task.taken_over:
                self.counts.lateness_ms.append(max(0, sent_at_ms - task.task.due_ms))
        if sent:
            shown = ", ".join(f"{t.task.task}[{t.task.id}]" for t in sent[:3])
            logger.info(
                "anarchon: released %d parked task(s): %s%s",
                len(sent),
                shown,
                f" and {len(sent) - 3} more" if len(sent) > 3 else "",
            )
        self.counts.released += len(sent)
        self.metrics.delayed_released(len(sent), over)
        self._give_back_failed(taken, outcomes)
        return len(taken)

    def _publish_all(
        self, taken: Sequence[Taken], started: float, lease_ms: int
    ) -> list[tuple[Outcome, BaseException | None]]:
        def keep_going(_index: int) -> bool:
            return (time.monotonic() - started) * 1000 < lease_ms * PUBLISH_BY

        try:
            producer = self._ensure_producer()
        except Exception as exc:
            # No broker connection: nothing was tried, so no task's attempt
            # is counted (an outage never marks tasks stuck); all of them
            # are given back for BROKER_RETRY_S.
            self._drop_connection()
            self._broker_down(exc)
            return [(Outcome.UNTRIED, exc)] * len(taken)
        self._broker_up()
        if BatchWriter.mode(producer.connection) is not None:
            try:
                outcomes = self._writer.write(producer, taken, keep_going)
            except ValueError:
                outcomes = self._publish_each(producer, taken, keep_going)
        else:
            outcomes = self._publish_each(producer, taken, keep_going)
        if self._writer.broken:
            self._writer.reset()
            self._drop_connection()
        return outcomes

    def _publish_each(
        self, producer: Any, taken: Sequence[Taken], keep_going: Any
    ) -> list[tuple[Outcome, BaseException | None]]:
        outcomes: list[tuple[Outcome, BaseException | None]] = [(Outcome.UNTRIED, None)] * len(
            taken
        )
        for index, item in enumerate(taken):
            if not keep_going(index):
                break
            try:
                self._publish(item, producer)
            except Exception as exc:
                kind = publish_failure(exc, True)
                if kind == UNSENDABLE:
                    outcomes[index] = (Outcome.REFUSED, exc)
                    continue
                outcomes[index] = (
                    (Outcome.NOT_SENT if kind == UNSENT else Outcome.IN_DOUBT),
                    exc,
                )
                self._drop_connection()
                break
            outcomes[index] = (Outcome.SENT, None)
        return outcomes

    def _publish(self, item: Taken, producer: Any) -> None:
        """The batch writer's publish: one task's message, its queue
        declared only by the first message of its route on this connection
        (as beat's publisher does: the messages are the same, and kombu
        declaring before each publish costs a fifth of a batch's CPU)."""
        try:
            body = item.task.decoded()
        except Exception as exc:  # kombu's DecodeError, a class the process lacks, ...
            # That task's own failure (refused, like a serializer's refusal),
            # never the batch's or the broker's.
            raise EncodeError(f"the parked payload cannot be decoded here: {exc!r}") from exc
        options = body.get("options") or {}
        route = (
            item.task.task,
            repr(options.get("queue")),
            repr(options.get("exchange")),
            repr(options.get("routing_key")),
        )
        declared = route in self._declared
        send_parked(
            self.app,
            item.task,
            producer,
            self.namespace,
            body=body,
            declare=[] if declared else None,
        )
        if not declared and not self.app.conf.task_routes and self._cached(options.get("queue")):
            self._declared.add(route)

    def _cached(self, queue: Any) -> bool:
        """True when kombu caches the declaration of ``queue`` (a name or
        None for the default): not for one that expires."""
        if queue is None:
            queue = self.app.conf.task_default_queue
        found = self.app.amqp.queues.get(queue) if isinstance(queue, str) else queue
        if found is None or getattr(found, "expires", None) is not None:
            return False
        return bool(getattr(found, "can_cache_declaration", False))

    def _give_back_failed(
        self, taken: Sequence[Taken], outcomes: Sequence[tuple[Outcome, BaseException | None]]
    ) -> None:
        """Give back what was not published: a failed publish after its
        backoff (refused by Celery: after ``stuck_retry``), counted; one
        never tried (the batch stopped before it) at once, not counted."""
        groups: dict[tuple[float, str, bool], list[Taken]] = {}
        for item, (outcome, error) in zip(taken, outcomes, strict=True):
            if outcome is Outcome.SENT:
                continue
            if outcome is Outcome.UNTRIED:
                # never tried: at once, or (no broker) after BROKER_RETRY_S
                delay = 0.0 if error is None else BROKER_RETRY_S
                groups.setdefault((delay, "", False), []).append(item)
                continue
            attempts = item.task.attempts + 1
            self.counts.failed += 1
            if outcome is Outcome.REFUSED:
                delay, why = self.settings.stuck_retry_s, f"refused: {error!r}"
            else:
                if outcome is Outcome.IN_DOUBT:
                    self.counts.in_doubt += 1
                delay = backoff_s(attempts, self.settings)
                why = f"publish failed: {error!r}"
            if attempts > self.settings.retries:
                why = f"stuck after {attempts} attempts; {why}"
            groups.setdefault((delay, why, True), []).append(item)
        for (delay, why, failed), items in groups.items():
            retry_at = items[0].now_ms + int(delay * 1000)
            try:
                self.store.give_back(items, retry_at, why, failed=failed)
            except BackendUnavailable as exc:
                logger.warning(
                    "anarchon: %d task(s) not published could not be given back (%s); "
                    "they are taken again when their lease expires",
                    len(items),
                    exc,
                )
                continue
            if not failed:
                continue
            self.metrics.delayed_failed(len(items))
            shown = ", ".join(item.task.key or item.task.id for item in items[:5])
            logger.warning(
                "anarchon: %d parked task(s) not published (%s; %s%s); again in %gs",
                len(items),
                why,
                shown,
                ", ..." if len(items) > 5 else "",
                delay,
            )

    # -- the broker ----------------------------------------------------------

    def _broker_down(self, exc: BaseException) -> None:
        if self._broker_down_since is None:
            self._broker_down_since = time.monotonic()
            logger.warning(
                "anarchon: the releaser cannot reach the broker (%s); due tasks stay parked "
                "and are tried every %gs",
                exc,
                BROKER_RETRY_S,
            )

    def _broker_up(self) -> None:
        if self._broker_down_since is not None:
            logger.warning(
                "anarchon: the releaser reaches the broker again after %.1fs",
                time.monotonic() - self._broker_down_since,
            )
            self._broker_down_since = None

    def _ensure_producer(self) -> Any:
        if self._producer is None:
            connection = bounded_connection(self.app)
            try:
                connection.ensure_connection(max_retries=0)
            except Exception:
                connection.release()
                raise
            self._connection = connection
            self._producer = self.app.amqp.Producer(connection, auto_declare=False)
            self._declared = set()
        return self._producer

    def _drop_connection(self) -> None:
        self._producer = None
        self._writer.reset()
        connection, self._connection = self._connection, None
        if connection is not None:
            try:
                connection.release()
            except Exception as exc:  # a broken connection may not close cleanly
                logger.debug("anarchon: releasing a broken broker connection: %r", exc)
