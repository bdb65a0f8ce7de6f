"""The operator web app: a Flask (WSGI) app over the control API.

:func:`create_app` builds it for one Celery app. The pages only read; the
actions (run-now, pause, resume; add, edit, remove of stored jobs) are off
unless ``allow_actions``, and then need the operator's token (the
``anarchon_web_token`` setting or the ``ANARCHON_WEB_TOKEN`` environment
variable), given once on the sign-in page, and a CSRF token in every form
post. A sign-in puts a random session id in the signed session cookie and
in this process's set of live sessions; signing out removes it, so a copied
cookie stops working. A refused action answers 403 and changes nothing.
With ``allowed_hosts``, a request whose ``Host`` is not one of them answers
400 (DNS rebinding). docs/web.md describes the pages and the protection.
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
import json
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from flask import Flask, flash, redirect, render_template, request, session, url_for
from werkzeug.wrappers import Response

from ..backends import sanitize_url
from ..checks import one_line
from ..cli_common import Fail
from ..cli_schedules import REMOVED_TAIL, _json_option, _schedule, pause_line
from ..exceptions import AnarchonError, BackendMissing, BackendUnavailable, ConfigurationError
from ..schedules import NoSuchJob, Schedules
from .pages import (
    FILTERS,
    SORTS,
    JobsQuery,
    PageControl,
    cluster_page,
    delayed_page,
    job_page,
    jobs_page,
    now_text,
)

__all__ = ["LOOPBACK_HOSTS", "TOKEN_ENV", "TOKEN_SETTING", "create_app", "web_token"]

#: What a page shows as a banner instead of its data: the backend does not
#: answer, (SQLite) its file does not exist yet, or it is reachable but
#: refuses to be used as configured (Redis credentials, eviction policy).
_UNUSABLE = (BackendUnavailable, BackendMissing, ConfigurationError)

logger = logging.getLogger(__name__)

#: Where the operator's token is read from: the setting, then the environment.
TOKEN_SETTING = "anarchon_web_token"
TOKEN_ENV = "ANARCHON_WEB_TOKEN"

#: The refresh interval a page starts with, and the choices, seconds (0: off).
REFRESH_S = 10
REFRESH_CHOICES = (0, 2, 5, 10, 30, 60)

#: The host names of a page bound to a loopback address (any port).
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")

#: Most live sessions a process keeps; the oldest sign-in goes first.
MAX_SESSIONS = 1000


def web_token(celery_app: Any) -> str | None:
    """The operator's token: the ``anarchon_web_token`` setting, else the
    ``ANARCHON_WEB_TOKEN`` environment variable, else None (empty counts
    as unset)."""
    value = celery_app.conf.get(TOKEN_SETTING) or os.environ.get(TOKEN_ENV) or None
    return str(value) if value else None


class _Shared:
    """The one Control (and Schedules) a web app reads through, opened
    once and shared by the server's threads."""

    def __init__(self, celery_app: Any, schedule_filename: str | None) -> None:
        self.celery_app = celery_app
        self.control = PageControl(celery_app, schedule_filename=schedule_filename)
        self.lock = threading.Lock()
        self._schedules: Schedules | None = None
        #: How long opening the backend took, milliseconds (None: not open yet).
        self.connect_ms: float | None = None

    def ready(self) -> float:
        """Open the backend once, for every thread (a reading page never
        creates a SQLite file: it must exist); how long opening took, ms.

        Raises:
            BackendMissing: the SQLite file does not exist yet.
            BackendUnavailable: the backend does not answer (tried again
                at the next request).
        """
        with self.lock:
            if self.connect_ms is None:
                self.control.require_backend()
                started = time.perf_counter()
                self.control.backend.open()
                self.connect_ms = (time.perf_counter() - started) * 1000
            return self.connect_ms

    @property
    def schedules(self) -> Schedules:
        """The stored-jobs API over the same backend.

        Raises:
            StoredJobsRefused: the backend keeps no stored jobs (RabbitMQ).
        """
        if self._schedules is None:
            self._schedules = Schedules(self.celery_app, backend=self.control.backend)
        return self._schedules


