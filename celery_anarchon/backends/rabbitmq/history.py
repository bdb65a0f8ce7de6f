"""History of the RabbitMQ backend: one stream queue per job, records
appended as a run moves on, read whole and folded per run."""

from __future__ import annotations

import functools
import json
import logging
import secrets
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import amqp
from amqp.exceptions import AMQPError, NotFound

from ...exceptions import BackendUnavailable
from ..base import FINAL_RANK, Claim, RunRecord, State
from .channel import _ConfirmChannel, _Declare, _Lane
from .connection import _CONNECTION_ERRORS, CLAIM_CHANNELS, RabbitMQConnection

logger = logging.getLogger(__name__)

#: States a record is written with only after the gate was won.
_GATE_STATES = frozenset({State.CLAIMED, State.MISSED, State.SKIPPED})


#: History stream sizing (see :func:`history_arguments`): records a run
#: appends at most (claimed, sent, running, succeeded), and the bytes one
#: record takes on disk besides the job name (JSON without empty fields,
#: about 200 bytes, plus about 160 bytes of AMQP properties and chunk header,
#: measured on RabbitMQ 3.10).
RECORDS_PER_RUN = 4


RECORD_BYTES = 400


#: Smallest stream segment we ask for, bytes.
MIN_SEGMENT_BYTES = 4096


#: Reading history: prefetch (streams need one), the quiet time after a
#: delivery after which the stream is taken as read to its end (seconds;
#: RabbitMQ sends no end-of-stream signal to an AMQP 0-9-1 consumer), and the
#: longest read.
READ_PREFETCH = 1000


READ_IDLE_S = 0.2


READ_MAX_S = 10.0


#: Most history streams :meth:`RabbitMQHistory.history_many` reads at once
#: (a channel each; RabbitMQ allows 2047 per connection by default).
READ_STREAMS = 100


