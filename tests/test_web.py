"""The operator web page (celery_anarchon.web), over HTTP with Flask's test
client, on real backends: every page, every action, the refusals (no
token, a wrong token, a bad CSRF token: 403 and nothing changed), escaping,
the backend-down banner, and the backend round trips of a Jobs render.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import socket
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner
from flask.testing import FlaskClient

from celery_anarchon.backends import backend_from_url
from celery_anarchon.backends.base import Backend, ClaimRequest, State
from celery_anarchon.cli import anarchon
from celery_anarchon.cli_schedules import REMOVED_TAIL
from celery_anarchon.exceptions import ConfigurationError
from celery_anarchon.reports import utc
from celery_anarchon.schedules import Schedules
from celery_anarchon.web import create_app
from celery_anarchon.web.app import LOOPBACK_HOSTS

from .conftest import MYSQL_URL, POSTGRES_URL, REDIS_URL, require_service

pytestmark = pytest.mark.services

TOKEN = "operator-token-" + uuid.uuid4().hex[:8]

#: A job whose name is markup: every page must show it as text.
SCRIPT = "<script>alert(1)</script>"

WEB_BACKENDS = ["sqlite", "redis", "postgresql", "mysql"]


def _url(name: str, tmp_path: Path, run: str) -> str:
    return {
        "sqlite": f"sqlite:///{tmp_path / 'claims.db'}",
        "postgresql": f"{POSTGRES_URL}?prefix=tw{run}_",
        "mysql": f"{MYSQL_URL}?prefix=tw{run}_",
        "redis": f"{REDIS_URL}?prefix=anarchon-web-test:{run}:",
    }[name]


def _drop(name: str, run: str) -> None:
    """Remove what a test's backend wrote (tables or keys of its prefix)."""
    if name == "redis":
        import redis

        client = redis.Redis.from_url(REDIS_URL)
        for key in client.scan_iter(match=f"*anarchon-web-test:{run}:*", count=1000):
            client.delete(key)
        client.close()
    elif name in {"postgresql", "mysql"}:
        url = POSTGRES_URL if name == "postgresql" else MYSQL_URL
        engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
        with engine.begin() as conn:
            for table in sa.inspect(conn).get_table_names():
                if table.startswith(f"tw{run}_"):
                    conn.execute(sa.text(f"DROP TABLE {table}"))
        engine.dispose()


def make_app(url: str, **conf: Any) -> Celery:
    """A Celery app with two code jobs (one named :data:`SCRIPT`) on ``url``,
    sending to an in-memory broker."""
    app = Celery("webtest", broker="memory://")
    app.conf.update(
        timezone="UTC",
        task_ignore_result=True,
        anarchon_backend=url,
        anarchon_web_token=TOKEN,
        beat_schedule={
            SCRIPT: {"task": "webtest.noop", "schedule": 60.0},
            "every-minute": {"task": "webtest.noop", "schedule": "* * * * *"},
        },
    )
    app.conf.update(conf)
    return app


