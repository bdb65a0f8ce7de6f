"""``celery anarchon``: operator commands (a click group under Celery's CLI).

Registered through the ``celery.commands`` entry point, so ``celery -A proj
anarchon --help`` lists the commands::

    celery -A proj anarchon jobs              # code and stored jobs: pause, next slots, last state
    celery -A proj anarchon history JOB       # newest runs first
    celery -A proj anarchon last-run JOB      # the newest run really sent
    celery -A proj anarchon run-now JOB       # send now, once per --key
    celery -A proj anarchon status            # backend, live instances, clocks, drift
    celery -A proj anarchon check             # validate settings and schedules
    celery -A proj anarchon add NAME ...      # store a job (celery_anarchon.cli_schedules)
    celery -A proj anarchon pause NAME        # also update, remove, resume
    celery -A proj anarchon delayed list      # parked tasks (celery_anarchon.cli_delayed)

Every command prints human-readable text by default and one JSON object with
``--json``. Credentials in URLs are always masked.

Exit codes (the same for every command):

====  ==================================================================
0     OK.
1     A problem was found: ``check`` found a bad setting or schedule;
      ``status`` printed a warning (no live instance, a clock off by more
      than ``max_skew``, a stale heartbeat, jobs defined differently on
      different instances); ``last-run`` found no run; ``run-now`` did
      not send (the key was used before, or the broker refused the task);
      ``delayed cancel`` or ``delayed reschedule`` found the task not
      pending (:mod:`celery_anarchon.cli_delayed`).
2     Usage: a bad option or argument, an unknown job, no ``-A`` (Celery's
      empty default app); for ``add``, ``update``, ``remove``, ``pause``
      and ``resume`` also a refused definition, a name taken, a
      ``beat_schedule`` entry to update or remove, or a claim-only backend
      (RabbitMQ), which keeps no stored jobs
      (:mod:`celery_anarchon.cli_schedules`); ``delayed show`` of a task
      that is not parked.
3     The claim backend is unreachable, or (SQLite) its file does not
      exist yet: the reading commands never create it (``jobs`` lists
      the ``beat_schedule`` entries before it exits 3).
4     The app's configuration cannot be loaded (a bad setting or
      schedule); ``check`` lists every problem. For ``delayed``, also a
      backend that keeps no delayed tasks (only Redis and PostgreSQL do).
====  ==================================================================
"""

from __future__ import annotations

import difflib
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone, tzinfo
from typing import Any
from zoneinfo import ZoneInfo

import click

from .backends import sanitize_url
from .backends.base import Backend, InstanceInfo, LeaseBackend, RunRecord
from .beat.registry import HEARTBEAT_INTERVAL, schedule_fingerprint
from .checks import CheckResult, Probe, has_clock, one_line, probe_backend, run_check
from .cli_common import (
    EXIT_CONFIG,
    EXIT_OK,
    EXIT_PROBLEM,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    Fail,
    app_of,
    handled,
    json_option,
    schedule_file,
)
from .cli_delayed import delayed_group
from .cli_schedules import COMMANDS as SCHEDULE_COMMANDS
from .control import Control
from .exceptions import BackendUnavailable, ConfigurationError
from .importers.cli import import_group
from .model import Job, app_zone
from .slots import BoundedSlots, CronSlots, IntervalSlots, Slots

__all__ = [
    "anarchon",
    "EXIT_OK",
    "EXIT_PROBLEM",
    "EXIT_USAGE",
    "EXIT_UNREACHABLE",
    "EXIT_CONFIG",
]

#: How many upcoming slots ``jobs`` shows per job.
NEXT_SLOTS = 3

#: A heartbeat older than this is reported as stale by ``status``, seconds.
STALE_HEARTBEAT_S = 3 * HEARTBEAT_INTERVAL


def _control(ctx: click.Context) -> Control:
    """A :class:`Control` over the app (builds the backend, connects nothing)."""
    return Control(app_of(ctx), schedule_filename=schedule_file(ctx))


