"""Backup take-over: a backup takes a dead owner's slot over when its lease
ends, checks are batched and staggered by rendezvous rank, and an unsent
slot past ``max_late`` is recorded ``lost``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from celery_anarchon.backends import backend_from_url
from celery_anarchon.backends.base import ClaimRequest, State
from celery_anarchon.beat.registry import HEARTBEAT_INTERVAL
from celery_anarchon.beat.scheduler import Scheduler
from celery_anarchon.exceptions import BackendUnavailable

from .support import (
    Clock,
    app_with_slot,
    claim_and_die,
    jobs_app,
    make_app,
    next_slot,
    open_backend,
    peers_above,
    records,
    register,
    sent_slots,
    spy,
)


def test_take_over_checks_of_a_round_go_in_one_batch(sqlite_url: str) -> None:
    # A dead owner claimed 20 slots: 10 it sent, 10 it never did (a 1 ms
    # lease, long expired). The backup loses all 20 at the slot, then checks
    # them in one batched call once its lease (1 s) ends, and sends the 10.
    app = jobs_app(sqlite_url, 20, 10.0, anarchon_lease_ttl=1)
    slot = next_slot(10.0)
    slot_ms = int(slot * 1000)
    dead = backend_from_url(sqlite_url, instance="dead-owner")
    dead.open()
    clock = Clock(slot - 0.5)
    s = Scheduler(app, clock=clock)
    batches: list[int] = []
    try:
        assert s.backend is not None
        spy(s.backend, "take_over_many", batches, lambda requests: len(requests))
        assert not hasattr(s.backend, "take_over")  # no one-by-one form to fall back on
        requests = [s.jobs[f"job-{i:04d}"].claim_request(slot_ms, 120) for i in range(20)]
        expired = [r.__class__(**{**r.__dict__, "lease_ms": 1}) for r in requests[:10]]
        claims = dead.claim(expired + requests[10:])
        assert all(c.won for c in claims)
        assert all(dead.mark_many(claims[10:], State.SENT, task_ids=["t"] * 10))
        clock.now = slot + 0.1
        s.tick()
        assert sent_slots(app) == [] and batches == []
        clock.now = slot + 3.0  # the backup's lease plus its jitter, rounded
        s.tick()
        assert batches == [20]
        assert sorted(sent_slots(app)) == [(f"job-{i:04d}", slot_ms) for i in range(10)]
        for i in range(20):
            states = [r.state for r in s.backend.history(f"job-{i:04d}")]
            assert states == ([State.SENT, State.SUPERSEDED] if i < 10 else [State.SENT])
    finally:
        s.close()
        dead.close()


@pytest.mark.services
def test_a_backup_takes_over_a_dead_owners_slot(url: str) -> None:
    now = int(time.time())
    schedule = {
        "b": {"task": "t.b", "schedule": 3600.0, "anarchon": {"lease_ttl": 1}},
    }
    slot = (now // 3600) * 3600 + 3600  # the next whole hour: slot of "b"
    app = make_app(url, schedule, anarchon_max_late=30, anarchon_max_skew=7200)
    dead = open_backend(app, "dead-owner")
    clock = Clock(float(slot))
    # Built (connected, tables made, first slots planned) before the dead
    # owner claims: on a loaded machine that took up to 0.97 s, most of the
    # dead owner's lease, and the first tick must still find it running.
    s = Scheduler(app, clock=clock)
    lease_s = 2.0
    held = dead.claim(
        [ClaimRequest("b", slot * 1000, 10**9, 10**9, slot * 1000 + 10**7, int(lease_s * 1000))]
    )
    lease_ends = time.monotonic() + lease_s  # at the latest (backend clock)
    try:
        assert held[0].won  # claimed, never sent: then its owner died
        s.tick()  # loses the race: the dead owner holds the slot
        assert sent_slots(app) == []
        time.sleep(max(lease_ends + 0.2 - time.monotonic(), 0.0))  # the dead owner's lease ends
        clock.now = slot + 3.5
        s.tick()
        assert sent_slots(app) == [("b", slot * 1000)]
        history = s.backend.history("b")  # type: ignore[union-attr]
        by_state = {r.state: r for r in history}
        assert by_state[State.SENT].instance == s.instance_id
        assert by_state[State.SENT].token == 2
        assert dead.mark(held[0], State.SENT, task_id="too-late") is False  # fenced out
    finally:
        s.close()
        dead.close()


def test_a_take_over_check_that_meets_a_blip_is_checked_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The slot's owner died after claiming it (1 s lease). This instance,
    # its backup, checks at the lease's end; that one call meets a backend
    # blip (a Redis failover, a PostgreSQL restart: every instance sees it
    # at once). The backend answers again a moment later, well within
    # max_late=30: the slot must still be sent, or at least recorded.

    url = f"sqlite:///{tmp_path / 'claims.db'}"
    app, slot_ms, before = app_with_slot(url, anarchon_max_late=30)
    clock = Clock(before)
    s = Scheduler(app, clock=clock)
    assert s.backend is not None
    dead = open_backend(app, "dead-owner")
    try:
        s.tick()
        claim_and_die(dead, slot_ms)
        clock.now = slot_ms / 1000
        s.tick()  # loses the race: a take-over check is planned at lease end
        assert sent_slots(app) == []
        time.sleep(1.2)  # the dead owner's lease ends (backend clock)
        real = s.backend.take_over_many
        blips: list[int] = []

        def blip(requests: Any) -> Any:
            if not blips:
                blips.append(1)
                raise BackendUnavailable("blip")
            return real(requests)

        monkeypatch.setattr(s.backend, "take_over_many", blip)
        clock.now = slot_ms / 1000 + 3
        s.tick()  # the check meets the blip
        assert blips == [1]
        sent: list[tuple[str, int]] = []
        for step in range(4, 40):  # the backend answers; ticks go on past max_late
            clock.now = slot_ms / 1000 + step
            s.tick()
            sent += sent_slots(app)
        states = [r.state for r in records(s, slot_ms)]
        assert sent == [("k", slot_ms)] or states[0] in (State.LOST, State.MISSED), (
            sent,
            states,
        )
    finally:
        s.close()
        dead.close()


@pytest.mark.services
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
        assert len(s.registry.peers) == 3
        assert s.registry.rank("k", slot_ms) == 2
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


@pytest.mark.services
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
        assert s.registry.rank("k", slot_ms) == 3
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
        s.registry.next_heartbeat = 0
        s.tick()  # the heartbeat sees it gone: checks at once
        assert sent_slots(app) == [("k", slot_ms)]
        assert records(s, slot_ms)[0].token == 2
    finally:
        s.close()
        dead.close()


@pytest.mark.services
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


@pytest.mark.services
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
