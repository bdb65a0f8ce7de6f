"""Stored jobs at scale: one instance holding 100,000 stored jobs against
one holding 1,000, and three instances under 1,000 updates a second.

    python -m bench.stored_scale [--sizes 1000,100000] [--seconds 60]
        [--startup-repeats 3] [--probes 10]
        [--storm-jobs 1000] [--firing 50] [--rate 1000] [--storm-seconds 10]
        [--writers 4] [--instances 3] [--settle 3]
        [--backend redis[,postgresql]] [--parts size,storm] [--seed 1]
        [--tiny] [--json PATH]

The beats are those of :mod:`bench.runtime` (real ``celery -A
bench.bench_app beat -S celery_anarchon.Scheduler`` processes, one hourly
code job, log lines stamped with the record's epoch time, the clock every
delay is computed with; on one host the backend's commit clock is the same
clock). Stored jobs are stored before the beats start through the store's
batched write, ``write_stored_many``, 1,000 records per atomic step (the
write ``Schedules.add`` ends with, without its per-job validation and
round trips): ``Schedules.add`` one job at a time would take 80 s (Redis)
to 18 minutes (PostgreSQL) for 100,000.

* **size** (per backend): two backends, one holding the smaller and one
  the larger size of ``--sizes`` of hourly stored jobs, anchored half an
  hour after the run started (none falls due during the run):

  - *start-up*, ``--startup-repeats`` times, the sizes in turn: one beat
    logging at DEBUG, from launching the process to its first ``beat:
    Waking up`` line, of which set-up from ``beat: Starting...``; its CPU
    seconds and RSS at that line (:func:`bench.runtime.startup`);
  - *idle*: one beat of each size at INFO, side by side, CPU seconds of
    each over ``--seconds`` after a 5 s settle, scaled to a minute, and RSS
    at the end;
  - *one change*: then, with both still running, ``--probes`` rounds of
    one ``Schedules.update`` (a new hourly interval) on each backend in
    turn, each waited for until its beat logged it, 0.2 to 0.8 s apart (so
    commits fall at random points of the 0.5 s poll). Per change: its
    *delay*, the beat's ``applied stored-jobs version N`` line minus the
    commit time, and its *apply time*, the beat's own: that line's record
    time minus the instant the line names as its start (its commit time
    plus ``s ago``, read after the records were read, before applying;
    whole milliseconds, floored, so the apply time is over-estimated by
    less than 1 ms). And the *read*: the same call the beat makes for it
    (``stored_changes(N - 1)``) timed from the benchmark, five times,
    the median.

* **storm** (per backend): ``--instances`` beats on a backend holding
  ``--storm-jobs`` stored jobs: the first ``--firing`` every 1 s (slots on
  whole seconds, anchored on the epoch), the others hourly. Then
  ``--writers`` processes, each with its own connection and its share of
  the jobs (job ``i`` to writer ``i mod writers``), commit ``--rate``
  updates a second between them for ``--storm-seconds``, each at its
  planned instant (a writer behind its plan writes at once, and stops at
  the end: the achieved rate is what committed). Each update is one
  atomic ``write_stored(JOB, name, body, exists=True)``, the write
  ``Schedules.update`` ends with (its validation, the read of the record
  and of the clock, left out: on two cores it would cap the writer, not
  load the beats), and switches its job between two intervals: 1 s and
  2 s (the firing jobs), 1 h and 1.5 h (the others). Each write's version
  and commit time are what the backend answered.

  - *delay*, per instance: for each update, the time of the instance's
    first ``applied stored-jobs version N`` line with N at least the
    update's version, minus its commit time; median, p99, max, share
    within 1 s;
  - *convergence*: ``--settle`` seconds after the last write, each
    instance's newest applied version must equal the store's version,
    and no instance may have logged a line at WARNING or above;
  - *stale and duplicate sends*: a reader drains the broker queue
    throughout (:class:`bench.arrivals.Reader`); each message of a firing
    job is counted per ``(job, slot)`` from its headers. A definition
    holds its slots from its commit plus 1 s until the next one's commit
    plus 1 s (``APPLY_DELAY_MS``), so each sent slot is checked against the
    definition that held at it: a slot that is not one of its slots is
    **stale** (a 1 s slot on an odd second while the 2 s definition held,
    sent by an instance that applied the change more than 1 s late, or
    too early); a slot sent twice or more is a **duplicate**. Each slot
    the holding definition had from the first write to 3 s before the
    beats stop (the 2 s jitter after which a backup claims, and a second)
    must have been sent: one that was not is **never sent**.

Everything is made under a run-unique prefix and removed at the end, also
on SIGTERM; the beats and writers are stopped.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import multiprocessing
import os
import random
import shutil
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import redis

from . import common, runtime
from .arrivals import Reader
from .burst import Config, claim_backend, clean_broker
from .common import log
from .runtime import Beat, applied_at, delay_stats, loaded, problems, running, wait_ready

PARTS = ("size", "storm")

#: Records per atomic write when storing the jobs before a run.
CHUNK = 1000
#: The intervals an update of a firing job switches between, seconds.
FIRING_INTERVALS = (1.0, 2.0)
#: The intervals an update of an hourly job switches between, seconds (on
#: the run's anchor: no slot within half an hour of the start).
HOURLY_INTERVALS = (runtime.PERIOD, 1.5 * runtime.PERIOD)
#: A definition holds from this long after its commit, milliseconds.
APPLY_DELAY_MS = 1000
#: Slots due in the last this many seconds before the beats stop are not
#: required to have been sent (the default jitter, 2 s, plus a second).
WINDOW_MARGIN_S = 3.0


# -- the store -----------------------------------------------------------------------


def open_store(url: str) -> Any:
    """The backend at ``url``, opened (schema made), as the benchmark's client."""
    from celery_anarchon.backends import backend_from_url
    from celery_anarchon.beat.registry import new_instance_id

    backend = backend_from_url(url, instance=new_instance_id())
    backend.open()
    return backend


