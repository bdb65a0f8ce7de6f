"""Lease faults with real ``celery beat`` processes on each lease backend
(issue 5): kill -9 between claim and send, SIGSTOP longer than the lease,
and a rolling restart, with publishes and executions counted apart.

Each scenario runs three beats for about 20 to 30 seconds against SQLite,
PostgreSQL and Redis (Celery's broker: Redis db 1). The window between a
won claim and its send is widened with ``tests.beat.support.SEND_DELAY`` on one
beat only (fault injection, tests only).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from celery_anarchon.backends.base import RunRecord, State
from celery_anarchon.beat.registry import HEARTBEAT_INTERVAL
from celery_anarchon.beat.scheduler import Scheduler

from ..beats import instance_prefix
from ..conftest import POSTGRES_URL, REDIS_URL, require_service
from ..faults.harness import FaultRun, wait_until
from .support import SEND_DELAY, Clock, make_app, sent_slots

pytestmark = [pytest.mark.integration, pytest.mark.services]

LEASE_BACKENDS = ["sqlite", "postgresql", "redis"]

#: Short lease and generous max_late, so a take-over happens inside the test.
LEASE_S = 3.0
JITTER_S = 1.0
CONF = {
    "anarchon_lease_ttl": LEASE_S,
    "anarchon_max_late": 30.0,
    "anarchon_jitter": JITTER_S,
    "anarchon_registry_ttl": 10.0,
}
ONE_SECOND = {"every-second": 1.0}
#: A beat's tick runs at least once a second (beat_max_loop_interval = 1).
TICK_S = 1.0
#: Time a loaded 2-core CI machine may add on top (the backup's own claim
#: attempt lands up to a tick after the winner's, then one round trip and the
#: publish). CI once measured 5.024 s against a bare 5.0 s bound. Still far
#: below max_late (30 s), after which the slot would be missed instead.
SLACK_S = 3.0


@pytest.fixture(params=LEASE_BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    require_service("redis")  # Celery's broker
    require_service(name)
    return name


def start_with_victim(run: FaultRun, delay_s: float) -> tuple[object, int]:
    """Start two plain beats, then, once they have sent the slots of the
    last ``max_late`` (a beat's first slots at start-up), a third beat with
    a send delay of ``delay_s`` (``tests.beat.support.SEND_DELAY``). Returns the victim and the
    first slot (epoch ms) it may be caught holding: one registry heartbeat
    period after it ticks, when every beat knows every other (the steady
    state; see test_take_over_when_the_first_backup_won_and_died for what
    happens before)."""
    run.start(2, worker=False)
    time.sleep(3.0)
    victim = run.cluster.start(1, conf={SEND_DELAY: delay_s})[0]
    # Set-up, not the check: the victim's first tick sleeps delay_s for each
    # won slot and, on a loaded CI machine, has run past 30 s (2 of 3 clean
    # runs after the batched send path; not yet explained, see issue 14).
    assert run.cluster.wait_ticking([victim], timeout=90), run.cluster.logs()
    return victim, int(time.time() + HEARTBEAT_INTERVAL + 1) * 1000


def held_claim(run: FaultRun, victim: object, job: str, since_ms: int) -> RunRecord:
    held = run.wait_for_held(victim, job, since_ms=since_ms, timeout=20)  # type: ignore[arg-type]
    assert held is not None, run.cluster.logs()
    return held


def still_held(run: FaultRun, held: RunRecord) -> bool:
    """True while ``held`` is its slot's current record, still ``claimed``."""
    records = [r for r in run.history([held.job])[held.job] if r.slot_ms == held.slot_ms]
    return bool(records) and records[0].state is State.CLAIMED and records[0].token == held.token


def test_kill9_between_claim_and_send(backend: str, tmp_path: Path) -> None:
    """The owner dies holding a slot: another beat sends it once, within
    the lease (plus the backup's jitter and one tick). The victim sleeps
    5 s between each won claim and its send (longer than the lease: a slot
    it wins earlier is either taken over or still its own when it wakes),
    and is killed in such a sleep once every beat knows every other."""
    job = "every-second"
    with FaultRun(backend, tmp_path, conf=CONF, schedules=ONE_SECOND) as run:
        victim, since_ms = start_with_victim(run, 5.0)
        held = held_claim(run, victim, job, since_ms)
        run.kill9(victim)
        slot = (job, held.slot_ms)

        def sent_by_backup() -> bool:
            return any(
                r.state is State.SENT for r in run.history([job])[job] if r.slot_ms == held.slot_ms
            )

        wait_until(sent_by_backup, LEASE_S + JITTER_S + 10, 0.2)
        time.sleep(2.0)
        run.stop()
        outcome = run.outcome()
    logs = run.cluster.logs()
    assert outcome.published[slot] == 1, logs
    records = outcome.records(*slot)
    by_state = {r.state: r for r in records}
    assert set(by_state) == {State.SUPERSEDED, State.SENT}, (records, logs)
    old, new = by_state[State.SUPERSEDED], by_state[State.SENT]
    assert (old.instance or "").startswith(instance_prefix(victim))
    assert not (new.instance or "").startswith(instance_prefix(victim))
    assert new.token == 2
    assert held.claimed_at_ms is not None and new.sent_at_ms is not None
    taken_after_s = (new.sent_at_ms - held.claimed_at_ms) / 1000
    assert taken_after_s <= LEASE_S + JITTER_S + TICK_S + SLACK_S, (taken_after_s, logs)
    assert outcome.duplicate_publishes() == {}, logs
    assert outcome.unpublished() == [], logs


def test_sigstop_longer_than_the_lease(backend: str, tmp_path: Path) -> None:
    """A beat frozen holding a slot for longer than the lease, then thawed:
    the slot runs once; publishes and executions are counted apart, and a
    second publish may only be of a slot a backup took over."""
    job = "every-second"
    freeze_s = 3 * LEASE_S
    with FaultRun(backend, tmp_path, conf=CONF, schedules=ONE_SECOND) as run:
        run.cluster.start_worker()
        victim, since_ms = start_with_victim(run, 3.0)
        for _ in range(3):  # bounded: the claim may be sent before the freeze lands
            held = held_claim(run, victim, job, since_ms)
            run.signal(victim, signal.SIGSTOP)
            if still_held(run, held):
                break
            run.signal(victim, signal.SIGCONT)
            since_ms = held.slot_ms + 1
        else:
            pytest.fail("never froze the victim while it held a claim")
        time.sleep(freeze_s)
        run.signal(victim, signal.SIGCONT)
        time.sleep(6.0)
        run.stop()
        outcome = run.outcome()
    logs = run.cluster.logs()
    slot = (job, held.slot_ms)
    print(
        f"{backend}: frozen slot published {outcome.published[slot]}x, "
        f"executed {outcome.executed[slot]}x; {outcome.counts()}"
    )
    assert outcome.executed[slot] == 1, logs
    assert outcome.duplicate_executions() == {}, logs
    assert outcome.unexplained_duplicate_publishes() == {}, logs
    assert State.SUPERSEDED in {r.state for r in outcome.records(*slot)}, logs
    assert outcome.missed() == [], logs


def test_rolling_restart_of_three_beats(backend: str, tmp_path: Path) -> None:
    """SIGTERM each beat in turn, restart it, next: zero duplicates and
    zero misses, published and executed."""
    with FaultRun(backend, tmp_path, conf=CONF) as run:
        run.start(3)
        time.sleep(3.0)
        for proc in list(run.cluster.procs[:3]):
            run.cluster.stop([proc], timeout=15)
            assert proc.returncode == 0, run.cluster.logs()
            again = run.cluster.restart(proc)
            assert run.cluster.wait_ticking([again]), run.cluster.logs()
            time.sleep(2.0)
        time.sleep(2.0)
        run.stop()
        for proc in run.cluster.procs:
            assert proc.returncode == 0, run.cluster.logs()
        outcome = run.outcome()
    logs = run.cluster.logs()
    counts = outcome.counts()
    print(f"{backend}: {counts}")
    start, end = outcome.window
    assert counts["due"] >= 1.4 * (end - start) - 2  # the window really held slots
    assert outcome.duplicate_publishes() == {}, logs
    assert outcome.duplicate_executions() == {}, logs
    assert outcome.unpublished() == [], logs
    assert outcome.missed() == [], logs


# -- found by these tests ------------------------------------------------------
# Only the loser ranked 1 in its own rendezvous view used to plan a take-over,
# so a slot won by that instance (the preferred owner was late), or lost while
# views disagreed (an instance joined or left less than a heartbeat ago), was
# taken over by nobody when its owner died: 'claimed' forever, never sent,
# never recorded missed. Fixed in the scheduler (37850f0).


def test_take_over_when_the_first_backup_won_and_died(backend: str, tmp_path: Path) -> None:
    """Three schedulers that know each other; the slot's first backup (rank
    1) wins it because the preferred owner was late, then dies before
    sending. The two others lost the slot and must take it over once the
    dead owner's lease ends. Deterministic: one process, a hand-moved clock
    (the backend's own clock judges the lease)."""
    url = {
        "sqlite": f"sqlite:///{tmp_path / 'claims.db'}",
        "postgresql": f"{POSTGRES_URL}",
        "redis": REDIS_URL,
    }[backend]
    now = int(time.time())
    slot = now + 2
    schedule = {"j": {"task": "t.j", "schedule": 3600.0, "anarchon": {"anchor": slot}}}
    app = make_app(url, schedule, anarchon_jitter=1, anarchon_max_late=30, anarchon_lease_ttl=1)
    clock = Clock(float(now))
    schedulers = [Scheduler(app, clock=clock) for _ in range(3)]
    try:
        for s in schedulers:
            s.tick()  # registers
        for s in schedulers:
            s.registry.next_heartbeat = 0
            s.tick()  # reads every peer
            s.agenda.plan_first_slots()
        assert all(len(s.registry.peers) == 3 for s in schedulers)
        first, second, third = sorted(schedulers, key=lambda s: s.registry.rank("j", slot * 1000))
        request = second.jobs["j"].claim_request(slot * 1000, 10)
        assert second.backend is not None
        assert second.backend.claim([request])[0].won  # then it dies, unsent
        clock.now = slot + 1.5  # the preferred owner and the last backup lose
        first.tick()
        third.tick()
        assert sent_slots(app) == []
        time.sleep(1.3)  # the dead owner's lease (1 s, backend clock) ends
        clock.now = slot + 4.0
        first.tick()
        third.tick()
        assert sent_slots(app) == [("j", slot * 1000)]
    finally:
        for s in schedulers:
            s.close()
