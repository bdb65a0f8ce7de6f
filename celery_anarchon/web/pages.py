"""What each operator page shows, read through the control API.

Each function takes a :class:`~celery_anarchon.control.Control` (and what
the request asked for) and returns plain values for a template. The
backend round trips of one render are bounded whatever the number of jobs:
the Jobs page reads the history of the jobs it shows with one
:meth:`~celery_anarchon.backends.base.Backend.history_many` call, a state
filter asks :meth:`~celery_anarchon.backends.base.Backend.jobs_with_state`
and the sort by last state reads the matching jobs' recent history; the
Cluster page's totals are one
:meth:`~celery_anarchon.backends.base.Backend.state_counts` call. None reads
job by job.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from typing import Any

from ..backends import sanitize_url
from ..backends.base import SENT_STATES, Backend, RunRecord, State
from ..backends.store import JOB, StoredJobsStore
from ..beat.registry import schedule_fingerprint
from ..checks import Probe, has_clock
from ..control import Control
from ..model import Job, app_zone, jobs_from_stored
from ..reports import (
    StatusReport,
    after_slot,
    check_instances,
    describe_job,
    record_note,
    run_counts,
    utc,
)
from ..stored import StoredState
from .svg import histogram, lateness_chart, lateness_s, timeline

__all__ = [
    "FILTERS",
    "SORTS",
    "TOTAL_STATES",
    "JobsQuery",
    "PageControl",
    "cluster_page",
    "delayed_page",
    "job_page",
    "jobs_page",
    "now_text",
    "probe",
]

HOUR_MS = 3600 * 1000
DAY_MS = 24 * HOUR_MS

#: The states the Cluster page totals over the last hour.
TOTAL_STATES = ("sent", "missed", "lost", "skipped", "superseded")

#: The Jobs page's state filters: name -> (label, states, look-back ms).
FILTERS: dict[str, tuple[str, frozenset[State], int]] = {
    "missed-24h": ("a miss in the last 24 h", frozenset({State.MISSED}), DAY_MS),
    "lost-24h": ("a lost run in the last 24 h", frozenset({State.LOST}), DAY_MS),
    "failed-24h": ("a failed run in the last 24 h", frozenset({State.FAILED}), DAY_MS),
    "skipped-24h": ("a skipped slot in the last 24 h", frozenset({State.SKIPPED}), DAY_MS),
    "trouble-24h": (
        "a miss, loss or failure in the last 24 h",
        frozenset({State.MISSED, State.LOST, State.FAILED}),
        DAY_MS,
    ),
}

#: The Jobs page's sort orders: name -> label.
SORTS = {"name": "name", "next": "next slot", "last": "last state", "source": "source"}

#: Most jobs on one Jobs page, and the default.
MAX_PER_PAGE = 500
PER_PAGE = 50

#: Slots drawn in each job's timeline on the Jobs page.
TIMELINE_SLOTS = 30

#: Most parked tasks the Delayed page reads for its histogram.
DELAYED_READ = 1000


def _now_ms() -> int:
    return int(time.time() * 1000)


def _ago(ms: float) -> str:
    """``12.3s ago``: a duration in milliseconds as seconds ago."""
    return f"{ms / 1000:.1f}s ago"


class PageControl(Control):
    """:class:`Control` for a page that lives long and renders often:
    :meth:`read_jobs` reads the change counter and then only the stored
    records written since its last read, and builds only the jobs they
    changed, as a beat does (``beat/stored.py``). Reading and building
    every stored job at every render cost seconds at 100,000 jobs
    (docs/benchmarks.md, "The web page's render cost").

    Thread-safe: the server's threads share one.
    """

    def __init__(self, app: Any, **options: Any) -> None:
        super().__init__(app, **options)
        self._state = StoredState()
        self._stored_jobs: dict[str, Job] = {}
        self._problems: dict[str, str] = {}
        self._reading = threading.Lock()

    def read_jobs(self) -> dict[str, Job]:
        """:meth:`Control.read_jobs`, from what changed since the last read:
        one round trip when nothing did (the change counter). A counter
        that went back (a failover, a backend restarted without its data)
        reads everything again.

        Raises:
            BackendUnavailable: the backend does not answer.
        """
        with self._reading:
            if not self.keeps_stored_jobs or (not self._opened and not self.backend.exists()):
                return super().read_jobs()
            store = self._open()
            assert isinstance(store, StoredJobsStore)
            version = store.stored_version()
            if self._jobs is not None and version == self._state.version:
                return self._jobs
            everything = version < self._state.version or self._state.version == 0
            if everything:
                self._state, self._stored_jobs, self._problems = StoredState(), {}, {}
            changed = self._state.apply(store.stored_changes(self._state.version))
            rebuilt = {name for kind, name in changed if kind == JOB}
            for name in rebuilt:
                self._stored_jobs.pop(name, None)
                self._problems.pop(name, None)
            stored = [
                self._state.jobs[name]
                for name in sorted(rebuilt)
                if name in self._state.jobs and name not in self.code_jobs
            ]
            built, problems = jobs_from_stored(stored, self.app, self.settings, app_zone(self.app))
            self._stored_jobs.update(built)
            self._problems.update(problems)
            jobs = {**self._stored_jobs, **self.code_jobs}  # the code entry wins
            touched = jobs if everything else {name for _, name in changed}
            for name in touched:
                if name in jobs:
                    jobs[name].pause = self._state.pauses.get(name)
            self.stored_problems = {**self._problems, **self._state.unreadable}
            self._jobs = jobs
            return jobs


#: Most jobs in one history read over every job (the ``last`` sort): each
#: read is one call to the backend, and a SQL backend's watchdog ends a call
#: that outlasts ``statement_timeout`` (5 s), which the read of 100,000 jobs'
#: history does on PostgreSQL.
WIDE_CHUNK = 5000


def recent_history(
    backend: Backend, jobs: Sequence[str], since_ms: int
) -> dict[str, list[RunRecord]]:
    """Every record of ``jobs`` with a slot at or after ``since_ms`` (epoch
    ms), by job: :meth:`~Backend.history_many` over :data:`WIDE_CHUNK` jobs
    at a time, so that no single call outlasts the backend's timeout (the
    round trips are the same: SQL reads 500 jobs a query, Redis 1,000 a
    pipeline).

    Raises:
        BackendUnavailable: the backend does not answer.
    """
    found: dict[str, list[RunRecord]] = {}
    for start in range(0, len(jobs), WIDE_CHUNK):
        found.update(backend.history_many(jobs[start : start + WIDE_CHUNK], since_ms=since_ms))
    return found


# -- Cluster ---------------------------------------------------------------------


def probe(backend: Backend, connect_ms: float) -> Probe:
    """The backend's round trip and clock as ``status`` measures them (the
    shortest of three clock reads, as NTP does), on an open backend:
    ``probe_backend`` without its connect, which a page refreshed every
    few seconds must not repeat.

    Args:
        backend: the opened backend.
        connect_ms: how long opening it took, milliseconds.
    Raises:
        BackendUnavailable: no answer.
    """
    measured = Probe(connect_ms=connect_ms)
    if not has_clock(backend):
        return measured
    for _ in range(3):
        local_s, before = time.time(), time.perf_counter()
        backend_now = backend.now_ms()
        rtt_ms = (time.perf_counter() - before) * 1000
        if measured.rtt_ms is None or rtt_ms < measured.rtt_ms:
            measured.rtt_ms = rtt_ms
            measured.backend_now_ms = backend_now
            measured.host_offset_ms = local_s * 1000 + rtt_ms / 2 - backend_now
    return measured


def cluster_page(control: Control, app_name: str, connect_ms: float) -> dict[str, Any]:
    """The Cluster page: the backend (masked) and its round trip, the live
    instances as ``status`` lists them (drift and warnings), and the last
    hour's totals by state over every job.

    Args:
        control: the control API, its backend open.
        app_name: the app's name, for the hint of a cluster without beat.
        connect_ms: how long opening the backend took, milliseconds.
    Raises:
        BackendUnavailable: the backend does not answer.
    """
    backend = control.backend
    probe_ = probe(backend, connect_ms)
    report = StatusReport(
        backend=sanitize_url(backend.describe()),
        supports_leases=backend.supports_leases,
        backend_clock=has_clock(backend),
        max_skew_s=control.settings.max_skew,
        probe=probe_,
        local_fingerprint=schedule_fingerprint(control.code_jobs),
    )
    now_ms = probe_.backend_now_ms or backend.now_ms()
    if backend.supports_leases:
        live = control.instances()
        if len({info.fingerprint for info in live}) > 1:
            live = [
                replace(info, jobs=info.jobs or control.definitions(info.instance)) for info in live
            ]
        check_instances(report, live, now_ms, app_name)
    else:
        report.notes.append(
            "claim-only backend: no instance registry is kept, so live instances cannot "
            "be listed (use a lease backend to see them)"
        )
    jobs = control.read_jobs()
    since = now_ms - HOUR_MS
    counts: Counter[str] = Counter()
    for state, count in backend.state_counts(jobs, since).items():
        # "sent": every run that really went to the broker, whatever it became.
        counts["sent" if state in SENT_STATES else state.value] += count
    instances = [
        {
            **item,
            "started": utc(item["started_ms"] - item["started_ms"] % 1000),
            "heartbeat": _ago(item["heartbeat_age_ms"]),
            "offset": "-" if item["offset_ms"] is None else f"{item['offset_ms'] / 1000:+.3f}s",
            "skewed": item["offset_ms"] is not None
            and abs(item["offset_ms"]) > report.max_skew_s * 1000,
            "other_schedule": item["fingerprint"] != report.local_fingerprint,
        }
        for item in report.instances
    ]
    return {
        "report": report,
        "instances": instances,
        "totals": {state: counts.get(state, 0) for state in TOTAL_STATES},
        "jobs": len(jobs),
        "now": utc(now_ms),
        # SQLite and RabbitMQ keep no clock: each host's own is used (as `status` says)
        "backend_clock": report.backend_clock and probe_.backend_now_ms is not None,
    }


# -- Jobs ------------------------------------------------------------------------


@dataclass(frozen=True)
class JobsQuery:
    """What the Jobs page was asked for.

    Attributes:
        page: the page, from 1.
        per_page: jobs per page (at most :data:`MAX_PER_PAGE`).
        sort: a key of :data:`SORTS`.
        state: a key of :data:`FILTERS`, or "" for every job.
        text: jobs whose name contains it (case-insensitive), or "".
        source: ``"code"``, ``"stored"`` or "" for both.
        paused: only paused jobs.
    """

    page: int = 1
    per_page: int = PER_PAGE
    sort: str = "name"
    state: str = ""
    text: str = ""
    source: str = ""
    paused: bool = False

    @classmethod
    def from_args(cls, args: Mapping[str, str]) -> JobsQuery:
        """From a request's query string; a value out of range falls back
        to the default."""

        def number(name: str, default: int, top: int) -> int:
            try:
                value = int(args.get(name, default))
            except ValueError:
                return default
            return min(max(value, 1), top)

        sort = args.get("sort", "name")
        state = args.get("state", "")
        source = args.get("source", "")
        return cls(
            page=number("page", 1, 10**9),
            per_page=number("per_page", PER_PAGE, MAX_PER_PAGE),
            sort=sort if sort in SORTS else "name",
            state=state if state in FILTERS else "",
            text=args.get("q", "")[:200],
            source=source if source in ("code", "stored") else "",
            paused=args.get("paused", "") == "1",
        )

    def args(self, **changes: Any) -> dict[str, Any]:
        """The query string of this query with ``changes``, for links."""
        fields = {**asdict(self), **changes}
        out = {
            "page": fields["page"],
            "per_page": fields["per_page"],
            "sort": fields["sort"],
            "state": fields["state"],
            "q": fields["text"],
            "source": fields["source"],
            "paused": "1" if fields["paused"] else "",
        }
        return {key: value for key, value in out.items() if value not in ("", None)}


@dataclass
class JobsResult:
    """The Jobs page's rows and its paging."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    total: int = 0
    matching: int = 0
    pages: int = 1
    stored_problems: dict[str, str] = field(default_factory=dict)


