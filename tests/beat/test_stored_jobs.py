"""Stored jobs applied by one in-process scheduler on every lease backend:
added, updated, paused, resumed and removed at runtime, the slots each
change holds from, the pause recorded once, and a restart that keeps them.

Commit times are the backend's real clock, so these schedulers run on the
real clock too, ticking for a few seconds each."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_anarchon.backends.base import State
from celery_anarchon.beat.registry import STORED_LAG_MS
from celery_anarchon.beat.scheduler import Scheduler
from celery_anarchon.schedules import JobExists, Schedules
from celery_anarchon.stored import APPLY_DELAY_MS

from .support import make_app, sent_messages, sent_slots

HOURLY = {"code-hourly": {"task": "t.noop", "schedule": 3600.0}}


@pytest.fixture
def app(lease_url: str) -> Celery:
    return make_app(lease_url, HOURLY, anarchon_max_skew=120, anarchon_max_late=30)


@pytest.fixture
def schedules(app: Celery) -> Iterator[Schedules]:
    with Schedules(app) as s:
        yield s


def start(app: Celery) -> Scheduler:
    s = Scheduler(app)
    s.tick()
    return s


def run_until(s: Scheduler, until_s: float) -> tuple[int, int]:
    """Tick as beat does (sleeping what a tick says, at most 0.05 s) up to
    ``until_s``; returns when the last tick began and ended, epoch ms: every
    slot up to the first was due then, none after the second."""
    while time.time() < until_s:
        time.sleep(max(min(s.tick(), 0.05, until_s - time.time()), 0.0))
    began = int(time.time() * 1000)
    s.tick()
    return began, int(time.time() * 1000)


def series(first: int, period: int, ticked: tuple[int, int]) -> tuple[list[int], list[int]]:
    """The slots every ``period`` ms from ``first`` that were surely due by the
    last tick, and those that may have been."""
    began, ended = ticked
    return list(range(first, began + 1, period)), list(range(first, ended + 1, period))


def within(sent: list[int], bounds: tuple[list[int], list[int]]) -> bool:
    return sent in (bounds[0], bounds[1])


def tick_at(s: Scheduler, when_s: float) -> None:
    """Tick once at ``when_s`` (real time), sleeping until then."""
    time.sleep(max(when_s - time.time(), 0.0))
    s.tick()


def first_after(ms: int, period_ms: int) -> int:
    """The first multiple of ``period_ms`` at or after ``ms``."""
    return -(-ms // period_ms) * period_ms


def of(sent: list[tuple[str, int]], job: str) -> list[int]:
    return sorted(slot for name, slot in sent if name == job)


def test_an_added_job_runs_from_its_first_slot_a_second_after_the_commit(
    app: Celery, schedules: Schedules
) -> None:

    s = start(app)
    try:
        added = schedules.add("dyn", "t.noop", 1.0)
        tick_at(s, added.committed_ms / 1000 + 0.1)
        assert "dyn" in s.jobs and s.jobs["dyn"].source == "stored"
        ticked = run_until(s, added.committed_ms / 1000 + 4.5)
        first = first_after(added.committed_ms + APPLY_DELAY_MS, 1000)
        sent = of(sent_slots(app), "dyn")
        assert within(sent, series(first, 1000, ticked)), (sent, first, ticked)
    finally:
        s.close()


def test_an_update_keeps_the_old_slots_before_it_holds_and_the_new_after(
    app: Celery, schedules: Schedules
) -> None:
    added = schedules.add("dyn", "t.noop", 1.0)
    s = start(app)
    try:
        run_until(s, added.committed_ms / 1000 + 3.0)
        sent_slots(app)  # drain the slots of the first definition
        updated = schedules.update("dyn", schedule=2.0)
        tick_at(s, updated.committed_ms / 1000 + 0.1)
        ticked = run_until(s, updated.committed_ms / 1000 + 5.0)
        effective = updated.committed_ms + APPLY_DELAY_MS
        slots = of(sent_slots(app), "dyn")
        old = [t for t in slots if t < effective]
        new = [t for t in slots if t >= effective]
        # Before it holds: the old definition's (every second) slots only.
        assert all(t % 1000 == 0 for t in old)
        assert len(old) <= 2
        # After: every 2 s, none pushed back or dropped, none twice.
        first_new = first_after(effective, 2000)
        assert within(new, series(first_new, 2000, ticked)), (new, first_new, ticked)
        assert len(set(slots)) == len(slots)
    finally:
        s.close()


def test_a_paused_job_sends_nothing_records_the_pause_once_and_resumes_without_a_stale_run(
    app: Celery, schedules: Schedules
) -> None:
    added = schedules.add("dyn", "t.noop", 1.0)
    s = start(app)
    try:
        run_until(s, added.committed_ms / 1000 + 2.0)
        pause = schedules.pause("dyn", note="billing <freeze>")
        tick_at(s, pause.paused_ms / 1000 + 0.1)
        sent_slots(app)
        run_until(s, pause.paused_ms / 1000 + 4.0)
        during = [t for t in of(sent_slots(app), "dyn") if t >= pause.from_ms]
        assert during == []
        skipped = [r for r in s.backend.history("dyn") if r.state == State.SKIPPED]  # type: ignore[union-attr]
        assert len(skipped) == 1
        assert "billing <freeze>" in (skipped[0].error or "")
        assert skipped[0].slot_ms == first_after(pause.from_ms, 1000) + 1  # off the slot

        resumed = schedules.resume("dyn")
        tick_at(s, (resumed.resumed_ms or 0) / 1000 + 0.1)
        run_until(s, (resumed.resumed_ms or 0) / 1000 + 3.0)
        after = of(sent_slots(app), "dyn")
        assert after, "nothing ran after the resume"
        # No stale run: nothing from the pause, the first slot after the resume holds.
        assert min(after) == first_after(resumed.until_ms or 0, 1000)
    finally:
        s.close()


def test_a_removed_job_sends_nothing_after_the_removal_holds(
    app: Celery, schedules: Schedules
) -> None:
    added = schedules.add("dyn", "t.noop", 1.0)
    s = start(app)
    try:
        run_until(s, added.committed_ms / 1000 + 2.0)
        version = schedules.remove("dyn")
        committed = schedules.backend_now_ms()
        tick_at(s, committed / 1000)
        assert "dyn" not in s.jobs
        sent_slots(app)
        run_until(s, committed / 1000 + 4.0)
        assert [t for t in of(sent_slots(app), "dyn") if t >= committed + APPLY_DELAY_MS] == []
        assert s.stored.state.version >= version
        # Its history stays readable.
        assert s.backend.history("dyn")  # type: ignore[union-attr]
    finally:
        s.close()


def test_stored_jobs_and_pauses_survive_a_restart(app: Celery, schedules: Schedules) -> None:
    schedules.add("dyn", "t.noop", 1.0)
    schedules.add("held", "t.noop", 1.0, paused=True, note="later")
    schedules.pause("code-hourly")

    s = start(app)
    try:
        assert {"dyn", "held", "code-hourly"} <= set(s.jobs)
        assert s.jobs["held"].pause is not None and s.jobs["held"].pause.paused
        assert s.jobs["code-hourly"].pause is not None
        run_until(s, time.time() + 3.0)
        sent = sent_slots(app)
        assert of(sent, "dyn") and not of(sent, "held")
    finally:
        s.close()


def test_a_code_entry_wins_over_a_stored_job_of_its_name(
    lease_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Code deployed after the job was stored: the code entry runs here."""
    stored_side = make_app(lease_url, {}, anarchon_max_skew=120)
    with Schedules(stored_side) as schedules:
        schedules.add("shared-name", "t.stored", 1.0)

    code = {"shared-name": {"task": "t.code", "schedule": 3600.0}}
    app = make_app(lease_url, code, anarchon_max_skew=120)
    app.conf.anarchon_backend_options = stored_side.conf.anarchon_backend_options
    with caplog.at_level(logging.WARNING, logger="celery_anarchon"):
        s = start(app)
    try:
        assert s.jobs["shared-name"].source == "code"
        assert s.jobs["shared-name"].entry.task == "t.code"
        assert "the code entry wins on this host" in caplog.text
    finally:
        s.close()


