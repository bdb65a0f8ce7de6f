"""``python -m tests.faults``: run the fault campaign and print (or publish) the table.

Examples::

    python -m tests.faults                      # the short (CI) profile
    python -m tests.faults --publish            # ... and rewrite docs/reliability.md
    python -m tests.faults --lease --publish    # issue 5's lease faults, 9 rows
    python -m tests.faults --long --duration 120
    python -m tests.faults --scenarios "kill-9 loop" --backends redis,postgresql
    python -m tests.faults --long --backends rabbitmq --block long-rabbitmq --publish
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .badinput import BAD_INPUT, run_bad_input
from .campaign import (
    markers,
    publish,
    results_block,
    run_campaign,
    save_json,
    table,
    versions,
)
from .scenarios import (
    ALL,
    LEASE_DURATION,
    LEASE_PROFILE,
    SCENARIOS,
    SHORT_DURATION,
    SHORT_PROFILE,
    long_profile,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "reliability.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.faults", description=__doc__)
    parser.add_argument("--long", action="store_true", help="every scenario on every backend")
    parser.add_argument(
        "--lease",
        action="store_true",
        help="issue 5's lease faults: kill -9 in send, SIGSTOP > lease and rolling restart "
        "on sqlite, postgresql and redis (no bad input)",
    )
    parser.add_argument(
        "--duration", type=float, help="seconds per scenario (16; --lease 30; --long 60)"
    )
    parser.add_argument("--backends", help=f"comma-separated subset of {','.join(ALL)}")
    parser.add_argument("--scenarios", help="comma-separated scenario names (see --list)")
    parser.add_argument(
        "--rows", help='comma-separated "scenario/backend" rows, e.g. "stall/redis,stall/mysql"'
    )
    parser.add_argument("--no-bad-input", action="store_true", help="skip the bad-input checks")
    parser.add_argument("--publish", action="store_true", help=f"rewrite the table in {DOC}")
    parser.add_argument(
        "--block",
        help="results block to rewrite (default: short, lease, or long for --long, "
        "--scenarios and --rows); its markers must be in the page",
    )
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--keep", type=Path, help="leave each row's logs in this folder")
    parser.add_argument("--list", action="store_true", help="list scenarios and exit")
    args = parser.parse_args(argv)
    if args.list:
        for name, sc in SCENARIOS.items():
            print(f"{name:18} {','.join(sc.backends):40} {sc.about}")
        for case in BAD_INPUT:
            print(f"bad input: {case.name} ({case.backend})")
        return 0
    if args.lease and (args.long or args.scenarios or args.rows):
        parser.error("--lease is a profile of its own: no --long, --scenarios or --rows")
    backends = tuple(args.backends.split(",")) if args.backends else ALL
    plan = LEASE_PROFILE if args.lease else long_profile(backends) if args.long else SHORT_PROFILE
    plan = [(s, b) for s, b in plan if b in backends]
    if args.rows:
        plan = [tuple(r.split("/", 1)) for r in args.rows.split(",")]  # type: ignore[misc]
        unknown = {s for s, _ in plan} - set(SCENARIOS)
        if unknown:
            parser.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")
    elif args.scenarios:
        wanted = set(args.scenarios.split(","))
        unknown = wanted - set(SCENARIOS)
        if unknown:
            parser.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")
        plan = [(s, b) for s, b in long_profile(backends) if s in wanted]
    # Rows picked by --scenarios/--rows go to the long block, said so in its header.
    if args.lease:
        profile = "lease"
    else:
        profile = "short" if not (args.long or args.scenarios or args.rows) else "long"
    block = args.block or profile
    if args.publish and any(m not in DOC.read_text() for m in markers(block)):
        parser.error(f"{DOC} has no results block {block!r} (markers {markers(block)})")
    default = 60.0 if args.long else LEASE_DURATION if args.lease else SHORT_DURATION
    duration = args.duration or default
    rows = run_campaign(plan, duration, seed=args.seed, keep=args.keep)
    if not (args.no_bad_input or args.lease):
        rows += run_bad_input(backends)
    found = versions()
    print()
    print(table(rows))
    if args.json:
        save_json(rows, args.json, found)
    if args.publish:
        label = ("long" if args.long else "selected rows") if profile == "long" else profile
        if args.backends and not args.rows:
            label += f", backends {','.join(b for b in ALL if b in backends)}"
        publish(DOC, results_block(rows, block, duration, found, label=label), block)
        print(f"\npublished in {DOC} (block {block!r})")
    return 0 if all(r.ok or r.skipped for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
