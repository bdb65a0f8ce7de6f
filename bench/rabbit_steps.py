"""Where a RabbitMQ claim batch spends its time, step by step.

``python -m bench.rabbit_steps [--jobs 200] [--repeats 3]`` runs, in a vhost
of its own, ``RabbitMQBackend.claim`` for one slot of ``--jobs`` jobs (as a
burst's round does) and times each broker step of it through wrappers on the
backend's own methods:

* ``gates declare``: the gate ``queue.declare`` of every slot, pipelined
  over the backend's channels (``_declared_lanes``);
* ``gates publish+confirm``: the claim messages and their publisher
  confirms (``_publish_claims``);
* ``streams declare``: the history streams' ``queue.declare`` on this
  connection (``_declare_streams``: on a job's first claim of a connection);
* ``history append``: the ``claimed`` records published to the streams and
  their confirms (``_append`` minus the stream declares);
* ``mark sent``: ``mark_many(sent)`` of the won claims (the scheduler's next
  call).

Cases, in each repeat: ``cold`` (new jobs: streams are created), ``warm``
(next slot, same backend: streams known on this connection), ``new
connection`` (next slot, a new backend: streams exist, declared again). The
floor, the same number of gate declares alone, is measured in the same
repeat (``bench.claims.RabbitFloor.batch``). Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from celery_anarchon.backends.base import ClaimRequest, State
from celery_anarchon.backends.rabbitmq import RabbitMQBackend

from . import common
from .claims import RabbitFloor

STEPS = ("gates declare", "gates publish+confirm", "streams declare", "history append")


def _timed(backend: RabbitMQBackend, times: dict[str, float]) -> None:
    """Wrap the backend's step methods to add their wall time to ``times``."""

    def wrap(name: str, step: str) -> None:
        original: Callable[..., Any] = getattr(backend, name)

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                times[step] += time.perf_counter() - started

        setattr(backend, name, timed)

    wrap("_declared_lanes", "gates declare")
    wrap("_publish_claims", "gates publish+confirm")
    wrap("_declare_streams", "streams declare")
    wrap("_append", "append total")


def one_case(backend: RabbitMQBackend, jobs: list[str], slot_ms: int) -> dict[str, float]:
    times: dict[str, float] = defaultdict(float)
    _timed(backend, times)
    requests = [
        ClaimRequest(
            job,
            slot_ms,
            window_before_ms=62_000,
            window_after_ms=10_000,
            keep_until_ms=slot_ms + 80_000,
        )
        for job in jobs
    ]
    started = time.perf_counter()
    claims = backend.claim(requests)
    times["claim total"] = time.perf_counter() - started
    append_in_claim = times["append total"]
    streams_in_claim = times["streams declare"]
    times["history append"] = append_in_claim - streams_in_claim
    won = [c for c in claims if c.won]
    started = time.perf_counter()
    backend.mark_many(won, State.SENT, task_ids=[f"t-{c.job}" for c in won])
    times["mark sent"] = time.perf_counter() - started
    times["won"] = len(won)
    for c in claims:
        if not c.won:
            times[f"lost {c.reason}"] = times.get(f"lost {c.reason}", 0) + 1
    del times["append total"]
    for name in ("_declared_lanes", "_publish_claims", "_declare_streams", "_append"):
        backend.__dict__.pop(name, None)
    return dict(times)


def delete_queues(vhost: str, names: list[str]) -> None:
    """Delete ``names`` (gates hold a file descriptor each on the broker:
    the shared broker's limit is 1,024, so no case leaves its gates behind)."""
    import amqp

    conn = amqp.Connection(common.RABBIT_HOST, userid="guest", password="guest", virtual_host=vhost)
    conn.connect()
    try:
        channel = conn.channel()
        for name in names:
            channel.queue_delete(name)
    finally:
        conn.close()


