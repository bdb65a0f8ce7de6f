"""The backend contract: what every backend does, and what a lease backend
does besides.

:class:`Backend` is the claim contract every backend (SQL, Redis, RabbitMQ)
implements. It is small, batched, and each call is atomic on the backend:

* :meth:`Backend.claim` -- take slots, one winner per ``(job, slot)``;
* :meth:`Backend.mark_many` (and :meth:`Backend.mark` for one claim, the
  worker's start gate) -- move claimed runs to a later state (``sent``,
  ``running``, ``succeeded``, ``failed``, ``lost``), checked against each
  claim's fencing token;
* :meth:`Backend.record_many_if_absent` -- write ``missed`` or ``skipped``
  for slots nobody acted on;
* :meth:`Backend.history`, :meth:`Backend.last_run`,
  :meth:`Backend.last_slots` -- read per-job history;
  :meth:`Backend.history_many` -- the history of many jobs at once;
  :meth:`Backend.state_counts`, :meth:`Backend.jobs_with_state` -- counts
  by state, and the jobs with a state, over many jobs in a window;
* :meth:`Backend.claim_manual` -- the claim behind ``run_now``;
* :meth:`Backend.register` and the other registry calls -- the live
  instances.

:class:`LeaseBackend` (SQL, Redis) keeps an owner, a fencing token and a
lease expiry per claim, judges time by the backend's own clock, and refuses
a slot outside the claim window ``[now - window_before_ms, now +
window_after_ms]``. Its lease operations are apart from the claim contract:

* :meth:`LeaseBackend.take_over_many` -- take over slots whose lease ended
  (backup runner);
* :meth:`LeaseBackend.release` -- give back claimed, unsent slots
  (hand-over);
* :meth:`LeaseBackend.extend` -- heartbeat a running run's lease (worker);
* :meth:`LeaseBackend.holding` -- read whether claims are still held.

A claim-only backend (RabbitMQ) gives one winner per slot and nothing more.

The state rules (which timestamp each state stamps, which moves go forward)
live once, on :class:`State`. Times crossing the contract are integer
milliseconds since the Unix epoch (UTC). Durations are integer milliseconds
and say so in their names (``_ms``).
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import math
import time
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, ClassVar

__all__ = [
    "AbsentRecord",
    "Backend",
    "Claim",
    "ClaimRequest",
    "InstanceInfo",
    "LeaseBackend",
    "RunRecord",
    "State",
    "DEADLINE_SHARE",
    "FINAL_RANK",
    "FINISHED_STATES",
    "OFFSET_REFRESH_S",
    "SENT_STATES",
]


class State(str, enum.Enum):
    """States of a run in history (``docs/how-it-works.md``, "Leases and
    fencing tokens")."""

    #: Held by an instance, not yet sent.
    CLAIMED = "claimed"
    #: ``apply_async`` returned.
    SENT = "sent"
    #: A worker started it (worker integration).
    RUNNING = "running"
    #: A worker finished it without error (worker integration).
    SUCCEEDED = "succeeded"
    #: A worker finished it with an error (worker integration).
    FAILED = "failed"
    #: Nobody sent it within ``max_late``.
    MISSED = "missed"
    #: Not sent because of the overlap policy.
    SKIPPED = "skipped"
    #: Claimed, outcome unknown (lost confirm, send failed, worker died).
    LOST = "lost"
    #: A backup runner took the slot over from this claim.
    SUPERSEDED = "superseded"

    def __str__(self) -> str:
        return self.value

    # The state rules, here once for every backend (the SQL statements, the
    # Redis Lua scripts, which get RANK rendered from :attr:`rank`, and the
    # RabbitMQ history fold all read them).

    @property
    def stamp(self) -> str | None:
        """The :class:`RunRecord` timestamp a move to this state sets to the
        backend's now: ``sent_at_ms`` for SENT, ``started_at_ms`` for
        RUNNING, ``finished_at_ms`` for SUCCEEDED, FAILED and LOST; None for
        the states :meth:`Backend.mark` never writes."""
        return _STAMPS.get(self)

    @property
    def rank(self) -> int:
        """This state's place in the forward order of a run: ``claimed`` 0 <
        ``sent`` 1 < ``running`` 2 < 3 for every state nothing moves on from
        (``succeeded``, ``failed``, ``lost``; and ``superseded``,
        ``missed``, ``skipped``, which only take-over and the miss records
        write). A mark moves a run only to a higher rank."""
        return _RANKS.get(self, FINAL_RANK)

    @property
    def moves_from(self) -> frozenset[State]:
        """The states :meth:`Backend.mark` moves a run to this state from:
        those of a lower rank that a mark may touch (``claimed``, ``sent``,
        ``running``); for SENT also ``sent`` and the finished states, where
        it is a late ``sent`` that only fills in ``sent_at_ms`` and
        ``task_id`` and keeps the state. Empty for the states a mark never
        writes (``claimed``, ``missed``, ``skipped``, ``superseded``)."""
        if self not in _STAMPS:
            return frozenset()
        markable = frozenset(_RANKS) | FINISHED_STATES
        if self is State.SENT:
            return markable
        return frozenset(s for s in markable if s.rank < self.rank)


#: :attr:`State.rank` of the states a run moves forward through; every other
#: state has :data:`FINAL_RANK`.
_RANKS = {State.CLAIMED: 0, State.SENT: 1, State.RUNNING: 2}
#: The rank of a state nothing moves on from.
FINAL_RANK = 3
#: States that end a run a worker or the scheduler finished.
FINISHED_STATES = frozenset({State.SUCCEEDED, State.FAILED, State.LOST})
_STAMPS = {
    State.SENT: "sent_at_ms",
    State.RUNNING: "started_at_ms",
    **dict.fromkeys(FINISHED_STATES, "finished_at_ms"),
}

#: States of a run that really went to the broker.
SENT_STATES = frozenset({State.SENT, State.RUNNING, State.SUCCEEDED, State.FAILED})


#: A claim's deadline is this share of the backend's client timeout after
#: it is sent (:meth:`Backend.stamp_deadlines`): a request the backend runs
#: by then leaves the rest of the timeout for its answer to come back.
DEADLINE_SHARE = 0.8

#: How often a backend measures the offset of its clock to this process's
#: again, seconds (:meth:`Backend.clock_offset_ms`).
OFFSET_REFRESH_S = 60.0


@dataclass(frozen=True)
class ClaimRequest:
    """One slot an instance wants to claim.

    Attributes:
        job: the job's name (the ``beat_schedule`` key), as the user wrote it.
        slot_ms: the slot's fire time, epoch milliseconds (UTC).
        window_before_ms: ``max_late + jitter`` in milliseconds; a lease backend
            refuses the slot when ``slot_ms < backend_now - window_before_ms``.
        window_after_ms: ``max_skew`` in milliseconds; a lease backend refuses
            the slot when ``slot_ms > backend_now + window_after_ms``.
        keep_until_ms: absolute epoch milliseconds before which the claim
            record must not be forgotten (no late instance can try the slot
            after it): ``slot + jitter + max_late + max_skew`` plus a margin.
        lease_ms: how long the claim's lease lasts, from the backend's now,
            before a backup runner may take the slot over (lease backends).
        history_size: most history records to keep for this job.
        history_ttl_ms: history records older than this (by slot) may go.
        deadline_ms: the last instant, epoch milliseconds by the *backend's*
            clock, at which the request may still take effect; a lease
            backend that gets it later claims nothing and answers
            ``"deadline"``. None: the backend stamps it when it sends the
            request (:meth:`Backend.stamp_deadlines`: sent time plus a share
            of its client timeout, in its own time); 0: no deadline.
        max_runs: the job's cluster-wide run limit, or None: a lease
            backend wins the claim only while the job's count of won claims
            is below it, and counts the win in the same atomic step;
            otherwise it answers ``"finished"`` (take-overs and manual runs
            do not count; a claim later recorded ``lost`` is not given back).
    """

    job: str
    slot_ms: int
    window_before_ms: int
    window_after_ms: int
    keep_until_ms: int
    lease_ms: int = 60_000
    history_size: int = 100
    history_ttl_ms: int = 7 * 24 * 3600 * 1000
    deadline_ms: int | None = None
    max_runs: int | None = None

    def past_deadline(self, backend_now_ms: int) -> bool:
        """Whether ``backend_now_ms`` (the backend's clock, epoch ms) is past
        this request's deadline (never when it has none)."""
        return bool(self.deadline_ms) and backend_now_ms > (self.deadline_ms or 0)


@dataclass(frozen=True)
class AbsentRecord:
    """One ``missed`` or ``skipped`` record to write where the slot has none
    (:meth:`Backend.record_many_if_absent`).

    Attributes:
        job: the job's name.
        slot_ms: the slot, epoch milliseconds (UTC).
        state: ``missed`` or ``skipped``.
        error: why, for history (``None``: no text).
        history_size: most history records to keep for this job.
        history_ttl_ms: history records older than this (by slot) may go.
        keep_until_ms: absolute epoch milliseconds until which the slot
            stays closed (as :attr:`ClaimRequest.keep_until_ms`).
    """

    job: str
    slot_ms: int
    state: State
    error: str | None = None
    history_size: int = 100
    history_ttl_ms: int = 7 * 24 * 3600 * 1000
    keep_until_ms: int = 0


@dataclass(frozen=True)
class Claim:
    """The answer to one :class:`ClaimRequest` (or a manual claim).

    Attributes:
        job: the job's name.
        slot_ms: the slot, epoch milliseconds (UTC).
        won: True when this instance holds the slot and must send it.
        token: the fencing token when won (an integer, larger for each
            takeover of the same slot; a string on claim-only backends);
            None when lost.
        reason: why the claim was lost: ``"taken"`` (another instance holds
            or held it), ``"held"`` (:meth:`Backend.take_over_many` only: the
            slot is still ``claimed`` and its lease has not ended),
            ``"window"`` (outside the claim window), ``"deadline"`` (the
            request reached the backend after its deadline: nobody claimed
            the slot by it, try again), ``"unknown"`` (no answer: the
            outcome cannot be known), or ``""``.
    """

    job: str
    slot_ms: int
    won: bool
    token: int | str | None = None
    reason: str = ""


@dataclass(frozen=True)
class RunRecord:
    """One history record: what happened to one slot of one job.

    All times are epoch milliseconds (UTC) or None when the run never got
    there. ``manual_key`` is set for runs made by ``run_now``.
    """

    job: str
    slot_ms: int
    state: State
    instance: str | None = None
    token: int | str | None = None
    claimed_at_ms: int | None = None
    sent_at_ms: int | None = None
    started_at_ms: int | None = None
    finished_at_ms: int | None = None
    task_id: str | None = None
    error: str | None = None
    manual_key: str | None = None
    #: When the run's current lease ends, epoch ms (backend clock); lease
    #: backends only. A ``claimed`` or ``running`` run whose lease ended is
    #: presumed dead (its owner or worker stopped).
    lease_until_ms: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """The record as plain JSON-ready values (state as its string)."""
        return {
            "job": self.job,
            "slot_ms": self.slot_ms,
            "state": self.state.value,
            "instance": self.instance,
            "token": self.token,
            "claimed_at_ms": self.claimed_at_ms,
            "sent_at_ms": self.sent_at_ms,
            "started_at_ms": self.started_at_ms,
            "finished_at_ms": self.finished_at_ms,
            "task_id": self.task_id,
            "error": self.error,
            "manual_key": self.manual_key,
            "lease_until_ms": self.lease_until_ms,
        }


@dataclass(frozen=True)
class InstanceInfo:
    """A live scheduler instance, as kept in the instance registry.

    Attributes:
        instance: the instance id (``host:pid:random``).
        host: host name.
        pid: process id.
        version: celery-anarchon version.
        started_ms: start time, epoch milliseconds.
        heartbeat_ms: last heartbeat, epoch milliseconds (backend clock: the
            backend sets it when it writes the heartbeat).
        fingerprint: hash of the instance's schedule definitions.
        jobs: per-job definition hashes, ``{job: hash}``: given to
            :meth:`Backend.register` to store them; empty in what
            :meth:`Backend.instances` returns (see
            :meth:`Backend.definitions`).
        clock_ms: the instance's own clock when it sent that heartbeat,
            epoch milliseconds, or None (older versions). The instance's
            clock offset from the backend's is ``clock_ms - heartbeat_ms``,
            within one round trip.
        stored_version: the stored-jobs version the instance applies
            (docs/runtime-schedules.md), or None (older versions).
    """

    instance: str
    host: str
    pid: int
    version: str
    started_ms: int
    heartbeat_ms: int = 0
    fingerprint: str = ""
    jobs: dict[str, str] = field(default_factory=dict)
    clock_ms: int | None = None
    stored_version: int | None = None

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> InstanceInfo:
        """Build from stored fields, ignoring any this version does not know
        (a newer instance may store more)."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in fields.items() if k in known})


class Backend(abc.ABC):
    """A shared store in which instances claim slots.

    Construct with a URL or a client the user owns (then :meth:`close` never
    closes it), the instance id of this scheduler, and backend options. The
    constructor must not connect: :meth:`open` does, so that Celery's
    ``lazy=True`` contract holds.

    Every method that talks to the backend raises
    :class:`~celery_anarchon.exceptions.BackendUnavailable` (``from`` the
    driver's error) when the backend cannot be reached or does not answer in
    time; never another driver exception.
    """

    #: True for lease backends (:class:`LeaseBackend`: owner, fencing token,
    #: expiry, backend clock); a plain :class:`Backend` is claim-only.
    supports_leases: ClassVar[bool] = False

    #: Options this backend accepts (``anarchon_backend_options`` keys and URL
    #: query parameters); anything else is a ConfigurationError.
    options: ClassVar[frozenset[str]] = frozenset()

    #: The store: ``"redis"``, ``"postgresql"``, ``"mysql"``, ``"sqlite"`` or
    #: ``"rabbitmq"`` (empty for a backend of a user's own).
    kind: str = ""

    #: What this client is for, as its start-up log line names it:
    #: ``"claim backend"``, or ``"delayed store"`` for the client that
    #: :func:`celery_anarchon.delayed.delayed_backend` opens.
    role: str = "claim backend"

    instance: str

    def __init__(
        self, url: str | None = None, *, client: Any = None, instance: str, **options: Any
    ) -> None:
        """Remember the URL, the user's client and the instance id; never
        connect here (Celery's ``lazy=True`` contract).

        Raises:
            ConfigurationError: an unknown or malformed option.
        """
        self.url = url
        self.client = client
        self.instance = instance

    @abc.abstractmethod
    def open(self) -> None:
        """Connect and create the schema (tables, scripts) if missing.

        Idempotent. Raises:
            BackendUnavailable: the backend cannot be reached.
            ConfigurationError: the backend is reachable but unusable as
                configured (e.g. a Redis eviction policy that could drop claims).
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections this backend opened. Safe to call twice."""

    @property
    def namespace(self) -> str:
        """What keeps this cluster's claims apart from another's on the same
        server: the backend's ``prefix`` (tables, keys or queues). Task ids
        include it (:func:`celery_anarchon.message.task_id_for`)."""
        return str(getattr(self, "prefix", ""))

    def exists(self) -> bool:
        """False when the backend's store was never created and
        :meth:`open` would create it (a SQLite file not there yet); True
        for a server backend, which is there or unreachable."""
        return True

    @abc.abstractmethod
    def now_ms(self) -> int:
        """The backend's clock (the server's where it has one), epoch ms."""

    @abc.abstractmethod
    def claim(self, requests: Sequence[ClaimRequest]) -> list[Claim]:
        """Claim slots, exactly one winner per ``(job, slot_ms)`` across all
        instances, ever, while the claim record is kept.

        Returns one :class:`Claim` per request, in request order. A won claim
        is recorded in history as ``claimed`` with this instance as owner and
        a fresh fencing token. A slot already claimed, or recorded in any
        state, is lost with reason ``"taken"``; a slot outside the claim
        window is lost with reason ``"window"`` (lease backends).

        Raises:
            BackendUnavailable: no answer; the caller must treat every
                request of the batch as lost.
        """

    @abc.abstractmethod
    def mark(
        self,
        claim: Claim,
        state: State,
        *,
        task_id: str | None = None,
        error: str | None = None,
    ) -> bool:
        """Move a won claim's record to ``state``, fenced by ``claim.token``.

        Sets the matching timestamp (``sent_at_ms`` for SENT,
        ``started_at_ms`` for RUNNING, ``finished_at_ms`` for SUCCEEDED,
        FAILED and LOST), and ``task_id`` / ``error`` when given.

        States only move forward (claimed, sent, running, then succeeded,
        failed or lost); a mark that would move a run backwards, or out of
        a finished state, writes nothing and returns False, except that a
        late ``sent`` still fills in ``sent_at_ms`` and ``task_id``. So
        ``mark(claim, RUNNING)`` is the worker's start gate: it returns True
        once per slot, and False for a duplicate delivery.

        Returns:
            False when the record's current token is not ``claim.token``
            (another instance took the slot over), or the move is not
            forward; nothing is written then. Claim-only backends, which
            have no token to check, append the state and return True.
        Raises:
            BackendUnavailable: no answer.
        """

    def mark_many(
        self,
        claims: Sequence[Claim],
        state: State,
        *,
        task_ids: Sequence[str | None] | None = None,
    ) -> list[bool]:
        """:meth:`mark` for many won claims at once (the scheduler records
        ``sent`` for a chunk of sent slots in one call), each fenced by its
        own token, with the same rules and answers as :meth:`mark`.

        The default calls :meth:`mark` for each claim; backends override it
        with one round trip (a pipeline, a transaction, one append).

        Args:
            claims: won claims, any jobs and slots.
            state: the state to record for every claim.
            task_ids: one task id (or None) per claim, in order; None: none.
        Returns:
            one answer per claim, in order, as :meth:`mark` gives it.
        Raises:
            ValueError: ``task_ids`` is not as long as ``claims``.
            BackendUnavailable: no answer, or not every claim was answered;
                nothing may be assumed written then, and the caller may
                send the whole call again (a repeated ``sent`` is written
                again and answers True).
        """
        ids = [None] * len(claims) if task_ids is None else list(task_ids)
        if len(ids) != len(claims):
            raise ValueError(f"{len(ids)} task ids for {len(claims)} claims")
        return [
            self.mark(claim, state, task_id=task_id)
            for claim, task_id in zip(claims, ids, strict=True)
        ]

    @abc.abstractmethod
    def record_many_if_absent(self, records: Sequence[AbsentRecord]) -> list[bool]:
        """Record ``missed`` or ``skipped`` for each slot of ``records`` that
        has no record yet (the misses of one scheduler round, or of one
        job's gap), in one round trip (a pipeline, a transaction, one batch
        of gate claims). A record also closes its slot: it can no longer be
        claimed.

        Returns:
            one answer per record, in order: True when written, False when
            the slot already had a record (another instance claimed it, so
            it was not missed).
        Raises:
            BackendUnavailable: no answer, or not every record was answered;
                some may have been written then, and the caller may send the
                whole call again (a written slot then answers False).
        """

    @abc.abstractmethod
    def history(self, job: str, limit: int | None = None) -> list[RunRecord]:
        """The job's history, newest slot first, at most ``limit`` records
        (all kept records when None).

        Raises:
            BackendUnavailable: no answer.
        """

    def history_many(
        self, jobs: Sequence[str], limit: int | None = None, *, since_ms: int | None = None
    ) -> dict[str, list[RunRecord]]:
        """:meth:`history` of many jobs in as few round trips as the backend
        allows (an operator's page of jobs, the last hour's totals): each
        job's records newest slot first, at most ``limit`` per job (all kept
        records when None), only those with ``slot_ms >= since_ms`` (epoch
        ms, UTC) when given.

        The default reads each job with :meth:`history` (one round trip per
        job); the SQL and Redis backends override it with one query or one
        pipeline per chunk of jobs.

        Returns:
            ``{job: records}`` with every job of ``jobs`` as a key (an empty
            list for a job without records), in the order of ``jobs``.
        Raises:
            BackendUnavailable: no answer.
        """
        found: dict[str, list[RunRecord]] = {}
        for job in jobs:
            if job in found:
                continue
            records = self.history(job, None if since_ms is not None else limit)
            if since_ms is not None:
                records = [r for r in records if r.slot_ms >= since_ms][:limit]
            found[job] = records
        return found

    def state_counts(self, jobs: Collection[str], since_ms: int) -> dict[State, int]:
        """How many history records of ``jobs`` with ``slot_ms >= since_ms``
        (epoch ms, UTC: the slot's time, not when the record was written)
        each state has: the Cluster page's last hour's totals. Every kept
        record counts (a slot taken over has its ``superseded`` record and
        the current one; manual runs count, under their claim time).
        Records whose state this version does not know are left out, as
        :meth:`history` leaves them out.

        The default reads the records with :meth:`history_many` and counts
        them; the SQL backend overrides it with one grouped statement.

        Returns:
            ``{state: count}``, states without such records left out.
        Raises:
            BackendUnavailable: no answer.
        """
        counts: Counter[State] = Counter()
        for records in self.history_many(list(dict.fromkeys(jobs)), since_ms=since_ms).values():
            counts.update(record.state for record in records)
        return dict(counts)

    def jobs_with_state(
        self, jobs: Collection[str], states: Collection[State], since_ms: int
    ) -> set[str]:
        """The jobs of ``jobs`` that have a history record in one of
        ``states`` with ``slot_ms >= since_ms`` (epoch ms, UTC): the Jobs
        page's state filters ("a miss in the last 24 h").

        The default reads the records with :meth:`history_many`; the SQL
        backend overrides it with one ``SELECT DISTINCT`` statement.

        Returns:
            those job names (a subset of ``jobs``).
        Raises:
            BackendUnavailable: no answer.
        """
        wanted = frozenset(states)
        if not wanted:
            return set()
        found = self.history_many(list(dict.fromkeys(jobs)), since_ms=since_ms)
        return {job for job, records in found.items() if any(r.state in wanted for r in records)}

    def last_run(self, job: str) -> RunRecord | None:
        """The newest record of a run that was really sent (state ``sent``,
        ``running``, ``succeeded`` or ``failed``), or None.

        Raises:
            BackendUnavailable: no answer.
        """
        for record in self.history(job):
            if record.state in SENT_STATES:
                return record
        return None

    @abc.abstractmethod
    def claim_manual(self, job: str, key: str, keep_until_ms: int) -> Claim:
        """Claim a manual run (``run_now``) of ``job`` under ``key``.

        Calls with the same ``(job, key)`` win once, on every instance, while
        the record is kept (at least until ``keep_until_ms``). The won
        claim's ``slot_ms`` is the backend's now, and it is recorded in
        history as ``claimed`` with ``manual_key = key``.

        Raises:
            BackendUnavailable: no answer.
        """

    @abc.abstractmethod
    def take_run_now_guard(self, job: str, hold_ms: int) -> bool:
        """Take ``job``'s run-now guard for ``hold_ms`` milliseconds.

        Atomic in the backend: of calls racing for a free guard, from any
        host, exactly one takes it; every call until ``hold_ms`` after it
        is refused. ``run_now`` without a key takes it before claiming, so
        two quick calls send once whatever second they fall in.

        Returns:
            True when this call took the guard, False while it is held.
        Raises:
            BackendUnavailable: no answer (nothing taken).
        """

    def last_slots(self, jobs: Sequence[str]) -> dict[str, int]:
        """``job -> newest scheduled slot with a record`` (epoch ms) for each
        of ``jobs`` that has one (manual runs are not counted), read in as
        few round trips as the backend allows: the scheduler reads it once
        at start-up for every job.

        The default reads each job's newest ten records (:meth:`history`);
        backends override it with one pipeline or a grouped query.

        Raises:
            BackendUnavailable: no answer.
        """
        found: dict[str, int] = {}
        for job in jobs:
            for record in self.history(job, limit=10):
                if record.manual_key is None:
                    found[job] = record.slot_ms
                    break
        return found

    # -- instance registry (lease backends; claim-only backends keep none) --

    def register(self, info: InstanceInfo, ttl_ms: int) -> bool:
        """Add or refresh this instance in the registry; it drops out
        ``ttl_ms`` after its last call unless refreshed.

        The heartbeat carries the schedule's fingerprint, not its
        definitions: ``info.jobs``, when not empty, is stored as this
        instance's definitions (under a key or row of its own, kept as long
        as the instance is registered) and replaces the ones stored before;
        when empty, the stored definitions are kept as they are. So an
        instance sends its definitions once per schedule, not at every
        heartbeat.

        Returns:
            True when, after this call, the registry holds definitions of
            this instance for ``info.fingerprint`` (or keeps none: claim-only
            backends); False when the caller should send ``info.jobs`` (its
            entry had expired, or was made with another fingerprint).
        Raises:
            BackendUnavailable: no answer.
        """
        return True

    def unregister(self, instance: str) -> None:  # noqa: B027
        """Remove an instance from the registry (graceful shutdown)."""

    def instances(self) -> list[InstanceInfo]:
        """The live instances, oldest start first (empty when not kept).

        Each carries its fingerprint; ``jobs`` is left empty: read an
        instance's definitions with :meth:`definitions`, only when its
        fingerprint differs from yours.
        """
        return []

    def definitions(self, instance: str) -> dict[str, str]:
        """The per-job definition hashes ``{job: hash}`` that a live
        ``instance`` stored with :meth:`register` (empty when none are
        kept).

        Raises:
            BackendUnavailable: no answer.
        """
        return {}

    def housekeep(self, budget_s: float = 0.5) -> None:  # noqa: B027
        """Run upkeep that writes left for later (SQL: history trims), for
        about ``budget_s`` seconds at most. The scheduler calls it after each
        registry heartbeat; a backend may take the first call as the sign
        that its caller does upkeep regularly, and from then on leave such
        work out of its claims (off the claim path). Never raises. Default:
        nothing."""

    def check_job(  # noqa: B027
        self,
        job: str,
        *,
        jitter_s: float | timedelta,
        max_late_s: float | timedelta,
        max_skew_s: float | timedelta,
    ) -> None:
        """Refuse, at start-up and in ``check``, a job this backend cannot
        keep to one run per slot. Durations in seconds (or timedelta).

        The default accepts every job: a lease backend keeps a claim record
        at least until ``keep_until_ms`` of each request. RabbitMQ refuses a
        job whose ``jitter + max_late + max_skew`` reaches its ``slot_ttl``.

        Raises:
            ConfigurationError: the job cannot be kept to one run per slot,
                naming the job, the values and the fix.
        """

    def describe(self) -> str:
        """The backend for logs and banners, credentials masked."""
        return type(self).__name__

    # -- deadlines (lease backends enforce them; see ClaimRequest.deadline_ms) --

    #: The measured offset of the backend's clock to this process's
    #: (``backend - local``, ms), and when it was measured (monotonic s).
    _clock_offset_ms: int = 0
    _clock_offset_at: float = -math.inf

    def request_timeout_s(self) -> float | None:
        """How long this client waits for the answer to one call, seconds;
        None when a request cannot be held up in a network (SQLite, which
        is embedded) or the backend keeps no lease (RabbitMQ): no deadline
        is stamped then."""
        return None

    def clock_offset_ms(self) -> int:
        """The backend's clock minus this process's, milliseconds, measured
        with one :meth:`now_ms` round trip (against its midpoint) at
        :meth:`open` and again at the first call after every
        :data:`OFFSET_REFRESH_S` seconds; off by at most half a round trip.

        Raises:
            BackendUnavailable: no answer.
        """
        if time.monotonic() - self._clock_offset_at >= OFFSET_REFRESH_S:
            self._measure_clock_offset()
        return self._clock_offset_ms

    def _measure_clock_offset(self) -> None:
        """Measure :meth:`clock_offset_ms` now (lease backends call it at
        the end of :meth:`open`).

        Raises:
            BackendUnavailable: no answer.
        """
        before = time.time()
        backend_ms = self.now_ms()
        local_ms = (before + time.time()) * 500
        self._clock_offset_ms = int(backend_ms - local_ms)
        self._clock_offset_at = time.monotonic()

    def stamp_deadlines(self, requests: Sequence[ClaimRequest]) -> list[ClaimRequest]:
        """``requests`` with ``deadline_ms`` set where it is None: now plus
        :data:`DEADLINE_SHARE` of :meth:`request_timeout_s`, in the
        backend's time (this process's clock plus :meth:`clock_offset_ms`).
        Unchanged when the backend needs no deadline.

        Raises:
            BackendUnavailable: the clock offset could not be measured.
        """
        timeout_s = self.request_timeout_s()
        if timeout_s is None or all(r.deadline_ms is not None for r in requests):
            return list(requests)
        offset_ms = self.clock_offset_ms()
        deadline_ms = int(time.time() * 1000 + offset_ms + timeout_s * DEADLINE_SHARE * 1000)
        return [
            r if r.deadline_ms is not None else dataclasses.replace(r, deadline_ms=deadline_ms)
            for r in requests
        ]


class LeaseBackend(Backend):
    """A backend that keeps a lease per claim (SQL, Redis): an owner, a
    fencing token and a lease expiry, judged by the backend's own clock.

    On top of the claim contract of :class:`Backend` it takes slots over
    from owners whose lease ended, gives unsent claims back, extends a
    running run's lease and reads whether claims are still held. A
    claim-only backend (RabbitMQ) has none of these: callers check
    ``isinstance(backend, LeaseBackend)`` (or :attr:`supports_leases`) first.
    """

    supports_leases: ClassVar[bool] = True

    @abc.abstractmethod
    def take_over_many(self, requests: Sequence[ClaimRequest]) -> list[Claim]:
        """Take slots over from owners whose lease ended (the backup
        runner's checks due in one tick), in one round trip.

        Atomic on the backend, per slot: only a scheduled run still
        ``claimed`` whose ``lease_until_ms`` is before the backend's now is
        taken; its record becomes ``superseded`` and this instance holds the
        slot with the next fencing token. Inside the claim window only. A
        slot with no record is claimed as by :meth:`claim`.

        Returns:
            one :class:`Claim` per request, in request order: won with the
            new token, or lost: ``"held"`` when the slot is still
            ``claimed`` with its lease running (its holder, maybe another
            backup that took it over first, may still send it; the scheduler
            checks again when that lease ends), ``"taken"`` when it was sent
            (or moved further, or is a manual run), ``"window"`` outside the
            claim window, ``"unknown"`` for a request the backend answered
            with an error while it answered others.
        Raises:
            BackendUnavailable: no answer.
        """

    def won_counts(self, jobs: Sequence[str]) -> dict[str, int]:
        """Each job's count of won claims toward its run limit
        (:attr:`ClaimRequest.max_runs`), 0 for a job never counted. The
        backends of this package all keep the count; this default (no
        count kept) is for a backend that has no run limits.

        Raises:
            BackendUnavailable: no answer.
        """
        return dict.fromkeys(jobs, 0)

    @abc.abstractmethod
    def release(self, claims: Sequence[Claim]) -> None:
        """Give back won claims that were not sent (hand-over on shutdown,
        or a batch that could not be sent in time), so another instance can
        claim them at once. Fenced by token; a claim already sent is left
        alone.

        Raises:
            BackendUnavailable: no answer.
        """

    @abc.abstractmethod
    def extend(self, claim: Claim, lease_ms: int, *, restart: bool = False) -> bool:
        """Extend the lease of a running run (the worker's heartbeat), fenced
        by ``claim.token``: ``lease_until_ms`` becomes the backend's now plus
        ``lease_ms`` (milliseconds), only while the run is ``running``.

        With ``restart=True`` the call is the start gate of a redelivered
        message (``acks_late``) whose run is recorded ``running``: it writes
        only when that lease has already expired by the backend's clock (the
        worker that started the run stopped heartbeating: it died), and sets
        ``started_at_ms`` to now as well. Two redeliveries racing: one wins.

        Returns:
            True when written. False when the slot's current record does not
            carry the token, is not ``running``, or (``restart``) its lease
            has not expired.
        Raises:
            BackendUnavailable: no answer.
        """

    @abc.abstractmethod
    def holding(self, claims: Sequence[Claim], margin_ms: int = 0) -> list[bool]:
        """Whether each won claim is still held, in one batched read: the
        slot's current record carries the claim's token, is still
        ``claimed``, and its lease ends more than ``margin_ms``
        (milliseconds) after the backend's now. The scheduler asks before
        publishing a claim whose send stalled.

        Returns:
            one answer per claim, in order (False for a lost claim).
        Raises:
            BackendUnavailable: no answer.
        """
