"""``celery anarchon add|update|remove|pause|resume``: change jobs at runtime.

The commands that write stored jobs (docs/runtime-schedules.md), a thin
layer over :class:`~celery_anarchon.schedules.Schedules`, registered on the
``anarchon`` group of :mod:`celery_anarchon.cli`::

    celery -A proj anarchon add report --task proj.tasks.report \\
        --cron "0 7 * * *" --tz Europe/Berlin
    celery -A proj anarchon add sync --task proj.tasks.sync --every 30s --queue low
    celery -A proj anarchon add launch --task proj.tasks.launch \\
        --at 2027-01-01T00:00Z --paused --note "waits for review"
    celery -A proj anarchon update report --cron "30 7 * * *" --tz Europe/Berlin
    celery -A proj anarchon pause report --note "billing freeze"
    celery -A proj anarchon resume report
    celery -A proj anarchon remove report

Every running beat applies a change within a second of its commit; it holds
from the first slot due at least 1 s after the commit. Each definition is
validated as beat validates ``beat_schedule``, and nothing is written when
it is refused. ``pause`` and ``resume`` also work on ``beat_schedule``
entries; ``update`` and ``remove`` only on stored jobs.

Every command prints one line or a few by default and one JSON object with
``--json``.

Exit codes:

====  ==================================================================
0     Done; also a ``pause`` of a paused job or a ``resume`` of a running
      one, which change nothing (``"changed": false``).
2     Usage or a refused definition: a bad option (``--every`` that is not
      a duration, a naive ``--at``, ``--args`` that is not a JSON list,
      ``--kwargs`` not a JSON object), a schedule beat would refuse (a
      cron that does not parse, an instant in the past), an unknown job,
      a name already taken (``add``: a stored job or a ``beat_schedule``
      entry), ``update`` or ``remove`` of a ``beat_schedule`` entry, or a
      claim backend that keeps no stored jobs (RabbitMQ: use a lease
      backend, Redis, PostgreSQL, MySQL or SQLite).
3     The claim backend is unreachable, or (SQLite) its file does not
      exist yet: ``update`` and ``remove`` never create it.
4     The app's configuration cannot be loaded (a bad setting).
====  ==================================================================
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any, TypeVar

import click

from .checks import one_line
from .cli_common import EXIT_USAGE, Fail, app_of, handled, json_option, schedule_file
from .exceptions import ConfigurationError
from .model import app_zone, job_from_stored
from .schedules import Schedules, StoredJobsRefused
from .slots import cron
from .stored import APPLY_DELAY_MS, Pause, StoredJob, StoredState
from .times import iso

__all__ = ["COMMANDS", "add", "parse_at", "parse_every", "pause", "remove", "resume", "update"]

_F = TypeVar("_F", bound=Callable[..., Any])

#: Units ``--every`` takes, in seconds.
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}

_DURATION = re.compile(r"(?P<number>\d+(?:\.\d*)?|\.\d+)(?P<unit>[smhd]?)")


# -- reading the options ---------------------------------------------------------


def parse_every(text: str) -> float:
    """``--every``: ``30``, ``30s``, ``5m``, ``1.5h``, ``1d`` as seconds.

    Raises:
        Fail: anything else (exit 2).
    """
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise Fail(
            EXIT_USAGE,
            f"--every {text!r}: give seconds or a duration with a unit s, m, h or d "
            "(30, 30s, 5m, 1.5h, 1d)",
        )
    return float(match["number"]) * UNITS[match["unit"] or "s"]


def parse_at(text: str, option: str = "--at", *, naive_utc: bool = False) -> datetime:
    """``--at`` (or ``option``): an ISO 8601 instant that carries its zone
    (``Z`` or an offset), as an aware datetime; with ``naive_utc``, one
    without a zone is read as UTC.

    Raises:
        Fail: not ISO 8601, or naive (without ``naive_utc``) (exit 2).
    """
    value = text.strip()
    if value[-1:] in ("Z", "z"):
        value = value[:-1] + "+00:00"  # Python 3.10 reads no "Z"
    try:
        at = datetime.fromisoformat(value)
    except ValueError:
        raise Fail(
            EXIT_USAGE, f"{option} {text!r} is not ISO 8601: give e.g. 2027-01-01T00:00Z"
        ) from None
    if at.tzinfo is None or at.utcoffset() is None:
        shown = "auto" if at.microsecond else "seconds" if at.second else "minutes"
        example = at.isoformat(timespec=shown)
        if naive_utc:
            return at.replace(tzinfo=timezone.utc)
        raise Fail(
            EXIT_USAGE,
            f"{option} {text!r} has no time zone, so hosts in other zones would read another "
            f"instant: add one, e.g. {example}Z (UTC) or {example}+01:00",
        )
    return at


def bounds_of(start_at: str | None, end_at: str | None, max_runs: str | None) -> dict[str, Any]:
    """``--start-at``, ``--end-at`` and ``--max-runs`` as :meth:`Schedules.add`
    takes them; ``none`` (``update``) removes a bound, given as None.

    Raises:
        Fail: an instant without a zone, or a limit that is not a whole number (exit 2).
    """
    bounds: dict[str, Any] = {}
    for key, text, option in (("start_at", start_at, "--start-at"), ("end_at", end_at, "--end-at")):
        if text is not None:
            bounds[key] = None if text.lower() == "none" else parse_at(text, option)
    if max_runs is not None:
        if max_runs.lower() == "none":
            bounds["max_runs"] = None
        else:
            try:
                bounds["max_runs"] = int(max_runs)
            except ValueError:
                raise Fail(
                    EXIT_USAGE, f"--max-runs {max_runs!r}: give a whole number >= 1"
                ) from None
    return bounds


def _json_option(option: str, text: str, kind: type) -> Any:
    """``--args`` (a JSON list) or ``--kwargs`` (a JSON object), decoded.

    Raises:
        Fail: not JSON, or JSON of another kind (exit 2).
    """
    example = "'[1, \"a\"]'" if kind is list else '\'{"name": "value"}\''
    what = "a JSON list" if kind is list else "a JSON object"
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise Fail(
            EXIT_USAGE, f"{option}: {text!r} is not JSON ({exc}); give {what}, e.g. {example}"
        )
    if not isinstance(value, kind):
        raise Fail(EXIT_USAGE, f"{option}: expected {what}, got {text!r}; e.g. {example}")
    return value


def _schedule(every: str | None, cron_expr: str | None, tz: str | None, at: str | None) -> Any:
    """The schedule the options give, or None when none is given.

    Raises:
        Fail: more than one of --every, --cron, --at; --tz without --cron.
    """
    given = [
        name for name, value in (("--every", every), ("--cron", cron_expr), ("--at", at)) if value
    ]
    if len(given) > 1:
        raise Fail(EXIT_USAGE, f"give one schedule, not {' and '.join(given)}")
    if tz and cron_expr is None:
        raise Fail(EXIT_USAGE, "--tz is the zone of a --cron: give it with --cron")
    if every is not None:
        return parse_every(every)
    if cron_expr is not None:
        return cron(cron_expr, tz=tz or None)
    if at is not None:
        return parse_at(at)
    return None


def definition_options(func: _F) -> _F:
    """The options of ``add`` and ``update`` that make a definition."""
    options = [
        click.option("--task", default=None, help="The task's registered name."),
        click.option(
            "--every", default=None, help="An interval: seconds, or with a unit: 30s, 5m, 1.5h, 1d."
        ),
        click.option("--cron", "cron_expr", default=None, help='A cron expression: "*/5 * * * *".'),
        click.option(
            "--tz", default=None, help="The zone of --cron's wall clock [default: the app's]."
        ),
        click.option(
            "--at",
            default=None,
            help="One run at an ISO 8601 instant with a zone: 2027-01-01T00:00Z.",
        ),
        click.option("--args", "args_json", default=None, help="Positional args, a JSON list."),
        click.option("--kwargs", "kwargs_json", default=None, help="Keyword args, a JSON object."),
        click.option("--queue", default=None, help="The queue to send to (an apply_async option)."),
        click.option(
            "--start-at", default=None, help="No slot before this ISO 8601 instant (with a zone)."
        ),
        click.option(
            "--end-at",
            default=None,
            help="No slot after this ISO 8601 instant; then the job is finished.",
        ),
        click.option(
            "--max-runs", default=None, help="Most runs the cluster sends; then it is finished."
        ),
    ]
    for option in reversed(options):
        func = option(func)
    return func


# -- running a call --------------------------------------------------------------


@contextmanager
def _schedules(ctx: click.Context) -> Iterator[Schedules]:
    """The app's :class:`Schedules`, closed afterwards; a refusal of the
    call (a bad definition, an unknown job, a name taken) exits 2.

    Raises:
        Fail: the backend keeps no stored jobs (RabbitMQ), or a call refused.
        ConfigurationError: the settings cannot be loaded (exit 4).
    """
    try:
        schedules = Schedules(app_of(ctx), schedule_filename=schedule_file(ctx))
    except StoredJobsRefused as exc:
        raise Fail(EXIT_USAGE, one_line(exc)) from exc
    try:
        yield schedules
    except ConfigurationError as exc:
        raise Fail(EXIT_USAGE, one_line(exc)) from exc
    finally:
        schedules.close()


def _next_slot_ms(schedules: Schedules, stored: StoredJob) -> int | None:
    """The stored job's first slot under this definition, epoch ms."""
    job = job_from_stored(stored, schedules.app, schedules.settings, app_zone(schedules.app))
    return job.slots.next_after(stored.committed_ms)


