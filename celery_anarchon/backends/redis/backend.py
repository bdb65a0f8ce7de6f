"""The Redis backend: claims, take-over, marks, misses and ``run_now``, each
one script call; connection, keys, history and registry are the layers it
stands on."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, ClassVar

import redis
from redis.cluster import RedisCluster
from redis.sentinel import Sentinel

from ...exceptions import ConfigurationError
from ..base import AbsentRecord, Claim, ClaimRequest, State
from .connection import _Client, _flag, _seconds, _wrong_type
from .scripts import (
    CLAIM,
    CLAIM_COUNTED,
    EXTEND,
    HOLDING,
    MANUAL,
    MARK,
    RECORD,
    RELEASE,
    TAKE_OVER,
    _Call,
    _Script,
)
from .stored import RedisStored

__all__ = ["RedisBackend"]

logger = logging.getLogger(__name__)

#: Default history bounds for manual runs (``claim_manual`` takes none).
DEFAULT_HISTORY_TTL_MS = 7 * 24 * 3600 * 1000
#: Lease of a manual run, milliseconds.
MANUAL_LEASE_MS = 60_000


class RedisBackend(RedisStored):
    """Slots claimed in Redis, one Lua script per operation.

    Guarantees (Redis runs a script atomically, so no other command lands in
    between the checks and the writes of one script):

    * one winner per ``(job, slot)`` while the claim key lives:
      :data:`LUA_CLAIM_SCRIPT` wins only when the claim key
      ``{PJ}:slot:<slot_ms>`` holds no token and the slot has no history
      record; it writes both in the same script. The claim key expires at
      the request's ``keep_until_ms`` (``PEXPIREAT``, an absolute time), and
      history trimming skips a record until its ``keep_until_ms``;
    * the claim window and lease expiry are judged by the server's clock
      (``TIME`` inside the scripts; Redis replicates a script's effects, not
      the script, so replicas and the AOF see the same writes), never by the
      client's;
    * fencing: :data:`LUA_MARK_SCRIPT` and :data:`LUA_RELEASE_SCRIPT` write
      only when the slot's current record carries the caller's token;
      :data:`LUA_TAKE_OVER_SCRIPT` takes a ``claimed`` slot whose lease ran
      out by server time, with token ``old + 1``, leaving the old record in
      history as ``superseded``;
    * :data:`LUA_MANUAL_SCRIPT` wins once per ``(job, key)`` while the
      manual key lives (until ``keep_until_ms``);
    * nothing grows without bound: claim and manual keys expire; history is
      trimmed to ``history_size`` and ``history_ttl_ms`` inside the writing
      scripts, amortised: a job's history is trimmed back to
      ``history_size`` once it holds more than ``history_size`` plus a
      tenth (at least one record more), or a record older than
      ``history_ttl_ms``; the history keys themselves expire when their
      newest record would be trimmed by age (a claim moves their expiry in
      steps of a tenth of ``history_ttl_ms``, so they may live that much
      longer); registry entries expire after ``ttl_ms``.

    Needs Redis 6.2 or later (:meth:`open` checks). Limits (``docs/backends/redis.md``):
    a Redis without persistence, or a Sentinel
    failover that loses unreplicated writes, can lose a claim, and then a slot
    can be claimed twice; AOF with ``appendfsync always`` and replicas narrow
    that window, they do not close it. An eviction policy other than
    ``noeviction`` with ``maxmemory`` set can evict claim keys: :meth:`open`
    refuses it unless ``allow_eviction`` (on a cluster, every primary is
    checked).

    Redis Cluster: every key of a job shares the hash tag ``{PJ}`` (the
    registry's share ``{P}``), so each script touches one cluster slot. Pass
    a ``redis.cluster.RedisCluster`` as the client (there is no cluster URL
    scheme); tested against a three-primary cluster without replicas, not
    through resharding or cluster failover. Every script touches only the
    keys it declares.

    A batch of claims goes out as one pipeline of ``EVALSHA`` calls (one
    round trip per node; after a ``NOSCRIPT``, one ``SCRIPT LOAD`` per
    missing script and a second pipeline for the calls that did not run).

    URLs: ``redis://[[user]:password@]host:6379/0``, ``rediss://`` (TLS,
    redis-py's ``ssl_*`` query parameters such as ``ssl_ca_certs``,
    ``ssl_certfile``, ``ssl_keyfile``, ``ssl_cert_reqs`` pass through),
    ``redis+sentinel://[:password@]host:26379[,host2:26379]/0`` and kombu's
    ``sentinel://host:26379;sentinel://host2:26379`` (both need
    ``master_name``; the client follows the master on failover through
    :meth:`redis.sentinel.Sentinel.master_for`; the password is the master's).

    Options (``anarchon_backend_options`` or URL query parameters):
        prefix: key prefix, default ``"anarchon:"``.
        socket_timeout: seconds to wait for connecting and for each reply,
            default 5.
            Every call is bounded by it (connect and each reply:
            redis-py's ``socket_connect_timeout`` and ``socket_timeout``,
            on the Sentinel connections too), and a claim or take-over
            carries a deadline of :data:`~celery_anarchon.backends.base.DEADLINE_SHARE`
            of it after it is sent, in the server's time (the offset of
            the server's ``TIME`` to this process's clock is measured at
            open and every minute): a script that runs later (a request
            held up in the network) claims nothing and answers
            ``"deadline"``.
        master_name: the Sentinel service name (Sentinel URLs only).
        allow_eviction: accept a Redis that may evict keys (the
            ``anarchon_allow_eviction`` setting), default False.
    """

    kind = "redis"

    supports_leases: ClassVar[bool] = True
    options: ClassVar[frozenset[str]] = frozenset(
        {"prefix", "socket_timeout", "master_name", "allow_eviction"}
    )

    def __init__(
        self,
        url: str | None,
        *,
        client: redis.Redis | RedisCluster | None = None,
        instance: str,
        prefix: str = "anarchon:",
        socket_timeout: float | str = 5.0,
        master_name: str | None = None,
        allow_eviction: bool | str = False,
    ) -> None:
        """Build the backend without connecting.

        Args:
            url: the Redis URL; None when ``client`` is given.
            client: a ``redis.Redis`` (or ``redis.cluster.RedisCluster``)
                the user owns: used as is and never
                closed by :meth:`close`.
            instance: this scheduler's instance id (owner of its claims).
            prefix, socket_timeout, master_name, allow_eviction: see the
                class docstring.

        Raises:
            ConfigurationError: neither URL nor client, an unparsable URL, a
                Sentinel URL without ``master_name``, a bad option value.
        """
        if url is None and client is None:
            raise ConfigurationError("anarchon_backend: give a Redis URL or a redis.Redis client.")
        self.instance = instance
        self.prefix = str(prefix)
        self.socket_timeout = _seconds(socket_timeout)
        self.master_name = master_name or None
        self.allow_eviction = _flag("allow_eviction", allow_eviction)
        self._url = url
        self._owns_client = client is None
        self._client: _Client | None = client
        self._sentinel: Sentinel | None = None
        if client is None and url is not None:
            self._check_url(url)

    # -- lifecycle -----------------------------------------------------------

    # -- claims --------------------------------------------------------------

    def claim(self, requests: Sequence[ClaimRequest]) -> list[Claim]:
        """Claim slots with :data:`LUA_CLAIM_SCRIPT`, all in one pipeline.

        Returns one :class:`Claim` per request, in order: won with the
        fencing token (1, or one more than a released claim's), lost with
        ``"taken"``, ``"window"`` (outside ``[server_now - window_before_ms,
        server_now + window_after_ms]``), or ``"unknown"`` when Redis
        answered that one script with an error (e.g. out of memory) while
        answering others.

        A script refused with ``WRONGTYPE`` (a key of the job holds another
        program's value) loses its request with ``"unknown"`` and is logged;
        it is not an outage, even when it is the whole batch, so the other
        jobs go on being claimed.

        Raises:
            BackendUnavailable: no answer, or every script failed (other
                than with ``WRONGTYPE``).
        """
        if not requests:
            return []
        calls = [self._claim_call(r) for r in self.stamp_deadlines(requests)]
        replies = self._run(calls)
        errors = [r for r in replies if isinstance(r, Exception)]
        if len(errors) == len(replies) and not all(map(_wrong_type, errors)):
            raise self._unavailable("claim", errors[0]) from errors[0]
        for request, reply in zip(requests, replies, strict=True):
            if isinstance(reply, Exception) and _wrong_type(reply):
                logger.error(
                    "anarchon: cannot claim %s: a key of this job (%s*) holds a value "
                    "that is not ours (%s); its slots are not sent until the key is "
                    "removed or anarchon_backend_options['prefix'] is changed",
                    request.job,
                    self._tag(request.job),
                    reply,
                )
        return [_claim_answer(r, reply) for r, reply in zip(requests, replies, strict=True)]

    def mark(
        self,
        claim: Claim,
        state: State,
        *,
        task_id: str | None = None,
        error: str | None = None,
    ) -> bool:
        """Move a run to ``state`` with :data:`LUA_MARK_SCRIPT`, fenced by
        ``claim.token``; the state's timestamp is the server's now.

        A state only moves forward (``claimed`` < ``sent`` < ``running``
        < ``succeeded``/``failed``/``lost``), so ``mark(claim, RUNNING)`` is
        the worker's start gate: True once, False for a duplicate delivery.
        A late ``sent`` after the worker's ``succeeded`` records
        ``sent_at_ms`` and keeps ``succeeded``. Empty ``task_id``/``error``
        strings count as not given.

        Returns:
            False when the slot's current record does not carry the token
            (taken over, released, trimmed away, or ``claim.token`` is None),
            or the move is not forward; nothing is written then.
        Raises:
            BackendUnavailable: no answer.
        """
        if claim.token is None:
            return False
        return bool(self._call(self._mark_call(claim, State(state), task_id, error)))

    def mark_many(
        self,
        claims: Sequence[Claim],
        state: State,
        *,
        task_ids: Sequence[str | None] | None = None,
    ) -> list[bool]:
        """:meth:`mark` for many claims: one pipeline of
        :data:`LUA_MARK_SCRIPT` calls, each fenced by its claim's token.

        Returns:
            one answer per claim, in order (see :meth:`mark`).
        Raises:
            ValueError: ``task_ids`` is not as long as ``claims``.
            BackendUnavailable: no answer, or Redis answered any of the
                scripts with an error (the whole call may be sent again).
        """
        ids = [None] * len(claims) if task_ids is None else list(task_ids)
        if len(ids) != len(claims):
            raise ValueError(f"{len(ids)} task ids for {len(claims)} claims")
        state = State(state)
        marked = [
            (i, self._mark_call(claim, state, task_id, None))
            for i, (claim, task_id) in enumerate(zip(claims, ids, strict=True))
            if claim.token is not None
        ]
        answers = [False] * len(claims)
        if not marked:
            return answers
        replies = self._run([call for _, call in marked])
        for (i, _), reply in zip(marked, replies, strict=True):
            if isinstance(reply, Exception):
                raise self._unavailable("mark", reply) from reply
            answers[i] = bool(reply)
        return answers

    def _mark_call(
        self, claim: Claim, state: State, task_id: str | None, error: str | None
    ) -> _Call:
        args = [
            claim.slot_ms,
            str(claim.token),
            state.value,
            state.stamp or "",
            task_id or "",
            error or "",
        ]
        return (MARK, [self._runs_key(claim.job)], args)

    def take_over_many(self, requests: Sequence[ClaimRequest]) -> list[Claim]:
        """Take over slots whose winner's lease ran out (backup runner): one
        pipeline of :data:`LUA_TAKE_OVER_SCRIPT` calls (a slot already sent
        answers 0 after one ``HGET``).

        Returns:
            one :class:`Claim` per request, in order: won with token ``old +
            1`` when the slot's record is ``claimed`` (never marked sent) and
            its lease expired by the server's clock (the old record becomes
            ``superseded``); otherwise lost with ``"held"`` (still
            ``claimed``, its lease still running), ``"taken"`` (already sent,
            or a manual run) or ``"window"``; ``"unknown"`` for a script
            Redis answered with an error while answering others.
        Raises:
            BackendUnavailable: no answer, or every script failed.
        """
        if not requests:
            return []
        calls = [self._slot_call(TAKE_OVER, r) for r in self.stamp_deadlines(requests)]
        replies = self._run(calls)
        errors = [r for r in replies if isinstance(r, Exception)]
        if len(errors) == len(replies):
            raise self._unavailable("take_over", errors[0]) from errors[0]
        return [_claim_answer(r, reply) for r, reply in zip(requests, replies, strict=True)]

    def holding(self, claims: Sequence[Claim], margin_ms: int = 0) -> list[bool]:
        """Whether each claim is still held, with one pipeline of
        :data:`LUA_HOLDING_SCRIPT` calls (reads only; the lease judged by the
        server's clock).

        Returns:
            one answer per claim, in order (see :meth:`Backend.holding`).
        Raises:
            BackendUnavailable: no answer, or an error reply.
        """
        asked = [(i, c) for i, c in enumerate(claims) if c.won and c.token is not None]
        answers = [False] * len(claims)
        if not asked:
            return answers
        calls = [
            (HOLDING, [self._runs_key(c.job)], [c.slot_ms, str(c.token), int(margin_ms)])
            for _, c in asked
        ]
        for (i, _), reply in zip(asked, self._run(calls), strict=True):
            if isinstance(reply, Exception):
                raise self._unavailable("holding", reply) from reply
            answers[i] = bool(reply)
        return answers

    def extend(self, claim: Claim, lease_ms: int, *, restart: bool = False) -> bool:
        """Extend a running run's lease to the server's now plus ``lease_ms``
        (milliseconds), or restart it once its lease expired, with
        :data:`LUA_EXTEND_SCRIPT`, fenced by ``claim.token``
        (see :meth:`Backend.extend`).

        Raises:
            BackendUnavailable: no answer.
        """
        if claim.token is None:
            return False
        args = [claim.slot_ms, str(claim.token), int(lease_ms), "1" if restart else ""]
        return bool(self._call((EXTEND, [self._runs_key(claim.job)], args)))

    def record_many_if_absent(self, records: Sequence[AbsentRecord]) -> list[bool]:
        """Record ``missed`` or ``skipped`` for slots that have neither a
        claim nor a record: one pipeline of :data:`LUA_RECORD_SCRIPT` calls;
        each sets the claim key to 0 until ``keep_until_ms`` (when that is
        ahead), which closes the slot.

        Returns:
            one answer per record, in order.
        Raises:
            BackendUnavailable: no answer, or Redis answered any of the
                scripts with an error (the others may be written).
        """
        if not records:
            return []
        replies = self._run([self._record_call(r) for r in records])
        for reply in replies:
            if isinstance(reply, Exception):
                raise self._unavailable("record", reply) from reply
        return [bool(reply) for reply in replies]

    def _record_call(self, r: AbsentRecord) -> _Call:
        args = [
            r.slot_ms,
            State(r.state).value,
            self.instance,
            r.error or "",
            r.history_size,
            r.history_ttl_ms,
            r.keep_until_ms,
        ]
        return (RECORD, self._slot_keys(r.job, r.slot_ms), args)

    def release(self, claims: Sequence[Claim]) -> None:
        """Give back won, unsent claims with :data:`LUA_RELEASE_SCRIPT`, all
        in one pipeline. Only a record still ``claimed`` with the claim's
        token is released; its slot can be claimed again at once (the next
        winner gets token + 1).

        Raises:
            BackendUnavailable: no answer.
        """
        calls: list[_Call] = [
            (RELEASE, self._slot_keys(c.job, c.slot_ms), [c.slot_ms, str(c.token)])
            for c in claims
            if c.won and c.token is not None
        ]
        if calls:
            self._run(calls)

    def claim_manual(self, job: str, key: str, keep_until_ms: int) -> Claim:
        """Claim a manual run with :data:`LUA_MANUAL_SCRIPT`: the first call
        per ``(job, key)`` wins (token 1) until ``keep_until_ms``.

        The run's ``slot_ms`` is the server's now, moved forward by a
        millisecond when it falls on a whole second or on a slot that has a
        record, so a manual run never takes a scheduled slot. A lost call
        answers with the winning run's slot.

        Raises:
            BackendUnavailable: no answer.
        """
        tag = self._tag(job)
        keys = [f"{tag}:manual:{key}", f"{tag}:runs", f"{tag}:index"]
        args = [key, self.instance, keep_until_ms, MANUAL_LEASE_MS, DEFAULT_HISTORY_TTL_MS]
        token, slot_ms = self._call((MANUAL, keys, args))
        if int(token):
            return Claim(job, int(slot_ms), won=True, token=int(token))
        return Claim(job, int(slot_ms), won=False, reason="taken")

    def take_run_now_guard(self, job: str, hold_ms: int) -> bool:
        """Take the guard: ``SET <tag>:run-now-guard 1 NX PX hold_ms``, one
        atomic command, expired by the server's clock.

        Raises:
            BackendUnavailable: no answer.
        """
        with self._translated("SET"):
            taken = self._require_client().set(
                f"{self._tag(job)}:run-now-guard", 1, nx=True, px=max(1, hold_ms)
            )
        return bool(taken)

    # -- history -------------------------------------------------------------

    # -- instance registry ---------------------------------------------------

    # -- keys ----------------------------------------------------------------

    def _claim_call(self, r: ClaimRequest) -> _Call:
        """:data:`CLAIM`, or :data:`CLAIM_COUNTED` for a job with a run limit."""
        if r.max_runs is None:
            return self._slot_call(CLAIM, r)
        _, keys, args = self._slot_call(CLAIM_COUNTED, r)
        return (CLAIM_COUNTED, [*keys, self._won_key(r.job)], [*args, r.max_runs])

    def won_counts(self, jobs: Sequence[str]) -> dict[str, int]:
        """Each job's count of won claims toward its run limit (0 when none).

        Raises:
            BackendUnavailable: no answer.
        """
        if not jobs:
            return {}
        client = self._require_client()
        with self._translated("GET won counts"):
            pipe = client.pipeline(transaction=False)
            for job in jobs:
                pipe.get(self._won_key(job))
            values = pipe.execute()
        return {job: int(v or 0) for job, v in zip(jobs, values, strict=True)}

    def _slot_call(self, script: _Script, r: ClaimRequest) -> _Call:
        args = [
            r.slot_ms,
            self.instance,
            r.window_before_ms,
            r.window_after_ms,
            r.keep_until_ms,
            r.lease_ms,
            r.history_size,
            r.history_ttl_ms,
            r.deadline_ms or 0,
        ]
        return (script, self._slot_keys(r.job, r.slot_ms), args)

    # -- running scripts -----------------------------------------------------

    # -- connecting ----------------------------------------------------------


# -- helpers -----------------------------------------------------------------


def _claim_answer(request: ClaimRequest, reply: Any) -> Claim:
    if isinstance(reply, Exception):
        return Claim(request.job, request.slot_ms, won=False, reason="unknown")
    token = int(reply)
    if token > 0:
        return Claim(request.job, request.slot_ms, won=True, token=token)
    reason = {-1: "window", -2: "held", -3: "deadline", -4: "finished"}.get(token, "taken")
    return Claim(request.job, request.slot_ms, won=False, reason=reason)