def test_resume_with_catch_up_latest_sends_the_newest_paused_slot_once(
    lease_url: str,
) -> None:
    app = make_app(lease_url, HOURLY, anarchon_max_skew=120, anarchon_max_late=30)
    with Schedules(app) as schedules:
        schedules.add("dyn", "t.noop", 2.0, anarchon={"catch_up": "latest"})
        s = start(app)
        try:
            pause = schedules.pause("dyn")
            tick_at(s, pause.paused_ms / 1000 + 0.1)
            run_until(s, pause.paused_ms / 1000 + 5.5)
            sent_slots(app)
            resumed = schedules.resume("dyn")
            tick_at(s, (resumed.resumed_ms or 0) / 1000 + 0.1)
            run_until(s, (resumed.until_ms or 0) / 1000 + 0.5)
            caught = [t for t in of(sent_slots(app), "dyn") if resumed.covers(t)]
            newest_paused = max(
                range(first_after(pause.from_ms, 2000), resumed.until_ms or 0, 2000)
            )
            assert caught == [newest_paused]
        finally:
            s.close()


def test_a_refused_update_leaves_the_old_definition_in_force(schedules: Schedules) -> None:
    schedules.add("dyn", "t.noop", 1.0)
    before = schedules.state().version
    with pytest.raises(ValueError, match="61"):
        schedules.update("dyn", schedule="61 * * * *")
    state = schedules.state()
    assert state.version == before
    assert state.jobs["dyn"].definition.schedule == {"every": 1.0}


