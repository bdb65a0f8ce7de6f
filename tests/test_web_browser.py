"""The operator web page in a real browser: headless Chromium (Debian's
``chromium`` and ``chromium-driver``) driven by Selenium, against a served
``celery anarchon web --allow-actions`` (its own process, the token from
the environment) and 2 real ``celery beat`` processes on Redis.

The operator signs in, pauses one job and runs another now; the test checks
the effect in the backend (the pause stored, the run-now slot claimed and
recorded as sent, its message on the queue) and that both beats honour the
pause (no slot of the paused job sent from the pause's first paused slot
on, while the other jobs keep being sent). It also checks that the
auto-refresh replaces the live part without reloading the page, and that a
job named ``<script>alert(1)</script>`` shows as text and raises no alert.

On the way it saves screenshots of the Cluster, Jobs, Job and Delayed pages
at a fixed window size: into the test's temporary folder, or into
``$ANARCHON_WEB_SCREENSHOTS`` when set (the docs' images are made with
``ANARCHON_WEB_SCREENSHOTS=docs/images pytest tests/test_web_browser.py``).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_anarchon.backends import backend_from_url
from celery_anarchon.backends.base import (
    SENT_STATES,
    AbsentRecord,
    Backend,
    ClaimRequest,
    State,
)
from celery_anarchon.schedules import Schedules

from .beats import REPO, BeatCluster
from .conftest import IN_CI, REDIS_URL, require_service

pytestmark = [pytest.mark.services, pytest.mark.integration]

TOKEN = "browser-token-" + uuid.uuid4().hex[:8]
SCRIPT = "<script>alert(1)</script>"

#: Window size of every page, and so of every screenshot, CSS pixels.
WINDOW = (1280, 900)

#: The jobs the beats run (``beat_schedule``), named as an operator's would be.
PAUSED = "cache.warm"  # every second: paused by the operator
RUN_NOW = "reports.nightly"  # 02:00 every day: run now by the operator
TICKING = "heartbeat.ping"  # every second: the refresh moves its next slot
LATE = "sync.inventory"  # every 5 s, with a late run and a lost one written
MISSED = "billing.sweep"  # every 5 min, with misses written
JOBS: dict[str, Any] = {
    TICKING: 1.0,
    PAUSED: 1.0,
    LATE: 5.0,
    MISSED: "*/5 * * * *",
    RUN_NOW: "0 2 * * *",
    "emails.digest": "0 8 * * 1-5",
    SCRIPT: 60.0,
}


def _need(found: object, what: str) -> None:
    """Skip by hand, fail under CI, when ``what`` is missing."""
    if found:
        return
    if IN_CI:
        pytest.fail(f"{what} is missing (.ci/run installs it)")
    pytest.skip(f"{what} is missing")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def _wait_for(check: Callable[[], Any], what: str, timeout: float = 20.0) -> Any:
    """Poll ``check`` until it answers something true; that answer."""
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.1)


def _drop_keys(prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    for key in client.scan_iter(match=f"*{prefix}*", count=1000):
        client.delete(key)
    client.close()


def _seed_history(backend: Backend) -> None:
    """What a cluster that ran a while has: a late run and a lost one of
    :data:`LATE`, and misses of :data:`MISSED` (written before the beats
    start, on slots in the past)."""
    now = backend.now_ms()
    hour = 3600_000
    five_min = 300_000
    misses = [now - now % five_min - i * five_min for i in (1, 2, 5)]
    backend.record_many_if_absent(
        [
            AbsentRecord(MISSED, slot, State.MISSED, "no instance was running (max_late=60s)")
            for slot in misses
        ]
    )
    # sent when claimed: its lateness is the time since its slot (0 to 5 s)
    late_slot = now - now % 5000
    lost_slot = late_slot - 5000
    claims = backend.claim(
        [
            ClaimRequest(
                LATE, slot, window_before_ms=hour, window_after_ms=10_000, keep_until_ms=slot + hour
            )
            for slot in (lost_slot, late_slot)
        ]
    )
    assert all(c.won for c in claims)
    backend.mark(claims[0], State.LOST, error="send failed: ConnectionResetError(104)")
    backend.mark(claims[1], State.SENT, task_id=str(uuid.uuid4()))


@pytest.fixture
def browser() -> Iterator[Any]:
    """A headless Chromium driven by Selenium, at :data:`WINDOW`."""
    chromium = shutil.which("chromium")
    chromedriver = shutil.which("chromedriver")
    _need(chromium, "Debian's chromium")
    _need(chromedriver, "Debian's chromium-driver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.options import Options
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _need(False, "selenium (the test extra)")
        raise
    options = Options()
    options.binary_location = str(chromium)
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--hide-scrollbars",
        f"--window-size={WINDOW[0]},{WINDOW[1]}",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(str(chromedriver)), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[BeatCluster, str, Celery]]:
    """2 real beats on a Redis backend of the test's own, with some
    history, 2 stored jobs and parked tasks written first; the backend URL
    and a Celery app on it (to check the backend and to park)."""
    require_service("redis")
    run = uuid.uuid4().hex[:8]
    prefix = f"anarchon-browser:{run}:"
    url = f"{REDIS_URL}?prefix={prefix}"
    schedule = {name: {"task": "itest.noop", "schedule": s} for name, s in JOBS.items()}
    beats = BeatCluster(backend=url, folder=tmp_path, conf={"beat_schedule": schedule})
    app = Celery("browser", broker=beats.broker)
    app.conf.update(
        anarchon_backend=url,
        beat_schedule=schedule,
        timezone="UTC",
        task_default_queue=beats.queue,
        task_ignore_result=True,
    )
    writer = backend_from_url(url, instance="browser-test-writer")
    writer.open()
    try:
        _seed_history(writer)
        with Schedules(app) as schedules:
            schedules.add("tenant-42.export", "itest.noop", 30.0)
            schedules.add("cleanup.tmp", "itest.noop", 10.0)
        from celery_anarchon import delayed

        for i in range(24):
            delayed.park(app, "itest.noop", countdown=90 + i * i * 400, key=f"invoice-{i}")
        beats.start(2)
        assert beats.wait_ticking(timeout=40), beats.logs()
        yield beats, url, app
    finally:
        beats.stop()
        writer.close()
        _drop_keys(prefix)
        import redis

        broker = redis.Redis.from_url(beats.broker)
        broker.delete(beats.queue)
        broker.close()


@pytest.fixture
def web(cluster: tuple[BeatCluster, str, Celery], tmp_path: Path) -> Iterator[str]:
    """``celery -A tests.beat_app anarchon web --allow-actions`` in a process
    of its own, the beats' configuration, the token from the environment;
    its base URL."""
    beats, _, _ = cluster
    port = _free_port()
    log = open(tmp_path / "web.log", "wb")  # noqa: SIM115
    process = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "tests.beat_app", "anarchon", "web"]
        + ["--port", str(port), "--allow-actions"],
        env=beats.env(env={"ANARCHON_WEB_TOKEN": TOKEN}),
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert process.poll() is None, (tmp_path / "web.log").read_text()
        try:
            with urllib.request.urlopen(f"{base}/jobs", timeout=5) as answer:
                return bool(answer.status == 200)
        except OSError:
            return False

    try:
        _wait_for(up, "the web page serving", timeout=30)
        yield base
    finally:
        process.terminate()
        process.wait(10)


def _screenshots_folder(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("ANARCHON_WEB_SCREENSHOTS") or tmp_path / "screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _screenshot(driver: Any, height: int) -> bytes:
    """The page as a PNG, :data:`WINDOW` wide and ``height`` CSS pixels
    tall from its top (beyond the window when taller)."""
    import base64

    shot = driver.execute_cdp_cmd(
        "Page.captureScreenshot",
        {
            "format": "png",
            "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": WINDOW[0], "height": height, "scale": 1},
        },
    )
    return base64.b64decode(shot["data"])


def _no_alert(driver: Any) -> None:
    from selenium.common.exceptions import NoAlertPresentException

    with pytest.raises(NoAlertPresentException):
        driver.switch_to.alert.text  # noqa: B018


def _text(driver: Any, element_id: str) -> str:
    from selenium.webdriver.common.by import By

    return str(driver.find_element(By.ID, element_id).text)


def test_an_operator_signs_in_pauses_and_runs_now_in_a_real_browser(
    browser: Any,
    web: str,
    cluster: tuple[BeatCluster, str, Celery],
    tmp_path: Path,
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    began = time.monotonic()
    beats, url, app = cluster
    driver = browser
    shots = _screenshots_folder(tmp_path)
    checker = backend_from_url(url, instance="browser-test-checker")
    checker.open()
    try:
        # -- the Cluster page: both beats live -------------------------------------
        def both_listed() -> bool:
            driver.get(web + "/")
            listed = _text(driver, "instances")
            return all(f":{p.pid}:" in listed for p in beats.procs)

        _wait_for(both_listed, "both beats listed on the Cluster page")
        assert "Live instances (2)" in _text(driver, "instances")
        assert "other schedule" not in _text(driver, "instances")

        # -- a job named as markup is text, and no alert ---------------------------
        driver.get(web + "/jobs")
        links = [a.text for a in driver.find_elements(By.CSS_SELECTOR, "a.job-link")]
        assert SCRIPT in links, links
        assert (
            driver.execute_script("return document.querySelectorAll('script:not([src])').length")
            == 0
        )
        _no_alert(driver)
        driver.find_element(By.LINK_TEXT, SCRIPT).click()
        assert _text(driver, "job-name") == SCRIPT
        _no_alert(driver)

        # -- sign in -----------------------------------------------------------------
        driver.find_element(By.ID, "sign-in").click()
        driver.find_element(By.ID, "login-token").send_keys(TOKEN)
        driver.find_element(By.ID, "login-submit").click()
        _wait_for(lambda: driver.find_elements(By.ID, "sign-out"), "signed in")

        # -- pause: stored, and honoured by both beats -------------------------------
        driver.get(f"{web}/jobs/{PAUSED}")
        driver.find_element(By.ID, "pause-note").send_keys("cache cluster upgrade")
        driver.find_element(By.ID, "action-pause").click()
        assert "paused" in _wait_for(lambda: driver.find_elements(By.ID, "flash"), "flash")[0].text
        assert _text(driver, "job-paused") == "yes: cache cluster upgrade"
        assert driver.find_elements(By.ID, "action-resume")
        with Schedules(app) as schedules:
            pause = schedules.state().pauses[PAUSED]
        assert pause.paused and pause.note == "cache cluster upgrade"

        # -- run now: claimed, recorded as sent, on the queue ------------------------
        driver.get(f"{web}/jobs/{RUN_NOW}")
        driver.find_element(By.ID, "run-now-key").send_keys("deploy-check-1")
        driver.find_element(By.ID, "action-run-now").click()
        flash = _wait_for(lambda: driver.find_elements(By.ID, "flash"), "flash")[0].text
        assert "sent, task id" in flash, flash
        task_id = flash.rsplit(" ", 1)[1]
        [manual] = [r for r in checker.history(RUN_NOW) if r.manual_key is not None]
        assert manual.manual_key == "deploy-check-1"
        assert manual.state is State.SENT and manual.task_id == task_id
        assert manual.instance  # the web process's claim

        # -- the auto-refresh replaces the live part, no reload ----------------------
        driver.get(web + "/jobs")
        paused_next = f'tr[data-job="{PAUSED}"] td:nth-child(6)'
        assert driver.find_element(By.CSS_SELECTOR, paused_next).text == "(paused)"
        Select(driver.find_element(By.ID, "refresh-interval")).select_by_value("2")
        driver.execute_script("window.anarchonMarker = 'not reloaded';")
        row = f'tr[data-job="{TICKING}"] td:nth-child(6)'
        before = driver.find_element(By.CSS_SELECTOR, row)
        first_next = before.text
        _wait_for(
            lambda: (
                _text(driver, "refresh-status").startswith("refreshed")
                and driver.find_element(By.CSS_SELECTOR, row).text != first_next
            ),
            "the Jobs page refreshed in place",
            timeout=15,
        )
        assert driver.execute_script("return window.anarchonMarker") == "not reloaded"
        from selenium.common.exceptions import StaleElementReferenceException

        with pytest.raises(StaleElementReferenceException):
            before.text  # noqa: B018  (the old row was replaced)
        Select(driver.find_element(By.ID, "refresh-interval")).select_by_value("10")

        # -- the beats honoured the pause --------------------------------------------
        first_paused = pause.from_ms
        _wait_for(lambda: checker.now_ms() > first_paused + 3000, "3 s past the pause")
        # Slots only: a parked task released meanwhile (the first is due
        # 90 s after the start, which a loaded machine reaches) has no job.
        headers = [h for h in beats.read_sent(timeout=1.0) if "anarchon_job" in h]
        sent = {(h["anarchon_job"], int(h["anarchon_slot"])) for h in headers}
        paused_slots = sorted(slot for job, slot in sent if job == PAUSED)
        assert paused_slots and paused_slots[0] < first_paused, "sent before the pause"
        assert all(slot < first_paused for slot in paused_slots), (first_paused, paused_slots)
        assert any(job == TICKING and slot > first_paused + 1000 for job, slot in sent)
        assert any(h["anarchon_job"] == RUN_NOW and h["id"] == task_id for h in headers)
        after = [r for r in checker.history(PAUSED) if r.slot_ms >= first_paused]
        assert not [r for r in after if r.state in SENT_STATES], after
        assert [r.state for r in after] == [State.SKIPPED]  # the pause, recorded once

        # -- screenshots for the docs ------------------------------------------------
        if os.environ.get("ANARCHON_WEB_SCREENSHOTS"):
            # for the docs, full timelines: 30 slots of the jobs every second
            time.sleep(max(0.0, 32 - (time.monotonic() - began)))
        for name, path, height in (
            ("cluster", "/", WINDOW[1]),
            ("jobs", "/jobs", WINDOW[1]),
            ("job", f"/jobs/{LATE}", 1500),  # the charts and the history too
            ("delayed", "/delayed", WINDOW[1]),
        ):
            driver.get(web + path)
            target = shots / f"web-{name}.png"
            target.write_bytes(_screenshot(driver, height))
            assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert _text(driver, "delayed-total") == "24"
    finally:
        checker.close()