def jobs_page(control: Control, query: JobsQuery, *, backend_up: bool = True) -> JobsResult:
    """The Jobs page: every job matching ``query``, sorted, one page of
    them described (schedule in words, zone, next slot, last state, pause)
    with a timeline of its last :data:`TIMELINE_SLOTS` slots.

    Backend round trips: the stored jobs and pauses (one read); with a
    state filter, one :meth:`~Backend.jobs_with_state` (one statement on
    SQL; a read of every matching job's recent history elsewhere); with the
    ``last`` sort, one :meth:`history_many` over every matching job; one
    :meth:`history_many` over the page's jobs; one run count read when a
    job on the page has ``max_runs``.

    Args:
        control: the control API.
        query: what was asked for.
        backend_up: False to list the ``beat_schedule`` entries alone,
            without states (the backend does not answer).
    Raises:
        BackendUnavailable: the backend does not answer (with
            ``backend_up``).
    """
    backend = control.backend
    now_ms = _now_ms()
    jobs: dict[str, Job] = control.read_jobs() if backend_up else dict(control.code_jobs)
    names = sorted(jobs)
    total = len(names)
    if query.text:
        needle = query.text.lower()
        names = [n for n in names if needle in n.lower()]
    if query.source:
        names = [n for n in names if jobs[n].source == query.source]
    if query.paused:
        names = [n for n in names if _paused(jobs[n])]
    if query.state and backend_up:
        _, states, look_back = FILTERS[query.state]
        having = backend.jobs_with_state(names, states, now_ms - look_back)
        names = [n for n in names if n in having]
    wide: dict[str, list[RunRecord]] = {}
    if backend_up and query.sort == "last" and names:
        look_back = FILTERS[query.state][2] if query.state else DAY_MS
        wide = recent_history(backend, names, now_ms - look_back)
    if query.sort == "next":
        names.sort(key=lambda n: (_next(jobs[n], now_ms) or math.inf, n))
    elif query.sort == "last":
        names.sort(key=lambda n: (_last_state(wide.get(n)), n))
    elif query.sort == "source":
        names.sort(key=lambda n: (jobs[n].source, n))
    pages = max(1, math.ceil(len(names) / query.per_page))
    page = min(query.page, pages)
    shown = names[(page - 1) * query.per_page : page * query.per_page]
    recent = backend.history_many(shown, TIMELINE_SLOTS) if backend_up and shown else {}
    counts = run_counts(control, {n: jobs[n] for n in shown}) if backend_up else {}
    zone = app_zone(control.app)
    rows = []
    for name in shown:
        records = recent.get(name, [])
        item = describe_job(
            jobs[name], backend, zone, now_ms, records[0] if records else None, counts.get(name)
        )
        item["timeline"] = timeline(records)
        item["next_utc"] = item["next"][0]["utc"] if item["next"] else "-"
        item["next_local"] = item["next"][0]["local"] if item["next"] else "(no more slots)"
        rows.append(item)
    return JobsResult(
        rows=rows,
        total=total,
        matching=len(names),
        pages=pages,
        stored_problems=dict(control.stored_problems),
    )


