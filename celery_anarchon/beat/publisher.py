"""Publishing: a won slot to Celery's broker, at most once.

The :class:`Publisher` sends a batch's won claims in order, each through
:func:`~celery_anarchon.message.send_slot` on beat's own producer, bounded in
time (a broker that is away never blocks a tick for long) and never
repeated once it may have reached the broker (docs/exactly-once.md: in
doubt, never send twice). A send that fails is left to a backup on a lease
backend; one in doubt, or one whose arguments the serializer refuses, is
recorded ``lost`` at once (:func:`publish_failure`, the one rule).

The age of a won claim is judged by one rule (:func:`held_past`), against
the shares of its lease named below.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from ..backends.base import Claim, State
from ..exceptions import BackendUnavailable
from ..message import send_slot, task_id_for
from ..metrics import Metrics
from ..model import Job
from ..times import iso as _iso
from ..times import ms as _ms
from .agenda import SEND_FAILED, Agenda, Slot
from .batch import IN_DOUBT, UNSENDABLE, UNSENT, BatchWriter, Outcome, publish_failure
from .claiming import Claimer
from .journal import Journal
from .link import BackendLink
from .registry import HAND_OVER_MARGIN

__all__ = [
    "GIVE_BACK_SHARE",
    "IN_DOUBT",
    "PUBLISH_ATTEMPTS",
    "PUBLISH_BY",
    "PUBLISH_PAUSE",
    "UNSENDABLE",
    "UNSENT",
    "VERIFY_SHARE",
    "Publisher",
    "held_past",
    "publish_failure",
]

logger = logging.getLogger(__name__)

#: Attempts of one publish, each on a broker connection made afresh after a
#: failure with one connect attempt (bounded by
#: ``broker_connection_timeout``); after a publish failed, further sends
#: fail at once for PUBLISH_PAUSE seconds, so a tick with many won slots and
#: an unreachable broker is not blocked once per slot.
PUBLISH_ATTEMPTS = 2
PUBLISH_PAUSE = 1.0

#: The staleness rule's marks, shares of a claim's lease it has been held
#: (:func:`held_past`). The later, the likelier a backup takes the slot
#: over at the lease's end and publishes it too:
#:
#: * a batch still sending past GIVE_BACK_SHARE of its shortest lease (this
#:   instance is slower than measured) gives the rest back, to be claimed
#:   afresh with a full lease;
#: * a send starting past VERIFY_SHARE first asks the backend whether the
#:   claim still holds (its token current, a tenth of the lease left);
#: * no publish starts past PUBLISH_BY: the slot is left to a backup.
GIVE_BACK_SHARE = 1 / 3
VERIFY_SHARE = 1 / 2
PUBLISH_BY = 0.8


def held_past(held_s: float, lease_s: float, share: float) -> bool:
    """The staleness rule: True when a claim held ``held_s`` seconds has
    used more than ``share`` of its ``lease_s`` second lease."""
    return held_s > lease_s * share


class _StaleClaim(Exception):
    """A won claim was held too long to publish (past :data:`PUBLISH_BY`)."""

    def __init__(self, held_s: float) -> None:
        super().__init__(f"claim held {held_s:.1f}s")
        self.held_s = held_s


class _PublishInDoubt(Exception):
    """A publish failed after it may have reached Celery's broker (the
    connection broke or timed out during or after the write): sending it
    again, here or by a backup, could publish the slot twice."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(repr(cause))
        self.cause = cause


