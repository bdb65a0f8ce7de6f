"""RabbitMQ claim-only backend: a gate queue per slot, decided by publisher
confirms (DESIGN section 4, "RabbitMQ: claim only").

How a slot is claimed
=====================

Every run gets a *gate queue* ``<prefix><job>.slot.<slot_ms>``, classic and
durable, declared with::

    x-queue-type = classic            (a vhost whose default queue type is
                                       quorum must not make gates quorum)
    x-max-length = 1                  the gate holds one message
    x-overflow   = reject-publish     a publish to a full gate is nacked
    x-expires    = slot_ttl (ms)      the gate is deleted slot_ttl after its
                                       last declare

Every instance declares the gate (same arguments: no error) and publishes one
persistent *claim message* to it through the default exchange, ``mandatory``,
on a channel in confirm mode on a connection of our own. The broker handles
the publishes one after another: the one that fills the gate is acked (won),
every later one is nacked (lost, reason ``"taken"``). Nobody consumes the
gate; it expires ``slot_ttl`` after the last instance declared it.

Broker rules relied on (RabbitMQ documentation pages):

* a publish to a queue at ``x-max-length`` with ``x-overflow=reject-publish``
  is nacked when publisher confirms are on -- "Queue Length Limit",
  https://www.rabbitmq.com/maxlength.html ("Overflow Behaviour");
* an unroutable ``mandatory`` publish is returned (``basic.return``) and then
  *acked*, so a gate that vanished must never read as a win --
  https://www.rabbitmq.com/confirms.html ("When Will Published Messages Be
  Confirmed by the Broker?");
* a persistent message routed to a durable queue is acked once it is
  persisted; acks and nacks may arrive out of publish order and may cover
  several delivery tags (``multiple``) -- same page;
* ``x-expires`` deletes a queue unused (no consumer, no ``basic.get``, not
  redeclared) for that long -- https://www.rabbitmq.com/ttl.html ("Queue
  TTL");
* redeclaring a queue with other arguments is a ``406 PRECONDITION_FAILED``
  channel error; a passive declare checks existence only --
  https://www.rabbitmq.com/queues.html ("Declaration and Property
  Equivalence"); after a channel error the broker discards everything sent
  on that channel until ``channel.close-ok`` (AMQP 0-9-1, ``channel.close``);
* ``x-queue-type`` chooses classic over a vhost's default queue type --
  https://www.rabbitmq.com/vhosts.html ("Default Queue Type");
* streams keep a byte budget by deleting whole segments, evaluated when a
  segment fills up -- https://www.rabbitmq.com/streams.html ("Data
  Retention").

What it guarantees, and what it does not
========================================

* One winner per ``(job, slot)`` while the gate lives: the broker orders the
  publishes. :meth:`RabbitMQBackend.check_job` refuses a job whose
  ``jitter + max_late + max_skew`` reaches ``slot_ttl``, since a late
  instance could claim again once the gate expired.
* A lost confirm (the connection drops after a publish, or no ack or nack
  arrives within ``confirm_timeout``) leaves the outcome unknown: the claim
  reads as lost (reason ``"unknown"``), a ``lost`` record is appended, the
  run may then not happen at all. That is the documented price of never
  running twice. A nack is never published again.
* No leases: no backup runners, overlap protection, catch-up or hand-over
  (``supports_leases = False``; :meth:`RabbitMQBackend.release` does
  nothing). The scheduler refuses settings that need them.
* One queue per run: a job every second keeps about ``slot_ttl`` gates alive
  (300 with the default), and brokers create queues at a few hundred per
  second, so very frequent jobs and large bursts belong on Redis.
* Broker resources (measured on RabbitMQ 3.10): a live gate holds about
  50 KB, two Erlang processes and one file descriptor (its queue index
  journal); a job's history stream about 100 KB, one process and two file
  descriptors that are never given back while it exists. A broker needs a
  file limit well above ``2 x jobs + live gates`` (RabbitMQ recommends at
  least 65,536 in production): at the common default of 1,024, a few
  hundred jobs exhaust it, and a broker that crashed holding more gates than
  its file handle limit was seen to stall while recovering them.

Queue names
===========

A job name made of letters, digits, ``_`` and ``-`` is used as it is. Any
other name (Celery's ``add_periodic_task`` makes names like
``proj.tasks.add(1, 2)``) becomes a safe form plus ``~`` and 12 hex digits of
the SHA-256 of the full name (:meth:`RabbitMQBackend.job_part`): ``~`` never
appears in a plain name, so no two jobs share a gate, and every queue name
stays within RabbitMQ's 255 bytes. History records carry the real name.

History
=======

One stream queue per job, ``<prefix><job>.history`` (``x-queue-type=stream``,
durable), trimmed by size only: ``x-max-length-bytes`` and a segment size
derived from ``history_size`` (:func:`history_arguments`). Records (JSON, one
message each) are appended as a run moves on: ``claimed`` on a win, then
whatever :meth:`~RabbitMQBackend.mark` is told, ``missed``/``skipped`` from
:meth:`~RabbitMQBackend.record_if_absent`, ``lost`` when a confirm was lost.
:meth:`~RabbitMQBackend.history` reads the whole stream without consuming it
and folds the records per run (:func:`fold_history`). A run whose runner
crashed keeps its last state (``running``): nothing can know it stopped.

Clock
=====

:meth:`~RabbitMQBackend.now_ms` is this host's clock: RabbitMQ offers no
clock a client can read cheaply, and a claim-only backend needs none (slot
identity never depends on a clock; gate expiry is a duration timed by the
broker).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import re
import secrets
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, ClassVar

import amqp
import kombu
from amqp import spec
from amqp.exceptions import AMQPError, ChannelError, NotFound, error_for_code

from ..exceptions import BackendUnavailable, ConfigurationError
from . import sanitize_url
from .base import AbsentRecord, Backend, Claim, ClaimRequest, RunRecord, State

__all__ = [
    "RabbitMQBackend",
    "check_job",
    "fold_history",
    "history_arguments",
]

logger = logging.getLogger(__name__)

#: Oldest RabbitMQ with stream queues (history needs them).
MIN_RABBITMQ = (3, 9)
#: Longest queue name RabbitMQ accepts, in UTF-8 bytes.
MAX_QUEUE_NAME_BYTES = 255
#: Longest suffix after the job part: ``.slot.`` plus a 20-digit slot.
_MAX_SUFFIX_BYTES = len(".slot.") + 20
#: A stream keeps its data in a directory named ``<vhost>_<queue>_<timestamp>``
#: (a 19-20 digit timestamp), and a file name has at most 255 bytes on Linux
#: file systems: a history stream named longer than that never confirms a
#: record (seen on RabbitMQ 3.10: ``failed to get tail of member``).
_STREAM_DIR_EXTRA_BYTES = 22
_HISTORY_SUFFIX = ".history"
#: Fewest bytes the prefix and vhost must leave for the job part.
_MIN_JOB_PART_BYTES = 32
#: Characters a job name may use as it is in a queue name.
_PLAIN_JOB = re.compile(r"[A-Za-z0-9_-]+")
_UNSAFE_RUN = re.compile(r"[^A-Za-z0-9_-]+")
#: Hex digits of SHA-256 appended to a mapped job name (and of a manual key).
_JOB_HASH_HEX = 12
_KEY_HASH_HEX = 16

#: Channels a claim batch is spread over. RabbitMQ creates queues faster from
#: several channels at once (measured here with 1,000 new gates: about 280/s
#: from one channel, 400-700/s from eight).
CLAIM_CHANNELS = 8

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

#: Delivery mode of a persistent message.
PERSISTENT = 2

#: States a record is written with only after the gate was won.
_GATE_STATES = frozenset({State.CLAIMED, State.MISSED, State.SKIPPED})

#: Errors that mean the connection is gone (socket, protocol, forced close).
_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (OSError, amqp.exceptions.ConnectionError)


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
    after it (DESIGN section 4). All durations in seconds (or timedelta).

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


def gate_arguments(ttl_ms: int) -> dict[str, Any]:
    """Arguments of a gate queue that expires ``ttl_ms`` ms after last use."""
    return {
        "x-queue-type": "classic",
        "x-max-length": 1,
        "x-overflow": "reject-publish",
        "x-expires": ttl_ms,
    }


def fold_history(records: Iterable[Mapping[str, Any]]) -> list[RunRecord]:
    """Fold appended history records into one :class:`RunRecord` per run.

    ``records`` are decoded stream messages in append order (fields of
    :meth:`RunRecord.as_dict`, empty ones left out). A run is one
    ``(slot_ms, token)``. Its state only moves forward, as the contract's
    ``mark`` does on lease backends (claimed, sent, running, then a finished
    state): a record that would move it back, or out of a finished state,
    is ignored, except that a late ``sent`` still fills in ``sent_at_ms``
    and ``task_id``. Other fields take the latest non-empty value.

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