def _stored_json(schedules: Schedules, action: str, stored: StoredJob) -> dict[str, Any]:
    slot_ms = _next_slot_ms(schedules, stored)
    definition = stored.definition
    return {
        "job": stored.name,
        "action": action,
        "source": "stored",
        "version": stored.version,
        "committed_ms": stored.committed_ms,
        "effective_ms": stored.effective_ms,
        "schedule": definition.describe_schedule(),
        "next_slot_ms": slot_ms,
        "next_slot": None if slot_ms is None else iso(slot_ms, exact=True),
        "definition": definition.fields(),
    }


def _print_stored(report: dict[str, Any]) -> None:
    click.echo(
        f"{report['job']}: {report['action']} (version {report['version']}): "
        f"{report['schedule']}, task {report['definition']['task']}"
    )
    click.echo(f"  next slot  {report['next_slot'] or '(none)'}")
    definition = report["definition"]
    for key in ("start_at", "end_at", "max_runs"):
        if key in definition["anarchon"]:
            click.echo(f"  {key:<9}  {definition['anarchon'][key]}")
    for key in ("args", "kwargs", "options"):
        if definition[key]:
            click.echo(f"  {key:<9}  {json.dumps(definition[key])}")
    if report.get("paused"):
        note = f": {report['pause_note']}" if report["pause_note"] else ""
        click.echo(f"  paused{note} (nothing runs until `resume`)")


