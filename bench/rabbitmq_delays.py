"""Delays on RabbitMQ alone: per-message TTL's head-of-line blocking, and a
prototype of fixed delay levels (docs/delayed-designs.md).

``python -m bench.rabbitmq_delays [--long 30] [--short 1] [--count 5]
[--delays 0.5,1,3.7,12,45,95,150] [--per-delay 5] [--json PATH]`` runs, in
a vhost of its own on the local broker (deleted at the end), two
experiments, each timed by this host's clock (the broker's host):

1. **Per-message TTL plus a dead-letter exchange.** One queue ``wait``
   without consumers dead-letters to ``ready``. One message with a TTL
   (``expiration``) of ``--long`` seconds is published, then ``--count``
   messages of ``--short`` seconds; a consumer on ``ready`` stamps when each
   comes out. The same short messages alone in a second pair of queues are
   the control.
2. **Fixed delay levels** (RocketMQ's 18, 1 s ... 2 h). One queue per level
   with a queue-wide ``x-message-ttl``, so every message of a queue expires
   in the order it came in: no message waits behind a longer one. Each
   dead-letters to ``hop``, whose consumer (the router) reads the message's
   due time and sends it on: to the largest level that fits the time left,
   to a ``residual`` queue with a per-message TTL for a remainder under the
   smallest level (blocking there is bounded by that level), or, due, to
   the real queue ``target``. ``--per-delay`` messages of each of
   ``--delays`` (seconds) are parked at once; a consumer on ``target``
   stamps their lateness and hop count. The router publishes with
   confirms, then acks what it took: at least once.

The prototype lives here only: it is not a product store. Nothing here
asserts a time.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import amqp

from . import common

#: RocketMQ's default delay levels, seconds: ``messageDelayLevel`` = 1s 5s
#: 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h
#: (https://rocketmq.apache.org/docs/4.x/producer/04message3/).
LEVELS_S = (1, 5, 10, 30, 60, 120, 180, 240, 300, 360, 420, 480, 540, 600, 1200, 1800, 3600, 7200)

#: A remainder this small (ms) is sent to the real queue at once.
DUE_MS = 2


def now_ms() -> int:
    return int(time.time() * 1000)


def plan(
    remaining_ms: int, levels_s: Sequence[int] = LEVELS_S, slack_ms: int = 0
) -> tuple[list[int], int]:
    """The greedy decomposition of ``remaining_ms`` over ``levels_s``: the
    levels (seconds) waited in turn, largest first, and the remainder (ms,
    below the smallest level) left to the residual queue.

    A level up to ``slack_ms`` longer than what is left is taken too (the
    message is then late by that much, never early): without it a hop a
    few ms late turns the next 5 s level into 1 + 1 + 1 + 1 s + a residual.
    """
    hops: list[int] = []
    for level in sorted(levels_s, reverse=True):
        while remaining_ms + slack_ms >= level * 1000:
            hops.append(level)
            remaining_ms -= level * 1000
    return hops, max(remaining_ms, 0)


def connect(vhost: str) -> amqp.Connection:
    conn = amqp.Connection(common.RABBIT_HOST, userid="guest", password="guest", virtual_host=vhost)
    conn.connect()
    return conn


def drain(conn: amqp.Connection, until: Any, timeout_s: float) -> None:
    """Serve ``conn``'s consumers until ``until()`` or ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while not until() and time.monotonic() < deadline:
        with contextlib.suppress(TimeoutError):
            conn.drain_events(timeout=min(0.2, max(deadline - time.monotonic(), 0.01)))


# -- 1. per-message TTL -------------------------------------------------------------


