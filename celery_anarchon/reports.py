"""What the operator front ends show of jobs, runs and instances: a job
described (its schedule in words, zone, next slots, last state, run count),
a run's times after its slot and its note, and the live instances checked
(clock offsets, stale heartbeats, definitions that differ). The
``celery anarchon`` commands (:mod:`celery_anarchon.cli`) print them and the
web page (:mod:`celery_anarchon.web`) renders them: one text for both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone, tzinfo
from typing import Any
from zoneinfo import ZoneInfo

from .backends import sanitize_url
from .backends.base import Backend, InstanceInfo, LeaseBackend, RunRecord
from .beat.registry import HEARTBEAT_INTERVAL
from .checks import Probe
from .control import Control
from .model import Job
from .slots import BoundedSlots, CronSlots, IntervalSlots, Slots

__all__ = [
    "NEXT_SLOTS",
    "STALE_HEARTBEAT_S",
    "StatusReport",
    "after_slot",
    "check_instances",
    "describe_job",
    "finished_reason",
    "local_time",
    "record_note",
    "run_counts",
    "schedule_text",
    "seconds_text",
    "signed_s",
    "utc",
    "zone_name",
]


#: How many upcoming slots ``jobs`` shows per job.
NEXT_SLOTS = 3


#: A heartbeat older than this is reported as stale by ``status``, seconds.
STALE_HEARTBEAT_S = 3 * HEARTBEAT_INTERVAL


def utc(ms: int | None) -> str:
    """``2026-06-01T12:00:00Z`` (milliseconds only when there are some)."""
    if ms is None:
        return "-"
    spec = "milliseconds" if ms % 1000 else "seconds"
    stamp = datetime.fromtimestamp(ms / 1000, timezone.utc).replace(tzinfo=None)
    return stamp.isoformat(timespec=spec) + "Z"


def local_time(ms: int, zone: tzinfo) -> str:
    """``2026-06-01 14:00:00 CEST``: ``ms`` on the wall clock of ``zone``."""
    stamp = datetime.fromtimestamp(ms / 1000, zone)
    text = stamp.strftime("%Y-%m-%d %H:%M:%S")
    if ms % 1000:
        text += f".{ms % 1000:03d}"
    return f"{text} {stamp.tzname()}"


def after_slot(ms: int | None, slot_ms: int) -> str:
    """``+1.234s``: ``ms`` relative to the slot, or ``-``."""
    return "-" if ms is None else signed_s(ms - slot_ms)


def signed_s(ms: float) -> str:
    """``+1.234s``: milliseconds as signed seconds (never ``-0.000s``)."""
    return f"{round(ms / 1000, 3) + 0.0:+.3f}s"


def seconds_text(value: float) -> str:
    """``2s``, ``0.5s``, ``7d``: a duration in seconds, short."""
    if value >= 86400 and value % 86400 == 0:
        return f"{value / 86400:g}d"
    if value >= 3600 and value % 3600 == 0:
        return f"{value / 3600:g}h"
    return f"{value:g}s"


def zone_name(zone: tzinfo) -> str:
    return str(getattr(zone, "key", None) or zone)


def run_counts(control: Control, found: Mapping[str, Job]) -> dict[str, int]:
    """Runs counted toward each run limit (one backend call for all)."""
    limited = [name for name, job in found.items() if job.options.max_runs is not None]
    backend = control.backend
    if not limited or not isinstance(backend, LeaseBackend) or not backend.exists():
        return {}
    return backend.won_counts(limited)


def finished_reason(job: Job, now_ms: int, runs: int | None) -> str | None:
    """Why ``job`` is finished (its run limit reached, its ``end_at``
    passed), or None."""
    o = job.options
    if o.max_runs is not None and runs is not None and runs >= o.max_runs:
        return f"max_runs={o.max_runs} reached"
    if o.end_at_ms is not None and o.end_at_ms < now_ms and job.slots.next_after(now_ms) is None:
        return f"end_at {utc(o.end_at_ms)} passed"
    return None


def describe_job(
    job: Job,
    backend: Backend,
    app_zone_: ZoneInfo,
    now_ms: int,
    last: RunRecord | None,
    runs: int | None = None,
) -> dict[str, Any]:
    # Bounds and a stored job's effective time wrap the schedule: show the schedule.
    schedule = job.slots
    while isinstance(schedule, BoundedSlots):
        schedule = schedule.inner
    finished = finished_reason(job, now_ms, runs)
    zone: tzinfo = getattr(schedule, "zone", None) or app_zone_
    slots: list[int] = []
    slot = None if finished else job.slots.next_after(now_ms)
    while slot is not None and len(slots) < NEXT_SLOTS:
        slots.append(slot)
        slot = job.slots.next_after(slot)
    paused = job.pause is not None and job.pause.paused
    described: dict[str, Any] = {
        "name": job.name,
        "source": job.source,
        "version": job.version,
        "paused": paused,
        "pause_note": job.pause.note if paused and job.pause is not None else None,
        "task": job.entry.task,
        "schedule": schedule_text(schedule),
        "zone": zone_name(zone),
        "next": [{"slot_ms": s, "utc": utc(s), "local": local_time(s, zone)} for s in slots],
        "last_state": None if last is None else last.state.value,
        "last_slot_ms": None if last is None else last.slot_ms,
        "finished": finished,
        "runs": runs,
        "options": job.options.as_dict(),
        "definition": job.definition,
    }
    gate_queue = getattr(backend, "gate_queue", None)
    if gate_queue is not None and slots:
        described["gate_queue"] = gate_queue(job.name, slots[0])
    return described


def schedule_text(slots: Slots) -> str:
    """The schedule as ``jobs`` shows it: an interval in days or hours with
    the weekday and time its anchor puts the slots on (the Unix epoch, a
    Thursday 00:00 UTC, unless an anchor is set); a cron with a seconds
    field named as such (POSIX cron has five fields)."""
    if isinstance(slots, IntervalSlots):
        interval_s = slots.interval_ms / 1000
        anchor = datetime.fromtimestamp(slots.anchor_ms / 1000, timezone.utc)
        at = anchor.strftime("%H:%M") + (anchor.strftime(":%S") if anchor.second else "")
        if interval_s == 7 * 86400:
            on = f"{anchor.strftime('%A')}s {at} UTC"
        elif interval_s % 86400 == 0:
            on = f"days at {at} UTC from {anchor.strftime('%A')}"
        else:
            return f"every {seconds_text(interval_s)} (anchor {utc(slots.anchor_ms)})"
        return f"every {seconds_text(interval_s)}: {on} (anchor {utc(slots.anchor_ms)})"
    if isinstance(slots, CronSlots) and len(slots.expr.split()) == 6 and slots.day_or:
        zone = zone_name(slots.zone)
        return f"{slots.kind} '{slots.expr}' (with seconds; day-of-month OR day-of-week) {zone}"
    return slots.describe()


def record_note(record: RunRecord) -> str:
    parts = []
    if record.manual_key is not None:
        parts.append(f"run-now key={record.manual_key}")
    if record.error:
        parts.append(sanitize_url(record.error))
    return "; ".join(parts) or "-"


@dataclass
class StatusReport:
    backend: str
    supports_leases: bool
    backend_clock: bool
    max_skew_s: float
    probe: Probe
    local_fingerprint: str
    instances: list[dict[str, Any]] = field(default_factory=list)
    drift: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def check_instances(
    report: StatusReport, live: Sequence[InstanceInfo], now_ms: int, app_name: str
) -> None:
    skew_ms = report.max_skew_s * 1000
    for info in live:
        offset = (
            info.clock_ms - info.heartbeat_ms
            if report.backend_clock and info.clock_ms is not None
            else None
        )
        age_ms = max(now_ms - info.heartbeat_ms, 0)
        report.instances.append({**asdict(info), "offset_ms": offset, "heartbeat_age_ms": age_ms})
        if offset is not None and abs(offset) > skew_ms:
            report.warnings.append(
                f"instance {info.instance}: clock {offset / 1000:+.1f}s off the backend's, more "
                f"than anarchon_max_skew={report.max_skew_s:g}s; its claims are refused or "
                "judged late. Sync its clock (NTP)."
            )
        if age_ms > STALE_HEARTBEAT_S * 1000:
            report.warnings.append(
                f"instance {info.instance}: last heartbeat {age_ms / 1000:.0f}s ago (every "
                f"{HEARTBEAT_INTERVAL:g}s expected): frozen or stopped?"
            )
        if info.fingerprint != report.local_fingerprint:
            report.notes.append(
                f"instance {info.instance} runs another schedule (fingerprint "
                f"{info.fingerprint}) than this app's ({report.local_fingerprint})"
            )
    if not live:
        report.warnings.append(
            "no live instance in the registry: no slot is being sent. Start "
            f"`celery -A {app_name} beat -S celery_anarchon.Scheduler` on at least one host."
        )
    names = sorted({name for info in live for name in info.jobs})
    for name in names:
        definitions = {info.instance: info.jobs.get(name) for info in live}
        if len(set(definitions.values())) > 1:
            report.drift.append({"job": name, "definitions": definitions})
            report.warnings.append(
                f"job {name!r} is defined differently on the live instances (a rolling "
                "deploy, or hosts with different code)"
            )
