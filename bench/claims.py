"""Benchmark 1: claim round trip per backend, next to the raw floor of the
same server over the same kind of connection.

    python -m bench.claims [--backends redis,postgresql,mysql,sqlite,rabbitmq]
                           [--single 300] [--batch 500] [--batches 4] [--repeats 5]

For each backend and each repeat, side by side (the order of ours and the
floor alternates between repeats):

* single: ``--single`` claims of one slot each (``Backend.claim([request])``),
  one after another, each timed; the floor does the same number of plain
  operations: Redis ``SET key 1 NX PX``; SQL one ``INSERT INTO <one-column
  table> .. ON CONFLICT DO NOTHING`` (MySQL ``ON DUPLICATE KEY UPDATE k = k``)
  in its own transaction; RabbitMQ one ``queue.declare`` of a gate queue with
  the gate's arguments.
* batched: ``--batches`` batches of ``--batch`` slots (distinct jobs, one
  slot each, as in a burst); the floor sends the same number of plain
  operations in one go: a Redis pipeline, one multi-row ``INSERT``, or
  declares pipelined over as many channels as the backend uses.

A warm-up call of each kind runs first and is not timed (it creates the
RabbitMQ history streams and opens pools). Everything the run creates (keys,
tables, the SQLite folder, a RabbitMQ vhost) is removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from celery_anarchon.backends import backend_from_url
from celery_anarchon.backends.base import Backend, ClaimRequest

from . import common
from .common import log

ALL = ["redis", "postgresql", "mysql", "sqlite", "rabbitmq"]

#: The claim windows of a job with default settings (jitter 2 s, max_late
#: 60 s, max_skew 10 s), milliseconds.
WINDOW_BEFORE_MS = 62_000
WINDOW_AFTER_MS = 10_000
KEEP_MS = 2_000 + 60_000 + 10_000 + 60_000

#: Gate queue arguments the RabbitMQ floor declares (those of the backend).
GATE_ARGS = {
    "x-queue-type": "classic",
    "x-max-length": 1,
    "x-overflow": "reject-publish",
    "x-expires": 300_000,
}
#: Channels the RabbitMQ floor pipelines a batch over (the backend's count).
RABBIT_CHANNELS = 8


def request(job: str, slot_ms: int) -> ClaimRequest:
    """A claim request with the default windows."""
    return ClaimRequest(
        job=job,
        slot_ms=slot_ms,
        window_before_ms=WINDOW_BEFORE_MS,
        window_after_ms=WINDOW_AFTER_MS,
        keep_until_ms=slot_ms + KEEP_MS,
    )


def now_ms() -> int:
    return time.time_ns() // 1_000_000


# -- floors ------------------------------------------------------------------------


class Floor:
    """The plainest write with the same uniqueness rule on the same server."""

    name = "floor"

    def single(self, key: str) -> None:
        raise NotImplementedError

    def batch(self, keys: Sequence[str]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release connections (and remove what was made)."""


class RedisFloor(Floor):
    name = "SET NX PX"

    def __init__(self, url: str, prefix: str) -> None:
        import redis

        self.client = redis.Redis.from_url(url, socket_timeout=5, decode_responses=True)
        self.prefix = prefix

    def single(self, key: str) -> None:
        self.client.set(self.prefix + key, "1", nx=True, px=120_000)

    def batch(self, keys: Sequence[str]) -> None:
        with self.client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.set(self.prefix + key, "1", nx=True, px=120_000)
            pipe.execute()

    def close(self) -> None:
        common.redis_delete(self.client, self.prefix + "*")
        self.client.close()