class _Unsendable(Exception):
    """A slot's message was refused before it was written: its args or
    kwargs (:data:`UNSENDABLE`)."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(repr(cause))
        self.cause = cause


class _WriteRules:
    """The send path's age rules for one :meth:`BatchWriter.write` of
    ``pending`` slots claimed at ``claimed_at`` (see
    :meth:`Publisher._send_batched`)."""

    def __init__(
        self, publisher: Publisher, pending: Sequence[Slot], claimed_at: float, lease_s: float
    ) -> None:
        self._publisher = publisher
        self._pending = pending
        self._claimed_at = claimed_at
        self._lease_s = lease_s
        #: the batch went past GIVE_BACK_SHARE: what was not tried is given back
        self.gave_back = False
        #: slots of a write given up past VERIFY_SHARE / PUBLISH_BY
        self.stale: list[Slot] = []

    def _held_s(self) -> float:
        return self._publisher._clock() - self._claimed_at

    def keep_going(self, index: int) -> bool:
        """May ``pending[index]`` (and those after it) still be buffered?"""
        if held_past(self._held_s(), self._lease_s, GIVE_BACK_SHARE):
            self.gave_back = True
            return False
        if Publisher.before_send is not None:
            Publisher.before_send(self._pending[index])
        return True

    def may_write(self, indexes: Sequence[int]) -> bool:
        """May the write of ``pending[i] for i in indexes`` go ahead?"""
        held_s = self._held_s()
        if not held_past(held_s, self._lease_s, VERIFY_SHARE):
            return True
        chunk = [self._pending[i] for i in indexes]
        if not held_past(held_s, self._lease_s, PUBLISH_BY) and all(
            self._publisher._still_hold(chunk)
        ):
            return True
        self.stale.extend(chunk)
        return False


class Publisher:
    """Sends won slots; owns the publish pause and the failed sends.

    Args:
        app: the Celery app.
        instance_id: this instance, for the log line of a send.
        link: the backend.
        claimer: the held claims (a published claim is no longer held) and
            give-back.
        journal: where sends, and sends lost, are recorded.
        agenda: where a failed send's close is planned.
        metrics: counters.
        clock: seconds since the epoch.
        producer: beat's producer (Celery's ``Scheduler.producer``;
            connects if needed, bounded).
        drop_producer: forget the producer and its connection after a
            failed publish, so the next one makes both afresh.
        connection: beat's broker connection, not connected by the call
            (Celery's ``Scheduler.connection``): its transport decides the
            send path (:meth:`BatchWriter.mode`); None: message by message.
    """

    #: Called with each slot right before it is sent (a seam for tests that
    #: widen the window between claim and send); None in production.
    before_send: ClassVar[Callable[[Slot], None] | None] = None

    def __init__(
        self,
        app: Any,
        instance_id: str,
        link: BackendLink,
        claimer: Claimer,
        journal: Journal,
        agenda: Agenda,
        metrics: Metrics,
        clock: Callable[[], float],
        producer: Callable[[], Any],
        drop_producer: Callable[[], None],
        connection: Callable[[], Any] | None = None,
    ) -> None:
        self._app = app
        self._instance_id = instance_id
        self._link = link
        self._claimer = claimer
        self._journal = journal
        self._agenda = agenda
        self._metrics = metrics
        self._clock = clock
        self._producer = producer
        self._drop_producer = drop_producer
        self._connection = connection
        #: no publish is tried before this time.monotonic() (broker away), and why
        self._paused_until = 0.0
        self._pause_reason = ""
        #: claims whose send failed, left to a backup, by (job, slot)
        self.failed: dict[tuple[str, int], Slot] = {}
        #: the batched send path (Redis pipelines, AMQP publisher confirms)
        self._writer = BatchWriter(self._publish_one)
        #: routes (task, queue, exchange, routing key) whose queue was
        #: declared on the connection ``_declared_on`` and may stay so (kombu
        #: caches it, no task_routes, no declare list of the route's own)
        self._declared: set[tuple[str, str, str, str]] = set()
        self._declared_on: Any = None

    def send_all(self, won: Sequence[Slot], claimed_at: float) -> int:
        """Send won slots in order, recording ``sent`` in chunks; how many
        were sent. Should sending run past :data:`GIVE_BACK_SHARE` of the
        shortest lease of the batch (this instance is slower than measured,
        e.g. a loaded machine), the rest is given back
        (:meth:`Claimer.give_back`) instead of being sent on a lease
        running short.

        On a broker with a batched path (:meth:`BatchWriter.mode`: Redis,
        or AMQP with publisher confirms) the batch goes out in writes of
        :data:`~celery_anarchon.beat.batch.FLUSH_EVERY` messages
        (:meth:`_send_batched`); on any other, message by message
        (:meth:`send`)."""
        if won and time.monotonic() >= self._paused_until:
            mode = self._batch_mode()
            if mode is not None:
                return self._send_batched(won, claimed_at)
        return self._send_each(won, claimed_at)

    def _send_each(self, won: Sequence[Slot], claimed_at: float) -> int:
        """Send won slots message by message (:meth:`send`); how many."""
        lease_s = min((slot.job.options.lease_ttl for slot in won), default=0.0)
        for index, slot in enumerate(won):
            if held_past(self._clock() - claimed_at, lease_s, GIVE_BACK_SHARE):
                self._claimer.give_back(won[index:])
                return index
            self.send(slot, claimed_at)
        return len(won)

    def _batch_mode(self) -> str | None:
        """The broker's batched path, or None (message by message); judged
        from the transport, without connecting."""
        if self._connection is None:
            return None
        return BatchWriter.mode(self._connection())

    def _send_batched(self, won: Sequence[Slot], claimed_at: float) -> int:
        """Send ``won`` through the :class:`BatchWriter`; how many were sent.

        The rules of :meth:`send` hold per message and per write:
        :data:`GIVE_BACK_SHARE` is judged before each message is buffered
        (the rest is given back), and right before each write the batch's
        age is judged once: past :data:`PUBLISH_BY`, or past
        :data:`VERIFY_SHARE` with any of the write's claims no longer held
        (one :meth:`Backend.holding` read), nothing of that write is written
        and its slots are left to a backup. Outcomes:

        * sent: recorded ``sent`` (:meth:`Journal.record_sent`, in chunks);
        * refused by the serializer: that slot alone is recorded ``lost``
          with the error; the publisher is not paused;
        * in doubt (a failed or unanswered write, a nack, no confirm): each
          recorded ``lost`` at once, never sent again; the publisher pauses;
        * certainly not written: tried once more on a new connection
          (:data:`PUBLISH_ATTEMPTS`), then left to a backup.
        """
        lease_s = min(slot.job.options.lease_ttl for slot in won)
        sent = 0
        pending: list[Slot] = list(won)
        for attempt in range(1, PUBLISH_ATTEMPTS + 1):
            try:
                producer = self._producer()
            except Exception as exc:
                self._pause(exc)
                for slot in pending:
                    self._on_send_failed(slot, exc)
                return sent
            rules = _WriteRules(self, pending, claimed_at, lease_s)
            try:
                outcomes = self._writer.write(producer, pending, rules.keep_going, rules.may_write)
            except ValueError:  # kombu would write at once: message by message
                return sent + self._send_each(pending, claimed_at)
            stale = rules.stale
            retry: list[Slot] = []
            for slot, (outcome, error) in zip(pending, outcomes, strict=True):
                if outcome is Outcome.SENT:
                    self._on_sent(slot)
                    sent += 1
                elif outcome is Outcome.REFUSED:
                    assert error is not None
                    self._metrics.send_failed(slot.job.name)
                    self._on_unsendable(slot, error)
                elif outcome is Outcome.IN_DOUBT:
                    assert error is not None
                    self._metrics.send_failed(slot.job.name)
                    self._pause(error)
                    self._on_publish_in_doubt(slot, error)
                elif outcome is Outcome.NOT_SENT:
                    retry.append(slot)
            if self._writer.broken:
                self._writer.reset()
                self._drop_producer()
            for slot in stale:
                self._leave_to_backup(slot, self._clock() - claimed_at, lease_s, "before its send")
            stale_ids = {id(slot) for slot in stale}
            untried = [
                slot
                for slot, (outcome, _) in zip(pending, outcomes, strict=True)
                if outcome is Outcome.UNTRIED and id(slot) not in stale_ids
            ]
            if untried and (rules.gave_back or stale):
                self._claimer.give_back(untried)
            elif untried:
                retry.extend(untried)
            if not retry:
                return sent
            if attempt == PUBLISH_ATTEMPTS or held_past(
                self._clock() - claimed_at, lease_s, GIVE_BACK_SHARE
            ):
                error = next((e for o, e in outcomes if o is Outcome.NOT_SENT and e), None)
                failure = error or ConnectionError("the batch's write failed")
                self._pause(failure)
                for slot in retry:
                    self._metrics.send_failed(slot.job.name)
                    self._on_send_failed(slot, failure)
                return sent
            logger.info(
                "anarchon: publishing %d slot(s) failed; again on a new broker connection",
                len(retry),
            )
            pending = retry
        return sent

    def _publish_one(self, slot: Slot, producer: Any) -> None:
        """The batch writer's publish: one won slot's message on ``producer``."""
        self._take_for_send(slot)
        self._send_declaring_once(slot, producer)

    def _send_declaring_once(self, slot: Slot, producer: Any) -> None:
        """:meth:`_send_message`, with the message's queue declared only by
        the first message of its route on this connection."""
        job = slot.job
        # Celery declares a message's queue before each publish (kombu copies
        # and binds the queue each time, a fifth of a batch's CPU): once per
        # route and connection is enough, the messages are the same. Only
        # without task_routes (a router may pick a queue from the args), and
        # for a queue kombu itself would declare once (not one that expires
        # or is deleted when unused: the broker may drop it between sends).
        if self._declared_on is not producer.connection:
            self._declared_on, self._declared = producer.connection, set()
        options = self._route_options(job)
        route = (
            job.entry.task,
            repr(options.get("queue")),
            repr(options.get("exchange")),
            repr(options.get("routing_key")),
        )
        declared = route in self._declared
        self._send_message(slot, producer, declare=[] if declared else None)
        if (
            not declared
            and "declare" not in options  # the entry's or task's own list is kept
            and not self._app.conf.task_routes
            and self._declaration_cached(options.get("queue"))
        ):
            self._declared.add(route)  # later messages of the route skip the declare

    def _route_options(self, job: Job) -> dict[str, Any]:
        """The options ``apply_async`` routes ``job``'s message by: the
        task's own (``@app.task(queue=...)``, as Celery's ``send_task``
        merges them), then the entry's, which win."""
        task = self._app.tasks.get(job.entry.task) if job.entry.task else None
        get_exec_options = getattr(task, "_get_exec_options", None)
        merged = dict(get_exec_options() or {}) if callable(get_exec_options) else {}
        merged = {k: v for k, v in merged.items() if v is not None}
        merged.update(job.entry.options or {})
        return merged

    def _take_for_send(self, slot: Slot) -> None:
        """Give ``slot`` its task id and take it out of the held claims: from
        here on it is not released on shutdown, since a publish interrupted
        after it reached the broker must fall to lease expiry (the documented
        window, leaving a superseded record), never to a hand-over."""
        assert self._link.backend is not None  # it answered the claim
        namespace = self._link.backend.namespace
        slot.task_id = task_id_for(slot.job.name, slot.slot_ms, namespace=namespace)
        self._claimer.held.pop(slot.key, None)

    def _send_message(self, slot: Slot, producer: Any, declare: Any = None) -> None:
        """Publish ``slot``'s message on ``producer`` through Celery
        (:func:`send_slot`, without kombu's retries); raises what it raises."""
        job, claim = slot.job, slot.claim
        assert claim is not None
        send_slot(
            self._app,
            job.entry,
            job=job.name,
            slot_ms=slot.slot_ms,
            token=claim.token,
            task_id=slot.task_id,
            producer=producer,
            expires=job.expires(slot.slot_ms),
            retry=False,
            declare=declare,
        )

    def _declaration_cached(self, queue: Any) -> bool:
        """True when kombu caches the declaration of ``queue`` (an entry's
        ``queue`` option: a name, a ``Queue``, or None for the default)."""
        if queue is None:
            queue = self._app.conf.task_default_queue
        if isinstance(queue, str):
            queue = self._app.amqp.queues.get(queue)
        if getattr(queue, "expires", None) is not None:  # x-expires, set at declare
            return False
        return bool(getattr(queue, "can_cache_declaration", False))

    def _pause(self, exc: BaseException) -> None:
        """No publish is tried for :data:`PUBLISH_PAUSE` seconds."""
        self._pause_reason = repr(exc)
        self._paused_until = time.monotonic() + PUBLISH_PAUSE

    def _on_sent(self, slot: Slot) -> None:
        """A slot's message reached the broker: count, log, record ``sent``."""
        job = slot.job
        self._metrics.won(job.name, self._clock() - slot.slot_ms / 1000)
        logger.info(
            "anarchon: sent %s @ %s (task %s, id %s, by %s)",
            job.name,
            _iso(slot.slot_ms),
            job.entry.task,
            slot.task_id,
            self._instance_id,
        )
        self._journal.record_sent(slot)

    def _still_hold(self, slots: Sequence[Slot]) -> list[bool]:
        """For each slot, whether its claim is still held (as
        :meth:`_still_holds`, one :meth:`Backend.holding` read for all);
        all False when the backend does not answer."""
        backend = self._link.lease_backend
        if backend is None:
            return [True] * len(slots)
        claims = [slot.claim for slot in slots if slot.claim is not None]
        margin_ms = _ms(min(slot.job.options.lease_ttl for slot in slots) / 10)
        try:
            answers = backend.holding(claims, margin_ms)
        except BackendUnavailable as exc:
            self._link.on_outage(exc)
        except Exception:
            logger.exception("anarchon: reading the leases of %d claim(s) failed", len(claims))
        else:
            if len(answers) == len(claims):
                return list(answers)
        return [False] * len(slots)

    def send(self, slot: Slot, claimed_at: float) -> None:
        """Send a won slot; record ``sent`` (or ``lost`` when the send fails).

        A claim held for more than :data:`VERIFY_SHARE` of its lease (this
        process was frozen or slow) is checked against the backend before
        publishing: if its fencing token is no longer current, another
        instance took the slot over and nothing is sent.
        """
        if Publisher.before_send is not None:
            Publisher.before_send(slot)
        job, claim = slot.job, slot.claim
        assert claim is not None
        lease_s = job.options.lease_ttl
        held_s = self._clock() - claimed_at
        self._take_for_send(slot)
        if held_past(held_s, lease_s, VERIFY_SHARE) and (
            held_past(held_s, lease_s, PUBLISH_BY) or not self._still_holds(slot)
        ):
            # The lease has (nearly) ended: a backup may be taking the slot
            # over now. Publishing would risk a second publish; leave the
            # slot to the backup, recorded lost later if none sent it.
            self._leave_to_backup(slot, held_s, lease_s, "before its send")
            return
        try:
            self._publish(slot, claimed_at)
        except _StaleClaim as exc:
            self._leave_to_backup(slot, exc.held_s, lease_s, "when its publish was due")
            return
        except _PublishInDoubt as exc:
            self._metrics.send_failed(job.name)
            self._on_publish_in_doubt(slot, exc.cause)
            return
        except _Unsendable as exc:
            self._metrics.send_failed(job.name)
            self._on_unsendable(slot, exc.cause)
            return
        except Exception as exc:
            self._metrics.send_failed(job.name)
            self._on_send_failed(slot, exc)
            return
        self._metrics.won(job.name, self._clock() - slot.slot_ms / 1000)
        logger.info(
            "anarchon: sent %s @ %s (task %s, id %s, by %s)",
            job.name,
            _iso(slot.slot_ms),
            job.entry.task,
            slot.task_id,
            self._instance_id,
        )
        self._journal.record_sent(slot)

    def _leave_to_backup(self, slot: Slot, held_s: float, lease_s: float, when: str) -> None:
        """Not send ``slot``: its claim was held (nearly) as long as
        ``lease_s`` (the lease the send was judged by), so a backup may be
        taking it over now; a second publish is the risk. Recorded lost
        later if no backup sent it."""
        logger.warning(
            "anarchon: %s @ %s held %.1fs of a %.0fs lease %s; not sent "
            "by this instance (left to a backup)",
            slot.job.name,
            _iso(slot.slot_ms),
            held_s,
            lease_s,
            when,
        )
        self._on_send_failed(slot, TimeoutError("lease ended"))

    def _on_send_failed(self, slot: Slot, exc: BaseException) -> None:
        """Sending a won slot failed (this instance cannot reach Celery's
        broker). On a lease backend the claim is left to expire, so a backup
        that can reach the broker takes the slot over and sends it; if none
        did by ``max_late``, this instance records it ``lost`` (fenced: a
        take-over leaves its record alone, :meth:`close_failed_send`). A
        claim-only backend cannot hand the slot on: it is recorded ``lost``
        at once."""
        job, claim = slot.job, slot.claim
        assert claim is not None
        self._claimer.held.pop(slot.key, None)  # recorded lost if need be, never released
        slot.error = f"send failed: {exc!r}"
        if not self._link.leases:
            logger.error(
                "anarchon: won %s @ %s but sending failed: %r; recorded as lost",
                job.name,
                _iso(slot.slot_ms),
                exc,
            )
            self._journal.mark(claim, State.LOST, task_id=slot.task_id, error=slot.error)
            return
        logger.error(
            "anarchon: won %s @ %s but sending failed: %r; left for a backup instance "
            "to take over when the lease ends",
            job.name,
            _iso(slot.slot_ms),
            exc,
        )
        slot.lease_end_ms = int(self._clock() * 1000) + _ms(job.options.lease_ttl)
        self.failed[slot.key] = slot
        due_ms = max(slot.lease_end_ms, job.deadline_ms(slot.slot_ms)) + 1000
        self._agenda.push(due_ms, Slot(job, slot.slot_ms, SEND_FAILED))

    def _on_publish_in_doubt(self, slot: Slot, exc: BaseException) -> None:
        """A publish failed after it may have reached Celery's broker: the
        slot may be queued already. Recorded ``lost`` at once (in doubt,
        never send twice: docs/exactly-once.md), not left to a backup: a
        take-over would publish it a second time. The record closes the
        claim, so no backup takes it over; only when the backend does not
        take the record may a backup take the slot over at lease end."""
        assert slot.claim is not None
        error = f"publish failed after it may have reached the broker: {exc!r}"
        if self._journal.mark(slot.claim, State.LOST, task_id=slot.task_id, error=error):
            logger.error(
                "anarchon: %s @ %s: publish failed after it may have reached the broker "
                "(%r); not sent again, recorded lost",
                slot.job.name,
                _iso(slot.slot_ms),
                exc,
            )
        else:
            logger.error(
                "anarchon: %s @ %s: publish failed after it may have reached the broker "
                "(%r) and it could not be recorded lost; a backup may send it again "
                "when the lease ends",
                slot.job.name,
                _iso(slot.slot_ms),
                exc,
            )

    def _on_unsendable(self, slot: Slot, exc: BaseException) -> None:
        """The serializer or the task's argument check refused the slot's
        args or kwargs: its own failure, recorded ``lost`` with that error at
        once (a backup would fail the same way). The broker is not paused
        for it: the other slots keep being sent."""
        assert slot.claim is not None
        error = f"its args or kwargs were refused: {exc!r}"
        self._journal.mark(slot.claim, State.LOST, task_id=slot.task_id, error=error)
        logger.error(
            "anarchon: %s @ %s not sent: %s; recorded lost. Fix: give the entry args and "
            "kwargs its task takes and its serializer can encode (`celery anarchon check` "
            "shows the same problem)",
            slot.job.name,
            _iso(slot.slot_ms),
            error,
        )

    def close_failed_send(self, slot: Slot) -> None:
        """No backup took a failed send over by ``max_late``: record this
        instance's claim lost (fenced: a take-over keeps its record)."""
        failed = self.failed.pop(slot.key, None)
        if failed is None or failed.claim is None:
            return
        if self._journal.mark(failed.claim, State.LOST, error=failed.error):
            logger.warning(
                "anarchon: %s @ %s: sending failed and no backup sent it; recorded lost",
                slot.job.name,
                _iso(slot.slot_ms),
            )

    def hand_over(self, now_ms: int) -> list[tuple[Claim, str]]:
        """On shutdown, the failed sends to record ``lost`` now, with why;
        none is kept afterwards.

        A claim whose send failed stays with its lease while a backup can
        still take it over: its lease ends before ``max_late``, or it has
        ended already with at least :data:`HAND_OVER_MARGIN` seconds left
        before ``max_late`` (the backups' checks are due); otherwise it is
        recorded ``lost`` now (this instance will not be there to do it when
        ``max_late`` ends)."""
        lost: list[tuple[Claim, str]] = []
        for slot in self.failed.values():
            assert slot.claim is not None
            last_ms = slot.job.deadline_ms(slot.slot_ms)
            if slot.lease_end_ms > last_ms:
                backup_can_take = False  # the lease outlives max_late
            elif now_ms < slot.lease_end_ms:
                backup_can_take = True  # a backup checks at the lease's end
            else:  # the lease ended: a backup's check is due now, or at its next heartbeat
                backup_can_take = now_ms + _ms(HAND_OVER_MARGIN) <= last_ms
            if not backup_can_take:
                lost.append((slot.claim, f"{slot.error}; shut down, no backup took it over"))
        self.failed = {}
        return lost

    def _publish(self, slot: Slot, claimed_at: float) -> None:
        """Publish a won slot, bounded in time so a tick is never blocked
        long by a broker that is away (any doubt is lost).

        At most :data:`PUBLISH_ATTEMPTS` attempts. Each connects (once,
        bounded by ``broker_connection_timeout``) if beat has no broker
        connection, re-checks the claim's age right before publishing, and
        publishes without kombu's own retries. An attempt is repeated only
        when it certainly wrote nothing: the connection could not be made
        (connecting failed, or the publish was refused a connection). A
        publish that failed once it may have written (a connection reset or
        a timeout during or after the write) is never repeated: in doubt,
        never send twice. After a failed attempt the producer and its
        connection are dropped and made afresh: kombu closes the producer's
        channel when a publish hits a dropped connection and leaves it
        closed when it cannot reconnect, so the cached producer would fail
        every later publish (``AttributeError: 'NoneType' object has no
        attribute 'state'`` on the Redis transport) even once the broker is
        back.

        What a failure means is decided by one rule, :func:`publish_failure`.

        Raises:
            _StaleClaim: the claim was held more than :data:`PUBLISH_BY` of
                its lease when a publish was due (a backup may take it over).
            _Unsendable: the serializer or the task's argument check refused
                the slot's args or kwargs (not tried again; no pause, the
                producer is kept).
            _PublishInDoubt: the publish failed after it may have reached
                the broker (not tried again).
            Exception: the last attempt's error, or, within
                :data:`PUBLISH_PAUSE` seconds of a failed publish, a
                ConnectionError without trying (the broker is away).
        """
        job, claim = slot.job, slot.claim
        assert claim is not None
        if time.monotonic() < self._paused_until:
            raise ConnectionError(
                f"Celery's broker did not answer a publish less than {PUBLISH_PAUSE:g}s "
                f"ago ({self._pause_reason}); not tried again yet"
            )
        for attempt in range(1, PUBLISH_ATTEMPTS + 1):
            may_have_written = False
            try:
                producer = self._producer()  # connects if needed, bounded
                held_s = self._clock() - claimed_at
                if held_past(held_s, job.options.lease_ttl, PUBLISH_BY):
                    raise _StaleClaim(held_s)
                may_have_written = True  # from here on the message may reach the broker
                self._send_declaring_once(slot, producer)
                return
            except _StaleClaim:
                raise
            except Exception as exc:
                outcome = publish_failure(exc, may_have_written)
                if outcome == UNSENDABLE:  # the message, not the broker: no pause
                    raise _Unsendable(exc) from exc
                self._drop_producer()
                in_doubt = outcome == IN_DOUBT
                if in_doubt or attempt == PUBLISH_ATTEMPTS:
                    self._pause(exc)
                    if in_doubt:
                        raise _PublishInDoubt(exc) from exc
                    raise
                logger.info(
                    "anarchon: publishing %s @ %s failed (%r); again on a new broker connection",
                    job.name,
                    _iso(slot.slot_ms),
                    exc,
                )

    def _still_holds(self, slot: Slot) -> bool:
        """True when ``slot``'s claim is still held: its token is the slot's
        current one, the run is still ``claimed``, and its lease ends more
        than a tenth of the lease after the backend's now: one
        :meth:`Backend.holding` read (a key read, not the job's history);
        False when the backend does not answer. (A batch gives back what it
        could not send by :data:`GIVE_BACK_SHARE` of the lease, so this is
        asked only of a send that stalled on its own.)"""
        return self._still_hold([slot])[0]
