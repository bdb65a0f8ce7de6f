"""The figures of docs/benchmarks.md, drawn from the JSON the benchmarks write.

    python -m bench.figures --out docs/_static/bench burst-10k.json [burst-1k.json ...]

Reads ``bench.burst --json`` files (any number, any job counts) and draws:

* ``lateness.png``: per configuration, the distribution of every measured
  message's lateness (seconds from its slot to its read from the broker),
  as the share of the messages due (all repeats pooled) that were in the
  broker by each time after the slot: a scheduler that did not send all of
  them within the wait stays below 100 %;
* ``round-vs-jobs.png``: per configuration, the median time from the slot
  to the last message of round 1 against the number of jobs (a point per
  job count present in the files, min-max as error bars).

Needs matplotlib (the ``bench`` extra). A configuration with no successful
run is left out of a figure, and named on standard error.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def load(paths: Sequence[str]) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        runs.extend(data if isinstance(data, list) else data.get("results", []))
    return [r for r in runs if "rounds" in r]


def lateness_figure(runs: Sequence[dict[str, Any]], out: Path, jobs: int) -> Path | None:
    import matplotlib.pyplot as plt

    by_config: dict[str, list[float]] = defaultdict(list)
    expected: dict[str, int] = defaultdict(int)
    for r in runs:
        if r.get("jobs") == jobs and "late_s" in r:
            by_config[r["config"]].extend(r["late_s"])
            expected[r["config"]] += jobs * len(r["rounds"])
    if not any(by_config.values()):
        print(f"no per-message lateness for {jobs} jobs: lateness.png not drawn", file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(11, 4.8), dpi=100)
    for label, late in sorted(by_config.items(), key=lambda kv: max(kv[1], default=0.0)):
        late, total = sorted(late), expected[label]
        # the share of the messages due, so a scheduler that never sent
        # some of them stays below 100 %
        share = [(i + 1) / total * 100 for i in range(len(late))]
        p99 = late[int(0.99 * total) - 1] if len(late) >= 0.99 * total else None
        note = f"p99 {p99:.2f} s" if p99 is not None else f"{len(late) / total:.0%} sent"
        ax.plot(late, share, label=f"{label} ({note})")
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_xlabel("seconds after the slot (log scale above 1 s)")
    ax.set_ylabel("messages in the broker (%)")
    ax.set_title(f"{jobs:,} jobs due together: when each message reached the broker")
    return _finish(fig, ax, out / "lateness.png")


def round_figure(runs: Sequence[dict[str, Any]], out: Path) -> Path | None:
    import matplotlib.pyplot as plt

    points: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in runs:
        done = r["rounds"][0].get("done")
        if done is not None:
            points[r["config"]][int(r["jobs"])].append(done)
    if not points:
        print("no finished round: round-vs-jobs.png not drawn", file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(11, 4.8), dpi=100)
    for label, by_jobs in sorted(points.items()):
        sizes = sorted(by_jobs)
        medians = [statistics.median(by_jobs[n]) for n in sizes]
        below = [m - min(by_jobs[n]) for m, n in zip(medians, sizes, strict=True)]
        above = [max(by_jobs[n]) - m for m, n in zip(medians, sizes, strict=True)]
        ax.errorbar(sizes, medians, yerr=[below, above], marker="o", capsize=3, label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("jobs due together")
    ax.set_ylabel("slot to last message of the round (s)")
    ax.set_title("Round time against job count (median, min-max)")
    return _finish(fig, ax, out / "round-vs-jobs.png")


def _finish(fig: Any, ax: Any, path: Path) -> Path:
    """Grid, legend to the right, write ``path``, free the figure."""
    import matplotlib.pyplot as plt

    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.figures", description=__doc__)
    parser.add_argument("results", nargs="+", help="bench.burst --json files")
    parser.add_argument("--out", default="docs/_static/bench")
    parser.add_argument("--jobs", type=int, default=10_000, help="job count of lateness.png")
    args = parser.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        print("matplotlib is not installed: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    runs = load(args.results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for path in (lateness_figure(runs, out, args.jobs), round_figure(runs, out)):
        if path is not None:
            print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