def body(name: str, interval: float) -> str:
    """The stored body of job ``name`` every ``interval`` seconds: on the
    epoch (whole seconds) below an hour, on the run's anchor from an hour."""
    from celery_anarchon.stored import Definition

    anarchon = {"anchor": runtime.anchor_s()} if interval >= runtime.PERIOD else None
    return Definition.build(name, runtime.TASK, interval, anarchon=anarchon).body()


def store_jobs(url: str, jobs: Sequence[tuple[str, str]]) -> tuple[float, list[Any]]:
    """Store ``(name, body)`` jobs, :data:`CHUNK` records per atomic write.

    Returns:
        the seconds the writes took, and the records written.
    Raises:
        RuntimeError: a name was taken (nothing of that chunk written).
    """
    from celery_anarchon.backends.store import JOB, StoredWrite

    backend = open_store(url)
    try:
        records: list[Any] = []
        started = time.perf_counter()
        for i in range(0, len(jobs), CHUNK):
            writes = [StoredWrite(JOB, n, b, exists=False) for n, b in jobs[i : i + CHUNK]]
            written = backend.write_stored_many(writes)
            if written is None:
                raise RuntimeError(f"a name of {jobs[i][0]}.. was taken")
            records += written
        return time.perf_counter() - started, records
    finally:
        backend.close()


def wait_applied(beat: Beat, version: int, timeout: float) -> list[tuple[int, float, float]]:
    """The beat's applied batches once one reached ``version``.

    Raises:
        RuntimeError: the beat exited, or did not get there within ``timeout`` s.
    """
    deadline = time.monotonic() + timeout
    while True:
        batches = applied_at(beat)
        if batches and max(v for v, *_ in batches) >= version:
            return batches
        beat.check_alive()
        if time.monotonic() > deadline:
            raise RuntimeError(f"{beat.name}: version {version} not applied in {timeout:g} s")
        time.sleep(0.02)


# -- size: 1,000 against 100,000 stored jobs -----------------------------------------


@contextmanager
def sized_backends(args: argparse.Namespace, backend: str) -> Iterator[dict[int, dict[str, Any]]]:
    """A backend per size of ``--sizes``, that many hourly stored jobs in
    place: ``{size: {"url", "store_s"}}``; removed afterwards."""
    with ExitStack() as stack:
        out: dict[int, dict[str, Any]] = {}
        for size in args.sizes_:
            tag = f"{common.RUN_ID}-z{size}{backend[:2]}"
            url = stack.enter_context(claim_backend(Config("anarchon", backend), tag))
            assert url is not None
            hourly = body("stored-000000", runtime.PERIOD)  # a body names no job: one for all
            store_s, _ = store_jobs(url, [(f"stored-{i:06d}", hourly) for i in range(size)])
            log(f"{backend}: {size:,} stored jobs stored in {store_s:.1f} s")
            out[size] = {"url": url, "store_s": store_s}
        yield out