def _paused(job: Job) -> bool:
    return job.pause is not None and job.pause.paused


def _next(job: Job, now_ms: int) -> int | None:
    return job.slots.next_after(now_ms)


#: The ``last`` sort: trouble first, then the rest, jobs without runs last.
_LAST_ORDER = {
    State.FAILED: 0,
    State.LOST: 1,
    State.MISSED: 2,
    State.SKIPPED: 3,
    State.SUPERSEDED: 4,
    State.CLAIMED: 5,
    State.RUNNING: 6,
    State.SENT: 7,
    State.SUCCEEDED: 8,
}


def _last_state(records: Sequence[RunRecord] | None) -> int:
    if not records:
        return len(_LAST_ORDER)
    return _LAST_ORDER.get(records[0].state, len(_LAST_ORDER))


# -- Job -------------------------------------------------------------------------

#: Bins of the Job page's lateness histogram: upper bounds, seconds.
LATENESS_BINS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


def job_page(control: Control, name: str) -> dict[str, Any] | None:
    """The Job page: the job's definition and options, its full kept
    history as ``history`` shows it, a lateness-over-time chart and a
    lateness histogram; None when no job has the name and no history is
    kept of it.

    Raises:
        BackendUnavailable: the backend does not answer.
    """
    jobs = control.read_jobs()
    records = control.history(name)
    job = jobs.get(name)
    if job is None and not records:
        return None
    now_ms = _now_ms()
    described = None
    if job is not None:
        counts = run_counts(control, {name: job})
        described = describe_job(
            job, control.backend, app_zone(control.app), now_ms, records[0] if records else None
        )
        described["runs"] = counts.get(name)
        entry = job.entry
        described["entry"] = {
            "task": entry.task,
            "args": repr(tuple(entry.args or ())),
            "kwargs": repr(dict(entry.kwargs or {})),
            "send options": repr(dict(entry.options or {})),
        }
    rows = [
        {
            "slot": utc(r.slot_ms),
            "state": r.state.value,
            "instance": r.instance or "-",
            "claimed": after_slot(r.claimed_at_ms, r.slot_ms),
            "sent": after_slot(r.sent_at_ms, r.slot_ms),
            "started": after_slot(r.started_at_ms, r.slot_ms),
            "finished": after_slot(r.finished_at_ms, r.slot_ms),
            "task_id": r.task_id or "-",
            "note": record_note(r),
        }
        for r in records
    ]
    late = [v for v in (lateness_s(r) for r in records) if v is not None]
    counts_by_bin = [0] * (len(LATENESS_BINS) + 1)
    for value in late:
        index = next((i for i, top in enumerate(LATENESS_BINS) if value <= top), None)
        counts_by_bin[len(LATENESS_BINS) if index is None else index] += 1
    labels = [f"≤{top:g}s" for top in LATENESS_BINS] + [f">{LATENESS_BINS[-1]:g}s"]
    states = Counter(r.state.value for r in records)
    return {
        "name": name,
        "job": described,
        "rows": rows,
        "states": dict(sorted(states.items())),
        "chart": lateness_chart(records),
        "histogram": histogram(counts_by_bin, labels, element_id="lateness-histogram"),
        "stored_problem": control.stored_problems.get(name),
    }


