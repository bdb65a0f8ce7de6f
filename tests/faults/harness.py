"""The fault harness: real beats, a real worker, one backend, faults on a
timeline, and everything read back.

One :class:`FaultRun` is one scenario on one backend. It starts ``celery
beat`` processes (:class:`tests.beats.BeatCluster` on :mod:`tests.faults.app`)
and a prefork ``celery worker`` with the worker integration, lets the
scenario inject its faults, stops everything, and then reads back:

* every published message, from ``<queue>.audit``, a queue bound to the
  tasks' exchange with the same routing key and consumed by nobody
  (headers ``anarchon_job``, ``anarchon_slot``);
* every execution, from the file the task appends to (one JSON line each);
* the backend's history of every job (read directly, not through a proxy).

:meth:`FaultRun.outcome` turns that into the counts the campaign reports.
Every wait is bounded; every process, queue, table, key and vhost it made is
removed by :meth:`FaultRun.close`; all traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kombu import Connection, Exchange, Queue

from celery_anarchon.backends import backend_from_url
from celery_anarchon.backends.base import Backend, RunRecord, State

from ..beats import BROKER, BeatCluster, expected_slots, instance_prefix
from ..conftest import MYSQL_URL, POSTGRES_URL, REDIS_URL
from .app import SCHEDULES

#: The error of a slot recorded lost because its publish failed in doubt
#: (celery_anarchon.beat.publisher, ``Publisher._on_publish_in_doubt``).
IN_DOUBT = "may have reached the broker"

#: Backends the campaign knows, lease backends first.
BACKENDS = ("sqlite", "postgresql", "mysql", "redis", "rabbitmq")
LEASE_BACKENDS = ("sqlite", "postgresql", "mysql", "redis")

#: The RabbitMQ vhost of the campaign, unique per process (made and deleted
#: by the harness), so parallel runs never share one.
RABBIT_VHOST = f"anarchon-faults-{uuid.uuid4().hex[:6]}"

#: Settings every fault run uses unless the scenario says otherwise: a short
#: lease so backup runners act within a run of a few tens of seconds, a
#: short registry TTL (its minimum) so dead instances drop out quickly.
BASE_CONF: dict[str, Any] = {
    "anarchon_jitter": 1.0,
    "anarchon_max_late": 15.0,
    "anarchon_max_skew": 10.0,
    "anarchon_lease_ttl": 3.0,
    "anarchon_registry_ttl": 10.0,
}

#: Claim-only RabbitMQ refuses lease settings: the same without them.
RABBIT_CONF: dict[str, Any] = {
    k: v for k, v in BASE_CONF.items() if k not in {"anarchon_lease_ttl"}
}

#: States in which a slot was claimed by someone.
CLAIM_STATES = frozenset(
    {
        State.CLAIMED,
        State.SENT,
        State.RUNNING,
        State.SUCCEEDED,
        State.FAILED,
        State.LOST,
        State.SUPERSEDED,
    }
)
#: States that put a slot that never ran on the record.
MISS_STATES = frozenset({State.MISSED, State.LOST, State.SKIPPED})

#: libfaketime's preload library (Debian package ``faketime``).
FAKETIME_LIB = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_until(check: Any, timeout: float, interval: float = 0.1) -> bool:
    """Call ``check`` until it returns true or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(interval)
    return bool(check())


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def faketime_env(offset_s: float) -> dict[str, str]:
    """Environment that shifts a process's clocks by ``offset_s`` seconds
    (libfaketime). Monotonic clocks shift too: with
    ``FAKETIME_DONT_FAKE_MONOTONIC=1`` libfaketime 0.9.10 makes Python's
    ``time.sleep`` fail with EINVAL (an absolute ``clock_nanosleep``), and a
    constant shift changes no monotonic difference anyway."""
    return {
        "LD_PRELOAD": FAKETIME_LIB,
        "FAKETIME": f"{offset_s:+g}",
        "FAKETIME_NO_CACHE": "1",
    }


def rabbit_url(vhost: str = RABBIT_VHOST, port: int = 5672) -> str:
    return f"amqp://guest:guest@127.0.0.1:{port}/{vhost}"


