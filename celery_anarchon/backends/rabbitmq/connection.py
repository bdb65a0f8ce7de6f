"""Connecting the RabbitMQ backend: our own connection dialled from the URL
or the user's client, the version check, the channels per lane, declaring
with recovery after a channel error, and the clock."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import amqp
import kombu
from amqp.exceptions import AMQPError

from ...exceptions import BackendUnavailable, ConfigurationError
from ...times import option_seconds
from .. import sanitize_url
from .channel import _ConfirmChannel, _Lane
from .naming import RabbitMQNaming

logger = logging.getLogger(__name__)


#: Oldest RabbitMQ with stream queues (history needs them).
MIN_RABBITMQ = (3, 9)


#: Channels a claim batch is spread over. RabbitMQ creates queues faster from
#: several channels at once (measured here with 1,000 new gates: about 280/s
#: from one channel, 400-700/s from eight).
CLAIM_CHANNELS = 8


#: Errors that mean the connection is gone (socket, protocol, forced close).
_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (OSError, amqp.exceptions.ConnectionError)


def _seconds(value: float | timedelta | str) -> float:
    if isinstance(value, timedelta):
        return value.total_seconds()
    return float(value)


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _positive(name: str, value: float | timedelta | str) -> float:
    """A positive duration option (:func:`~celery_anarchon.times.option_seconds`)."""
    return option_seconds(name, value)


class RabbitMQConnection(RabbitMQNaming):
    """Our connection to the broker and its channels."""

    #: seconds a gate lives after its last declare
    slot_ttl: float
    #: seconds to wait for the broker's next reply; also the connect timeout
    confirm_timeout: float
    _client_properties: dict[str, Any]
    #: opens a new connection with the user's parameters
    _dial: Callable[[], amqp.Connection]
    #: the broker for logs, credentials masked
    _where: str
    _lock: threading.RLock
    _conn: amqp.Connection | None
    _claim_channels: dict[int, _ConfirmChannel]
    _history_ch: _ConfirmChannel | None
    #: History streams declared on the current connection.
    _streams: set[str]
    #: Channels the history stream declares are spread over besides the
    #: history channel (lane 0), by lane.
    _stream_chs: dict[int, _ConfirmChannel]

    def _dialer(
        self, url: str | None, client: Any
    ) -> tuple[Callable[[], amqp.Connection], str, str]:
        """A function opening a new connection of our own, where it goes
        (credentials masked) and its vhost. Nothing connects here."""
        if client is None:
            url = url or "amqp://localhost"
            kombu_conn = kombu.Connection(
                url,
                connect_timeout=self.confirm_timeout,
                transport_options={"client_properties": self._client_properties},
            )
            dial = self._kombu_dialer(kombu_conn)
            return dial, sanitize_url(url), str(kombu_conn.virtual_host or "/")
        if isinstance(client, kombu.Connection):
            ours = self._clone(client)
            dial = self._kombu_dialer(ours)
            return dial, sanitize_url(client.as_uri()), str(ours.virtual_host or "/")
        if isinstance(client, amqp.Connection):
            where = f"amqp://{client.host}/{client.virtual_host}"
            return self._amqp_dialer(client), where, str(client.virtual_host)
        raise ConfigurationError(
            f"anarchon_backend: cannot use a {type(client).__name__} as a RabbitMQ "
            "connection; pass a kombu Connection or a py-amqp Connection."
        )

    def _clone(self, client: kombu.Connection) -> kombu.Connection:
        """A connection of our own with the parameters of the user's kombu
        ``client``, without py-amqp's per-publish ``confirm_publish``."""
        if client.transport.driver_type != "amqp":
            raise ConfigurationError(
                f"anarchon_backend: the kombu Connection given uses the "
                f"{client.transport.driver_type!r} transport; the RabbitMQ backend needs "
                "an AMQP one (amqp://, amqps://, pyamqp://)."
            )
        options = dict(client.transport_options or {})
        options.pop("confirm_publish", None)
        options["client_properties"] = self._client_properties
        ours: kombu.Connection = client.clone(
            transport_options=options, connect_timeout=self.confirm_timeout
        )
        return ours

    @staticmethod
    def _kombu_dialer(kombu_conn: kombu.Connection) -> Callable[[], amqp.Connection]:
        def dial() -> amqp.Connection:
            conn: amqp.Connection = kombu_conn.transport.establish_connection()
            return conn

        return dial

    def _amqp_dialer(self, client: amqp.Connection) -> Callable[[], amqp.Connection]:
        def dial() -> amqp.Connection:
            conn = amqp.Connection(
                host=client.host,
                authentication=client.authentication,
                virtual_host=client.virtual_host,
                ssl=client.ssl,
                connect_timeout=self.confirm_timeout,
                client_properties=self._client_properties,
            )
            conn.connect()
            return conn

        return dial

    def describe(self) -> str:
        """The backend for logs and banners, credentials masked."""
        return (
            f"RabbitMQBackend({self._where}, prefix={self.prefix!r}, "
            f"slot_ttl={self.slot_ttl:g}s, claim-only)"
        )

    def open(self) -> None:
        """Connect (idempotent) and check the broker version.

        Raises:
            BackendUnavailable: the broker cannot be reached in
                ``confirm_timeout`` seconds.
            ConfigurationError: the broker refused the login or the vhost,
                or is older than RabbitMQ 3.9 (no streams).
        """
        with self._lock:
            fresh = self._conn is None
            try:
                conn = self._connection()
            except BackendUnavailable as exc:
                refused = exc.__cause__
                if isinstance(refused, AMQPError) and refused.reply_code in (403, 530):
                    raise ConfigurationError(
                        f"anarchon_backend {self._where}: the broker refused the login or "
                        f"virtual host ({refused.reply_text}); check the user, password and "
                        "vhost in the URL and the user's permissions."
                    ) from refused
                raise
            self._check_version(conn)
            if fresh:
                logger.info("anarchon: RabbitMQ claim backend ready: %s", self.describe())

    def _check_version(self, conn: amqp.Connection) -> None:
        raw = conn.server_properties.get("version", "")
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        numbers = tuple(int(n) for n in re.findall(r"\d+", text)[:2])
        if len(numbers) == 2 and numbers < MIN_RABBITMQ:
            raise ConfigurationError(
                f"anarchon_backend {self._where}: RabbitMQ {text} has no stream queues, "
                "which the RabbitMQ backend keeps history in; upgrade to RabbitMQ 3.9 or "
                "newer, or choose a Redis or SQL backend."
            )

    def close(self) -> None:
        """Close our connection (never the user's). Safe to call twice."""
        with self._lock:
            conn, self._conn = self._conn, None
            self._forget_channels()
            if conn is None:
                return
            try:
                with conn.transport.having_timeout(self.confirm_timeout):
                    conn.close()
            except Exception:  # closing a broken connection: drop it
                conn.collect()

    def _connection(self) -> amqp.Connection:
        """Our open connection, connecting first when there is none.

        Raises:
            BackendUnavailable: cannot connect.
        """
        if self._conn is not None and self._conn.connected:
            return self._conn
        self._drop()
        try:
            self._conn = self._dial()
        except (*_CONNECTION_ERRORS, AMQPError) as exc:
            raise BackendUnavailable(
                f"RabbitMQ backend: cannot connect to {self._where}: {exc}"
            ) from exc
        logger.debug("connected to %s", self._where)
        return self._conn

    def _drop(self) -> None:
        """Forget the connection without a handshake (it may be dead): no
        late reply on it can reach a later call."""
        conn, self._conn = self._conn, None
        self._forget_channels()
        if conn is not None:
            conn.collect()

    def _forget_channels(self) -> None:
        self._claim_channels.clear()
        self._history_ch = None
        self._streams.clear()
        self._stream_chs.clear()

    def _claim_channel(self, lane: int) -> _ConfirmChannel:
        channel = self._claim_channels.get(lane)
        if channel is None or not channel.usable:
            channel = _ConfirmChannel.opened(self._connection())
            self._claim_channels[lane] = channel
        return channel

    def _history_channel(self) -> _ConfirmChannel:
        if self._history_ch is None or not self._history_ch.usable:
            self._history_ch = _ConfirmChannel.opened(self._connection())
        return self._history_ch

    def _stream_channel(self, lane: int) -> _ConfirmChannel:
        if lane == 0:
            return self._history_channel()
        channel = self._stream_chs.get(lane)
        if channel is None or not channel.usable:
            channel = _ConfirmChannel.opened(self._connection())
            self._stream_chs[lane] = channel
        return channel

    def _drain_until(self, done: Callable[[], bool]) -> None:
        """Read frames until ``done()``.

        Raises:
            TimeoutError: no frame for ``confirm_timeout`` seconds.
            OSError, amqp ConnectionError: the connection failed.
        """
        conn = self._conn
        while not done():
            if conn is None or not conn.connected:
                raise amqp.exceptions.RecoverableConnectionError("connection lost")
            conn.drain_events(timeout=self.confirm_timeout)

    def _declare(self, lanes: Sequence[_Lane]) -> None:
        """Declare every lane's queues, pipelined per lane.

        A queue that exists with other arguments (406, e.g. another
        instance's ``slot_ttl``) is used as it is: declared again passively
        on a new channel. A passive declare of a queue that expired
        meanwhile (404) is made active again.

        Raises:
            BackendUnavailable: another channel error, or one queue failing
                three times.
            TimeoutError, OSError, amqp ConnectionError: from the connection.
        """
        for lane in lanes:
            lane.send()
        while True:
            self._drain_until(lambda: all(lane.settled for lane in lanes))
            broken = [lane for lane in lanes if lane.channel.error is not None]
            if not broken:
                return
            for lane in broken:
                self._recover(lane)

    def _recover(self, lane: _Lane) -> None:
        error = lane.channel.error
        assert error is not None
        item = lane.items[lane.failed_at]
        item.tries += 1
        if item.tries > 3 or error.reply_code not in (404, 406):
            raise BackendUnavailable(
                f"RabbitMQ backend: declaring queue {item.queue!r} failed: {error.reply_text}"
            ) from error
        if error.reply_code == 406:
            logger.info(
                "queue %s exists with other arguments (%s); using it as it is",
                item.queue,
                error.reply_text,
            )
        item.passive = error.reply_code == 406
        lane.start = lane.failed_at
        lane.channel = lane.new_channel()
        lane.send()

    def now_ms(self) -> int:
        """This host's clock, epoch ms (RabbitMQ has no clock to read)."""
        return _now_ms()