#: How far along a run each state is (DESIGN section 5); finished states last.
_STATE_RANK = {
    State.CLAIMED: 0,
    State.MISSED: 0,
    State.SKIPPED: 0,
    State.SENT: 1,
    State.RUNNING: 2,
    State.SUCCEEDED: 3,
    State.FAILED: 3,
    State.LOST: 3,
    State.SUPERSEDED: 3,
}
_FINISHED_RANK = 3


def _merge(run: dict[str, Any], record: Mapping[str, Any]) -> None:
    """Fold one record into ``run`` (see :func:`fold_history`)."""
    fields = {k: v for k, v in record.items() if v is not None}
    if "state" in run:
        now, new = _STATE_RANK[State(run["state"])], _STATE_RANK[State(fields["state"])]
        if now == _FINISHED_RANK or new <= now:
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


def _seconds(value: float | timedelta | str) -> float:
    if isinstance(value, timedelta):
        return value.total_seconds()
    return float(value)


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


# -- a confirm-mode channel with its own books --------------------------------


class _ConfirmChannel(amqp.Channel):
    """A channel in confirm mode that pipelines declares and publishes and
    keeps its own books of the replies.

    py-amqp's own confirm support (``Connection(confirm_publish=True)``)
    applies to every channel of a connection and waits for each publish in
    turn; this channel sends many methods and then reads the replies as they
    come, through py-amqp's listener table (``_setup_listeners``):

    * ``declared``: ``queue.declare-ok`` replies since :meth:`send_declares`;
      a channel's methods are handled in order, so after a channel error the
      declare at that index is the one that failed;
    * ``confirmed``: delivery tag -> True (``basic.ack``) or False
      (``basic.nack``), ``multiple`` expanded; ``unconfirmed`` the tags still
      waiting;
    * ``returned``: message ids of publishes returned as unroutable
      (``basic.return`` comes before the ack of the same publish);
    * ``error``: the channel error the broker closed it with. Such a channel
      is answered ``close-ok`` and dropped, never reused, so no late ack is
      ever credited to a later publish.
    """

    def __init__(self, connection: amqp.Connection) -> None:
        self.declared = 0
        self.published = 0
        self.confirmed: dict[int, bool] = {}
        self.unconfirmed: set[int] = set()
        self.returned: set[str] = set()
        self.error: AMQPError | None = None
        super().__init__(connection)

    def _setup_listeners(self) -> None:
        super()._setup_listeners()
        self._callbacks[spec.Queue.DeclareOk] = self._on_declare_ok
        self._callbacks[spec.Channel.Close] = self._on_server_close

    @classmethod
    def opened(cls, connection: amqp.Connection) -> _ConfirmChannel:
        """A new channel on ``connection``, open and in confirm mode."""
        channel = cls(connection)
        channel.open()
        channel.confirm_select()
        return channel

    @property
    def usable(self) -> bool:
        """True while the channel is open and no error closed it."""
        return bool(self.is_open) and self.error is None

    def send_declares(self, items: Sequence[_Declare]) -> None:
        """Send ``queue.declare`` (durable, replies wanted) for each item
        without waiting; count replies in ``declared`` from zero."""
        self.declared = 0
        for item in items:
            # queue.declare: ticket, queue, passive, durable, exclusive,
            # auto_delete, nowait, arguments (AMQP 0-9-1; py-amqp's argsig).
            self.send_method(
                spec.Queue.Declare,
                "BsbbbbbF",
                (0, item.queue, item.passive, True, False, False, False, item.arguments),
            )

    def start_round(self) -> None:
        """Forget the replies of earlier rounds (nothing is outstanding)."""
        self.confirmed.clear()
        self.unconfirmed.clear()
        self.returned.clear()

    def publish(self, queue: str, body: bytes, message_id: str, *, mandatory: bool) -> int:
        """Publish a persistent JSON message to ``queue`` through the
        default exchange; returns its delivery tag on this channel."""
        message = amqp.Message(
            body,
            content_type="application/json",
            delivery_mode=PERSISTENT,
            message_id=message_id,
            app_id="celery-anarchon",
        )
        self.basic_publish(message, exchange="", routing_key=queue, mandatory=mandatory)
        self.published += 1
        self.unconfirmed.add(self.published)
        return self.published

    def _on_declare_ok(self, *_: Any) -> None:
        self.declared += 1

    def _on_basic_ack(self, delivery_tag: int, multiple: bool) -> None:
        self._settle(delivery_tag, multiple, True)

    def _on_basic_nack(self, delivery_tag: int, multiple: bool) -> None:
        self._settle(delivery_tag, multiple, False)

    def _on_basic_return(
        self, reply_code: int, reply_text: str, exchange: str, routing_key: str, message: Any
    ) -> None:
        message_id = message.properties.get("message_id")
        logger.debug("broker returned a publish to %r: %s %s", routing_key, reply_code, reply_text)
        if message_id:
            self.returned.add(str(message_id))

    def _settle(self, delivery_tag: int, multiple: bool, ok: bool) -> None:
        if multiple:
            tags = [t for t in self.unconfirmed if delivery_tag == 0 or t <= delivery_tag]
        else:
            tags = [delivery_tag]
        for tag in tags:
            self.unconfirmed.discard(tag)
            self.confirmed.setdefault(tag, ok)

    def _on_server_close(
        self, reply_code: int, reply_text: str, class_id: int, method_id: int
    ) -> None:
        # py-amqp would reopen the channel and raise from drain_events; we
        # answer close-ok, keep the error, and drop the channel instead.
        self.error = error_for_code(reply_code, reply_text, (class_id, method_id), ChannelError)
        self.send_method(spec.Channel.CloseOk)
        self.collect()