# -- the commands ------------------------------------------------------------------


@click.command()
@click.argument("name")
@definition_options
@click.option("--paused", is_flag=True, help="Store it paused: nothing runs until `resume`.")
@click.option("--note", default=None, help="The pause's note (with --paused).")
@json_option
@click.pass_context
@handled
def add(
    ctx: click.Context,
    name: str,
    task: str | None,
    every: str | None,
    cron_expr: str | None,
    tz: str | None,
    at: str | None,
    args_json: str | None,
    kwargs_json: str | None,
    queue: str | None,
    start_at: str | None,
    end_at: str | None,
    max_runs: str | None,
    paused: bool,
    note: str | None,
    as_json: bool,
) -> None:
    """Store a new job NAME: a --task and one of --every, --cron, --at.

    Every running beat runs it from its first slot at least 1 s after the
    commit. Exit 2 when the definition is refused (nothing is written) or
    NAME is taken by a stored job or a beat_schedule entry.
    """
    if not task:
        raise Fail(EXIT_USAGE, f"add {name}: give the task, --task proj.tasks.name")
    schedule = _schedule(every, cron_expr, tz, at)
    if schedule is None:
        raise Fail(EXIT_USAGE, f"add {name}: give a schedule, --every, --cron or --at")
    if note is not None and not paused:
        raise Fail(EXIT_USAGE, f"add {name}: --note is the note of a pause: give it with --paused")
    args = _json_option("--args", args_json, list) if args_json is not None else ()
    kwargs = _json_option("--kwargs", kwargs_json, dict) if kwargs_json is not None else None
    options = {"queue": queue} if queue else None
    bounds = {k: v for k, v in bounds_of(start_at, end_at, max_runs).items() if v is not None}
    with _schedules(ctx) as schedules:
        fresh = not schedules.backend.exists()
        stored = schedules.add(
            name, task, schedule, args, kwargs, options, paused=paused, note=note, **bounds
        )
        report = _stored_json(schedules, "added", stored)
        if fresh and schedules.backend.kind == "sqlite":
            click.echo(
                f"note: created {schedules.backend.describe()}: no beat has used this file "
                "yet. Run this where beat runs, with beat's -s file "
                "(`celery -A proj anarchon -s FILE add ...`), or beat will not see the job.",
                err=True,
            )
    report["paused"] = paused
    report["pause_note"] = (note or "") if paused else None
    if as_json:
        click.echo(json.dumps(report))
    else:
        _print_stored(report)


