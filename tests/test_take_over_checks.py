"""Backup take-over checks when several instances die (issues 5 and 7): in
one process, schedulers sharing a real lease backend, dead peers played by
backend clients that claim or take a slot over and never send it. The
scheduler's clock moves by hand; leases end by the backend's clock (short
real sleeps).

Each test is one cause of the "kill-9 in send / redis" fault row
(docs/reliability.md, lease faults): a slot left ``claimed`` by a killed
beat that nobody took over and nobody recorded."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
from celery import Celery

from celery_anarchon.backends.base import Backend, ClaimRequest, InstanceInfo, RunRecord, State
from celery_anarchon.scheduler import HEARTBEAT_INTERVAL, Scheduler, _weight

from .conftest import backend_options, backend_url, require_service
from .test_lease_features import Clock, make_app, open_backend, sent_slots

pytestmark = pytest.mark.services


@pytest.fixture(params=["sqlite", "postgresql", "redis"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    name: str = request.param
    require_service(name)
    if name == "redis":
        request.getfixturevalue("_redis_cleanup")
    elif name == "postgresql":
        request.getfixturevalue("_sql_cleanup")
    return backend_url(name, tmp_path)


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
    mine = _weight(s.instance_id, key)
    found = [f"dead-{i}" for i in range(5000) if _weight(f"dead-{i}", key) > mine][:count]
    assert len(found) == count
    return found


def register(backend: Backend, instance: str) -> None:
    """``instance`` in the registry with a fresh heartbeat (as a beat killed
    a moment ago: the registry lists it until its entry expires)."""
    info = InstanceInfo(instance, "host", 1, "0", int(time.time() * 1000))
    backend.register(info, 60_000)


def test_a_third_ranked_backup_takes_over_when_both_before_it_died(url: str) -> None:
    """Cause 1: the owner and the first backup of the slot's order both died
    (still listed in the registry): the third-ranked instance checks too,
    a heartbeat period after the lease's end, and sends the slot."""
    app, slot_ms, before = app_with_slot(url, anarchon_max_late=30)
    clock = Clock(before)
    s = Scheduler(app, clock=clock)
    dead = open_backend(app, "dead")
    try:
        first, second = peers_above(s, slot_ms, 2)
        register(dead, first)
        register(dead, second)
        s.tick()  # heartbeat: three live instances, this one third for the slot
        assert len(s._peers) == 3
        assert s._rank("k", slot_ms) == 2
        claim_and_die(dead, slot_ms)
        clock.now = slot_ms / 1000
        s.tick()  # loses the race
        assert sent_slots(app) == []
        time.sleep(1.2)  # the dead owner's lease ends (backend clock)
        clock.now = slot_ms / 1000 + 1.5  # lease end: the first backup's time
        s.tick()
        assert sent_slots(app) == []  # rank 2 waits a heartbeat period
        clock.now = slot_ms / 1000 + 2.5 + HEARTBEAT_INTERVAL
        s.tick()
        assert sent_slots(app) == [("k", slot_ms)]
        newest = records(s, slot_ms)[0]
        assert (newest.state, newest.instance, newest.token) == (State.SENT, s.instance_id, 2)
    finally:
        s.close()
        dead.close()