class SQLFloor(Floor):
    """``INSERT .. ON CONFLICT DO NOTHING`` into a one-column table, through
    the same driver (psycopg 3, PyMySQL, sqlite3) as the backend, without
    SQLAlchemy's statement building (driver-level SQL)."""

    def __init__(self, url: str, table: str) -> None:
        import sqlalchemy as sa

        self.kind = "mysql" if url.startswith("mysql") else url.split(":", 1)[0].split("+")[0]
        self.table = table
        self.engine = sa.create_engine(common._sa_url(url))
        if self.kind == "sqlite":
            sa.event.listen(self.engine, "connect", _sqlite_wal)
        mark = "?" if self.kind == "sqlite" else "%s"
        self.mark = mark
        key_type = "VARCHAR(255)"
        with self.engine.begin() as conn:
            conn.exec_driver_sql(f"CREATE TABLE {table} (k {key_type} PRIMARY KEY)")
        self.name = (
            "INSERT .. ON DUPLICATE KEY UPDATE k = k"
            if self.kind == "mysql"
            else "INSERT .. ON CONFLICT DO NOTHING"
        )

    def _sql(self, rows: int) -> str:
        values = ",".join([f"({self.mark})"] * rows)
        tail = "ON DUPLICATE KEY UPDATE k = k" if self.kind == "mysql" else "ON CONFLICT DO NOTHING"
        return f"INSERT INTO {self.table} (k) VALUES {values} {tail}"

    def single(self, key: str) -> None:
        with self.engine.begin() as conn:
            conn.exec_driver_sql(self._sql(1), (key,))

    def batch(self, keys: Sequence[str]) -> None:
        with self.engine.begin() as conn:
            conn.exec_driver_sql(self._sql(len(keys)), tuple(keys))

    def close(self) -> None:
        with contextlib.suppress(Exception), self.engine.begin() as conn:
            conn.exec_driver_sql(f"DROP TABLE {self.table}")
        self.engine.dispose()


def _sqlite_wal(dbapi_connection: Any, _record: Any) -> None:
    dbapi_connection.execute("PRAGMA journal_mode=WAL").close()


class RabbitFloor(Floor):
    """``queue.declare`` of a gate queue (same arguments as the backend's),
    on a connection of its own; a batch is pipelined over
    :data:`RABBIT_CHANNELS` channels, as the backend pipelines its declares."""

    name = "queue.declare"

    def __init__(self, vhost: str, prefix: str) -> None:
        import amqp

        self.conn = amqp.Connection(
            common.RABBIT_HOST, userid="guest", password="guest", virtual_host=vhost
        )
        self.conn.connect()
        self.prefix = prefix
        self.channel = self.conn.channel()
        self.lanes = [_CountingChannel.opened(self.conn) for _ in range(RABBIT_CHANNELS)]

    def single(self, key: str) -> None:
        self.channel.queue_declare(self.prefix + key, durable=True, arguments=GATE_ARGS)

    def batch(self, keys: Sequence[str]) -> None:
        from amqp import spec

        lanes = self.lanes[: max(1, min(len(self.lanes), len(keys)))]
        for lane in lanes:
            lane.declared = 0
        wanted = [0] * len(lanes)
        for i, key in enumerate(keys):
            lane_index = i % len(lanes)
            wanted[lane_index] += 1
            lanes[lane_index].send_method(
                spec.Queue.Declare,
                "BsbbbbbF",
                (0, self.prefix + key, False, True, False, False, False, GATE_ARGS),
            )
        deadline = time.monotonic() + 120
        while any(lane.declared < n for lane, n in zip(lanes, wanted, strict=True)):
            if time.monotonic() > deadline:
                raise TimeoutError("RabbitMQ floor: declare-ok replies missing after 120 s")
            self.conn.drain_events(timeout=30)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.close()


def _counting_channel_class() -> type[Any]:
    import amqp
    from amqp import spec

    class CountingChannel(amqp.Channel):
        """A channel that counts ``queue.declare-ok`` replies."""

        declared = 0

        def _setup_listeners(self) -> None:
            super()._setup_listeners()
            self._callbacks[spec.Queue.DeclareOk] = self._on_declare_ok

        def _on_declare_ok(self, *_: Any) -> None:
            self.declared += 1

        @classmethod
        def opened(cls, connection: Any) -> CountingChannel:
            channel = cls(connection)
            channel.open()
            return channel

    return CountingChannel


class _CountingChannel:
    """Lazy holder so that importing this module does not import py-amqp."""

    @staticmethod
    def opened(connection: Any) -> Any:
        return _counting_channel_class().opened(connection)


# -- set-up per backend ------------------------------------------------------------


@dataclass
class Subject:
    """One backend under test and its floor."""

    name: str
    backend: Backend
    floor: Floor
    url: str


