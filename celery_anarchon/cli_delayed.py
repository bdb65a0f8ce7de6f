"""``celery anarchon delayed list|show|cancel|reschedule|count``: parked tasks.

The commands over the delayed tasks of :mod:`celery_anarchon.delayed`
(docs/delayed-tasks.md), a thin layer over its functions, registered as the
``delayed`` group of the ``anarchon`` group of :mod:`celery_anarchon.cli`::

    celery -A proj anarchon delayed list [--limit 50] [--before 2027-01-01T00:00Z]
    celery -A proj anarchon delayed show invoice-42
    celery -A proj anarchon delayed cancel invoice-42
    celery -A proj anarchon delayed reschedule invoice-42 2027-01-01T09:00+01:00
    celery -A proj anarchon delayed reschedule invoice-42 +3600
    celery -A proj anarchon delayed count

A task is named by its key (``park(..., key=...)``) or its task id, the key
first. Every command prints a line or a table by default and one JSON object
with ``--json``; times are ISO 8601 UTC (epoch milliseconds in ``--json``).

Exit codes, as for every ``celery anarchon`` command:

====  ==================================================================
0     Done.
1     Nothing done: ``cancel`` or ``reschedule`` of a task that is not
      pending (no such task is parked, or it is in flight: being released
      now, so it will be sent).
2     Usage: a bad option or argument (a ``--before`` or ``WHEN`` that is
      not ISO 8601, a naive ``WHEN``), or ``show`` of a key or id that no
      parked task has.
3     The backend is unreachable.
4     The configuration cannot be loaded, or no backend keeps delayed
      tasks (claims on RabbitMQ without ``anarchon_delayed_backend``).
====  ==================================================================
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import Any

import click

from . import delayed
from .backends import sanitize_url
from .checks import one_line
from .cli_common import (
    EXIT_CONFIG,
    EXIT_PROBLEM,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    Fail,
    app_of,
    handled,
    json_option,
)
from .cli_schedules import parse_at
from .delayed.model import IN_FLIGHT, ParkedTask
from .delayed.store import DelayedStore
from .exceptions import ConfigurationError
from .settings import Settings
from .times import iso

__all__ = ["delayed_group", "parse_before", "parse_when"]

#: Longest error text in ``list``'s table, characters (``show`` and
#: ``--json`` give it whole).
ERROR_WIDTH = 60

_SECONDS = re.compile(r"\+?(?:\d+(?:\.\d*)?|\.\d+)")


# -- reading the arguments -----------------------------------------------------------


def parse_when(text: str) -> datetime:
    """``reschedule``'s WHEN: ``+SECONDS`` or ``SECONDS`` from now (this
    host's clock), or an ISO 8601 instant with its zone, as an aware
    datetime.

    Raises:
        Fail: anything else, or an instant without a zone (exit 2).
    """
    value = text.strip()
    if _SECONDS.fullmatch(value):
        return datetime.now(timezone.utc) + timedelta(seconds=float(value.lstrip("+")))
    return parse_at(value, "WHEN")


def parse_before(text: str) -> datetime:
    """``--before``: an ISO 8601 instant; one without a zone is read as UTC.

    Raises:
        Fail: not ISO 8601 (exit 2).
    """
    return parse_at(text, "--before", naive_utc=True)


# -- the store ---------------------------------------------------------------------


@contextmanager
def _delayed_app(ctx: click.Context) -> Iterator[tuple[Any, DelayedStore]]:
    """The app and its delayed store (in ``anarchon_delayed_backend``,
    else the claim backend), the store's connections closed afterwards.

    Raises:
        ConfigurationError: a bad setting that ``check`` reports (exit 4).
        Fail: no backend keeps delayed tasks, or a bad
            ``anarchon_delayed_*`` setting, ``anarchon_delayed_backend``
            included (exit 4).
    """
    app = app_of(ctx)
    Settings.from_app(app)  # a bad anarchon_* setting: exit 4, pointing to `check`
    try:
        store, _ = delayed.store_for(app)
    except ConfigurationError as exc:  # a backend without a delayed store, or a bad setting
        raise Fail(EXIT_CONFIG, f"configuration error: {one_line(exc)}") from exc
    backend = getattr(store, "backend", None)
    if backend is not None and not backend.exists():
        # A SQLite file that is not there: another folder than beat's, most
        # likely; "0 parked" would be a wrong answer.
        store.close()
        raise Fail(
            EXIT_UNREACHABLE,
            f"no delayed store: {backend.describe()} does not exist: beat creates it on its "
            "first start. Run the command where beat runs, with beat's -s file "
            "(`celery -A proj anarchon -s FILE delayed ...`), or set anarchon_backend "
            "(or anarchon_delayed_backend) to the shared backend beat uses.",
        )
    try:
        yield app, store
    finally:
        store.close()


# -- formatting --------------------------------------------------------------------


def _printable(text: str) -> str:
    """``text`` with control characters escaped, so one value stays one
    cell of a table."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _task_json(task: ParkedTask) -> dict[str, Any]:
    """:meth:`ParkedTask.summary`, with ``due`` and ``parked`` as ISO text,
    ``lease_until_ms`` (in flight: when the releaser's lease expires, else
    None) and the error's credentials masked."""
    summary = task.summary()
    parked_ms = summary["parked_ms"]
    return {
        **summary,
        "due": iso(summary["due_ms"], exact=True),
        "parked": None if parked_ms is None else iso(parked_ms, exact=True),
        "lease_until_ms": task.due_ms if task.state == IN_FLIGHT else None,
        "error": None if task.error is None else sanitize_url(task.error),
    }


