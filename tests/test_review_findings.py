"""Adversarial review of the batching / publish-path / hand-over changes
(61e8628..HEAD). Each test is either a defect reproduced (strict xfail,
failing now) or a behaviour checked and found sound (passing).

In-process schedulers on a real backend, the scheduler's clock moved by
hand (the backends judge leases by their own clocks: short real sleeps)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest

import celery_anarchon.beat.publisher as publisher_module
from celery_anarchon.backends import backend_from_url
from celery_anarchon.backends.base import ClaimRequest, State
from celery_anarchon.beat.claiming import MAX_CLAIM_BATCH
from celery_anarchon.beat.scheduler import Scheduler
from celery_anarchon.exceptions import BackendUnavailable

from .beat.support import delay_sends
from .conftest import backend_options, backend_url, require_service
from .test_batching import Clock, make_app, next_slot, sent_slots, spy
from .test_lease_features import make_app as lease_app
from .test_lease_features import open_backend
from .test_take_over_checks import app_with_slot, claim_and_die, records


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'claims.db'}"


def test_an_ambiguous_publish_failure_is_not_published_again(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The broker receives the message, then the connection drops before
    # the publish returns (a socket error after the write). Beat cannot know
    # whether it arrived; docs/exactly-once.md: any doubt counts as lost, one
    # publish per slot except when an instance dies or freezes.
    app = make_app(sqlite_url, 1, 10.0)
    slot = next_slot(10.0)
    clock = Clock(slot - 0.5)
    s = Scheduler(app, clock=clock)
    real_send = publisher_module.send_slot
    calls: list[int] = []

    def delivered_then_dropped(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        result = real_send(*args, **kwargs)
        if len(calls) == 1:
            raise ConnectionResetError("connection reset after the publish was written")
        return result

    try:
        monkeypatch.setattr(publisher_module, "send_slot", delivered_then_dropped)
        clock.now = slot + 0.1
        s.tick()
        slot_ms = int(slot * 1000)
        sent = sent_slots(app)
        assert s.backend is not None
        states = [r.state for r in s.backend.history("job-0000")]
        assert State.SUPERSEDED not in states  # no take-over on record
        assert sent == [("job-0000", slot_ms)], f"published {len(sent)} times: {sent}"
        assert states == [State.LOST]  # in doubt: recorded, not sent again
    finally:
        s.close()


def test_close_after_a_blip_still_records_what_was_sent(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The backend answers again by the time beat shuts down; only one
    # mark_many call failed (a blip). A graceful shutdown must not leave the
    # published slot to a backup: that is not the die-or-freeze window.
    app = make_app(sqlite_url, 3, 10.0, anarchon_lease_ttl=1)
    slot = next_slot(10.0)
    slot_ms = int(slot * 1000)
    clock = Clock(slot - 0.5)
    s = Scheduler(app, clock=clock)
    assert s.backend is not None
    real_mark_many = s.backend.mark_many
    failed: list[int] = []

    def blip(*args: Any, **kwargs: Any) -> Any:
        if not failed:
            failed.append(1)
            raise BackendUnavailable("blip")
        return real_mark_many(*args, **kwargs)

    monkeypatch.setattr(s.backend, "mark_many", blip)
    clock.now = slot + 0.1
    s.tick()
    assert len(sent_slots(app)) == 3
    assert len(s.journal.unmarked) == 3
    s.close()  # SIGTERM right after the blip: the backend answers again
    check = backend_from_url(sqlite_url, instance="checker")
    check.open()
    try:
        states = [check.history(f"job-{i:04d}")[0].state for i in range(3)]
        time.sleep(1.2)  # the 1 s lease ends: would a backup take over?
        requests = [s.jobs[f"job-{i:04d}"].claim_request(slot_ms, 120) for i in range(3)]
        taken = [c.won for c in check.take_over_many(requests)]
        assert states == [State.SENT] * 3 and taken == [False] * 3, (states, taken)
    finally:
        check.close()


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


@pytest.fixture(params=["sqlite", "postgresql", "mysql", "redis"])
def lease_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:

    name: str = request.param
    require_service(name)
    if name == "redis":
        request.getfixturevalue("_redis_cleanup")
    elif name in {"postgresql", "mysql"}:
        request.getfixturevalue("_sql_cleanup")
    return backend_url(name, tmp_path)


@pytest.mark.services
def test_a_retried_sent_mark_never_moves_a_finished_run_back(lease_url: str) -> None:
    # mark_many may be sent again whole after a partial failure (its
    # contract); by then the worker may have recorded running, then
    # succeeded. The retry must answer True (no false 'taken over' warning)
    # and leave the run succeeded; a superseded token's retry is refused.

    scheme = lease_url.split(":")[0].split("+")[0]
    options = backend_options("postgresql" if scheme == "postgresql" else scheme)
    owner = backend_from_url(lease_url, instance="owner", options=options)
    owner.open()
    try:
        slot_ms = (int(time.time()) + 1) * 1000
        job = f"retry-{slot_ms}"
        request = ClaimRequest(job, slot_ms, 10**9, 10**9, slot_ms + 10**7, 30_000)
        other = ClaimRequest(job + "-b", slot_ms, 10**9, 10**9, slot_ms + 10**7, 30_000)
        claim, claim_b = owner.claim([request, other])
        assert claim.won and claim_b.won
        assert owner.mark_many([claim, claim_b], State.SENT, task_ids=["t1", "t2"]) == [True] * 2
        assert owner.mark(claim, State.RUNNING)
        assert owner.mark(claim, State.SUCCEEDED)
        again = owner.mark_many([claim, claim_b], State.SENT, task_ids=["t1", "t2"])
        assert again == [True, True]
        [record] = owner.history(job)
        assert record.state is State.SUCCEEDED
        assert owner.history(job + "-b")[0].state is State.SENT
    finally:
        owner.close()


def test_shutdown_leaves_a_failed_send_to_the_backup_while_it_can_still_send_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A wins the slot, but its publish fails (A cannot reach Celery's
    # broker): the claim is left to a backup at lease end (1 s). B lost the
    # race and checks at lease end. A is stopped just after its lease ended,
    # 28 s before max_late: B can take the slot over and send it.

    url = f"sqlite:///{tmp_path / 'claims.db'}"
    app, slot_ms, before = app_with_slot(url, anarchon_max_late=30)
    clock_a, clock_b = Clock(before), Clock(before)
    a = Scheduler(app, clock=clock_a)
    b = Scheduler(app, clock=clock_b)
    real_send = publisher_module.send_slot
    broker_down = [True]

    def send(*args: Any, **kwargs: Any) -> Any:
        if broker_down[0]:
            raise ConnectionRefusedError("A cannot reach Celery's broker")
        return real_send(*args, **kwargs)

    monkeypatch.setattr(publisher_module, "send_slot", send)
    try:
        a.tick()
        b.tick()
        clock_a.now = clock_b.now = slot_ms / 1000
        a.tick()  # A alone in its view: claims at the slot, the publish fails
        b.tick()  # B loses the race: a take-over check at the lease's end
        assert [r.state for r in records(a, slot_ms)] == [State.CLAIMED]
        assert ("k", slot_ms) in b.take_over.watching
        broker_down[0] = False
        time.sleep(1.2)  # A's lease ends (backend clock)
        clock_a.now = clock_b.now = slot_ms / 1000 + 1.3
        a.close()  # SIGTERM: 28 s before max_late
        b.registry.next_heartbeat = 0  # B's heartbeat sees A leave
        for step in (1.5, 2.0, 3.0, 5.0):
            clock_b.now = slot_ms / 1000 + step
            b.tick()
        states = [r.state for r in records(b, slot_ms)]
        assert sent_slots(app) == [("k", slot_ms)], states
    finally:
        a.close()
        b.close()
        open_backend(app, "x").close()


def test_overlap_skip_reads_each_deferred_slot_once(sqlite_url: str) -> None:
    # 400 jobs due at once, overlap='skip', a lease that allows batches of
    # 50 (2 s lease, 10 ms sends): 8 rounds. Each slot needs its previous
    # run read once (before the fix every round read every slot still waiting).
    jobs = 400
    app = make_app(
        sqlite_url,
        jobs,
        10.0,
        anarchon_lease_ttl=2,
        anarchon_overlap="skip",
    )
    slot = next_slot(10.0)
    clock = Clock(slot - 0.5)
    s = Scheduler(app, clock=clock)
    reads: list[str] = []
    try:
        assert s.backend is not None
        spy(s.backend, "history", reads, lambda job, limit=None: job)
        clock.now = slot + 0.1
        sent: list[tuple[str, int]] = []
        for _ in range(40):
            with delay_sends(0.01):
                s.tick()
            sent += sent_slots(app)
            if len(sent) >= jobs:
                break
        assert len(sent) == len(set(sent)) == jobs
        assert len(reads) <= 2 * jobs, f"{len(reads)} history reads for {jobs} slots"
    finally:
        s.close()


@pytest.mark.services
def test_a_given_back_slot_is_published_once_with_a_peer_racing_for_it(
    lease_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A wins 20 slots and sends slower than its 1.2 s lease allows: it gives
    # the rest back. Peer B ticks right after each give-back (it claims the
    # released slots at once); A then claims what is left afresh. Every slot
    # must be published once and recorded sent once, on every lease backend.

    slot = next_slot(10.0)
    slot_ms = int(slot * 1000)
    schedule = {f"g-{i:02d}": {"task": "t.g", "schedule": 10.0} for i in range(20)}

    # A namespace of this test's own under the run's prefix (the run's
    # clean-up still finds it): the run's prefix alone is every test's in
    # this xdist worker, registry included.
    base = backend_options(lease_url.split(":")[0].split("+")[0])["prefix"]
    own = {"prefix": f"{base}g{uuid.uuid4().hex[:6]}{base[-1]}"}
    app = lease_app(
        lease_url,
        schedule,
        anarchon_backend_options=own,
        anarchon_lease_ttl=1.2,
        anarchon_max_skew=120,
        anarchon_max_late=5,
    )
    clock_a, clock_b = Clock(slot - 0.5), Clock(slot - 0.5)
    a = Scheduler(app, clock=clock_a)
    a.tick()  # A registers first: alone in its view, it claims at the slot
    b = Scheduler(app, clock=clock_b)
    b.tick()
    real_send = publisher_module.send_slot
    real_give_back = a.claimer.give_back
    given: list[int] = []

    def slow_send(*args: Any, **kwargs: Any) -> Any:
        clock_a.now += 0.1
        return real_send(*args, **kwargs)

    def give_back_then_peer(rest: Any) -> None:
        given.append(len(rest))
        real_give_back(rest)
        clock_b.now = clock_a.now
        b.tick()

    monkeypatch.setattr(publisher_module, "send_slot", slow_send)
    monkeypatch.setattr(a.claimer, "give_back", give_back_then_peer)
    try:
        clock_a.now = slot + 0.1
        sent: list[tuple[str, int]] = []
        for _ in range(30):
            a.tick()
            clock_b.now = clock_a.now
            b.tick()
            sent += sent_slots(app)
            if len(sent) >= 20:
                break
        time.sleep(1.5)  # every lease ends; late take-over checks find them sent
        for step in (2, 3, 4):
            clock_a.now = clock_b.now = slot + step
            a.tick()
            b.tick()
        sent += sent_slots(app)
        assert given, "no batch was given back"
        assert sorted(sent) == [(f"g-{i:02d}", slot_ms) for i in range(20)]
        assert a.backend is not None
        owners = set()
        for i in range(20):
            runs = [r for r in a.backend.history(f"g-{i:02d}") if r.slot_ms == slot_ms]
            assert [r.state for r in runs] == [State.SENT], (i, runs)
            owners.add(runs[0].instance)
        assert owners == {a.instance_id, b.instance_id}  # B did race for released slots
    finally:
        a.close()
        b.close()


def test_a_lone_instance_sends_thousands_due_at_once_each_once(sqlite_url: str) -> None:
    # One instance (the registry shows it alone: it claims at the slot),
    # 3,000 slots due in the same second, the default 30 s lease: claims
    # go in capped batches (at most MAX_CLAIM_BATCH), the rest waits in the
    # heap; every slot is sent once and recorded sent, none missed.

    jobs = 3000
    app = make_app(sqlite_url, jobs, 60.0, anarchon_max_late=30)
    slot = next_slot(60.0)
    clock = Clock(slot - 0.5)
    s = Scheduler(app, clock=clock)
    batches: list[int] = []
    try:
        assert s.backend is not None
        s.tick()
        assert s.registry.peers == [s.instance_id]
        spy(s.backend, "claim", batches, lambda requests: len(requests))
        clock.now = slot + 0.1
        sent: list[tuple[str, int]] = []
        for _ in range(60):
            s.tick()
            sent += sent_slots(app)
            if len(sent) >= jobs:
                break
        assert len(sent) == len(set(sent)) == jobs
        assert len(batches) >= 2 and max(batches) <= MAX_CLAIM_BATCH and sum(batches) == jobs
        slot_ms = int(slot * 1000)
        for i in range(0, jobs, 97):
            [record] = s.backend.history(f"job-{i:04d}")
            assert (record.state, record.slot_ms) == (State.SENT, slot_ms)
    finally:
        s.close()
