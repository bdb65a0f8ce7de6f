"""Steady state: jobs every ``--period`` seconds for many rounds, N
celery-anarchon instances, a real Redis broker; every message attributed to
its slot by its headers.

    python -m bench.steady [--jobs 10000] [--period 20] [--instances 3]
        [--backend redis] [--jitter 2] [--max-late 60] [--warmup 10]
        [--rounds 15] [--send-wait 45] [--repeats 1] [--json PATH]

The instances run ``celery -A bench.bench_app beat`` (as ``bench.burst``),
``--jobs`` jobs every ``--period`` seconds, all due at the same instants.
A reader thread drains the broker queue continuously (``RPOP`` of up to 1,000
messages, every 5 ms while it is empty) and stamps each message with the time
it was read: **a message's lateness is that time minus its own slot**, the
slot read from its ``anarchon_slot`` header (with ``anarchon_job``), never
from its position in the queue. The reading time is at most one poll (5 ms
plus the read) after the message reached the broker, later when the reader
waits for a core: lateness is over-, never under-estimated.

Rounds, by slot:

* start-up backlog: slots at or before the moment the last instance finished
  set-up (due at start-up: with ``max_late`` 60 s and a 20 s period, three
  rounds; none when ``max_late + 10 < period``, since the instances are then
  launched just after a slot's ``max_late`` has passed);
* ``--warmup`` rounds: the first slots after set-up, reported, not counted;
* ``--rounds`` measured rounds.

The instances run until the last measured slot plus ``--send-wait`` seconds
(45 s: longer than the 30 s lease, so a backup's take-over of an unsent slot
shows as a duplicate), and at least ``max_late + jitter + 5`` s (so every
slot of the last measured round is sent or recorded missed before the stop),
then are stopped; the queue is drained to the end.
Per round: slots due, sent once, sent twice or more, never sent (and what the
backend's history says of those: ``missed``, ``skipped``, ``lost``, no
record, ...), lateness p50/p90/p99/max of every message, how many later than
2 s and than a period, when the round was complete, CPU seconds of the beat
processes between this slot and the next, the 1-minute load average at the
slot. The backend's history of every job is read back at the end: each slot
the queue got once must have exactly one ``sent`` record.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

from . import common
from .arrivals import Reader
from .burst import Config, Run, claim_backend, clean_broker, sent_by_instance, wait_for_launch
from .common import log


def parse(reader: Reader) -> list[tuple[str, int, float]]:
    """``(anarchon_job, anarchon_slot ms, read time)`` of every message
    ``reader`` read; messages without those headers get job ``""`` and slot 0."""
    return [
        (str(h.get("anarchon_job") or ""), int(h.get("anarchon_slot") or 0), at)
        for at, h in reader.messages()
    ]


def attribute(
    messages: Sequence[tuple[str, int, float]],
    jobs: Sequence[str],
    slots_ms: Sequence[int],
    period: float,
) -> list[dict[str, Any]]:
    """Per slot of ``slots_ms``: how many of ``jobs`` were sent once, twice
    or more, never, and the lateness of every message of that slot (read
    time minus the slot from its header)."""
    wanted = set(jobs)
    by_slot: dict[int, list[tuple[str, float]]] = defaultdict(list)
    for job, slot_ms, at in messages:
        by_slot[slot_ms].append((job, at))
    rows = []
    for slot_ms in slots_ms:
        slot = slot_ms / 1000
        got = [(job, at) for job, at in by_slot.get(slot_ms, []) if job in wanted]
        per_job = Counter(job for job, _ in got)
        late = sorted(at - slot for _, at in got)
        first = {}
        for job, at in sorted(got, key=lambda x: x[1]):
            first.setdefault(job, at)
        complete = len(per_job) == len(wanted)
        rows.append(
            {
                "slot_ms": slot_ms,
                "due": len(wanted),
                "messages": len(got),
                "once": sum(1 for n in per_job.values() if n == 1),
                "twice_or_more": sum(1 for n in per_job.values() if n > 1),
                "extra_messages": sum(n - 1 for n in per_job.values() if n > 1),
                "never": len(wanted) - len(per_job),
                "never_jobs": sorted(wanted - set(per_job)),
                "duplicate_jobs": sorted(j for j, n in per_job.items() if n > 1),
                **common.lateness_stats(late),
                "over_period": sum(1 for x in late if x > period),
                "done": (max(first.values()) - slot) if complete else None,
                "late": late,
            }
        )
    return rows


def history_states(
    backend_url: str, jobs: Sequence[str], slots_ms: Sequence[int], limit: int
) -> dict[int, dict[str, str]]:
    """``slot -> {job: state}`` of the backend's current record of each job
    for each of ``slots_ms`` (a job with no record for a slot is left out):
    one history read per job."""
    from celery_anarchon.backends import backend_from_url

    out: dict[int, dict[str, str]] = {s: {} for s in slots_ms}
    backend = backend_from_url(backend_url, instance="bench-steady-reader")
    try:
        for job in jobs:
            for record in backend.history(job, limit=limit):
                # newest first; for one slot, the current record first
                found = out.get(record.slot_ms)
                if found is not None and job not in found:
                    found[job] = record.state.value
    finally:
        close = getattr(backend, "close", None)
        if close is not None:
            close()
    return out


def check_history(row: dict[str, Any], states: dict[str, str], jobs: Sequence[str]) -> None:
    """Adds to ``row``: the states of every job's record for its slot
    (``history``), of the jobs never sent (``history_never``), and how many
    slots the queue got exactly once without a ``sent`` record, or with one
    but not in the queue (``history_mismatch``)."""
    never = set(row["never_jobs"])
    row["history"] = dict(Counter(states.get(job, "none") for job in jobs))
    row["history_never"] = dict(Counter(states.get(job, "none") for job in never))
    sent_like = {"sent", "running", "succeeded", "failed"}
    row["history_mismatch"] = sum(
        1 for job in jobs if (states.get(job) in sent_like) == (job in never)
    )


def measure(args: argparse.Namespace, index: int) -> dict[str, Any]:
    from .bench_app import job_name

    cfg = Config("anarchon", args.backend, args.instances, args.jitter)
    period, jobs = args.period, args.jobs
    names = [job_name(i) for i in range(jobs)]
    tag = f"{common.RUN_ID}-s{index}"
    folder = Path(tempfile.mkdtemp(prefix="anarchon-bench-steady-"))
    broker = redis.Redis.from_url(common.BROKER_URL)
    run = Run(cfg, jobs, period, folder, f"bench-{tag}", broker)
    clean = args.max_late + 10 < period
    result: dict[str, Any] = {
        "config": cfg.label,
        "jobs": jobs,
        "period": period,
        "max_late": args.max_late,
        "jitter": args.jitter,
        "start": "clean" if clean else "with backlog",
        "load_before": os.getloadavg(),
    }
    reader: Reader | None = None
    try:
        with claim_backend(cfg, tag) as backend_url:
            assert backend_url is not None
            wait_for_launch(period, args.max_late)
            reader = Reader(common.BROKER_URL, run.queue)
            reader.start()
            run.start(backend_url, 0.0, tag, argparse.Namespace(rounds=1, max_late=args.max_late))
            startup = run.wait_ready(timeout=120 + jobs / 100)
            ready = run.launched + startup
            result["startup_s"] = startup
            first = math.floor(ready / period) * period + period
            # slots planned at start-up: the first after ``now - max_late``
            backlog: list[float] = []
            slot = first - period
            while slot >= run.launched - args.max_late:
                backlog.insert(0, slot)
                slot -= period
            rounds = [first + k * period for k in range(args.warmup + args.rounds)]
            last = rounds[-1]
            # until every slot of the last measured round was sent or is past
            # max_late (claims close at max_late + jitter), and --send-wait
            stop_at = last + max(args.send_wait, period, args.max_late + args.jitter + 5)
            # CPU of the beats and the 1-minute load at each slot, until the stop
            cpu_at: list[tuple[float, float, float]] = [(ready, sum(run.cpu()), 0.0)]
            for slot in [*rounds, last + period, stop_at]:
                time.sleep(max(0.0, slot - time.time()))
                cpu_at.append((slot, sum(run.cpu()), os.getloadavg()[0]))
                if reader.error is not None:
                    raise reader.error
                for proc in run.procs:
                    if proc.poll() is not None:
                        raise RuntimeError(f"a beat exited:\n{run.logs()}")
            run.stop()
            reader.finish()
            result["load_after"] = os.getloadavg()
            messages = parse(reader)
            result["messages_total"] = len(messages)
            slots_ms = [int(round(s * 1000)) for s in [*backlog, *rounds]]
            rows = attribute(messages, names, slots_ms, period)
            known = set(slots_ms)
            result["other_messages"] = sum(1 for _, s, _ in messages if s not in known)
            started = time.monotonic()
            limit = len(slots_ms) + int((stop_at - last) / period) + 5
            states = history_states(backend_url, names, slots_ms, limit=limit)
            result["history_read_s"] = time.monotonic() - started
            cpu_by_slot = {at: (cpu, load) for at, cpu, load in cpu_at}
            for i, row in enumerate(rows):
                slot = row["slot_ms"] / 1000
                row["phase"] = (
                    "backlog"
                    if i < len(backlog)
                    else "warm-up"
                    if i < len(backlog) + args.warmup
                    else "measured"
                )
                check_history(row, states[row["slot_ms"]], names)
                if slot in cpu_by_slot and slot + period in cpu_by_slot:
                    row["cpu_s"] = cpu_by_slot[slot + period][0] - cpu_by_slot[slot][0]
                    row["load1"] = cpu_by_slot[slot][1]
            # a start-up slot past max_late before the instances planned it
            # (set-up began after launch) was never theirs: left out
            rows = [
                r
                for r in rows
                if not (r["phase"] == "backlog" and r["history"] == {"none": r["due"]})
                or r["messages"]
            ]
            measured = [r for r in rows if r["phase"] == "measured"]
            first_m = measured[0]["slot_ms"] / 1000
            end_m = measured[-1]["slot_ms"] / 1000 + period
            result["cpu_measured_s"] = cpu_by_slot[end_m][0] - cpu_by_slot[first_m][0]
            result["cpu_setup_s"] = cpu_at[0][1]
            result["cpu_setup_to_round_1_s"] = cpu_by_slot[first][0] - cpu_at[0][1]
            result["totals"] = totals(measured, period)
            result["rounds"] = [
                {
                    **{k: v for k, v in r.items() if k != "late"},
                    "never_jobs": r["never_jobs"][:20],
                    "duplicate_jobs": r["duplicate_jobs"][:20],
                }
                for r in rows
            ]
            result["sent_by_instance"] = sent_by_instance(folder, first_m, period, len(measured))
            return result
    except Exception as exc:  # reported; the other repeats go on
        result["error"] = f"{type(exc).__name__}: {exc}"
        log(f"steady: {result['error'][:2000]}")
        return result
    finally:
        run.stop()
        if reader is not None and reader.is_alive():
            reader.halt.set()
        clean_broker(broker, run.queue)
        broker.close()
        if args.keep_logs:
            log(f"logs kept in {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)


def totals(rows: Sequence[dict[str, Any]], period: float) -> dict[str, Any]:
    """Sums over ``rows``, lateness percentiles over all their messages."""
    late = sorted(x for r in rows for x in r["late"])
    sent_states = Counter()
    for r in rows:
        sent_states.update(r["history"])
    return {
        "rounds": len(rows),
        "due": sum(r["due"] for r in rows),
        "messages": len(late),
        "once": sum(r["once"] for r in rows),
        "twice_or_more": sum(r["twice_or_more"] for r in rows),
        "extra_messages": sum(r["extra_messages"] for r in rows),
        "never": sum(r["never"] for r in rows),
        "exactly_once": all(r["once"] == r["due"] for r in rows),
        **common.lateness_stats(late),
        "over_period": sum(1 for x in late if x > period),
        "done_max": max((r["done"] for r in rows if r["done"] is not None), default=None),
        "done_median": (
            common.percentile([r["done"] for r in rows if r["done"] is not None], 50)
            if any(r["done"] is not None for r in rows)
            else None
        ),
        "history": dict(sent_states),
        "history_mismatch": sum(r["history_mismatch"] for r in rows),
    }


# -- report ------------------------------------------------------------------------


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _counts(found: dict[str, int]) -> str:
    return ", ".join(f"{k} {v:,}" for k, v in sorted(found.items())) or "-"


def run_table(result: dict[str, Any]) -> str:
    start = result["rounds"][0]["slot_ms"] / 1000 if result["rounds"] else 0.0
    rows = []
    for r in result["rounds"]:
        rows.append(
            [
                r["phase"],
                f"{r['slot_ms'] / 1000 - start:+.0f}",
                f"{r['due']:,}",
                f"{r['once']:,}",
                f"{r['twice_or_more']:,}",
                f"{r['never']:,}" + (f" ({_counts(r['history_never'])})" if r["never"] else ""),
                _f(r["p50"]),
                _f(r["p90"]),
                _f(r["p99"]),
                _f(r["max"]),
                f"{r['over_2s']:,}",
                _f(r["done"]),
                _f(r.get("cpu_s"), 1),
                _f(r.get("load1")),
            ]
        )
    t = result["totals"]
    rows.append(
        [
            f"**{t['rounds']} measured**",
            "",
            f"{t['due']:,}",
            f"{t['once']:,}",
            f"{t['twice_or_more']:,}",
            f"{t['never']:,}",
            _f(t["p50"]),
            _f(t["p90"]),
            _f(t["p99"]),
            _f(t["max"]),
            f"{t['over_2s']:,}",
            f"max {_f(t['done_max'])}",
            _f(result["cpu_measured_s"], 1),
            "",
        ]
    )
    headers = [
        "round",
        "slot (s)",
        "due",
        "sent once",
        "sent 2+ times",
        "never sent (history)",
        "p50 (s)",
        "p90 (s)",
        "p99 (s)",
        "max (s)",
        "> 2 s",
        "done (s)",
        "CPU s",
        "load 1 min",
    ]
    return common.table(headers, rows)


def report(results: Sequence[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"Steady state: {args.jobs:,} jobs every {args.period:g} s, {args.instances} "
        f"instances on {args.backend}, jitter {args.jitter:g} s, max_late "
        f"{args.max_late:g} s, {args.warmup} warm-up round(s), {args.rounds} measured; "
        "lateness = read from the broker queue minus the message's own slot.",
    ]
    good = [r for r in results if "totals" in r]
    for n, r in enumerate(results):
        lines += ["", f"Repeat {n + 1} ({r.get('start', '?')} start)"]
        if "error" in r:
            lines.append(f"error: {r['error'][:300]}")
            continue
        t = r["totals"]
        lines += [
            f"set-up {r['startup_s']:.1f} s; load average before {_load(r['load_before'])}, "
            f"after {_load(r['load_after'])}; CPU of the beats during set-up "
            f"{r['cpu_setup_s']:.1f} s, from then to the first round's slot "
            f"{r['cpu_setup_to_round_1_s']:.1f} s; sent by instance over the measured rounds "
            f"{r['sent_by_instance']}; messages of other slots {r['other_messages']}; "
            f"backend history of the measured slots: {_counts(t['history'])} "
            f"({t['history_mismatch']} disagree with the queue); "
            f"**every measured slot exactly once: {'yes' if t['exactly_once'] else 'NO'}**",
            "",
            run_table(r),
        ]
    if len(good) > 1:
        lines += ["", "Across repeats, measured rounds: median (min-max)", ""]
        figures = [
            ("lateness p50 (s)", lambda r: r["totals"]["p50"]),
            ("lateness p90 (s)", lambda r: r["totals"]["p90"]),
            ("lateness p99 (s)", lambda r: r["totals"]["p99"]),
            ("lateness max (s)", lambda r: r["totals"]["max"]),
            ("messages later than 2 s", lambda r: r["totals"]["over_2s"]),
            ("round done, median of rounds (s)", lambda r: r["totals"]["done_median"]),
            ("CPU s per round", lambda r: r["cpu_measured_s"] / r["totals"]["rounds"]),
            ("sent twice or more", lambda r: r["totals"]["twice_or_more"]),
            ("never sent", lambda r: r["totals"]["never"]),
        ]
        rows = []
        for name, get in figures:
            values = [get(r) for r in good if get(r) is not None]
            rows.append([name, common.fmt(common.spread(values), 2) if values else "-"])
        lines.append(common.table(["figure", "value"], rows))
    return "\n".join(lines)


def _load(values: Sequence[float]) -> str:
    return " / ".join(f"{v:.2f}" for v in values)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.steady", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--period", type=float, default=20.0, help="seconds")
    parser.add_argument("--instances", type=int, default=3)
    parser.add_argument("--backend", default="redis", help="claim backend (bench.burst names)")
    parser.add_argument("--jitter", type=float, default=2.0, help="anarchon_jitter, seconds")
    parser.add_argument(
        "--max-late",
        type=float,
        default=60.0,
        help="anarchon_max_late, seconds; below period - 10: nothing due at start-up",
    )
    parser.add_argument("--warmup", type=int, default=10, help="rounds after set-up not counted")
    parser.add_argument("--rounds", type=int, default=15, help="measured rounds")
    parser.add_argument(
        "--send-wait", type=float, default=45.0, help="seconds run after the last measured slot"
    )
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--keep-logs", action="store_true")
    parser.add_argument("--json", help="write raw results to this file")
    args = parser.parse_args(argv)
    common.exit_on_sigterm()
    if not common.service_up("redis"):
        log("the steady-state benchmark needs Redis on 127.0.0.1:6379 (the broker)")
        return 2
    print(common.header("Steady state"))
    results = []
    for repeat in range(args.repeats):
        log(f"repeat {repeat + 1}/{args.repeats}")
        result = measure(args, repeat)
        result["repeat"] = repeat
        results.append(result)
        if "totals" in result:
            brief = {k: v for k, v in result["totals"].items() if k != "history"}
            log(f"  {json.dumps(brief, default=str)[:600]}")
    print(report(results, args))
    common.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