def _table(headers: list[str], rows: list[list[str]]) -> str:
    """Left-aligned columns separated by two spaces."""
    widths = [max([len(h)] + [len(row[i]) for row in rows]) for i, h in enumerate(headers)]
    return "\n".join(
        "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(line)).rstrip()
        for line in [headers, *rows]
    )


def _error_cell(error: str | None) -> str:
    if not error:
        return "-"
    text = _printable(error)
    return text if len(text) <= ERROR_WIDTH else text[: ERROR_WIDTH - 3] + "..."


def _print_task(item: dict[str, Any]) -> None:
    click.echo(item["key"] if item["key"] is not None else item["id"])
    lines = [
        ("id", item["id"]),
        ("key", "-" if item["key"] is None else _printable(item["key"])),
        ("task", _printable(item["task"])),
        ("state", item["state"]),
        ("due", item["due"]),
    ]
    if item["lease_until_ms"] is not None:
        lines.append(("lease", f"until {iso(item['lease_until_ms'], exact=True)}"))
    lines += [
        ("parked", item["parked"] or "-"),
        ("attempts", str(item["attempts"])),
        ("error", _printable(item["error"]) if item["error"] else "-"),
        ("args", json.dumps(item["args"])),
        ("kwargs", json.dumps(item["kwargs"])),
        ("options", json.dumps(item["options"])),
    ]
    for label, value in lines:
        click.echo(f"  {label:<8}  {value}")


def _why_not_pending(task: ParkedTask | None) -> str:
    if task is not None and task.state == IN_FLIGHT:
        return "it is in flight (being released now), so it will be sent"
    return "no task is pending under that key or id (never parked, cancelled, or released)"


def _described(task: ParkedTask | None) -> str:
    return "" if task is None else f" (task {_printable(task.task)}, id {task.id})"


# -- the commands ------------------------------------------------------------------


@click.group(name="delayed")
def delayed_group() -> None:
    """Parked tasks (celery_anarchon.delayed): list, show, cancel,
    reschedule, count.

    A task is named by its key or its task id. Exit codes: 0 done; 1
    nothing done (cancel or reschedule of a task not pending); 2 usage, or
    show of an unknown task; 3 backend unreachable; 4 configuration error,
    or no backend keeps delayed tasks (claims on RabbitMQ without
    anarchon_delayed_backend).
    """


@delayed_group.command(name="list")
@click.option(
    "-n",
    "--limit",
    type=click.IntRange(min=1),
    default=50,
    show_default=True,
    help="Most tasks to show, earliest due first.",
)
@click.option(
    "--before",
    default=None,
    help="Only tasks due before this ISO 8601 instant (without a zone: UTC).",
)
@json_option
@click.pass_context
@handled
def list_(ctx: click.Context, limit: int, before: str | None, as_json: bool) -> None:
    """Parked tasks, earliest due first: id, key, task, due time (UTC),
    state, failed publishes and the last error.

    A task in flight (being released) is listed by its lease's expiry. The
    count is of every parked task, pending and in flight.
    """
    before_at = None if before is None else parse_before(before)
    with _delayed_app(ctx) as (app, store):
        tasks = [_task_json(task) for task in delayed.pending(app, limit, before_at)]
        total = delayed.count(app)
        where = store.describe()
    before_ms = None if before_at is None else int(before_at.timestamp() * 1000)
    if as_json:
        report = {
            "store": where,
            "count": total,
            "limit": limit,
            "before_ms": before_ms,
            "before": None if before_ms is None else iso(before_ms, exact=True),
            "tasks": tasks,
        }
        click.echo(json.dumps(report))
        return
    click.echo(f"store: {where}")
    due = "" if before_ms is None else f" due before {iso(before_ms, exact=True)}"
    if not tasks:
        click.echo(f"{total} parked task(s); none{due} to show")
        return
    click.echo(f"{total} parked task(s); the {len(tasks)} earliest{due}:")
    rows = [
        [
            item["id"],
            "-" if item["key"] is None else _printable(item["key"]),
            _printable(item["task"]),
            item["due"],
            item["state"],
            str(item["attempts"]),
            _error_cell(item["error"]),
        ]
        for item in tasks
    ]
    headers = ["ID", "KEY", "TASK", "DUE (UTC)", "STATE", "ATTEMPTS", "ERROR"]
    click.echo(_table(headers, rows))