@dataclass
class _Declare:
    """One queue to declare, actively (with arguments) or passively."""

    queue: str
    arguments: dict[str, Any]
    passive: bool = False
    tries: int = 0


class _Lane:
    """One channel and the queues declared on it, in order.

    ``start`` is the index of the first item sent on the current channel;
    after a channel error at ``start + channel.declared`` the lane takes a new
    channel from ``new_channel`` and sends the rest again.
    """

    def __init__(self, new_channel: Callable[[], _ConfirmChannel], items: list[_Declare]) -> None:
        self.new_channel = new_channel
        self.channel = new_channel()
        self.items = items
        self.start = 0

    def send(self) -> None:
        self.channel.send_declares(self.items[self.start :])

    @property
    def settled(self) -> bool:
        """All declares answered, or the channel failed."""
        return self.channel.error is not None or self.failed_at >= len(self.items)

    @property
    def failed_at(self) -> int:
        return self.start + self.channel.declared


@dataclass
class _Attempt:
    """One gate this call publishes to, and what came of it."""

    job: str
    slot_ms: int
    gate: _Declare
    token: str
    body: bytes
    lane: int = 0
    tag: int = 0
    #: ``won``, ``taken`` (nacked), ``returned`` (no gate), ``unknown``.
    outcome: str = "unknown"
    why: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


