"""``celery -A proj anarchon web``: serve the operator web page with waitress."""

from __future__ import annotations

import ipaddress
import logging

import click

from ..cli_common import EXIT_CONFIG, app_of, exit_with, handled, schedule_file

__all__ = ["DEFAULT_BIND", "DEFAULT_PORT", "web"]

logger = logging.getLogger(__name__)

DEFAULT_BIND = "127.0.0.1"
DEFAULT_PORT = 5580

#: The levels ``--loglevel`` takes (Celery's).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

#: waitress worker threads: a page render blocks on the backend.
THREADS = 8


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@click.command()
@click.option("--bind", default=DEFAULT_BIND, show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=DEFAULT_PORT, show_default=True)
@click.option(
    "--allow-actions",
    is_flag=True,
    help="Enable run-now, pause, resume, and add, edit, remove of stored jobs; they need "
    "the token of anarchon_web_token or ANARCHON_WEB_TOKEN.",
)
@click.option(
    "--allowed-host",
    "allowed_hosts",
    multiple=True,
    metavar="NAME",
    help="A host name the page answers to (the Host header, any port; .example.com for "
    "every name under it); repeat for more. Bound to a loopback address it answers to "
    "localhost, 127.0.0.1 and [::1] too; any other host gets 400 (DNS rebinding). Give "
    "the names a proxy or other hosts reach it by.",
)
@click.option(
    "-l",
    "--loglevel",
    type=click.Choice(LOG_LEVELS, case_sensitive=False),
    default="INFO",
    show_default=True,
    help="Logging level: INFO shows every action with the operator's address.",
)
@click.pass_context
@handled
def web(
    ctx: click.Context,
    bind: str,
    port: int,
    allow_actions: bool,
    allowed_hosts: tuple[str, ...],
    loglevel: str,
) -> None:
    """Serve the operator web page: the cluster, every job with its recent
    slots, each job's history, the delayed tasks; with --allow-actions the
    actions too. Binds 127.0.0.1 by default (docs/web.md)."""
    app = app_of(ctx)
    # Celery's own log format; the page's actions and refusals are INFO and
    # WARNING lines of the logger celery_anarchon.web.app.
    logging.basicConfig(
        level=loglevel.upper(), format="[%(asctime)s: %(levelname)s] %(name)s: %(message)s"
    )
    try:
        import waitress

        from .app import LOOPBACK_HOSTS, create_app, web_token
    except ImportError as exc:
        exit_with(
            EXIT_CONFIG,
            f"the web page needs the {exc.name!r} package: pip install 'celery-anarchon[web]'",
            False,
        )
    token = web_token(app)
    if allow_actions and not token:
        exit_with(
            EXIT_CONFIG,
            "--allow-actions needs a token: set anarchon_web_token in the app's configuration "
            "or ANARCHON_WEB_TOKEN in the environment, e.g. ANARCHON_WEB_TOKEN=$(python -c "
            "'import secrets; print(secrets.token_urlsafe())')",
            False,
        )
    hosts: tuple[str, ...] | None
    if _loopback(bind):
        # The bound address too: a browser opening the printed URL of
        # 127.0.0.2 (or ::1 spelled in full) sends it as the Host.
        own = f"[{bind}]" if ":" in bind else bind
        hosts = (*LOOPBACK_HOSTS, own, *allowed_hosts)
    else:
        hosts = allowed_hosts or None
        # The token guards the actions only: every page reads without it.
        click.echo(
            f"WARNING: serving on {bind}, reachable from other hosts: every page (each job, "
            "its arguments, its history, the parked tasks) is open to anyone who reaches "
            "the port; the token guards only the actions. Bind 127.0.0.1, or put the page "
            "behind an authenticating proxy."
            + ("" if hosts else " Without --allowed-host it answers to any Host header."),
            err=True,
        )
    wsgi = create_app(
        app,
        allow_actions=allow_actions,
        token=token,
        schedule_filename=schedule_file(ctx),
        allowed_hosts=hosts,
    )
    actions = "actions on (token required)" if allow_actions else "read only"
    click.echo(f"celery anarchon web: http://{bind}:{port}/ ({actions})", err=True)
    waitress.serve(wsgi, host=bind, port=port, threads=THREADS, ident="celery-anarchon")