class _Sessions:
    """This process's live sessions: the random id a sign-in puts in the
    session cookie. Signing out removes it, so a copy of the cookie stops
    working; a restart forgets them all. Thread-safe."""

    def __init__(self) -> None:
        self._ids: dict[str, float] = {}  # id -> sign-in time (time.time(), s)
        self._lock = threading.Lock()

    def start(self) -> str:
        """A new live session; its id."""
        sid = secrets.token_urlsafe(32)
        with self._lock:
            self._ids[sid] = time.time()
            while len(self._ids) > MAX_SESSIONS:
                del self._ids[next(iter(self._ids))]
        return sid

    def end(self, sid: object) -> None:
        """Forget the session ``sid`` (nothing when unknown)."""
        with self._lock:
            if isinstance(sid, str):
                self._ids.pop(sid, None)

    def __contains__(self, sid: object) -> bool:
        with self._lock:
            return isinstance(sid, str) and sid in self._ids


def _host_name(value: str) -> str | None:
    """The name of a ``Host`` header without its port, lower case, an IPv6
    literal in brackets (``[::1]:5580`` -> ``[::1]``); None when it is not
    a host (RFC 9110 section 7.2: ``uri-host [ ":" port ]``)."""
    value = value.strip().lower()
    if value.startswith("["):
        name, bracket, port = value.partition("]")
        name += bracket
        if not bracket:
            return None
        try:
            ipaddress.IPv6Address(name[1:-1])
        except ValueError:
            return None
    else:
        name, _, port = value.partition(":")
        port = f":{port}" if port else ""
        if not re.fullmatch(r"[a-z0-9.-]+", name):
            return None
    if port and not (re.fullmatch(r":[0-9]{1,5}", port) and int(port[1:]) <= 65535):
        return None
    return name


def _allowed_names(hosts: Iterable[str]) -> tuple[str, ...]:
    """``allowed_hosts`` as :func:`_host_name` gives them: lower case, the
    port dropped, an IPv6 address in brackets (``::1`` -> ``[::1]``).

    Raises:
        ConfigurationError: a name that is no host name.
    """
    names = []
    for host in hosts:
        text = str(host).strip()
        if text.count(":") > 1 and not text.startswith("["):
            text = f"[{text}]"  # an IPv6 address without its brackets
        suffix = text.startswith(".")
        name = _host_name(text[1:] if suffix else text)
        if not name:
            raise ConfigurationError(
                f"allowed host {host!r} is no host name: give a name (anarchon.example.com), "
                "an address (10.0.0.7, [::1]), or .example.com for every name under it."
            )
        names.append(f".{name}" if suffix else name)
    return tuple(names)


def _host_allowed(host: str | None, allowed: tuple[str, ...]) -> bool:
    """Whether a request's ``Host`` header names one of ``allowed`` (any
    port; ``.example.com`` allows example.com and every name under it)."""
    name = _host_name(host or "")
    if not name:
        return False
    for ref in allowed:
        if name == ref.lstrip(".") or (ref.startswith(".") and name.endswith(ref)):
            return True
    return False