@contextmanager
def rabbit_vhost(vhost: str = RABBIT_VHOST) -> Iterator[str]:
    """A RabbitMQ vhost of the harness's own, deleted afterwards."""
    ctl = shutil.which("rabbitmqctl") or "rabbitmqctl"
    subprocess.run([ctl, "add_vhost", vhost], capture_output=True, check=False, timeout=60)
    subprocess.run(
        [ctl, "set_permissions", "-p", vhost, "guest", ".*", ".*", ".*"],
        capture_output=True,
        check=True,
        timeout=60,
    )
    try:
        yield vhost
    finally:
        subprocess.run([ctl, "delete_vhost", vhost], capture_output=True, check=False, timeout=60)


def backend_url(name: str, folder: Path, run: str, *, port: int | None = None) -> str:
    """The URL of backend ``name`` with a run-unique prefix; ``port``
    replaces the service's port (a proxy, or a server of the harness)."""
    urls = {
        "sqlite": f"sqlite:///{folder / 'claims.db'}",
        "postgresql": f"{POSTGRES_URL}?prefix=f{run}_",
        "mysql": f"{MYSQL_URL}?prefix=f{run}_",
        "redis": f"{REDIS_URL}?prefix=anarchon-faults:{run}:",
        "rabbitmq": f"{rabbit_url()}?prefix=faults.{run}.",
    }
    url = urls[name]
    if port is not None:
        default = {"postgresql": 5432, "mysql": 3306, "redis": 6379, "rabbitmq": 5672}[name]
        url = url.replace(f"127.0.0.1:{default}", f"127.0.0.1:{port}", 1)
    return url


def base_conf(name: str) -> dict[str, Any]:
    return dict(RABBIT_CONF if name == "rabbitmq" else BASE_CONF)


# -- what happened --------------------------------------------------------------


@dataclass
class Outcome:
    """What one fault run did, read back after it stopped.

    Attributes:
        due: every slot due inside the counted window, ``(job, slot_ms)``.
        published: messages per slot (from the audit queue), all slots.
        executed: task executions per slot (from the execution log).
        history: every job's history records, newest first.
        window: the counted window, epoch seconds.
    """

    due: list[tuple[str, int]]
    published: Counter[tuple[str, int]]
    executed: Counter[tuple[str, int]]
    history: dict[str, list[RunRecord]]
    window: tuple[float, float]
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    claim_only: bool = False

    def records(self, job: str, slot_ms: int) -> list[RunRecord]:
        return [r for r in self.history.get(job, []) if r.slot_ms == slot_ms]

    def claimed(self) -> list[tuple[str, int]]:
        """Due slots that someone claimed (a record in a claim state)."""
        return [s for s in self.due if any(r.state in CLAIM_STATES for r in self.records(*s))]

    def duplicate_publishes(self) -> dict[tuple[str, int], int]:
        """Slots published more than once (any slot, not only due ones)."""
        return {s: n for s, n in self.published.items() if n > 1}

    def duplicate_executions(self) -> dict[tuple[str, int], int]:
        return {s: n for s, n in self.executed.items() if n > 1}

    def missed(self) -> list[tuple[str, int]]:
        """Due slots that never executed."""
        return [s for s in self.due if s not in self.executed]

    def unpublished(self) -> list[tuple[str, int]]:
        return [s for s in self.due if s not in self.published]

    def unrecorded_misses(self) -> list[tuple[str, int]]:
        """Missed slots whose history does not say why (no ``missed``,
        ``lost`` or ``skipped`` record). On a claim-only backend a
        ``claimed`` record that was never sent counts as saying why: its
        claimer died between claim and send, which nothing can record
        afterwards (docs/exactly-once.md, "What can still go wrong, per backend")."""
        said = MISS_STATES | ({State.CLAIMED} if self.claim_only else set())
        return [
            s
            for s in self.missed()
            if not any(r.state in said for r in self.records(*s))
            and s not in self.published  # a published slot's miss is the worker's
        ]

    def in_doubt_misses(self) -> list[tuple[str, int]]:
        """Missed slots recorded ``lost`` because their publish failed after
        the message may have reached Celery's broker (a connection reset
        mid-publish). docs/exactly-once.md: any doubt counts as lost and is never
        sent a second time, so no backup may take such a slot over; the miss
        is on the record with that reason, the documented price."""
        return [
            s
            for s in self.missed()
            if s not in self.published
            and any(r.state is State.LOST and IN_DOUBT in (r.error or "") for r in self.records(*s))
        ]

    def superseded_slots(self) -> set[tuple[str, int]]:
        """Slots a backup runner took over (the window where a second
        publish is allowed, docs/exactly-once.md)."""
        return {
            (r.job, r.slot_ms)
            for records in self.history.values()
            for r in records
            if r.state is State.SUPERSEDED
        }

    def unexplained_duplicate_publishes(self) -> dict[tuple[str, int], int]:
        """Duplicate publishes outside the documented window (no take-over
        of that slot on record)."""
        allowed = self.superseded_slots()
        return {s: n for s, n in self.duplicate_publishes().items() if s not in allowed}

    def counts(self) -> dict[str, Any]:
        """The campaign's row: due, claimed, published, executed,
        duplicates (publishes and executions apart), missed, misses on record."""
        missed = self.missed()
        unrecorded = self.unrecorded_misses()
        due = set(self.due)
        return {
            "due": len(self.due),
            "claimed": len(self.claimed()),
            "published": sum(1 for s in self.due if s in self.published),
            "executed": sum(1 for s in self.due if s in self.executed),
            "dup_published": sum(n - 1 for s, n in self.duplicate_publishes().items() if s in due),
            "dup_executed": sum(n - 1 for s, n in self.duplicate_executions().items() if s in due),
            "missed": len(missed),
            "missed_recorded": len(missed) - len(unrecorded),
            "missed_in_doubt": len(self.in_doubt_misses()),
            "unexplained_dup_published": sum(
                n - 1 for s, n in self.unexplained_duplicate_publishes().items() if s in due
            ),
        }


