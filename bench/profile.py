"""Summaries of py-spy raw profiles (``py-spy record --format raw --idle``).

    python -m bench.profile DIR_OR_FILE...

Each raw line is ``frame;frame;...;frame <samples>``, outermost frame first,
a frame ``function (path:line)``. A sample is 1/rate seconds of wall time of
one thread (idle frames included, so waits on a socket show). Prints, per
profile, where the samples went by part of the tick, and the functions with
the most samples (inclusive and self).
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from . import common

#: Parts of the work, by a frame on the stack (first match wins).
PARTS: list[tuple[str, str]] = [
    ("heartbeat (register + instances + drift check)", "Registry.heartbeat (celery_anarchon/"),
    ("take-over checks (backup runner)", "TakeOver.check (celery_anarchon/"),
    ("claim batch (backend.claim)", "Claimer.claim (celery_anarchon/"),
    ("mark sent (Journal -> backend.mark_many)", "Journal.flush_marks (celery_anarchon/"),
    ("broker write (the batch's pipeline)", "flush (kombu/"),
    ("log line per sent slot", "info (logging/"),
    ("build + buffer messages (send_slot -> apply_async)", "send_slot (celery_anarchon/"),
    ("heap, slot arithmetic, rendezvous", "Agenda.pop_due (celery_anarchon/"),
    ("heap, slot arithmetic, rendezvous", "Agenda.advance (celery_anarchon/"),
    ("heap, slot arithmetic, rendezvous", "TakeOver.watch (celery_anarchon/"),
    ("rest of the anarchon tick", "Scheduler.tick (celery_anarchon/"),
    ("celery-redbeat: load due entries", "schedule (redbeat/"),
    ("celery-redbeat: send + reschedule", "maybe_due (redbeat/"),
    ("Celery beat tick", "tick (celery/beat.py"),
    ("beat loop sleeping", "start (celery/beat.py"),
]

_LINE = re.compile(r"^(.*) (\d+)$")
_FRAME = re.compile(r"^(?P<fn>.*?) \((?P<path>[^()]*?)(?::(?P<line>\d+))?\)$")
_WAIT_LEAVES = (
    "recv",
    "recv_into",
    "readinto",
    "read",
    "select",
    "poll",
    "sleep",
    "wait",
    "_read_from_socket",
    "send_packed_command",
    "sendall",
    "drain_events",
)


def _short(path: str) -> str:
    for marker in ("site-packages/", "python3.11/", "/work/main/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def _frame(text: str) -> str:
    match = _FRAME.match(text.strip())
    if not match:
        return text.strip()
    return f"{match.group('fn')} ({_short(match.group('path'))})"


def load(path: Path) -> list[tuple[list[str], int]]:
    """``(frames outermost first, samples)`` of a raw profile."""
    stacks = []
    for line in path.read_text(errors="replace").splitlines():
        match = _LINE.match(line.strip())
        if match:
            stacks.append(([_frame(f) for f in match.group(1).split(";")], int(match.group(2))))
    return stacks


def summarise(path: Path, top: int = 15) -> str:
    stacks = load(path)
    total = sum(n for _, n in stacks) or 1
    parts: Counter[str] = Counter()
    waiting: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    leaf: Counter[str] = Counter()
    for frames, n in stacks:
        joined = ";".join(frames)
        part = next((name for name, marker in PARTS if marker in joined), "other")
        parts[part] += n
        fn = frames[-1].split(" (", 1)[0].rsplit(".", 1)[-1] if frames else ""
        if fn in _WAIT_LEAVES:
            waiting[part] += n
        for frame in set(frames):
            inclusive[frame] += n
        if frames:
            leaf[frames[-1]] += n
    rows = [
        [part, n, f"{100 * n / total:.1f}", f"{100 * waiting[part] / max(1, n):.0f}"]
        for part, n in parts.most_common()
    ]
    out = [
        f"### {path.name}: {total} samples",
        "",
        common.table(["part", "samples", "% of samples", "% of it waiting on I/O"], rows),
        "",
        f"Top {top} functions, inclusive (% of samples):",
        "",
        common.table(
            ["function", "%"],
            [[f"`{f}`", f"{100 * n / total:.1f}"] for f, n in inclusive.most_common(top)],
        ),
        "",
        f"Top {top} functions, self (% of samples):",
        "",
        common.table(
            ["function", "%"],
            [[f"`{f}`", f"{100 * n / total:.1f}"] for f, n in leaf.most_common(top)],
        ),
    ]
    return "\n".join(out)


def summarise_folder(folder: Path) -> str:
    files = sorted(folder.glob("*.txt")) if folder.is_dir() else [folder]
    return "\n\n".join(summarise(f) for f in files if f.exists() and f.stat().st_size)


def main(argv: Sequence[str] | None = None) -> int:
    paths = [Path(p) for p in (argv if argv is not None else sys.argv[1:])]
    if not paths:
        print(__doc__)
        return 2
    for path in paths:
        print(summarise_folder(path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
