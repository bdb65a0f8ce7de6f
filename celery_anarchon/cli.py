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
    celery -A proj anarchon web               # the operator web page (celery_anarchon.web)

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
      backend that keeps no delayed tasks (RabbitMQ).
====  ==================================================================
"""

from __future__ import annotations

import difflib
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from typing import Any
from zoneinfo import ZoneInfo

import click

from .backends.base import RunRecord
from .beat.registry import schedule_fingerprint
from .checks import CheckResult, has_clock, one_line, probe_backend, run_check
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
from .model import app_zone
from .reports import StatusReport as _Status
from .reports import after_slot as _after
from .reports import check_instances as _check_instances
from .reports import describe_job as _describe_job
from .reports import record_note as _note
from .reports import run_counts as _run_counts
from .reports import seconds_text as _seconds
from .reports import signed_s as _signed
from .reports import utc as _utc
from .reports import zone_name as _zone_name
from .web.command import web as web_command

__all__ = [
    "anarchon",
    "EXIT_OK",
    "EXIT_PROBLEM",
    "EXIT_USAGE",
    "EXIT_UNREACHABLE",
    "EXIT_CONFIG",
]


def _control(ctx: click.Context) -> Control:
    """A :class:`Control` over the app (builds the backend, connects nothing)."""
    return Control(app_of(ctx), schedule_filename=schedule_file(ctx))


# -- formatting ----------------------------------------------------------------


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns separated by two spaces."""
    widths = [max([len(h)] + [len(row[i]) for row in rows]) for i, h in enumerate(headers)]
    lines = [headers, *rows]
    return "\n".join(
        "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(line)).rstrip() for line in lines
    )


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
    if result.delayed_backend is not None:
        click.echo(f"delayed tasks kept in {result.delayed_backend}")
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

# -- web: the operator web page (celery_anarchon.web; Flask and waitress from [web]) --

anarchon.add_command(web_command)
