"""The RabbitMQ backend: claims by gate queue and publisher confirms, misses,
``run_now`` and the settings check; naming, channels, the connection and
history are the layers it stands on (see the package docstring)."""

from __future__ import annotations

import functools
import json
import logging
import math
import secrets
import threading
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any, ClassVar

import amqp
from amqp.exceptions import AMQPError

from ...exceptions import BackendUnavailable, ConfigurationError
from ..base import AbsentRecord, Claim, ClaimRequest, RunRecord, State
from .channel import _Attempt, _ConfirmChannel, _Declare, _Lane
from .connection import _CONNECTION_ERRORS, CLAIM_CHANNELS, _positive, _seconds
from .history import RabbitMQHistory

__all__ = ["RabbitMQBackend", "check_job", "gate_arguments"]

logger = logging.getLogger(__name__)


# -- settings check and pure helpers -----------------------------------------


def check_job(
    job: str,
    *,
    jitter_s: float | timedelta,
    max_late_s: float | timedelta,
    max_skew_s: float | timedelta,
    slot_ttl_s: float | timedelta,
) -> None:
    """Refuse a job that a late instance could claim twice.

    A gate queue is deleted ``slot_ttl`` after it was last declared; an
    instance may still try a slot up to ``jitter + max_late + max_skew``
    after it (``docs/backends/rabbitmq.md``, "``slot_ttl`` must outlast
    every late claim"). All durations in seconds (or timedelta).

    Raises:
        ConfigurationError: ``jitter + max_late + max_skew >= slot_ttl``,
            naming the job, the values and the fix.
    """
    jitter, late, skew = _seconds(jitter_s), _seconds(max_late_s), _seconds(max_skew_s)
    ttl = _seconds(slot_ttl_s)
    total = jitter + late + skew
    if total >= ttl:
        raise ConfigurationError(
            f"job {job!r}: anarchon jitter ({jitter:g} s) + max_late ({late:g} s) "
            f"+ max_skew ({skew:g} s) = {total:g} s must stay below the RabbitMQ "
            f"backend's slot_ttl ({ttl:g} s), or an instance this late could claim the "
            "slot again after its gate queue expired. Lower this job's max_late or "
            "jitter, or raise slot_ttl in anarchon_backend_options."
        )


def gate_arguments(ttl_ms: int) -> dict[str, Any]:
    """Arguments of a gate queue that expires ``ttl_ms`` ms after last use."""
    return {
        "x-queue-type": "classic",
        "x-max-length": 1,
        "x-overflow": "reject-publish",
        "x-expires": ttl_ms,
    }


# -- a confirm-mode channel with its own books --------------------------------


# -- the backend --------------------------------------------------------------