def test_a_refused_add_leaves_the_pause_state_of_the_job_it_collides_with(
    schedules: Schedules,
) -> None:
    schedules.add("held", "t.noop", 60, paused=True, note="keep")
    schedules.add("running", "t.noop", 60)
    before = schedules.state().version
    with pytest.raises(JobExists, match="held"):
        schedules.add("held", "t.noop", 60)
    with pytest.raises(JobExists, match="running"):
        schedules.add("running", "t.noop", 60, paused=True, note="oops")
    assert schedules.state().version == before
    assert schedules.get("held").paused
    assert not schedules.get("running").paused


def test_add_refuses_the_name_of_a_code_entry_on_a_live_instance(lease_url: str) -> None:
    """The name is in another host's beat_schedule only: its registry entry
    tells."""
    there = make_app(lease_url, {"only-there": {"task": "t.noop", "schedule": 3600.0}})
    here = make_app(lease_url, {})
    here.conf.anarchon_backend_options = there.conf.anarchon_backend_options
    s = start(there)
    try:
        with Schedules(here) as schedules, pytest.raises(JobExists, match="only-there"):
            schedules.add("only-there", "t.noop", 60)
        with Schedules(here) as schedules:
            assert schedules.add("free-name", "t.noop", 60).version == 1
    finally:
        s.close()


def test_a_peer_behind_on_stored_jobs_is_warned_about(
    lease_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    app = make_app(lease_url, HOURLY)
    s = start(app)
    try:
        with Schedules(app) as schedules:
            schedules.add("dyn", "t.noop", 60)
        s.tick()
        assert s.stored.state.version == 1
        behind = dataclasses.replace(
            s.registry.instance_info(),
            instance="host:1:behind",
            stored_version=0,
            heartbeat_ms=s.stored.state.committed_ms + STORED_LAG_MS + 1000,
        )
        with caplog.at_level(logging.WARNING, logger="celery_anarchon"):
            s.registry._warn_stored_lag([behind])
        assert "host:1:behind applies stored jobs at version 0" in caplog.text
    finally:
        s.close()


def test_changes_read_in_one_poll_each_hold_from_their_own_second(
    app: Celery, schedules: Schedules
) -> None:
    """A removal and a re-add (or two updates) committed between two reads:
    the old definition stops at the first change, not at the last."""
    schedules.add("dyn", "t.old", 0.5)
    s = start(app)
    try:
        run_until(s, time.time() + 2.0)
        sent_messages(app)
        schedules.remove("dyn")
        removed_ms = schedules.backend_now_ms()
        time.sleep(0.7)  # no tick: both changes are read by the same poll
        readded = schedules.add("dyn", "t.new", 0.5)
        run_until(s, readded.committed_ms / 1000 + 3.0)
        sends = [(h["task"], int(h["anarchon_slot"])) for h in sent_messages(app)]
        stale = [
            (task, slot)
            for task, slot in sends
            if task == "t.old" and slot >= removed_ms + APPLY_DELAY_MS
        ]
        assert stale == [], sends
        assert any(task == "t.new" for task, _ in sends)
    finally:
        s.close()


def test_a_change_counter_that_went_back_is_read_again(own_redis: Any) -> None:
    """A Redis restarted without its data (or a failover that lost writes):
    the jobs written afterwards reuse versions the instance has seen, and
    still run."""
    url = f"redis://127.0.0.1:{own_redis.port}/0"
    app = make_app(url, HOURLY)
    with Schedules(app) as schedules:
        for name in ("a", "b", "c"):
            schedules.add(name, "t.noop", 60)
        s = start(app)
        try:
            assert {"a", "b", "c"} <= set(s.jobs)
            schedules.backend.open()
            import redis

            redis.Redis(port=own_redis.port).flushall()  # the store's data is gone
            schedules.add("urgent", "t.noop", 0.5)
            run_until(s, time.time() + 2.0)
            assert "urgent" in s.jobs and not {"a", "b", "c"} & set(s.jobs)
            assert of(sent_slots(app), "urgent")
        finally:
            s.close()
