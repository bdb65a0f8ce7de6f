"""Confirm-mode channels of the RabbitMQ backend, and the declares and
publishes of one claim batch spread over them (lanes, attempts)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import amqp
from amqp import spec
from amqp.exceptions import AMQPError, ChannelError, error_for_code

logger = logging.getLogger(__name__)

#: Delivery mode of a persistent message.
PERSISTENT = 2


class _ConfirmChannel(amqp.Channel):
    """A channel in confirm mode that pipelines declares and publishes and
    keeps its own books of the replies.

    py-amqp's own confirm support (``Connection(confirm_publish=True)``)
    applies to every channel of a connection and waits for each publish in
    turn; this channel sends many methods and then reads the replies as they
    come, through py-amqp's listener table (``_setup_listeners``):

    * ``declared``: ``queue.declare-ok`` replies since :meth:`send_declares`;
      a channel's methods are handled in order, so after a channel error the
      declare at that index is the one that failed;
    * ``confirmed``: delivery tag -> True (``basic.ack``) or False
      (``basic.nack``), ``multiple`` expanded; ``unconfirmed`` the tags still
      waiting;
    * ``returned``: message ids of publishes returned as unroutable
      (``basic.return`` comes before the ack of the same publish);
    * ``error``: the channel error the broker closed it with. Such a channel
      is answered ``close-ok`` and dropped, never reused, so no late ack is
      ever credited to a later publish.
    """

    def __init__(self, connection: amqp.Connection) -> None:
        self.declared = 0
        self.published = 0
        self.confirmed: dict[int, bool] = {}
        self.unconfirmed: set[int] = set()
        self.returned: set[str] = set()
        self.error: AMQPError | None = None
        super().__init__(connection)

    def _setup_listeners(self) -> None:
        super()._setup_listeners()
        self._callbacks[spec.Queue.DeclareOk] = self._on_declare_ok
        self._callbacks[spec.Channel.Close] = self._on_server_close

    @classmethod
    def opened(cls, connection: amqp.Connection) -> _ConfirmChannel:
        """A new channel on ``connection``, open and in confirm mode."""
        channel = cls(connection)
        channel.open()
        channel.confirm_select()
        return channel

    @property
    def usable(self) -> bool:
        """True while the channel is open and no error closed it."""
        return bool(self.is_open) and self.error is None

    def send_declares(self, items: Sequence[_Declare]) -> None:
        """Send ``queue.declare`` (durable, replies wanted) for each item
        without waiting; count replies in ``declared`` from zero."""
        self.declared = 0
        for item in items:
            # queue.declare: ticket, queue, passive, durable, exclusive,
            # auto_delete, nowait, arguments (AMQP 0-9-1; py-amqp's argsig).
            self.send_method(
                spec.Queue.Declare,
                "BsbbbbbF",
                (0, item.queue, item.passive, True, False, False, False, item.arguments),
            )

    def start_round(self) -> None:
        """Forget the replies of earlier rounds (nothing is outstanding)."""
        self.confirmed.clear()
        self.unconfirmed.clear()
        self.returned.clear()

    def publish(self, queue: str, body: bytes, message_id: str, *, mandatory: bool) -> int:
        """Publish a persistent JSON message to ``queue`` through the
        default exchange; returns its delivery tag on this channel."""
        message = amqp.Message(
            body,
            content_type="application/json",
            delivery_mode=PERSISTENT,
            message_id=message_id,
            app_id="celery-anarchon",
        )
        self.basic_publish(message, exchange="", routing_key=queue, mandatory=mandatory)
        self.published += 1
        self.unconfirmed.add(self.published)
        return self.published

    def _on_declare_ok(self, *_: Any) -> None:
        self.declared += 1

    def _on_basic_ack(self, delivery_tag: int, multiple: bool) -> None:
        self._settle(delivery_tag, multiple, True)

    def _on_basic_nack(self, delivery_tag: int, multiple: bool) -> None:
        self._settle(delivery_tag, multiple, False)

    def _on_basic_return(
        self, reply_code: int, reply_text: str, exchange: str, routing_key: str, message: Any
    ) -> None:
        message_id = message.properties.get("message_id")
        logger.debug("broker returned a publish to %r: %s %s", routing_key, reply_code, reply_text)
        if message_id:
            self.returned.add(str(message_id))

    def _settle(self, delivery_tag: int, multiple: bool, ok: bool) -> None:
        if multiple:
            tags = [t for t in self.unconfirmed if delivery_tag == 0 or t <= delivery_tag]
        else:
            tags = [delivery_tag]
        for tag in tags:
            self.unconfirmed.discard(tag)
            self.confirmed.setdefault(tag, ok)

    def _on_server_close(
        self, reply_code: int, reply_text: str, class_id: int, method_id: int
    ) -> None:
        # py-amqp would reopen the channel and raise from drain_events; we
        # answer close-ok, keep the error, and drop the channel instead.
        self.error = error_for_code(reply_code, reply_text, (class_id, method_id), ChannelError)
        self.send_method(spec.Channel.CloseOk)
        self.collect()


@dataclass
class _Declare:
    """One queue to declare, actively (with arguments) or passively."""

    queue: str
    arguments: dict[str, Any]
    passive: bool = False
    tries: int = 0


class _Lane:
    """One channel and the queues declared on it, in order.

    ``start`` is the index of the first item sent on the current channel;
    after a channel error at ``start + channel.declared`` the lane takes a new
    channel from ``new_channel`` and sends the rest again.
    """

    def __init__(self, new_channel: Callable[[], _ConfirmChannel], items: list[_Declare]) -> None:
        self.new_channel = new_channel
        self.channel = new_channel()
        self.items = items
        self.start = 0

    def send(self) -> None:
        self.channel.send_declares(self.items[self.start :])

    @property
    def settled(self) -> bool:
        """All declares answered, or the channel failed."""
        return self.channel.error is not None or self.failed_at >= len(self.items)

    @property
    def failed_at(self) -> int:
        return self.start + self.channel.declared


@dataclass
class _Attempt:
    """One gate this call publishes to, and what came of it."""

    job: str
    slot_ms: int
    gate: _Declare
    token: str
    body: bytes
    lane: int = 0
    tag: int = 0
    #: ``won``, ``taken`` (nacked), ``returned`` (no gate), ``unknown``.
    outcome: str = "unknown"
    why: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