def test_a_late_rank_checks_only_once_a_peer_died(url: str) -> None:
    """A fourth-ranked instance does not check while every peer it saw is
    alive (a healthy cluster pays no check for it); once one stops
    heartbeating it checks at once and takes the slot over."""
    app, slot_ms, before = app_with_slot(url, anarchon_max_late=30)
    clock = Clock(before)
    s = Scheduler(app, clock=clock)
    dead = open_backend(app, "dead")
    try:
        above = peers_above(s, slot_ms, 3)
        for peer in above:
            register(dead, peer)
        s.tick()
        assert s._rank("k", slot_ms) == 3
        claim_and_die(dead, slot_ms)
        clock.now = slot_ms / 1000
        s.tick()  # loses the race
        time.sleep(1.2)
        clock.now = slot_ms / 1000 + 4 + 2 * HEARTBEAT_INTERVAL  # past its staged check
        for peer in above:
            register(dead, peer)  # every peer heartbeats: alive
        s.tick()
        assert sent_slots(app) == []
        assert records(s, slot_ms)[0].state is State.CLAIMED  # not checked
        dead.unregister(above[0])  # a peer died (or left)
        s._next_heartbeat = 0
        s.tick()  # the heartbeat sees it gone: checks at once
        assert sent_slots(app) == [("k", slot_ms)]
        assert records(s, slot_ms)[0].token == 2
    finally:
        s.close()
        dead.close()


def test_a_backup_killed_after_its_take_over_is_taken_over_again(url: str) -> None:
    """Cause 2: a backup took the slot over (token 2) and died before its
    send. The other backup, whose check found token 2's lease running,
    checks again at that lease's end and sends the slot with token 3."""
    app, slot_ms, before = app_with_slot(url, anarchon_max_late=30)
    clock = Clock(before)
    s = Scheduler(app, clock=clock)
    dead = open_backend(app, "dead")
    other = open_backend(app, "dead-backup")
    try:
        s.tick()
        claim_and_die(dead, slot_ms)
        clock.now = slot_ms / 1000
        s.tick()  # loses the race
        time.sleep(1.2)  # the owner's lease ends
        request = ClaimRequest("k", slot_ms, 10**9, 10**9, slot_ms + 10**7, 5000)
        backup = other.take_over_many([request])[0]
        assert backup.won and backup.token == 2  # then it died
        clock.now = slot_ms / 1000 + 2
        s.tick()  # its check finds token 2's lease running
        assert sent_slots(app) == []
        held = records(s, slot_ms)[0]
        assert (held.state, held.token) == (State.CLAIMED, 2)
        assert held.lease_until_ms is not None
        while other.now_ms() <= held.lease_until_ms:  # token 2's lease ends
            time.sleep(0.1)
        clock.now = slot_ms / 1000 + 4
        s.tick()
        assert sent_slots(app) == [("k", slot_ms)]
        states = [(r.state, r.token) for r in records(s, slot_ms)]
        assert states[0] == (State.SENT, 3)
        assert sorted(states[1:]) == [(State.SUPERSEDED, 1), (State.SUPERSEDED, 2)]
    finally:
        s.close()
        dead.close()
        other.close()


def test_a_claim_whose_lease_ended_unsent_is_recorded_lost_after_max_late(url: str) -> None:
    """Cause 3: the backup checks only after ``max_late`` (it was stalled):
    the slot, still ``claimed`` by a dead owner, is not sent but recorded
    ``lost`` (fenced: the old claim is superseded), and stays closed."""
    app, slot_ms, before = app_with_slot(url, anarchon_max_late=3)
    clock = Clock(before)
    s = Scheduler(app, clock=clock)
    dead = open_backend(app, "dead")
    try:
        s.tick()
        claim_and_die(dead, slot_ms)
        clock.now = slot_ms / 1000
        s.tick()  # loses the race
        time.sleep(1.2)  # the owner's lease ends
        clock.now = slot_ms / 1000 + 3.5  # the check falls due past max_late
        s.tick()
        assert sent_slots(app) == []
        newest, *older = records(s, slot_ms)
        assert (newest.state, newest.token, newest.instance) == (State.LOST, 2, s.instance_id)
        assert newest.error and "max_late" in newest.error
        assert [(r.state, r.token) for r in older] == [(State.SUPERSEDED, 1)]
        late = ClaimRequest("k", slot_ms, 10**9, 10**9, slot_ms + 10**7, 1000)
        assert not dead.claim([late])[0].won
        assert not dead.take_over_many([late])[0].won
    finally:
        s.close()
        dead.close()