@click.command()
@click.argument("name")
@definition_options
@json_option
@click.pass_context
@handled
def update(
    ctx: click.Context,
    name: str,
    task: str | None,
    every: str | None,
    cron_expr: str | None,
    tz: str | None,
    at: str | None,
    args_json: str | None,
    kwargs_json: str | None,
    queue: str | None,
    start_at: str | None,
    end_at: str | None,
    max_runs: str | None,
    as_json: bool,
) -> None:
    """Change the stored job NAME: the options given; the rest stays.

    The new definition holds from the first slot at least 1 s after the
    commit; slots before it keep the old one. A new --cron keeps no --tz of
    the old one: give --tz again. --queue replaces the queue and keeps the
    other send options. ``--start-at``, ``--end-at`` and ``--max-runs`` set
    a bound (``none`` removes it); a finished job whose bounds widen runs
    again. Exit 2 when NAME is no stored job (a beat_schedule
    entry changes in the code) or the definition is refused (the old one
    stays in force).
    """
    changes: dict[str, Any] = {}
    if task is not None:
        changes["task"] = task
    schedule = _schedule(every, cron_expr, tz, at)
    if schedule is not None:
        changes["schedule"] = schedule
    if args_json is not None:
        changes["args"] = _json_option("--args", args_json, list)
    if kwargs_json is not None:
        changes["kwargs"] = _json_option("--kwargs", kwargs_json, dict)
    changes.update(bounds_of(start_at, end_at, max_runs))
    with _schedules(ctx) as schedules:
        if queue is not None:
            current = schedules.get(name).definition
            options = dict(current.options) if current is not None else {}
            changes["options"] = {**options, "queue": queue}
        if not changes:
            raise Fail(
                EXIT_USAGE,
                f"update {name}: nothing to change; give --task, --every, --cron, --at, "
                "--args, --kwargs, --queue, --start-at, --end-at or --max-runs",
            )
        stored = schedules.update(name, **changes)
        report = _stored_json(schedules, "updated", stored)
        pause = schedules.state().pauses.get(name)
    report["paused"] = pause is not None and pause.paused
    report["pause_note"] = pause.note if pause is not None and pause.paused else None
    if as_json:
        click.echo(json.dumps(report))
    else:
        _print_stored(report)