def head_of_line(vhost: str, long_s: float, short_s: float, count: int) -> dict[str, Any]:
    """When the short messages come out behind a long one, and alone."""
    conn = connect(vhost)
    ch = conn.channel()
    out: dict[str, list[dict[str, Any]]] = {"blocked": [], "alone": []}
    for case in out:
        ch.queue_declare(f"{case}.ready", durable=True, auto_delete=False)
        ch.queue_declare(
            f"{case}.wait",
            durable=True,
            auto_delete=False,
            arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": f"{case}.ready"},
        )

        def arrived(message: amqp.Message, case: str = case) -> None:
            headers = message.properties["application_headers"]
            seen = now_ms()
            out[case].append(
                {
                    "label": headers["label"],
                    "ttl_ms": headers["ttl_ms"],
                    "late_ms": seen - headers["due_ms"],
                    "after_ms": seen - headers["sent_ms"],
                }
            )
            message.channel.basic_ack(message.delivery_tag)

        ch.basic_consume(f"{case}.ready", callback=arrived)

    def send(case: str, label: str, ttl_ms: int) -> None:
        sent = now_ms()
        headers = {"label": label, "ttl_ms": ttl_ms, "sent_ms": sent, "due_ms": sent + ttl_ms}
        message = amqp.Message(
            b"", expiration=str(ttl_ms), delivery_mode=2, application_headers=headers
        )
        ch.basic_publish(message, exchange="", routing_key=f"{case}.wait")

    send("blocked", "long", int(long_s * 1000))
    for n in range(count):
        send("blocked", f"short-{n}", int(short_s * 1000))
        send("alone", f"short-{n}", int(short_s * 1000))
    drain(conn, lambda: len(out["blocked"]) > count and len(out["alone"]) >= count, long_s + 30)
    conn.close()
    return {"long_s": long_s, "short_s": short_s, "count": count, **out}


# -- 2. fixed delay levels ------------------------------------------------------------