@pytest.fixture(params=WEB_BACKENDS)
def kind(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    require_service(name)
    return name


@pytest.fixture
def celery_app(kind: str, tmp_path: Path) -> Iterator[Celery]:
    run = uuid.uuid4().hex[:8]
    yield make_app(_url(kind, tmp_path, run))
    _drop(kind, run)


@pytest.fixture
def backend(celery_app: Celery) -> Iterator[Backend]:
    """A backend of the test's own on the app's store, to write and check."""
    made = backend_from_url(celery_app.conf.anarchon_backend, instance="test-writer")
    made.open()
    yield made
    made.close()


@pytest.fixture
def client(celery_app: Celery, backend: Backend) -> FlaskClient:
    """A test client of the web app with the actions on."""
    return create_app(celery_app, allow_actions=True).test_client()


def text(client: FlaskClient, url: str, status: int = 200) -> str:
    response = client.get(url)
    assert response.status_code == status, response.get_data(as_text=True)[:2000]
    return response.get_data(as_text=True)


def csrf_of(page: str) -> str:
    match = re.search(r'name="csrf" value="([^"]+)"', page)
    assert match, "no CSRF field on the page"
    return match.group(1)


def sign_in(client: FlaskClient) -> str:
    """Sign in with the token; the CSRF token of the signed-in session."""
    page = text(client, "/login")
    response = client.post("/login", data={"csrf": csrf_of(page), "token": TOKEN})
    assert response.status_code == 303
    return csrf_of(text(client, "/jobs/every-minute"))


def record_runs(backend: Backend, job: str, count: int, *, error: str | None = None) -> list[int]:
    """``count`` sent runs of ``job`` in the last minute, the newest lost
    with ``error``; their slots, oldest first."""
    now = backend.now_ms()
    slots = [now - 50_000 + i * (40_000 // count) for i in range(count)]
    requests = [
        ClaimRequest(job, s, window_before_ms=60_000, window_after_ms=10_000, keep_until_ms=s + 1)
        for s in slots
    ]
    claims = backend.claim(requests)
    assert all(c.won for c in claims)
    backend.mark_many(claims[:-1], State.SENT)
    backend.mark(claims[-1], State.LOST, error=error)
    return slots


def manual_runs(backend: Backend, job: str) -> list[Any]:
    return [r for r in backend.history(job) if r.manual_key is not None]


def pause_of(celery_app: Celery, job: str) -> bool:
    with Schedules(celery_app) as schedules:
        pause = schedules.state().pauses.get(job)
    return pause is not None and pause.paused


# -- pages --------------------------------------------------------------------------


def test_cluster_page_shows_backend_masked_instances_and_the_last_hours_totals(
    celery_app: Celery, backend: Backend
) -> None:
    record_runs(backend, "every-minute", 4)
    from celery_anarchon.backends.base import InstanceInfo

    backend.register(
        InstanceInfo("host-a:1:abc", "host-a", 1, "9.9", backend.now_ms(), fingerprint="f00"),
        60_000,
    )
    page = text(create_app(celery_app).test_client(), "/")
    assert 'id="total-sent">3<' in page
    assert 'id="total-lost">1<' in page
    assert 'id="total-missed">0<' in page
    assert "host-a:1:abc" in page and "9.9" in page
    assert "other schedule" in page  # its fingerprint is not this app's
    assert 'id="backend-rtt"' in page


def test_jobs_page_lists_code_and_stored_jobs_with_timelines(
    celery_app: Celery, client: FlaskClient, backend: Backend
) -> None:
    record_runs(backend, "every-minute", 5)
    with Schedules(celery_app) as schedules:
        schedules.add("stored-one", "webtest.noop", 30.0)
    page = text(client, "/jobs")
    assert "3 of 3 job(s)" in page
    assert 'data-job="stored-one"' in page and 'data-job="every-minute"' in page
    row = page.split('data-job="every-minute"')[1].split("</tr>")[0]
    assert row.count('class="mark st-sent"') == 4 and row.count('class="mark st-lost"') == 1
    assert "cron &#39;* * * * *&#39;" in row
    stored = page.split('data-job="stored-one"')[1].split("</tr>")[0]
    assert "<td>stored</td>" in stored and "every 30s" in stored


def test_jobs_page_filters_sorts_and_paginates(
    celery_app: Celery, client: FlaskClient, backend: Backend
) -> None:
    record_runs(backend, "every-minute", 3)
    missed = text(client, "/jobs?state=missed-24h")
    assert "0 of 2 job(s)" in missed
    lost = text(client, "/jobs?state=lost-24h")
    assert "1 of 2 job(s)" in lost and 'data-job="every-minute"' in lost
    by_last = text(client, "/jobs?sort=last")
    assert by_last.index('data-job="every-minute"') < by_last.index('data-job="&lt;script')
    first = text(client, "/jobs?per_page=1")
    assert "page 1 of 2" in first and 'id="page-next"' in first
    second = text(client, "/jobs?per_page=1&page=2")
    assert "page 2 of 2" in second and 'data-job="every-minute"' in second
    assert 'data-job="every-minute"' not in first
    found = text(client, "/jobs?q=MINUTE")
    assert "1 of 2 job(s)" in found


def test_job_page_shows_history_charts_and_definition(
    client: FlaskClient, backend: Backend
) -> None:
    slots = record_runs(backend, "every-minute", 4, error="broker said no")
    page = text(client, "/jobs/every-minute")
    assert page.count('<tr class="run">') == 4
    assert 'id="lateness-chart"' in page and 'id="lateness-histogram"' in page
    assert "broker said no" in page
    assert "webtest.noop" in page and "max_late" in page
    assert utc(slots[0]) in page
    text(client, "/jobs/no-such-job", status=404)


def test_job_page_of_a_job_known_only_by_its_history(client: FlaskClient, backend: Backend) -> None:
    record_runs(backend, "gone-job", 2)
    page = text(client, "/jobs/gone-job")
    assert "its history is kept" in page and page.count('<tr class="run">') == 2


def test_delayed_page(celery_app: Celery, client: FlaskClient) -> None:
    from celery_anarchon import delayed

    try:
        delayed.store_for(celery_app)
    except ConfigurationError:
        page = text(client, "/delayed")
        assert 'id="no-delayed-store"' in page and "keeps no delayed tasks" in page
        return
    parked = delayed.park(celery_app, "webtest.later", countdown=1800, key="web-key-1")
    try:
        page = text(client, "/delayed")
        assert 'id="delayed-total">1<' in page and 'id="delayed-histogram"' in page
        assert "&lt; 10 min: 0" in page and "&lt; 1 h: 1" in page  # due in 1800 s
        found = text(client, "/delayed?q=web-key-1")
        assert parked in found and "webtest.later" in found
        missing = text(client, "/delayed?q=no-such-key")
        assert 'id="delayed-missing"' in missing
    finally:
        delayed.cancel(celery_app, parked)


def test_pages_and_actions_on_a_claim_only_backend(rabbit_vhost: str) -> None:
    """RabbitMQ: no stored jobs, no registry, no delayed store; the pages
    say so, run-now works, and pause is refused with the reason."""
    run = uuid.uuid4().hex[:8]
    url = f"amqp://guest:guest@127.0.0.1:5672/{rabbit_vhost}?prefix=web.{run}."
    app = make_app(url)
    client = create_app(app, allow_actions=True).test_client()
    cluster = text(client, "/")
    assert "claim-only backend" in cluster and 'id="total-sent">0<' in cluster
    assert 'data-job="every-minute"' in text(client, "/jobs")
    assert 'id="no-delayed-store"' in text(client, "/delayed")
    csrf = sign_in(client)
    sent = client.post("/jobs/every-minute/run-now", data={"csrf": csrf}, follow_redirects=True)
    assert "sent, task id" in sent.get_data(as_text=True)
    page = text(client, "/jobs/every-minute")
    assert page.count('<tr class="run">') == 1 and "run-now key=" in page
    assert 'id="total-sent">1<' in text(client, "/")
    refused = client.post("/jobs/every-minute/pause", data={"csrf": csrf}, follow_redirects=True)
    assert refused.status_code == 200 and "claim-only" in refused.get_data(as_text=True)


def test_pages_forbid_inline_scripts_and_frames(client: FlaskClient) -> None:
    response = client.get("/jobs")
    policy = response.headers["Content-Security-Policy"]
    assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy
    assert response.headers["X-Frame-Options"] == "DENY"
    assert response.headers["X-Content-Type-Options"] == "nosniff"
    assert "<script>" not in response.get_data(as_text=True)  # only <script src=...>


def test_a_fragment_is_the_live_part_alone(client: FlaskClient) -> None:
    fragment = text(client, "/jobs?fragment=1")
    assert 'id="jobs-table"' in fragment and "<html" not in fragment
    assert 'id="refresh-interval"' in text(client, "/jobs")


def test_mounted_under_a_path_its_links_follow_the_path(
    celery_app: Celery, backend: Backend
) -> None:
    from flask import Flask
    from werkzeug.middleware.dispatcher import DispatcherMiddleware

    site = Flask("site")
    site.wsgi_app = DispatcherMiddleware(  # type: ignore[method-assign]
        site.wsgi_app, {"/ops/anarchon": create_app(celery_app)}
    )
    client = site.test_client()
    page = text(client, "/ops/anarchon/jobs")
    assert 'href="/ops/anarchon/static/anarchon.css"' in page
    assert 'href="/ops/anarchon/jobs/every-minute"' in page
    assert b"fragment" in client.get("/ops/anarchon/static/anarchon.js").data
    assert client.get("/jobs").status_code == 404  # the site's own paths stay its own


# -- escaping -------------------------------------------------------------------------


def test_a_job_named_as_markup_is_shown_as_text(client: FlaskClient, backend: Backend) -> None:
    record_runs(backend, SCRIPT, 2, error="<img src=x onerror=alert(2)>")
    escaped = "&lt;script&gt;alert(1)&lt;/script&gt;"
    for url in ("/jobs", "/jobs/%3Cscript%3Ealert(1)%3C/script%3E", "/jobs?fragment=1"):
        page = text(client, url)
        assert SCRIPT not in page and "<img src=x" not in page
        assert escaped in page
    assert "&lt;img src=x onerror=alert(2)&gt;" in text(
        client, "/jobs/%3Cscript%3Ealert(1)%3C/script%3E"
    )


# -- actions ----------------------------------------------------------------------------


def test_run_now_sends_once_and_logs_the_operator(
    client: FlaskClient, backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    csrf = sign_in(client)
    with caplog.at_level(logging.INFO, logger="celery_anarchon.web.app"):
        response = client.post("/jobs/every-minute/run-now", data={"csrf": csrf, "key": "k1"})
        again = client.post("/jobs/every-minute/run-now", data={"csrf": csrf, "key": "k1"})
    assert response.status_code == 303 and again.status_code == 303
    runs = manual_runs(backend, "every-minute")
    assert [r.manual_key for r in runs] == ["k1"] and runs[0].state is State.SENT
    logged = [r.getMessage() for r in caplog.records if "run-now" in r.getMessage()]
    assert any("127.0.0.1" in line and "sent" in line for line in logged)
    assert any("was used before" in line for line in logged)


def test_pause_and_resume(celery_app: Celery, client: FlaskClient) -> None:
    csrf = sign_in(client)
    response = client.post("/jobs/every-minute/pause", data={"csrf": csrf, "note": "freeze"})
    assert response.status_code == 303 and pause_of(celery_app, "every-minute")
    page = text(client, "/jobs/every-minute")
    assert 'id="action-resume"' in page and "yes: freeze" in page
    response = client.post("/jobs/every-minute/resume", data={"csrf": csrf})
    assert response.status_code == 303 and not pause_of(celery_app, "every-minute")


def test_add_edit_remove_a_stored_job(celery_app: Celery, client: FlaskClient) -> None:
    csrf = sign_in(client)
    form = {"csrf": csrf, "name": "web-added", "task": "webtest.noop", "every": "5m"}
    form["kwargs"] = '{"a": 1}'
    assert client.post("/add", data=form).status_code == 303
    with Schedules(celery_app) as schedules:
        view = schedules.get("web-added")
        assert view.source == "stored" and view.definition is not None
        assert view.definition.kwargs == {"a": 1}
        first = view.version
    page = text(client, "/jobs/web-added")
    assert 'id="action-edit"' in page and 'id="action-remove"' in page
    form_page = text(client, "/jobs/web-added/edit")
    assert 'id="form-current"' in form_page and "every 300s" in form_page
    assert "{&#34;a&#34;: 1}" in form_page  # the current kwargs, escaped
    assert (
        client.post("/jobs/web-added/edit", data={"csrf": csrf, "every": "1h"}).status_code == 303
    )
    with Schedules(celery_app) as schedules:
        assert schedules.get("web-added").version > first
    assert "every 1h" in text(client, "/jobs/web-added")
    assert client.post("/jobs/web-added/remove", data={"csrf": csrf}).status_code == 303
    with Schedules(celery_app) as schedules:
        assert "web-added" not in {v.name for v in schedules.list() if v.source == "stored"}


def test_a_refused_definition_changes_nothing_and_says_why(
    celery_app: Celery, client: FlaskClient
) -> None:
    csrf = sign_in(client)
    form = {"csrf": csrf, "name": "bad", "task": "webtest.noop", "cron": "every day"}
    response = client.post("/add", data=form)
    page = response.get_data(as_text=True)
    # The form again, with why and with what was typed: nothing to type twice.
    assert response.status_code == 400
    assert re.search(r'id="form-error"[^>]*>add bad: [^<]*cannot read cron', page), page[:3000]
    assert 'id="form-name" value="bad"' in page and 'id="form-cron" value="every day"' in page
    assert 'id="form-task" value="webtest.noop"' in page
    with Schedules(celery_app) as schedules:
        assert "bad" not in {v.name for v in schedules.list()}


def test_a_refused_edit_shows_the_form_again_and_keeps_the_job(
    celery_app: Celery, client: FlaskClient
) -> None:
    csrf = sign_in(client)
    added = {"csrf": csrf, "name": "kept", "task": "webtest.noop", "every": "5m"}
    assert client.post("/add", data=added).status_code == 303
    response = client.post("/jobs/kept/edit", data={"csrf": csrf, "args": "[1,"})
    page = response.get_data(as_text=True)
    assert response.status_code == 400
    assert 'id="form-error"' in page and "edit kept:" in page
    assert 'id="form-args" value="[1,"' in page and 'id="form-current"' in page
    with Schedules(celery_app) as schedules:
        assert schedules.get("kept").definition.args == []
        schedules.remove("kept")
    for form in ({"every": "1h"}, {"every": "bad"}):  # refused by the store, or before it
        gone = client.post("/jobs/kept/edit", data={"csrf": csrf, **form})
        assert gone.status_code == 303 and gone.headers["Location"].endswith("/jobs"), form
    code = client.post("/jobs/every-minute/edit", data={"csrf": csrf, "every": "1h"})
    assert code.status_code == 303 and code.headers["Location"].endswith("/jobs/every-minute")


def test_a_form_page_says_actions_are_off_before_asking_for_a_sign_in(
    celery_app: Celery,
) -> None:
    client = create_app(celery_app).test_client()
    for path in ("/add", "/jobs/every-minute/edit", "/login"):
        response = client.get(path)
        assert response.status_code == 403
        assert "actions are off" in response.get_data(as_text=True), path


# -- refusals: 403, nothing changed -------------------------------------------------------

ACTIONS = [
    ("/jobs/every-minute/run-now", {}),
    ("/jobs/every-minute/pause", {}),
    ("/jobs/every-minute/resume", {}),
    ("/jobs/every-minute/remove", {}),
    ("/jobs/every-minute/edit", {"every": "5m"}),
    ("/add", {"name": "sneaky", "task": "webtest.noop", "every": "5m"}),
]


def _unchanged(celery_app: Celery, backend: Backend) -> None:
    assert manual_runs(backend, "every-minute") == []
    assert not pause_of(celery_app, "every-minute")
    with Schedules(celery_app) as schedules:
        assert [v.name for v in schedules.list() if v.source == "stored"] == []


@pytest.mark.parametrize(("path", "form"), ACTIONS)
def test_actions_are_refused_when_off(
    celery_app: Celery, backend: Backend, path: str, form: dict[str, str]
) -> None:
    client = create_app(celery_app).test_client()
    response = client.post(path, data={**form, "csrf": "x"})
    assert response.status_code == 403
    assert 'id="action-run-now"' not in text(client, "/jobs/every-minute")
    _unchanged(celery_app, backend)


@pytest.mark.parametrize(("path", "form"), ACTIONS)
def test_actions_are_refused_without_signing_in(
    celery_app: Celery, backend: Backend, client: FlaskClient, path: str, form: dict[str, str]
) -> None:
    csrf = csrf_of(text(client, "/login"))
    response = client.post(path, data={**form, "csrf": csrf, "token": TOKEN})
    assert response.status_code == 403
    _unchanged(celery_app, backend)


@pytest.mark.parametrize(("path", "form"), ACTIONS)
def test_actions_are_refused_with_a_bad_csrf_token(
    celery_app: Celery, backend: Backend, client: FlaskClient, path: str, form: dict[str, str]
) -> None:
    sign_in(client)
    for csrf in ("", "forged"):
        response = client.post(path, data={**form, "csrf": csrf})
        assert response.status_code == 403
    _unchanged(celery_app, backend)


def test_a_wrong_token_does_not_sign_in(
    celery_app: Celery, backend: Backend, client: FlaskClient
) -> None:
    csrf = csrf_of(text(client, "/login"))
    response = client.post("/login", data={"csrf": csrf, "token": TOKEN + "x"})
    assert response.status_code == 403
    assert client.post("/jobs/every-minute/pause", data={"csrf": csrf}).status_code == 403
    _unchanged(celery_app, backend)


def test_actions_need_a_token(celery_app: Celery) -> None:
    celery_app.conf.anarchon_web_token = None
    with pytest.raises(ConfigurationError, match="ANARCHON_WEB_TOKEN"):
        create_app(celery_app, allow_actions=True)


# -- the backend down ---------------------------------------------------------------------


def _free_port() -> int:
    """A port nothing listens on (bound and released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def test_an_unreachable_backend_shows_a_banner_and_keeps_serving() -> None:
    url = f"redis://user:hunter2@127.0.0.1:{_free_port()}/0?socket_timeout=1"
    client = create_app(make_app(url)).test_client()
    for path in ("/", "/jobs", "/jobs/every-minute", "/delayed", "/jobs?fragment=1"):
        page = text(client, path)
        assert 'id="banner"' in page and "does not answer" in page
        assert "Traceback" not in page and "hunter2" not in page
        assert "user:**@" in page
    jobs = text(client, "/jobs")
    assert 'data-job="every-minute"' in jobs  # the code entries, without states


def test_an_add_while_the_backend_does_not_answer_keeps_the_form_and_answers_503() -> None:
    url = f"redis://127.0.0.1:{_free_port()}/0?socket_timeout=1"
    client = create_app(make_app(url), allow_actions=True).test_client()
    page = text(client, "/login")
    assert client.post("/login", data={"csrf": csrf_of(page), "token": TOKEN}).status_code == 303
    csrf = csrf_of(text(client, "/add"))
    form = {"csrf": csrf, "name": "later", "task": "webtest.noop", "every": "5m"}
    response = client.post("/add", data=form)
    answer = response.get_data(as_text=True)
    assert response.status_code == 503, answer[:2000]
    assert 'id="form-error"' in answer and 'id="form-every" value="5m"' in answer
    edited = client.post("/jobs/later/edit", data={"csrf": csrf, "every": "10m"})
    answer = edited.get_data(as_text=True)
    assert edited.status_code == 503, answer[:2000]
    assert 'id="form-error"' in answer and 'id="form-every" value="10m"' in answer


# -- the cost of a render ------------------------------------------------------------------


def _count_calls(backend: Backend, names: list[str]) -> dict[str, int]:
    counts = dict.fromkeys(names, 0)
    for name in names:
        method = getattr(backend, name)

        def counted(
            *args: Any, _name: str = name, _method: Callable[..., Any] = method, **kw: Any
        ) -> Any:
            counts[_name] += 1
            return _method(*args, **kw)

        setattr(backend, name, counted)
    return counts


def _round_trips(kind: str, backend: Backend, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A one-element list counting the backend's real round trips: SQL
    statements (SQLAlchemy's cursor events) or Redis pipelines and
    commands."""
    count = [0]
    if kind == "redis":
        import redis

        for cls, attr in ((redis.Redis, "execute_command"), (redis.client.Pipeline, "execute")):
            original = getattr(cls, attr)

            def wrapped(self: Any, *args: Any, _original: Any = original, **kw: Any) -> Any:
                count[0] += 1
                return _original(self, *args, **kw)

            monkeypatch.setattr(cls, attr, wrapped)
    else:
        engine = backend._engine  # type: ignore[attr-defined]

        @sa.event.listens_for(engine, "before_cursor_execute")
        def _counted(*args: Any) -> None:
            count[0] += 1

    return count


@pytest.mark.parametrize("kind", WEB_BACKENDS, indirect=True)
@pytest.mark.parametrize("query", ["", "?state=missed-24h", "?sort=last"])
def test_a_jobs_render_costs_the_same_backend_calls_for_200_and_2000_jobs(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, query: str
) -> None:
    trips = []
    for count in (200, 2000):
        run = uuid.uuid4().hex[:8]
        schedule = {
            f"job-{i:05d}": {"task": "webtest.noop", "schedule": 60.0} for i in range(count)
        }
        folder = tmp_path / str(count)
        folder.mkdir()
        app = make_app(_url(kind, folder, run), beat_schedule=schedule)
        writer = backend_from_url(app.conf.anarchon_backend, instance="test-writer")
        writer.open()  # the SQLite file exists, as after beat's first start
        writer.close()
        try:
            web = create_app(app)
            backend = web.extensions["anarchon"].control.backend
            client = web.test_client()
            text(client, "/jobs" + query)  # opens the backend
            calls = _count_calls(
                backend, ["history", "history_many", "last_run", "jobs_with_state"]
            )
            round_trips = _round_trips(kind, backend, monkeypatch)
            page = text(client, "/jobs" + query)
            monkeypatch.undo()
            assert calls["history"] == 0 and calls["last_run"] == 0
            filtered = query == "?state=missed-24h"
            assert calls["jobs_with_state"] == (1 if filtered else 0)
            # the page's jobs; with the sort, every job first; a state filter asks
            # jobs_with_state, which reads every job's history on Redis and is one
            # statement on SQL (no job has a miss, so the filtered page is empty
            # and needs no read of its jobs)
            if filtered:
                assert calls["history_many"] == (1 if kind == "redis" else 0)
            else:
                assert calls["history_many"] == {"": 1}.get(query, 2)
            if not query:
                assert page.count('<tr class="job') == 50
            trips.append(round_trips[0])
        finally:
            _drop(kind, run)
    small, large = trips
    assert small > 0, trips  # the counting saw the render's reads
    if query == "?state=missed-24h" and kind != "redis":
        assert large == small, trips  # one statement whatever the number of jobs
    elif query:
        # One history read over every job, chunked (500 jobs a query, 1000 a
        # pipeline): a few more round trips for ten times the jobs.
        assert large <= small + 4, trips
    else:
        assert large == small, trips


# -- the command ----------------------------------------------------------------------------


def _invoke(app: Celery, *args: str) -> Any:
    return CliRunner().invoke(
        anarchon, list(args), obj=CLIContext(app=app, no_color=True, workdir=None)
    )


def test_the_command_warns_when_bound_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import waitress

    served: list[dict[str, Any]] = []
    monkeypatch.setattr(waitress, "serve", lambda app, **kw: served.append(kw))
    monkeypatch.delenv("ANARCHON_WEB_TOKEN", raising=False)
    app = make_app(f"sqlite:///{tmp_path / 'c.db'}", anarchon_web_token=None)
    result = _invoke(app, "web", "--bind", "0.0.0.0", "--port", "5599")
    assert result.exit_code == 0, result.output
    assert "WARNING" in result.stderr and "open to anyone who reaches the port" in result.stderr
    assert served == [{"host": "0.0.0.0", "port": 5599, "threads": 8, "ident": "celery-anarchon"}]
    quiet = _invoke(app, "web")
    assert quiet.exit_code == 0 and "WARNING" not in quiet.stderr
    assert served[-1]["host"] == "127.0.0.1" and served[-1]["port"] == 5580
    refused = _invoke(app, "web", "--allow-actions")
    assert refused.exit_code == 4 and "ANARCHON_WEB_TOKEN" in refused.stderr


def test_the_command_serves_over_real_http(
    celery_app: Celery, backend: Backend, tmp_path: Path
) -> None:
    """``celery -A proj anarchon web`` in a process of its own, read and
    refused over HTTP."""
    import os
    import subprocess
    import sys
    import time
    import urllib.error
    import urllib.request

    module = tmp_path / "webproj.py"
    module.write_text(
        "from celery import Celery\n"
        "app = Celery('webproj', broker='memory://')\n"
        f"app.conf.update(anarchon_backend={celery_app.conf.anarchon_backend!r}, "
        f"beat_schedule={{'every-minute': {{'task': 'webtest.noop', 'schedule': 60.0}}}})\n"
    )
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "ANARCHON_WEB_TOKEN": TOKEN}
    command = [sys.executable, "-m", "celery", "-A", "webproj", "anarchon", "web"]
    process = subprocess.Popen(
        [*command, "--port", str(port), "--allow-actions"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{base}/jobs", timeout=5) as response:
                    body = response.read().decode()
                break
            except OSError:
                assert process.poll() is None, process.stdout and process.stdout.read()
                assert time.monotonic() < deadline, "the page did not come up in 30 s"
                time.sleep(0.2)
        assert response.status == 200 and 'data-job="every-minute"' in body
        assert 'id="sign-in"' in body  # actions on: the sign-in link
        with urllib.request.urlopen(f"{base}/static/anarchon.js", timeout=5) as response:
            assert b"fragment" in response.read()
        refused = urllib.request.Request(f"{base}/jobs/every-minute/pause", data=b"", method="POST")
        with pytest.raises(urllib.error.HTTPError) as answer:
            urllib.request.urlopen(refused, timeout=5)
        assert answer.value.code == 403
        answer.value.close()
        assert not pause_of(celery_app, "every-minute")
        # Signed in (a cookie jar keeps the session), the pause is made and
        # logged at INFO, which the command shows by default.
        import http.cookiejar
        import urllib.parse

        opener = urllib.request.build_opener(
            urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar())
        )

        def post(path: str, page: str, **fields: str) -> None:
            form = urllib.parse.urlencode({"csrf": csrf_of(page), **fields}).encode()
            opener.open(urllib.request.Request(f"{base}{path}", data=form), timeout=5).close()

        def read(path: str) -> str:
            with opener.open(f"{base}{path}", timeout=5) as answer_page:
                return str(answer_page.read().decode())

        post("/login", read("/login"), token=TOKEN)
        post("/jobs/every-minute/pause", read("/jobs/every-minute"), note="from the test")
        assert pause_of(celery_app, "every-minute")
    finally:
        process.terminate()
        output = process.communicate(timeout=10)[0].decode()
    assert f"http://127.0.0.1:{port}/" in output
    assert "refused POST /jobs/every-minute/pause from 127.0.0.1" in output
    assert "INFO] celery_anarchon.web.app: anarchon web: pause 'every-minute' by 127.0.0.1" in (
        output
    ), output


# -- the review's findings ---------------------------------------------------------------


@pytest.fixture
def sqlite_app(tmp_path: Path) -> Celery:
    """An app on a SQLite file that exists (as after beat's first start)."""
    app = make_app(f"sqlite:///{tmp_path / 'claims.db'}")
    made = backend_from_url(app.conf.anarchon_backend, instance="test-writer")
    made.open()
    made.close()
    return app


@pytest.fixture
def sqlite_client(sqlite_app: Celery) -> FlaskClient:
    return create_app(sqlite_app, allow_actions=True).test_client()


FOREIGN_HOSTS = ("evil.example", "evil.example:5580", "localhost.evil.example", "[::2]:5580")


def test_with_allowed_hosts_another_host_name_gets_400(sqlite_app: Celery) -> None:
    """DNS rebinding: a page of evil.example whose name resolves to
    127.0.0.1 reaches the page with ``Host: evil.example``; it gets 400 on
    every path, the loopback names on any port get the page."""
    client = create_app(sqlite_app, allow_actions=True, allowed_hosts=LOOPBACK_HOSTS).test_client()
    for host in FOREIGN_HOSTS:
        for path in (
            "/",
            "/jobs",
            "/jobs/every-minute",
            "/delayed",
            "/login",
            "/static/anarchon.js",
        ):
            response = client.get(path, headers={"Host": host})
            assert response.status_code == 400, (host, path)
            assert "every-minute" not in response.get_data(as_text=True)
        refused = client.post("/jobs/every-minute/pause", headers={"Host": host}, data={})
        assert refused.status_code == 400
    for host in ("localhost", "localhost:5580", "127.0.0.1:80", "[::1]:5580", "[::1]", "LOCALHOST"):
        assert client.get("/jobs", headers={"Host": host}).status_code == 200, host
    named = create_app(sqlite_app, allowed_hosts=["anarchon.example.com", ".ops.example"])
    named_client = named.test_client()
    for host in ("anarchon.example.com:443", "ops.example", "web.ops.example"):
        assert named_client.get("/jobs", headers={"Host": host}).status_code == 200, host
    for host in ("localhost", "evil.example", "ops.example.evil"):
        assert named_client.get("/jobs", headers={"Host": host}).status_code == 400, host
    # Mounted into a site (no allowed_hosts): the site checks the host itself.
    mounted = create_app(sqlite_app).test_client()
    assert mounted.get("/jobs", headers={"Host": "evil.example"}).status_code == 200
    with pytest.raises(ConfigurationError, match="no host name"):
        create_app(sqlite_app, allowed_hosts=["not a host"])


def _served_app(monkeypatch: pytest.MonkeyPatch, app: Celery, *args: str) -> tuple[Any, Any]:
    """The command's result and the WSGI app it would serve."""
    import waitress

    served: list[Any] = []
    monkeypatch.setattr(waitress, "serve", lambda wsgi, **kw: served.append(wsgi))
    result = _invoke(app, "web", *args)
    return result, served[-1] if served else None


def test_the_command_answers_only_its_host_names(
    sqlite_app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    def status(wsgi: Any, host: str) -> int:
        code: int = wsgi.test_client().get("/jobs", headers={"Host": host}).status_code
        return code

    result, wsgi = _served_app(monkeypatch, sqlite_app)
    assert result.exit_code == 0, result.output
    assert status(wsgi, "evil.example") == 400 and status(wsgi, "localhost:5580") == 200
    assert status(wsgi, "127.0.0.1:5580") == 200 and status(wsgi, "[::1]:5580") == 200
    result, wsgi = _served_app(
        monkeypatch, sqlite_app, "--allowed-host", "anarchon.example.com", "--allowed-host", "ops"
    )
    assert result.exit_code == 0, result.output
    assert status(wsgi, "anarchon.example.com") == 200 and status(wsgi, "ops:8080") == 200
    assert status(wsgi, "localhost") == 200 and status(wsgi, "evil.example") == 400
    result, wsgi = _served_app(
        monkeypatch, sqlite_app, "--bind", "0.0.0.0", "--allowed-host", "anarchon.example.com"
    )
    assert status(wsgi, "anarchon.example.com") == 200 and status(wsgi, "localhost") == 400
    result, wsgi = _served_app(monkeypatch, sqlite_app, "--bind", "0.0.0.0")
    assert status(wsgi, "evil.example") == 200  # no names given: it cannot know them
    assert "Without --allowed-host it answers to any Host header" in result.stderr
    # Another loopback address: the URL the command prints works.
    result, wsgi = _served_app(monkeypatch, sqlite_app, "--bind", "127.0.0.2")
    assert "http://127.0.0.2:5580/" in result.stderr
    assert status(wsgi, "127.0.0.2:5580") == 200 and status(wsgi, "evil.example") == 400
    refused, _ = _served_app(monkeypatch, sqlite_app, "--allowed-host", "not a host")
    assert refused.exit_code != 0 and "no host name" in refused.stderr


def test_bound_elsewhere_the_command_warns_though_a_token_is_set(
    sqlite_app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The token guards the actions only: the reads stay open, so the
    warning does not depend on it."""
    assert sqlite_app.conf.anarchon_web_token == TOKEN
    result, _ = _served_app(monkeypatch, sqlite_app, "--bind", "0.0.0.0", "--allow-actions")
    assert result.exit_code == 0, result.output
    warning = result.stderr
    assert "WARNING: serving on 0.0.0.0, reachable from other hosts" in warning
    assert "open to anyone who reaches the port" in warning
    assert "the token guards only the actions" in warning and "authenticating proxy" in warning
    quiet, _ = _served_app(monkeypatch, sqlite_app, "--bind", "::1", "--allow-actions")
    assert quiet.exit_code == 0 and "WARNING" not in quiet.stderr


def _cookie(client: FlaskClient) -> str:
    cookie = client.get_cookie("anarchon_session")
    assert cookie is not None
    return cookie.value


def test_signing_out_ends_the_session_for_a_copied_cookie_too(
    sqlite_app: Celery, sqlite_client: FlaskClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="celery_anarchon.web.app"):
        csrf = sign_in(sqlite_client)
        copy = sqlite_client.application.test_client()
        copy.set_cookie("anarchon_session", _cookie(sqlite_client))
        assert 'id="action-pause"' in text(copy, "/jobs/every-minute")  # the copy is signed in
        assert sqlite_client.post("/logout", data={"csrf": csrf}).status_code == 303
    logged = [r.getMessage() for r in caplog.records]
    assert "anarchon web: operator signed in from 127.0.0.1" in logged
    assert "anarchon web: operator signed out from 127.0.0.1" in logged
    assert 'id="sign-in"' in text(sqlite_client, "/jobs")
    assert 'id="action-pause"' not in text(copy, "/jobs/every-minute")
    response = copy.post("/jobs/every-minute/pause", data={"csrf": csrf})
    assert response.status_code == 403 and "not signed in" in response.get_data(as_text=True)
    assert not pause_of(sqlite_app, "every-minute")


def test_the_session_cookie_keeps_nothing_derived_from_the_token(
    sqlite_client: FlaskClient,
) -> None:
    """The cookie is readable by whoever holds it (signed, not encrypted):
    it must hold only random ids, nothing to test token guesses against."""
    web = sqlite_client.application
    serializer = web.session_interface.get_signing_serializer(web)  # type: ignore[attr-defined]
    sign_in(sqlite_client)
    other = web.test_client()
    sign_in(other)
    first = serializer.loads(_cookie(sqlite_client))
    second = serializer.loads(_cookie(other))
    assert set(first) == set(second) == {"csrf", "sid"}
    assert first["sid"] != second["sid"] and first["csrf"] != second["csrf"]
    kept = json.dumps([first, second])
    assert TOKEN not in kept
    # what the cookie held before: HMAC(a fixed, public key, token)
    assert hmac.new(b"anarchon-web-session", TOKEN.encode(), "sha256").hexdigest() not in kept


def test_sign_out_needs_the_forms_csrf_token(
    sqlite_app: Celery, sqlite_client: FlaskClient
) -> None:
    csrf = sign_in(sqlite_client)
    for form in ({}, {"csrf": ""}, {"csrf": "forged"}):
        assert sqlite_client.post("/logout", data=form).status_code == 403
    assert 'id="sign-out"' in text(sqlite_client, "/jobs")  # still signed in
    assert sqlite_client.post("/jobs/every-minute/pause", data={"csrf": csrf}).status_code == 303
    page = text(sqlite_client, "/jobs")  # its only post form is the sign-out's
    assert sqlite_client.post("/logout", data={"csrf": csrf_of(page)}).status_code == 303
    assert 'id="sign-in"' in text(sqlite_client, "/jobs")


def test_the_delayed_page_names_the_delayed_store_when_it_is_down(tmp_path: Path) -> None:
    down = f"redis://user:hunter2@127.0.0.1:{_free_port()}/0?socket_timeout=1"
    app = make_app(f"sqlite:///{tmp_path / 'claims.db'}", anarchon_delayed_backend=down)
    made = backend_from_url(app.conf.anarchon_backend, instance="test-writer")
    made.open()
    made.close()
    client = create_app(app).test_client()
    page = text(client, "/delayed")
    banner = page.split('id="banner"')[1].split("</div>")[0]
    assert "The delayed store (anarchon_delayed_backend) does not answer" in banner
    assert "claim backend" not in banner and "hunter2" not in page
    assert 'id="banner"' not in text(client, "/")  # the claim backend answers


def test_the_cluster_page_shows_the_backend_clock_as_status_does(
    kind: str, celery_app: Celery, backend: Backend
) -> None:
    page = text(create_app(celery_app).test_client(), "/")
    clock = page.split('id="backend-clock"')[1].split("</td>")[0]
    status = _invoke(celery_app, "status").stdout
    if kind == "sqlite":
        assert "none (each host's own clock is used)" in clock
        assert "backend clock: none (each host's own clock is used)" in status
        assert 'id="backend-rtt">-<' in page and "no backend clock" not in page
    else:
        assert re.search(r">\d{4}-\d\d-\d\dT", clock), clock
        assert re.search(r"backend clock: \d{4}-", status), status


def test_an_actions_message_is_the_commands_with_the_jobs_own_version(
    celery_app: Celery, client: FlaskClient
) -> None:
    """A stored job's version is what ``jobs`` shows; a pause writes no
    version of the job, and a code entry has none: neither shows the
    store's change counter as one."""
    csrf = sign_in(client)

    def flash(path: str, **form: str) -> str:
        answer = client.post(path, data={"csrf": csrf, **form}, follow_redirects=True)
        match = re.search(r'id="flash">([^<]*)<', answer.get_data(as_text=True))
        assert match, answer.get_data(as_text=True)[:2000]
        return match.group(1).replace("&#39;", "'")

    def cli(*args: str) -> str:
        result = _invoke(celery_app, *args)
        assert result.exit_code == 0, result.output
        return str(result.stdout.strip())

    def version(name: str) -> int:
        with Schedules(celery_app) as schedules:
            return schedules.get(name).version

    added = flash("/add", name="web-v", task="webtest.noop", every="5m")
    first = version("web-v")
    assert added == f"web-v: added (version {first})"
    assert flash("/jobs/web-v/edit", every="10m") == f"web-v: updated (version {version('web-v')})"
    own = version("web-v")
    assert own > first
    assert flash("/jobs/web-v/pause", note="freeze") == f"web-v: paused (freeze), version {own}"
    assert cli("resume", "web-v") == f"web-v: resumed, version {own}"  # the command's line
    assert flash("/jobs/web-v/pause") == f"web-v: paused, version {own}"
    assert flash("/jobs/web-v/resume") == f"web-v: resumed, version {own}"
    assert version("web-v") == own  # a pause and a resume write no version of the job
    # A code entry has no version: none is shown, by the page nor by the command.
    assert flash("/jobs/every-minute/pause", note="freeze") == "every-minute: paused (freeze)"
    assert cli("resume", "every-minute") == "every-minute: resumed"
    assert cli("pause", "every-minute") == "every-minute: paused"
    assert flash("/jobs/every-minute/resume") == "every-minute: resumed"
    removed = flash("/jobs/web-v/remove")
    assert re.fullmatch(
        rf"web-v: removed \(store version (\d+)\); {re.escape(REMOVED_TAIL)}", removed
    )
    cli("add", "cli-v", "--task", "webtest.noop", "--every", "5m")
    tail = re.escape(REMOVED_TAIL)
    assert re.fullmatch(rf"cli-v: removed \(store version \d+\); {tail}", cli("remove", "cli-v"))


def test_add_and_edit_take_the_queue(sqlite_app: Celery, sqlite_client: FlaskClient) -> None:
    csrf = sign_in(sqlite_client)
    form = {"csrf": csrf, "name": "queued", "task": "webtest.noop", "every": "5m", "queue": "low"}
    assert sqlite_client.post("/add", data=form).status_code == 303
    with Schedules(sqlite_app) as schedules:
        definition = schedules.get("queued").definition
        assert definition is not None and definition.options == {"queue": "low"}
    form_page = text(sqlite_client, "/jobs/queued/edit")
    assert 'id="form-queue"' in form_page and "queue <code>low</code>" in form_page
    edited = sqlite_client.post("/jobs/queued/edit", data={"csrf": csrf, "queue": "high"})
    assert edited.status_code == 303
    kept = sqlite_client.post("/jobs/queued/edit", data={"csrf": csrf, "every": "1h"})
    assert kept.status_code == 303
    with Schedules(sqlite_app) as schedules:
        definition = schedules.get("queued").definition
        assert definition is not None and definition.options == {"queue": "high"}


def test_the_refresh_interval_reads_once_in_the_header(sqlite_client: FlaskClient) -> None:
    """The select shows the interval; the status line beside it says only
    when the page was rendered or refreshed (the script writes no interval
    into it)."""
    page = text(sqlite_client, "/jobs")
    header = page.split('id="refresh"')[1].split("</div>")[0]
    assert header.count("every") == 1 and 'id="refresh-status">rendered ' in header
    script = sqlite_client.get("/static/anarchon.js").get_data(as_text=True)
    writes = re.findall(r"status\.textContent = ([^;]+);", script)
    assert writes and all("every" not in w and "seconds" not in w for w in writes), writes


def test_times_stay_on_one_line(sqlite_client: FlaskClient) -> None:
    page = text(sqlite_client, "/jobs")
    row = page.split('data-job="every-minute"')[1].split("</tr>")[0]
    assert re.search(r'<td class="time" title="[^"]*">\d{4}-\d\d-\d\dT[^<]*Z</td>', row), row
    css = sqlite_client.get("/static/anarchon.css").get_data(as_text=True)
    assert re.search(r"td\.time \{ white-space: nowrap; \}", css)
