"""Readers that take each message off a benchmark's queue as it arrives and
stamp it with the time it was read (the burst and steady benchmarks).

A message read at time ``t`` was in the broker at ``t`` at the latest, so a
message's lateness, read time minus its slot, is over-, never
under-estimated: by at most one poll (:data:`POLL_S` plus the read) on an
idle queue, more when the reader waits for a core. Readers take messages in
batches so that they are not the bottleneck, and parse them only after the
run so that they cost little CPU while the instances send:

* Redis (:class:`Reader`): ``RPOP`` of up to :data:`BATCH` messages per call
  (Celery's Redis transport ``LPUSH``-es a queue's messages, so this reads
  them first in, first out);
* AMQP (:class:`AmqpReader`): one ``basic_consume`` without acknowledgements
  or a prefetch limit, so the broker pushes as fast as it can.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import redis

#: Poll period of a Redis reader while the queue is empty, seconds.
POLL_S = 0.005
#: Messages per ``RPOP``.
BATCH = 1000


def is_amqp(url: str) -> bool:
    return url.startswith(("amqp://", "pyamqp://"))


def reader_for(url: str, queue: str) -> Reader:
    """The reader of ``queue`` on the broker at ``url`` (not started)."""
    return AmqpReader(url, queue) if is_amqp(url) else Reader(url, queue)


class Reader(threading.Thread):
    """Drains a Redis ``queue`` continuously; ``batches`` holds ``(read time,
    raw messages)``.

    Attributes:
        count: messages read so far.
        error: what stopped the thread, if anything did.
    """

    def __init__(self, url: str, queue: str) -> None:
        super().__init__(daemon=True, name="bench-reader")
        self.url, self.queue = url, queue
        self.batches: list[tuple[float, list[Any]]] = []
        self.count = 0
        self.halt = threading.Event()
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._generation = 0
        self._open()

    def _open(self) -> None:
        """Connect to the broker (before the thread starts)."""
        self.client = redis.Redis.from_url(self.url)

    def run(self) -> None:
        try:
            while not self.halt.is_set():
                if not self.read_once():
                    time.sleep(POLL_S)
        except BaseException as exc:  # reported by the benchmark
            self.error = exc

    def read_once(self) -> int:
        generation = self._generation
        items = self.client.rpop(self.queue, BATCH)
        if not items:
            return 0
        self._keep(time.time(), list(items), generation)
        return len(items)

    def _keep(self, at: float, items: list[Any], generation: int) -> None:
        """Keep a read, unless :meth:`reset` came while it was in flight."""
        with self._lock:
            if generation != self._generation:
                return
            self.batches.append((at, items))
            self.count += len(items)

    def reset(self) -> None:
        """Forget what was read so far (earlier rounds, a start-up catch-up),
        a read in flight included."""
        with self._lock:
            self._generation += 1
            self.batches, self.count = [], 0

    def messages(self) -> Iterator[tuple[float, dict[str, Any]]]:
        """``(read time, Celery headers)`` of every message read, in order
        (the Redis transport stores a JSON envelope with the headers)."""
        for at, items in self.batches:
            for raw in items:
                yield at, json.loads(raw).get("headers") or {}

    def finish(self, quiet_s: float = 2.0, timeout: float = 60.0) -> None:
        """Stop the thread, then read until the queue was empty ``quiet_s``."""
        self.halt.set()
        self.join(10)
        deadline = time.monotonic() + timeout
        empty_since = time.monotonic()
        while time.monotonic() < deadline:
            if self.read_once():
                empty_since = time.monotonic()
            elif time.monotonic() - empty_since > quiet_s:
                break
            else:
                time.sleep(0.05)
        self.close()

    def close(self) -> None:
        self.client.close()


class AmqpReader(Reader):
    """Drains an AMQP ``queue`` (declared as Celery declares a
    ``task_default_queue``: durable, no arguments) with one consumer; each
    delivery is stamped as py-amqp hands it over, ``batches`` holding one
    ``(read time, [headers])`` per delivery."""

    def _open(self) -> None:
        import amqp
        from kombu.utils.url import url_to_parts

        parts = url_to_parts(self.url)
        self.connection = amqp.Connection(
            f"{parts.hostname or '127.0.0.1'}:{parts.port or 5672}",
            userid=parts.username or "guest",
            password=parts.password or "guest",
            virtual_host=parts.path or "/",
        )
        self.connection.connect()
        self.channel = self.connection.channel()
        self.channel.queue_declare(self.queue, durable=True, auto_delete=False)
        self.channel.basic_consume(self.queue, callback=self._delivered, no_ack=True)

    def _delivered(self, message: Any) -> None:
        headers = message.properties.get("application_headers") or {}
        self._keep(time.time(), [headers], self._generation)

    def read_once(self) -> int:
        before = self.count
        with contextlib.suppress(TimeoutError):  # socket.timeout: nothing came
            self.connection.drain_events(timeout=POLL_S * 10)
        return self.count - before

    def messages(self) -> Iterator[tuple[float, dict[str, Any]]]:
        for at, items in self.batches:
            for headers in items:
                yield at, dict(headers)

    def close(self) -> None:
        with contextlib.suppress(Exception):  # a broken connection: nothing to keep
            self.connection.close()