@dataclass
class Levels:
    """The levels prototype: its queues, its router, what reached ``target``."""

    vhost: str
    slack_ms: int = 0
    levels_s: Sequence[int] = LEVELS_S
    arrived: list[dict[str, Any]] = field(default_factory=list)
    routed: int = 0

    def declare(self, ch: Any) -> None:
        dead = {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": self.name("hop")}
        for level in self.levels_s:
            ch.queue_declare(
                self.queue(level),
                durable=True,
                auto_delete=False,
                arguments={**dead, "x-message-ttl": level * 1000},
            )
        ch.queue_declare(self.name("residual"), durable=True, auto_delete=False, arguments=dead)
        ch.queue_declare(self.name("hop"), durable=True, auto_delete=False)
        ch.queue_declare(self.name("target"), durable=True, auto_delete=False)

    def name(self, queue: str) -> str:
        """A queue of this variant (each slack has its own queues)."""
        return f"slack{self.slack_ms}.{queue}"

    def queue(self, level: int) -> str:
        return self.name(f"level.{level}s")

    def route(self, pub: Any, headers: dict[str, Any]) -> None:
        """Send a message on to where its time left takes it."""
        left = headers["due_ms"] - now_ms()
        hops, residual = plan(max(left, 0), self.levels_s, self.slack_ms)
        properties: dict[str, Any] = {"delivery_mode": 2}
        if hops:
            queue = self.queue(hops[0])
        elif residual > DUE_MS:
            queue = self.name("residual")
            properties["expiration"] = str(residual)
        else:
            queue = self.name("target")
        if queue != self.name("target"):
            headers = {**headers, "hops": headers["hops"] + 1}
        message = amqp.Message(b"", application_headers=headers, **properties)
        pub.basic_publish_confirm(message, exchange="", routing_key=queue, confirm_timeout=10)

    def run(self, delays_s: Sequence[float], per_delay: int) -> dict[str, Any]:
        consumer, publisher = connect(self.vhost), connect(self.vhost)
        ch, pub = consumer.channel(), publisher.channel()
        self.declare(ch)

        def hop(message: amqp.Message) -> None:
            self.route(pub, dict(message.properties["application_headers"]))
            self.routed += 1
            message.channel.basic_ack(message.delivery_tag)  # after the confirm: at least once

        def target(message: amqp.Message) -> None:
            headers = message.properties["application_headers"]
            self.arrived.append(
                {
                    "delay_s": headers["delay_s"],
                    "late_ms": now_ms() - headers["due_ms"],
                    "hops": headers["hops"],
                }
            )
            message.channel.basic_ack(message.delivery_tag)

        ch.basic_qos(0, 50, False)
        ch.basic_consume(self.name("hop"), callback=hop)
        ch.basic_consume(self.name("target"), callback=target)
        total = 0
        for delay in delays_s:
            for _ in range(per_delay):
                parked = now_ms()
                headers = {
                    "delay_s": delay,
                    "parked_ms": parked,
                    "due_ms": parked + int(delay * 1000),
                    "hops": 0,
                }
                self.route(pub, headers)  # the park is the first hop
                total += 1
        drain(consumer, lambda: len(self.arrived) >= total, max(delays_s) + 60)
        consumer.close()
        publisher.close()
        return {
            "slack_ms": self.slack_ms,
            "per_delay": per_delay,
            "routed": self.routed,
            "arrived": self.arrived,
        }


# -- report -------------------------------------------------------------------------


def _ms(values: Sequence[float]) -> str:
    if not values:
        return "-"
    return f"{min(values):.0f} / {statistics.median(values):.0f} / {max(values):.0f}"


def report(
    hol: dict[str, Any], variants: Sequence[dict[str, Any]], delays_s: Sequence[float]
) -> None:
    print(common.header("RabbitMQ delays: per-message TTL and fixed levels"))
    print(
        f"\n1. Per-message TTL + DLX: one {hol['long_s']:g} s message, then "
        f"{hol['count']} of {hol['short_s']:g} s\n"
    )
    rows = []
    for case in ("blocked", "alone"):
        shorts = [r for r in hol[case] if r["label"] != "long"]
        longs = [r for r in hol[case] if r["label"] == "long"]
        rows.append(
            [
                "behind the long one" if case == "blocked" else "alone (control)",
                _ms([r["after_ms"] for r in shorts]),
                _ms([r["late_ms"] for r in shorts]),
                _ms([r["late_ms"] for r in longs]) if longs else "-",
            ]
        )
    print(
        common.table(
            [
                "short messages",
                "out after, ms (min/med/max)",
                "late, ms",
                "long one late, ms",
            ],
            rows,
        )
    )
    print("\n2. Fixed levels (RocketMQ's 18), router + residual queue\n")
    rows = []
    for levels in variants:
        for delay in delays_s:
            got = [r for r in levels["arrived"] if r["delay_s"] == delay]
            planned, residual = plan(int(delay * 1000), slack_ms=levels["slack_ms"])
            parts = [f"{h} s" for h in planned] + ([f"{residual} ms"] if residual else [])
            hops = [r["hops"] for r in got]
            rows.append(
                [
                    levels["slack_ms"],
                    f"{delay:g}",
                    " + ".join(parts),
                    len(parts),
                    f"{min(hops)}-{max(hops)}" if got else "-",
                    f"{len(got)}/{levels['per_delay']}",
                    _ms([r["late_ms"] for r in got]),
                ]
            )
    headers = [
        "slack, ms",
        "delay, s",
        "planned at park",
        "hops planned",
        "hops taken",
        "arrived",
        "late, ms (min/med/max)",
    ]
    print(common.table(headers, rows))
    for levels in variants:
        print(f"\nslack {levels['slack_ms']} ms: router hops in all: {levels['routed']}")
    print("\nDecomposition of longer delays (computed, not run):\n")
    rows = []
    for label, seconds in (
        ("95 s", 95),
        ("59 min 59.5 s", 3599.5),
        ("3 h", 3 * 3600),
        ("1 day", 86400),
        ("7 days", 7 * 86400),
        ("30 days", 30 * 86400),
    ):
        planned, residual = plan(int(seconds * 1000))
        rows.append([label, len(planned) + (1 if residual else 0), residual])
    print(common.table(["delay", "hops (levels + residual)", "residual, ms"], rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--long", type=float, default=30.0, help="the long TTL, s")
    parser.add_argument("--short", type=float, default=1.0, help="the short TTL, s")
    parser.add_argument("--count", type=int, default=5, help="short messages")
    parser.add_argument(
        "--delays", default="0.5,1,3.7,12,45,95,150", help="levels' delays, s (comma-separated)"
    )
    parser.add_argument("--per-delay", type=int, default=5, help="messages per delay")
    parser.add_argument(
        "--slack", default="0,50", help="the levels' slack, ms (comma-separated; run at once)"
    )
    parser.add_argument("--json", default=None, help="write the raw results here")
    args = parser.parse_args(argv)
    delays = [float(d) for d in args.delays.split(",") if d.strip()]
    if not common.service_up("rabbitmq"):
        common.log("RabbitMQ is not running on 127.0.0.1:5672")
        return 1
    common.exit_on_sigterm()
    with common.rabbit_vhost(f"anarchon-delays-{common.RUN_ID}") as vhost:
        common.log(f"per-message TTL: {args.long:g} s then {args.count} x {args.short:g} s")
        hol = head_of_line(vhost, args.long, args.short, args.count)
        slacks = [int(x) for x in args.slack.split(",") if x.strip()]
        common.log(f"levels: {args.per_delay} x each of {delays} s, slack {slacks} ms")
        variants: list[dict[str, Any]] = [{} for _ in slacks]

        def run(i: int) -> None:
            variants[i] = Levels(vhost, slacks[i]).run(delays, args.per_delay)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(slacks))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    report(hol, variants, delays)
    common.write_json(
        args.json, {"machine": common.machine(), "head_of_line": hol, "levels": variants}
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