# -- formatting ----------------------------------------------------------------


def _utc(ms: int | None) -> str:
    """``2026-06-01T12:00:00Z`` (milliseconds only when there are some)."""
    if ms is None:
        return "-"
    spec = "milliseconds" if ms % 1000 else "seconds"
    stamp = datetime.fromtimestamp(ms / 1000, timezone.utc).replace(tzinfo=None)
    return stamp.isoformat(timespec=spec) + "Z"


def _local(ms: int, zone: tzinfo) -> str:
    """``2026-06-01 14:00:00 CEST``: ``ms`` on the wall clock of ``zone``."""
    stamp = datetime.fromtimestamp(ms / 1000, zone)
    text = stamp.strftime("%Y-%m-%d %H:%M:%S")
    if ms % 1000:
        text += f".{ms % 1000:03d}"
    return f"{text} {stamp.tzname()}"


def _after(ms: int | None, slot_ms: int) -> str:
    """``+1.234s``: ``ms`` relative to the slot, or ``-``."""
    return "-" if ms is None else _signed(ms - slot_ms)


def _signed(ms: float) -> str:
    """``+1.234s``: milliseconds as signed seconds (never ``-0.000s``)."""
    return f"{round(ms / 1000, 3) + 0.0:+.3f}s"


def _seconds(value: float) -> str:
    """``2s``, ``0.5s``, ``7d``: a duration in seconds, short."""
    if value >= 86400 and value % 86400 == 0:
        return f"{value / 86400:g}d"
    if value >= 3600 and value % 3600 == 0:
        return f"{value / 3600:g}h"
    return f"{value:g}s"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns separated by two spaces."""
    widths = [max([len(h)] + [len(row[i]) for row in rows]) for i, h in enumerate(headers)]
    lines = [headers, *rows]
    return "\n".join(
        "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(line)).rstrip() for line in lines
    )


def _zone_name(zone: tzinfo) -> str:
    return str(getattr(zone, "key", None) or zone)


# -- the group -------------------------------------------------------------------


@click.group(name="anarchon")
@click.option(
    "-s",
    "--schedule",
    "schedule_filename",
    default=None,
    help="beat's schedule file (-s of `celery beat`), when the default SQLite "
    "backend is used and beat runs with another file than the default.",
)
@click.pass_context
def anarchon(ctx: click.Context, schedule_filename: str | None) -> None:
    """Inspect and operate celery-anarchon: jobs, history, runs, instances;
    add, update, pause, resume and remove jobs at runtime; parked tasks
    (delayed).

    Exit codes: 0 OK; 1 a problem found (check, status warnings, no last
    run, run-now not sent, delayed cancel or reschedule of a task not
    pending); 2 usage, a refused definition or name; 3 claim
    backend unreachable; 4 the configuration cannot be loaded.
    """
    ctx.meta["anarchon.schedule"] = schedule_filename


# -- jobs ------------------------------------------------------------------------


@anarchon.command()
@json_option
@click.pass_context
@handled
def jobs(ctx: click.Context, as_json: bool) -> None:
    """Every job, code entries and stored jobs: source, paused state,
    schedule, time zone, next slots (local and UTC), last state, options.

    Reads the stored jobs, pause states and each job's newest history
    record from the backend, creating nothing; the slots are computed from
    the schedules alone. Exit 3 when the backend is unreachable, after
    listing the beat_schedule entries (without pause or last states).
    """
    with _control(ctx) as control:
        zone = app_zone(control.app)
        now_ms = int(time.time() * 1000)
        backend = control.backend
        error = None
        try:
            found = control.jobs
            last = {name: next(iter(control.history(name, 1)), None) for name in found}
            counts = _run_counts(control, found)
        except BackendUnavailable as exc:
            error = f"claim backend unreachable: {one_line(exc)}"
            found, last, counts = control.code_jobs, {}, {}
        described = [
            _describe_job(job, backend, zone, now_ms, last.get(job.name), counts.get(job.name))
            for job in found.values()
        ]
        if as_json:
            payload = {
                "backend": backend.describe(),
                "supports_leases": backend.supports_leases,
                "stored_jobs": control.keeps_stored_jobs,
                "zone": _zone_name(zone),
                "now_ms": now_ms,
                "jobs": described,
                "stored_problems": control.stored_problems,
            }
            if error is not None:
                payload.update(error=error, exit_code=EXIT_UNREACHABLE)
            click.echo(json.dumps(payload))
        else:
            _print_jobs(control, described, zone, now_ms)
        if error is not None:
            if not as_json:
                click.echo(
                    f"celery anarchon: {error}; stored jobs, pause and last states not shown",
                    err=True,
                )
            raise click.exceptions.Exit(EXIT_UNREACHABLE)


def _print_jobs(
    control: Control, described: Sequence[dict[str, Any]], zone: ZoneInfo, now_ms: int
) -> None:
    backend = control.backend
    kind = "lease backend" if backend.supports_leases else "claim-only backend"
    click.echo(f"backend: {backend.describe()} ({kind})")
    click.echo(f"app time zone: {_zone_name(zone)}   now: {_utc(now_ms)}")
    stored = sum(item["source"] == "stored" for item in described)
    click.echo(f"{len(described)} job(s), {stored} stored")
    if described:
        click.echo("")
        rows = [
            [
                item["name"],
                item["source"],
                _paused_text(item),
                item["next"][0]["utc"] if item["next"] else "-",
                f"finished: {item['finished']}" if item["finished"] else item["last_state"] or "-",
                item["schedule"],
                item["zone"],
            ]
            for item in described
        ]
        headers = ["JOB", "SOURCE", "PAUSED", "NEXT (UTC)", "LAST", "SCHEDULE", "ZONE"]
        click.echo(_table(headers, rows))
    for item in described:
        click.echo("")
        click.echo(item["name"])
        source = f"stored, version {item['version']}" if item["source"] == "stored" else "code"
        click.echo(f"  source    {source}")
        click.echo(f"  task      {item['task']}")
        click.echo(f"  schedule  {item['schedule']}")
        click.echo(f"  zone      {item['zone']}")
        if item["paused"]:
            click.echo(f"  paused    {_paused_text(item)} (no slot is sent until `resume`)")
        nexts = item["next"] or [{"local": "(no more slots)", "utc": ""}]
        for i, slot in enumerate(nexts):
            label = "next" if i == 0 else ""
            click.echo(f"  {label:<8}  {slot['local']:<30}  {slot['utc']}".rstrip())
        if item["last_state"]:
            click.echo(f"  last      {item['last_state']} (slot {_utc(item['last_slot_ms'])})")
        bounds = item["options"]
        for key, label in (("start_at_ms", "start at"), ("end_at_ms", "end at")):
            if bounds.get(key) is not None:
                click.echo(f"  {label:<8}  {_utc(bounds[key])}")
        if item["finished"]:
            click.echo(
                f"  finished  {item['finished']} (claims nothing; widen its bounds to revive)"
            )
        elif item["runs"] is not None:
            click.echo(f"  runs      {item['runs']} of {item['options']['max_runs']}")
        if "gate_queue" in item:
            click.echo(f"  gate      {item['gate_queue']}")
        click.echo(f"  options   {_options_text(item['options'])}")
    for name, problem in sorted(control.stored_problems.items()):
        click.echo("")
        click.echo(f"note: stored job {name!r} is not listed: {problem}")


def _paused_text(item: Mapping[str, Any]) -> str:
    if not item["paused"]:
        return "-"
    return f"yes: {item['pause_note']}" if item["pause_note"] else "yes"


def _run_counts(control: Control, found: Mapping[str, Job]) -> dict[str, int]:
    """Runs counted toward each run limit (one backend call for all)."""
    limited = [name for name, job in found.items() if job.options.max_runs is not None]
    backend = control.backend
    if not limited or not isinstance(backend, LeaseBackend) or not backend.exists():
        return {}
    return backend.won_counts(limited)


def _finished(job: Job, now_ms: int, runs: int | None) -> str | None:
    """Why ``job`` is finished (its run limit reached, its ``end_at``
    passed), or None."""
    o = job.options
    if o.max_runs is not None and runs is not None and runs >= o.max_runs:
        return f"max_runs={o.max_runs} reached"
    if o.end_at_ms is not None and o.end_at_ms < now_ms and job.slots.next_after(now_ms) is None:
        return f"end_at {_utc(o.end_at_ms)} passed"
    return None


def _describe_job(
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
    finished = _finished(job, now_ms, runs)
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
        "schedule": _schedule_text(schedule),
        "zone": _zone_name(zone),
        "next": [{"slot_ms": s, "utc": _utc(s), "local": _local(s, zone)} for s in slots],
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


def _schedule_text(slots: Slots) -> str:
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
            return f"every {_seconds(interval_s)} (anchor {_utc(slots.anchor_ms)})"
        return f"every {_seconds(interval_s)}: {on} (anchor {_utc(slots.anchor_ms)})"
    if isinstance(slots, CronSlots) and len(slots.expr.split()) == 6 and slots.day_or:
        zone = _zone_name(slots.zone)
        return f"{slots.kind} '{slots.expr}' (with seconds; day-of-month OR day-of-week) {zone}"
    return slots.describe()


def _options_text(options: Mapping[str, Any]) -> str:
    parts = [
        f"jitter={_seconds(options['jitter'])}",
        f"max_late={_seconds(options['max_late'])}",
        f"overlap={options['overlap']}",
        f"catch_up={options['catch_up']}",
    ]
    if options["catch_up"] != "none":
        parts.append(f"catch_up_window={_seconds(options['catch_up_window'])}")
        parts.append(f"catch_up_limit={options['catch_up_limit']}")
    parts += [
        f"lease_ttl={_seconds(options['lease_ttl'])}",
        f"history={options['history_size']}/{_seconds(options['history_ttl'])}",
    ]
    if options.get("anchor_ms"):
        parts.append(f"anchor={_utc(options['anchor_ms'])}")
    return " ".join(parts)


# -- history and last-run --------------------------------------------------------


@anarchon.command()
@click.argument("job")
@click.option(
    "-n",
    "--limit",
    type=click.IntRange(min=1),
    default=20,
    show_default=True,
    help="Most records to show.",
)
@json_option
@click.pass_context
@handled
def history(ctx: click.Context, job: str, limit: int, as_json: bool) -> None:
    """JOB's runs, newest slot first: state, instance, times, task id, error.

    Times after the slot are shown in seconds relative to the slot (epoch
    milliseconds in --json). Exit 2 when JOB is neither in beat_schedule,
    nor a stored job, nor in the backend's history.
    """
    with _control(ctx) as control:
        control.require_backend()
        records = control.history(job, limit)
        found = control.jobs.get(job)
        if not records and found is None:
            raise Fail(EXIT_USAGE, _unknown_job(job, control))
        if as_json:
            click.echo(
                json.dumps(
                    {
                        "job": job,
                        "in_beat_schedule": job in control.code_jobs,
                        "source": None if found is None else found.source,
                        "records": [_record_json(r) for r in records],
                    }
                )
            )
            return
        note = "" if found is not None else " (no longer in beat_schedule nor stored)"
        if not records:
            # Say where we looked: the SQLite default lives beside the
            # schedule file, so a command run from another folder reads
            # (and creates) another, empty file.
            click.echo(f"{job}: no runs recorded yet in {control.backend.describe()}")
            return
        click.echo(f"{job}{note}: {len(records)} run(s), newest first; times after the slot")
        rows = [
            [
                _utc(r.slot_ms),
                r.state.value,
                r.instance or "-",
                _after(r.claimed_at_ms, r.slot_ms),
                _after(r.sent_at_ms, r.slot_ms),
                _after(r.started_at_ms, r.slot_ms),
                _after(r.finished_at_ms, r.slot_ms),
                r.task_id or "-",
                _note(r),
            ]
            for r in records
        ]
        headers = ["SLOT (UTC)", "STATE", "INSTANCE", "CLAIMED", "SENT", "STARTED", "FINISHED"]
        click.echo(_table([*headers, "TASK ID", "NOTE"], rows))


def _note(record: RunRecord) -> str:
    parts = []
    if record.manual_key is not None:
        parts.append(f"run-now key={record.manual_key}")
    if record.error:
        parts.append(sanitize_url(record.error))
    return "; ".join(parts) or "-"


def _record_json(record: RunRecord) -> dict[str, Any]:
    return {**record.as_dict(), "slot": _utc(record.slot_ms)}


def _unknown_job(job: str, control: Control, *, history: bool = True) -> str:
    """Why ``job`` is unknown, with a "did you mean" and the known jobs; a
    stored job this host cannot build says why instead."""
    if job in control.stored_problems:
        return f"stored job {job!r} cannot be used here: {control.stored_problems[job]}"
    close = difflib.get_close_matches(job, list(control.jobs), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    known = ", ".join(sorted(control.jobs)) or "none"
    where = f"no job named {job!r} in beat_schedule nor among the stored jobs"
    if history:
        where += ", and no history of it"
    return f"{where}.{hint} Jobs: {known}."


@anarchon.command(name="last-run")
@click.argument("job")
@json_option
@click.pass_context
@handled
def last_run(ctx: click.Context, job: str, as_json: bool) -> None:
    """The newest run of JOB that was really sent (exit 1 when there is none)."""
    with _control(ctx) as control:
        control.require_backend()
        record = control.last_run(job)
        if record is None and job not in control.jobs and not control.history(job, 1):
            raise Fail(EXIT_USAGE, _unknown_job(job, control))
        if as_json:
            click.echo(json.dumps({"job": job, "run": record and _record_json(record)}))
        elif record is None:
            click.echo(f"{job}: no run sent yet")
        else:
            click.echo(f"{job}: last sent run")
            for key, value in [
                ("slot", _utc(record.slot_ms)),
                ("state", record.state.value),
                ("instance", record.instance or "-"),
                ("claimed", _utc(record.claimed_at_ms)),
                ("sent", _utc(record.sent_at_ms)),
                ("started", _utc(record.started_at_ms)),
                ("finished", _utc(record.finished_at_ms)),
                ("task id", record.task_id or "-"),
                ("note", _note(record)),
            ]:
                click.echo(f"  {key:<9} {value}")
        if record is None:
            raise click.exceptions.Exit(EXIT_PROBLEM)


# -- run-now -----------------------------------------------------------------------


@anarchon.command(name="run-now")
@click.argument("job")
@click.option(
    "--key",
    default=None,
    help="Calls with the same key send once, from any host [default: no key; "
    "then a call is refused while the job's previous call without a key is "
    "younger than anarchon_run_now_guard (5 s), so a double click sends once].",
)
@json_option
@click.pass_context
@handled
def run_now(ctx: click.Context, job: str, key: str | None, as_json: bool) -> None:
    """Send JOB's task now (a beat_schedule entry or a stored job), once per
    --key across all hosts; prints the task id.

    Exit 0 when this call sent it; 1 when a call with the same key already
    did (the task id printed is that run's), a call without --key came less
    than anarchon_run_now_guard ago, or the broker refused the task
    (recorded ``lost``).
    """
    with _control(ctx) as control:
        if job not in control.jobs:
            raise Fail(EXIT_USAGE, _unknown_job(job, control, history=False))
        try:
            result = control.run_now(job, key)
        except (BackendUnavailable, ConfigurationError):
            raise
        except Exception as exc:
            raise Fail(
                EXIT_PROBLEM,
                f"{job}: claimed, but the broker refused the task ({one_line(exc)}); "
                "recorded as lost, not sent",
            ) from exc
        if as_json:
            click.echo(json.dumps(asdict(result)))
        elif result.sent:
            click.echo(f"{job}: sent, task id {result.task_id} (key {result.key})")
        elif result.guarded:
            guard = _seconds(control.settings.run_now_guard)
            previous = f" (task id {result.task_id})" if result.task_id else ""
            click.echo(
                f"{job}: not sent: a run-now of it was sent less than {guard} ago{previous} "
                f"(anarchon_run_now_guard={guard}); pass --key to send another run at once"
            )
        else:
            click.echo(
                f"{job}: not sent: key {result.key!r} was used before; "
                f"that run's task id is {result.task_id}"
            )
        if not result.sent:
            raise click.exceptions.Exit(EXIT_PROBLEM)


# -- status ------------------------------------------------------------------------


@dataclass
class _Status:
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


@anarchon.command()
@json_option
@click.pass_context
@handled
def status(ctx: click.Context, as_json: bool) -> None:
    """The backend, its round trip, the live instances and their clocks.

    Lists each live instance (host, pid, version, start, last heartbeat,
    schedule fingerprint) with its clock offset from the backend's clock
    (where the backend has one), and the jobs whose definitions differ
    between instances. Exit 1 when there is a warning: no live instance, a
    clock off by more than max_skew, a stale heartbeat, definitions that
    differ; exit 3 when the backend is unreachable.
    """
    with _control(ctx) as control:
        backend = control.backend
        control.require_backend()
        probe = probe_backend(backend)
        report = _Status(
            backend=backend.describe(),
            supports_leases=backend.supports_leases,
            backend_clock=has_clock(backend),
            max_skew_s=control.settings.max_skew,
            probe=probe,
            local_fingerprint=schedule_fingerprint(control.code_jobs),
        )
        if backend.supports_leases:
            live = control.instances()
            if len({info.fingerprint for info in live}) > 1:
                # Schedules differ: read each instance's definitions (kept
                # apart from the heartbeats) to name the jobs that differ.
                live = [
                    replace(info, jobs=info.jobs or control.definitions(info.instance))
                    for info in live
                ]
            now_ms = probe.backend_now_ms or backend.now_ms()
            _check_instances(report, live, now_ms, _app_option(ctx, control.app))
        else:
            report.notes.append(
                "claim-only backend: no instance registry is kept, so live instances "
                "cannot be listed (use a lease backend to see them)"
            )
        host_offset = probe.host_offset_ms
        if host_offset is not None and abs(host_offset) > report.max_skew_s * 1000:
            report.notes.append(
                f"this host's clock is {host_offset / 1000:+.1f}s off the backend's "
                f"(more than max_skew={report.max_skew_s:g}s): do not run beat here before "
                "syncing it (NTP)"
            )
        if as_json:
            payload = asdict(report)
            payload["reachable"] = True
            click.echo(json.dumps(payload))
        else:
            _print_status(report)
        if report.warnings:
            raise click.exceptions.Exit(EXIT_PROBLEM)


def _app_option(ctx: click.Context, app: Any) -> str:
    """What to pass to ``-A`` for this app: the ``-A`` this command got,
    else the app's name."""
    given = ctx.find_root().params.get("app")
    return given if isinstance(given, str) and given else str(app.main or "proj")


def _check_instances(
    report: _Status, live: Sequence[InstanceInfo], now_ms: int, app_name: str
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


def _print_status(report: _Status) -> None:
    probe = report.probe
    click.echo(f"backend: {report.backend}")
    line = f"reachable: yes, connect {probe.connect_ms:.1f} ms"
    if probe.rtt_ms is not None:
        line += f", round trip {probe.rtt_ms:.2f} ms"
    click.echo(line)
    if report.backend_clock and probe.backend_now_ms is not None:
        click.echo(
            f"backend clock: {_utc(probe.backend_now_ms)} (this host "
            f"{_signed(probe.host_offset_ms or 0)})"
        )
    else:
        click.echo("backend clock: none (each host's own clock is used)")
    click.echo(f"this app's schedule fingerprint: {report.local_fingerprint}")
    if report.supports_leases:
        click.echo("")
        click.echo(f"live instances: {len(report.instances)}")
        if report.instances:
            rows = [
                [
                    item["instance"],
                    item["host"],
                    str(item["pid"]),
                    item["version"],
                    _utc(item["started_ms"] - item["started_ms"] % 1000),
                    f"{item['heartbeat_age_ms'] / 1000:.1f}s ago",
                    item["fingerprint"]
                    + ("" if item["fingerprint"] == report.local_fingerprint else " *"),
                    "-" if item["offset_ms"] is None else _signed(item["offset_ms"]),
                ]
                for item in report.instances
            ]
            headers = ["INSTANCE", "HOST", "PID", "VERSION", "STARTED (UTC)", "HEARTBEAT"]
            click.echo(_table([*headers, "FINGERPRINT", "CLOCK OFFSET"], rows))
    if report.drift:
        click.echo("")
        click.echo("jobs defined differently between instances:")
        for item in report.drift:
            shown = ", ".join(
                f"{instance}={definition or '(absent)'}"
                for instance, definition in item["definitions"].items()
            )
            click.echo(f"  {item['job']}: {shown}")
    if report.notes or report.warnings:
        click.echo("")
    for note in report.notes:
        click.echo(f"note: {note}")
    for warning in report.warnings:
        click.echo(f"WARNING: {warning}")


# -- check -----------------------------------------------------------------------


@anarchon.command()
@click.option(
    "--connect",
    is_flag=True,
    help="Also connect to the backend: reachability, Redis eviction policy, "
    "RabbitMQ version, this host's clock against the backend's.",
)
@json_option
@click.pass_context
def check(ctx: click.Context, connect: bool, as_json: bool) -> None:
    """Validate every setting and schedule without starting beat.

    Builds every job as beat would (cron fields, intervals, zones, per-job
    options, what a claim-only backend can do) and the backend without
    connecting, unless --connect. Prints each problem with the job, the
    setting and the fix. Exit 0 when all is valid, 1 on any problem, 3 when
    --connect finds the backend unreachable. For CI and deploy hooks.
    """
    result = run_check(app_of(ctx), schedule_file(ctx), connect)
    if as_json:
        click.echo(json.dumps({"ok": not result.problems, **asdict(result)}))
    else:
        _print_check(result, connect)
    if result.unreachable:
        raise click.exceptions.Exit(EXIT_UNREACHABLE)
    if result.problems:
        raise click.exceptions.Exit(EXIT_PROBLEM)


def _print_check(result: CheckResult, connect: bool) -> None:
    if result.backend is None:
        backend = "not built: configuration error (below)"
    elif result.connected:
        backend = f"{result.backend} (connected)"
    elif result.unreachable:
        backend = f"{result.backend} (unreachable)"
    elif connect:
        backend = f"{result.backend} (reached, not usable: see below)"
    else:
        backend = f"{result.backend} (not connected)"
    click.echo(f"checked {result.jobs} valid job(s); backend {backend}")
    for problem in result.problems:
        click.echo(f"ERROR    {problem['message']}")
    for warning in result.warnings:
        click.echo(f"WARNING  {warning}")
    if result.problems:
        click.echo(f"{len(result.problems)} problem(s): fix them before starting beat.")
    else:
        click.echo("OK: beat would start with this configuration.")


# -- add, update, remove, pause, resume (celery_anarchon.cli_schedules) ----------

for _command in SCHEDULE_COMMANDS:
    anarchon.add_command(_command)

# -- import redbeat | django-celery-beat (celery_anarchon.importers) ---------------

anarchon.add_command(import_group)

# -- delayed list | show | cancel | reschedule | count (celery_anarchon.cli_delayed) --

anarchon.add_command(delayed_group)
