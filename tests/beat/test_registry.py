"""The live-instance registry: rendezvous spreads a burst, a lone instance
claims at the slot, drift between definitions is warned once."""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

import pytest

from celery_anarchon.backends.base import InstanceInfo
from celery_anarchon.beat.scheduler import Scheduler

from .support import (
    Clock,
    make_app,
    sent_slots,
)


@pytest.mark.services
def test_rendezvous_spreads_a_burst_across_instances(url: str) -> None:
    now = int(time.time())
    slot = now + 2
    schedule = {
        f"j{i}": {"task": "t.j", "schedule": 3600.0, "anarchon": {"anchor": slot}}
        for i in range(300)
    }
    app = make_app(url, schedule, anarchon_jitter=1, anarchon_max_late=30)
    clock = Clock(float(now))
    schedulers = [Scheduler(app, clock=clock) for _ in range(3)]
    try:
        for s in schedulers:
            s.tick()  # registers; the second round reads every peer
        for s in schedulers:
            s.registry.next_heartbeat = 0
            s.tick()
            s.agenda.plan_first_slots()
        clock.now = slot
        for s in schedulers:
            s.tick()  # preferred owners claim at the slot
        clock.now = slot + 1
        for s in schedulers:
            s.tick()  # backups find every slot taken
        sent = sent_slots(app)
        assert sorted(sent) == sorted((f"j{i}", slot * 1000) for i in range(300))
        owners = Counter(
            r.instance
            for s in schedulers[:1]
            for i in range(300)
            for r in s.backend.history(f"j{i}")  # type: ignore[union-attr]
        )
        assert len(owners) == 3 and min(owners.values()) > 60, owners
    finally:
        for s in schedulers:
            s.close()


@pytest.mark.services
def test_a_lone_instance_claims_at_the_slot(url: str) -> None:
    now = int(time.time())
    slot = now + 2
    schedule = {
        f"j{i}": {"task": "t.j", "schedule": 3600.0, "anarchon": {"anchor": slot}}
        for i in range(20)
    }
    app = make_app(url, schedule, anarchon_jitter=2)
    clock = Clock(float(now))
    alone = Scheduler(app, clock=clock)
    others: list[Scheduler] = []
    try:
        alone.registry.random.randint = lambda low, high: high  # type: ignore[method-assign]
        alone.tick()  # the first heartbeat: the registry shows this instance alone
        assert alone.registry.peers == [alone.instance_id]
        clock.now = slot
        alone.tick()  # claims at the slot, not after a random part of the jitter
        assert sorted(sent_slots(app)) == sorted((f"j{i}", slot * 1000) for i in range(20))
        # With a second instance, the preferred owner claims at once, the backup
        # after the jitter.
        others.append(Scheduler(app, clock=clock))
        others[0].tick()
        alone.registry.next_heartbeat = 0
        alone.tick()
        assert len(alone.registry.peers) == 2
        next_slot = (slot + 3600) * 1000
        delays = {alone.registry.claim_delay_ms(alone.jobs[f"j{i}"], next_slot) for i in range(20)}
        assert delays == {0, 2000}
    finally:
        for s in [alone, *others]:
            s.close()


@pytest.mark.services
def test_drift_is_warned_once_and_definitions_are_read_once(
    url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def schedule(changed: float) -> dict[str, Any]:
        return {
            "same": {"task": "t.same", "schedule": 3600.0},
            "changed": {"task": "t.changed", "schedule": changed},
        }

    caplog.set_level(logging.WARNING, logger="celery_anarchon.beat")
    clock = Clock(float(int(time.time())))
    app_a = make_app(url, schedule(3600.0))
    shared = app_a.conf.anarchon_backend_options  # one registry for both
    a = Scheduler(app_a, clock=clock)
    b = Scheduler(make_app(url, schedule(1800.0), anarchon_backend_options=shared), clock=clock)
    try:
        assert a.backend is not None
        read: list[str] = []
        sent_jobs: list[int] = []
        definitions, register = a.backend.definitions, a.backend.register

        def spy_definitions(instance: str) -> dict[str, str]:
            read.append(instance)
            return definitions(instance)

        def spy_register(info: InstanceInfo, ttl_ms: int) -> bool:
            sent_jobs.append(len(info.jobs))
            return register(info, ttl_ms)

        monkeypatch.setattr(a.backend, "definitions", spy_definitions)
        monkeypatch.setattr(a.backend, "register", spy_register)
        b.tick()
        for _ in range(3):
            a.registry.next_heartbeat = 0
            a.tick()
        assert read == [b.instance_id]  # once, though three heartbeats saw b
        assert sent_jobs == [2, 0, 0]  # definitions with the first heartbeat only
        warned = [r.getMessage() for r in caplog.records if "defined differently" in r.getMessage()]
        assert len(warned) == 1 and "job changed" in warned[0] and b.instance_id in warned[0]
    finally:
        a.close()
        b.close()