@contextlib.contextmanager
def subject(name: str) -> Iterator[Subject]:
    """The backend ``name`` (unique prefix, opened) and its floor; removes
    everything both made on exit."""
    tag = f"anarchon_bench_{common.RUN_ID}_"
    instance = f"bench:{os.getpid()}:{common.RUN_ID}"
    if name == "redis":
        prefix = f"anarchon-bench-{common.RUN_ID}:"
        backend = backend_from_url(common.REDIS_URL, instance=instance, options={"prefix": prefix})
        floor: Floor = RedisFloor(common.REDIS_URL, prefix + "floor:")
        try:
            backend.open()
            yield Subject(name, backend, floor, common.REDIS_URL)
        finally:
            backend.close()
            floor.close()
            import redis

            client = redis.Redis.from_url(common.REDIS_URL)
            common.redis_delete(client, "{" + prefix + "*")
            client.close()
    elif name in ("postgresql", "mysql"):
        url = common.POSTGRES_URL if name == "postgresql" else common.MYSQL_URL
        backend = backend_from_url(url, instance=instance, options={"prefix": tag})
        floor = SQLFloor(url, tag + "floor")
        try:
            backend.open()
            yield Subject(name, backend, floor, url)
        finally:
            backend.close()
            floor.close()
            common.drop_sql_tables(url, tag)
    elif name == "sqlite":
        folder = Path(tempfile.mkdtemp(prefix="anarchon-bench-"))
        url = f"sqlite:///{folder / 'claims.db'}"
        backend = backend_from_url(url, instance=instance)
        floor = SQLFloor(f"sqlite:///{folder / 'floor.db'}", "floor")
        try:
            backend.open()
            yield Subject(name, backend, floor, url)
        finally:
            backend.close()
            floor.close()
            shutil.rmtree(folder, ignore_errors=True)
    elif name == "rabbitmq":
        with common.rabbit_vhost(f"anarchon-bench-{common.RUN_ID}") as vhost:
            url = common.rabbit_url(vhost)
            backend = backend_from_url(url, instance=instance, options={"prefix": "b."})
            floor = RabbitFloor(vhost, "floor.")
            try:
                backend.open()
                yield Subject(name, backend, floor, url)
            finally:
                backend.close()
                floor.close()
    else:
        raise ValueError(f"unknown backend {name!r}; choose from {', '.join(ALL)}")


# -- measuring ---------------------------------------------------------------------


def timed(calls: int, one: Callable[[int], None]) -> list[float]:
    """Seconds each of ``calls`` calls of ``one(i)`` took."""
    out = []
    for i in range(calls):
        started = time.perf_counter()
        one(i)
        out.append(time.perf_counter() - started)
    return out


def run_single(s: Subject, rep: int, calls: int, ours_first: bool) -> dict[str, list[float]]:
    job = f"single-{rep}"
    base = now_ms() - 20_000
    lost: list[int] = []

    def ours(i: int) -> None:
        [claim] = s.backend.claim([request(job, base + i + 1)])
        if not claim.won:
            lost.append(i)

    def floor(i: int) -> None:
        s.floor.single(f"s{rep}-{i + 1}")

    ours(-1)  # warm-up: pools, scripts, the job's history stream
    floor(-1)
    if ours_first:
        mine, theirs = timed(calls, ours), timed(calls, floor)
    else:
        theirs, mine = timed(calls, floor), timed(calls, ours)
    if lost:
        raise RuntimeError(f"{s.name}: {len(lost)} fresh single claims were lost")
    return {"ours": mine, "floor": theirs}


