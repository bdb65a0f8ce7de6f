"""Runtime schedules (stored jobs): how soon every instance applies a
change, what stored jobs cost an idle instance, and start-up with many.

    python -m bench.runtime [--changes 200] [--gap 0.3] [--instances 3]
        [--backend redis[,postgresql]] [--stored 1000] [--seconds 60]
        [--startup-sizes 0,1000,10000] [--startup-repeats 3]
        [--before CHECKOUT] [--repeats 2]
        [--parts propagation,idle,startup] [--seed 1] [--tiny] [--json PATH]

Every part runs real ``celery -A bench.bench_app beat -S
celery_anarchon.Scheduler`` processes whose only code job runs every hour,
anchored half an hour after the run started; the stored jobs run every hour
on the same anchor. Nothing falls due during a run under 30 minutes, so no
slot keeps beat awake: it wakes for the stored-jobs poll (every 0.5 s) and
the registry heartbeat (every 5 s) only. The beats log with the record's
epoch time (``worker_log_format`` with ``%(created)``), the clock every
delay is computed with; on one host the backend's commit clock (Redis
``TIME``, the SQL server's clock) is the same clock.

* **propagation** (per backend of ``--backend``): ``--instances`` beats,
  20 stored jobs stored before they start; then ``--changes`` changes, one
  every ``--gap`` seconds on average (each wait drawn from 0.5 to 1.5 times
  the gap, so commits fall at random points of the poll), a mix of add,
  update (a new interval), pause, resume and remove of stored jobs. A
  change's version and commit time are what the API returns
  (``StoredJob.committed_ms``, ``Pause.paused_ms`` / ``resumed_ms``); a
  removal's commit time is read back from the backend's record of that
  version (``stored_changes``). Each beat logs ``anarchon: applied
  stored-jobs version N`` after applying a batch; **a change's delay on an
  instance is the time of the first such line with N at least the change's
  version, minus the change's commit time**. Median, p99, max, count and
  the share within 1 s, per repeat and over all repeats.
* **idle** (per backend): side by side, at the same time, one beat with no
  stored job, one with ``--stored`` hourly stored jobs and, with
  ``--before CHECKOUT`` (a checkout of a commit before stored jobs, with
  its own ``.venv``), that code's beat: CPU seconds of each process over
  ``--seconds`` after a 5 s settle (the scheduler's count of every thread,
  :func:`~bench.common.cpu_seconds_exact`), scaled to a minute, and its RSS
  at the end.
* **startup** (per backend, per size of ``--startup-sizes``, in turn,
  ``--startup-repeats`` times): one beat logging at DEBUG, started against
  a backend holding that many stored jobs (``--before``: also that code's
  beat, no stored job): seconds from launching the process to its first
  ``beat: Waking up`` line (after set-up and the first tick), of which from
  ``beat: Starting...`` (after the imports) to that line, the process's CPU
  seconds and RSS at that line.

Give the ``--before`` checkout's ``.venv`` the same packages as this one
(``pip install -e '.[test,docs,lint,postgres,mysql,bench]'``): an optional
package changes the imports (kombu registers a YAML serializer when PyYAML
is there), and so the start-up and RSS of a beat.

Repeats run the parts in turn, so each part of a repeat saw the same load.
Everything is made under a run-unique prefix (Redis keys, SQL tables, a
temporary folder) and removed at the end, also on SIGTERM; the beats are
stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import redis

from . import common
from .burst import Config, claim_backend, clean_broker
from .common import log

PARTS = ("propagation", "idle", "startup")

#: The interval of the code job and of every stored job, seconds.
PERIOD = 3600.0
#: The intervals an update picks from, seconds (on the same anchor, none
#: falls due within half an hour of the run's start).
UPDATE_PERIODS = (1800.0, 5400.0, 7200.0)
#: Stored jobs stored before the propagation beats start.
SEED_JOBS = 20
#: The task of every job (``bench.bench_app``'s, takes no argument).
TASK = "bench.noop"
#: Log lines with the record's epoch time first (to the microsecond).
LOG_FORMAT = "[%(created).6f: %(levelname)s/%(processName)s] %(message)s"

LINE = re.compile(r"^\[(\d+\.\d+): (\w+)/[^\]]*\] (.*)$")
APPLIED = re.compile(
    r"anarchon: applied stored-jobs version (\d+) \((\d+) change\(s\), "
    r"committed (\S+), (-?\d+\.\d+) s ago\)"
)


def anchor_s() -> float:
    """Every job's anchor, epoch seconds: half a period after the run
    started, so no slot is due within 30 minutes of the start."""
    return _START[0] + PERIOD / 2


#: When the run started (:func:`main`), epoch seconds.
_START = [time.time()]


# -- beats -------------------------------------------------------------------------


@dataclass
class Beat:
    """One real ``celery beat`` process of this benchmark."""

    name: str
    backend_url: str
    folder: Path
    checkout: Path = common.REPO
    level: str = "INFO"
    proc: subprocess.Popen[bytes] | None = None
    launched: float = 0.0

    @property
    def logfile(self) -> Path:
        return self.folder / f"{self.name}.log"

    @property
    def ready_dir(self) -> Path:
        return self.folder / f"{self.name}-ready"

    def start(self) -> None:
        self.ready_dir.mkdir(exist_ok=True)
        code_job = {
            "code-hourly": {"task": TASK, "schedule": PERIOD, "anarchon": {"anchor": anchor_s()}}
        }
        env = {
            **os.environ,
            "BENCH_KIND": "anarchon",
            "BENCH_BROKER": common.BROKER_URL,
            "BENCH_QUEUE": f"bench-{common.RUN_ID}-runtime",
            "BENCH_JOBS": "0",
            "BENCH_BACKEND": self.backend_url,
            "BENCH_CONF": json.dumps({"beat_schedule": code_job, "worker_log_format": LOG_FORMAT}),
            "BENCH_READY_DIR": str(self.ready_dir),
            "PYTHONPATH": str(self.checkout),
        }
        python = self.checkout / ".venv" / "bin" / "python"
        command = [str(python) if python.exists() else sys.executable, "-m", "celery"]
        command += ["-A", "bench.bench_app", "beat", "-S", "celery_anarchon.Scheduler"]
        command += ["-l", self.level, "-s", str(self.folder / f"{self.name}-schedule")]
        with open(self.logfile, "wb") as out:
            self.launched = time.time()
            self.proc = subprocess.Popen(
                command, cwd=self.folder, env=env, stdout=out, stderr=subprocess.STDOUT
            )

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def check_alive(self) -> None:
        """Raises RuntimeError when the process has exited."""
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n{self.tail()}")

    def ready(self) -> bool:
        """Whether set-up is done (``beat_init``'s mark is written)."""
        return any(self.ready_dir.glob("ready-*"))

    def lines(self) -> list[tuple[float, str, str]]:
        """``(epoch seconds, level, message)`` of every log line so far."""
        found = []
        with open(self.logfile, errors="replace") as text:
            for line in text:
                match = LINE.match(line.rstrip("\n"))
                if match:
                    found.append((float(match.group(1)), match.group(2), match.group(3)))
        return found

    def tail(self, size: int = 3000) -> str:
        return self.logfile.read_text(errors="replace")[-size:]

    def stop(self) -> None:
        if self.proc is not None:
            common.stop_process(self.proc, timeout=20)


def wait_ready(beats: Sequence[Beat], timeout: float) -> None:
    """Until every beat finished set-up.

    Raises:
        RuntimeError: a beat exited, or was not ready within ``timeout`` s.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for beat in beats:
            beat.check_alive()
        if all(beat.ready() for beat in beats):
            return
        time.sleep(0.05)
    raise RuntimeError(f"not ready within {timeout:.0f} s:\n{beats[0].tail()}")


def loaded(beat: Beat) -> list[str]:
    """The beat's start-up line saying how many stored jobs it read (none
    when it read none)."""
    return [m for _, _, m in beat.lines() if " stored job(s), " in m][:1]


def problems(beats: Sequence[Beat]) -> list[str]:
    """Every log line at WARNING or above, ``name: message``."""
    return [
        f"{beat.name}: {level} {message}"
        for beat in beats
        for _, level, message in beat.lines()
        if level in ("WARNING", "ERROR", "CRITICAL")
    ]


@contextmanager
def running(beats: Sequence[Beat]) -> Iterator[None]:
    """Start ``beats``; stop every one of them on the way out."""
    try:
        for beat in beats:
            beat.start()
        yield
    finally:
        for beat in beats:
            if beat.proc is not None and beat.proc.poll() is None:
                beat.proc.terminate()
        for beat in beats:
            beat.stop()


# -- the writer ----------------------------------------------------------------------


def schedules_for(backend_url: str) -> Any:
    """A :class:`celery_anarchon.Schedules` on ``backend_url``, with the
    beats' code job and task (``bench.bench_app``'s, a shared task), so it
    validates what beat validates."""
    from celery import Celery

    from celery_anarchon import Schedules

    from . import bench_app  # noqa: F401  (its task joins every app, this one too)

    app = Celery("bench-runtime", broker="memory://")
    app.conf.update(
        timezone="UTC",
        anarchon_backend=backend_url,
        beat_schedule={"code-hourly": {"task": TASK, "schedule": PERIOD}},
    )
    return Schedules(app)


def add_stored(schedules: Any, names: Sequence[str]) -> float:
    """Store hourly jobs named ``names``; returns the seconds it took."""
    anchor = {"anchor": anchor_s()}
    started = time.perf_counter()
    for name in names:
        schedules.add(name, TASK, PERIOD, anarchon=anchor)
    return time.perf_counter() - started


@dataclass
class Change:
    """One committed change: what, its version and commit time (epoch ms)."""

    op: str
    name: str
    version: int
    committed_ms: int


@dataclass
class Writer:
    """Draws and commits the changes of the propagation part."""

    schedules: Any
    rng: random.Random
    #: stored jobs not paused, and paused ones, by name
    active: list[str] = field(default_factory=list)
    paused: list[str] = field(default_factory=list)
    added: int = 0

    def seed(self, count: int) -> None:
        names = [self._new_name() for _ in range(count)]
        add_stored(self.schedules, names)
        self.active.extend(names)

    def _new_name(self) -> str:
        self.added += 1
        return f"stored-{self.added:06d}"

    def _op(self) -> str:
        jobs = len(self.active) + len(self.paused)
        weights = {
            "add": 3,
            "update": 3 if jobs else 0,
            "pause": 2 if self.active else 0,
            "resume": 2 if self.paused else 0,
            "remove": 2 if jobs > 10 else 0,
        }
        ops = [op for op, w in weights.items() if w]
        return self.rng.choices(ops, [weights[op] for op in ops])[0]

    def commit(self) -> Change:
        """Draw one change and commit it."""
        op, s, anchor = self._op(), self.schedules, {"anchor": anchor_s()}
        if op == "add":
            name = self._new_name()
            job = s.add(name, TASK, PERIOD, anarchon=anchor)
            self.active.append(name)
            return Change(op, name, job.version, job.committed_ms)
        if op == "update":
            name = self.rng.choice(self.active + self.paused)
            job = s.update(name, schedule=self.rng.choice(UPDATE_PERIODS), anarchon=anchor)
            return Change(op, name, job.version, job.committed_ms)
        if op == "pause":
            name = self.active.pop(self.rng.randrange(len(self.active)))
            pause = s.pause(name, note="bench")
            self.paused.append(name)
            return Change(op, name, pause.version, pause.paused_ms)
        if op == "resume":
            name = self.paused.pop(self.rng.randrange(len(self.paused)))
            pause = s.resume(name)
            self.active.append(name)
            return Change(op, name, pause.version, pause.resumed_ms)
        pool = self.active if self.active else self.paused
        name = pool.pop(self.rng.randrange(len(pool)))
        version = s.remove(name)
        # the removal's own record: its commit time as the backend wrote it
        [record] = [r for r in s.backend.stored_changes(version - 1) if r.version == version]
        return Change(op, name, version, record.committed_ms)


# -- propagation ---------------------------------------------------------------------


def applied_at(beat: Beat) -> list[tuple[int, float, float]]:
    """``(version, logged at, applied at per the line)`` of every batch the
    beat applied, epoch seconds: the line's record time, and its commit
    time plus its ``s ago``."""
    out = []
    for at, _, message in beat.lines():
        match = APPLIED.search(message)
        if match:
            committed = datetime.fromisoformat(match.group(3).replace("Z", "+00:00"))
            out.append((int(match.group(1)), at, committed.timestamp() + float(match.group(4))))
    return out


def delays(changes: Sequence[Change], batches: Sequence[tuple[int, float, float]]) -> list[float]:
    """Per change, seconds from its commit to the first batch of a version
    at least its own (NaN when none came)."""
    out = []
    for change in changes:
        first = next((at for version, at, _ in batches if version >= change.version), None)
        out.append(float("nan") if first is None else first - change.committed_ms / 1000)
    return out


def delay_stats(values: Sequence[float]) -> dict[str, Any]:
    got = [v for v in values if v == v]
    return {
        "count": len(values),
        "applied": len(got),
        "median": common.percentile(got, 50) if got else None,
        "p99": common.percentile(got, 99) if got else None,
        "max": max(got) if got else None,
        "min": min(got) if got else None,
        "within_1s": sum(1 for v in got if v <= 1.0) / len(values) if values else None,
    }


def propagation(args: argparse.Namespace, backend: str, repeat: int) -> dict[str, Any]:
    tag = f"{common.RUN_ID}-p{repeat}{backend[:2]}"
    folder = Path(tempfile.mkdtemp(prefix="anarchon-bench-runtime-"))
    result: dict[str, Any] = {"backend": backend, "repeat": repeat, "load_before": os.getloadavg()}
    rng = random.Random(args.seed * 1000 + repeat)
    try:
        with ExitStack() as stack:
            url = stack.enter_context(claim_backend(Config("anarchon", backend), tag))
            assert url is not None
            schedules = stack.enter_context(schedules_for(url))
            writer = Writer(schedules, rng)
            writer.seed(SEED_JOBS)
            beats = [Beat(f"beat-{i + 1}", url, folder) for i in range(args.instances)]
            stack.enter_context(running(beats))
            wait_ready(beats, timeout=120)
            time.sleep(1.0)  # past the first tick and heartbeat
            changes: list[Change] = []
            started = time.monotonic()
            for _ in range(args.changes):
                time.sleep(rng.uniform(0.5, 1.5) * args.gap)
                changes.append(writer.commit())
            result["writing_s"] = time.monotonic() - started
            last = max(c.version for c in changes)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                for beat in beats:
                    beat.check_alive()
                if all(max((v for v, *_ in applied_at(b)), default=0) >= last for b in beats):
                    break
                time.sleep(0.1)
            time.sleep(0.6)
            result["load_after"] = os.getloadavg()
            per_instance = []
            for beat in beats:
                batches = applied_at(beat)
                values = delays(changes, batches)
                # the line's own figure (commit + s ago, read before applying)
                # against its record time (after): what applying took
                gaps = [logged - own for _, logged, own in batches]
                per_instance.append(
                    {
                        "instance": beat.name,
                        "delays_s": [round(v, 4) for v in values],
                        "batches": len(batches),
                        "apply_s_max": max(gaps, default=None),
                        **delay_stats(values),
                    }
                )
            result["ops"] = dict(sorted(Counter(c.op for c in changes).items()))
            result["changes"] = [[c.op, c.name, c.version, c.committed_ms] for c in changes]
            result["instances"] = per_instance
            result["all"] = delay_stats([v for i in per_instance for v in i["delays_s"]])
            result["every_change_everywhere"] = all(
                i["applied"] == len(changes) for i in per_instance
            )
            result["problems"] = problems(beats)
            return result
    except Exception as exc:  # reported; the other parts go on
        result["error"] = f"{type(exc).__name__}: {exc}"
        log(f"propagation: {result['error'][:2000]}")
        return result
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# -- idle ------------------------------------------------------------------------------


def idle(
    args: argparse.Namespace, backend: str, repeat: int, urls: dict[str, str]
) -> list[dict[str, Any]]:
    """One window with the beats of every case side by side."""
    folder = Path(tempfile.mkdtemp(prefix="anarchon-bench-runtime-"))
    cases = [("after", 0, urls["0"]), ("after", args.stored, urls["idle"])]
    if args.before:
        cases.insert(0, ("before", 0, urls["before"]))
    beats = [
        Beat(f"{code}-{stored}", url, folder, args.before if code == "before" else common.REPO)
        for code, stored, url in cases
    ]
    rows = [
        {"backend": backend, "repeat": repeat, "code": code, "stored": stored, "beat": beat.name}
        for (code, stored, _), beat in zip(cases, beats, strict=True)
    ]
    try:
        with running(beats):
            wait_ready(beats, timeout=120)
            time.sleep(5.0)  # past the first heartbeat (definitions sent once)
            load = os.getloadavg()
            cpu0 = [common.cpu_seconds_exact(b.pid) for b in beats]
            time.sleep(args.seconds)
            for beat in beats:
                beat.check_alive()
            cpu1 = [common.cpu_seconds_exact(b.pid) for b in beats]
            for row, beat, c0, c1 in zip(rows, beats, cpu0, cpu1, strict=True):
                row["cpu_s"] = c1 - c0
                row["window_s"] = args.seconds
                row["cpu_per_min_s"] = (c1 - c0) * 60 / args.seconds
                row["rss_mib"] = common.rss_bytes(beat.pid) / 2**20
                row["load_before"] = load
                row["load_after"] = os.getloadavg()
            for row, beat in zip(rows, beats, strict=True):
                row["loaded"] = loaded(beat)
                row["problems"] = problems([beat])
    except Exception as exc:
        for row in rows:
            row["error"] = f"{type(exc).__name__}: {exc}"
        log(f"idle: {exc}"[:2000])
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return rows


# -- start-up ----------------------------------------------------------------------------


def startup(
    backend: str, repeat: int, code: str, stored: int, url: str, checkout: Path
) -> dict[str, Any]:
    """One beat started against ``stored`` stored jobs, to its first wake-up."""
    folder = Path(tempfile.mkdtemp(prefix="anarchon-bench-runtime-"))
    row: dict[str, Any] = {"backend": backend, "repeat": repeat, "code": code, "stored": stored}
    beat = Beat(f"startup-{code}-{stored}", url, folder, checkout, level="DEBUG")
    try:
        with running([beat]):
            row["load_before"] = os.getloadavg()
            deadline = time.monotonic() + 300
            woke = starting = None
            while woke is None:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no wake-up within 300 s:\n{beat.tail()}")
                beat.check_alive()
                time.sleep(0.02)
                for at, _, message in beat.lines():
                    if starting is None and message.startswith("beat: Starting"):
                        starting = at
                    if message.startswith("beat: Waking up"):
                        woke = at
                        break
            row["cpu_s"] = common.cpu_seconds_exact(beat.pid)
            row["rss_mib"] = common.rss_bytes(beat.pid) / 2**20
            row["startup_s"] = woke - beat.launched
            row["setup_s"] = woke - starting if starting is not None else None
            row["loaded"] = loaded(beat)
            row["problems"] = problems([beat])
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"
        log(f"startup: {row['error'][:2000]}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return row


# -- the run ------------------------------------------------------------------------------


@contextmanager
def stored_backends(args: argparse.Namespace, backend: str) -> Iterator[dict[str, str]]:
    """The backends the idle and start-up parts share, stored jobs in place:
    ``"0"`` (none), ``"idle"`` (``--stored``), ``"<n>"`` per start-up size,
    ``"before"`` (for the code before stored jobs); removed afterwards."""
    sizes = sorted({0, args.stored if "idle" in args.parts else 0, *args.sizes_})
    with ExitStack() as stack:
        urls: dict[str, str] = {}
        for size in sizes:
            tag = f"{common.RUN_ID}-s{size}{backend[:2]}"
            url = stack.enter_context(claim_backend(Config("anarchon", backend), tag))
            assert url is not None
            urls[str(size)] = url
            if size:
                schedules = stack.enter_context(schedules_for(url))
                took = add_stored(schedules, [f"stored-{i:06d}" for i in range(size)])
                log(f"{backend}: {size:,} stored jobs added in {took:.1f} s")
                schedules.close()
        urls["idle"] = urls[str(args.stored if "idle" in args.parts else 0)]
        tag = f"{common.RUN_ID}-b{backend[:2]}"
        before = stack.enter_context(claim_backend(Config("anarchon", backend), tag))
        assert before is not None
        urls["before"] = before
        yield urls


def startups(
    args: argparse.Namespace, backend: str, repeat: int, urls: dict[str, str]
) -> list[dict[str, Any]]:
    """The start-up of each size, and of the code before stored jobs, in
    turn, ``--startup-repeats`` times."""
    cases = [("after", size, common.REPO) for size in args.sizes_]
    if args.before:
        cases.insert(0, ("before", 0, args.before))
    rows = []
    for code, size, checkout in cases * args.startup_repeats:
        url = urls["before" if code == "before" else str(size)]
        rows.append(startup(backend, repeat, code, size, url, checkout))
        log(f"  {_brief(rows[-1])}")
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"propagation": [], "idle": [], "startup": []}
    for backend in args.backends:
        with stored_backends(args, backend) as urls:
            for repeat in range(args.repeats):
                step = f"repeat {repeat + 1}/{args.repeats}, {backend}"
                if "propagation" in args.parts:
                    log(f"{step}: propagation")
                    found = propagation(args, backend, repeat)
                    results["propagation"].append(found)
                    log(f"  {json.dumps(found.get('all', found.get('error')))[:400]}")
                if "idle" in args.parts:
                    log(f"{step}: idle {args.seconds:g} s")
                    rows = idle(args, backend, repeat, urls)
                    for row in rows:
                        log(f"  {_brief(row)}")
                    results["idle"] += rows
                if "startup" in args.parts:
                    log(f"{step}: start-up")
                    results["startup"] += startups(args, backend, repeat, urls)
    return results


def _brief(row: dict[str, Any]) -> str:
    return json.dumps({k: v for k, v in row.items() if k != "problems"}, default=str)[:300]


# -- report -------------------------------------------------------------------------------


def _f(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _spread(values: Sequence[float], digits: int = 3) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return common.fmt(common.spread(values), digits)


def report(results: dict[str, Any], args: argparse.Namespace) -> str:
    lines: list[str] = []
    if results["propagation"]:
        lines += [
            f"Propagation: {args.instances} instances, {args.changes} changes, one every "
            f"{args.gap:g} s on average; delay = the instance's log line of a version at "
            "least the change's, minus the change's commit time (s).",
            "",
        ]
        rows = []
        pooled: dict[str, list[float]] = {}
        for r in results["propagation"]:
            if "error" in r:
                rows.append([r["backend"], r["repeat"] + 1, "error: " + r["error"][:120]])
                continue
            a = r["all"]
            pooled.setdefault(r["backend"], []).extend(
                v for i in r["instances"] for v in i["delays_s"]
            )
            rows.append(_delay_row(r["backend"], str(r["repeat"] + 1), a, r))
        for backend, values in pooled.items():
            rows.append(_delay_row(backend, "all", delay_stats(values), None))
        headers = ["backend", "repeat", "delays", "applied", "median (s)", "p99 (s)"]
        headers += ["max (s)", "within 1 s", "load 1 min", "warnings"]
        lines += [common.table(headers, rows), "", *_late(results["propagation"]), ""]
    if results["idle"]:
        lines += [
            f"Idle: beats side by side over {args.seconds:g} s, CPU seconds per minute "
            "(median (min-max) over repeats), RSS at the end.",
            "",
        ]
        lines += [_grouped(results["idle"], "cpu_per_min_s", "idle CPU s / min"), ""]
    if results["startup"]:
        lines += [
            "Start-up: launch to the first `beat: Waking up` line; set-up = from "
            "`beat: Starting...` to it; CPU and RSS of the process at that line.",
            "",
        ]
        lines += [_grouped(results["startup"], "startup_s", "launch to first wake-up (s)"), ""]
    found = [p for part in PARTS for r in results[part] for p in r.get("problems", [])]
    lines.append(f"Beat log lines at WARNING or above: {len(found)}")
    lines += [f"- {p[:300]}" for p in sorted(set(found))[:10]]
    return "\n".join(lines)


def _late(runs: Sequence[dict[str, Any]]) -> list[str]:
    """The mix of changes, how long applying a batch took at most, and
    every change an instance applied later than 1 s (or never)."""
    out = []
    for r in runs:
        if "error" in r:
            continue
        late = []
        for i in r["instances"]:
            for (op, name, version, _), delay in zip(r["changes"], i["delays_s"], strict=True):
                if not delay <= 1.0:
                    late.append(f"{i['instance']} {op} {name} v{version}: {delay:.3f} s")
        apply_max = max((i["apply_s_max"] or 0.0) for i in r["instances"])
        mix = ", ".join(f"{op} {n}" for op, n in r["ops"].items())
        out.append(
            f"- {r['backend']}, repeat {r['repeat'] + 1}: {mix}; applying a batch took at "
            f"most {apply_max * 1000:.0f} ms; later than 1 s or never: {len(late)}"
            + (f" ({'; '.join(late[:10])})" if late else "")
        )
    return out


def _delay_row(backend: str, repeat: str, a: dict[str, Any], r: dict[str, Any] | None) -> list:
    load = "-" if r is None else f"{r['load_before'][0]:.2f}"
    warnings = "-" if r is None else str(len(r["problems"]))
    return [
        backend,
        repeat,
        f"{a['count']:,}",
        f"{a['applied']:,}",
        _f(a["median"]),
        _f(a["p99"]),
        _f(a["max"]),
        "-" if a["within_1s"] is None else f"{a['within_1s']:.1%}",
        load,
        warnings,
    ]


def _grouped(rows: Sequence[dict[str, Any]], key: str, label: str) -> str:
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for row in rows:
        if "error" not in row:
            groups.setdefault((row["backend"], row["code"], row["stored"]), []).append(row)
    out = []
    for (backend, code, stored), runs in groups.items():
        base = groups.get((backend, "after", 0))
        ratio = "-"
        if base and (code, stored) != ("after", 0) and _median(base, key) > 0:
            ratio = f"{_median(runs, key) / _median(base, key):.2f}"
        digits = 4 if key == "cpu_per_min_s" else 3
        cells = [backend, code, f"{stored:,}", _spread([r[key] for r in runs], digits), ratio]
        if key == "startup_s":
            cells.append(_spread([r["setup_s"] for r in runs if r.get("setup_s") is not None]))
            cells.append(_spread([r["cpu_s"] for r in runs], 2))
        cells.append(_spread([r["rss_mib"] for r in runs], 0))
        cells.append(_spread([r["load_before"][0] for r in runs], 2))
        cells.append(str(sum(len(r.get("problems", [])) for r in runs)))
        out.append(cells)
    headers = ["backend", "code", "stored jobs", label, "/ after, 0 stored"]
    if key == "startup_s":
        headers += ["set-up (s)", "CPU (s)"]
    headers += ["RSS (MiB)", "load 1 min", "warnings"]
    return common.table(headers, out)


def _median(runs: Sequence[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.runtime", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--changes", type=int, default=200, help="changes in propagation")
    parser.add_argument("--gap", type=float, default=0.3, help="mean seconds between changes")
    parser.add_argument("--instances", type=int, default=3, help="beats in propagation")
    parser.add_argument("--backend", default="redis", help="redis, postgresql, mysql (a list)")
    parser.add_argument("--stored", type=int, default=1000, help="stored jobs of the idle beat")
    parser.add_argument("--seconds", type=float, default=60.0, help="idle window, seconds")
    parser.add_argument("--startup-sizes", default="0,1000,10000", help="stored jobs, a list")
    parser.add_argument(
        "--startup-repeats", type=int, default=3, help="start-ups of each size per repeat"
    )
    parser.add_argument(
        "--before", type=Path, help="a checkout before stored jobs, with its own .venv"
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--parts", default=",".join(PARTS), help="a list of " + ", ".join(PARTS))
    parser.add_argument("--seed", type=int, default=1, help="of the changes drawn")
    parser.add_argument("--tiny", action="store_true", help="a few seconds, for the test suite")
    parser.add_argument("--json", help="write raw results to this file")
    args = parser.parse_args(argv)
    if args.tiny:
        args.changes, args.gap, args.instances, args.stored = 8, 0.2, 2, 20
        args.seconds, args.startup_sizes, args.repeats = 2.0, "0,20", 1
        args.startup_repeats = 1
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown part(s) {', '.join(sorted(unknown))}: use {', '.join(PARTS)}")
    args.sizes_ = [int(s) for s in args.startup_sizes.split(",") if s.strip()]
    if args.before is not None:
        args.before = args.before.resolve()
        if not (args.before / "bench" / "bench_app.py").exists():
            parser.error(f"--before {args.before}: not a checkout of this project")
    args.backends = []
    for backend in (b.strip() for b in args.backend.split(",") if b.strip()):
        if backend not in ("redis", "postgresql", "mysql"):
            parser.error(f"--backend {backend}: use redis, postgresql or mysql")
        if common.service_up(common.BACKEND_SERVICE[backend]):
            args.backends.append(backend)
        else:
            log(f"{backend} is not running on 127.0.0.1: skipped")
    if not common.service_up("redis"):
        log("the runtime benchmark needs Redis on 127.0.0.1:6379 (Celery's broker)")
        return 2
    common.exit_on_sigterm()
    _START[0] = time.time()
    print(common.header("Runtime schedules"))
    broker = redis.Redis.from_url(common.BROKER_URL)
    try:
        results = run(args)
    finally:
        clean_broker(broker, f"bench-{common.RUN_ID}-runtime")
        broker.close()
    results["args"] = {k: str(v) for k, v in vars(args).items()}
    print(report(results, args))
    common.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
