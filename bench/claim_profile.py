"""Where a claim's time goes against its floor (benchmark 1's gap).

``python -m bench.claim_profile [--backends redis,postgresql,mysql,sqlite]
[--single 300] [--batch 500] [--batches 4] [--profile-top 12]``

For each backend, with :func:`bench.claims.subject` (same backend, same
floor, same prefixes and clean-up as ``bench.claims``):

* wall time and this process's CPU time per operation, ours and the floor,
  single (``--single`` calls) and batched (``--batches`` batches of
  ``--batch`` slots);
* SQL: statements per operation, counted with SQLAlchemy's
  ``before_cursor_execute`` event on the backend's engine and the floor's,
  and commits (``commit`` event);
* a cProfile of the single claims, the functions with the most own time.

Round trips at the socket level are counted from outside with ``strace``:
each phase writes ``anarchon-mark <phase> start`` / ``end`` to ``/dev/null``
(visible in an ``strace -e trace=%network,write`` log), so ``sendto`` and
``recvfrom`` calls can be counted between the marks. Nothing here asserts a
time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

from . import common
from .claims import request, subject

_NULL = os.open(os.devnull, os.O_WRONLY)


def mark(text: str) -> None:
    os.write(_NULL, f"anarchon-mark {text}".encode())


class Counter:
    """Statements and commits on an engine, via SQLAlchemy events."""

    def __init__(self, engine: Any) -> None:
        import sqlalchemy as sa

        self.statements = 0
        self.commits = 0
        self.texts: dict[str, int] = {}
        sa.event.listen(engine, "before_cursor_execute", self._on_execute)
        sa.event.listen(engine, "commit", self._on_commit)

    def _on_execute(self, _conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        self.statements += 1
        head = " ".join(statement.split())[:60]
        self.texts[head] = self.texts.get(head, 0) + 1

    def _on_commit(self, _conn: Any) -> None:
        self.commits += 1

    def reset(self) -> None:
        self.statements = 0
        self.commits = 0
        self.texts = {}


def timed(name: str, calls: int, one: Callable[[int], None]) -> dict[str, float]:
    """Median wall and mean CPU seconds per call of ``one``."""
    walls = []
    mark(f"{name} start")
    cpu0 = time.process_time()
    for i in range(calls):
        started = time.perf_counter()
        one(i)
        walls.append(time.perf_counter() - started)
    cpu = time.process_time() - cpu0
    mark(f"{name} end")
    return {"wall_median": statistics.median(walls), "cpu_mean": cpu / calls, "calls": calls}


def redis_stats(client: Any) -> dict[str, tuple[int, int]]:
    """``command -> (calls, usec)`` from ``INFO commandstats``."""
    out = {}
    for key, value in client.info("commandstats").items():
        out[key.removeprefix("cmdstat_")] = (int(value["calls"]), int(value["usec"]))
    return out


def stats_diff(
    before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]], per: int
) -> str:
    parts = []
    inner = 0.0
    for cmd, (calls, usec) in sorted(after.items()):
        c0, u0 = before.get(cmd, (0, 0))
        if calls - c0 and cmd not in ("info",):
            parts.append(f"{cmd} {(calls - c0) / per:.2f} ({(usec - u0) / per:.1f} us)")
            if cmd not in ("evalsha", "set", "info"):
                inner += (calls - c0) / per
    return f"inner commands {inner:.2f} per op: " + ", ".join(parts)


def cprofile(fn: Callable[[], None], top: int) -> tuple[float, str]:
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    lines = out.getvalue().splitlines()
    start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
    return stats.total_tt, "\n".join(lines[start:])  # type: ignore[attr-defined]


def profile_backend(name: str, args: argparse.Namespace) -> None:
    with subject(name) as s:
        counters: dict[str, Counter] = {}
        rclient = None
        if name == "redis":
            import redis

            rclient = redis.Redis.from_url(common.REDIS_URL)
        else:
            counters["ours"] = Counter(s.backend._engine)  # type: ignore[attr-defined]
            counters["floor"] = Counter(s.floor.engine)  # type: ignore[attr-defined]
        base = time.time_ns() // 1_000_000 - 20_000
        job = "profile-single"

        def ours(i: int) -> None:
            [claim] = s.backend.claim([request(job, base + i + 1)])
            assert claim.won, claim

        def ours_jobs(i: int) -> None:
            [claim] = s.backend.claim([request(f"{job}-{i}", base + i + 1)])
            assert claim.won, claim

        def floor(i: int) -> None:
            s.floor.single(f"p-{i + 1}")

        jobs = [f"pb-{j}" for j in range(args.batch)]

        def ours_batch(k: int) -> None:
            claims = s.backend.claim([request(j, base + 1000 + k) for j in jobs])
            assert all(c.won for c in claims)

        def floor_batch(k: int) -> None:
            s.floor.batch([f"pb-{k + 1}-{j}" for j in range(args.batch)])

        ours(-1)
        ours_jobs(-1)
        floor(-1)
        ours_batch(-1)
        floor_batch(-1)
        results: dict[str, dict[str, Any]] = {}
        phases = [
            ("ours single, one job (as bench.claims)", ours, args.single),
            ("ours single, a job per claim", ours_jobs, args.single),
            ("floor single", floor, args.single),
            ("ours batch", ours_batch, args.batches),
            ("floor batch", floor_batch, args.batches),
        ]
        for label, fn, calls in phases:
            for c in counters.values():
                c.reset()
            before = redis_stats(rclient) if rclient is not None else {}
            results[label] = timed(f"{name} {label}", calls, fn)
            if rclient is not None:
                results[label]["server"] = stats_diff(before, redis_stats(rclient), calls)
            who = "ours" if label.startswith("ours") else "floor"
            if who in counters:
                c = counters[who]
                results[label]["statements"] = c.statements / calls
                results[label]["commits"] = c.commits / calls
                results[label]["texts"] = dict(c.texts)
        n = args.single
        single_total, single_prof = cprofile(
            lambda: [ours_jobs(i) for i in range(n, 2 * n)] and None, args.profile_top
        )
        batch_total, batch_prof = cprofile(
            lambda: [ours_batch(k) for k in range(args.batches, 2 * args.batches)] and None,
            args.profile_top,
        )
        if rclient is not None:
            rclient.close()

    print(f"\n### {name}\n")
    print("| phase | wall median per call (ms) | CPU per call (ms) | statements | commits |")
    print("|---|---|---|---|---|")
    for label, r in results.items():
        print(
            f"| {label} | {r['wall_median'] * 1e3:.3f} | {r['cpu_mean'] * 1e3:.3f} | "
            f"{r.get('statements', '-')} | {r.get('commits', '-')} |"
        )
    for label, r in results.items():
        if "texts" in r:
            print(f"- {label}: {r['texts']}")
        if "server" in r:
            print(f"- {label}: {r['server']}")
    print(f"\ncProfile of {n} single claims (a job per claim): {single_total:.3f} s\n")
    print("```\n" + single_prof + "\n```")
    print(f"\ncProfile of {args.batches} batches of {args.batch}: {batch_total:.3f} s\n")
    print("```\n" + batch_prof + "\n```")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="redis,postgresql,mysql,sqlite")
    parser.add_argument("--single", type=int, default=300)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--profile-top", type=int, default=15)
    args = parser.parse_args(argv)
    print(common.header("Claim profile"))
    for name in [b.strip() for b in args.backends.split(",") if b.strip()]:
        profile_backend(name, args)


if __name__ == "__main__":
    main()
