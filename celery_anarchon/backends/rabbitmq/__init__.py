"""RabbitMQ claim-only backend: a gate queue per slot, decided by publisher
confirms (``docs/backends/rabbitmq.md``).

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
:meth:`~RabbitMQBackend.record_many_if_absent`, ``lost`` when a confirm was lost.
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

from .backend import RabbitMQBackend, check_job, gate_arguments
from .history import fold_history, history_arguments
from .naming import MAX_QUEUE_NAME_BYTES

__all__ = [
    "MAX_QUEUE_NAME_BYTES",
    "RabbitMQBackend",
    "check_job",
    "fold_history",
    "gate_arguments",
    "history_arguments",
]