class RabbitMQBackend(RabbitMQHistory):
    """Claim-only backend on RabbitMQ 3.9+: gate queues and publisher
    confirms (see the :mod:`celery_anarchon.backends.rabbitmq` docstring for
    the mechanism and its limits).

    Args:
        url: ``amqp://user:pass@host:port/vhost``, ``amqps://...`` (TLS) or
            ``pyamqp://...``; ``amqp://localhost`` when None and no client.
        client: a connection the user owns: a kombu ``Connection`` (AMQP
            transport) or a py-amqp ``Connection``. It is never used for
            claims and never closed: py-amqp's confirm mode
            (``confirm_publish``) applies to a whole connection and claims
            need channels of our own, so we open our own connection with its
            parameters (host, vhost, credentials, TLS).
        instance: this scheduler's instance id (owner of its claims).
        prefix: prepended to every queue name (default ``cron.``); must not
            start with ``amq.`` (reserved by RabbitMQ).
        slot_ttl: seconds (float or timedelta, default 300) a gate lives
            after its last declare. Must exceed ``jitter + max_late +
            max_skew`` of every job (:meth:`check_job`).
        confirm_timeout: seconds (default 5) to wait for the broker's next
            reply (declare-ok, ack, nack) before the outcome counts as
            unknown; also the connect timeout.

    Raises:
        ConfigurationError: a bad option value, a prefix too long or
            reserved, a client that is not an AMQP connection.
    """

    kind = "rabbitmq"

    options: ClassVar[frozenset[str]] = frozenset({"prefix", "slot_ttl", "confirm_timeout"})

    def __init__(
        self,
        url: str | None,
        *,
        client: Any = None,
        instance: str,
        prefix: str = "cron.",
        slot_ttl: float | timedelta | str = 300,
        confirm_timeout: float | timedelta | str = 5,
    ) -> None:
        super().__init__(url, client=client, instance=instance)
        self.prefix = prefix
        self.slot_ttl = _positive("slot_ttl", slot_ttl)
        self.confirm_timeout = _positive("confirm_timeout", confirm_timeout)
        self._client_properties = {"connection_name": f"celery-anarchon {instance}"}
        self._dial, self._where, vhost = self._dialer(url, client)
        self._job_room = self._check_names(prefix, vhost)
        self._lock = threading.RLock()
        self._conn: amqp.Connection | None = None
        self._claim_channels: dict[int, _ConfirmChannel] = {}
        self._history_ch: _ConfirmChannel | None = None
        #: History streams declared on the current connection.
        self._streams: set[str] = set()
        #: Channels the history stream declares are spread over besides the
        #: history channel (lane 0), by lane.
        self._stream_chs: dict[int, _ConfirmChannel] = {}
        #: history_size last asked for each job (to declare its stream later).
        self._history_sizes: dict[str, int] = {}

    # -- configuration ---------------------------------------------------

    @property
    def slot_ttl_ms(self) -> int:
        """``slot_ttl`` in whole milliseconds (the gates' ``x-expires``)."""
        return max(1, round(self.slot_ttl * 1000))

    def check_job(
        self,
        job: str,
        *,
        jitter_s: float | timedelta,
        max_late_s: float | timedelta,
        max_skew_s: float | timedelta,
        slot_ttl_s: float | timedelta | None = None,
    ) -> None:
        """Refuse a job this backend cannot keep to one run per slot.

        ``slot_ttl_s`` defaults to this backend's ``slot_ttl``; see
        :func:`check_job` for the rule.

        Raises:
            ConfigurationError: ``jitter + max_late + max_skew >= slot_ttl``.
        """
        check_job(
            job,
            jitter_s=jitter_s,
            max_late_s=max_late_s,
            max_skew_s=max_skew_s,
            slot_ttl_s=self.slot_ttl if slot_ttl_s is None else slot_ttl_s,
        )

    # -- names -----------------------------------------------------------

    # -- connection ------------------------------------------------------

    # -- declaring ---------------------------------------------------------

    # -- claiming ----------------------------------------------------------

    def _take_gates(self, attempts: list[_Attempt]) -> None:
        """Declare each attempt's gate and publish its claim message; set
        every attempt's ``outcome``.

        Nothing is published until every gate is declared, on a connection
        that has just answered; a connection failure before that is retried
        once on a new connection (nothing was published, so nothing can be
        claimed twice).

        Raises:
            BackendUnavailable: no connection, or declaring failed twice
                (nothing was published).
        """
        try:
            lanes = self._declared_lanes(attempts)
        except (*_CONNECTION_ERRORS, AMQPError) as exc:
            logger.debug("declaring gates failed (%s); reconnecting once", exc)
            self._drop()
            try:
                lanes = self._declared_lanes(attempts)
            except (*_CONNECTION_ERRORS, AMQPError) as again:
                self._drop()
                raise BackendUnavailable(
                    f"RabbitMQ backend: declaring gate queues on {self._where} failed: {again}"
                ) from again
        self._publish_claims(lanes, attempts)

    def _declared_lanes(self, attempts: list[_Attempt]) -> list[_Lane]:
        lanes = self._lanes(attempts)
        self._declare(lanes)
        return lanes

    def _lanes(self, attempts: list[_Attempt]) -> list[_Lane]:
        count = min(CLAIM_CHANNELS, len(attempts))
        lanes: list[_Lane] = []
        for index in range(count):
            mine = attempts[index::count]
            for attempt in mine:
                attempt.lane = index
            lanes.append(
                _Lane(functools.partial(self._claim_channel, index), [a.gate for a in mine])
            )
        return lanes

    def _publish_claims(self, lanes: list[_Lane], attempts: list[_Attempt]) -> None:
        """Publish every claim message, then read the confirms together."""
        channels = [lane.channel for lane in lanes]
        why = ""
        try:
            for channel in channels:
                channel.start_round()
            for attempt in attempts:
                attempt.tag = channels[attempt.lane].publish(
                    attempt.gate.queue, attempt.body, attempt.token, mandatory=True
                )
            self._drain_until(lambda: all(c.error or not c.unconfirmed for c in channels))
        except TimeoutError:
            why = f"no publisher confirm within {self.confirm_timeout:g} s"
            self._drop()
        except _CONNECTION_ERRORS as exc:
            why = f"connection lost before the publisher confirm ({exc})"
            self._drop()
        for attempt in attempts:
            self._decide(attempt, channels[attempt.lane], why)

    @staticmethod
    def _decide(attempt: _Attempt, channel: _ConfirmChannel, why: str) -> None:
        confirmed = channel.confirmed.get(attempt.tag) if attempt.tag else None
        if confirmed is None:
            attempt.outcome = "unknown"
            attempt.why = why or f"channel closed: {channel.error}"
        elif not confirmed:
            attempt.outcome = "taken"
        elif attempt.token in channel.returned:
            attempt.outcome = "returned"
        else:
            attempt.outcome = "won"

    def _attempt(self, job: str, slot_ms: int, queue: str, ttl_ms: int, **extra: Any) -> _Attempt:
        token = f"{self.instance}/{secrets.token_hex(6)}"
        body = json.dumps(
            {
                "job": job,
                "slot_ms": slot_ms,
                "instance": self.instance,
                "token": token,
                "at_ms": self.now_ms(),
                **extra,
            },
            separators=(",", ":"),
        ).encode()
        gate = _Declare(queue, gate_arguments(ttl_ms))
        return _Attempt(job=job, slot_ms=slot_ms, gate=gate, token=token, body=body, extra=extra)

    def claim(self, requests: Sequence[ClaimRequest]) -> list[Claim]:
        """Claim slots, one winner per ``(job, slot_ms)`` across instances.

        All gates of the batch are declared (pipelined over up to
        ``CLAIM_CHANNELS`` channels), then all claim messages are published
        and their confirms read together. ack -> won (token
        ``<instance>/<random>``), nack -> lost ``"taken"``, returned (the gate
        vanished) or no confirm -> lost ``"unknown"``. Won claims are
        recorded ``claimed``; unknown ones ``lost``. A request repeating an
        earlier ``(job, slot_ms)`` of the same batch is lost ``"taken"``.

        Raises:
            BackendUnavailable: no connection, or declaring the gates failed
                (nothing was published: every request is lost).
        """
        if not requests:
            return []
        with self._lock:
            attempts: dict[tuple[str, int], _Attempt] = {}
            for req in requests:
                key = (req.job, req.slot_ms)
                self._history_sizes[req.job] = req.history_size
                if key not in attempts:
                    queue = self.gate_queue(req.job, req.slot_ms)
                    attempts[key] = self._attempt(req.job, req.slot_ms, queue, self.slot_ttl_ms)
            ordered = list(attempts.values())
            self._take_gates(ordered)
            self._record_outcomes(ordered, State.CLAIMED)
            return self._answers(requests, attempts)

    def _answers(
        self, requests: Sequence[ClaimRequest], attempts: Mapping[tuple[str, int], _Attempt]
    ) -> list[Claim]:
        answers: list[Claim] = []
        answered: set[tuple[str, int]] = set()
        for req in requests:
            key = (req.job, req.slot_ms)
            attempt = attempts[key]
            if key in answered:
                answers.append(Claim(req.job, req.slot_ms, won=False, reason="taken"))
                continue
            answered.add(key)
            answers.append(self._claim_of(attempt))
        return answers

    @staticmethod
    def _claim_of(attempt: _Attempt) -> Claim:
        if attempt.outcome == "won":
            return Claim(attempt.job, attempt.slot_ms, won=True, token=attempt.token)
        reason = "taken" if attempt.outcome == "taken" else "unknown"
        return Claim(attempt.job, attempt.slot_ms, won=False, reason=reason)

    def _record_outcomes(self, attempts: Sequence[_Attempt], won_state: State) -> None:
        """Log each outcome and append ``won_state`` for wins, ``lost`` for
        unknown outcomes. History trouble is logged, never raised: the claims
        are decided and the caller must act on them."""
        now = self.now_ms()
        records: list[RunRecord] = []
        for attempt in attempts:
            record = self._outcome_record(attempt, won_state, now)
            if record is not None:
                records.append(record)
        if not records:
            return
        try:
            self._append(records)
        except BackendUnavailable as exc:
            logger.error(
                "could not append %d history record(s) for decided claims: %s", len(records), exc
            )

    def _outcome_record(self, attempt: _Attempt, won_state: State, now: int) -> RunRecord | None:
        run = f"{attempt.job!r} slot {attempt.slot_ms}"
        if attempt.outcome == "won":
            # The scheduler logs the won claim at INFO (with the slot's
            # time); this is the gate's side of it.
            logger.debug("anarchon: won %s (%s)", run, won_state)
            claimed_at = now if won_state is State.CLAIMED else None
            return RunRecord(
                job=attempt.job,
                slot_ms=attempt.slot_ms,
                state=won_state,
                instance=self.instance,
                token=attempt.token,
                claimed_at_ms=claimed_at,
                error=attempt.extra.get("error"),
                manual_key=attempt.extra.get("manual_key"),
            )
        if attempt.outcome == "taken":
            logger.debug("anarchon: lost %s: taken by another instance", run)
            return None
        if attempt.outcome == "returned":
            logger.warning(
                "lost %s: gate queue %s vanished before the claim reached it "
                "(deleted by hand?); not sending",
                run,
                attempt.gate.queue,
            )
            return None
        logger.warning(
            "outcome of the claim on %s is unknown (%s): counting it lost and not "
            "sending; if this instance's publish did fill the gate, the run will not happen",
            run,
            attempt.why,
        )
        return RunRecord(
            job=attempt.job,
            slot_ms=attempt.slot_ms,
            state=State.LOST,
            instance=self.instance,
            token=attempt.token,
            finished_at_ms=now,
            error=f"claim outcome unknown: {attempt.why}",
            manual_key=attempt.extra.get("manual_key"),
        )

    def record_many_if_absent(self, records: Sequence[AbsentRecord]) -> list[bool]:
        """Record ``missed`` or ``skipped`` for slots nobody claimed, and close
        them: their gates claimed as one batch (as :meth:`claim` does), the
        records appended per state. If this instance's publish fills a gate,
        nobody had claimed the slot, so the record is appended and no one can
        claim it any more. ``history_ttl_ms`` and ``keep_until_ms`` are
        ignored (trimming is by size; gates live ``slot_ttl``).

        Returns:
            one answer per record, in order: True when the gate was free and
            the record was appended; False when the slot was taken, or when
            the outcome is unknown (logged).
        Raises:
            BackendUnavailable: no connection; nothing was published.
        """
        if not records:
            return []
        with self._lock:
            attempts = []
            for r in records:
                self._history_sizes[r.job] = r.history_size
                attempt = self._attempt(
                    r.job,
                    r.slot_ms,
                    self.gate_queue(r.job, r.slot_ms),
                    self.slot_ttl_ms,
                    state=str(r.state),
                )
                if r.error is not None:
                    attempt.extra["error"] = r.error
                attempts.append(attempt)
            self._take_gates(attempts)
            for state in dict.fromkeys(State(r.state) for r in records):
                self._record_outcomes(
                    [a for a, r in zip(attempts, records, strict=True) if r.state == state], state
                )
            return [attempt.outcome == "won" for attempt in attempts]

    def claim_manual(self, job: str, key: str, keep_until_ms: int) -> Claim:
        """Claim a manual run of ``job`` under ``key``: the gate
        ``<prefix><job>.manual.<sha256(key)[:16]>``, won once while it lives.

        The gate lives ``slot_ttl``, or until ``keep_until_ms`` rounded up to
        a whole number of ``slot_ttl`` (so instances racing at the same
        moment declare it with the same arguments). The claim's ``slot_ms``
        is this host's now.

        Raises:
            BackendUnavailable: no connection; nothing was published.
        """
        with self._lock:
            now = self.now_ms()
            periods = max(1, math.ceil((keep_until_ms - now) / self.slot_ttl_ms))
            attempt = self._attempt(
                job,
                now,
                self.manual_queue(job, key),
                periods * self.slot_ttl_ms,
                manual_key=key,
            )
            self._take_gates([attempt])
            self._record_outcomes([attempt], State.CLAIMED)
            return self._claim_of(attempt)

    def take_run_now_guard(self, job: str, hold_ms: int) -> bool:
        """Take the guard: a claim on the gate ``<prefix><job>.manual.guard``
        whose one message expires ``hold_ms`` after it was accepted
        (``x-message-ttl``): the broker nacks every publish while the
        message is there, and accepts the first one after it expired. The
        gate itself expires ``slot_ttl`` (at least twice ``hold_ms``) after
        its last declare. Nothing is recorded in history.

        Returns:
            True on an ack; False on a nack, and when no confirm came (in
            doubt, nothing is sent).
        Raises:
            BackendUnavailable: no connection; nothing was published.
        """
        with self._lock:
            now = self.now_ms()
            queue = f"{self.prefix}{self.job_part(job)}.manual.guard"
            attempt = self._attempt(job, now, queue, max(self.slot_ttl_ms, 2 * hold_ms))
            attempt.gate = _Declare(
                queue, {**attempt.gate.arguments, "x-message-ttl": max(1, hold_ms)}
            )
            self._take_gates([attempt])
            return attempt.outcome == "won"

    # -- history -----------------------------------------------------------
