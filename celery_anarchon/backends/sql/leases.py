"""The lease operations of the SQL backend: take-over, release, the worker's
heartbeat, and whether claims are still held; and a claim's first record,
which a claim and a take-over both insert."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..base import Claim, ClaimRequest, State
from .dialects import _NOW_SQL, INSERT_CHUNK
from .naming import key_of
from .stored import SQLStored

logger = logging.getLogger(__name__)


def _in_window(request: ClaimRequest, now: int) -> bool:
    """Whether ``request.slot_ms`` lies in ``[now - window_before_ms, now +
    window_after_ms]`` (all epoch ms)."""
    return now - request.window_before_ms <= request.slot_ms <= now + request.window_after_ms


def _lost(job: str, slot_ms: int, reason: str) -> Claim:
    return Claim(job, slot_ms, won=False, token=None, reason=reason)


class _PastDeadline(Exception):
    """Raised inside a claim's transaction to roll it back: the database's
    clock passed a won request's deadline before the commit."""


def _late_or(request: ClaimRequest, answer: Claim) -> Claim:
    """A won answer of a transaction rolled back for its deadline, as lost
    with ``"deadline"``; any other answer as it is."""
    return _lost(request.job, request.slot_ms, "deadline") if answer.won else answer


#: PostgreSQL: the last statement of a claim's transaction reads the clock
#: and, when the deadline ``:d`` (epoch ms) is ahead, lets the session wait
#: for the commit no longer than until then
#: (``idle_in_transaction_session_timeout``, for this transaction only):
#: a ``COMMIT`` held up on the way past the deadline finds the session
#: ended by the server, and nothing is committed.
_PG_COMMIT_GUARD = (
    "SELECT n.t, set_config('idle_in_transaction_session_timeout', "
    "CAST(GREATEST(1, :d - n.t) AS text), true) FROM (SELECT {now} AS t) AS n"
)