def size_part(args: argparse.Namespace, backend: str) -> dict[str, Any]:
    """Start-ups, idle CPU and the cost of one change at each size."""
    result: dict[str, Any] = {"backend": backend, "load_before": os.getloadavg()}
    try:
        with sized_backends(args, backend) as stores:
            result["stored"] = {
                str(s): {k: v for k, v in info.items() if k != "url"} for s, info in stores.items()
            }
            rows = []
            for repeat in range(args.startup_repeats):
                for size, info in stores.items():
                    row = runtime.startup(backend, repeat, "after", size, info["url"], common.REPO)
                    log(f"  start-up {size:,}: {_brief(row)}")
                    rows.append(row)
            result["startup"] = rows
            result.update(idle_and_changes(args, backend, stores))
    except Exception as exc:  # reported; the other parts go on
        result["error"] = f"{type(exc).__name__}: {exc}"
        log(f"size: {result['error'][:2000]}")
    result["load_after"] = os.getloadavg()
    return result


def idle_and_changes(
    args: argparse.Namespace, backend: str, stores: dict[int, dict[str, Any]]
) -> dict[str, Any]:
    """One beat per size side by side: an idle window, then the probes."""
    folder = Path(tempfile.mkdtemp(prefix="anarchon-bench-stored-scale-"))
    beats = {size: Beat(f"size-{size}", info["url"], folder) for size, info in stores.items()}
    rng = random.Random(args.seed)
    try:
        with ExitStack() as stack:
            stack.enter_context(running(list(beats.values())))
            wait_ready(list(beats.values()), timeout=600)
            time.sleep(5.0)  # past the first heartbeat
            load = os.getloadavg()
            cpu0 = {s: common.cpu_seconds_exact(b.pid) for s, b in beats.items()}
            time.sleep(args.seconds)
            idle = {}
            for size, beat in beats.items():
                beat.check_alive()
                cpu = common.cpu_seconds_exact(beat.pid) - cpu0[size]
                idle[str(size)] = {
                    "cpu_s": cpu,
                    "window_s": args.seconds,
                    "cpu_per_min_s": cpu * 60 / args.seconds,
                    "rss_mib": common.rss_bytes(beat.pid) / 2**20,
                    "load_before": load,
                    "load_after": os.getloadavg(),
                    "loaded": loaded(beat),
                }
            log(f"  idle: {json.dumps(idle, default=str)[:400]}")
            schedules = {
                s: stack.enter_context(runtime.schedules_for(info["url"]))
                for s, info in stores.items()
            }
            readers = {
                s: stack.enter_context(_closing(open_store(i["url"]))) for s, i in stores.items()
            }
            changes: dict[str, list[dict[str, Any]]] = {str(s): [] for s in stores}
            for k in range(args.probes):
                for size, beat in beats.items():
                    time.sleep(rng.uniform(0.2, 0.8))
                    changes[str(size)].append(
                        probe(schedules[size], readers[size], beat, f"stored-{k:06d}", rng)
                    )
        # after the stops: their lines count too
        return {"idle": idle, "changes": changes, "problems": problems(list(beats.values()))}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def _closing(backend: Any) -> Iterator[Any]:
    try:
        yield backend
    finally:
        backend.close()


