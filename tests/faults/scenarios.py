"""The campaign's scenarios (issue 7), each a function of a :class:`Ctx`
that starts a :class:`~tests.faults.harness.FaultRun`, injects its faults on
a timeline scaled to ``ctx.duration`` seconds, and returns what happened.

Every scenario starts three beats and a worker unless it says otherwise,
counts slots due between the beats' first tick (plus a moment) and the stop
(minus the jitter and a send), and declares whether misses are expected
(``misses_allowed``: the backend could not claim for a while) -- they must
then be on the record.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from celery_anarchon.beat.link import BACKOFF_MAX
from celery_anarchon.beat.registry import HEARTBEAT_INTERVAL

from ..beat.support import SEND_DELAY
from ..beats import BROKER, instance_prefix
from .harness import (
    LEASE_BACKENDS,
    RABBIT_VHOST,
    FaultRun,
    Outcome,
    faketime_env,
)
from .servers import PostgresServer, Proxy, RabbitServer, RedisServer

#: Service ports on this machine, by backend.
SERVICE_PORTS = {"postgresql": 5432, "mysql": 3306, "redis": 6379, "rabbitmq": 5672}


@dataclass
class Ctx:
    """What a scenario gets: the backend, a scratch folder, how long to run
    (seconds), a seeded random source, and a place for notes."""

    backend: str
    folder: Path
    duration: float
    rng: random.Random
    notes: list[str] = field(default_factory=list)

    def run(self, **kwargs: Any) -> FaultRun:
        return FaultRun(self.backend, self.folder, **kwargs)

    def note(self, text: str) -> None:
        self.notes.append(text)


@dataclass(frozen=True)
class Scenario:
    """A named scenario, the backends it applies to, and whether slots may
    be missed (each on the record) while it runs."""

    name: str
    run: Callable[[Ctx], Outcome]
    backends: tuple[str, ...]
    misses_allowed: bool | tuple[str, ...]
    about: str

    def allows_misses(self, backend: str) -> bool:
        """True when misses (on the record) are the documented price here."""
        if isinstance(self.misses_allowed, tuple):
            return backend in self.misses_allowed
        return self.misses_allowed


SCENARIOS: dict[str, Scenario] = {}

ALL = ("sqlite", "postgresql", "mysql", "redis", "rabbitmq")
#: Where a claimer killed or frozen between claim and send loses the slot
#: (no lease, no backup runner): the documented price of claim-only.
CLAIM_ONLY = ("rabbitmq",)
NETWORKED = ("postgresql", "mysql", "redis", "rabbitmq")


def scenario(
    name: str, *, backends: tuple[str, ...] = ALL, misses_allowed: bool | tuple[str, ...] = False
) -> Callable[[Callable[[Ctx], Outcome]], Callable[[Ctx], Outcome]]:
    def register(fn: Callable[[Ctx], Outcome]) -> Callable[[Ctx], Outcome]:
        about = (fn.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
        SCENARIOS[name] = Scenario(name, fn, backends, misses_allowed, about)
        return fn

    return register


def pause(seconds: float) -> None:
    time.sleep(max(0.0, seconds))


def finish(run: FaultRun, ctx: Ctx, until: float) -> Outcome:
    """Keep running until ``until`` seconds after the start, stop, read back."""
    pause(run.started_at + until - time.time())
    run.stop()
    outcome = run.outcome()
    outcome.notes.extend(ctx.notes)
    return outcome


# -- processes ------------------------------------------------------------------


def restart_ticking(run: FaultRun, victim: subprocess.Popen[bytes]) -> None:
    """Restart a killed beat and wait (at most 30 s) for its first tick, so
    the next kill never lands on a beat still importing Celery: under load a
    start takes longer than a round of the loop, and the loop then killed
    fresh beats until none was left running (no claim, no record: 10
    "misses" of the harness's making on SQLite)."""
    again = run.cluster.restart(victim)
    run.cluster.wait_ticking([again], timeout=30)


@scenario("baseline")
def baseline(ctx: Ctx) -> Outcome:
    """No fault: three beats and a worker, the reference row."""
    with ctx.run() as run:
        run.start(3)
        return finish(run, ctx, ctx.duration)


@scenario("kill-9 loop", misses_allowed=CLAIM_ONLY)
def kill9_loop(ctx: Ctx) -> Outcome:
    """Every 4 s a random beat is killed with SIGKILL and restarted 1.5 s later
    (the next kill waits for it to tick)."""
    with ctx.run() as run:
        run.start(3)
        deadline = run.started_at + ctx.duration - 6
        kills = 0
        while time.time() < deadline and kills < 100:
            pause(2.5)
            victim = ctx.rng.choice(run.cluster.running())
            run.kill9(victim)
            kills += 1
            pause(1.5)
            restart_ticking(run, victim)
        ctx.note(f"{kills} kills")
        return finish(run, ctx, ctx.duration)


@scenario("kill-9 in send", misses_allowed=CLAIM_ONLY)
def kill9_in_send(ctx: Ctx) -> Outcome:
    """As the kill-9 loop, with a 0.5 s pause between each won claim and its
    send (``tests.beat.support.SEND_DELAY``) so kills land between claim and send."""
    with ctx.run(conf={SEND_DELAY: 0.5}) as run:
        run.start(3)
        deadline = run.started_at + ctx.duration - 8
        kills = 0
        while time.time() < deadline and kills < 100:
            pause(2.5)
            victim = ctx.rng.choice(run.cluster.running())
            run.kill9(victim)
            kills += 1
            pause(1.5)
            restart_ticking(run, victim)
        ctx.note(f"{kills} kills")
        return finish(run, ctx, ctx.duration)


@scenario("SIGSTOP > lease", misses_allowed=CLAIM_ONLY)
def sigstop(ctx: Ctx) -> Outcome:
    """A random beat is frozen (SIGSTOP) for three leases (9 s), then thawed;
    twice when the run is long enough."""
    with ctx.run() as run:
        run.start(3)
        deadline = run.started_at + ctx.duration - 13
        freezes = 0
        while time.time() < deadline and freezes < 20:
            pause(3)
            victim = ctx.rng.choice(run.cluster.running())
            run.signal(victim, signal.SIGSTOP)
            pause(9)
            run.signal(victim, signal.SIGCONT)
            freezes += 1
        ctx.note(f"{freezes} freezes of 9 s")
        return finish(run, ctx, ctx.duration)


@scenario("rolling restart")
def rolling_restart(ctx: Ctx) -> Outcome:
    """Each beat in turn gets SIGTERM and is restarted once it exited."""
    with ctx.run() as run:
        run.start(3)
        rounds = 0
        deadline = run.started_at + ctx.duration - 6
        while time.time() < deadline and rounds < 100:
            for proc in list(run.cluster.running()):
                if time.time() >= deadline:
                    break
                pause(1.5)
                run.cluster.stop([proc], timeout=15)
                again = run.cluster.restart(proc)
                run.cluster.wait_ticking([again], timeout=20)
                rounds += 1
        ctx.note(f"{rounds} restarts")
        return finish(run, ctx, ctx.duration)


@scenario("scale 1-5-1")
def scale(ctx: Ctx) -> Outcome:
    """One beat, then four more one by one, then back to one (SIGTERM)."""
    with ctx.run() as run:
        run.start(1)
        step = max(1.0, (ctx.duration - 8) / 10)
        for _ in range(4):
            pause(step)
            run.cluster.start(1)
        pause(step * 2)
        for proc in run.cluster.running()[1:]:
            pause(step)
            run.cluster.stop([proc], timeout=15)
        return finish(run, ctx, ctx.duration)


# -- the backend ------------------------------------------------------------------


@scenario("backend cut", backends=NETWORKED, misses_allowed=True)
def backend_cut(ctx: Ctx) -> Outcome:
    """Every beat reaches the backend through a proxy, which drops every
    connection and refuses new ones for 6 s."""
    with (
        Proxy(SERVICE_PORTS[ctx.backend]) as proxy,
        ctx.run(beat_backend_port=proxy.port) as run,
    ):
        run.start(3)
        pause(run.started_at + 4 - time.time())
        proxy.cut()
        pause(6)
        proxy.restore()
        return finish(run, ctx, ctx.duration)


@scenario("backend restart", backends=("postgresql", "redis", "rabbitmq"), misses_allowed=True)
def backend_restart(ctx: Ctx) -> Outcome:
    """A server of the harness's own (Redis with an fsync'd append-only file;
    PostgreSQL as the postgres user; a RabbitMQ node with its own name,
    ports, data and cookie) is crashed and started again 3 s later."""
    server: RedisServer | PostgresServer | RabbitServer
    if ctx.backend == "redis":
        server = RedisServer(ctx.folder)
    elif ctx.backend == "rabbitmq":
        if not RabbitServer.available():
            raise Unavailable("RabbitMQ's start scripts (rabbitmq_server-*/sbin) are not installed")
        server = RabbitServer(RABBIT_VHOST)
    else:
        if not PostgresServer.available():
            raise Unavailable("PostgreSQL binaries (initdb, pg_ctl) are not installed")
        server = PostgresServer(ctx.folder)
    with server, ctx.run(backend_port=server.port) as run:
        run.start(3)
        pause(run.started_at + 4 - time.time())
        server.crash()
        pause(3)
        server.start()
        # A server that takes long to boot (a RabbitMQ node: 5 to 20 s here)
        # leaves the beats in their reconnect backoff past the planned end:
        # they must be back, and have had a moment to claim or record the
        # slots of the outage, before the run stops (else the row would judge
        # beats that never saw the backend again).
        back = wait_back(run, timeout=BACKOFF_MAX + 10)
        ctx.note(f"beats back {time.time() - run.started_at:.0f} s after the start")
        if not back:
            ctx.note("a beat did not report the backend back")
        return finish(run, ctx, max(ctx.duration, time.time() - run.started_at + 6))


#: What a beat logs when its backend is away, and when it answers again.
OUTAGE_LOG = b"is unavailable ("
BACK_LOG = b"claim backend is back after"


def wait_back(run: FaultRun, timeout: float) -> bool:
    """Wait (at most ``timeout`` seconds) until every running beat that
    logged its backend unavailable has logged it back as often; True then."""

    def all_back() -> bool:
        for proc in run.cluster.running():
            path = run.cluster.log_path(proc)
            text = path.read_bytes() if path.exists() else b""
            if text.count(BACK_LOG) < text.count(OUTAGE_LOG):
                return False
        return True

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all_back():
            return True
        time.sleep(0.2)
    return all_back()


def _slow(ctx: Ctx, latency: float) -> Outcome:
    with (
        Proxy(SERVICE_PORTS[ctx.backend]) as proxy,
        ctx.run(beat_backend_port=proxy.port) as run,
    ):
        run.start(3)
        pause(run.started_at + 3 - time.time())
        proxy.latency = latency
        pause(ctx.duration - 9)
        proxy.latency = 0.0
        return finish(run, ctx, ctx.duration)


@scenario("latency 100 ms", backends=NETWORKED)
def latency_100ms(ctx: Ctx) -> Outcome:
    """Every reply from the backend is delayed 100 ms (proxy) for most of the run."""
    return _slow(ctx, 0.1)


@scenario("latency 1 s", backends=NETWORKED, misses_allowed=True)
def latency_1s(ctx: Ctx) -> Outcome:
    """Every reply from the backend is delayed 1 s (proxy) for most of the run."""
    return _slow(ctx, 1.0)


@scenario("stall", backends=NETWORKED, misses_allowed=True)
def stall(ctx: Ctx) -> Outcome:
    """The backend stops answering mid-reply for 8 s (connections stay
    open, replies are held, then delivered)."""
    with (
        Proxy(SERVICE_PORTS[ctx.backend]) as proxy,
        ctx.run(beat_backend_port=proxy.port) as run,
    ):
        run.start(3)
        pause(run.started_at + 4 - time.time())
        proxy.stall()
        pause(8)
        proxy.unstall()
        return finish(run, ctx, ctx.duration)


#: How soon after a backend hangs each beat must log it unavailable,
#: seconds: the client-side bound of a call (``statement_timeout`` + 1 s on
#: PostgreSQL and MySQL, ``socket_timeout`` on Redis: 6 s and 5 s by
#: default) plus a tick and a claim's wait for its slot.
HUNG_LOG_LIMIT_S = 10.0
LEASE_NETWORKED = ("postgresql", "mysql", "redis")


def outage_counts(run: FaultRun) -> dict[int, int]:
    """How often each running beat (by pid) has logged its backend unavailable."""
    counts = {}
    for proc in run.cluster.running():
        path = run.cluster.log_path(proc)
        counts[proc.pid] = (path.read_bytes() if path.exists() else b"").count(OUTAGE_LOG)
    return counts


@scenario("hung backend", backends=LEASE_NETWORKED, misses_allowed=True)
def hung_backend(ctx: Ctx) -> Outcome:
    """The backend accepts connections and answers nothing (the proxy's
    blackhole: data acknowledged and dropped) for 12 s: every beat must log
    it unavailable within 10 s, and back after it answers again."""
    with (
        Proxy(SERVICE_PORTS[ctx.backend]) as proxy,
        ctx.run(beat_backend_port=proxy.port) as run,
    ):
        run.start(3)
        pause(run.started_at + 4 - time.time())
        before = outage_counts(run)
        proxy.blackhole()
        hung_at = time.time()
        logged: dict[int, float] = {}
        while time.time() < hung_at + 12:
            for pid, count in outage_counts(run).items():
                if count > before.get(pid, 0) and pid not in logged:
                    logged[pid] = time.time() - hung_at
            time.sleep(0.2)
        proxy.restore()
        back = wait_back(run, timeout=BACKOFF_MAX + 10)
        slowest = max(logged.values()) if len(logged) == len(before) else None
        ctx.note(
            f"{len(logged)} of {len(before)} beats logged the hang, the last after "
            f"{slowest if slowest is None else round(slowest, 1)} s; back: {back}"
        )
        outcome = finish(run, ctx, max(ctx.duration, time.time() - run.started_at + 6))
    outcome.extra["hung_logged_s"] = None if slowest is None else round(slowest, 1)
    outcome.extra["hung_back"] = back
    return outcome


@scenario("delayed request", backends=LEASE_NETWORKED, misses_allowed=True)
def delayed_request(ctx: Ctx) -> Outcome:
    """For 6 s every request reaches the backend 7 s late (the proxy's
    request_delay; replies are not delayed): past each claim's deadline
    and its client's timeout. A late claim must claim nothing; its slot is
    claimed again and sent once."""
    with (
        Proxy(SERVICE_PORTS[ctx.backend]) as proxy,
        ctx.run(beat_backend_port=proxy.port) as run,
    ):
        run.start(3)
        pause(run.started_at + 4 - time.time())
        proxy.request_delay = 7.0
        pause(6)
        proxy.request_delay = 0.0
        back = wait_back(run, timeout=BACKOFF_MAX + 10)
        ctx.note(f"beats back: {back}")
        return finish(run, ctx, max(ctx.duration, time.time() - run.started_at + 10))


# -- the broker and the clock -------------------------------------------------------


@scenario("broker outage", misses_allowed=("rabbitmq",))
def broker_outage(ctx: Ctx) -> Outcome:
    """One beat reaches Celery's broker through a proxy that is cut for 6 s
    while claims still work: what it claimed meanwhile must be sent by
    another beat (lease backends: no miss) or recorded (RabbitMQ: lost)."""
    port = int(BROKER.split(":")[-1].split("/")[0])
    with Proxy(port) as proxy, ctx.run() as run:
        run.start(2)
        cut_off = run.cluster.start(
            1, env={"ITEST_BROKER": BROKER.replace(str(port), str(proxy.port))}
        )
        run.cluster.wait_ticking(cut_off, timeout=20)
        pause(run.started_at + 4 - time.time())
        proxy.cut()
        pause(6)
        proxy.restore()
        return finish(run, ctx, ctx.duration)


# Not on SQLite: it serves one host, whose processes share one clock, and it
# judges claims and trims history by the clock of the process at hand. A
# process shifted by libfaketime there trims the others' fresh records as
# old ones (a +5 min beat deletes a slot's record right after it was
# claimed), and the slot is claimed and run again: a duplicate the one-host
# premise rules out, not a fault of the campaign's kind.
def _skewed(ctx: Ctx, offset: float) -> Outcome:
    with ctx.run() as run:
        run.start(2)
        skewed = run.cluster.start(1, env=faketime_env(offset))[0]
        run.cluster.wait_ticking([skewed], timeout=20)
        pause(HEARTBEAT_INTERVAL + 1)  # its first heartbeats are in the registry
        shown = status_offset_s(run, skewed)
        pause(run.started_at + ctx.duration - time.time())
        alive = skewed.poll() is None
        outcome = finish(run, ctx, ctx.duration)
    outcome.extra["skewed_alive"] = alive
    early = max_early_s(outcome)
    outcome.notes.append(f"sent at most {early:.1f} s before the slot")
    outcome.extra["max_early_s"] = round(early, 1)
    if ctx.backend in LEASE_BACKENDS:
        outcome.notes.append(f"`celery anarchon status` shows the skewed beat at {shown} s")
        outcome.extra["status_offset_s"] = shown
        outcome.extra["skew_s"] = offset
    return outcome


def status_offset_s(run: FaultRun, proc: subprocess.Popen[bytes]) -> float | None:
    """The clock offset ``celery anarchon status --json`` reports for beat
    ``proc``, seconds (None when it lists no offset for it)."""
    env = run.cluster.env()
    try:
        out = subprocess.run(
            [sys.executable, "-m", "celery", "-A", run.cluster.app, "anarchon", "status", "--json"],
            env=env,
            cwd=run.folder,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        report = json.loads(out[out.index("{") :])
    except (ValueError, subprocess.TimeoutExpired):
        return None
    prefix = instance_prefix(proc)
    for info in report.get("instances", []):
        if str(info.get("instance", "")).startswith(prefix) and info.get("offset_ms") is not None:
            return round(info["offset_ms"] / 1000, 1)
    return None


def max_early_s(outcome: Outcome) -> float:
    """How long before its slot the earliest send happened, seconds, by the
    backend's clock (``sent_at_ms`` is written with it on PostgreSQL, MySQL
    and Redis; on SQLite with the clock of the process that sent)."""
    early = 0.0
    for records in outcome.history.values():
        for r in records:
            if r.sent_at_ms is not None:
                early = max(early, (r.slot_ms - r.sent_at_ms) / 1000)
    return early


@scenario("clock +5 s", backends=NETWORKED)
def skew_plus_5s(ctx: Ctx) -> Outcome:
    """One beat of three runs 5 s ahead (libfaketime)."""
    return _skewed(ctx, 5)


@scenario("clock -60 s", backends=NETWORKED)
def skew_minus_60s(ctx: Ctx) -> Outcome:
    """One beat of three runs 60 s behind (libfaketime)."""
    return _skewed(ctx, -60)


@scenario("clock +5 min", backends=NETWORKED)
def skew_plus_5min(ctx: Ctx) -> Outcome:
    """One beat of three runs 5 minutes ahead (libfaketime)."""
    return _skewed(ctx, 300)


class Unavailable(Exception):
    """The scenario cannot run here (a binary or service is missing)."""


#: The short (CI) profile: a representative subset that runs inside the
#: default test run (``bash .ci/run``, ``pytest -n 5``), on every backend,
#: in about 6 minutes of one xdist worker. Why these: the kill -9 loop (the
#: fault that matters most) on SQLite and RabbitMQ, and on MySQL its harder
#: form, "kill-9 in send" (kills land between claim and send, so backups
#: take over, and take over again from a backup killed in turn; the same
#: row time as the loop); the lease fault
#: tests of tests/beat/test_lease_faults.py cover kill -9 between claim and send,
#: SIGSTOP longer than the lease and the rolling restart on SQLite,
#: PostgreSQL and Redis in the same run. Every
#: other family of fault once, on the backend where it says the most: a
#: cut and a hung server on PostgreSQL (the SQL path through a proxy; the
#: hang is the case only the client-side bound ends), a real server restart,
#: a 1 s latency, a clock 5 s fast and a broker outage on Redis (the
#: recommended backend, the one whose server the harness can restart in a
#: second), a clock 60 s slow on RabbitMQ (no claim window there: only the
#: gate's lifetime protects). The RabbitMQ node the
#: harness restarts is checked by tests/faults/test_servers.py (a row of it
#: takes a minute: the node boots twice). The rest (every scenario
#: everywhere, longer runs) is ``--long``.
SHORT_DURATION = 16.0
SHORT_PROFILE: list[tuple[str, str]] = [
    ("kill-9 loop", "sqlite"),
    ("backend cut", "postgresql"),
    ("hung backend", "postgresql"),
    ("kill-9 in send", "mysql"),
    ("backend restart", "redis"),
    ("latency 1 s", "redis"),
    ("clock +5 s", "redis"),
    ("broker outage", "redis"),
    ("kill-9 loop", "rabbitmq"),
    ("clock -60 s", "rabbitmq"),
]

#: Issue 5's table: each lease fault (kill -9 between claim and send,
#: SIGSTOP longer than the lease, rolling restart) on each lease backend of
#: that issue (``--lease``). 30 s a row: two freezes of 9 s in the SIGSTOP row.
LEASE_DURATION = 30.0
LEASE_PROFILE: list[tuple[str, str]] = [
    (name, backend)
    for name in ("kill-9 in send", "SIGSTOP > lease", "rolling restart")
    for backend in ("sqlite", "postgresql", "redis")
]


def long_profile(backends: tuple[str, ...] = ALL) -> list[tuple[str, str]]:
    """Every scenario on every backend it applies to."""
    return [
        (name, backend)
        for name, sc in SCENARIOS.items()
        for backend in backends
        if backend in sc.backends
    ]


__all__ = [
    "LEASE_BACKENDS",
    "SCENARIOS",
    "LEASE_DURATION",
    "LEASE_PROFILE",
    "SHORT_DURATION",
    "SHORT_PROFILE",
    "Ctx",
    "Scenario",
    "Unavailable",
    "long_profile",
]
