"""What one message costs to send, three ways, side by side in one run.

    python -m bench.send_cost [--messages 10000] [--repeats 3] [--broker redis://127.0.0.1:6379/1]

In one process, against a real Redis broker, ``--messages`` messages of one
beat entry (task ``bench.t``, args ``[i]``, the ``anarchon_*`` headers) are
sent:

* ``apply_async``: message by message through
  :func:`celery_anarchon.message.send_slot` (Celery's ``apply_async``), one
  broker round trip each: the send path before issue 14;
* ``batch``: the same messages through
  :class:`celery_anarchon.beat.batch.BatchWriter` (``apply_async`` inside
  kombu's ``Producer.batch()``, one pipeline per 500): the send path now;
* ``floor``: messages built with Celery's ``app.amqp.as_task_v2``, encoded
  as kombu's Redis transport encodes them, and written with ``LPUSH`` in
  pipelines of 1,000: no Celery publish machinery, no scheduler.

Per path: wall and CPU milliseconds per message (median over
``--repeats``, paths interleaved in each repeat), and the ratio to the
floor. Every message is counted on the queue afterwards; the queue is
deleted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery, beat
from kombu.utils.json import dumps as kombu_dumps

from celery_anarchon.beat.batch import BatchWriter, Outcome
from celery_anarchon.message import send_slot, task_id_for


def task_id(i: int) -> str:
    return task_id_for(f"j{i}", i, namespace="bench:")


def make_app(broker: str, queue: str) -> Celery:
    app = Celery("bench-send", set_as_current=False, broker=broker)
    app.conf.update(task_default_queue=queue, timezone="UTC")
    return app


def entry(app: Celery) -> beat.ScheduleEntry:
    return beat.ScheduleEntry(name="job", task="bench.t", schedule=60.0, args=(1,), app=app)


def path_apply_async(app: Celery, n: int) -> None:
    e = entry(app)
    with app.producer_or_acquire() as producer:
        for i in range(n):
            send_slot(
                app, e, job=f"j{i}", slot_ms=i, token=1, task_id=task_id(i),
                producer=producer, retry=False,
            )  # fmt: skip


def path_batch(app: Celery, n: int) -> None:
    e = entry(app)

    def publish(i: int, producer: Any) -> None:
        # as the Publisher does: the queue declared by the first message only
        send_slot(
            app, e, job=f"j{i}", slot_ms=i, token=1, task_id=task_id(i),
            producer=producer, retry=False, declare=[] if i else None,
        )  # fmt: skip

    with app.producer_or_acquire() as producer:
        outcomes = BatchWriter(publish).write(producer, list(range(n)), lambda i: True)
    assert all(o is Outcome.SENT for o, _ in outcomes)


def path_floor(app: Celery, n: int) -> None:
    """as_task_v2, kombu's envelope, LPUSH in pipelines of 1,000."""
    client = redis.Redis.from_url(app.conf.broker_url)
    queue = app.conf.task_default_queue
    pipe = client.pipeline(transaction=False)
    for i in range(n):
        headers, properties, body, _ = app.amqp.as_task_v2(
            task_id(i), "bench.t", args=(1,), kwargs={}
        )
        headers.update({"celery_beat_task": True, "anarchon_job": f"j{i}"})
        envelope = {
            "body": json.dumps(body),
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": headers,
            "properties": {
                **properties,
                "delivery_mode": 2,
                "delivery_info": {"exchange": "", "routing_key": queue},
                "priority": 0,
                "body_encoding": "base64",
                "delivery_tag": str(uuid.uuid4()),
            },
        }
        pipe.lpush(queue, kombu_dumps(envelope))
        if (i + 1) % 1000 == 0:
            pipe.execute()
    pipe.execute()


PATHS: dict[str, Callable[[Celery, int], None]] = {
    "apply_async": path_apply_async,
    "batch": path_batch,
    "floor": path_floor,
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--broker", default="redis://127.0.0.1:6379/1")
    parser.add_argument("--json", action="store_true", help="print raw figures as JSON")
    args = parser.parse_args(argv)
    queue = f"bench-send-{uuid.uuid4().hex[:8]}"
    app = make_app(args.broker, queue)
    client = redis.Redis.from_url(args.broker)
    path_batch(app, 10)  # warm: imports, connection, queue declare
    client.delete(queue)
    wall: dict[str, list[float]] = {name: [] for name in PATHS}
    cpu: dict[str, list[float]] = {name: [] for name in PATHS}
    try:
        for _ in range(args.repeats):
            for name, path in PATHS.items():
                started, started_cpu = time.perf_counter(), time.process_time()
                path(app, args.messages)
                wall[name].append((time.perf_counter() - started) * 1000 / args.messages)
                cpu[name].append((time.process_time() - started_cpu) * 1000 / args.messages)
                count = sum(client.llen(k) for k in client.scan_iter(f"{queue}*"))
                assert count == args.messages, (name, count)
                for key in client.scan_iter(f"{queue}*"):
                    client.delete(key)
    finally:
        for key in client.scan_iter(f"{queue}*"):
            client.delete(key)
    floor = statistics.median(cpu["floor"])
    rows = {
        name: {
            "wall_ms": statistics.median(wall[name]),
            "cpu_ms": statistics.median(cpu[name]),
            "cpu_ratio_to_floor": statistics.median(cpu[name]) / floor,
        }
        for name in PATHS
    }
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{args.messages:,} messages, median of {args.repeats}, Redis broker {args.broker}")
    print("| path | wall ms/msg | CPU ms/msg | CPU / floor |")
    print("|---|---|---|---|")
    for name, row in rows.items():
        print(
            f"| {name} | {row['wall_ms']:.3f} | {row['cpu_ms']:.3f} | "
            f"{row['cpu_ratio_to_floor']:.1f}x |"
        )


if __name__ == "__main__":
    main()
