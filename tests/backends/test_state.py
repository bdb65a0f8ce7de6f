"""The state rules every backend reads from :class:`State`: which timestamp
a move stamps, and which moves go forward."""

from __future__ import annotations

import pytest

from celery_anarchon.backends.base import FINAL_RANK, FINISHED_STATES, State
from celery_anarchon.backends.redis.scripts import LUA_MARK_SCRIPT

S = State


@pytest.mark.parametrize(
    ("state", "stamp"),
    [
        (S.SENT, "sent_at_ms"),
        (S.RUNNING, "started_at_ms"),
        (S.SUCCEEDED, "finished_at_ms"),
        (S.FAILED, "finished_at_ms"),
        (S.LOST, "finished_at_ms"),
        (S.CLAIMED, None),
        (S.MISSED, None),
        (S.SKIPPED, None),
        (S.SUPERSEDED, None),
    ],
)
def test_each_state_stamps_its_timestamp(state: State, stamp: str | None) -> None:
    assert state.stamp == stamp


def test_a_run_moves_forward_only_and_a_late_sent_reaches_a_finished_run() -> None:
    assert [s.rank for s in (S.CLAIMED, S.SENT, S.RUNNING)] == [0, 1, 2]
    assert {s for s in State if s.rank == FINAL_RANK} == {
        S.SUCCEEDED,
        S.FAILED,
        S.LOST,
        S.SUPERSEDED,
        S.MISSED,
        S.SKIPPED,
    }
    assert S.RUNNING.moves_from == {S.CLAIMED, S.SENT}  # a second 'running' is refused
    for done in FINISHED_STATES:
        assert done.moves_from == {S.CLAIMED, S.SENT, S.RUNNING}
    assert S.SENT.moves_from == {S.CLAIMED, S.SENT, S.RUNNING, *FINISHED_STATES}
    for never in (S.CLAIMED, S.MISSED, S.SKIPPED, S.SUPERSEDED):
        assert never.moves_from == frozenset()


def test_the_redis_mark_script_ranks_states_as_state_does() -> None:
    assert "local RANK = {claimed = 0, sent = 1, running = 2}" in LUA_MARK_SCRIPT
    assert f"or {FINAL_RANK}, RANK[ARGV[3]] or {FINAL_RANK}" in LUA_MARK_SCRIPT
