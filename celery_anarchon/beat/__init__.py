"""The beat side: a thin Celery ``Scheduler`` over components that each own
their state (see docs/architecture.md).

* :mod:`.scheduler`: Celery's scheduler contract, lifecycle, and the tick
  that wires the parts below;
* :mod:`.link`: the claim backend and its outages;
* :mod:`.agenda`: the event heap, the :class:`~.agenda.Slot` record, first
  slots and the catch-up gap;
* :mod:`.claiming`: batch sizing, the claim, give-back;
* :mod:`.publisher`: Celery's producer, the bounded publish, the staleness
  rule;
* :mod:`.journal`: write-behind of ``sent``, ``missed``, ``skipped`` and
  ``lost`` records;
* :mod:`.takeover`: backup runners;
* :mod:`.overlap`: ``overlap='skip'``;
* :mod:`.registry`: heartbeat, peers, drift, the schedule fingerprint.

Nothing is imported here, so ``celery_anarchon.beat.registry`` can be read
(by :mod:`celery_anarchon.checks`) without loading the scheduler.
"""