# -- the backend --------------------------------------------------------------


class RabbitMQBackend(Backend):
    """Claim-only backend on RabbitMQ 3.9+: gate queues and publisher
    confirms (see the module docstring for the mechanism and its limits).

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

    supports_leases: ClassVar[bool] = False
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

    @staticmethod
    def _check_names(prefix: str, vhost: str) -> int:
        """Bytes left for the job part of queue names under ``prefix`` in
        ``vhost``: every gate name within 255 bytes, every history stream's
        directory name (vhost, name, timestamp) too.

        Raises:
            ConfigurationError: a reserved prefix, or fewer than 32 bytes left.
        """
        if prefix.startswith("amq."):
            raise ConfigurationError(
                f"anarchon_backend_options: prefix {prefix!r} starts with 'amq.', which "
                "RabbitMQ reserves for its own queues; choose another prefix (default 'cron.')."
            )
        fixed = len(prefix.encode("utf-8"))
        stream_extra = len(vhost.encode("utf-8")) + _STREAM_DIR_EXTRA_BYTES + len(_HISTORY_SUFFIX)
        room = MAX_QUEUE_NAME_BYTES - fixed - max(_MAX_SUFFIX_BYTES, stream_extra)
        if room < _MIN_JOB_PART_BYTES:
            raise ConfigurationError(
                f"anarchon_backend_options: prefix {prefix!r} is too long for vhost "
                f"{vhost!r}: queue names (and a stream's directory name, which holds the "
                f"vhost too) are limited to {MAX_QUEUE_NAME_BYTES} bytes and must leave "
                f"{_MIN_JOB_PART_BYTES} bytes for the job; shorten the prefix."
            )
        return room

    def _dialer(
        self, url: str | None, client: Any
    ) -> tuple[Callable[[], amqp.Connection], str, str]:
        """A function opening a new connection of our own, where it goes
        (credentials masked) and its vhost. Nothing connects here."""
        if client is None:
            url = url or "amqp://localhost"
            kombu_conn = kombu.Connection(
                url,
                connect_timeout=self.confirm_timeout,
                transport_options={"client_properties": self._client_properties},
            )
            dial = self._kombu_dialer(kombu_conn)
            return dial, sanitize_url(url), str(kombu_conn.virtual_host or "/")
        if isinstance(client, kombu.Connection):
            ours = self._clone(client)
            dial = self._kombu_dialer(ours)
            return dial, sanitize_url(client.as_uri()), str(ours.virtual_host or "/")
        if isinstance(client, amqp.Connection):
            where = f"amqp://{client.host}/{client.virtual_host}"
            return self._amqp_dialer(client), where, str(client.virtual_host)
        raise ConfigurationError(
            f"anarchon_backend: cannot use a {type(client).__name__} as a RabbitMQ "
            "connection; pass a kombu Connection or a py-amqp Connection."
        )

    def _clone(self, client: kombu.Connection) -> kombu.Connection:
        """A connection of our own with the parameters of the user's kombu
        ``client``, without py-amqp's per-publish ``confirm_publish``."""
        if client.transport.driver_type != "amqp":
            raise ConfigurationError(
                f"anarchon_backend: the kombu Connection given uses the "
                f"{client.transport.driver_type!r} transport; the RabbitMQ backend needs "
                "an AMQP one (amqp://, amqps://, pyamqp://)."
            )
        options = dict(client.transport_options or {})
        options.pop("confirm_publish", None)
        options["client_properties"] = self._client_properties
        ours: kombu.Connection = client.clone(
            transport_options=options, connect_timeout=self.confirm_timeout
        )
        return ours

    @staticmethod
    def _kombu_dialer(kombu_conn: kombu.Connection) -> Callable[[], amqp.Connection]:
        def dial() -> amqp.Connection:
            conn: amqp.Connection = kombu_conn.transport.establish_connection()
            return conn

        return dial

    def _amqp_dialer(self, client: amqp.Connection) -> Callable[[], amqp.Connection]:
        def dial() -> amqp.Connection:
            conn = amqp.Connection(
                host=client.host,
                authentication=client.authentication,
                virtual_host=client.virtual_host,
                ssl=client.ssl,
                connect_timeout=self.confirm_timeout,
                client_properties=self._client_properties,
            )
            conn.connect()
            return conn

        return dial

    def describe(self) -> str:
        """The backend for logs and banners, credentials masked."""
        return (
            f"RabbitMQBackend({self._where}, prefix={self.prefix!r}, "
            f"slot_ttl={self.slot_ttl:g}s, claim-only)"
        )

    # -- names -----------------------------------------------------------

    def job_part(self, job: str) -> str:
        """The job's part of its queue names.

        ``job`` itself when it uses only letters, digits, ``_`` and ``-`` and
        fits; else its unsafe runs replaced by ``_``, cut to fit, plus ``~``
        and 12 hex digits of ``sha256(job)`` (e.g. ``proj.tasks.add(1, 2)``
        -> ``proj_tasks_add_1_2_~<hash>``).
        """
        room = self._job_room
        if _PLAIN_JOB.fullmatch(job) and len(job) <= room:
            return job
        digest = hashlib.sha256(job.encode("utf-8")).hexdigest()[:_JOB_HASH_HEX]
        safe = _UNSAFE_RUN.sub("_", job)
        return f"{safe[: room - _JOB_HASH_HEX - 1]}~{digest}"

    def gate_queue(self, job: str, slot_ms: int) -> str:
        """The gate queue of one slot: ``<prefix><job>.slot.<slot_ms>``."""
        return f"{self.prefix}{self.job_part(job)}.slot.{int(slot_ms)}"

    def manual_queue(self, job: str, key: str) -> str:
        """The gate queue of a manual run: ``<prefix><job>.manual.<hash>``."""
        digest = hashlib.sha256(key.encode("utf-8")).hexdigest()[:_KEY_HASH_HEX]
        return f"{self.prefix}{self.job_part(job)}.manual.{digest}"

    def history_queue(self, job: str) -> str:
        """The job's history stream: ``<prefix><job>.history``."""
        return f"{self.prefix}{self.job_part(job)}{_HISTORY_SUFFIX}"

    # -- connection ------------------------------------------------------

    def open(self) -> None:
        """Connect (idempotent) and check the broker version.

        Raises:
            BackendUnavailable: the broker cannot be reached in
                ``confirm_timeout`` seconds.
            ConfigurationError: the broker refused the login or the vhost,
                or is older than RabbitMQ 3.9 (no streams).
        """
        with self._lock:
            try:
                conn = self._connection()
            except BackendUnavailable as exc:
                refused = exc.__cause__
                if isinstance(refused, AMQPError) and refused.reply_code in (403, 530):
                    raise ConfigurationError(
                        f"anarchon_backend {self._where}: the broker refused the login or "
                        f"virtual host ({refused.reply_text}); check the user, password and "
                        "vhost in the URL and the user's permissions."
                    ) from refused
                raise
            self._check_version(conn)

    def _check_version(self, conn: amqp.Connection) -> None:
        raw = conn.server_properties.get("version", "")
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        numbers = tuple(int(n) for n in re.findall(r"\d+", text)[:2])
        if len(numbers) == 2 and numbers < MIN_RABBITMQ:
            raise ConfigurationError(
                f"anarchon_backend {self._where}: RabbitMQ {text} has no stream queues, "
                "which the RabbitMQ backend keeps history in; upgrade to RabbitMQ 3.9 or "
                "newer, or choose a Redis or SQL backend."
            )

    def close(self) -> None:
        """Close our connection (never the user's). Safe to call twice."""
        with self._lock:
            conn, self._conn = self._conn, None
            self._forget_channels()
            if conn is None:
                return
            try:
                with conn.transport.having_timeout(self.confirm_timeout):
                    conn.close()
            except Exception:  # closing a broken connection: drop it
                conn.collect()

    def _connection(self) -> amqp.Connection:
        """Our open connection, connecting first when there is none.

        Raises:
            BackendUnavailable: cannot connect.
        """
        if self._conn is not None and self._conn.connected:
            return self._conn
        self._drop()
        try:
            self._conn = self._dial()
        except (*_CONNECTION_ERRORS, AMQPError) as exc:
            raise BackendUnavailable(
                f"RabbitMQ backend: cannot connect to {self._where}: {exc}"
            ) from exc
        logger.debug("connected to %s", self._where)
        return self._conn

    def _drop(self) -> None:
        """Forget the connection without a handshake (it may be dead): no
        late reply on it can reach a later call."""
        conn, self._conn = self._conn, None
        self._forget_channels()
        if conn is not None:
            conn.collect()

    def _forget_channels(self) -> None:
        self._claim_channels.clear()
        self._history_ch = None
        self._streams.clear()
        self._stream_chs.clear()

    def _claim_channel(self, lane: int) -> _ConfirmChannel:
        channel = self._claim_channels.get(lane)
        if channel is None or not channel.usable:
            channel = _ConfirmChannel.opened(self._connection())
            self._claim_channels[lane] = channel
        return channel

    def _history_channel(self) -> _ConfirmChannel:
        if self._history_ch is None or not self._history_ch.usable:
            self._history_ch = _ConfirmChannel.opened(self._connection())
        return self._history_ch

    def _stream_channel(self, lane: int) -> _ConfirmChannel:
        if lane == 0:
            return self._history_channel()
        channel = self._stream_chs.get(lane)
        if channel is None or not channel.usable:
            channel = _ConfirmChannel.opened(self._connection())
            self._stream_chs[lane] = channel
        return channel

    def _drain_until(self, done: Callable[[], bool]) -> None:
        """Read frames until ``done()``.

        Raises:
            TimeoutError: no frame for ``confirm_timeout`` seconds.
            OSError, amqp ConnectionError: the connection failed.
        """
        conn = self._conn
        while not done():
            if conn is None or not conn.connected:
                raise amqp.exceptions.RecoverableConnectionError("connection lost")
            conn.drain_events(timeout=self.confirm_timeout)

    # -- declaring ---------------------------------------------------------

    def _declare(self, lanes: Sequence[_Lane]) -> None:
        """Declare every lane's queues, pipelined per lane.

        A queue that exists with other arguments (406, e.g. another
        instance's ``slot_ttl``) is used as it is: declared again passively
        on a new channel. A passive declare of a queue that expired
        meanwhile (404) is made active again.

        Raises:
            BackendUnavailable: another channel error, or one queue failing
                three times.
            TimeoutError, OSError, amqp ConnectionError: from the connection.
        """
        for lane in lanes:
            lane.send()
        while True:
            self._drain_until(lambda: all(lane.settled for lane in lanes))
            broken = [lane for lane in lanes if lane.channel.error is not None]
            if not broken:
                return
            for lane in broken:
                self._recover(lane)

    def _recover(self, lane: _Lane) -> None:
        error = lane.channel.error
        assert error is not None
        item = lane.items[lane.failed_at]
        item.tries += 1
        if item.tries > 3 or error.reply_code not in (404, 406):
            raise BackendUnavailable(
                f"RabbitMQ backend: declaring queue {item.queue!r} failed: {error.reply_text}"
            ) from error
        if error.reply_code == 406:
            logger.info(
                "queue %s exists with other arguments (%s); using it as it is",
                item.queue,
                error.reply_text,
            )
        item.passive = error.reply_code == 406
        lane.start = lane.failed_at
        lane.channel = lane.new_channel()
        lane.send()

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
            logger.info("won %s (%s)", run, won_state)
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
            logger.debug("lost %s: taken by another instance", run)
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

    def record_if_absent(
        self,
        job: str,
        slot_ms: int,
        state: State,
        *,
        error: str | None = None,
        history_size: int = 100,
        history_ttl_ms: int = 7 * 24 * 3600 * 1000,
        keep_until_ms: int = 0,
    ) -> bool:
        """Record ``state`` (``missed`` or ``skipped``) for a slot nobody
        claimed, and close the slot.

        The slot's gate is claimed like any run: if this instance's publish
        fills it, nobody had claimed the slot, so the record is appended and
        no one can claim it any more. ``history_ttl_ms`` and
        ``keep_until_ms`` are ignored (trimming is by size; gates live
        ``slot_ttl``).

        Returns:
            True when the gate was free and the record was appended; False
            when the slot was taken, or when the outcome is unknown (logged).
        Raises:
            BackendUnavailable: no connection; nothing was published.
        """
        record = AbsentRecord(job, slot_ms, State(state), error, history_size)
        return self.record_many_if_absent([record])[0]

    def record_many_if_absent(self, records: Sequence[AbsentRecord]) -> list[bool]:
        """:meth:`record_if_absent` for many slots: their gates claimed as one
        batch (as :meth:`claim` does), the records appended per state.

        Returns:
            one answer per record, in order (see :meth:`record_if_absent`).
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

    def release(self, claims: Sequence[Claim]) -> None:
        """Do nothing: a gate cannot be given back (claim-only)."""

    # -- history -----------------------------------------------------------

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

    def now_ms(self) -> int:
        """This host's clock, epoch ms (RabbitMQ has no clock to read)."""
        return _now_ms()


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


def _positive(name: str, value: float | timedelta | str) -> float:
    try:
        seconds = _seconds(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if not seconds > 0 or math.isinf(seconds):
        raise ConfigurationError(
            f"anarchon_backend_options: {name}={value!r} is not a positive number of "
            f"seconds; give e.g. {name}=300."
        )
    return seconds