def run_batched(
    s: Subject, rep: int, size: int, batches: int, ours_first: bool
) -> dict[str, list[float]]:
    jobs = [f"b{rep}-{j}" for j in range(size)]
    base = now_ms() - 20_000

    def ours(k: int) -> None:
        claims = s.backend.claim([request(job, base + k + 1) for job in jobs])
        lost = sum(1 for c in claims if not c.won)
        if lost:
            raise RuntimeError(f"{s.name}: {lost} of {size} fresh batched claims were lost")

    def floor(k: int) -> None:
        s.floor.batch([f"b{rep}-{k + 1}-{j}" for j in range(size)])

    ours(-1)  # warm-up: creates the jobs' history streams on RabbitMQ
    floor(-1)
    if ours_first:
        mine, theirs = timed(batches, ours), timed(batches, floor)
    else:
        theirs, mine = timed(batches, floor), timed(batches, ours)
    return {"ours": [size / t for t in mine], "floor": [size / t for t in theirs]}


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Every repeat of one backend: per-repeat medians, p99s and rates."""
    reps: list[dict[str, float]] = []
    with subject(name) as s:
        floor_name = s.floor.name
        for rep in range(args.repeats):
            ours_first = rep % 2 == 0
            single = run_single(s, rep, args.single, ours_first)
            batched = run_batched(s, rep, args.batch, args.batches, ours_first)
            row = {
                "single_median_ours": statistics.median(single["ours"]),
                "single_median_floor": statistics.median(single["floor"]),
                "single_p99_ours": common.percentile(single["ours"], 99),
                "single_p99_floor": common.percentile(single["floor"], 99),
                "batched_rate_ours": statistics.median(batched["ours"]),
                "batched_rate_floor": statistics.median(batched["floor"]),
            }
            row["single_ratio"] = row["single_median_ours"] / row["single_median_floor"]
            row["p99_ratio"] = row["single_p99_ours"] / row["single_p99_floor"]
            row["batched_ratio"] = row["batched_rate_floor"] / row["batched_rate_ours"]
            reps.append(row)
            log(
                f"{name} rep {rep + 1}/{args.repeats}: single "
                f"{row['single_median_ours'] * 1e3:.3f} ms vs "
                f"{row['single_median_floor'] * 1e3:.3f} ms, batched "
                f"{row['batched_rate_ours']:.0f}/s vs "
                f"{row['batched_rate_floor']:.0f}/s"
            )
    summary = {key: common.spread([r[key] for r in reps]) for key in reps[0]}
    return {"backend": name, "floor": floor_name, "repeats": reps, "summary": summary}


def report(results: Sequence[dict[str, Any]], args: argparse.Namespace) -> str:
    rows_single = []
    rows_batch = []
    for r in results:
        s = r["summary"]
        rows_single.append(
            [
                r["backend"],
                r["floor"],
                common.fmt(s["single_median_ours"], 3, 1e3),
                common.fmt(s["single_median_floor"], 3, 1e3),
                common.fmt(s["single_ratio"], 2),
                common.fmt(s["single_p99_ours"], 3, 1e3),
                common.fmt(s["single_p99_floor"], 3, 1e3),
                common.fmt(s["p99_ratio"], 2),
            ]
        )
        rows_batch.append(
            [
                r["backend"],
                common.fmt(s["batched_rate_ours"], 0),
                common.fmt(s["batched_rate_floor"], 0),
                common.fmt(s["batched_ratio"], 2),
            ]
        )
    return "\n\n".join(
        [
            f"Single claims ({args.single} per repeat, {args.repeats} repeats; ms, "
            "median over repeats (min-max); ratio = ours / floor):",
            common.table(
                [
                    "backend",
                    "floor",
                    "claim median",
                    "floor median",
                    "ratio",
                    "claim p99",
                    "floor p99",
                    "p99 ratio",
                ],
                rows_single,
            ),
            f"Batched claims ({args.batches} batches of {args.batch} per repeat; "
            "claims/s; ratio = floor rate / our rate):",
            common.table(["backend", "claims/s", "floor ops/s", "ratio"], rows_batch),
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.claims", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--backends", default=",".join(ALL))
    parser.add_argument("--single", type=int, default=300, help="single claims per repeat")
    parser.add_argument("--batch", type=int, default=500, help="slots per batch")
    parser.add_argument("--batches", type=int, default=4, help="batches per repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write raw results to this file")
    args = parser.parse_args(argv)
    common.exit_on_sigterm()
    names = [n.strip() for n in args.backends.split(",") if n.strip()]
    print(common.header("Claim round trip"))
    results: list[dict[str, Any]] = []
    failed: list[tuple[str, str]] = []
    for name in names:
        if name not in ALL:
            parser.error(f"unknown backend {name!r}; choose from {', '.join(ALL)}")
        if not common.service_up(common.BACKEND_SERVICE[name]):
            log(f"{name}: service not running on 127.0.0.1, skipped")
            continue
        log(f"{name}: measuring")
        try:
            results.append(measure(name, args))
        except Exception as exc:  # one broken service must not hide the others
            log(f"{name}: failed: {type(exc).__name__}: {exc}")
            failed.append((name, f"{type(exc).__name__}: {exc}"))
    print(report(results, args))
    for name, error in failed:
        print(f"\n{name}: not measured ({error[:300]})")
    common.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
