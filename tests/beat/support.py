"""What the beat-side tests share: one clock moved by hand, one app
builder (:func:`make_app`, with :func:`sqlite_app` and :func:`jobs_app` as
presets over it), the readers of what was sent and recorded, and the seam
that slows sends down (fault injection, :func:`install_send_delay`)."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from celery import Celery
from kombu import Connection, Exchange, Queue

from celery_anarchon.backends import backend_from_url
from celery_anarchon.backends.base import Backend, ClaimRequest, InstanceInfo, RunRecord, State
from celery_anarchon.beat.agenda import Slot
from celery_anarchon.beat.publisher import Publisher
from celery_anarchon.beat.registry import weight
from celery_anarchon.beat.scheduler import Scheduler

from ..conftest import REDIS_URL, backend_options

BROKER_DB = 1  # Celery's broker on the shared Redis (db 0 holds claims)

LEASE_BACKENDS = ["sqlite", "postgresql", "redis"]


#: The ``ITEST_CONF`` key the test apps (tests.beat_app, tests.faults.app)
#: read for :func:`install_send_delay`: seconds slept before each send.
SEND_DELAY = "itest_send_delay"

#: The ``ITEST_CONF`` key the test apps read for
#: :func:`give_unserializable_args`: the jobs whose args JSON cannot encode.
UNSERIALIZABLE_ARGS = "itest_unserializable_args"


class Unserializable:
    """A custom object as a job's argument: Celery's JSON serializer
    refuses it (kombu's ``EncodeError``)."""

    def __repr__(self) -> str:
        return "Unserializable()"


def give_unserializable_args(conf: dict[str, Any]) -> None:
    """Give the ``beat_schedule`` entries of ``conf`` named under
    :data:`UNSERIALIZABLE_ARGS` (the key is taken out) one
    :class:`Unserializable` argument: the JSON a test passes to a real beat
    cannot hold one."""
    for name in conf.pop(UNSERIALIZABLE_ARGS, []):
        conf["beat_schedule"][name]["args"] = [Unserializable()]


class Clock:
    """A clock the test moves by hand (seconds since the epoch)."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def sqlite_app(tmp_path: Path, schedule: dict[str, Any], **conf: Any) -> Celery:
    """:func:`make_app` on a SQLite file in ``tmp_path`` (its default
    namespace), ``max_skew`` widened to 120 s (the test clock runs up to
    80 s ahead)."""
    url = f"sqlite:///{tmp_path / 'claims.db'}"
    return make_app(
        url, schedule, **{"anarchon_backend_options": {}, "anarchon_max_skew": 120, **conf}
    )


def jobs_app(url: str, jobs: int, period: float, **conf: Any) -> Celery:
    """:func:`make_app` with ``jobs`` jobs ``job-0000``... every ``period``
    seconds, on the backend's default namespace, ``max_skew`` 120 s (the
    test clock may run ahead of the real one) and ``max_late`` 5 s (below
    the period: only the next slot is due)."""
    schedule = {f"job-{i:04d}": {"task": "proj.job", "schedule": period} for i in range(jobs)}
    settings = {"anarchon_backend_options": {}, "anarchon_max_skew": 120, "anarchon_max_late": 5}
    return make_app(url, schedule, **{**settings, **conf})


def tick_for(s: Scheduler, check: Any, timeout: float) -> bool:
    """Tick ``s`` on the real clock until ``check()`` is true (``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s.tick()
        if check():
            return True
        time.sleep(0.1)
    return bool(check())


def install_send_delay(seconds: float) -> None:
    """Sleep ``seconds`` between winning each claim and sending it, in this
    process, from now on (0: no delay): widens the window in which a test
    kills, stops or shuts down the owner."""

    def sleep(slot: Slot) -> None:
        time.sleep(seconds)

    Publisher.before_send = sleep if seconds else None


@contextmanager
def delay_sends(seconds: float) -> Iterator[None]:
    """:func:`install_send_delay` for the ``with`` block only."""
    install_send_delay(seconds)
    try:
        yield
    finally:
        install_send_delay(0)


def sent_messages(app: Celery) -> list[dict[str, Any]]:
    """Take every message off the app's default queue; their headers."""
    out = []
    with Connection("memory://") as conn:
        queue = conn.SimpleQueue(app.conf.task_default_queue)
        while True:
            try:
                message = queue.get(timeout=0.05)
            except queue.Empty:
                break
            out.append(dict(message.headers))
            message.ack()
        queue.close()
    return out


def redis_app(broker: str, queue: str, schedule: dict[str, Any], **conf: Any) -> Celery:
    """An app as the fault campaign's: Redis claims under a unique prefix,
    Celery's broker at ``broker``, tasks routed by a named direct exchange
    to ``queue`` (the path on which a closed channel shows)."""
    exchange = Exchange(queue, type="direct")
    app = Celery(f"send-{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.update(
        broker_url=broker,
        task_queues=[Queue(queue, exchange, routing_key=queue)],
        task_default_queue=queue,
        task_routes={"sp.*": {"exchange": queue, "routing_key": queue}},
        anarchon_backend=REDIS_URL,
        anarchon_backend_options={"prefix": f"anarchon-send:{uuid.uuid4().hex[:8]}:"},
        anarchon_jitter=0,
        anarchon_max_late=5,
        anarchon_lease_ttl=2,
        beat_schedule=schedule,
        timezone="UTC",
        **conf,
    )
    return app


def queued_slots(queue: str) -> list[int]:
    """``anarchon_slot`` of every message on ``queue`` (taken off)."""
    found = []
    with Connection(f"redis://127.0.0.1:6379/{BROKER_DB}") as conn:
        simple = conn.SimpleQueue(queue, no_ack=True)
        try:
            while True:
                try:
                    message = simple.get(timeout=0.2)
                except simple.Empty:
                    break
                found.append(int(message.headers["anarchon_slot"]))
        finally:
            simple.close()
    return found


class CountingRefuser:
    """A TCP port that accepts each connection and closes it at once (a
    broker that is away), counting the connections."""

    def __init__(self) -> None:
        self.count = 0
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self._listener.settimeout(0.1)
        self.port: int = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                continue
            self.count += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._listener.close()


class SlowConnect(Scheduler):
    """A scheduler whose broker connect takes ``connect_s`` of its clock."""

    connect_s = 0.0

    def _ensure_connected(self) -> Any:
        self._clock.now += self.connect_s  # type: ignore[attr-defined]
        return super()._ensure_connected()


def record_finished(backend: Any, job: str, slot_ms: int, state: State = State.SENT) -> None:
    """A run of ``job`` at ``slot_ms`` that an earlier instance sent (and,
    with ``state`` SUCCEEDED, that a worker finished)."""
    from celery_anarchon.backends.base import ClaimRequest

    claim = backend.claim([ClaimRequest(job, slot_ms, 10**9, 10_000, slot_ms + 3_600_000)])[0]
    assert claim.won
    backend.mark(claim, State.SENT, task_id=f"old-{slot_ms}")
    if state is not State.SENT:
        backend.mark(claim, State.RUNNING)
        backend.mark(claim, state)


def open_backend(app: Celery, instance: str) -> Any:

    conf = app.conf
    backend = backend_from_url(
        conf.anarchon_backend, instance=instance, options=dict(conf.anarchon_backend_options)
    )
    backend.open()
    return backend


def hourly_at(slot_s: int, **options: Any) -> dict[str, Any]:
    """One hourly job ``h`` whose slot falls at ``slot_s`` (epoch seconds)."""
    return {"h": {"task": "t.h", "schedule": 3600.0, "anarchon": {"anchor": slot_s, **options}}}


def next_slot(period: float) -> float:
    """The first slot of an epoch-anchored ``period`` at least 1 s ahead."""
    return (int(time.time() + 1) // int(period) + 1) * period


def spy(obj: Any, name: str, calls: list[Any], arg: Callable[..., Any]) -> None:
    """Record ``arg(*args)`` of every call of ``obj.name``, then call it."""
    real = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls.append(arg(*args, **kwargs))
        return real(*args, **kwargs)

    setattr(obj, name, wrapper)


def tick_until(s: Scheduler, done: Callable[[], bool], rounds: int = 50) -> None:
    for _ in range(rounds):
        s.tick()
        if done():
            return


def make_app(url: str, schedule: dict[str, Any], **conf: Any) -> Celery:
    tag = uuid.uuid4().hex[:6]
    app = Celery(f"lease-{tag}", set_as_current=False)
    # A namespace of this app's own under the run's prefix (the run's clean-up
    # still finds it): claims and registry entries of an earlier test in the
    # same worker (same job names, a slot in the same second, an instance not
    # yet stale) must not reach this one.
    kind = url.split(":")[0].split("+")[0]  # sqlite, postgresql, mysql or redis
    prefix = backend_options(kind)["prefix"]
    settings: dict[str, Any] = {
        "broker_url": "memory://",
        "task_default_queue": f"q-{uuid.uuid4().hex[:8]}",
        "anarchon_backend": url,
        "anarchon_backend_options": {"prefix": f"{prefix}{tag}{prefix[-1]}"},
        "anarchon_jitter": 0,
        "beat_schedule": schedule,
        "timezone": "UTC",
    }
    app.conf.update({**settings, **conf})
    return app


def sent_slots(app: Celery) -> list[tuple[str, int]]:
    """``(job, slot)`` of every message on the app's queue, in queue order."""
    return [(h["anarchon_job"], h["anarchon_slot"]) for h in sent_messages(app)]


def record_sent(backend: Backend, job: str, slot_ms: int) -> None:
    """A run of ``job`` at ``slot_ms`` that an earlier instance sent."""
    claim = backend.claim([ClaimRequest(job, slot_ms, 10**9, 10_000, slot_ms + 3_600_000)])[0]
    assert claim.won
    backend.mark(claim, State.SENT, task_id=f"old-{slot_ms}")


def catch_up_app(url: str, policy: str, restart_s: int, **conf: Any) -> Celery:
    """The start-up scenario of docs/scheduling.md, shifted so that the restart (09:52:10) is now.

    ``ten`` fires every ten minutes with a slot at 09:50 (= restart - 130 s);
    ``one`` every minute with a slot at 09:52 (= restart - 10 s).
    """
    opts = {"catch_up": policy, "catch_up_limit": 5}
    schedule = {
        f"ten-{policy}": {
            "task": "t.ten",
            "schedule": 600.0,
            "anarchon": {**opts, "anchor": restart_s - 130},
        },
        f"one-{policy}": {
            "task": "t.one",
            "schedule": 60.0,
            "anarchon": {**opts, "anchor": restart_s - 10},
        },
    }
    return make_app(url, schedule, **conf)


def run_restart(url: str, policy: str) -> tuple[Celery, Scheduler, int]:
    restart = int(time.time())
    app = catch_up_app(url, policy, restart)
    before = open_backend(app, "before")
    record_sent(before, f"ten-{policy}", (restart - 1330) * 1000)  # 09:30
    record_sent(before, f"one-{policy}", (restart - 790) * 1000)  # 09:39
    before.close()
    s = Scheduler(app, clock=Clock(float(restart)))
    s.tick()
    return app, s, restart


def states(s: Scheduler, job: str) -> dict[int, State]:
    assert s.backend is not None
    return {r.slot_ms: r.state for r in s.backend.history(job)}


def at(restart: int, offset_s: int) -> int:
    return (restart + offset_s) * 1000


def app_with_slot(url: str, **conf: object) -> tuple[Celery, int, float]:
    """An app with one hourly job ``k`` (lease 1 s) whose slot is two
    seconds ahead; the slot (ms) and the time one second before it. Its
    own prefix: the registry peers of a test are not another's."""
    now = time.time()
    slot = int(now) + 2
    schedule = {
        "k": {"task": "t.k", "schedule": 3600.0, "anarchon": {"anchor": slot, "lease_ttl": 1}},
    }
    base = backend_options(url.split(":")[0])["prefix"]
    options = {"prefix": f"{base}to{uuid.uuid4().hex[:6]}_"}
    app = make_app(url, schedule, anarchon_backend_options=options, **conf)
    return app, slot * 1000, float(slot - 1)


def claim_and_die(backend: Backend, slot_ms: int) -> None:
    """Claim ``k`` at ``slot_ms`` with a 1 s lease, as a beat killed before its send."""
    request = ClaimRequest("k", slot_ms, 10**9, 10**9, slot_ms + 10**7, 1000)
    assert backend.claim([request])[0].won


def records(s: Scheduler, slot_ms: int) -> list[RunRecord]:
    """Every record of ``k`` at ``slot_ms``, newest first."""
    assert s.backend is not None
    return [r for r in s.backend.history("k") if r.slot_ms == slot_ms]


def peers_above(s: Scheduler, slot_ms: int, count: int) -> list[str]:
    """``count`` instance ids that rank before ``s`` in the slot's rendezvous order."""
    key = f"\x00k\x00{slot_ms}".encode()
    mine = weight(s.instance_id, key)
    found = [f"dead-{i}" for i in range(5000) if weight(f"dead-{i}", key) > mine][:count]
    assert len(found) == count
    return found


def register(backend: Backend, instance: str) -> None:
    """``instance`` in the registry with a fresh heartbeat (as a beat killed
    a moment ago: the registry lists it until its entry expires)."""
    info = InstanceInfo(instance, "host", 1, "0", int(time.time() * 1000))
    backend.register(info, 60_000)
