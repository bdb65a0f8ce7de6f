"""Two checkouts of this project, one benchmark, side by side in one run.

    python -m bench.compare --before ../old --after . burst --jobs 10000 \\
        --configs anarchon-redis-1,anarchon-redis-3 [--repeats 3]
    python -m bench.compare --before ../old --after . scale --sizes 100000 \\
        --backends stub [--repeats 3]

Each checkout runs the benchmark with its own virtualenv
(``CHECKOUT/.venv/bin/python``, falling back to this interpreter) and its
own code, one repeat at a time, alternating before and after, so both see
the same machine load over the run: on a shared, noisy machine the ratio
of two figures taken side by side means more than either figure alone.
Every argument after the benchmark's name is passed to it unchanged, with
``--repeats 1`` and ``--json`` added.

Prints one Markdown table: per configuration (burst) or backend and size
(scale), each figure's median over the repeats for before and after (min
and max in brackets) and the ratio of the medians, after / before: below 1
is faster or smaller after.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from . import common

Figures = Callable[[dict[str, Any]], dict[str, float]]


def burst_key(run: dict[str, Any]) -> str:
    return str(run["config"])


def burst_figures(run: dict[str, Any]) -> dict[str, float]:
    """The first round's completion and tail (seconds after the slot) and
    the instances' CPU seconds per round."""
    if "rounds" not in run:
        return {}
    first = run["rounds"][0]
    out = {"round done s": first["done"], "p99 s": first["p99"]}
    out["CPU s/round"] = run["cpu_s"] / max(1, len(run["rounds"]))
    return {k: v for k, v in out.items() if v is not None}


def scale_key(run: dict[str, Any]) -> str:
    return f"{run['backend']} {run['size']:,}"


def scale_figures(run: dict[str, Any]) -> dict[str, float]:
    if "error" in run:
        return {}
    names = {
        "startup_s": "start-up s",
        "first_tick_s": "first tick s",
        "rss_mib": "RSS MiB",
        "idle_cpu_per_min_s": "idle CPU s/min",
        "due_tick_per_job_us": "due tick us/job",
    }
    return {label: run[key] for key, label in names.items() if run.get(key) is not None}


BENCHES: dict[str, tuple[Callable[[dict[str, Any]], str], Figures]] = {
    "burst": (burst_key, burst_figures),
    "scale": (scale_key, scale_figures),
}


def interpreter(checkout: Path) -> str:
    venv = checkout / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def run_once(checkout: Path, bench: str, passed: Sequence[str]) -> list[dict[str, Any]]:
    """One repeat of ``bench`` in ``checkout``: its raw JSON results."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder, "results.json")
        command = [interpreter(checkout), "-m", f"bench.{bench}", *passed]
        command += ["--repeats", "1", "--json", str(out)]
        common.log(f"{checkout}: {' '.join(command[1:])}")
        done = subprocess.run(command, cwd=checkout, check=False, timeout=3600)
        if done.returncode != 0 or not out.exists():
            common.log(f"  exit {done.returncode}: no results")
            return []
        results: list[dict[str, Any]] = json.loads(out.read_text())
        return results


def _spread(values: Sequence[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.3g} ({min(values):.3g}-{max(values):.3g})"


def report(collected: dict[str, dict[str, dict[str, list[float]]]]) -> str:
    """``collected[side][key][figure]`` -> values; one row per key and figure."""
    rows = []
    keys = sorted(set(collected["before"]) | set(collected["after"]))
    for key in keys:
        before = collected["before"].get(key, {})
        after = collected["after"].get(key, {})
        for figure in sorted(set(before) | set(after)):
            b, a = before.get(figure, []), after.get(figure, [])
            ratio = "-"
            if a and b and statistics.median(b):
                ratio = f"{statistics.median(a) / statistics.median(b):.2f}"
            rows.append([key, figure, _spread(b), _spread(a), ratio, f"{len(b)}/{len(a)}"])
    headers = ["run", "figure", "before", "after", "after/before", "repeats"]
    return common.table(headers, rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__)
    parser.add_argument("--before", required=True, type=Path, help="checkout measured first")
    parser.add_argument("--after", required=True, type=Path, help="checkout measured second")
    parser.add_argument("--repeats", type=int, default=3, help="repeats per checkout")
    parser.add_argument("bench", choices=sorted(BENCHES))
    parser.add_argument("args", nargs=argparse.REMAINDER, help="passed to the benchmark")
    args = parser.parse_args(argv)
    key_of, figures_of = BENCHES[args.bench]
    collected: dict[str, dict[str, dict[str, list[float]]]] = {"before": {}, "after": {}}
    for repeat in range(args.repeats):
        for side in ("before", "after"):
            checkout = getattr(args, side).resolve()
            common.log(f"repeat {repeat + 1}/{args.repeats}, {side}")
            for run in run_once(checkout, args.bench, args.args):
                figures = collected[side].setdefault(key_of(run), {})
                for name, value in figures_of(run).items():
                    figures.setdefault(name, []).append(float(value))
    print(common.header(f"Compare {args.bench}: {args.before} -> {args.after}"))
    print(report(collected))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