@click.command()
@click.argument("name")
@json_option
@click.pass_context
@handled
def remove(ctx: click.Context, name: str, as_json: bool) -> None:
    """Remove the stored job NAME: no slot from 1 s after the commit runs.

    Its history stays (`history NAME`). Exit 2 when NAME is no stored job.
    """
    with _schedules(ctx) as schedules:
        version = schedules.remove(name)
    if as_json:
        click.echo(json.dumps({"job": name, "action": "removed", "version": version}))
    else:
        click.echo(f"{name}: removed (store version {version}); {REMOVED_TAIL}")


def _pause_json(name: str, action: str, pause: Pause, changed: bool) -> dict[str, Any]:
    return {
        "job": name,
        "action": action,
        "changed": changed,
        "paused": pause.paused,
        "note": pause.note,
        "version": pause.version,
        "paused_ms": pause.paused_ms or None,
        "resumed_ms": pause.resumed_ms,
    }


@click.command()
@click.argument("name")
@click.option("--note", default=None, help="Why (shown by `jobs` and recorded in the history).")
@json_option
@click.pass_context
@handled
def pause(ctx: click.Context, name: str, note: str | None, as_json: bool) -> None:
    """Pause NAME, a stored job or a beat_schedule entry.

    From the first slot at least 1 s after the commit, no instance claims
    or sends it; its history records the pause once, with the note. A
    paused job stays paused (its first note stays). Exit 2 when no job has
    the name.
    """
    with _schedules(ctx) as schedules:
        state = schedules.state()
        before = state.pauses.get(name)
        result = schedules.pause(name, note=note)
    changed = result.version != (before.version if before else 0)
    if as_json:
        click.echo(json.dumps(_pause_json(name, "paused", result, changed)))
    else:
        click.echo(pause_line(name, result, changed, _own_version(schedules, state, name)))


@click.command()
@click.argument("name")
@json_option
@click.pass_context
@handled
def resume(ctx: click.Context, name: str, as_json: bool) -> None:
    """Resume NAME: its first slot is the first at least 1 s after the commit.

    Slots that passed while it was paused are not sent, unless its
    catch_up policy asks for them. A running job stays as it is. Exit 2
    when no job has the name.
    """
    with _schedules(ctx) as schedules:
        state = schedules.state()
        before = state.pauses.get(name)
        result = schedules.resume(name)
    changed = result.version != (before.version if before else 0)
    if as_json:
        click.echo(json.dumps(_pause_json(name, "resumed", result, changed)))
    else:
        click.echo(pause_line(name, result, changed, _own_version(schedules, state, name)))


def _own_version(schedules: Schedules, state: StoredState, name: str) -> int:
    """The job's own version as ``jobs`` shows it: a stored job's, 0 for a
    code entry (it has none, and wins over a stored job of its name)."""
    stored = state.jobs.get(name)
    if stored is None or name in (schedules.app.conf.beat_schedule or {}):
        return 0
    return stored.version


#: What ``remove`` prints after the store version (and the web page shows):
#: a removal holds from 1 s after its commit, like every change.
REMOVED_TAIL = f"no slot from {APPLY_DELAY_MS // 1000} s after the commit runs; its history stays"


def pause_line(name: str, result: Pause, changed: bool, job_version: int) -> str:
    """The line ``pause`` and ``resume`` print (and the web page shows).

    Args:
        name: the job.
        result: its pause state after the command.
        changed: whether the command wrote it.
        job_version: a stored job's own version (as ``jobs`` shows it; 0
            for a code entry, which has none). The pause record's number in
            the store's change counter (``--json``'s ``version``) is not
            shown: it is no version of the job.
    """
    version = f", version {job_version}" if job_version else ""
    note = f" ({result.note})" if result.note else ""
    if result.paused and changed:
        return f"{name}: paused{note}{version}"
    if result.paused:
        return f"{name}: already paused since {iso(result.paused_ms, exact=True)}{note}"
    if changed:
        return f"{name}: resumed{version}"
    return f"{name}: not paused; nothing to resume"


#: The commands of this module, as :mod:`celery_anarchon.cli` registers them.
COMMANDS = (add, update, remove, pause, resume)