@delayed_group.command()
@click.argument("key_or_id")
@json_option
@click.pass_context
@handled
def show(ctx: click.Context, key_or_id: str, as_json: bool) -> None:
    """The parked task KEY_OR_ID (its key, else its task id): state, due
    time, failed publishes, last error, args, kwargs and options.

    Exit 2 when no task is parked under that key or id (never parked,
    cancelled, or released already).
    """
    with _delayed_app(ctx) as (app, _store):
        task = delayed.get(app, key_or_id)
    if task is None:
        raise Fail(
            EXIT_USAGE,
            f"no parked task has the key or id {key_or_id!r} (never parked, cancelled, "
            "or released already)",
        )
    item = _task_json(task)
    if as_json:
        click.echo(json.dumps(item))
    else:
        _print_task(item)


@delayed_group.command()
@click.argument("key_or_id")
@json_option
@click.pass_context
@handled
def cancel(ctx: click.Context, key_or_id: str, as_json: bool) -> None:
    """Cancel the pending task KEY_OR_ID: it is deleted and never sent.

    Atomic against a release. Exit 1 when it was not pending: no such task
    is parked, or it is in flight (being released now: it will be sent).
    """
    with _delayed_app(ctx) as (app, _store):
        task = delayed.get(app, key_or_id)
        done = delayed.cancel(app, key_or_id)
        if not done:
            task = delayed.get(app, key_or_id)  # why not: in flight, or absent
    if as_json:
        report = {
            "key_or_id": key_or_id,
            "action": "cancel",
            "was_pending": done,
            "task": None if task is None else _task_json(task),
        }
        click.echo(json.dumps(report))
    elif done:
        click.echo(f"{_printable(key_or_id)}: cancelled{_described(task)}; it will not be sent")
    else:
        click.echo(f"{_printable(key_or_id)}: not cancelled: {_why_not_pending(task)}")
    if not done:
        raise click.exceptions.Exit(EXIT_PROBLEM)


@delayed_group.command()
@click.argument("key_or_id")
@click.argument("when")
@json_option
@click.pass_context
@handled
def reschedule(ctx: click.Context, key_or_id: str, when: str, as_json: bool) -> None:
    """Move the pending task KEY_OR_ID to WHEN: an ISO 8601 instant with its
    zone (2027-01-01T09:00Z), or +SECONDS from now (+3600).

    A time in the past releases it at once. Atomic against a release. Exit 1
    when it was not pending: no such task is parked, or it is in flight.
    """
    at = parse_when(when)
    due_ms = int(at.timestamp() * 1000)
    with _delayed_app(ctx) as (app, _store):
        done = delayed.reschedule(app, key_or_id, at)
        task = delayed.get(app, key_or_id)
    if as_json:
        report = {
            "key_or_id": key_or_id,
            "action": "reschedule",
            "was_pending": done,
            "due_ms": due_ms,
            "due": iso(due_ms, exact=True),
            "task": None if task is None else _task_json(task),
        }
        click.echo(json.dumps(report))
    elif done:
        click.echo(
            f"{_printable(key_or_id)}: rescheduled to {iso(due_ms, exact=True)}{_described(task)}"
        )
    else:
        click.echo(f"{_printable(key_or_id)}: not rescheduled: {_why_not_pending(task)}")
    if not done:
        raise click.exceptions.Exit(EXIT_PROBLEM)


@delayed_group.command()
@json_option
@click.pass_context
@handled
def count(ctx: click.Context, as_json: bool) -> None:
    """How many tasks are parked, pending and in flight."""
    with _delayed_app(ctx) as (app, store):
        total = delayed.count(app)
        where = store.describe()
    if as_json:
        click.echo(json.dumps({"store": where, "count": total}))
    else:
        click.echo(f"{total} parked task(s), pending and in flight, in the {where}")