# -- Delayed tasks ----------------------------------------------------------------


def delayed_page(app: Any, search: str = "") -> dict[str, Any]:
    """The Delayed page: how many tasks are parked, the next due, a
    histogram of the next :data:`DELAYED_READ` by due time, and the task
    with key or id ``search`` when asked.

    Returns:
        ``{"store": None, "why": text}`` when the backend keeps no delayed
        tasks.
    Raises:
        BackendUnavailable: the backend does not answer.
    """
    from .. import delayed
    from ..exceptions import ConfigurationError

    try:
        store, _ = delayed.store_for(app)
    except ConfigurationError as exc:
        return {"store": None, "why": sanitize_url(str(exc))}
    now_ms = store.now_ms()
    total = store.count()
    next_due = store.next_due_ms()
    tasks = store.pending(DELAYED_READ)
    counts, labels = _due_bins(tasks, now_ms)
    found = None
    if search:
        task = store.get(search)
        found = (
            {"missing": True}
            if task is None
            else {
                "id": task.id,
                "key": task.key or "-",
                "task": task.task,
                "due": utc(task.due_ms),
                "state": task.state,
                "attempts": task.attempts,
                "error": sanitize_url(task.error) if task.error else "-",
            }
        )
    return {
        "store": sanitize_url(store.describe()),
        "total": total,
        "next_due": utc(next_due) if next_due is not None else "-",
        "next_in": "-" if next_due is None else f"{(next_due - now_ms) / 1000:+.1f}s",
        "read": len(tasks),
        "histogram": histogram(counts, labels, element_id="delayed-histogram"),
        "soonest": [
            {"id": t.id, "key": t.key or "-", "task": t.task, "due": utc(t.due_ms)}
            for t in tasks[:20]
        ],
        "search": search,
        "found": found,
    }


#: Bins of the Delayed page's histogram: (label, upper bound from now, ms).
DUE_BINS = (
    ("overdue", 0),
    ("< 1 min", 60_000),
    ("< 10 min", 600_000),
    ("< 1 h", HOUR_MS),
    ("< 6 h", 6 * HOUR_MS),
    ("< 24 h", DAY_MS),
    ("< 7 d", 7 * DAY_MS),
)


def _due_bins(tasks: Sequence[Any], now_ms: int) -> tuple[list[int], list[str]]:
    counts = [0] * (len(DUE_BINS) + 1)
    for task in tasks:
        ahead = task.due_ms - now_ms
        index = next((i for i, (_, top) in enumerate(DUE_BINS) if ahead <= top), len(DUE_BINS))
        counts[index] += 1
    return counts, [label for label, _ in DUE_BINS] + [">= 7 d"]


def now_text() -> str:
    """The page's render time, UTC, to the second."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