def history_arguments(history_size: int, job: str = "") -> dict[str, Any]:
    """Arguments of a job's history stream for ``history_size`` runs.

    A stream deletes whole segments, oldest first, once its size passes
    ``x-max-length-bytes``, so it keeps between ``max - segment`` and ``max``
    bytes. We want at least ``history_size`` runs of ``RECORDS_PER_RUN``
    records of ``RECORD_BYTES + len(job)`` bytes (``retained``), so::

        segment = max(MIN_SEGMENT_BYTES, retained // 3)
        max     = retained + segment

    e.g. 100 runs of a 20-byte job name: 168,000 bytes kept at least, at most
    224,000 bytes on disk. Source: https://www.rabbitmq.com/streams.html
    ("Data Retention").

    Returns:
        the ``queue.declare`` arguments (``x-queue-type``,
        ``x-max-length-bytes``, ``x-stream-max-segment-size-bytes``).
    """
    record_bytes = RECORD_BYTES + len(job.encode("utf-8"))
    retained = max(1, history_size) * RECORDS_PER_RUN * record_bytes
    segment = max(MIN_SEGMENT_BYTES, retained // 3)
    return {
        "x-queue-type": "stream",
        "x-max-length-bytes": retained + segment,
        "x-stream-max-segment-size-bytes": segment,
    }


def fold_history(records: Iterable[Mapping[str, Any]]) -> list[RunRecord]:
    """Fold appended history records into one :class:`RunRecord` per run.

    ``records`` are decoded stream messages in append order (fields of
    :meth:`RunRecord.as_dict`, empty ones left out). A run is one
    ``(slot_ms, token)``. Its state only moves forward, as the contract's
    ``mark`` does on lease backends (claimed, sent, running, then a finished
    state): a record that would move it back, or out of a finished state,
    is ignored, except that a late ``sent`` still fills in ``sent_at_ms``
    and ``task_id``. ``instance`` stays the run's first (the beat that
    claimed it, as a lease backend's owner: the worker integration appends
    ``running`` and the finish under the worker's own id). Other fields
    take the latest non-empty value.

    When a slot has a record written only by the gate's winner
    (``claimed``, ``missed``, ``skipped``), records of other tokens for that
    slot are dropped: they come from instances whose confirm was lost but
    whose publish was in fact nacked.

    Returns:
        runs newest slot first (ties: newest claim first). Records that do
        not parse are skipped.
    """
    parsed = [r for r in records if _valid_record(r)]
    winners: dict[int, set[str]] = defaultdict(set)
    for r in parsed:
        if r["state"] in _GATE_STATES:
            winners[r["slot_ms"]].add(str(r.get("token")))
    runs: dict[tuple[int, str], dict[str, Any]] = {}
    for r in parsed:
        slot, token = r["slot_ms"], str(r.get("token"))
        if winners[slot] and token not in winners[slot]:
            continue
        _merge(runs.setdefault((slot, token), {}), r)
    folded = [_run_record(fields) for fields in runs.values()]
    folded.sort(key=lambda r: (r.slot_ms, r.claimed_at_ms or 0), reverse=True)
    return folded


_RECORD_FIELDS = frozenset(RunRecord.__dataclass_fields__)


def _merge(run: dict[str, Any], record: Mapping[str, Any]) -> None:
    """Fold one record into ``run`` (see :func:`fold_history`)."""
    fields = {k: v for k, v in record.items() if v is not None}
    if run.get("instance") is not None:
        fields.pop("instance", None)  # the claimer's, kept
    if "state" in run:
        now, new = State(run["state"]).rank, State(fields["state"]).rank
        if now == FINAL_RANK or new <= now:
            if fields["state"] == State.SENT.value:
                run.update({k: fields[k] for k in ("sent_at_ms", "task_id") if k in fields})
            return
    run.update(fields)


def _valid_record(r: Mapping[str, Any]) -> bool:
    return (
        isinstance(r, Mapping)
        and isinstance(r.get("job"), str)
        and isinstance(r.get("slot_ms"), int)
        and r.get("state") in State._value2member_map_
    )


def _run_record(fields: Mapping[str, Any]) -> RunRecord:
    kept = {k: v for k, v in fields.items() if k in _RECORD_FIELDS}
    kept["state"] = State(kept["state"])
    return RunRecord(**kept)


def _encode(record: RunRecord) -> bytes:
    fields = {k: v for k, v in record.as_dict().items() if v is not None}
    return json.dumps(fields, separators=(",", ":")).encode()


def _decode(body: bytes | str) -> list[dict[str, Any]]:
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        logger.debug("skipping a history message that is not JSON")
        return []
    return [value] if isinstance(value, dict) else []


class RabbitMQHistory(RabbitMQConnection):
    """Appending to and reading the history streams.

    :meth:`~Backend.state_counts` and :meth:`~Backend.jobs_with_state` keep
    the default (each job's history read, then counted here): a job's
    records are in its own stream, and nothing indexes records of every
    job by slot time or state.
    """

    #: history_size last asked for each job (to declare its stream later).
    _history_sizes: dict[str, int]

    def mark(
        self,
        claim: Claim,
        state: State,
        *,
        task_id: str | None = None,
        error: str | None = None,
    ) -> bool:
        """Append ``state`` for a won claim to the job's history.

        Sets ``sent_at_ms`` for SENT, ``started_at_ms`` for RUNNING,
        ``finished_at_ms`` for SUCCEEDED, FAILED and LOST (this host's
        clock), and ``task_id`` / ``error`` when given.

        Returns:
            True always: a claim-only backend has no token to check.
        Raises:
            BackendUnavailable: the record could not be appended (no
                connection, no confirm within ``confirm_timeout``).
        """
        with self._lock:
            self._append([self._mark_record(claim, state, self.now_ms(), task_id, error)])
        return True

    def mark_many(
        self,
        claims: Sequence[Claim],
        state: State,
        *,
        task_ids: Sequence[str | None] | None = None,
    ) -> list[bool]:
        """:meth:`mark` for many claims: one append of all the records to
        their jobs' history streams, the confirms read together.

        Returns:
            True for each claim (no token to check).
        Raises:
            ValueError: ``task_ids`` is not as long as ``claims``.
            BackendUnavailable: as :meth:`mark`; the whole call may be sent
                again (a repeated record folds into the same run).
        """
        ids = [None] * len(claims) if task_ids is None else list(task_ids)
        if len(ids) != len(claims):
            raise ValueError(f"{len(ids)} task ids for {len(claims)} claims")
        if not claims:
            return []
        now = self.now_ms()
        records = [
            self._mark_record(claim, State(state), now, task_id, None)
            for claim, task_id in zip(claims, ids, strict=True)
        ]
        with self._lock:
            self._append(records)
        return [True] * len(claims)

    def _mark_record(
        self, claim: Claim, state: State, now: int, task_id: str | None, error: str | None
    ) -> RunRecord:
        finished = state in (State.SUCCEEDED, State.FAILED, State.LOST)
        return RunRecord(
            job=claim.job,
            slot_ms=claim.slot_ms,
            state=state,
            instance=self.instance,
            token=claim.token,
            sent_at_ms=now if state is State.SENT else None,
            started_at_ms=now if state is State.RUNNING else None,
            finished_at_ms=now if finished else None,
            task_id=task_id,
            error=error,
        )

    def _append(self, records: Sequence[RunRecord]) -> None:
        """Publish ``records`` to their jobs' history streams (declared
        first where needed) and wait for their confirms.

        Raises:
            BackendUnavailable: no connection, no confirm within
                ``confirm_timeout``, a stream refused a record.
        """
        try:
            channel = self._declare_streams({r.job for r in records})
            channel.start_round()
            for record in records:
                channel.publish(
                    self.history_queue(record.job),
                    _encode(record),
                    f"{self.instance}/{secrets.token_hex(6)}",
                    mandatory=False,
                )
            self._drain_until(lambda: channel.error is not None or not channel.unconfirmed)
        except TimeoutError as exc:
            self._drop()
            raise BackendUnavailable(
                f"RabbitMQ backend: no confirm for history records within "
                f"{self.confirm_timeout:g} s"
            ) from exc
        except (*_CONNECTION_ERRORS, AMQPError) as exc:
            self._drop()
            raise BackendUnavailable(f"RabbitMQ backend: appending history failed: {exc}") from exc
        if channel.error is not None or not all(channel.confirmed.values()):
            raise BackendUnavailable(
                f"RabbitMQ backend: a history stream refused a record ({channel.error or 'nack'})"
            ) from channel.error

    def _declare_streams(self, jobs: Iterable[str]) -> _ConfirmChannel:
        """The history channel, after declaring the streams of ``jobs`` not
        yet declared on this connection, pipelined over up to
        ``CLAIM_CHANNELS`` channels: the broker creates streams several
        times faster from several channels at once (measured here: 100 new
        streams in 1.3 to 1.8 s from one channel, 0.3 to 0.6 s from
        eight), and a job's first claim creates its stream."""
        todo = [job for job in sorted(jobs) if self.history_queue(job) not in self._streams]
        items = [
            _Declare(
                self.history_queue(job),
                history_arguments(self._history_sizes.get(job, 100), job),
            )
            for job in todo
        ]
        if items:
            count = min(CLAIM_CHANNELS, len(items))
            lanes = [
                _Lane(functools.partial(self._stream_channel, index), items[index::count])
                for index in range(count)
            ]
            self._declare(lanes)
            self._streams.update(item.queue for item in items)
        return self._history_channel()

    def history(self, job: str, limit: int | None = None) -> list[RunRecord]:
        """The job's runs, newest slot first, at most ``limit``.

        Reads the job's history stream from its first kept record without
        consuming it (``x-stream-offset=first``, manual acks, prefetch
        ``READ_PREFETCH``) until no record arrives for ``READ_IDLE_S``
        seconds (so a call takes at least that long), then folds the records
        per run (:func:`fold_history`). A job without a stream reads as
        empty at once.

        Raises:
            BackendUnavailable: no connection or it failed while reading.
        """
        with self._lock:
            try:
                messages = self._read_stream(self.history_queue(job))
            except (*_CONNECTION_ERRORS, AMQPError) as exc:
                self._drop()
                raise BackendUnavailable(
                    f"RabbitMQ backend: reading history failed: {exc}"
                ) from exc
        runs = fold_history(messages)
        return runs if limit is None else runs[:limit]

    def history_many(
        self, jobs: Sequence[str], limit: int | None = None, *, since_ms: int | None = None
    ) -> dict[str, list[RunRecord]]:
        """:meth:`history` of many jobs: their streams read together, up to
        :data:`READ_STREAMS` at a time, each on a channel of its own on one
        connection, so the quiet time that ends a read (``READ_IDLE_S``) is
        waited once per group, not once per job. Each stream still costs its
        own channel, declare and consume (a stream per job is how this
        backend keeps history); ``since_ms`` is applied after the fold.
        See :meth:`Backend.history_many`.

        Raises:
            BackendUnavailable: no connection or it failed while reading.
        """
        found: dict[str, list[RunRecord]] = {job: [] for job in jobs}
        if limit is not None and limit <= 0:
            return found
        names = list(found)
        with self._lock:
            try:
                for start in range(0, len(names), READ_STREAMS):
                    chunk = names[start : start + READ_STREAMS]
                    read = self._read_streams([self.history_queue(job) for job in chunk])
                    for job, messages in zip(chunk, read, strict=True):
                        runs = fold_history(messages)
                        if since_ms is not None:
                            runs = [r for r in runs if r.slot_ms >= since_ms]
                        found[job] = runs if limit is None else runs[:limit]
            except (*_CONNECTION_ERRORS, AMQPError) as exc:
                self._drop()
                raise BackendUnavailable(
                    f"RabbitMQ backend: reading history failed: {exc}"
                ) from exc
        return found

    def _read_streams(self, queues: Sequence[str]) -> list[list[dict[str, Any]]]:
        """The records of each of ``queues`` (history streams), read as
        :meth:`_read_stream` reads one, all at once: until every stream that
        exists delivered a record and then none came for ``READ_IDLE_S``
        seconds (``confirm_timeout`` for the first, ``READ_MAX_S`` in all)."""
        conn = self._connection()
        records: list[list[dict[str, Any]]] = [[] for _ in queues]
        channels = []
        waiting = []
        try:
            for index, queue in enumerate(queues):
                channel = conn.channel()
                channels.append(channel)
                try:
                    channel.queue_declare(queue, passive=True)
                except NotFound:  # the broker closed the channel: no stream, no history
                    continue
                waiting.append(records[index])
                channel.basic_qos(0, READ_PREFETCH, False)

                def on_message(
                    message: amqp.Message, into: list[dict[str, Any]] = records[index]
                ) -> None:
                    into.extend(_decode(message.body))
                    message.channel.basic_ack(message.delivery_tag)

                channel.basic_consume(
                    queue, callback=on_message, arguments={"x-stream-offset": "first"}
                )
            deadline = time.monotonic() + READ_MAX_S
            while waiting and time.monotonic() < deadline:
                started = all(waiting)
                try:
                    conn.drain_events(timeout=READ_IDLE_S if started else self.confirm_timeout)
                except TimeoutError:
                    if started:
                        break
                    return records  # a stream that never delivered: read as it stands
        finally:
            for channel in channels:
                if channel.is_open:
                    channel.close()
        return records

    def _read_stream(self, queue: str) -> list[dict[str, Any]]:
        conn = self._connection()
        channel = conn.channel()
        records: list[dict[str, Any]] = []
        try:
            try:
                channel.queue_declare(queue, passive=True)
            except NotFound:
                return []
            channel.basic_qos(0, READ_PREFETCH, False)

            def on_message(message: amqp.Message) -> None:
                records.extend(_decode(message.body))
                channel.basic_ack(message.delivery_tag)

            channel.basic_consume(
                queue, callback=on_message, arguments={"x-stream-offset": "first"}
            )
            self._read_until_idle(conn, records)
        finally:
            if channel.is_open:
                channel.close()
        return records

    def _read_until_idle(self, conn: amqp.Connection, records: list[dict[str, Any]]) -> None:
        """Read deliveries until none comes for ``READ_IDLE_S`` seconds after
        the first one, or ``confirm_timeout`` seconds before it (a stream
        that exists holds at least one record; the broker may be slow to read
        it from disk), or ``READ_MAX_S`` seconds in all."""
        deadline = time.monotonic() + READ_MAX_S
        wait = self.confirm_timeout
        while time.monotonic() < deadline:
            try:
                conn.drain_events(timeout=wait)
            except TimeoutError:
                return
            if records:
                wait = READ_IDLE_S