def create_app(
    celery_app: Any,
    *,
    allow_actions: bool = False,
    token: str | None = None,
    schedule_filename: str | None = None,
    allowed_hosts: Iterable[str] | None = None,
) -> Flask:
    """The operator web app for ``celery_app``, as a Flask (WSGI) app.

    Args:
        celery_app: the Celery app beat runs with (its ``beat_schedule`` and
            ``anarchon_*`` settings).
        allow_actions: enable run-now, pause, resume, and add, edit, remove
            of stored jobs.
        token: the operator's token; default :func:`web_token`.
        schedule_filename: beat's ``-s`` file (default SQLite backend only).
        allowed_hosts: the host names the page answers to (the ``Host``
            header, any port; ``.example.com`` for every name under it);
            any other answers 400, against DNS rebinding. None (the
            default, for a page mounted into a site that checks the host
            itself): every host. The command passes :data:`LOOPBACK_HOSTS`
            when bound to a loopback address, and its ``--allowed-host``.
    Returns:
        the Flask app; mount it anywhere a WSGI app goes (docs/web.md).
    Raises:
        ConfigurationError: ``allow_actions`` without a token, a name of
            ``allowed_hosts`` that is no host name, or a bad setting (as
            beat would refuse).
    """
    token = token or web_token(celery_app)
    if allow_actions and not token:
        raise ConfigurationError(
            f"the web page's actions need a token: set {TOKEN_SETTING} in the app's "
            f"configuration or the {TOKEN_ENV} environment variable, e.g. "
            f"{TOKEN_ENV}=$(python -c 'import secrets; print(secrets.token_urlsafe())')."
        )
    allowed = None if allowed_hosts is None else _allowed_names(allowed_hosts)
    shared = _Shared(celery_app, schedule_filename)
    sessions = _Sessions()
    app = Flask(__name__)
    app.secret_key = secrets.token_bytes(32)
    app.config.update(
        SESSION_COOKIE_HTTPONLY=True,
        SESSION_COOKIE_SAMESITE="Strict",
        SESSION_COOKIE_NAME="anarchon_session",
    )
    app.extensions["anarchon"] = shared
    app_name = str(celery_app.main or "proj")

    def signed_in() -> bool:
        return bool(allow_actions and token and session.get("sid") in sessions)

    def csrf_ok() -> bool:
        sent = request.form.get("csrf", "")
        expected = session.get("csrf")
        return isinstance(expected, str) and hmac.compare_digest(sent.encode(), expected.encode())

    def csrf_token() -> str:
        value = session.get("csrf")
        if not isinstance(value, str):
            value = secrets.token_urlsafe(32)
            session["csrf"] = value
        return value

    @app.context_processor
    def _globals() -> dict[str, Any]:
        return {
            "allow_actions": allow_actions,
            "signed_in": signed_in(),
            "csrf_token": csrf_token,
            "refresh_s": REFRESH_S,
            "refresh_choices": REFRESH_CHOICES,
            "backend_name": sanitize_url(shared.control.backend.describe()),
            "now_text": now_text,
        }

    @app.before_request
    def _check_host() -> Response | None:
        # Against DNS rebinding: a page of another site whose name is made
        # to resolve to this address reaches it with its own name as Host.
        # (Flask 3.1's TRUSTED_HOSTS would do this, but Werkzeug cannot
        # match an IPv6 literal there: "[::1]" is cut at its first colon.)
        if allowed is None or _host_allowed(request.headers.get("Host"), allowed):
            return None
        logger.warning(
            "anarchon web: refused %s %s from %s: host %r is not allowed",
            request.method,
            request.path,
            request.remote_addr,
            request.headers.get("Host"),
        )
        body = (
            "400: this page does not answer to that host name; to reach it by that "
            "name, start it with --allowed-host NAME (or pass allowed_hosts).\n"
        )
        return Response(body, status=400, mimetype="text/plain")

    @app.after_request
    def _headers(response: Response) -> Response:
        # Scripts and styles from this app only, no inline script (the page
        # has none: a markup that slipped through escaping would not run),
        # never in a frame (the action buttons cannot be clicked through
        # another site's page).
        response.headers.setdefault(
            "Content-Security-Policy",
            "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
            "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
        )
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        response.headers.setdefault("X-Frame-Options", "DENY")
        response.headers.setdefault("Referrer-Policy", "same-origin")
        return response

    def refuse(why: str) -> Response:
        logger.warning(
            "anarchon web: refused %s %s from %s: %s",
            request.method,
            request.path,
            request.remote_addr,
            why,
        )
        body = render_template("refused.html", why=why)
        return Response(body, status=403, mimetype="text/html")

    def form_refusal() -> Response | None:
        """Why an action's form page is refused (403), or None: actions off
        first, then not signed in, as the action itself answers."""
        if not allow_actions:
            return refuse("actions are off (start the page with --allow-actions)")
        if not signed_in():
            return refuse("not signed in: give the operator's token first")
        return None

    def guarded(action: Callable[..., Response]) -> Callable[..., Response]:
        """An action view: 403 unless actions are on, the session is signed
        in, and the form's CSRF token is the session's."""

        @functools.wraps(action)
        def view(**kwargs: Any) -> Response:
            refused = form_refusal()
            if refused is not None:
                return refused
            if not csrf_ok():
                return refuse("the form's CSRF token is missing or wrong: reload the page")
            return action(**kwargs)

        return view

    def audit(action: str, job: str, outcome: str) -> None:
        """Log an action's outcome (the message shown, without the job's name
        in front: the line names it)."""
        outcome = sanitize_url(outcome.removeprefix(f"{job}: "))
        logger.info("anarchon web: %s %r by %s: %s", action, job, request.remote_addr, outcome)

    def banner_of(exc: BaseException, what: str = "claim backend") -> str:
        """The banner of a page whose store ``what`` cannot be read."""
        text = sanitize_url(one_line(exc))
        if isinstance(exc, BackendMissing):
            return f"No {what} yet: {text}"
        if isinstance(exc, BackendUnavailable):
            return f"The {what} does not answer: {text}"
        return f"The {what} cannot be used as configured: {text}"

    def page(template: str, fragment: str, **values: Any) -> str:
        """The whole page, or (``?fragment=1``, the refresh) its live part."""
        if request.args.get("fragment") == "1":
            return render_template(fragment, **values)
        return render_template(template, fragment=fragment, **values)

    # -- pages ----------------------------------------------------------------

    @app.get("/")
    def cluster() -> str:
        try:
            connect_ms = shared.ready()
            values: dict[str, Any] = {"data": cluster_page(shared.control, app_name, connect_ms)}
        except _UNUSABLE as exc:
            values = {"data": None, "banner": banner_of(exc)}
        return page("cluster.html", "_cluster.html", **values)

    @app.get("/jobs")
    def jobs() -> str:
        query = JobsQuery.from_args(request.args)
        banner = None
        try:
            shared.ready()
            result = jobs_page(shared.control, query)
        except _UNUSABLE as exc:
            banner = banner_of(exc) + " Only the beat_schedule entries are listed, without states."
            result = jobs_page(shared.control, query, backend_up=False)
        return page(
            "jobs.html",
            "_jobs.html",
            result=result,
            query=query,
            filters={key: value[0] for key, value in FILTERS.items()},
            sorts=SORTS,
            banner=banner,
        )

    @app.get("/jobs/<path:name>")
    def job(name: str) -> str | Response:
        try:
            shared.ready()
            data = job_page(shared.control, name)
        except _UNUSABLE as exc:
            return page("job.html", "_job.html", name=name, data=None, banner=banner_of(exc))
        if data is None:
            body = render_template("missing.html", name=name)
            return Response(body, status=404, mimetype="text/html")
        return page("job.html", "_job.html", name=name, data=data, stored=_is_stored(data))

    @app.get("/delayed")
    def delayed() -> str:
        search = request.args.get("q", "").strip()[:500]
        try:
            values: dict[str, Any] = {"data": delayed_page(celery_app, search)}
        except _UNUSABLE as exc:
            what = (
                "delayed store (anarchon_delayed_backend)"
                if celery_app.conf.get("anarchon_delayed_backend")
                else "delayed store (in the claim backend)"
            )
            values = {"data": None, "banner": banner_of(exc, what)}
        return page("delayed.html", "_delayed.html", **values)

    # -- signing in -------------------------------------------------------------

    @app.route("/login", methods=["GET", "POST"])
    def login() -> str | Response:
        if not allow_actions:
            return refuse("actions are off (start the page with --allow-actions)")
        if request.method == "GET":
            return render_template("login.html")
        if not csrf_ok():
            return refuse("the form's CSRF token is missing or wrong: reload the page")
        given = request.form.get("token", "")
        assert token is not None
        if not hmac.compare_digest(given.encode(), token.encode()):
            return refuse("wrong token")
        # The cookie keeps a random id and nothing derived from the token.
        sessions.end(session.get("sid"))
        session.clear()
        session["sid"] = sessions.start()
        session["csrf"] = secrets.token_urlsafe(32)  # a new one once signed in
        logger.info("anarchon web: operator signed in from %s", request.remote_addr)
        return redirect(url_for("jobs"), code=303)

    @app.post("/logout")
    def logout() -> Response:
        if not csrf_ok():
            return refuse("the form's CSRF token is missing or wrong: reload the page")
        was_signed_in = signed_in()
        sessions.end(session.get("sid"))  # a copy of the cookie stops working too
        session.clear()
        if was_signed_in:
            logger.info("anarchon web: operator signed out from %s", request.remote_addr)
        return redirect(url_for("cluster"), code=303)

    # -- actions ----------------------------------------------------------------

    def done(name: str | None, message: str, ok: bool = True) -> Response:
        flash(message, "ok" if ok else "error")
        target = url_for("job", name=name) if name else url_for("jobs")
        return redirect(target, code=303)

    def refusal(action: str, name: str, exc: BaseException) -> str:
        """Log a refused action; the message shown for it."""
        text = sanitize_url(one_line(exc))
        audit(action, name, f"refused: {text}")
        return f"{action} {name}: {text}"

    def failed(action: str, name: str, exc: BaseException, back: str | None) -> Response:
        return done(back, refusal(action, name, exc), False)

    @app.post("/jobs/<path:name>/run-now")
    @guarded
    def run_now(name: str) -> Response:
        key = request.form.get("key", "").strip() or None
        try:
            shared.control.read_jobs()  # a stored job added since the last read
            result = shared.control.run_now(name, key)
        except AnarchonError as exc:
            return failed("run-now", name, exc, name)
        except Exception as exc:
            return failed(
                "run-now", name, RuntimeError(f"the broker refused the task: {exc}"), name
            )
        if result.sent:
            message = f"{name}: sent, task id {result.task_id}"
        elif result.guarded:
            message = f"{name}: not sent, a run-now of it was sent moments ago"
        else:
            message = f"{name}: not sent, key {result.key!r} was used before"
        audit("run-now", name, message)
        return done(name, message, result.sent)

    def pause_or_resume(action: str, name: str) -> Response:
        """Pause or resume ``name``; the outcome as the command prints it."""
        note = request.form.get("note", "").strip()[:500] or None
        try:
            job = shared.control.read_jobs().get(name)
            before = job.pause if job is not None else None
            if action == "pause":
                result = shared.schedules.pause(name, note)
            else:
                result = shared.schedules.resume(name)
        except AnarchonError as exc:
            return failed(action, name, exc, name)
        changed = result.version != (before.version if before else 0)
        message = pause_line(name, result, changed, job.version if job is not None else 0)
        audit(action, name, message)
        return done(name, message)

    @app.post("/jobs/<path:name>/pause")
    @guarded
    def pause(name: str) -> Response:
        return pause_or_resume("pause", name)

    @app.post("/jobs/<path:name>/resume")
    @guarded
    def resume(name: str) -> Response:
        return pause_or_resume("resume", name)

    @app.post("/jobs/<path:name>/remove")
    @guarded
    def remove(name: str) -> Response:
        try:
            version = shared.schedules.remove(name)
        except AnarchonError as exc:
            return failed("remove", name, exc, name)
        # As `remove` prints it: the removal's number in the store's change
        # counter, which is no version of the job.
        message = f"{name}: removed (store version {version}); {REMOVED_TAIL}"
        audit("remove", name, message)
        return done(None, message)

    def form_again(action: str, job: str, exc: BaseException, **values: Any) -> Response:
        """A refused add or edit: its form again, with what was typed and
        why, so nothing typed is lost; ``values`` are the form's. 400 for
        a definition refused, 503 when the backend did not answer."""
        error = refusal(action, job, exc)
        typed = {key: str(request.form.get(key, "")) for key in FORM_FIELDS}
        body = render_template("job_form.html", typed=typed, error=error, **values)
        status = 503 if isinstance(exc, BackendUnavailable) else 400
        return Response(body, status=status, mimetype="text/html")

    @app.get("/add")
    def add_form() -> str | Response:
        return form_refusal() or render_template("job_form.html", mode="add", current={})

    @app.post("/add")
    @guarded
    def add() -> Response:
        form = request.form
        name = form.get("name", "").strip()
        try:
            if not name:
                raise ConfigurationError("give the job's name")
            fields = _definition(form, require=True)
            stored = shared.schedules.add(name, **fields)
        except (AnarchonError, Fail) as exc:
            return form_again("add", name, exc, mode="add", current={})
        message = f"{name}: added (version {stored.version})"  # as `add` prints it
        audit("add", name, message)
        return done(name, message)

    def current_of(definition: Any) -> dict[str, str]:
        """A stored definition as the edit form shows it ("Now: ...")."""
        return {
            "task": definition.task,
            "schedule": definition.describe_schedule(),
            "args": json.dumps(definition.args),
            "kwargs": json.dumps(definition.kwargs),
            "queue": (definition.options or {}).get("queue") or "",
        }

    @app.get("/jobs/<path:name>/edit")
    def edit_form(name: str) -> str | Response:
        refused = form_refusal()
        if refused is not None:
            return refused
        try:
            definition = shared.schedules.get(name).definition
        except AnarchonError as exc:
            return done(name, f"edit {name}: {sanitize_url(one_line(exc))}", False)
        if definition is None:
            return done(name, f"edit {name}: a beat_schedule entry changes in the code", False)
        current = current_of(definition)
        return render_template("job_form.html", mode="edit", name=name, current=current)

    @app.post("/jobs/<path:name>/edit")
    @guarded
    def edit(name: str) -> Response:
        try:
            fields = _definition(request.form, require=False)
            if not fields:
                raise ConfigurationError("nothing to change: fill in a field")
            if "options" in fields:  # a new queue keeps the other send options
                current = shared.schedules.get(name).definition
                fields["options"] = {**(current.options if current else {}), **fields["options"]}
            stored = shared.schedules.update(name, **fields)
        except (AnarchonError, Fail) as exc:
            try:
                definition = shared.schedules.get(name).definition
            except NoSuchJob:  # removed meanwhile, or never there: no page of its own
                return failed("edit", name, exc, None)
            except AnarchonError:  # the store does not answer: the form, without "Now"
                return form_again("edit", name, exc, mode="edit", name=name, current={})
            if definition is None:  # a beat_schedule entry: back to its page
                return failed("edit", name, exc, name)
            return form_again(
                "edit", name, exc, mode="edit", name=name, current=current_of(definition)
            )
        audit("edit", name, f"updated {', '.join(sorted(fields))} (version {stored.version})")
        return done(name, f"{name}: updated (version {stored.version})")  # as `update` prints it

    return app