# -- one run ----------------------------------------------------------------------


class FaultRun:
    """One scenario on one backend: beats, a worker, and the read-back.

    Use as a context manager: entering declares the audit queue, leaving
    stops every process and removes every queue, table and key of the run.

    Args:
        backend: backend kind (one of :data:`BACKENDS`).
        folder: scratch folder (logs, the SQLite file, the execution log).
        conf: settings over :data:`BASE_CONF`.
        schedules: ``job -> schedule`` (default :data:`tests.faults.app.SCHEDULES`).
        backend_port: the port of a server of the harness's own, used by
            beats, worker and read-back.
        beat_backend_port: a port only the beats use (a proxy).
        broker: Celery broker URL of the beats (worker and read-back use
            :data:`tests.beats.BROKER`).
        url: a backend URL to use as given (bad-input cases).
    """

    def __init__(
        self,
        backend: str,
        folder: Path,
        *,
        conf: dict[str, Any] | None = None,
        schedules: dict[str, Any] | None = None,
        backend_port: int | None = None,
        beat_backend_port: int | None = None,
        broker: str = BROKER,
        url: str | None = None,
    ) -> None:
        self.name = backend
        self.folder = folder
        self.run_id = uuid.uuid4().hex[:8]
        self.url = url or backend_url(backend, folder, self.run_id, port=backend_port)
        self.beat_url = (
            backend_url(backend, folder, self.run_id, port=beat_backend_port)
            if beat_backend_port
            else self.url
        )
        self.schedules = dict(SCHEDULES if schedules is None else schedules)
        conf = {**base_conf(backend), **(conf or {})}
        if schedules is not None:
            conf["beat_schedule"] = {
                job: {"task": "faults.run", "schedule": s} for job, s in self.schedules.items()
            }
        self.exec_log = folder / "executions.jsonl"
        self.cluster = BeatCluster(
            self.beat_url,
            folder,
            conf=conf,
            broker=broker,
            queue=f"faults-{self.run_id}",
            app="tests.faults.app",
            extra_env={"ITEST_EXEC_LOG": str(self.exec_log)},
        )
        self.started_at = 0.0
        self.stopped_at = 0.0
        self._declared = False

    # -- lifecycle -------------------------------------------------------------

    def __enter__(self) -> FaultRun:
        self.folder.mkdir(parents=True, exist_ok=True)
        self._declare_queues()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _queues(self) -> list[Queue]:
        q = self.cluster.queue
        exchange = Exchange(q, type="direct")
        return [Queue(q, exchange, routing_key=q), Queue(f"{q}.audit", exchange, routing_key=q)]

    def _declare_queues(self) -> None:
        with Connection(BROKER, connect_timeout=5) as conn:
            channel = conn.default_channel
            for queue in self._queues():
                queue.bind(channel).declare()
        self._declared = True

    def close(self) -> None:
        """Stop every process, then drop the run's queues, tables and keys."""
        self.cluster.stop(timeout=10)
        self.cluster.stop_workers(timeout=10)
        if self._declared:
            drop_broker_keys(BROKER, self.cluster.queue)
        drop_backend_data(self.name, self.url, self.run_id)

    # -- processes -------------------------------------------------------------

    def start(self, beats: int = 3, *, worker: bool = True) -> list[subprocess.Popen[bytes]]:
        """Start the worker (first, so it is ready) and ``beats`` beats, and
        wait (at most 30 s) until the beats tick. Counting starts then."""
        if worker:
            self.cluster.start_worker()
        procs = self.cluster.start(beats)
        self.cluster.wait_ticking(procs, timeout=30)
        if not self.started_at:
            self.started_at = time.time()
        return procs

    def stop(self, drain_timeout: float = 20.0) -> None:
        """Stop the beats (SIGTERM), let the worker drain the queue, stop it."""
        self.stopped_at = time.time()
        self.cluster.stop(timeout=15)
        if self.cluster.workers:
            deadline = time.monotonic() + drain_timeout
            wait_until(lambda: self.queue_length() == 0, drain_timeout, 0.3)
            # A prefetched message is off the queue but not yet run: wait
            # until the execution log has stopped growing for a while.
            last, still_since = -1, time.monotonic()
            while time.monotonic() < deadline:
                size = self.exec_log.stat().st_size if self.exec_log.exists() else 0
                if size != last:
                    last, still_since = size, time.monotonic()
                elif time.monotonic() - still_since >= 1.5:
                    break
                time.sleep(0.2)
        self.cluster.stop_workers(timeout=15)

    def queue_length(self) -> int:
        """Messages waiting on the run's queue; -1 when the broker is away.
        (On a Redis broker an empty queue has no key, so a passive declare
        answers NOT_FOUND: that is 0.)"""
        try:
            with Connection(BROKER, connect_timeout=3) as conn:
                try:
                    _, count, _ = conn.default_channel.queue_declare(
                        queue=self.cluster.queue, passive=True
                    )
                except conn.channel_errors:
                    return 0
                return int(count)
        except Exception:
            return -1

    def signal(self, proc: subprocess.Popen[bytes], sig: int) -> None:
        if proc.poll() is None:
            os.kill(proc.pid, sig)

    def kill9(self, proc: subprocess.Popen[bytes]) -> None:
        self.signal(proc, signal.SIGKILL)
        proc.wait(10)

    # -- reading back ----------------------------------------------------------

    def open_backend(self) -> Backend:
        backend = backend_from_url(self.url, instance=f"faults-reader-{self.run_id}")
        backend.open()
        return backend

    def history(self, jobs: Iterable[str] | None = None) -> dict[str, list[RunRecord]]:
        backend = self.open_backend()
        try:
            return {job: backend.history(job) for job in (jobs or self.schedules)}
        finally:
            backend.close()

    def wait_for_held(
        self, proc: subprocess.Popen[bytes], job: str, *, since_ms: int, timeout: float
    ) -> RunRecord | None:
        """The first record of ``job`` in state ``claimed``, owned by beat
        ``proc``, of a slot at or after ``since_ms``; None after ``timeout``
        seconds. Polls one backend connection every 0.1 s."""
        prefix = instance_prefix(proc)
        backend = self.open_backend()
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                for r in backend.history(job, limit=20):
                    if (
                        r.state is State.CLAIMED
                        and r.slot_ms >= since_ms
                        and (r.instance or "").startswith(prefix)
                    ):
                        return r
                time.sleep(0.1)
        finally:
            backend.close()
        return None

    def published(self) -> list[dict[str, Any]]:
        """Headers of every message on the audit queue (drained)."""
        return drain(BROKER, f"{self.cluster.queue}.audit")

    def executions(self) -> list[tuple[str, int]]:
        if not self.exec_log.exists():
            return []
        found = []
        for line in self.exec_log.read_text().splitlines():
            job, slot, _pid, _at = json.loads(line)
            found.append((str(job), int(slot)))
        return found

    def outcome(self, settle_s: float = 3.0, tail_s: float | None = None) -> Outcome:
        """Read everything back. Slots count when due inside ``[start +
        settle_s, stop - tail_s]`` (the first beats need a moment to start;
        the last slots need the jitter and the send before the stop, and on
        a lease backend a backup's take-over: lease + jitter + 2 s, at least
        4 s, by default)."""
        if tail_s is None:
            conf = self.cluster.conf
            lease = float(conf.get("anarchon_lease_ttl") or 0.0)
            tail_s = max(4.0, lease + float(conf.get("anarchon_jitter") or 0.0) + 2.0)
        start, end = self.started_at + settle_s, self.stopped_at - tail_s
        expected = expected_slots(self.schedules, start, end)
        due = [(job, s) for job, slots in expected.items() for s in slots]
        published = Counter(
            (str(h["anarchon_job"]), int(h["anarchon_slot"])) for h in self.published()
        )
        return Outcome(
            due=due,
            published=published,
            executed=Counter(self.executions()),
            history=self.history(),
            window=(start, end),
            claim_only=self.name == "rabbitmq",
        )


