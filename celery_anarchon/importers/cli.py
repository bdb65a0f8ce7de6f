"""``celery anarchon import``: move another scheduler's entries into stored jobs.

::

    celery -A proj anarchon import redbeat [--redis URL] [--dry-run] [--json]
    celery -A proj anarchon import django-celery-beat [--database-url URL] [--dry-run] [--json]

Exit codes, as for every ``celery anarchon`` command:

====  ==================================================================
0     Every entry was imported (or would be, with ``--dry-run``, or an
      earlier run imported it).
1     Some entry was skipped (its name is taken) or not mapped (no
      equivalent here, or validation refused it), or nothing was found.
2     Usage: a bad option, a source that cannot be read as given (not a
      Redis URL, a key that is not redbeat's index, no django-celery-beat
      tables, Django not configured and no ``--database-url``), no ``-A``.
3     The source (redbeat's Redis, the database) or the claim backend is
      unreachable.
4     The app's configuration cannot be loaded, or its claim backend keeps
      no stored jobs (RabbitMQ).
====  ==================================================================
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any, TypeVar

import click

from ..checks import one_line
from ..cli_common import (
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
from .common import (
    ALREADY_IMPORTED,
    DONE,
    IMPORTED,
    NOT_MAPPED,
    SKIPPED,
    WOULD_IMPORT,
    EntryResult,
    ImportReport,
    ImportSourceError,
    SourceUnavailable,
)

__all__ = ["import_group"]

#: How the text output names each status.
LABELS = {
    IMPORTED: "imported",
    WOULD_IMPORT: "would import",
    ALREADY_IMPORTED: "already imported",
    SKIPPED: "skipped",
    NOT_MAPPED: "not mapped",
}

_F = TypeVar("_F", bound=Callable[..., Any])


def _handled(func: _F) -> _F:
    """:func:`~celery_anarchon.cli_common.handled`, with the source's own
    errors: an unreadable source (exit 2) and an unreachable one (exit 3)."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except ImportSourceError as exc:
            raise Fail(EXIT_USAGE, one_line(exc)) from exc
        except SourceUnavailable as exc:
            raise Fail(EXIT_UNREACHABLE, f"source unreachable: {one_line(exc)}") from exc

    return handled(wrapper)  # type: ignore[return-value]


_dry_run = click.option(
    "--dry-run", is_flag=True, help="Write nothing; report what would be stored."
)
_epoch_anchor = click.option(
    "--epoch-anchor",
    is_flag=True,
    help="Anchor interval jobs on the Unix epoch instead of their last run (which "
    "keeps the phase they had).",
)
_json = json_option


@click.group(name="import")
def import_group() -> None:
    """Store another scheduler's entries as stored jobs (redbeat, django-celery-beat).

    Each entry is validated as `add` validates it; a name already taken (a
    code entry, a stored job) is skipped, an entry with no equivalent here
    is reported with the reason. Exit 0 when all were imported, 1 when some
    were skipped or not mapped.
    """


@import_group.command(name="redbeat")
@click.option(
    "--redis",
    "redis_url",
    default=None,
    help="redbeat's Redis URL [default: redbeat_redis_url, else broker_url].",
)
@click.option(
    "--key-prefix",
    default=None,
    help="redbeat's key prefix [default: redbeat_key_prefix, else 'redbeat:'].",
)
@_epoch_anchor
@_dry_run
@_json
@click.pass_context
@_handled
def redbeat(
    ctx: click.Context,
    redis_url: str | None,
    key_prefix: str | None,
    epoch_anchor: bool,
    dry_run: bool,
    as_json: bool,
) -> None:
    """celery-redbeat's entries, read from its Redis."""
    from .redbeat import import_redbeat

    report = import_redbeat(
        app_of(ctx),
        redis_url,
        key_prefix=key_prefix,
        dry_run=dry_run,
        keep_phase=not epoch_anchor,
        schedule_filename=schedule_file(ctx),
    )
    _finish(report, as_json)


@import_group.command(name="django-celery-beat")
@click.option(
    "--database-url",
    default=None,
    help="The Django database's URL, read with SQLAlchemy [default: through Django's ORM, "
    "with the project's settings].",
)
@_epoch_anchor
@_dry_run
@_json
@click.pass_context
@_handled
def django_celery_beat(
    ctx: click.Context,
    database_url: str | None,
    epoch_anchor: bool,
    dry_run: bool,
    as_json: bool,
) -> None:
    """django-celery-beat's periodic tasks, through the ORM or from its tables."""
    from .django import import_django_celery_beat

    report = import_django_celery_beat(
        app_of(ctx),
        database_url,
        dry_run=dry_run,
        keep_phase=not epoch_anchor,
        schedule_filename=schedule_file(ctx),
    )
    _finish(report, as_json)


def _finish(report: ImportReport, as_json: bool) -> None:
    """Print the report; exit 1 unless every entry was imported."""
    code = EXIT_OK if report.ok and report.entries else EXIT_PROBLEM
    if as_json:
        click.echo(json.dumps({**report.as_dict(), "exit_code": code}))
    else:
        _print(report)
    if code != EXIT_OK:
        raise click.exceptions.Exit(code)


def _print(report: ImportReport) -> None:
    click.echo(f"from {report.source}: {report.read_from}")
    click.echo(f"into: {report.target}")
    if report.dry_run:
        click.echo("dry run: nothing written")
    if not report.entries:
        click.echo(f"no {report.source} entries found there: are the URL and the prefix right?")
        return
    width = max(len(LABELS[e.status]) for e in report.entries)
    for entry in report.entries:
        click.echo("")
        click.echo(f"{LABELS[entry.status]:<{width}}  {entry.name}: {_what(entry)}")
        for note in entry.notes if entry.status in DONE else ():
            click.echo(f"{'':<{width}}    - {note}")
    counts = ", ".join(f"{n} {LABELS[s]}" for s, n in report.counts().items() if n)
    click.echo("")
    click.echo(counts)


def _what(entry: EntryResult) -> str:
    if entry.status == NOT_MAPPED:
        return f"{entry.source}: {entry.reason}"
    text = f"{entry.schedule} (was {entry.source})" if entry.schedule else entry.source
    if entry.paused:
        text += ", paused"
    if entry.reason:
        text += f": {entry.reason}"
    return text
