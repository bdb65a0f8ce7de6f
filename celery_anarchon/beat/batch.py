"""Writing a batch of Celery messages to the broker in few writes.

:class:`BatchWriter` publishes a batch of won slots' messages, each built by
Celery's own ``apply_async`` (so signals, routing and the message format are
Celery's), and tells per message what became of it (:class:`Outcome`). It
knows two batched paths:

* **pipeline**: a transport that can defer writes (kombu's
  ``Producer.batch()``, the Redis transport): the messages of a chunk of
  :data:`FLUSH_EVERY` are buffered and written as one pipeline. A flush that
  fails or is not answered leaves its whole chunk in doubt
  (``BatchPublishError``: delivery uncertain, kombu's docs).
* **confirms**: py-amqp with publisher confirms on (``confirm_publish``).
  py-amqp then waits for the broker's confirm after every publish; here the
  chunk is published on a channel of our own in confirm mode without
  waiting, and the confirms are waited for once, honouring ``multiple`` acks
  and nacks (RabbitMQ's publisher confirms:
  https://www.rabbitmq.com/docs/confirms). A nacked or unconfirmed message
  is in doubt.

Any other transport (and py-amqp without confirms, whose ``basic_publish``
does not wait) has no batched path: :meth:`BatchWriter.mode` says None and
the caller publishes message by message.
"""

from __future__ import annotations

import contextlib
import enum
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kombu import Producer
from kombu.exceptions import BatchPublishError, EncodeError

__all__ = [
    "CONFIRM_TIMEOUT",
    "FLUSH_EVERY",
    "BatchWriter",
    "Outcome",
    "IN_DOUBT",
    "UNSENDABLE",
    "UNSENT",
    "publish_failure",
]

T = TypeVar("T")

#: Messages per broker write (a Redis pipeline, or the messages between two
#: waits for publisher confirms). A failed write puts at most this many in
#: doubt.
FLUSH_EVERY = 500

#: Seconds to wait for the publisher confirms of one chunk; a message not
#: confirmed by then is in doubt.
CONFIRM_TIMEOUT = 5.0

#: kombu's ``Producer.batch(max_size=...)``: a bound no chunk reaches, so
#: kombu never writes part of a chunk on its own.
_NEVER_FLUSH = 2**62

PIPELINE = "pipeline"
CONFIRMS = "confirms"


class Outcome(enum.Enum):
    """What became of one message of a batch."""

    #: written (Redis: the pipeline answered; AMQP: the broker confirmed it)
    SENT = "sent"
    #: the message could not be built (the serializer or the task's
    #: argument check refused its args or kwargs: :data:`UNSENDABLE`):
    #: nothing written, and trying again cannot help
    REFUSED = "refused"
    #: certainly not written (the connection could not be made, or the
    #: chunk was discarded before its write): it may be sent again
    NOT_SENT = "not sent"
    #: may have reached the broker (a failed or unanswered write, a nack,
    #: no confirm in time): never to be sent again
    IN_DOUBT = "in doubt"
    #: not tried: the caller's ``keep_going`` said stop, or an earlier
    #: message's failure ended the batch
    UNTRIED = "untried"


#: What a failed publish means for its slot (:func:`publish_failure`).
UNSENT = "unsent"
IN_DOUBT = "in doubt"
UNSENDABLE = "unsendable"


def publish_failure(exc: BaseException, may_have_written: bool) -> str:
    """What a failed publish means for its slot: the one rule.

    * :data:`UNSENDABLE`: the slot's message itself was refused, before
      anything was written: by the serializer (kombu's ``EncodeError``, e.g.
      a custom object under JSON) or by the task's argument check (Celery's
      ``TypeError`` under ``strict_typing``). No attempt, here or by a
      backup, can do better. The slot's own failure: recorded ``lost`` at
      once; the broker is fine and other slots keep being sent.
    * :data:`UNSENT`: nothing was written: the publish failed before it
      could write (``may_have_written`` False), or the connection it needed
      was never made (refused, or the host name did not resolve), found
      anywhere in the chain Python prints for ``exc`` (``__cause__``, else
      ``__context__``: kombu and Celery re-raise a refusal as
      ``OperationalError('Error 111 connecting ... Connection refused.')``).
      It may be tried again, and on a lease backend is left to a backup.
    * :data:`IN_DOUBT`: anything else once the write may have begun: the
      message may be queued; never sent again (docs/exactly-once.md).
    """
    if isinstance(exc, (EncodeError, TypeError)):
        return UNSENDABLE
    if not may_have_written:
        return UNSENT
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, (ConnectionRefusedError, socket.gaierror)):
            return UNSENT
        seen.add(id(current))
        if current.__cause__ is not None:
            current = current.__cause__
        else:
            current = None if current.__suppress_context__ else current.__context__
    return IN_DOUBT


