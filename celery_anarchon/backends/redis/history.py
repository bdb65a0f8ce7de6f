"""History of the Redis backend: reading a job's records (``{PJ}:runs``,
``{PJ}:index``) and the newest slot of many jobs."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from ..base import RunRecord, State
from .connection import RedisConnection
from .scripts import HISTORY, LAST_SLOT, _Call

logger = logging.getLogger(__name__)

#: Jobs per pipeline when reading the last slots at start-up.
LAST_SLOTS_CHUNK = 1000


def _record_or_none(job: str, item: str | bytes) -> RunRecord | None:
    """The history record stored as ``item`` (JSON), or None (logged) when
    it cannot be read as one."""
    try:
        return _record(job, json.loads(item))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        logger.warning(
            "anarchon: history of %s: a record that is not ours (%s: %.200r); left out",
            job,
            type(exc).__name__,
            item,
        )
        return None


def _record(job: str, run: dict[str, Any]) -> RunRecord:
    def ms(name: str) -> int | None:
        value = run.get(name)
        return None if value is None else int(value)

    token = run.get("token")
    return RunRecord(
        job=job,
        slot_ms=int(run["slot_ms"]),
        state=State(run["state"]),
        instance=run.get("instance"),
        token=None if token is None else int(token),
        claimed_at_ms=ms("claimed_at_ms"),
        sent_at_ms=ms("sent_at_ms"),
        started_at_ms=ms("started_at_ms"),
        finished_at_ms=ms("finished_at_ms"),
        task_id=run.get("task_id"),
        error=run.get("error"),
        manual_key=run.get("manual_key"),
        lease_until_ms=ms("lease_until_ms"),
    )


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


class RedisHistory(RedisConnection):
    """Reading history.

    :meth:`~Backend.state_counts` and :meth:`~Backend.jobs_with_state` keep
    the default (:meth:`history_many` and counting here): a job's records
    live under keys of its own (``{PJ}:runs``, ``{PJ}:index``, by slot),
    and no key indexes records of every job by slot time or state, so a
    window over all jobs reads each job's records.
    """

    def history(self, job: str, limit: int | None = None) -> list[RunRecord]:
        """The job's records, newest slot first (for one slot, the current
        record before superseded ones), at most ``limit``; read with
        :data:`LUA_HISTORY_SCRIPT`.

        A record that is not ours (not JSON, no slot, or a state this
        version does not know) is left out with a warning; its slot stays
        taken, since claims check the slot's key, not the record.

        Raises:
            BackendUnavailable: no answer.
        """
        if limit is not None and limit <= 0:
            return []
        tag = self._tag(job)
        raw = self._call((HISTORY, [f"{tag}:runs", f"{tag}:index"], [limit or 0]))
        return [record for record in (_record_or_none(job, item) for item in raw) if record]

    def history_many(
        self, jobs: Sequence[str], limit: int | None = None, *, since_ms: int | None = None
    ) -> dict[str, list[RunRecord]]:
        """:meth:`history` of many jobs: :data:`LUA_HISTORY_SCRIPT` per job,
        in pipelines of :data:`LAST_SLOTS_CHUNK` calls; with ``since_ms``
        each job's kept records are read and the older ones dropped here
        (see :meth:`Backend.history_many`).

        Raises:
            BackendUnavailable: no answer, or an error reply.
        """
        found: dict[str, list[RunRecord]] = {job: [] for job in jobs}
        if limit is not None and limit <= 0:
            return found
        names = list(found)
        count = 0 if since_ms is not None or limit is None else limit
        for start in range(0, len(names), LAST_SLOTS_CHUNK):
            chunk = names[start : start + LAST_SLOTS_CHUNK]
            calls: list[_Call] = []
            for job in chunk:
                tag = self._tag(job)
                calls.append((HISTORY, [f"{tag}:runs", f"{tag}:index"], [count]))
            for job, reply in zip(chunk, self._run(calls), strict=True):
                if isinstance(reply, Exception):
                    raise self._unavailable("history_many", reply) from reply
                records = [r for r in (_record_or_none(job, item) for item in reply) if r]
                if since_ms is not None:
                    records = [r for r in records if r.slot_ms >= since_ms][:limit]
                found[job] = records
        return found

    def last_slots(self, jobs: Sequence[str]) -> dict[str, int]:
        """``job -> newest scheduled slot with a record`` for each of
        ``jobs`` that has one: :data:`LUA_LAST_SLOT_SCRIPT` per job, in
        pipelines of :data:`LAST_SLOTS_CHUNK` calls (see
        :meth:`Backend.last_slots`).

        Raises:
            BackendUnavailable: no answer, or an error reply.
        """
        names = list(jobs)
        found: dict[str, int] = {}
        for start in range(0, len(names), LAST_SLOTS_CHUNK):
            chunk = names[start : start + LAST_SLOTS_CHUNK]
            calls: list[_Call] = [
                (LAST_SLOT, [self._runs_key(job), f"{self._tag(job)}:index"], []) for job in chunk
            ]
            for job, reply in zip(chunk, self._run(calls), strict=True):
                if isinstance(reply, Exception):
                    raise self._unavailable("last_slots", reply) from reply
                if int(reply) >= 0:
                    found[job] = int(reply)
        return found