def probe(schedules: Any, reader: Any, beat: Beat, name: str, rng: random.Random) -> dict[str, Any]:
    """One update of ``name``, its delay and apply time on ``beat``, and the
    time of the read the beat makes for it."""
    job = schedules.update(
        name, schedule=rng.choice(runtime.UPDATE_PERIODS), anarchon={"anchor": runtime.anchor_s()}
    )
    batches = wait_applied(beat, job.version, timeout=30)
    version, logged, own = next(b for b in batches if b[0] >= job.version)
    reads = []
    for _ in range(5):
        started = time.perf_counter()
        reader.stored_version()
        reader.stored_changes(job.version - 1)
        reads.append(time.perf_counter() - started)
    return {
        "version": job.version,
        "batch_version": version,
        "delay_s": logged - job.committed_ms / 1000,
        "apply_s": logged - own,
        "read_s": sorted(reads)[len(reads) // 2],
    }


# -- storm: 1,000 updates a second, three instances ------------------------------------


def storm_jobs(args: argparse.Namespace) -> list[tuple[str, tuple[float, float]]]:
    """``(name, (first interval, second interval))`` of every storm job,
    the firing ones first."""
    return [
        (f"storm-{i:06d}", FIRING_INTERVALS if i < args.firing else HOURLY_INTERVALS)
        for i in range(args.storm_jobs)
    ]


def writer(
    url: str,
    index: int,
    writers: int,
    jobs: list[tuple[str, tuple[float, float], tuple[str, str]]],
    rate: float,
    seconds: float,
    start: Any,
    go: Any,
    out: Any,
) -> None:
    """One writer process: its share of ``rate`` updates a second from
    ``start.value`` (epoch seconds, set before ``go``) for ``seconds``,
    each switching its job to the other interval; puts ``("done", index,
    commits, behind_s)`` on ``out``, ``commits`` as ``(name, interval,
    version, committed_ms)``."""
    from celery_anarchon.backends.store import JOB

    try:
        backend = open_store(url)
        out.put(("ready", index))
        go.wait()
        t0, commits, behind, k = start.value, [], 0.0, 0
        now_at = [0] * len(jobs)  # which interval each job has now (the first)
        while jobs:
            planned = t0 + (k * writers + index) / rate
            if planned >= t0 + seconds:
                break
            wait = planned - time.time()
            if wait > 0:
                time.sleep(wait)
            else:
                behind = max(behind, -wait)
            if time.time() >= t0 + seconds:
                break
            i = k % len(jobs)
            name, intervals, bodies = jobs[i]
            now_at[i] = 1 - now_at[i]
            record = backend.write_stored(JOB, name, bodies[now_at[i]], exists=True)
            if record is None:
                raise RuntimeError(f"stored job {name} is gone")
            commits.append((name, intervals[now_at[i]], record.version, record.committed_ms))
            k += 1
        backend.close()
        out.put(("done", index, commits, behind))
    except BaseException as exc:  # reported by the benchmark
        out.put(("error", index, f"{type(exc).__name__}: {exc}"))


def run_writers(
    args: argparse.Namespace, url: str, jobs: list[tuple[str, tuple[float, float]]]
) -> dict[str, Any]:
    """``--writers`` processes committing ``--rate`` updates a second for
    ``--storm-seconds``; returns the commits, oldest first, and the timing."""
    context = multiprocessing.get_context("spawn")
    start, go, out = context.Value("d", 0.0), context.Event(), context.Queue()
    shares: list[list[tuple[str, tuple[float, float], tuple[str, str]]]] = [
        [] for _ in range(args.writers)
    ]
    for i, (name, intervals) in enumerate(jobs):
        bodies = (body(name, intervals[0]), body(name, intervals[1]))
        shares[i % args.writers].append((name, intervals, bodies))
    procs = [
        context.Process(
            target=writer,
            args=(url, w, args.writers, shares[w], args.rate, args.storm_seconds, start, go, out),
            daemon=True,
        )
        for w in range(args.writers)
    ]
    try:
        for proc in procs:
            proc.start()
        for _ in procs:
            _expect(out.get(timeout=120), "ready")
        start.value = time.time() + 0.5
        go.set()
        done = [_expect(out.get(timeout=args.storm_seconds + 120), "done") for _ in procs]
        for proc in procs:
            proc.join(10)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
    commits = sorted((c for d in done for c in d[2]), key=lambda c: c[2])
    return {
        "started": start.value,
        "commits": commits,
        "behind_s": max(d[3] for d in done),
    }


def _expect(message: tuple[Any, ...], what: str) -> tuple[Any, ...]:
    if message[0] == "error":
        raise RuntimeError(f"writer {message[1]}: {message[2]}")
    if message[0] != what:
        raise RuntimeError(f"writer {message[1]}: {message[0]}, expected {what}")
    return message


def change_delays(
    commits: Sequence[Sequence[Any]], batches: Sequence[tuple[int, float, float]]
) -> list[float]:
    """Per commit ``(name, interval, version, committed_ms)``, seconds from
    it to the first batch of a version at least its own (NaN when none came)."""
    versions, times = [], []
    for version, at, _ in batches:
        if not versions or version > versions[-1]:
            versions.append(version)
            times.append(at)
    out = []
    for commit in commits:
        i = bisect.bisect_left(versions, commit[2])
        out.append(times[i] - commit[3] / 1000 if i < len(versions) else float("nan"))
    return out


def definitions(
    initial: dict[str, tuple[int, float]], commits: Sequence[Sequence[Any]]
) -> dict[str, list[tuple[int, float]]]:
    """``{job: [(effective ms, interval s), ...]}``, oldest first: the
    initial definition and every update, each holding from its commit plus
    :data:`APPLY_DELAY_MS` until the next one does."""
    out = {name: [(c + APPLY_DELAY_MS, interval)] for name, (c, interval) in initial.items()}
    for name, interval, _, committed_ms in commits:
        if name in out:
            out[name].append((committed_ms + APPLY_DELAY_MS, interval))
    for held in out.values():
        held.sort()
    return out


def holding(held: Sequence[tuple[int, float]], slot_ms: int) -> float | None:
    """The interval of the definition holding at ``slot_ms`` (None before the first)."""
    i = bisect.bisect_right([at for at, _ in held], slot_ms) - 1
    return held[i][1] if i >= 0 else None


def check_sends(
    messages: Sequence[tuple[str, int, float]],
    held: dict[str, list[tuple[int, float]]],
    window_ms: tuple[int, int],
) -> dict[str, Any]:
    """Each sent ``(job, slot)`` of the jobs of ``held`` against the
    definition holding at its slot (intervals on the epoch): how many were
    sent, stale (not a slot of that definition), sent twice or more, and
    how many slots of the holding definitions within ``window_ms`` were
    never sent."""
    counts = Counter((job, slot) for job, slot, _ in messages if job in held)
    stale = sorted(
        (job, slot)
        for job, slot in counts
        if (interval := holding(held[job], slot)) is None or slot % round(interval * 1000)
    )
    duplicates = sorted(key for key, n in counts.items() if n > 1)
    start, end = window_ms
    due = 0
    never = []
    for job, defs in held.items():
        for slot in range(math.ceil(start / 1000) * 1000, end + 1, 1000):
            interval = holding(defs, slot)
            if interval is not None and slot % round(interval * 1000) == 0:
                due += 1
                if (job, slot) not in counts:
                    never.append((job, slot))
    return {
        "messages": sum(counts.values()),
        "slots_sent": len(counts),
        "stale": len(stale),
        "stale_slots": stale[:20],
        "duplicates": len(duplicates),
        "duplicate_slots": duplicates[:20],
        "due_in_window": due,
        "never_sent": len(never),
        "never_slots": never[:20],
    }


def storm_part(args: argparse.Namespace, backend: str) -> dict[str, Any]:
    """Three beats while the writers commit ``--rate`` updates a second."""
    tag = f"{common.RUN_ID}-w{backend[:2]}"
    folder = Path(tempfile.mkdtemp(prefix="anarchon-bench-stored-scale-"))
    result: dict[str, Any] = {"backend": backend, "load_before": os.getloadavg()}
    reader: Reader | None = None
    broker = redis.Redis.from_url(common.BROKER_URL)
    queue = f"bench-{common.RUN_ID}-runtime"
    try:
        with ExitStack() as stack:
            url = stack.enter_context(claim_backend(Config("anarchon", backend), tag))
            assert url is not None
            jobs = storm_jobs(args)
            _, records = store_jobs(url, [(n, body(n, iv[0])) for n, iv in jobs])
            firing = {n: iv for n, iv in jobs[: args.firing]}
            initial = {
                r.name: (r.committed_ms, firing[r.name][0]) for r in records if r.name in firing
            }
            clean_broker(broker, queue)
            reader = Reader(common.BROKER_URL, queue)
            reader.start()
            beats = [Beat(f"beat-{i + 1}", url, folder) for i in range(args.instances)]
            stack.enter_context(running(beats))
            wait_ready(beats, timeout=120)
            time.sleep(2.0)  # past the first heartbeat: each sees the others
            cpu0 = [common.cpu_seconds_exact(b.pid) for b in beats]
            server0 = common.server_cpu_seconds()
            written = run_writers(args, url, jobs)
            commits = written["commits"]
            last = commits[-1][2] if commits else 0
            time.sleep(args.settle)
            for beat in beats:
                beat.check_alive()
            cpu1 = [common.cpu_seconds_exact(b.pid) for b in beats]
            server1 = common.server_cpu_seconds()
            result["server_cpu_s"] = {k: server1[k] - server0.get(k, 0.0) for k in server1}
            store = stack.enter_context(_closing(open_store(url)))
            result["store_version"] = store.stored_version()
            result["versions_at_settle"] = [
                max((v for v, *_ in applied_at(b)), default=0) for b in beats
            ]
            stopped_at = time.time()
        result["problems"] = problems(beats)  # the stops' lines too
        reader.finish()
        if reader.error is not None:
            raise reader.error
        messages = [
            (str(h.get("anarchon_job") or ""), int(h.get("anarchon_slot") or 0), at)
            for at, h in reader.messages()
        ]
        started = written["started"]
        result["load_after"] = os.getloadavg()
        result["target_rate"] = args.rate
        result["commits"] = len(commits)
        result["write_s"] = args.storm_seconds
        result["achieved_rate"] = len(commits) / args.storm_seconds
        result["writer_behind_s"] = written["behind_s"]
        result["last_version"] = last
        span = (commits[-1][3] - commits[0][3]) / 1000 if len(commits) > 1 else 0.0
        result["commit_span_s"] = span
        per_instance = []
        for beat, c0, c1, at_settle in zip(
            beats, cpu0, cpu1, result["versions_at_settle"], strict=True
        ):
            batches = applied_at(beat)
            values = change_delays(commits, batches)
            storm = [b for b in batches if b[0] > commits[0][2] - 1] if commits else []
            per_instance.append(
                {
                    "instance": beat.name,
                    **delay_stats(values),
                    "batches": len(storm),
                    "apply_s_max": max((at - own for _, at, own in storm), default=None),
                    "cpu_s": c1 - c0,
                    "converged": at_settle == result["store_version"],
                    "delays_s": [round(v, 4) for v in values],
                }
            )
        result["instances"] = per_instance
        result["all"] = delay_stats([v for i in per_instance for v in i["delays_s"]])
        result["converged"] = (
            all(i["converged"] for i in per_instance) and last == result["store_version"]
        )
        held = definitions(initial, commits)
        # to a margin before the stop: a backup claims a slot its first
        # choice left after the jitter (2 s)
        window = (int(started * 1000), int((stopped_at - WINDOW_MARGIN_S) * 1000))
        result["sends"] = check_sends(messages, held, window)
        result["other_messages"] = sum(1 for job, _, _ in messages if job not in held)
        result["commit_log"] = [list(c) for c in commits]
        return result
    except Exception as exc:  # reported; the other parts go on
        result["error"] = f"{type(exc).__name__}: {exc}"
        log(f"storm: {result['error'][:2000]}")
        return result
    finally:
        if reader is not None and reader.is_alive():
            reader.halt.set()
        clean_broker(broker, queue)
        broker.close()
        shutil.rmtree(folder, ignore_errors=True)


# -- report --------------------------------------------------------------------------------


def _brief(row: dict[str, Any]) -> str:
    skip = ("problems", "delays_s", "commit_log")
    return json.dumps({k: v for k, v in row.items() if k not in skip}, default=str)[:300]


def _f(value: float | None, digits: int = 3) -> str:
    return "-" if value is None or value != value else f"{value:.{digits}f}"


def _med(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _ratio(big: float | None, small: float | None) -> str:
    return "-" if big is None or not small else f"{big / small:.2f}"


def size_report(results: Sequence[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    small, large = args.sizes_[0], args.sizes_[-1]
    lines = [
        f"Size: one instance per size, hourly stored jobs. Start-up: {args.startup_repeats} "
        "launch(es) per size at DEBUG, median (min-max), launch to the first `beat: Waking up` "
        "line, set-up from `beat: Starting...` to it, CPU and RSS at it. Idle: one beat per "
        f"size at INFO side by side, CPU over {args.seconds:g} s scaled to a minute, RSS at "
        "the end. Ratios of medians, larger over smaller size.",
        "",
    ]
    startup_rows: list[list[str]] = []
    change_rows: list[list[str]] = []
    for r in results:
        if "error" in r:
            startup_rows.append([r["backend"], "error: " + r["error"][:120]])
            continue
        figures = {size: size_figures(r, size) for size in args.sizes_}
        for size in args.sizes_:
            ups = [u for u in r["startup"] if u["stored"] == size and "error" not in u]
            f = figures[size]
            startup_rows.append(
                [
                    r["backend"],
                    f"{size:,}",
                    _f(f["store_s"], 1),
                    runtime._spread([u["startup_s"] for u in ups], 2),
                    runtime._spread([u["setup_s"] for u in ups if u.get("setup_s") is not None], 2),
                    runtime._spread([u["cpu_s"] for u in ups], 2),
                    runtime._spread([u["rss_mib"] for u in ups], 0),
                    _f(f["idle_cpu_per_min_s"], 4),
                    _f(f["idle_rss_mib"], 0),
                ]
            )
            change_rows.append(
                [
                    r["backend"],
                    f"{size:,}",
                    str(len(r.get("changes", {}).get(str(size), []))),
                    _f(f["delay_median_s"]),
                    _f(f["delay_max_s"]),
                    _f(f["apply_median_ms"], 1),
                    _f(f["apply_max_ms"], 1),
                    _f(f["read_median_ms"], 2),
                ]
            )
        if large != small:
            a, b = figures[large], figures[small]
            label = [r["backend"], f"{large:,} / {small:,}"]
            startup_rows.append([*label, *(_ratio(a[k], b[k]) for k in STARTUP_FIGURES)])
            change_rows.append([*label, "", *(_ratio(a[k], b[k]) for k in CHANGE_FIGURES)])
    lines += [common.table(STARTUP_HEADERS, startup_rows), ""]
    lines += [
        f"One change on a running instance: {args.probes} single updates per size; delay = "
        "the beat's `applied stored-jobs version N` line minus the commit; apply = that "
        "line minus the instant it names as its start (the beat's own timing, whole ms); "
        "read = `stored_changes(N - 1)` and `stored_version()` from the benchmark.",
        "",
        common.table(CHANGE_HEADERS, change_rows),
        "",
    ]
    for r in results:
        if "error" not in r:
            loads = f"{r['load_before'][0]:.2f} / {r['load_after'][0]:.2f}"
            lines.append(
                f"- {r['backend']}: load (1 min) before / after {loads}; beat log lines "
                f"at WARNING or above: {len(r['problems'])}"
            )
            lines += [f"  - {p[:300]}" for p in sorted(set(r["problems"]))[:10]]
    return lines


STARTUP_HEADERS = [
    "backend",
    "stored jobs",
    "stored in (s)",
    "launch to first wake-up (s)",
    "set-up (s)",
    "CPU at wake-up (s)",
    "RSS at wake-up (MiB)",
    "idle CPU (s / min)",
    "RSS after idle (MiB)",
]
#: The figures of the start-up table's ratio row, in its column order.
STARTUP_FIGURES = (
    "store_s",
    "startup_s",
    "setup_s",
    "startup_cpu_s",
    "startup_rss_mib",
    "idle_cpu_per_min_s",
    "idle_rss_mib",
)
CHANGE_HEADERS = [
    "backend",
    "stored jobs",
    "changes",
    "delay, median (s)",
    "delay, max (s)",
    "apply, median (ms)",
    "apply, max (ms)",
    "read, median (ms)",
]
#: The figures of the change table's ratio row, in its column order.
CHANGE_FIGURES = (
    "delay_median_s",
    "delay_max_s",
    "apply_median_ms",
    "apply_max_ms",
    "read_median_ms",
)


def size_figures(r: dict[str, Any], size: int) -> dict[str, float | None]:
    """The medians of one size of a size part's result."""
    ups = [row for row in r["startup"] if row["stored"] == size and "error" not in row]
    idle = r.get("idle", {}).get(str(size), {})
    changes = r.get("changes", {}).get(str(size), [])
    return {
        "store_s": r["stored"][str(size)]["store_s"],
        "startup_s": _med([u["startup_s"] for u in ups]),
        "setup_s": _med([u["setup_s"] for u in ups if u.get("setup_s") is not None]),
        "startup_cpu_s": _med([u["cpu_s"] for u in ups]),
        "startup_rss_mib": _med([u["rss_mib"] for u in ups]),
        "idle_cpu_per_min_s": idle.get("cpu_per_min_s"),
        "idle_rss_mib": idle.get("rss_mib"),
        "delay_median_s": _med([c["delay_s"] for c in changes]),
        "delay_max_s": max((c["delay_s"] for c in changes), default=None),
        "apply_median_ms": _ms(_med([c["apply_s"] for c in changes])),
        "apply_max_ms": _ms(max((c["apply_s"] for c in changes), default=None)),
        "read_median_ms": _ms(_med([c["read_s"] for c in changes])),
    }


def _yes(value: bool | None) -> str:
    return "-" if value is None else "yes" if value else "NO"


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def storm_report(results: Sequence[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    lines = [
        f"Storm: {args.instances} instances, {args.storm_jobs:,} stored jobs ({args.firing} "
        f"every 1 or 2 s), {args.writers} writers aiming at {args.rate:g} updates/s for "
        f"{args.storm_seconds:g} s; delay = the instance's first line of a version at least "
        "the update's, minus its commit time (s).",
        "",
    ]
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["backend"], "error: " + r["error"][:120]])
            continue
        for i in [*r["instances"], {"instance": "all", **r["all"]}]:
            rows.append(
                [
                    r["backend"],
                    i["instance"],
                    f"{i['count']:,}",
                    f"{i['applied']:,}",
                    _f(i["median"]),
                    _f(i["p99"]),
                    _f(i["max"]),
                    "-" if i["within_1s"] is None else f"{i['within_1s']:.1%}",
                    str(i.get("batches", "-")),
                    _f(_ms(i.get("apply_s_max")), 0),
                    _f(i.get("cpu_s"), 2),
                    _yes(i.get("converged")),
                ]
            )
    headers = ["backend", "instance", "updates", "applied", "median (s)", "p99 (s)", "max (s)"]
    headers += ["within 1 s", "batches", "longest apply (ms)", "CPU (s)", "converged"]
    lines += [common.table(headers, rows), ""]
    for r in results:
        if "error" in r:
            continue
        s = r["sends"]
        lines.append(
            f"- {r['backend']}: {r['commits']:,} updates committed in {r['write_s']:g} s, "
            f"**{r['achieved_rate']:,.0f} updates/s** (target {r['target_rate']:g}; a writer "
            f"fell at most {r['writer_behind_s']:.3f} s behind its plan); store version "
            f"{r['store_version']:,}, each instance's newest applied "
            f"{', '.join(f'{v:,}' for v in r['versions_at_settle'])} after {args.settle:g} s: "
            f"**converged: {'yes' if r['converged'] else 'NO'}**; sends of the firing jobs: "
            f"{s['messages']:,} messages, {s['slots_sent']:,} slots checked, "
            f"**{s['stale']} stale, {s['duplicates']} sent twice or more**, "
            f"{s['never_sent']} of {s['due_in_window']:,} due never sent; other messages "
            f"{r['other_messages']}; beat log lines at WARNING or above: {len(r['problems'])}; "
            f"server CPU from the first update to the end of the settle: {_servers(r)}; "
            f"load (1 min) {r['load_before'][0]:.2f} before, {r['load_after'][0]:.2f} after"
        )
        lines += [f"  - {p[:300]}" for p in sorted(set(r["problems"]))[:10]]
    return lines


def _servers(r: dict[str, Any]) -> str:
    """CPU seconds of the backend's server and of Redis (the broker)."""
    names = sorted({"redis", r["backend"]})
    return ", ".join(f"{n} {r['server_cpu_s'].get(n, 0.0):.1f} s" for n in names)


def report(results: dict[str, Any], args: argparse.Namespace) -> str:
    lines: list[str] = []
    if results["size"]:
        lines += size_report(results["size"], args) + [""]
    if results["storm"]:
        lines += storm_report(results["storm"], args)
    return "\n".join(lines)


# -- the run ------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"size": [], "storm": []}
    for backend in args.backends:
        if "size" in args.parts:
            log(f"{backend}: size {', '.join(f'{s:,}' for s in args.sizes_)}")
            results["size"].append(size_part(args, backend))
        if "storm" in args.parts:
            log(f"{backend}: storm of {args.rate:g} updates/s for {args.storm_seconds:g} s")
            found = storm_part(args, backend)
            log(f"  {_brief(found.get('all', found))}")
            results["storm"].append(found)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.stored_scale", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--sizes", default="1000,100000", help="stored jobs, smaller,larger")
    parser.add_argument("--seconds", type=float, default=60.0, help="idle window, seconds")
    parser.add_argument("--startup-repeats", type=int, default=3, help="start-ups per size")
    parser.add_argument("--probes", type=int, default=10, help="single updates per size")
    parser.add_argument("--storm-jobs", type=int, default=1000, help="stored jobs in the storm")
    parser.add_argument("--firing", type=int, default=50, help="of them, every 1 or 2 s")
    parser.add_argument("--rate", type=float, default=1000.0, help="updates per second")
    parser.add_argument("--storm-seconds", type=float, default=10.0, help="seconds of updates")
    parser.add_argument("--writers", type=int, default=4, help="writer processes")
    parser.add_argument("--instances", type=int, default=3, help="beats in the storm")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds after the storm")
    parser.add_argument("--backend", default="redis", help="redis, postgresql, mysql (a list)")
    parser.add_argument("--parts", default=",".join(PARTS), help="a list of " + ", ".join(PARTS))
    parser.add_argument("--seed", type=int, default=1, help="of the probes' intervals and waits")
    parser.add_argument("--tiny", action="store_true", help="a few seconds, for the test suite")
    parser.add_argument("--json", help="write raw results to this file")
    args = parser.parse_args(argv)
    if args.tiny:
        args.sizes, args.seconds, args.startup_repeats, args.probes = "20,200", 2.0, 1, 2
        args.storm_jobs, args.firing, args.rate, args.storm_seconds = 40, 6, 100.0, 3.0
        args.writers, args.instances, args.settle = 2, 2, 2.0
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown part(s) {', '.join(sorted(unknown))}: use {', '.join(PARTS)}")
    args.sizes_ = sorted({int(s) for s in args.sizes.split(",") if s.strip()})
    if not args.sizes_ or args.sizes_[0] < args.probes:
        parser.error("--sizes: give at least as many stored jobs as --probes")
    if args.firing > args.storm_jobs or args.writers < 1 or args.rate <= 0:
        parser.error("--firing at most --storm-jobs, --writers at least 1, --rate above 0")
    args.backends = []
    for backend in (b.strip() for b in args.backend.split(",") if b.strip()):
        if backend not in ("redis", "postgresql", "mysql"):
            parser.error(f"--backend {backend}: use redis, postgresql or mysql")
        if common.service_up(common.BACKEND_SERVICE[backend]):
            args.backends.append(backend)
        else:
            log(f"{backend} is not running on 127.0.0.1: skipped")
    if not common.service_up("redis"):
        log("this benchmark needs Redis on 127.0.0.1:6379 (Celery's broker)")
        return 2
    common.exit_on_sigterm()
    runtime._START[0] = time.time()
    print(common.header("Stored jobs at scale"))
    results = run(args)
    results["args"] = {k: str(v) for k, v in vars(args).items()}
    print(report(results, args))
    common.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
