"""Transparent parking: a Celery task class whose ``apply_async`` parks a
long ``countdown`` or ``eta`` instead of sending it (docs/delayed-tasks.md,
"Parking countdowns transparently").

Opt-in twice: the setting ``anarchon_park_countdown_over`` (seconds, or a
timedelta; None, the default, parks nothing) and the task class
:class:`ParkingTask`, per task (``@app.task(base=ParkingTask)``) or for the
whole app (``Celery("proj", task_cls="celery_anarchon.delayed.parking:ParkingTask")``).

A call whose countdown (or eta) is more than the threshold away is given to
:func:`celery_anarchon.delayed.park` with the same task id, arguments and
options, and returns ``AsyncResult(task_id)``; any other call is Celery's
own ``apply_async``. Under ``task_always_eager`` every call runs eagerly, as
Celery runs it. ``self.retry(countdown=...)`` goes through ``apply_async``
too, so a long retry is parked with its ``retries`` count; the worker gate
marks a released retry by ``(task id, retries)``
(:meth:`celery_anarchon.worker.WorkerIntegration._gate_released`).

This module sits above the package's public API (it calls
:func:`~celery_anarchon.delayed.park`), so the package does not import it:
name it ``celery_anarchon.delayed.parking``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from celery import Task

from ..exceptions import ConfigurationError
from ..times import iso, seconds
from . import OPTIONS, PENDING, park, store_for

__all__ = ["SETTING", "ParkingSettings", "ParkingTask", "parking_settings"]

logger = logging.getLogger(__name__)

#: The setting: park a countdown or eta further away than this, seconds.
SETTING = "anarchon_park_countdown_over"

#: The per-call option that sends a call with Celery's own countdown,
#: whatever the threshold: ``apply_async(countdown=7200, anarchon_park=False)``.
PARK_OPTION = "anarchon_park"

#: ``apply_async`` options that only say how to publish the message now.
#: A parked call publishes nothing now; its release publishes with the
#: releaser's own connection and retries until the broker takes it, so
#: these have nothing left to do and are not kept.
PUBLISH_ONLY = frozenset({"producer", "connection", "publisher", "retry", "retry_policy"})

#: What a retry's options carry from the delivery it retries (Celery's
#: ``signature_from_request`` merges ``delivery_info``): whether that
#: delivery was a redelivery. It describes the old message, not the retry's.
DELIVERY_ONLY = frozenset({"redelivered"})

#: Longest wait for the store to let go of a task id still in flight under
#: a releaser (a retry parked before the release of its first attempt was
#: deleted), seconds.
IN_FLIGHT_WAIT_S = 60.0


@dataclass(frozen=True)
class ParkingSettings:
    """The transparent parking settings, read once per app and process.

    Attributes:
        countdown_over_s: park a call whose countdown or eta is more than
            this many seconds away (``anarchon_park_countdown_over``); None:
            park nothing (the default).
    """

    countdown_over_s: float | None = None

    @classmethod
    def from_app(cls, app: Any) -> ParkingSettings:
        """Read ``app.conf``.

        Raises:
            ConfigurationError: the threshold is not None, a number of
                seconds >= 0 or a timedelta, or is not finite.
        """
        value = app.conf.get(SETTING)
        if value is None:
            return cls()
        if isinstance(value, str):
            raise ConfigurationError(
                f"{SETTING}={value!r}: give seconds as a number (600) or a timedelta "
                "(timedelta(minutes=10)), not text; None turns parking off."
            )
        over = seconds(value, setting=SETTING)
        if not math.isfinite(over):
            raise ConfigurationError(
                f"{SETTING}={value!r}: must be a finite number of seconds; None turns parking off."
            )
        return cls(countdown_over_s=over)


_SETTINGS: dict[Any, ParkingSettings] = {}
_SETTINGS_LOCK = threading.Lock()


def parking_settings(app: Any) -> ParkingSettings:
    """``app``'s :class:`ParkingSettings`, read at the first call and kept.

    Raises:
        ConfigurationError: a bad ``anarchon_park_countdown_over`` (raised
            again at every call until it is fixed).
    """
    with _SETTINGS_LOCK:
        known = _SETTINGS.get(app)
        if known is None:
            known = _SETTINGS[app] = ParkingSettings.from_app(app)
        return known


class ParkingTask(Task):
    """A Celery task whose long countdowns are parked.

    ``apply_async`` (and so ``retry``, signatures and chains) parks a call
    whose ``countdown`` or ``eta`` is more than ``anarchon_park_countdown_over``
    away; other calls, ``delay()``, and every call under
    ``task_always_eager`` are Celery's own. Give ``anarchon_park=False`` to
    send one call with Celery's countdown whatever the threshold.
    """

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: str | None = None,
        **options: Any,
    ) -> Any:
        """Celery's ``apply_async``, parking a countdown or eta more than
        ``anarchon_park_countdown_over`` away.

        Returns:
            ``AsyncResult`` of the task id it runs under (``task_id`` when
            given), parked or sent.
        Raises:
            ConfigurationError: a bad ``anarchon_park_countdown_over``, or
                (parking) a backend that keeps no delayed tasks.
            TypeError: (parking) an option a parked task cannot keep, named
                with the fix; what :func:`~celery_anarchon.delayed.park`
                raises for bad arguments.
            BackendUnavailable: (parking) the store cannot be reached.
        """
        wanted = options.pop(PARK_OPTION, None)
        app = self._get_app()
        delay_s = None
        if wanted is not False and not app.conf.task_always_eager:
            threshold = parking_settings(app).countdown_over_s
            if threshold is not None:
                delay_s = _delay_s(options.get("countdown"), options.get("eta"))
                if delay_s is not None and delay_s <= threshold:
                    delay_s = None
        if delay_s is None:
            return super().apply_async(
                args,
                kwargs,
                task_id=task_id,
                producer=producer,
                link=link,
                link_error=link_error,
                shadow=shadow,
                **options,
            )
        return self._park(
            app, args, kwargs, task_id, link=link, link_error=link_error, shadow=shadow, **options
        )

    def _park(self, app: Any, args: Any, kwargs: Any, task_id: str | None, **options: Any) -> Any:
        if self.soft_time_limit and self.time_limit and self.soft_time_limit > self.time_limit:
            raise ValueError("soft_time_limit must be less than or equal to time_limit")
        countdown = options.pop("countdown", None)
        eta = options.pop("eta", None)
        if countdown:
            due = datetime.now(timezone.utc) + timedelta(seconds=countdown)
        else:
            due = _aware(eta)
        kept = _kept_options(self, app, options)
        dump = getattr(self, "_dump_pydantic_arguments", None)
        if dump is not None and kept.get("serializer") != "pickle":
            args, kwargs = dump(args, kwargs)
        add_to_parent = kept.pop("add_to_parent", True)
        if task_id is not None:
            _make_room(app, self.name, task_id, int(kept.get("retries") or 0))
        parked_id = park(
            app,
            self,
            args if args is not None else (),
            kwargs,
            eta=due,
            task_id=task_id,
            **kept,
        )
        logger.debug(
            "anarchon: parked %s[%s] due %s instead of sending it (over %s)",
            self.name,
            parked_id,
            due.isoformat(),
            SETTING,
        )
        result = self.AsyncResult(parked_id)
        result.ignored = kept.get("ignore_result", self.ignore_result)
        parent = app.current_worker_task
        if add_to_parent and parent is not None:
            parent.add_trail(result)
        return result


def _delay_s(countdown: Any, eta: Any) -> float | None:
    """Seconds from now until a call runs, by Celery's rules: a truthy
    ``countdown`` wins over ``eta`` (as ``celery.app.amqp`` builds the
    message); None when the call is due now or its values are not ones
    Celery takes (Celery's own ``apply_async`` then judges them)."""
    if countdown:
        if isinstance(countdown, bool) or not isinstance(countdown, (int, float)):
            return None
        return float(countdown) if math.isfinite(countdown) else None
    if eta is None:
        return None
    try:
        when = _aware(eta)
    except (TypeError, ValueError):
        return None
    return (when - datetime.now(timezone.utc)).total_seconds()


def _aware(value: Any) -> datetime:
    """An ``eta`` or ``expires`` datetime (or its ISO 8601 text) as an aware
    datetime; a naive one is read as UTC, as Celery's worker reads it
    (``celery.utils.time.maybe_make_aware``, ``naive_as_utc=True``).

    Raises:
        TypeError: neither a datetime nor text. ValueError: text that is not ISO 8601.
    """
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if not isinstance(value, datetime):
        raise TypeError(f"expected a datetime or ISO 8601 text, got {value!r}")
    if value.tzinfo is None or value.utcoffset() is None:
        return value.replace(tzinfo=timezone.utc)
    return value


def _kept_options(task: Any, app: Any, options: Mapping[str, Any]) -> dict[str, Any]:
    """The call's options as :func:`~celery_anarchon.delayed.park` keeps
    them, or a TypeError naming the ones no parked task can keep.

    None values are left out (Celery ignores them too); ``expires`` in
    seconds becomes the instant it names (Celery counts it from the call,
    not from the release); the caller's ``reply_to``, ``root_id`` and
    ``parent_id`` are taken now, as ``send_task`` would take them.
    """
    kept: dict[str, Any] = {}
    refused = []
    for name, value in options.items():
        if value is None or name in PUBLISH_ONLY or name in DELIVERY_ONLY:
            continue
        if name == "add_to_parent":
            kept[name] = bool(value)
        elif name == "stamped_headers":
            if value:
                refused.append(name)
        elif name in OPTIONS:
            kept[name] = value
        else:
            refused.append(name)
    if refused:
        raise TypeError(
            f"{task.name}.apply_async: the countdown or eta is over {SETTING}, so the task "
            f"would be parked, and a parked task cannot keep the option(s) "
            f"{', '.join(sorted(refused))} (it keeps {', '.join(sorted(OPTIONS))}). "
            f"Drop them, or send this call with Celery's own countdown: "
            f"apply_async(..., {PARK_OPTION}=False)."
        )
    expires = kept.get("expires")
    if isinstance(expires, timedelta):
        expires = expires.total_seconds()
    if isinstance(expires, (int, float)) and not isinstance(expires, bool):
        kept["expires"] = datetime.now(timezone.utc) + timedelta(seconds=expires)
    elif expires is not None:
        kept["expires"] = _aware(expires)
    kept.setdefault("reply_to", app.thread_oid)
    parent = app.current_worker_task
    if parent is not None:
        kept.setdefault("root_id", parent.request.root_id or parent.request.id)
        kept.setdefault("parent_id", parent.request.id)
    return kept


def _make_room(app: Any, name: str, task_id: str, retries: int) -> None:
    """Before a call with its own task id is parked: wait while that id is
    in flight in the store, and let a retry replace its own attempt.

    A retry parks under the task id of the attempt that retries (``retries``
    is its count, 0 for a first call). When that attempt was itself
    released, its releaser deletes it only after the publish, so a quick
    retry can find it still in flight: parking then would write nothing (the
    id is parked) and the delete would lose the retry, so this waits. A
    retry can also find its attempt pending again, given back after a
    publish in doubt that did reach the worker (it runs now): that copy is
    cancelled (the worker gate would discard it anyway) and the retry
    parked. A first call (not a retry) whose id is pending is refused:
    Celery would send both, and ``park`` would keep the first alone.

    Raises:
        ValueError: a first call whose task id is parked and pending.
        RuntimeError: a retry whose id is pending under another attempt, or
            an id still in flight after :data:`IN_FLIGHT_WAIT_S` (a
            releaser's lease is 30 s).
    """
    store, _ = store_for(app)
    deadline = time.monotonic() + IN_FLIGHT_WAIT_S
    pause = 0.01
    while True:
        found = store.get(task_id)
        if found is None or found.id != task_id:
            return
        if found.state == PENDING:
            if not retries:
                # Celery would send both calls; parking both under one id
                # cannot be (park would keep the first and drop this one).
                raise ValueError(
                    f"{name}.apply_async: task id {task_id} is parked already (due "
                    f"{iso(found.due_ms)}); parking this call under it would drop it. "
                    "Give another task_id, or cancel the parked one first "
                    f"(celery anarchon delayed cancel {task_id})."
                )
            attempt = int(found.decoded().get("options", {}).get("retries") or 0)
            if attempt == retries:
                return  # this retry is parked already
            if attempt == retries - 1:
                if store.cancel(task_id):
                    logger.warning(
                        "anarchon: %s[%s]: cancelled a parked copy of the attempt that "
                        "retries (given back after a publish that did reach a worker); "
                        "parking the retry",
                        name,
                        task_id,
                    )
                    return
                continue  # taken meanwhile: in flight now
            raise RuntimeError(
                f"{name}.retry: task id {task_id} is parked already, pending as attempt "
                f"{attempt}; parking retry {retries} would keep that one. Cancel it "
                "(celery anarchon delayed cancel) if it should not run."
            )
        if time.monotonic() >= deadline:
            raise RuntimeError(
                f"{name}.apply_async: task id {task_id} is still in flight under a releaser "
                f"after {IN_FLIGHT_WAIT_S:g}s; not parked."
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.5)
