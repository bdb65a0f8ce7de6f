"""Claiming: one claim per slot across instances, batches no larger than a
share of the lease allows, and give-back of what a batch could not send in
time."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import celery_anarchon.beat.publisher as publisher_module
from celery_anarchon.backends.base import State
from celery_anarchon.beat.claiming import MAX_CLAIM_BATCH, MIN_CLAIM_BATCH
from celery_anarchon.beat.scheduler import Scheduler

from ..conftest import backend_options
from .support import (
    Clock,
    delay_sends,
    jobs_app,
    make_app,
    next_slot,
    sent_messages,
    sent_slots,
    spy,
    sqlite_app,
    tick_until,
)


def test_two_schedulers_on_one_backend_send_each_slot_once(
    t0: float, tmp_path: Path, every_second: dict[str, Any]
) -> None:
    app = sqlite_app(tmp_path, every_second, anarchon_max_late=0.5)
    clock = Clock(t0 + 0.5)
    a, b = Scheduler(app, clock=clock), Scheduler(app, clock=clock)
    try:
        for step in range(1, 11):
            clock.now = t0 + step
            (a, b)[step % 2].tick()
            (b, a)[step % 2].tick()
        sent = sent_messages(app)
        slots = [h["anarchon_slot"] for h in sent]
        assert sorted(slots) == [int((t0 + i) * 1000) for i in range(1, 11)]
        senders = {r.instance for r in a.backend.history("tick")}  # type: ignore[union-attr]
        assert senders == {a.instance_id, b.instance_id}
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize(("lease", "delay", "most"), [(2.0, 0.01, MIN_CLAIM_BATCH), (30.0, 0, 200)])
def test_a_claim_batch_fits_in_a_share_of_the_lease(
    sqlite_url: str, lease: float, delay: float, most: int
) -> None:
    # 200 slots due at once. With a 2 s lease and sends slowed to 10 ms
    # each, a batch may hold only what is sent in 0.5 s: the smallest batch;
    # the rest waits in the heap. With a 30 s lease, one batch takes all.
    app = jobs_app(sqlite_url, 200, 10.0, anarchon_lease_ttl=lease)
    slot = next_slot(10.0)
    clock = Clock(slot - 0.5)
    s = Scheduler(app, clock=clock)
    batches: list[int] = []
    try:
        assert s.backend is not None
        spy(s.backend, "claim", batches, lambda requests: len(requests))
        clock.now = slot + 0.1
        with delay_sends(delay):
            tick_until(s, lambda: sum(batches) >= 200)
        assert max(batches) == most and sum(batches) == 200
        sent = sent_slots(app)
        assert len(sent) == 200 and len(set(sent)) == 200
        states = Counter(s.backend.history(f"job-{i:04d}")[0].state for i in range(200))
        assert states == Counter({State.SENT: 200})
    finally:
        s.close()


def test_a_batch_sending_slower_than_its_lease_allows_gives_the_rest_back(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Each send takes 0.1 s of the scheduler's clock and the lease is 1.2 s:
    # a batch may send for 0.4 s (a third of the lease), then releases the
    # rest, which is claimed afresh (a full lease each time) and sent.
    app = jobs_app(sqlite_url, 20, 10.0, anarchon_lease_ttl=1.2)
    slot = next_slot(10.0)
    clock = Clock(slot - 0.5)
    s = Scheduler(app, clock=clock)
    real_send = publisher_module.send_slot

    def slow_send(*args: Any, **kwargs: Any) -> Any:
        clock.now += 0.1
        return real_send(*args, **kwargs)

    batches: list[int] = []
    released: list[int] = []
    try:
        assert s.backend is not None
        spy(s.backend, "claim", batches, lambda requests: len(requests))
        spy(s.backend, "release", released, lambda claims: len(claims))
        monkeypatch.setattr(publisher_module, "send_slot", slow_send)
        clock.now = slot + 0.1
        sent_slots_seen: list[tuple[str, int]] = []

        def all_sent() -> bool:
            sent_slots_seen.extend(sent_slots(app))
            return len(sent_slots_seen) >= 20

        with caplog.at_level("INFO", logger="celery_anarchon.beat"):
            tick_until(s, all_sent)
        slot_ms = int(slot * 1000)
        assert sorted(sent_slots_seen) == [(f"job-{i:04d}", slot_ms) for i in range(20)]
        assert batches[0] == 20 and len(batches) >= 3 and released and released[0] >= 10
        assert "claimed afresh" in caplog.text
        for i in range(20):
            [record] = s.backend.history(f"job-{i:04d}")
            assert record.state is State.SENT
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
    app = make_app(
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
    app = jobs_app(sqlite_url, jobs, 60.0, anarchon_max_late=30)
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


def test_a_claim_answered_deadline_is_claimed_again_and_sent_once(
    t0: float, tmp_path: Path, every_second: dict[str, Any]
) -> None:
    """A claim that reached the backend after its deadline claimed nothing
    (``"deadline"``): nobody holds the slot, so the scheduler claims it
    again shortly and sends it once, instead of dropping it."""
    import dataclasses

    app = sqlite_app(tmp_path, every_second, anarchon_max_late=5.0, anarchon_jitter=0)
    clock = Clock(t0 + 0.5)
    s = Scheduler(app, clock=clock)
    try:
        clock.now = t0 + 0.5
        s.tick()  # set up
        backend = s.backend
        assert backend is not None
        real_claim = backend.claim
        late: list[int] = []

        def claim_late_once(requests: Any) -> Any:
            if not late:  # the first batch arrives past its deadline
                late.extend(r.slot_ms for r in requests)
                requests = [dataclasses.replace(r, deadline_ms=1) for r in requests]
            return real_claim(requests)

        backend.claim = claim_late_once  # type: ignore[method-assign]
        for step in range(1, 30):
            clock.now = t0 + 1 + step * 0.1
            s.tick()
        assert late, "no claim was made"
        slot = late[0]
        assert [h["anarchon_slot"] for h in sent_messages(app)].count(slot) == 1
        assert [r.state for r in backend.history("tick") if r.slot_ms == slot] == [State.SENT]
    finally:
        s.close()
