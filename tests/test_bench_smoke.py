"""Each benchmark of ``bench/`` runs end to end on a tiny size.

No timing is asserted: the figures of a run this small mean nothing. What is
checked is that every benchmark runs, prints its table, and (burst) that
every slot it measured was sent exactly once, (runtime) that every change
was applied by every instance, (stored_scale) that every instance reached
the store's version and no slot was sent twice or under a stale definition,
(countdown) that every parked task ran exactly once while the native
countdown tasks were held by their worker and ran again past a short
``visibility_timeout``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import (
    burst,
    claims,
    figures,
    footprint,
    misses,
    profile,
    runtime,
    scale,
    steady,
    stored_scale,
)

from .conftest import require_service

pytestmark = pytest.mark.services


def test_claims_smoke(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    require_service("redis")
    out = tmp_path / "claims.json"
    args = ["--single", "5", "--batch", "5", "--batches", "1", "--repeats", "1"]
    assert claims.main([*args, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| redis | SET NX PX |" in printed
    assert "| sqlite |" in printed
    results = json.loads(out.read_text())
    assert {r["backend"] for r in results} >= {"redis", "sqlite"}
    for r in results:
        assert r["summary"]["single_median_ours"]["median"] > 0


@pytest.mark.integration
def test_burst_smoke(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    require_service("redis")
    out = tmp_path / "burst.json"
    args = [
        "--jobs",
        "20",
        "--period",
        "4",
        "--max-late",
        "3",
        "--rounds",
        "1",
        "--repeats",
        "1",
        "--wait",
        "10",
        "--setup-allowance",
        "15",  # a loaded machine took 4.5 s to start the publisher (3 s allowed by default)
        "--configs",
        "publish-1,anarchon-redis-2",
        "--jitters",
        "1",
        "--json",
        str(out),
    ]
    assert burst.main(args) == 0
    assert "| anarchon redis x2 jitter 1 | 20 |" in capsys.readouterr().out
    results = json.loads(out.read_text())
    assert [r.get("error") for r in results] == [None, None]
    anarchon = next(r for r in results if r["config"].startswith("anarchon"))
    assert anarchon["exactly_once"], anarchon
    assert anarchon["duplicates"] == 0
    assert len(anarchon["late_s"]) == 20  # a lateness per message read


@pytest.mark.integration
def test_burst_on_a_rabbitmq_broker_with_confirms(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The beats publish to a RabbitMQ vhost of the run's own, the reader
    consumes every message there, and the figures are drawn from the run."""
    require_service("redis")
    require_service("rabbitmq")
    out = tmp_path / "burst.json"
    args = ["--jobs", "20", "--period", "4", "--max-late", "3", "--rounds", "1"]
    args += ["--repeats", "1", "--wait", "10", "--jitters", "1", "--json", str(out)]
    args += ["--configs", "anarchon-redis-2-amqp-confirm"]
    assert burst.main(args) == 0
    assert "broker RabbitMQ with confirms | 20 |" in capsys.readouterr().out
    [result] = json.loads(out.read_text())
    assert "error" not in result, result
    assert result["exactly_once"] and result["duplicates"] == 0, result
    assert sum(result["sent_by_instance"]) == 20
    drawn = tmp_path / "figures"
    assert figures.main([str(out), "--out", str(drawn), "--jobs", "20"]) == 0
    for name in ("lateness.png", "round-vs-jobs.png"):
        assert (drawn / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.integration
def test_steady_smoke(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    require_service("redis")
    out = tmp_path / "steady.json"
    args = ["--jobs", "20", "--period", "4", "--instances", "2", "--max-late", "3"]
    args += ["--warmup", "1", "--rounds", "2", "--send-wait", "6", "--json", str(out)]
    assert steady.main(args) == 0
    assert "every measured slot exactly once: yes" in capsys.readouterr().out
    [result] = json.loads(out.read_text())
    assert "error" not in result, result
    totals = result["totals"]
    assert (totals["due"], totals["once"], totals["never"]) == (40, 40, 0)
    assert totals["history"] == {"sent": 40}
    assert totals["history_mismatch"] == 0


def test_steady_attribution() -> None:
    """Each message counts for the slot in its headers, not for its place
    in the queue: a late message of an earlier slot is not the next round's."""
    jobs = ["a", "b"]
    messages = [
        ("a", 20_000, 20.5),
        ("b", 0, 21.0),  # slot 0, arrived during round 20 s: late 21 s
        ("b", 20_000, 22.5),
        ("b", 20_000, 23.0),  # twice
        ("x", 20_000, 20.1),  # not one of the jobs
    ]
    zero, twenty = steady.attribute(messages, jobs, [0, 20_000], period=20)
    assert (zero["once"], zero["never"], zero["never_jobs"]) == (1, 1, ["a"])
    assert zero["max"] == pytest.approx(21.0)
    assert zero["over_period"] == 1
    assert (twenty["once"], twenty["twice_or_more"], twenty["extra_messages"]) == (1, 1, 1)
    assert twenty["never"] == 0
    assert twenty["done"] == pytest.approx(2.5)
    assert twenty["max"] == pytest.approx(3.0)
    assert twenty["over_2s"] == 2
    states = {"a": "sent", "b": "missed"}
    steady.check_history(zero, states, jobs)
    assert zero["history_never"] == {"sent": 1}
    assert zero["history_mismatch"] == 2  # a: sent but not queued; b: queued, missed


@pytest.mark.integration
def test_runtime_smoke(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Every change reaches every instance; the idle and start-up beats run."""
    require_service("redis")
    out = tmp_path / "runtime.json"
    assert runtime.main(["--tiny", "--json", str(out)]) == 0
    assert "| redis | all | 16 | 16 |" in capsys.readouterr().out
    results = json.loads(out.read_text())
    [run] = results["propagation"]
    assert "error" not in run, run
    assert len(run["changes"]) == 8
    assert [i["applied"] for i in run["instances"]] == [8, 8]
    assert run["every_change_everywhere"]
    assert [(r["code"], r["stored"]) for r in results["idle"]] == [("after", 0), ("after", 20)]
    assert [r["stored"] for r in results["startup"]] == [0, 20]
    for row in results["idle"] + results["startup"]:
        assert "error" not in row, row
    # the start-up beat read the stored jobs: the size measured is the size stored
    assert "20 stored job(s)" in results["startup"][1]["loaded"][0]
    assert "20 stored job(s)" in results["idle"][1]["loaded"][0]


@pytest.mark.integration
def test_stored_scale_smoke(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Both sizes start, idle and apply single changes; under the storm
    every instance applies every update, ends on the store's version, and
    the firing jobs' slots are sent once each, under the definition that
    held at them."""
    require_service("redis")
    out = tmp_path / "stored-scale.json"
    assert stored_scale.main(["--tiny", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| redis | 200 / 20 |" in printed
    assert "converged: yes" in printed
    results = json.loads(out.read_text())
    [size] = results["size"]
    assert "error" not in size, size
    assert [(r["stored"], "error" in r) for r in size["startup"]] == [(20, False), (200, False)]
    assert "200 stored job(s)" in size["startup"][1]["loaded"][0]
    assert "200 stored job(s)" in size["idle"]["200"]["loaded"][0]
    assert [len(size["changes"][n]) for n in ("20", "200")] == [2, 2]
    [storm] = results["storm"]
    assert "error" not in storm, storm
    assert storm["commits"] > 0
    assert [i["applied"] for i in storm["instances"]] == [storm["commits"]] * 2
    assert storm["versions_at_settle"] == [storm["store_version"]] * 2
    assert storm["converged"]
    sends = storm["sends"]
    assert sends["slots_sent"] > 0 and sends["due_in_window"] > 0
    assert (sends["stale"], sends["duplicates"], sends["never_sent"]) == (0, 0, 0), sends
    assert storm["problems"] == []


def test_stored_scale_send_check() -> None:
    """A sent slot is judged by the definition that held at it (from its
    commit plus 1 s): an odd second while the 2 s one held is stale, a slot
    sent twice is a duplicate, a slot of the holding definition not sent
    is missing."""
    # every 1 s from 10.0 s (committed 9.0 s), every 2 s from 13.5 s (12.5 s)
    held = stored_scale.definitions({"a": (9_000, 1.0)}, [("a", 2.0, 7, 12_500)])
    assert held == {"a": [(10_000, 1.0), (13_500, 2.0)]}
    assert stored_scale.holding(held["a"], 9_999) is None
    assert stored_scale.holding(held["a"], 13_000) == 1.0
    assert stored_scale.holding(held["a"], 13_500) == 2.0
    sent = [("a", ms, 0.0) for ms in (10_000, 11_000, 12_000, 13_000, 14_000, 15_000)]
    sent += [("a", 14_000, 0.1), ("b", 15_000, 0.0)]  # twice; not a checked job
    found = stored_scale.check_sends(sent, held, (10_000, 18_000))
    assert found["messages"] == 7
    assert found["slots_sent"] == 6
    assert (found["stale"], found["stale_slots"]) == (1, [("a", 15_000)])
    assert (found["duplicates"], found["duplicate_slots"]) == (1, [("a", 14_000)])
    # due: 10, 11, 12, 13 (1 s), 14, 16, 18 (2 s); 16 and 18 not sent
    assert found["due_in_window"] == 7
    assert (found["never_sent"], found["never_slots"]) == (2, [("a", 16_000), ("a", 18_000)])


def test_stored_scale_delays() -> None:
    """An update counts as applied at the first batch of a version at least
    its own; one no batch reached is NaN."""
    commits = [("a", 1.0, 5, 1_000), ("b", 2.0, 6, 1_100), ("a", 2.0, 9, 1_200)]
    batches = [(4, 0.9, 0.9), (6, 1.4, 1.39), (8, 1.9, 1.88)]
    first, second, never = stored_scale.change_delays(commits, batches)
    assert first == pytest.approx(0.4) and second == pytest.approx(0.3)
    assert never != never


def test_scale_smoke(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    args = ["--sizes", "60", "--backends", "stub", "--idle", "1", "--due", "30"]
    assert scale.main([*args, "--repeats", "1", "--json", str(out)]) == 0
    assert "| stub | 60 |" in capsys.readouterr().out
    [result] = json.loads(out.read_text())
    assert result["jobs"] == 60
    assert result["due"] == 30


def test_misses_smoke(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # The run itself checks every slot recorded missed and nothing sent.
    out = tmp_path / "misses.json"
    args = ["--jobs", "20", "--backends", "sqlite", "--repeats", "1", "--json", str(out)]
    assert misses.main(args) == 0
    assert "| sqlite |" in capsys.readouterr().out
    runs = json.loads(out.read_text())["sqlite"]
    assert len(runs["batched"]) == len(runs["per slot"]) == 1


def test_footprint_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    require_service("redis")
    args = ["--jobs", "2", "--history-size", "4", "--backends", "redis,sqlite"]
    assert footprint.main(args) == 0
    printed = capsys.readouterr().out
    assert "| redis |" in printed
    assert "| sqlite |" in printed


def test_profile_summary(tmp_path: Path) -> None:
    raw = tmp_path / "p.txt"
    raw.write_text(
        "main (celery/beat.py:1);Scheduler.tick (celery_anarchon/beat/scheduler.py:2);"
        "Claimer.claim (celery_anarchon/beat/claiming.py:3);recv (socket.py:4) 30\n"
        "main (celery/beat.py:1);Scheduler.tick (celery_anarchon/beat/scheduler.py:2) 10\n"
    )
    text = profile.summarise(raw)
    assert "| claim batch (backend.claim) | 30 | 75.0 | 100 |" in text
    assert "40 samples" in text


def test_compare_runs_both_checkouts_and_reports_ratios(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``bench.compare`` runs the benchmark in each checkout, alternating, and
    prints per-figure medians and their ratio. Both sides are this checkout,
    so both sides have figures; no figure's value is checked."""
    from bench import compare

    here = str(Path(__file__).resolve().parents[1])
    argv = ["--before", here, "--after", here, "--repeats", "1", "scale"]
    argv += ["--sizes", "200", "--backends", "stub", "--idle", "1", "--due", "20"]
    assert compare.main(argv) == 0
    printed = capsys.readouterr().out
    rows = [line for line in printed.splitlines() if line.startswith("| stub 200 |")]
    assert {row.split(" | ")[1] for row in rows} >= {"start-up s", "RSS MiB"}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[2] != "-" and cells[3] != "-", row
        float(cells[4])  # a ratio of two medians
        assert cells[5] == "1/1"


@pytest.mark.integration
def test_delayed_smoke(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """On Redis and PostgreSQL, three real beats release every task of the
    tiny burst, of the lateness part and of the push part exactly once and
    none before its due time, the store is empty at the end, and the
    figures are printed side by side."""
    from bench import delayed

    require_service("redis")
    require_service("postgresql")
    out = tmp_path / "delayed.json"
    assert delayed.main(["--tiny", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| figure | Redis | PostgreSQL |" in printed
    for label in (
        "memory per task, whole (bytes)",
        "park, single (calls/s)",
        "park_many (tasks/s)",
        "burst: release rate, first to last message (tasks/s)",
        "lateness: p50 / p99 / max (ms)",
        "push: lateness p50 / p99 / max (ms)",
    ):
        assert f"| {label} |" in printed, label
    results = json.loads(out.read_text())["results"]
    assert [r["backend"] for r in results] == ["redis", "postgresql"]
    for r in results:
        assert "error" not in r, r["error"]
        assert r["stored_count"] == 200
        for part, parked in (("burst", 200), ("lateness", 200), ("push", 10)):
            found = r[part]
            assert (found["parked"], found["read"]) == (parked, parked), (part, found)
            assert (found["duplicates"], found["missing"], found["early"]) == (0, 0, 0), found
            assert found["p99_ms"] is not None and found["p99_ms"] >= 0
        assert r["single"]["calls"] == 50 and r["single"]["per_s"] > 0
        assert r["many"]["per_s"] > 0
        assert r["unknown_messages"] == 0
        assert r["left_in_store"] == 0
        assert r["problems"] == []
    redis_own = results[0]["memory_per_task"]["keys"]
    postgres_own = results[1]["memory_per_task"]["total"]
    assert redis_own > 0 and postgres_own > 0


@pytest.mark.integration
def test_countdown_smoke(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Real workers on a Redis broker: the native countdown tasks are all
    held by their worker, unacknowledged, and run more than once past a
    short ``visibility_timeout``; the parked ones are fetched by no worker
    until due, and run exactly once. The consumer-timeout part is not run
    here: it starts a RabbitMQ node of its own and takes minutes even with
    ``--quick``."""
    from bench import countdown

    require_service("redis")
    out = tmp_path / "countdown.json"
    argv = ["--quick", "--only", "rss", "--only", "redelivery", "--json", str(out)]
    assert countdown.main(argv) == 0
    printed = capsys.readouterr().out
    assert "| per pending task: RSS / PSS (bytes) |" in printed
    assert "| executions beyond the first (duplicates) |" in printed
    results = json.loads(out.read_text())
    rss = results["rss"]
    assert "error" not in rss, rss
    assert rss["native_taken_s"] is not None
    assert (rss["native_unacked"], rss["native_queued"]) == (2000, 0)
    assert rss["ours_parked"] == 2000
    assert (rss["unacked_after_ours"], rss["ours_queued"]) == (2000, 0)
    assert rss["native_loaded"]["main_rss"] > rss["native_baseline"]["main_rss"]
    redelivery = results["redelivery"]
    assert "error" not in redelivery, redelivery
    assert redelivery["ours"]["per_task"] == {"1": 5}, redelivery["ours"]
    assert redelivery["native"]["never"] == 0
    assert redelivery["native"]["extra"] > 0, redelivery["native"]


def test_web_render_cost_smoke(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Every page renders at both tiny sizes on Redis, PostgreSQL and SQLite,
    without a banner, and a Jobs render makes the same round trips at 100
    and 1,000 jobs."""
    from bench import web

    require_service("redis")
    require_service("postgresql")
    out = tmp_path / "web.json"
    assert web.main(["--quick", "--json", str(out)]) == 0
    assert "| redis | Jobs, filtered |" in capsys.readouterr().out
    results = json.loads(out.read_text())["results"]
    assert [(r["backend"], r["jobs"]) for r in results] == [
        (kind, size) for kind in ("redis", "postgresql", "sqlite") for size in (100, 1000)
    ]
    for r in results:
        for page in web.PAGES:
            assert "error" not in r["pages"][page], (r["backend"], r["jobs"], r["pages"][page])
            assert r["pages"][page]["round_trips"] > 0 and r["pages"][page]["ms"] > 0
    for kind in ("redis", "postgresql", "sqlite"):
        small, large = (r["pages"]["Jobs"]["round_trips"] for r in results if r["backend"] == kind)
        assert small == large, kind
