"""History of the SQL backend: reading a job's records and trimming them after writes."""

from __future__ import annotations

import hashlib
import itertools
import logging
import time
from collections.abc import Collection, Iterable, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ...exceptions import BackendUnavailable
from ..base import RunRecord, State
from .connection import SQLConnection
from .dialects import INSERT_CHUNK
from .naming import key_of

logger = logging.getLogger(__name__)


#: Jobs trimmed per transaction by :meth:`SQLBackend.housekeep`.
TRIM_CHUNK = 50


#: Most jobs whose trim waits for :meth:`SQLBackend.housekeep`, and the
#: longest one waits, seconds; past either, a write trims the oldest waiting
#: ones itself (a caller that stopped housekeeping never lets a history grow).
MAX_DEFERRED_TRIMS = 20_000


MAX_TRIM_WAIT_S = 60.0


#: ``state`` column value -> State (a value this version does not know is absent).
_STATES = {state.value: state for state in State}


def _trim_every(history_size: int) -> int:
    """Writes of a job between two trims of its history."""
    return max(1, history_size // 10)


def _record_or_none(job: str, row: Any) -> RunRecord | None:
    """The history record of ``row``, or None (logged) when its state is unknown."""
    try:
        return _record(job, row)
    except ValueError:
        logger.warning(
            "anarchon: history of %s: row for slot %s has state %r, unknown to this "
            "version; left out (the slot stays taken)",
            job,
            row.slot_ms,
            row.state,
        )
        return None


def _record(job: str, row: Any) -> RunRecord:
    return RunRecord(
        job=job,
        slot_ms=int(row.slot_ms),
        state=State(row.state),
        instance=row.owner,
        token=int(row.token),
        claimed_at_ms=row.claimed_at_ms,
        sent_at_ms=row.sent_at_ms,
        started_at_ms=row.started_at_ms,
        finished_at_ms=row.finished_at_ms,
        task_id=row.task_id,
        error=row.error,
        manual_key=row.manual_key,
        lease_until_ms=row.lease_until_ms,
    )


class SQLHistory(SQLConnection):
    """Reading and trimming ``<prefix>runs``; owns the per-job write counts and the trims left to
    :meth:`housekeep`."""

    #: job key -> writes by this instance (a trim every few writes)
    _writes: dict[str, int]
    #: job key -> (history_size, history_ttl_ms, waiting since (monotonic
    #: seconds)) of trims left to housekeep(), oldest first
    _trims_due: dict[str, tuple[int, int, float]]
    #: housekeep() was called: trims wait for it
    _housekept: bool

    def history(self, job: str, limit: int | None = None) -> list[RunRecord]:
        """The job's records, newest slot first (for one slot, the current
        record before superseded ones), at most ``limit``: ``SELECT .. WHERE
        job = :job ORDER BY slot_ms DESC, token DESC LIMIT :limit``.

        A row whose state this version does not know (written by another
        program, or by a newer celery-anarchon) is left out with a warning;
        its slot stays taken, since claims check the key, not the state.

        Raises:
            BackendUnavailable: no answer.
        """
        if limit is not None and limit <= 0:
            return []
        runs = self._tables.runs
        query = (
            sa.select(runs)
            .where(runs.c.job == key_of(job))
            .order_by(runs.c.slot_ms.desc(), runs.c.token.desc())
            .limit(limit)
        )
        with self._read("read history") as conn:
            rows = list(conn.execute(query))
        return [record for record in (_record_or_none(job, row) for row in rows) if record]

    def history_many(
        self, jobs: Sequence[str], limit: int | None = None, *, since_ms: int | None = None
    ) -> dict[str, list[RunRecord]]:
        """:meth:`history` of many jobs, one query per :data:`INSERT_CHUNK`
        jobs in one read: ``SELECT .. FROM (SELECT runs.*, row_number() OVER
        (PARTITION BY job ORDER BY slot_ms DESC, token DESC) AS place ..
        WHERE job IN (..) AND slot_ms >= :since) WHERE place <= :limit``
        (without the window when there is no ``limit``). See
        :meth:`Backend.history_many`.

        Raises:
            BackendUnavailable: no answer.
        """
        found: dict[str, list[RunRecord]] = {job: [] for job in jobs}
        if limit is not None and limit <= 0:
            return found
        runs = self._tables.runs
        names = {key_of(job): job for job in found}
        keys = list(names)
        with self._read("read history of many jobs") as conn:
            for start in range(0, len(keys), INSERT_CHUNK):
                where: list[sa.ColumnElement[bool]] = [
                    runs.c.job.in_(keys[start : start + INSERT_CHUNK])
                ]
                if since_ms is not None:
                    where.append(runs.c.slot_ms >= since_ms)
                order = (runs.c.slot_ms.desc(), runs.c.token.desc())
                if limit is None:
                    query = sa.select(runs).where(*where).order_by(runs.c.job, *order)
                else:
                    place = sa.func.row_number().over(partition_by=runs.c.job, order_by=order)
                    inner = sa.select(runs, place.label("place")).where(*where).subquery()
                    query = (
                        sa.select(inner)
                        .where(inner.c.place <= limit)
                        .order_by(inner.c.job, inner.c.place)
                    )
                for row in conn.execute(query):
                    job = names.get(row.job)
                    record = None if job is None else _record_or_none(job, row)
                    if record is not None:
                        found[record.job].append(record)
        return found

    def state_counts(self, jobs: Collection[str], since_ms: int) -> dict[State, int]:
        """:meth:`Backend.state_counts` in one statement over the window of
        every job: ``SELECT job, state, count(*) .. WHERE slot_ms >= :since
        GROUP BY job, state``, summed here over ``jobs`` (an ``IN`` list of
        100,000 jobs would not fit one statement; the rows are one per job
        and state in the window, not one per record). No index leads with
        ``slot_ms`` (the key is ``(job, slot_ms, token)``): the statement
        reads every kept record of the table.

        Raises:
            BackendUnavailable: no answer.
        """
        runs = self._tables.runs
        keys = {key_of(job) for job in jobs}
        query = (
            sa.select(runs.c.job, runs.c.state, sa.func.count())
            .where(runs.c.slot_ms >= since_ms)
            .group_by(runs.c.job, runs.c.state)
        )
        counts: dict[State, int] = {}
        with self._read("count history by state") as conn:
            for job, state, count in conn.execute(query):
                known = _STATES.get(state)
                if job in keys and known is not None:
                    counts[known] = counts.get(known, 0) + int(count)
        return counts

    def jobs_with_state(
        self, jobs: Collection[str], states: Collection[State], since_ms: int
    ) -> set[str]:
        """:meth:`Backend.jobs_with_state` in one statement: ``SELECT
        DISTINCT job .. WHERE state IN (..) AND slot_ms >= :since``, kept
        here to ``jobs``; it reads every kept record of the table, as
        :meth:`state_counts` does.

        Raises:
            BackendUnavailable: no answer.
        """
        wanted = sorted({State(state).value for state in states})
        if not wanted:
            return set()
        runs = self._tables.runs
        names = {key_of(job): job for job in jobs}
        query = (
            sa.select(runs.c.job)
            .where(runs.c.state.in_(wanted), runs.c.slot_ms >= since_ms)
            .distinct()
        )
        with self._read("read jobs by state") as conn:
            return {names[key] for (key,) in conn.execute(query) if key in names}

    def last_slots(self, jobs: Sequence[str]) -> dict[str, int]:
        """``job -> newest scheduled slot with a record`` for each of
        ``jobs`` that has one: ``SELECT job, max(slot_ms) .. WHERE job IN
        (..) AND manual_key IS NULL GROUP BY job``, one query per
        :data:`INSERT_CHUNK` jobs (see :meth:`Backend.last_slots`).

        Raises:
            BackendUnavailable: no answer.
        """
        runs = self._tables.runs
        names = {key_of(job): job for job in jobs}
        keys = list(names)
        found: dict[str, int] = {}
        with self._read("read last slots") as conn:
            for start in range(0, len(keys), INSERT_CHUNK):
                query = (
                    sa.select(runs.c.job, sa.func.max(runs.c.slot_ms))
                    .where(
                        runs.c.job.in_(keys[start : start + INSERT_CHUNK]),
                        runs.c.manual_key.is_(None),
                    )
                    .group_by(runs.c.job)
                )
                for job, slot in conn.execute(query):
                    if job in names and slot is not None:
                        found[names[job]] = int(slot)
        return found

    def _after_writes(self, writes: Iterable[tuple[str, int, int]]) -> None:
        """Count writes per job key and trim the histories now due (see the
        class docstring); ``writes`` holds ``(job key, history_size,
        history_ttl_ms)``. A job is first trimmed at a write between its
        ``every``-th and ``2 * every - 1``-th (at an offset of its own),
        then at every ``every``-th: jobs written together (a burst) are
        trimmed in different rounds, and a new job's first writes never are.
        Once :meth:`housekeep` has been called, due trims wait for its next
        call: at most :data:`MAX_DEFERRED_TRIMS` jobs for at most
        :data:`MAX_TRIM_WAIT_S` seconds; a write that finds more, or older,
        trims those itself. A failed trim is logged, never raised."""
        due: dict[str, tuple[int, int]] = {}
        for job, size, ttl_ms in writes:
            every = _trim_every(size)
            count = self._writes.get(job, 0) + 1
            self._writes[job] = count
            offset = int.from_bytes(hashlib.blake2b(job.encode(), digest_size=4).digest())
            if count >= every and (count + offset) % every == 0:
                due[job] = (size, ttl_ms)
        if not due:
            return
        if not self._housekept:
            self._trim_now(due)
            return
        now = time.monotonic()
        for job, (size, ttl_ms) in due.items():
            waiting = self._trims_due.get(job)
            self._trims_due[job] = (size, ttl_ms, waiting[2] if waiting else now)
        # Oldest first (a job keeps its place while it waits): the overdue
        # and the excess are at the head.
        overdue = itertools.takewhile(
            lambda job: now - self._trims_due[job][2] > MAX_TRIM_WAIT_S, self._trims_due
        )
        count = max(len(list(overdue)), len(self._trims_due) - MAX_DEFERRED_TRIMS)
        if count > 0:
            oldest = list(itertools.islice(self._trims_due, count))
            self._trim_now({job: self._trims_due.pop(job)[:2] for job in oldest})

    def housekeep(self, budget_s: float = 0.5) -> None:
        """Run the history trims that writes left due, for about
        ``budget_s`` seconds at most (one transaction per
        :data:`TRIM_CHUNK` jobs); the rest wait for the next call. From the
        first call on, writes leave their trims to this method instead of
        trimming in their own call (see :meth:`Backend.housekeep`). Never
        raises: a failed trim is logged and kept for the next call."""
        self._housekept = True
        deadline = time.monotonic() + budget_s
        while self._trims_due and time.monotonic() < deadline:
            jobs = list(itertools.islice(self._trims_due, TRIM_CHUNK))
            chunk = {job: self._trims_due.pop(job) for job in jobs}
            if not self._trim_now({job: waiting[:2] for job, waiting in chunk.items()}):
                self._trims_due.update(chunk)
                return

    def _trim_now(self, due: dict[str, tuple[int, int]]) -> bool:
        """Trim the histories of ``due`` (``job key -> (history_size,
        history_ttl_ms)``) in one transaction; False (logged) when it failed."""
        try:
            with self._write("trim history") as conn:
                now = self._now(conn)
                for job, (size, ttl_ms) in sorted(due.items()):
                    self._trim(conn, job, size, ttl_ms, now)
        except BackendUnavailable as exc:
            logger.warning("anarchon: history trim failed, retried later: %s", exc)
            return False
        return True

    def _trim(self, conn: Connection, job: str, size: int, ttl_ms: int, now: int) -> None:
        """Delete ``job``'s records with a slot before ``now - ttl_ms`` or
        beyond the newest ``size``, unless ``keep_until_ms`` is after ``now``;
        then the manual keys whose run is gone and whose keep-until passed."""
        runs, manual = self._tables.runs, self._tables.manual
        cut = conn.execute(
            sa.select(runs.c.slot_ms)
            .where(runs.c.job == job)
            .order_by(runs.c.slot_ms.desc(), runs.c.token.desc())
            .offset(max(size, 0))
            .limit(1)
        ).scalar()
        old = runs.c.slot_ms < now - ttl_ms
        if cut is not None:
            old = sa.or_(old, runs.c.slot_ms <= cut)
        conn.execute(sa.delete(runs).where(runs.c.job == job, runs.c.keep_until_ms <= now, old))
        has_run = (
            sa.select(runs.c.token)
            .where(runs.c.job == manual.c.job, runs.c.slot_ms == manual.c.slot_ms)
            .exists()
        )
        conn.execute(
            sa.delete(manual).where(
                manual.c.job == job, manual.c.keep_until_ms <= now, sa.not_(has_run)
            )
        )