class SQLLeases(SQLStored):
    """Leases on ``<prefix>runs``: each claim's ``owner``, ``token`` and ``lease_until_ms``."""

    def _commit_by_deadline(
        self, conn: Connection, requests: Sequence[ClaimRequest], answers: Sequence[Claim]
    ) -> None:
        """The last statement of a claim or take-over transaction that won
        something: read the database clock again and raise
        :class:`_PastDeadline` (rolling the transaction back) when it is past
        the earliest deadline of the won requests. On PostgreSQL it also
        bounds the wait for the commit by that deadline (see
        :data:`_PG_COMMIT_GUARD`). Nothing on SQLite (no deadlines)."""
        deadlines = [
            r.deadline_ms for r, a in zip(requests, answers, strict=True) if a.won and r.deadline_ms
        ]
        if not deadlines or self.kind == "sqlite":
            return
        deadline = min(deadlines)
        if self.kind == "postgresql":
            guard = sa.text(_PG_COMMIT_GUARD.format(now=_NOW_SQL["postgresql"]))
            now = int(conn.execute(guard, {"d": deadline}).scalar_one())
        else:
            now = self._now(conn)
        if now > deadline:
            raise _PastDeadline()

    def _claim_row(self, req: ClaimRequest, now: int, token: int) -> dict[str, Any]:
        return {
            "job": key_of(req.job),
            "slot_ms": req.slot_ms,
            "token": token,
            "state": State.CLAIMED.value,
            "owner": self.instance,
            "lease_until_ms": now + req.lease_ms,
            "keep_until_ms": req.keep_until_ms,
            "claimed_at_ms": now,
        }

    def _take_over(self, conn: Connection, request: ClaimRequest) -> Claim:
        runs = self._tables.runs
        job = key_of(request.job)
        now = self._now(conn)
        if not _in_window(request, now):
            return _lost(request.job, request.slot_ms, "window")
        current = self._current_record(conn, job, request.slot_ms)
        if current is None:
            won = self._insert_if_absent(conn, runs, self._claim_row(request, now, token=1))
            return self._answer(request, won, token=1)
        keep_until_ms = max(request.keep_until_ms, int(current.keep_until_ms))
        scheduled_claim = current.state == State.CLAIMED.value and current.manual_key is None
        if scheduled_claim and (current.lease_until_ms or 0) >= now:
            return _lost(request.job, request.slot_ms, "held")
        if not scheduled_claim or not self._supersede(conn, current, now, keep_until_ms):
            return _lost(request.job, request.slot_ms, "taken")
        row = self._claim_row(request, now, token=int(current.token) + 1)
        row["keep_until_ms"] = keep_until_ms
        conn.execute(sa.insert(runs), row)
        return self._answer(request, True, token=row["token"])

    def take_over_many(self, requests: Sequence[ClaimRequest]) -> list[Claim]:
        """Take over slots whose winner's lease ran out (backup runner), in
        one transaction: one ``SELECT`` of the slots' current records (per
        :data:`INSERT_CHUNK`) answers every slot already sent, or with a
        live lease, at once. Each of the rest (no record, or ``claimed`` with
        an expired lease) is read again ``FOR UPDATE``; when it is a
        scheduled run still ``claimed`` with ``lease_until_ms`` before the
        database's now, it is updated to ``superseded`` fenced by its
        token, state and lease, and token ``old + 1`` owned by this instance
        is inserted (``keep_until_ms`` the later of the two). A slot with no
        record is claimed as by :meth:`claim`.

        Returns:
            one :class:`Claim` per request, in request order: won with token
            ``old + 1`` (or 1); lost with ``"window"`` outside the claim
            window, ``"held"`` when the record is still ``claimed`` with its
            lease running (its holder, maybe a backup that took it over
            first, may still send it), ``"deadline"`` past the request's
            deadline by the database clock (nothing written), ``"taken"``
            otherwise (sent, or a manual run).
        Raises:
            BackendUnavailable: no answer; treat every request as lost.
        """
        if not requests:
            return []
        requests = self.stamp_deadlines(requests)
        answers: list[Claim] = []
        try:
            with self._write("take over") as conn:
                self._take_over_all(conn, requests, answers)
                self._commit_by_deadline(conn, requests, answers)
        except _PastDeadline:
            answers = [_late_or(r, a) for r, a in zip(requests, answers, strict=True)]
        self._after_writes(
            (key_of(r.job), r.history_size, r.history_ttl_ms)
            for r, a in zip(requests, answers, strict=True)
            if a.won
        )
        return answers

    def _take_over_all(
        self, conn: Connection, requests: Sequence[ClaimRequest], answers: list[Claim]
    ) -> None:
        now = self._now(conn)
        keys = [(key_of(r.job), r.slot_ms) for r in requests]
        current = self._current_records(conn, keys)
        for request, key in zip(requests, keys, strict=True):
            row = current.get(key)
            if request.past_deadline(now):
                answers.append(_lost(request.job, request.slot_ms, "deadline"))
            elif row is None:
                answers.append(self._take_over(conn, request))
            elif row.state != State.CLAIMED.value or row.manual_key is not None:
                answers.append(_lost(request.job, request.slot_ms, "taken"))
            elif (row.lease_until_ms or 0) >= now:
                answers.append(_lost(request.job, request.slot_ms, "held"))
            else:
                answers.append(self._take_over(conn, request))

    def holding(self, claims: Sequence[Claim], margin_ms: int = 0) -> list[bool]:
        """Whether each claim is still held, from one ``SELECT`` of the
        slots' current records (per :data:`INSERT_CHUNK`) and the database
        clock (see :meth:`Backend.holding`).

        Raises:
            BackendUnavailable: no answer.
        """
        asked = [c for c in claims if c.won and isinstance(c.token, int)]
        if not asked:
            return [False] * len(claims)
        with self._read("read leases") as conn:
            now = self._now(conn)
            current = self._current_records(
                conn, [(key_of(c.job), c.slot_ms) for c in asked], lock=False
            )
        answers = []
        for claim in claims:
            row = current.get((key_of(claim.job), claim.slot_ms))
            answers.append(
                claim.won
                and row is not None
                and int(row.token) == claim.token
                and row.state == State.CLAIMED.value
                and (row.lease_until_ms or 0) > now + margin_ms
            )
        return answers

    def _current_records(
        self, conn: Connection, keys: Sequence[tuple[str, int]], *, lock: bool = False
    ) -> dict[tuple[str, int], Any]:
        """The current (highest-token) record of each ``(job key, slot_ms)``
        that has one, one ``SELECT`` per :data:`INSERT_CHUNK` keys."""
        runs = self._tables.runs
        found: dict[tuple[str, int], Any] = {}
        unique = sorted(set(keys))
        for start in range(0, len(unique), INSERT_CHUNK):
            chunk = unique[start : start + INSERT_CHUNK]
            query = sa.select(runs).where(sa.tuple_(runs.c.job, runs.c.slot_ms).in_(chunk))
            if lock:
                query = query.with_for_update()
            for row in conn.execute(query):
                key = (row.job, int(row.slot_ms))
                if key not in found or int(row.token) > int(found[key].token):
                    found[key] = row
        return found

    def _current_record(self, conn: Connection, job: str, slot_ms: int) -> Any:
        runs = self._tables.runs
        query = (
            sa.select(runs)
            .where(runs.c.job == job, runs.c.slot_ms == slot_ms)
            .order_by(runs.c.token.desc())
            .limit(1)
            .with_for_update()
        )
        return conn.execute(query).first()

    def _supersede(self, conn: Connection, current: Any, now: int, keep_until_ms: int) -> bool:
        """Mark ``current`` superseded, fenced by its token, state and lease;
        whether it changed (one row)."""
        runs = self._tables.runs
        fenced = (
            sa.update(runs)
            .where(
                runs.c.job == current.job,
                runs.c.slot_ms == current.slot_ms,
                runs.c.token == current.token,
                runs.c.state == State.CLAIMED.value,
                runs.c.lease_until_ms < now,
            )
            .values(state=State.SUPERSEDED.value, keep_until_ms=keep_until_ms)
        )
        return conn.execute(fenced).rowcount == 1

    @staticmethod
    def _answer(request: ClaimRequest, won: bool, token: int) -> Claim:
        if won:
            return Claim(request.job, request.slot_ms, won=True, token=token)
        return _lost(request.job, request.slot_ms, "taken")

    def release(self, claims: Sequence[Claim]) -> None:
        """Give back won claims that were not sent, in one transaction.

        A first record (token 1) still ``claimed`` with the claim's token is
        deleted, so any instance can claim the slot at once. A record that
        came from a takeover (token above 1) cannot be deleted without
        reopening its superseded predecessor's key, so its lease is ended
        instead (``lease_until_ms = 0``): :meth:`take_over_many` then wins it at
        once. Records already sent, or with another token, are left alone.

        Raises:
            BackendUnavailable: no answer.
        """
        mine = [c for c in claims if c.won and isinstance(c.token, int)]
        if not mine:
            return
        runs = self._tables.runs
        with self._write("release") as conn:
            for claim in mine:
                fenced = (
                    runs.c.job == key_of(claim.job),
                    runs.c.slot_ms == claim.slot_ms,
                    runs.c.token == claim.token,
                    runs.c.state == State.CLAIMED.value,
                )
                if claim.token == 1:
                    deleted = conn.execute(sa.delete(runs).where(*fenced)).rowcount
                    if deleted == 1:  # a run limit's count gives the released run back
                        won = self._tables.won
                        conn.execute(
                            sa.update(won)
                            .where(won.c.job == key_of(claim.job), won.c.won > 0)
                            .values(won=won.c.won - 1)
                        )
                else:
                    conn.execute(sa.update(runs).where(*fenced).values(lease_until_ms=0))
        logger.debug("anarchon: released %d claim(s)", len(mine))

    def extend(self, claim: Claim, lease_ms: int, *, restart: bool = False) -> bool:
        """Extend a running run's lease (the worker's heartbeat) with one
        fenced ``UPDATE .. SET lease_until_ms = <now> + lease_ms WHERE job,
        slot_ms, token = claim.token AND state = 'running'``; ``lease_ms`` in
        milliseconds, ``<now>`` the database clock.

        ``restart=True`` adds ``AND lease_until_ms < <now>`` and sets
        ``started_at_ms = <now>``: an ``acks_late`` redelivery takes over a
        run whose worker stopped heartbeating (see :meth:`Backend.extend`).
        Concurrent calls queue on the row lock; one restart wins.

        Returns:
            True when one row was written, else False.
        Raises:
            BackendUnavailable: no answer.
        """
        if not claim.won or not isinstance(claim.token, int):
            return False
        runs = self._tables.runs
        now = self._now_expr()
        fenced = [
            runs.c.job == key_of(claim.job),
            runs.c.slot_ms == claim.slot_ms,
            runs.c.token == claim.token,
            runs.c.state == State.RUNNING.value,
        ]
        values: dict[str, Any] = {"lease_until_ms": now + int(lease_ms)}
        if restart:
            fenced.append(sa.or_(runs.c.lease_until_ms.is_(None), runs.c.lease_until_ms < now))
            values["started_at_ms"] = now
        with self._write("extend") as conn:
            changed = conn.execute(sa.update(runs).where(*fenced).values(values)).rowcount
            if changed == 0 and self.kind == "mysql" and not restart:
                # MySQL counts changed rows: a heartbeat repeated in the same
                # millisecond changes none.
                changed = len(conn.execute(sa.select(runs.c.token).where(*fenced)).all())
        return changed == 1