class BatchWriter:
    """Publishes batches of messages, one write (or one confirm wait) per
    :data:`FLUSH_EVERY`.

    Args:
        publish: builds and publishes one item's message on the producer
            given (Celery's ``apply_async(producer=...)``); raises what
            that raises.
        flush_every: messages per write.
        confirm_timeout: seconds to wait for one chunk's confirms.
    """

    def __init__(
        self,
        publish: Callable[[Any, Producer], Any],
        flush_every: int = FLUSH_EVERY,
        confirm_timeout: float = CONFIRM_TIMEOUT,
    ) -> None:
        self._publish = publish
        self.flush_every = flush_every
        self.confirm_timeout = confirm_timeout
        #: set when a write failed in a way that leaves the producer or its
        #: connection unusable; the caller drops both (and calls :meth:`reset`)
        self.broken = False
        self._confirm_producer: Producer | None = None
        self._confirm_connection: Any = None
        #: delivery tag -> acked (True) or nacked (False), until read
        self._acked: dict[int, bool] = {}
        #: delivery tags published and not settled yet
        self._outstanding: set[int] = set()
        self._next_tag = 1

    @staticmethod
    def mode(connection: Any) -> str | None:
        """The batched path for a kombu ``connection``'s transport, judged
        without connecting: ``'pipeline'``, ``'confirms'``, or None
        (publish message by message)."""
        transport = connection.transport
        if getattr(transport.implements, "batch_publish", False) and getattr(
            transport, "supports_batch_publish", True
        ):
            return PIPELINE
        if transport.driver_type == "amqp" and connection.transport_options.get("confirm_publish"):
            return CONFIRMS
        return None

    def reset(self) -> None:
        """Forget the confirm channel (its connection was dropped)."""
        if self._confirm_producer is not None:
            with contextlib.suppress(Exception):  # the connection is gone already
                self._confirm_producer.channel.close()
        self._confirm_producer = None
        self._confirm_connection = None
        self.broken = False

    def write(
        self,
        producer: Producer,
        items: Sequence[T],
        keep_going: Callable[[int], bool],
        may_write: Callable[[Sequence[int]], bool] | None = None,
    ) -> list[tuple[Outcome, BaseException | None]]:
        """Publish ``items`` in order; one outcome per item, in order.

        Args:
            producer: beat's producer, connected.
            items: what ``publish`` takes, one per message.
            keep_going: called with an index before that item is published
                (buffered); False stops there: the item and those after it
                are :attr:`Outcome.UNTRIED`.
            may_write: called with the indexes of a chunk right before the
                chunk is written (Redis: its pipeline; AMQP: its first
                publish); False discards the chunk, nothing of it written,
                and stops: the chunk and the rest are
                :attr:`Outcome.UNTRIED`.
        Raises:
            ValueError: ``producer``'s transport has no batched path
                (:meth:`mode` is None, or kombu's batch would write at once).
        """
        mode = self.mode(producer.connection)
        if mode == PIPELINE and not producer.supports_batch_publish:
            mode = None  # the channel's own options make kombu write at once
        if mode is None:
            raise ValueError(f"no batched publish on {producer.connection.transport.driver_type}")
        outcomes: list[tuple[Outcome, BaseException | None]] = [(Outcome.UNTRIED, None)] * len(
            items
        )
        start = 0
        while start < len(items) and not self.broken:
            end = min(len(items), start + self.flush_every)
            if mode == PIPELINE:
                stopped = self._pipeline_chunk(
                    producer, items, start, end, keep_going, may_write, outcomes
                )
            else:
                stopped = self._confirm_chunk(
                    producer, items, start, end, keep_going, may_write, outcomes
                )
            if stopped:
                break
            start = end
        return outcomes

    def _pipeline_chunk(
        self,
        producer: Producer,
        items: Sequence[Any],
        start: int,
        end: int,
        keep_going: Callable[[int], bool],
        may_write: Callable[[Sequence[int]], bool] | None,
        outcomes: list[tuple[Outcome, BaseException | None]],
    ) -> bool:
        """Buffer items[start:end] in one ``Producer.batch()`` and write
        them as one pipeline; True when the batch must stop here."""
        buffered: list[int] = []
        stopped = False
        failure: BaseException | None = None
        try:
            # max_size above anything a chunk can buffer (a message takes
            # one command per priority step on an expiring queue, and one
            # per topic on a fanout): kombu never writes on its own
            # mid-chunk, so one chunk is one write with one outcome.
            with producer.batch(max_size=_NEVER_FLUSH):
                for index in range(start, end):
                    if not keep_going(index):
                        stopped = True
                        break
                    try:
                        self._publish(items[index], producer)
                    except Exception as exc:
                        if publish_failure(exc, False) == UNSENDABLE:
                            outcomes[index] = (Outcome.REFUSED, exc)
                            continue
                        if isinstance(exc, BatchPublishError):
                            # kombu wrote the buffer on its own, this message
                            # with it perhaps, and the write failed
                            outcomes[index] = (Outcome.IN_DOUBT, exc)
                            raise
                        # Routing (a bindings read) or the connection failed
                        # while buffering: nothing of the chunk was written.
                        outcomes[index] = (Outcome.NOT_SENT, exc)
                        failure = exc
                        raise
                    buffered.append(index)
                if buffered and may_write is not None and not may_write(buffered):
                    raise _Discard
        except _Discard:
            for index in buffered:
                outcomes[index] = (Outcome.UNTRIED, None)
            return True
        except BatchPublishError as exc:  # the write failed or was not answered
            self.broken = True
            for index in buffered:
                outcomes[index] = (Outcome.IN_DOUBT, exc)
            return True
        except Exception as exc:
            self.broken = True
            for index in buffered:  # discarded by the batch: never written
                outcomes[index] = (Outcome.NOT_SENT, failure or exc)
            return True
        for index in buffered:
            outcomes[index] = (Outcome.SENT, None)
        return stopped

    def _confirm_chunk(
        self,
        producer: Producer,
        items: Sequence[Any],
        start: int,
        end: int,
        keep_going: Callable[[int], bool],
        may_write: Callable[[Sequence[int]], bool] | None,
        outcomes: list[tuple[Outcome, BaseException | None]],
    ) -> bool:
        """Publish items[start:end] on the confirm channel without waiting,
        then wait once for their confirms; True when the batch must stop."""
        try:
            confirm = self._confirm_producer_for(producer)
        except Exception as exc:
            self.broken = True
            for index in range(start, end):
                outcomes[index] = (Outcome.NOT_SENT, exc)
            return True
        if may_write is not None and not may_write(range(start, end)):
            return True
        tags: dict[int, int] = {}  # delivery tag -> index
        stopped = False
        for index in range(start, end):
            if not keep_going(index):
                stopped = True
                break
            tag = self._next_tag
            try:
                self._publish(items[index], confirm)
            except Exception as exc:
                if publish_failure(exc, False) == UNSENDABLE:
                    outcomes[index] = (Outcome.REFUSED, exc)
                    continue
                self.broken = True
                unsent = publish_failure(exc, True) == UNSENT
                outcomes[index] = (Outcome.NOT_SENT if unsent else Outcome.IN_DOUBT, exc)
                stopped = True
                break
            self._next_tag = tag + 1
            self._outstanding.add(tag)
            tags[tag] = index
        unconfirmed = self._await_confirms(tags)
        for tag, index in tags.items():
            if tag in unconfirmed:
                outcomes[index] = (Outcome.IN_DOUBT, unconfirmed[tag])
            else:
                outcomes[index] = (Outcome.SENT, None)
        return stopped or bool(unconfirmed)

    def _await_confirms(self, tags: dict[int, int]) -> dict[int, BaseException]:
        """Wait for the confirms of ``tags``, at most :attr:`confirm_timeout`
        seconds; the tags not acked, with why."""
        if not tags:
            return {}
        last = max(tags)
        deadline = time.monotonic() + self.confirm_timeout
        failure: BaseException | None = None
        while any(tag not in self._acked for tag in tags):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                failure = TimeoutError(f"no publisher confirm within {self.confirm_timeout:g}s")
                break
            try:
                self._confirm_connection.drain_events(timeout=remaining)
            except TimeoutError:
                continue
            except Exception as exc:
                failure = exc
                self.broken = True
                break
        missing: dict[int, BaseException] = {}
        for tag in tags:
            acked = self._acked.pop(tag, None)
            if acked is None:
                missing[tag] = failure or TimeoutError("not confirmed")
            elif not acked:
                missing[tag] = ConnectionError("the broker nacked the message")
        for tag in [t for t in self._acked if t <= last]:
            del self._acked[tag]
        self._outstanding.difference_update(tags)
        if failure is not None:
            self.broken = True
        return missing

    def _confirm_producer_for(self, producer: Producer) -> Producer:
        """A producer on a channel of our own, in confirm mode, on
        ``producer``'s connection, whose publishes do not wait."""
        connection = producer.connection
        if self._confirm_producer is not None and self._confirm_connection is connection:
            return self._confirm_producer
        self.reset()
        channel = connection.channel()
        channel.confirm_select()
        channel._confirm_selected = True
        # py-amqp waits for each confirm in basic_publish when confirm_publish
        # is set; publish without waiting and wait once per chunk instead.
        channel.basic_publish = channel._basic_publish
        channel.events["basic_ack"].add(self._on_ack)
        channel.events["basic_nack"].add(self._on_nack)
        self._acked = {}
        self._outstanding = set()
        self._next_tag = 1
        self._confirm_connection = connection
        self._confirm_producer = Producer(channel, exchange=producer.exchange)
        return self._confirm_producer

    def _on_ack(self, delivery_tag: int, multiple: bool) -> None:
        self._settle(delivery_tag, multiple, True)

    def _on_nack(self, delivery_tag: int, multiple: bool) -> None:
        self._settle(delivery_tag, multiple, False)

    def _settle(self, delivery_tag: int, multiple: bool, acked: bool) -> None:
        """Settle one tag, or (``multiple``) every outstanding tag up to it."""
        tags = [t for t in self._outstanding if t <= delivery_tag] if multiple else [delivery_tag]
        for tag in tags:
            self._outstanding.discard(tag)
            self._acked[tag] = acked


class _Discard(Exception):
    """A chunk given up right before its write."""