def stream_lanes(vhost: str, count: int, lanes: int) -> float:
    """Seconds to create ``count`` new history streams pipelined over
    ``lanes`` channels (then deleted)."""
    import amqp
    from amqp import spec

    from celery_anarchon.backends.rabbitmq import history_arguments
    from celery_anarchon.backends.rabbitmq.channel import _ConfirmChannel

    conn = amqp.Connection(common.RABBIT_HOST, userid="guest", password="guest", virtual_host=vhost)
    conn.connect()
    names = [f"x{lanes}.job-{i:06d}.history" for i in range(count)]
    try:
        channels = [_ConfirmChannel.opened(conn) for _ in range(lanes)]
        for channel in channels:
            channel.declared = 0
        started = time.perf_counter()
        for i, name in enumerate(names):
            channels[i % lanes].send_method(
                spec.Queue.Declare,
                "BsbbbbbF",
                (0, name, False, True, False, False, False, history_arguments(100, name)),
            )
        while sum(c.declared for c in channels) < count:
            conn.drain_events(timeout=30)
        took = time.perf_counter() - started
        plain = conn.channel()
        for name in names:
            plain.queue_delete(name)
        return took
    finally:
        conn.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    common.log(common.header("RabbitMQ claim steps"))
    rows: dict[str, list[dict[str, float]]] = defaultdict(list)
    floors: list[float] = []
    rows_lanes: dict[int, list[float]] = defaultdict(list)
    for repeat in range(args.repeats):
        with common.rabbit_vhost(f"anarchon-steps-{common.RUN_ID}-{repeat}") as vhost:
            url = common.rabbit_url(vhost)
            jobs = [f"job-{i:06d}" for i in range(args.jobs)]
            slot = (int(time.time()) // 60) * 60_000
            floor = RabbitFloor(vhost, "floor.")
            try:
                started = time.perf_counter()
                floor.batch([str(i) for i in range(args.jobs)])
                floors.append(time.perf_counter() - started)
            finally:
                floor.close()
            delete_queues(vhost, [f"floor.{i}" for i in range(args.jobs)])
            for lanes in (1, 8):
                rows_lanes[lanes].append(stream_lanes(vhost, args.jobs, lanes))
            first = RabbitMQBackend(url, instance=f"steps-a-{repeat}", prefix="s.")
            first.open()
            try:
                rows["cold"].append(one_case(first, jobs, slot))
                delete_queues(vhost, [first.gate_queue(j, slot) for j in jobs])
                rows["warm"].append(one_case(first, jobs, slot + 60_000))
                delete_queues(vhost, [first.gate_queue(j, slot + 60_000) for j in jobs])
            finally:
                first.close()
            second = RabbitMQBackend(url, instance=f"steps-b-{repeat}", prefix="s.")
            second.open()
            try:
                rows["new connection"].append(one_case(second, jobs, slot + 120_000))
                delete_queues(vhost, [second.gate_queue(j, slot + 120_000) for j in jobs])
            finally:
                second.close()
    common.log(f"declare-only floor, {args.jobs} gates: {common.fmt(common.spread(floors), 3)} s")
    for lanes, took in rows_lanes.items():
        common.log(
            f"{args.jobs} new streams over {lanes} channel(s): "
            f"{common.fmt(common.spread(took), 3)} s"
        )
    headers = ["case", *STEPS, "claim total", "mark sent", "won"]
    table = []
    for case, results in rows.items():
        line = [case]
        for step in (*STEPS, "claim total", "mark sent"):
            line.append(common.fmt(common.spread([r.get(step, 0.0) for r in results]), 3))
        line.append(str(statistics.median(r["won"] for r in results)))
        table.append(line)
    common.log(common.table(headers, table))
    for case, results in rows.items():
        lost = [{k: v for k, v in r.items() if k.startswith("lost")} for r in results]
        if any(lost):
            common.log(f"{case}: {lost}")


if __name__ == "__main__":
    main()