def drain(
    broker: str, queue: str, timeout: float = 1.0, limit: int = 100_000
) -> list[dict[str, Any]]:
    """Take every message off ``queue`` (at most ``limit``); their headers."""
    found: list[dict[str, Any]] = []
    with Connection(broker, connect_timeout=5) as conn:
        simple = conn.SimpleQueue(queue, no_ack=True)
        try:
            while len(found) < limit:
                try:
                    message = simple.get(timeout=timeout)
                except simple.Empty:
                    break
                found.append(dict(message.headers))
        finally:
            simple.close()
    return found


def drop_broker_keys(broker: str, queue: str) -> None:
    """Remove the run's queues and every binding table kombu's Redis
    transport kept for them (``queue.delete()`` leaves the exchange's
    tables behind), on the Redis broker of the harness."""
    import redis

    names = [queue, f"{queue}.audit"]
    keys = names + [
        f"_kombu.{table}.{name}" for table in ("binding", "binding_permanent") for name in names
    ]
    try:
        client = redis.Redis.from_url(broker, socket_timeout=3)
        try:
            client.delete(*keys)
        finally:
            client.close()
    except Exception:  # the broker may be what a scenario broke
        pass


def drop_backend_data(name: str, url: str, run: str) -> None:
    """Remove the tables or keys of run ``run`` (best effort: a server a
    scenario started itself is gone already)."""
    try:
        if name in {"postgresql", "mysql"}:
            import sqlalchemy as sa

            engine = sa.create_engine(
                url.split("?")[0].replace("postgresql://", "postgresql+psycopg://", 1),
                connect_args={"connect_timeout": 2},
            )
            try:
                with engine.begin() as conn:
                    for table in sa.inspect(conn).get_table_names():
                        if table.startswith(f"f{run}_"):
                            conn.execute(sa.text(f"DROP TABLE {table}"))
            finally:
                engine.dispose()
        elif name == "redis":
            import redis

            client = redis.Redis.from_url(url.split("?")[0], socket_timeout=2)
            try:
                for key in client.scan_iter(match=f"{{anarchon-faults:{run}:*", count=1000):
                    client.delete(key)
            finally:
                client.close()
    except Exception:
        pass
