"""``python -m celery_anarchon demo``: several real beats, one run per slot.

Starts N real ``celery beat`` processes with the embedded defaults (claims in
SQLite beside the schedule file; kombu's ``filesystem://`` broker, which works
across processes and needs no server) and one real worker, lets them run, then
prints which instance sent each slot and a summary line::

    slots=18 sent=18 duplicates=0 missed=0

``duplicates`` counts extra executions of a slot; ``missed`` counts slots due
while the instances ran that were never executed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

__all__ = ["main", "run_demo"]

APP = "celery_anarchon.demo_app"
#: Slots of the demo's jobs are counted from this long after every beat is
#: ready (its backend answered; its first round follows within a second) ...
SETTLE_S = 1.0
#: ... until this long before the beats are stopped (the jitter of the last
#: slots, 2 s by default, and the send).
TAIL_S = 4.0
#: Longest wait for every beat to be ready, seconds (a loaded machine).
READY_TIMEOUT_S = 90.0
#: The line a beat logs once its claim backend answered.
READY_LINE = b"backend ready"


def _celery(*args: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", APP, *args]


def _start(cmd: list[str], folder: Path, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "ANARCHON_DEMO_DIR": str(folder)}
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, cwd=folder, env=env, stdout=out, stderr=subprocess.STDOUT)


def _stop(procs: list[subprocess.Popen[bytes]], timeout: float = 15.0) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _expected_slots(start_s: float, end_s: float) -> dict[str, list[int]]:
    """Every slot of the demo's jobs in ``[start_s, end_s]``, epoch ms."""
    from zoneinfo import ZoneInfo

    from .slots import slots_for

    schedules = {"every-second": 1.0, "cron-every-5s": "* * * * * */5"}
    expected: dict[str, list[int]] = {}
    for job, schedule in schedules.items():
        slots = slots_for(schedule, job=job, tz=ZoneInfo("UTC"))
        found: list[int] = []
        slot = slots.next_after(int(start_s * 1000) - 1)
        while slot is not None and slot <= end_s * 1000:
            found.append(slot)
            slot = slots.next_after(slot)
        expected[job] = found
    return expected


def run_demo(instances: int = 3, seconds: float = 20.0, folder: Path | None = None) -> int:
    """Run the demo; print the per-slot table and the summary line.

    Args:
        instances: how many ``celery beat`` processes to start.
        seconds: how long they run once every one is ready (slots are
            counted from then).
        folder: working folder, kept (default: a new temporary one, removed
            at the end unless the run failed).
    Returns:
        0 when every slot ran exactly once, 1 otherwise.
    """
    keep = folder is not None
    folder = Path(folder or tempfile.mkdtemp(prefix="anarchon-demo-")).resolve()
    code = 1
    try:
        code = _run(instances, seconds, folder)
    finally:
        if code == 0 and not keep:
            shutil.rmtree(folder, ignore_errors=True)
        elif code != 0:
            print(f"logs kept in {folder} (beat-N.log, worker.log, executions.log)")
    return code


def _run(instances: int, seconds: float, folder: Path) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "executions.log").write_text("")
    print(f"demo folder: {folder}")
    print(f"starting 1 worker and {instances} beat instances for {seconds:.0f}s ...")
    worker = _start(
        _celery(
            "worker",
            "-P",
            "solo",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "-l",
            "WARNING",
        ),
        folder,
        folder / "worker.log",
    )
    beats: list[subprocess.Popen[bytes]] = []
    try:
        for i in range(instances):
            beats.append(
                _start(
                    _celery("beat", "-S", "celery_anarchon.Scheduler", "-l", "INFO"),
                    folder,
                    folder / f"beat-{i + 1}.log",
                )
            )
        waited = time.monotonic()
        _wait_ready(beats, folder)
        started = time.time()
        if beats:
            print(
                f"every beat ready after {time.monotonic() - waited:.1f}s; counting slots from now"
            )
        time.sleep(seconds)
        stopped = time.time()
        _stop(beats)
        _drain(folder, deadline=time.monotonic() + 15)
    finally:
        _stop(beats)
        _stop([worker])
    return _report(folder, started + SETTLE_S, stopped - TAIL_S)


