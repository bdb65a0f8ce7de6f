"""What every ``celery anarchon`` command shares: exit codes, the error
handling that turns an error into one line (or one JSON object) and its
exit code, ``--json``, and the app from Celery's CLI context.

:mod:`celery_anarchon.cli` (the reading and operating commands) and
:mod:`celery_anarchon.cli_schedules` (the commands that change stored jobs)
both build on it; neither imports the other's commands from here.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import click

from .checks import one_line
from .exceptions import BackendMissing, BackendUnavailable, ConfigurationError

__all__ = [
    "EXIT_CONFIG",
    "EXIT_OK",
    "EXIT_PROBLEM",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "Fail",
    "app_of",
    "exit_with",
    "handled",
    "json_option",
    "schedule_file",
]

#: Exit codes, see :mod:`celery_anarchon.cli`.
EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_CONFIG = 4

_F = TypeVar("_F", bound=Callable[..., Any])


class Fail(Exception):
    """Ends a command with ``code`` and a one-line ``message``."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def handled(func: _F) -> _F:
    """Turn backend and configuration errors into a one-line message and
    the documented exit code (JSON ``{"error", "exit_code"}`` with --json)."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        as_json = bool(kwargs.get("as_json"))
        try:
            return func(*args, **kwargs)
        except Fail as exc:
            exit_with(exc.code, exc.message, as_json)
        except BackendMissing as exc:
            exit_with(EXIT_UNREACHABLE, f"no claim backend: {one_line(exc)}", as_json)
        except BackendUnavailable as exc:
            exit_with(EXIT_UNREACHABLE, f"claim backend unreachable: {one_line(exc)}", as_json)
        except ConfigurationError as exc:
            exit_with(
                EXIT_CONFIG,
                f"configuration error: {one_line(exc)} "
                "(`celery -A proj anarchon check` lists every problem)",
                as_json,
            )

    return wrapper  # type: ignore[return-value]


def exit_with(code: int, message: str, as_json: bool) -> NoReturn:
    """Print ``message`` (on stderr; as ``{"error", "exit_code"}`` on stdout
    with ``as_json``) and exit with ``code``."""
    if as_json:
        click.echo(json.dumps({"error": message, "exit_code": code}))
    else:
        click.echo(f"celery anarchon: {message}", err=True)
    raise click.exceptions.Exit(code)


json_option = click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON object (for scripts)."
)


def app_of(ctx: click.Context) -> Any:
    """The Celery app, from Celery's CLI context (``ctx.obj.app``, as
    Celery's own commands get it).

    Raises:
        click.UsageError: no ``-A`` (Celery's empty default app).
    """
    obj = ctx.obj
    app = getattr(obj, "app", None)
    if app is None or _is_celery_default_app(app):
        raise click.UsageError(
            "no app given: run it as `celery -A proj anarchon ...`, with -A naming the "
            "module of your Celery app (the one beat runs with)",
            ctx=ctx,
        )
    return app


def _is_celery_default_app(app: Any) -> bool:
    """True for the app Celery falls back to without ``-A``: it has no
    ``beat_schedule`` and no ``anarchon_backend``, so a command on it would
    report an empty cluster (and, for SQLite, read a file beside the
    current folder)."""
    from celery import _state

    return (
        app is _state.default_app
        and not app.conf.beat_schedule
        and app.conf.get("anarchon_backend") is None
    )


def schedule_file(ctx: click.Context) -> str | None:
    """The ``-s`` file given to the ``anarchon`` group, or None."""
    value = ctx.meta.get("anarchon.schedule")
    return value if isinstance(value, str) else None
