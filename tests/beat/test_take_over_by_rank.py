"""Take-over by rendezvous rank when the first two of a slot's order are
dead: four schedulers in one process on a real lease backend, a hand-moved
clock, the two first of the slot's order never ticked again (killed, still
listed in the registry for ``registry_ttl``). The third of the order checks
the slot one heartbeat period after the lease's end
(:data:`celery_anarchon.beat.takeover.TAKE_OVER_RANKS`) and sends it once.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from celery_anarchon.beat.registry import HEARTBEAT_INTERVAL
from celery_anarchon.beat.scheduler import Scheduler

from ..conftest import POSTGRES_URL, REDIS_URL, require_service
from .support import Clock, make_app, sent_slots

pytestmark = pytest.mark.services


@pytest.mark.parametrize("backend", ["sqlite", "redis"])
def test_take_over_when_the_two_first_of_the_order_are_dead(backend: str, tmp_path: Path) -> None:
    if backend != "sqlite":
        require_service(backend)
    url = {
        "sqlite": f"sqlite:///{tmp_path / 'claims.db'}",
        "postgresql": POSTGRES_URL,
        "redis": REDIS_URL,
    }[backend]
    now = int(time.time())
    slot = now + 2
    schedule = {"j": {"task": "t.j", "schedule": 3600.0, "anarchon": {"anchor": slot}}}
    app = make_app(url, schedule, anarchon_jitter=1, anarchon_max_late=30, anarchon_lease_ttl=1)
    clock = Clock(float(now))
    schedulers = [Scheduler(app, clock=clock) for _ in range(4)]
    try:
        for s in schedulers:
            s.tick()  # registers
        for s in schedulers:
            s.registry.next_heartbeat = 0
            s.tick()  # reads every peer
            s.agenda.plan_first_slots()
        assert all(len(s.registry.peers) == 4 for s in schedulers)
        first, second, third, fourth = sorted(
            schedulers, key=lambda s: s.registry.rank("j", slot * 1000)
        )
        request = first.jobs["j"].claim_request(slot * 1000, 10)
        assert first.backend is not None
        assert first.backend.claim([request])[0].won  # then it dies unsent; so does `second`
        clock.now = slot + 1.5  # the two live ones lose the slot
        third.tick()
        fourth.tick()
        assert sent_slots(app) == []
        time.sleep(1.3)  # the dead owner's lease (1 s, backend clock) ends
        clock.now = slot + 4.0
        third.tick()
        fourth.tick()
        assert sent_slots(app) == []  # rank 2 checks a heartbeat period later
        clock.now = slot + 4.0 + HEARTBEAT_INTERVAL
        third.tick()
        fourth.tick()
        assert sent_slots(app) == [("j", slot * 1000)]
    finally:
        for s in schedulers:
            s.close()