def _wait_ready(beats: list[subprocess.Popen[bytes]], folder: Path) -> None:
    """Wait until every beat logged that its backend is ready (or exited, or
    :data:`READY_TIMEOUT_S` passed: the report then shows what it missed).
    Slots before that are not counted: a machine that is slow to start
    Python and Celery does not make the demo fail."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    waiting = set(range(len(beats)))
    while waiting and time.monotonic() < deadline:
        for i in sorted(waiting):
            log = folder / f"beat-{i + 1}.log"
            if beats[i].poll() is not None or READY_LINE in log.read_bytes():
                waiting.discard(i)
        time.sleep(0.2)
    if waiting:
        names = ", ".join(f"beat-{i + 1}" for i in sorted(waiting))
        print(f"not ready after {READY_TIMEOUT_S:.0f}s: {names} (see its log)")


def _drain(folder: Path, deadline: float) -> None:
    """Wait until the worker has taken every message from the broker folder."""
    broker = folder / "broker"
    while time.monotonic() < deadline:
        if not any(p.suffix == ".msg" for p in broker.iterdir()):
            time.sleep(1.0)  # the last execution finishing
            return
        time.sleep(0.2)


def _report(folder: Path, start_s: float, end_s: float) -> int:
    executions: Counter[tuple[str, int]] = Counter()
    for line in (folder / "executions.log").read_text().splitlines():
        run = json.loads(line)
        executions[(run["job"], int(run["slot"]))] += 1
    senders = _senders(folder)
    expected = _expected_slots(start_s, end_s)
    slots = sent = duplicates = missed = 0
    per_instance: Counter[str] = Counter()  # of the counted slots, as sent= is
    print(f"\n{'job':<16} {'slot (UTC)':<26} {'sent by':<34} executed")
    for job, job_slots in expected.items():
        for slot in job_slots:
            count = executions.get((job, slot), 0)
            slots += 1
            sent += 1 if count else 0
            duplicates += max(count - 1, 0)
            missed += 0 if count else 1
            if count:
                per_instance[senders.get((job, slot), "-")] += 1
            stamp = time.strftime("%H:%M:%S", time.gmtime(slot / 1000)) + f".{slot % 1000:03d}Z"
            print(f"{job:<16} {stamp:<26} {senders.get((job, slot), '-'):<34} {count}x")
    # Extra executions outside the counted window are duplicates all the same.
    duplicates += sum(
        c - 1
        for (job, slot), c in executions.items()
        if c > 1 and slot not in expected.get(job, [])
    )
    print("\nsent per instance: " + ", ".join(f"{k}={v}" for k, v in sorted(per_instance.items())))
    print(f"slots={slots} sent={sent} duplicates={duplicates} missed={missed}")
    return 0 if duplicates == 0 and missed == 0 and slots > 0 else 1


def _senders(folder: Path) -> dict[tuple[str, int], str]:
    """``(job, slot) -> instance`` from the claim backend's history."""
    os.environ["ANARCHON_DEMO_DIR"] = str(folder)
    cwd = os.getcwd()
    os.chdir(folder)  # the default SQLite file lives beside the schedule file
    try:
        from .control import Control
        from .demo_app import app

        found: dict[tuple[str, int], str] = {}
        with Control(app) as control:
            for job in control.jobs:
                for record in control.history(job):
                    if record.instance:
                        found[(job, record.slot_ms)] = record.instance
        return found
    finally:
        os.chdir(cwd)


def main(argv: list[str] | None = None) -> None:
    """Command line: ``python -m celery_anarchon demo [--instances N] [--seconds S]``."""
    parser = argparse.ArgumentParser(prog="python -m celery_anarchon")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run N real beats on the embedded default backend")
    demo.add_argument("--instances", type=int, default=3, help="beat processes (default 3)")
    demo.add_argument("--seconds", type=float, default=20.0, help="how long (default 20)")
    demo.add_argument(
        "--dir", type=Path, default=None, help="working folder, kept (default: a temporary one)"
    )
    args = parser.parse_args(argv)
    sys.exit(run_demo(args.instances, args.seconds, args.dir))