#: The fields of the add and edit forms (a refused one is shown again with them).
FORM_FIELDS = ("name", "task", "every", "cron", "tz", "at", "args", "kwargs", "queue")


def _is_stored(data: dict[str, Any]) -> bool:
    job = data.get("job")
    return bool(job and job.get("source") == "stored")


def _definition(form: Any, *, require: bool) -> dict[str, Any]:
    """The fields of an add or edit form as :meth:`Schedules.add` or
    :meth:`Schedules.update` take them (the CLI's parsers: ``every`` as
    ``--every``, ``cron`` and ``tz`` as ``--cron`` and ``--tz``, ``args``
    and ``kwargs`` as JSON, ``queue`` as ``--queue``: the send option).

    Raises:
        Fail: a field the CLI would refuse.
        ConfigurationError: a required field is missing.
    """

    def text(name: str) -> str | None:
        value = str(form.get(name, "")).strip()
        return value or None

    fields: dict[str, Any] = {}
    task = text("task")
    schedule = _schedule(text("every"), text("cron"), text("tz"), text("at"))
    if require and (task is None or schedule is None):
        raise ConfigurationError("give the task and one schedule (every, cron or at)")
    if task is not None:
        fields["task"] = task
    if schedule is not None:
        fields["schedule"] = schedule
    args, kwargs = text("args"), text("kwargs")
    if args is not None:
        fields["args"] = _json_option("args", args, list)
    if kwargs is not None:
        fields["kwargs"] = _json_option("kwargs", kwargs, dict)
    queue = text("queue")
    if queue is not None:
        fields["options"] = {"queue": queue}
    return fields
