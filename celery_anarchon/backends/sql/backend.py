"""The SQL backend: claims, take-over, state moves and ``run_now``; the
connection, dialects, history and registry are the layers it stands on."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from ...exceptions import BackendUnavailable, ConfigurationError
from ..base import AbsentRecord, Claim, ClaimRequest, State
from .connection import _parse_url, _seconds
from .dialects import INSERT_CHUNK
from .leases import SQLLeases, _in_window, _late_or, _lost, _PastDeadline
from .naming import _clean, _kind_of, _prefix, _tables, key_of

__all__ = ["SQLBackend"]

logger = logging.getLogger(__name__)


#: Most candidate milliseconds a manual run tries before giving up.
MANUAL_SLOT_TRIES = 100

#: The ``<prefix>manual`` key of a job's run-now guard: ``run_now`` refuses
#: an empty key, so no manual run ever uses it.
GUARD_KEY = ""


class SQLBackend(SQLLeases):
    """Lease backend on SQLite, PostgreSQL or MySQL/MariaDB (SQLAlchemy Core).

    Construct with a URL (``sqlite:///path``, ``postgresql://`` or
    ``postgres://`` (psycopg 3), ``postgresql+psycopg://``, ``mysql://``,
    ``mysql+pymysql://``, ``mariadb://``: MySQL and MariaDB go through
    PyMySQL) or with ``client=`` an SQLAlchemy :class:`~sqlalchemy.engine.Engine`
    the user owns (then :meth:`close` never disposes it). Nothing connects
    before :meth:`open`, which creates the tables (see the :mod:`celery_anarchon.backends.sql`
    docstring)
    if missing; several processes may do so at once.

    Guarantees, and the statement that gives each:

    * **One winner per slot.** A claim is one conditional insert of the slot's
      first record (token 1) on the key ``(job, slot_ms, token)``: SQLite and
      PostgreSQL ``INSERT .. ON CONFLICT DO NOTHING RETURNING job, slot_ms``,
      one multi-row statement for a batch (PostgreSQL: rows from
      ``unnest`` of one array per column, see
      :meth:`_insert_claims_postgresql`); MySQL/MariaDB ``INSERT .. ON
      DUPLICATE KEY UPDATE job = job``, won when it affected one row (a batch
      goes as one multi-row statement when all or none of it is won, see
      :meth:`_insert_claims_mysql`). A no-op update affects 0 rows only
      without ``CLIENT_FOUND_ROWS``, which SQLAlchemy always sets: engines
      made here strip it, and :meth:`open` refuses a user's MySQL Engine
      that has it (strip it in a ``do_connect`` listener:
      ``cparams["client_flag"] &= ~2``). A batch is one transaction,
      inserted in key order so concurrent batches never deadlock.
    * **Claim window by the database clock**: PostgreSQL ``clock_timestamp()``,
      MySQL ``UTC_TIMESTAMP(6)``; SQLite has no server, so this process's
      clock (SQLite serves one host). A slot outside ``[now -
      window_before_ms, now + window_after_ms]`` is lost with ``"window"``.
    * **Fencing and forward-only states**: :meth:`mark` is ``UPDATE ..
      WHERE job, slot_ms, token = :token AND state IN (<states it may move
      from>)``, so a superseded record never changes and ``running`` is
      entered once (the worker's start gate).
    * **Takeover** (:meth:`take_over_many`): in one transaction, ``UPDATE .. SET
      state = 'superseded' WHERE token = :old AND state = 'claimed' AND
      lease_until_ms < now`` and, when that changed one row, insert token
      ``old + 1``.
    * **A late claim claims nothing**: each claim and take-over carries a
      deadline in the database's time (:meth:`stamp_deadlines`); the
      transaction reads the clock first and again just before ``COMMIT``
      (PostgreSQL: with ``idle_in_transaction_session_timeout`` set to the
      time left, so a held-up ``COMMIT`` commits nothing) and, past it,
      rolls back and answers ``"deadline"``. SQLite: no deadline.
    * **run_now once per key**: a conditional insert into ``<prefix>manual``
      on ``(job, manual_key)`` in the transaction that writes the run.
    * **Records outlive every late claimer**: trimming deletes only records
      whose ``keep_until_ms`` has passed (by the database clock).
    * **Short waits**: ``connect_timeout`` bounds connecting (PostgreSQL:
      at least 2 s, libpq's minimum; MySQL: the TCP connect, the server's
      greeting then waits up to ``statement_timeout``) and
      ``statement_timeout`` each statement (PostgreSQL ``statement_timeout``
      and ``tcp_user_timeout``; MySQL client read/write timeouts and
      ``innodb_lock_wait_timeout``; SQLite busy timeout), and the whole
      call by a watchdog that shuts its socket down ``statement_timeout`` +
      1 s after it began (PostgreSQL, MySQL: a server that never answers).
      Pooled connections
      are pinged before use, so the backend recovers when the database
      comes back. Every driver error is raised as
      :class:`~celery_anarchon.exceptions.BackendUnavailable`. These
      settings apply to engines made here; a user's Engine keeps its own.

    SQLite runs in WAL mode and starts write transactions with ``BEGIN
    IMMEDIATE`` (engines made here), so processes on one host share a file.
    In-memory SQLite is refused: it cannot be shared between processes.
    MySQL engines made here use ``READ COMMITTED``.

    Fork-safe: in a process forked after connecting (a prefork worker), the
    first call gives the engine a fresh pool without closing the parent's
    connections.

    History is trimmed per job after writes, amortised: at every
    ``max(1, history_size // 10)``-th write of the job by this instance
    (at an offset of the job's own, so a burst's jobs are trimmed in
    different rounds; never before that many writes), one ``DELETE``
    removes its records older than
    ``history_ttl_ms`` (by slot) or beyond the newest ``history_size``,
    except those whose ``keep_until_ms`` is ahead; so between trims a job may
    hold up to ``history_size // 10`` records more. A trim runs in the
    writing call, after its transaction, unless the caller does
    housekeeping: once :meth:`housekeep` has been called (the scheduler calls
    it after each registry heartbeat), trims wait for its next call, off the
    claim path. A trim that fails is logged and retried later: it never
    fails the claim.

    Options (``anarchon_backend_options`` or URL query parameters):

    * ``prefix``: table name prefix, default ``anarchon_``;
    * ``connect_timeout``: seconds, default 5;
    * ``statement_timeout``: seconds, default 5.
    """

    supports_leases: ClassVar[bool] = True
    options: ClassVar[frozenset[str]] = frozenset(
        {"prefix", "connect_timeout", "statement_timeout"}
    )

    def __init__(
        self,
        url: str | None,
        *,
        client: Any = None,
        instance: str,
        prefix: str = "anarchon_",
        connect_timeout: float | str | timedelta = 5.0,
        statement_timeout: float | str | timedelta = 5.0,
    ) -> None:
        """Prepare the backend; nothing connects (see :meth:`open`).

        Raises:
            ConfigurationError: no URL nor Engine, a client that is not an
                Engine, an in-memory SQLite URL, an unsupported dialect, or
                a bad option value.
        """
        super().__init__(url, client=client, instance=instance)
        self.prefix = _prefix(prefix)
        self.connect_timeout = _seconds("connect_timeout", connect_timeout)
        self.statement_timeout = _seconds("statement_timeout", statement_timeout)
        self._tables = _tables(self.prefix)
        self._owns_engine = client is None
        self._engine: Engine | None = None
        self._pid = os.getpid()
        self._ready = False
        self._watchdog = None
        self._writes: dict[str, int] = {}
        self._trims_due: dict[str, tuple[int, int, float]] = {}
        self._housekept = False
        self._unnest_stmt: Any = None
        if client is not None:
            if not isinstance(client, Engine):
                raise ConfigurationError(
                    f"anarchon_backend: SQLBackend needs an SQLAlchemy Engine as its client, "
                    f"not a {type(client).__name__}; pass create_engine(url) or the URL."
                )
            self._engine = client
            self._url = client.url
        elif url is None:
            raise ConfigurationError("anarchon_backend: give an SQL URL or an SQLAlchemy Engine.")
        else:
            self._url = _parse_url(url)
        self.kind = _kind_of(self._url.get_backend_name())
        if self.kind not in ("sqlite", "postgresql", "mysql"):
            raise ConfigurationError(
                f"anarchon_backend: {self._url.get_backend_name()!r} databases are not "
                "supported; use SQLite, PostgreSQL or MySQL/MariaDB."
            )

    # -- lifecycle -----------------------------------------------------------

    # -- clock ---------------------------------------------------------------

    # -- claims --------------------------------------------------------------

    def claim(self, requests: Sequence[ClaimRequest]) -> list[Claim]:
        """Claim slots in one transaction (see the class docstring for the
        statements), exactly one winner per ``(job, slot_ms)``.

        Returns:
            one :class:`Claim` per request, in request order: won with token
            1 (record ``claimed``, owner this instance, ``lease_until_ms =
            now + lease_ms``, ``keep_until_ms`` from the request); lost with
            ``"window"`` when outside the claim window by the database clock,
            ``"deadline"`` when the database's clock passed the request's
            deadline before the commit (nothing written), ``"taken"`` when
            the slot has a record (or appears twice in the batch: the first
            wins).
        Raises:
            BackendUnavailable: no answer; treat every request as lost.
        """
        if not requests:
            return []
        requests = self.stamp_deadlines(requests)
        try:
            with self._write("claim") as conn:
                now = self._now(conn)
                answers = self._claim_all(conn, requests, now)
                self._commit_by_deadline(conn, requests, answers)
        except _PastDeadline:
            answers = [_late_or(r, a) for r, a in zip(requests, answers, strict=True)]
        won = [r for r, a in zip(requests, answers, strict=True) if a.won]
        logger.debug("anarchon: claimed %d of %d slot(s)", len(won), len(requests))
        self._after_writes((key_of(r.job), r.history_size, r.history_ttl_ms) for r in won)
        return answers

    def _claim_all(
        self, conn: Connection, requests: Sequence[ClaimRequest], now: int
    ) -> list[Claim]:
        answers: dict[int, Claim] = {}
        rows: dict[tuple[str, int], tuple[int, dict[str, Any]]] = {}
        for i, req in enumerate(requests):
            slot = (key_of(req.job), req.slot_ms)
            if req.past_deadline(now):
                answers[i] = _lost(req.job, req.slot_ms, "deadline")
            elif not _in_window(req, now):
                answers[i] = _lost(req.job, req.slot_ms, "window")
            elif slot in rows:
                answers[i] = _lost(req.job, req.slot_ms, "taken")
            else:
                rows[slot] = (i, self._claim_row(req, now, token=1))
        ordered = [rows[slot] for slot in sorted(rows)]
        counted = [(i, row) for i, row in ordered if requests[i].max_runs is not None]
        if counted:
            for i, row in counted:
                answers[i] = self._claim_counted(conn, requests[i], row)
            ordered = [(i, row) for i, row in ordered if requests[i].max_runs is None]
        claim_rows = [row for _, row in ordered]
        if self.kind == "postgresql" and len(claim_rows) > 1:
            won = self._insert_claims_postgresql(conn, claim_rows)
        else:
            won = self._insert_claims(conn, claim_rows)
        for i, row in ordered:
            req = requests[i]
            if (row["job"], row["slot_ms"]) in won:
                answers[i] = Claim(req.job, req.slot_ms, won=True, token=1)
            else:
                answers[i] = _lost(req.job, req.slot_ms, "taken")
        return [answers[i] for i in range(len(requests))]

    def _claim_counted(self, conn: Connection, req: ClaimRequest, row: dict[str, Any]) -> Claim:
        """Claim one slot of a job with a run limit, in a savepoint: lock
        the job's count row first (every claim of the job queues on it, in
        the batch's sorted order, so two instances cannot both win the
        limit's last run), then insert the claim and count it; at the limit,
        nothing is written and the answer is ``"finished"``. A slot that has
        a record answers ``"taken"`` first, as an unlimited claim does, so
        its loser watches it for a take-over. A released claim's count was
        given back by :meth:`release`."""
        won, runs = self._tables.won, self._tables.runs
        assert req.max_runs is not None
        taken = conn.execute(
            sa.select(runs.c.token)
            .where(runs.c.job == row["job"], runs.c.slot_ms == row["slot_ms"])
            .limit(1)
        ).first()
        if taken is not None:  # answered as an unlimited claim is: its owner may die
            return _lost(req.job, req.slot_ms, "taken")
        savepoint = conn.begin_nested()
        self._insert_if_absent(conn, won, {"job": row["job"], "won": 0})
        count_query = sa.select(won.c.won).where(won.c.job == row["job"])
        if self.kind != "sqlite":
            count_query = count_query.with_for_update()
        count = int(conn.execute(count_query).scalar_one())
        if count >= req.max_runs:
            savepoint.rollback()
            return _lost(req.job, req.slot_ms, "finished")
        if not self._insert_if_absent(conn, runs, row):
            savepoint.rollback()
            return _lost(req.job, req.slot_ms, "taken")
        conn.execute(sa.update(won).where(won.c.job == row["job"]).values(won=count + 1))
        savepoint.commit()
        return Claim(req.job, req.slot_ms, won=True, token=1)

    def won_counts(self, jobs: Sequence[str]) -> dict[str, int]:
        """Each job's count of won claims toward its run limit (0 when none).

        Raises:
            BackendUnavailable: no answer.
        """
        won = self._tables.won
        keys = {key_of(job): job for job in jobs}
        counts = dict.fromkeys(jobs, 0)
        with self._read("read won counts") as conn:
            for start in range(0, len(keys), 500):
                part = list(keys)[start : start + 500]
                for key, value in conn.execute(
                    sa.select(won.c.job, won.c.won).where(won.c.job.in_(part))
                ):
                    counts[keys[key]] = int(value)
        return counts

    # -- states --------------------------------------------------------------

    def mark(
        self,
        claim: Claim,
        state: State,
        *,
        task_id: str | None = None,
        error: str | None = None,
    ) -> bool:
        """Move a won claim's record forward to ``state`` (``sent``,
        ``running``, ``succeeded``, ``failed`` or ``lost``) with one fenced
        ``UPDATE .. WHERE job, slot_ms, token = claim.token AND state IN
        (<states it may move from>)``.

        States only move forward: ``claimed`` < ``sent`` < ``running`` <
        ``succeeded`` / ``failed`` / ``lost``. So ``mark(claim, RUNNING)``
        is the worker's start gate: the first call moves the run and returns
        True, a duplicate delivery's call finds it ``running`` and returns
        False (concurrent calls queue on the row lock and re-check the
        state). A ``sent`` that arrives after the worker moved the run on
        (a late ``sent``) fills in ``sent_at_ms`` and ``task_id``, keeps the
        state, and returns True. The state's timestamp (``sent_at_ms``,
        ``started_at_ms`` or ``finished_at_ms``) becomes the database's now;
        ``task_id`` / ``error`` are written when given.

        Returns:
            False when no current record carries ``claim.token`` (taken over,
            released, trimmed, or the claim was lost), or the move is not
            forward (``claimed`` never is); nothing is written then.
        Raises:
            ValueError: ``state`` is ``missed``, ``skipped`` or
                ``superseded``, which :meth:`record_many_if_absent` and
                :meth:`take_over_many` write, never :meth:`mark`.
            BackendUnavailable: no answer.
        """
        state = State(state)
        if state in (State.MISSED, State.SKIPPED, State.SUPERSEDED):
            raise ValueError(f"mark() cannot record {state.value!r}; see record_many_if_absent()")
        if state is State.CLAIMED or not claim.won or not isinstance(claim.token, int):
            return False
        runs = self._tables.runs
        fenced = (
            runs.c.job == key_of(claim.job),
            runs.c.slot_ms == claim.slot_ms,
            runs.c.token == claim.token,
            runs.c.state.in_(sorted(s.value for s in state.moves_from)),
        )
        with self._write("mark") as conn:
            update = sa.update(runs).where(*fenced).values(self._mark_values(state, task_id, error))
            changed = conn.execute(update).rowcount
            if changed == 0 and self.kind == "mysql":
                # MySQL counts changed rows: a late 'sent' repeated with the
                # same values in the same millisecond changes none.
                changed = len(conn.execute(sa.select(runs.c.token).where(*fenced)).all())
        return changed == 1

    def mark_many(
        self,
        claims: Sequence[Claim],
        state: State,
        *,
        task_ids: Sequence[str | None] | None = None,
    ) -> list[bool]:
        """:meth:`mark` for many claims in one transaction: one ``SELECT ..
        FOR UPDATE`` of the records ``(job, slot_ms, token)`` of the claims
        (per :data:`INSERT_CHUNK`) decides which may move (token present,
        state one it may move from), then one fenced ``UPDATE`` sent with
        ``executemany`` moves them (the rows are locked, so none changes in
        between; SQLite's write transaction is exclusive).

        Returns:
            one answer per claim, in order (see :meth:`mark`).
        Raises:
            ValueError: ``task_ids`` is not as long as ``claims``; ``state``
                is ``missed``, ``skipped`` or ``superseded``.
            BackendUnavailable: no answer; nothing was written.
        """
        ids = [None] * len(claims) if task_ids is None else list(task_ids)
        if len(ids) != len(claims):
            raise ValueError(f"{len(ids)} task ids for {len(claims)} claims")
        state = State(state)
        if state in (State.MISSED, State.SKIPPED, State.SUPERSEDED):
            raise ValueError(f"mark() cannot record {state.value!r}; see record_many_if_absent()")
        asked = {
            (key_of(c.job), c.slot_ms, c.token): i
            for i, c in enumerate(claims)
            if state is not State.CLAIMED and c.won and isinstance(c.token, int)
        }
        answers = [False] * len(claims)
        if not asked:
            return answers
        runs = self._tables.runs
        movable = {s.value for s in state.moves_from}
        with self._write("mark") as conn:
            keys = sorted(asked)
            rows: list[Any] = []
            for start in range(0, len(keys), INSERT_CHUNK):
                chunk = keys[start : start + INSERT_CHUNK]
                where = sa.tuple_(runs.c.job, runs.c.slot_ms, runs.c.token).in_(chunk)
                query = sa.select(runs.c.job, runs.c.slot_ms, runs.c.token, runs.c.state)
                rows.extend(conn.execute(query.where(where).with_for_update()))
            moving = sorted(
                (row.job, int(row.slot_ms), int(row.token)) for row in rows if row.state in movable
            )
            if not moving:
                return answers
            values = self._mark_values(state, None, None)
            values["task_id"] = sa.func.coalesce(
                sa.bindparam("m_task", type_=sa.Text), runs.c.task_id
            )
            update = (
                sa.update(runs)
                .where(
                    runs.c.job == sa.bindparam("m_job"),
                    runs.c.slot_ms == sa.bindparam("m_slot"),
                    runs.c.token == sa.bindparam("m_token"),
                    sa.or_(*(runs.c.state == value for value in sorted(movable))),
                )
                .values(values)
            )
            params = []
            for key in moving:
                i = asked[key]
                task_id = ids[i]
                params.append(
                    {
                        "m_job": key[0],
                        "m_slot": key[1],
                        "m_token": key[2],
                        "m_task": None if task_id is None else _clean(task_id),
                    }
                )
                answers[i] = True
            conn.execute(update, params)
        return answers

    def _mark_values(self, state: State, task_id: str | None, error: str | None) -> dict[str, Any]:
        runs = self._tables.runs
        assert state.stamp is not None  # mark() refused the states without one
        values: dict[str, Any] = {state.stamp: self._now_expr()}
        if state is State.SENT:  # a late 'sent' keeps the state it finds
            values["state"] = sa.case(
                (runs.c.state == State.CLAIMED.value, State.SENT.value), else_=runs.c.state
            )
        else:
            values["state"] = state.value
        if task_id is not None:
            values["task_id"] = _clean(task_id)
        if error is not None:
            values["error"] = _clean(error)
        return values

    def record_many_if_absent(self, records: Sequence[AbsentRecord]) -> list[bool]:
        """Record ``missed`` or ``skipped`` as the first record of each slot
        that has none, closing the slot, in one transaction: the claim's
        multi-row conditional insert (rows in key order; a slot
        twice in ``records`` is written once, its first answer True).

        Returns:
            one answer per record, in order.
        Raises:
            BackendUnavailable: no answer; nothing was written.
        """
        if not records:
            return []
        rows: dict[tuple[str, int], dict[str, Any]] = {}
        for r in records:
            rows.setdefault((key_of(r.job), r.slot_ms), self._absent_row(r))
        with self._write("record") as conn:
            written = self._insert_claims(conn, [rows[slot] for slot in sorted(rows)])
        answers = []
        for r in records:
            slot = (key_of(r.job), r.slot_ms)
            answers.append(slot in written)
            written.discard(slot)
        self._after_writes(
            (key_of(r.job), r.history_size, r.history_ttl_ms)
            for r, answer in zip(records, answers, strict=True)
            if answer
        )
        return answers

    def _absent_row(self, r: AbsentRecord) -> dict[str, Any]:
        return {
            "job": key_of(r.job),
            "slot_ms": r.slot_ms,
            "token": 1,
            "state": State(r.state).value,
            "owner": self.instance,
            "keep_until_ms": r.keep_until_ms,
            "error": None if r.error is None else _clean(r.error),
        }

    # -- run_now -------------------------------------------------------------

    def claim_manual(self, job: str, key: str, keep_until_ms: int) -> Claim:
        """Claim a manual run (``run_now``) of ``job`` under ``key``.

        One transaction: the conditional insert of ``(job, key)`` into
        ``<prefix>manual`` (the same statement as a claim's); when that key
        exists, the call is lost. Otherwise the run record (state
        ``claimed``, token 1, ``manual_key = key``, lease until
        ``keep_until_ms``) goes to the first free millisecond from the
        database's now, skipping whole seconds, where nearly every scheduled
        slot falls (cron, whole-second intervals), so a manual run
        practically never takes a scheduled slot. The key row comes first:
        racers for one key then queue on that one row, and never hold a run
        row while waiting (MariaDB found deadlocks in the other order). The
        key is kept while its run record is, and at least until
        ``keep_until_ms``.

        Returns:
            won with the run's ``slot_ms`` and token 1; or lost (``"taken"``)
            with the slot of the run that used the key.
        Raises:
            BackendUnavailable: no answer (or no free millisecond in
                :data:`MANUAL_SLOT_TRIES`).
        """
        manual = self._tables.manual
        this_key = (manual.c.job == key_of(job), manual.c.manual_key == key_of(key))
        with self._write("claim a manual run") as conn:
            now = self._now(conn)
            guard = {
                "job": key_of(job),
                "manual_key": key_of(key),
                "slot_ms": now,
                "keep_until_ms": keep_until_ms,
            }
            if not self._insert_if_absent(conn, manual, guard):
                used = conn.execute(sa.select(manual.c.slot_ms).where(*this_key)).scalar()
                return _lost(job, now if used is None else int(used), "taken")
            slot = self._insert_manual_run(conn, job, key, now, keep_until_ms)
            if slot != now:
                conn.execute(sa.update(manual).where(*this_key).values(slot_ms=slot))
        logger.debug("anarchon: manual run of %r under key %r claimed", job, key)
        return Claim(job, slot, won=True, token=1)

    def take_run_now_guard(self, job: str, hold_ms: int) -> bool:
        """Take the guard: the ``<prefix>manual`` row of ``(job, '')`` (a key
        ``run_now`` refuses), held until its ``keep_until_ms``.

        One transaction: insert the row if absent, else
        ``UPDATE .. SET keep_until_ms = now + hold_ms WHERE keep_until_ms
        <= now``; taken when a row was written (by the database clock). A
        racer waits on the row lock and then finds the guard held.

        Raises:
            BackendUnavailable: no answer.
        """
        manual = self._tables.manual
        with self._write("take the run-now guard") as conn:
            now = self._now(conn)
            row = {
                "job": key_of(job),
                "manual_key": GUARD_KEY,
                "slot_ms": now,
                "keep_until_ms": now + hold_ms,
            }
            if self._insert_if_absent(conn, manual, row):
                return True
            freed = conn.execute(
                sa.update(manual)
                .where(
                    manual.c.job == key_of(job),
                    manual.c.manual_key == GUARD_KEY,
                    manual.c.keep_until_ms <= now,
                )
                .values(slot_ms=now, keep_until_ms=now + hold_ms),
                execution_options={"preserve_rowcount": True},
            )
            return bool(freed.rowcount == 1)

    def _insert_manual_run(
        self, conn: Connection, job: str, key: str, now: int, keep_until_ms: int
    ) -> int:
        row: dict[str, Any] = {
            "job": key_of(job),
            "token": 1,
            "state": State.CLAIMED.value,
            "owner": self.instance,
            "lease_until_ms": keep_until_ms,
            "keep_until_ms": keep_until_ms,
            "claimed_at_ms": now,
            "manual_key": _clean(key),
        }
        slot = now
        for _ in range(MANUAL_SLOT_TRIES):
            if slot % 1000 == 0:
                slot += 1
            if self._insert_if_absent(conn, self._tables.runs, {**row, "slot_ms": slot}):
                return slot
            slot += 1
        raise BackendUnavailable(
            f"{self.describe()}: no free millisecond for a manual run of {job!r} "
            f"within {MANUAL_SLOT_TRIES} ms of now"
        )

    # -- history -------------------------------------------------------------

    # -- instance registry ---------------------------------------------------

    # -- trimming ------------------------------------------------------------

    # -- SQL helpers ---------------------------------------------------------

    # -- connections and errors ----------------------------------------------
