"""``sparkbus`` command line: ``broker`` (the daemon), ``status`` (live figures), ``demo`` (the main job)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path

from .config import BrokerConfig, from_env, parse_duration, parse_size


def add_broker_arguments(parser: argparse.ArgumentParser) -> None:
    """The daemon's flags, shared by ``sparkbus broker`` and ``python -m broker``."""
    parser.add_argument("--feed", default=from_env("feed", str, "tcp://0.0.0.0:5555"),
                        help="PULL endpoint Spark tasks push batches to (default tcp://0.0.0.0:5555); a port "
                             "of * is chosen by the system (see --ready-file)")
    parser.add_argument("--ranks", default=from_env("ranks", str, "tcp://0.0.0.0:5556"),
                        help="ROUTER endpoint the ranks connect to (default tcp://0.0.0.0:5556)")
    parser.add_argument("--control", default=from_env("control", str, None),
                        help="ROUTER endpoint for feeders' requests (default: the feed port + 2)")
    parser.add_argument("--max-buffer", type=parse_size, default=from_env("max_buffer", parse_size, 1 << 30),
                        help="bytes of batches held before the feed is throttled (default 1GiB)")
    parser.add_argument("--max-message", type=parse_size, default=from_env("max_message", parse_size, 1 << 30),
                        help="largest message any peer may send (default 1GiB)")
    parser.add_argument("--heartbeat", type=parse_duration, default=from_env("heartbeat", parse_duration, 1.0),
                        help="interval of heartbeats to the ranks (default 1s)")
    parser.add_argument("--dead-after", type=parse_duration, default=from_env("dead_after", parse_duration, 5.0),
                        help="declare a rank dead when its connection is silent this long (default 5s)")
    parser.add_argument("--rejoin-grace", type=parse_duration,
                        default=from_env("rejoin_grace", parse_duration, 10.0),
                        help="a rank whose connection was lost keeps its unacknowledged batches this long, so that "
                             "it finds them when it rejoins; then they go to the other ranks (default 10s)")
    parser.add_argument("--journal", default=from_env("journal", str, None),
                        help="directory for the append-only journal that lets a restarted broker go on")
    parser.add_argument("--ready-file", help="write the bound endpoints as JSON here once listening")
    parser.add_argument("--log-level", default=from_env("log_level", str, "INFO"))


def run_broker(args: argparse.Namespace) -> int:
    """Run the daemon in the foreground until SIGTERM or SIGINT; exit 0 on either."""
    from .daemon import Broker

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    broker = Broker(BrokerConfig(feed=args.feed, ranks=args.ranks, control=args.control,
                                 max_buffer=args.max_buffer, max_message=args.max_message,
                                 heartbeat=args.heartbeat, dead_after=args.dead_after,
                                 rejoin_grace=args.rejoin_grace,
                                 journal=args.journal, ready_file=args.ready_file))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: broker.stop())
    try:
        broker.run()
    except OSError as exc:
        logging.getLogger("sparkbus.broker").error("%s", exc)
        return 2
    return 0


def run_status(args: argparse.Namespace) -> int:
    from .address import broker_addresses
    from .client import fetch_stats
    from .errors import BrokerError
    from .status import render_stats, render_totals, totals

    try:
        addresses = broker_addresses(args.address, "SPARKBUS_STATUS_ADDRESS")
        timeout = parse_duration(args.timeout)
    except ValueError as exc:
        print(f"sparkbus status: {exc}", file=sys.stderr)
        return 2
    try:
        stats = {address: fetch_stats(address, timeout) for address in addresses}
    except BrokerError as exc:
        print(f"sparkbus status: {exc}", file=sys.stderr)
        return 1
    if len(stats) == 1:
        (one,) = stats.values()
        print(json.dumps(one, indent=2, sort_keys=True) if args.json else render_stats(one))
    elif args.json:
        print(json.dumps({"brokers": stats, "totals": totals(stats)}, indent=2, sort_keys=True))
    else:
        print("\n\n".join([*(f"{address}\n{render_stats(one)}" for address, one in stats.items()),
                            render_totals(totals(stats))]))
    return 0


def run_script(relative: str, args: list[str]) -> int:
    """``sparkbus demo`` and ``sparkbus bench`` run scripts of the source checkout (deploy/, benchmarks/)."""
    script = Path(__file__).resolve().parent.parent / relative
    if not script.exists():
        print(f"this command runs from a source checkout ({relative} was not found)", file=sys.stderr)
        return 2
    # exec, not a child: Ctrl-C and SIGTERM then reach the demo itself, which stops its processes in order
    os.execv(sys.executable, [sys.executable, str(script), *args])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sparkbus", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    add_broker_arguments(commands.add_parser("broker", help="run the broker daemon"))
    status = commands.add_parser("status", help="print a broker's live figures")
    status.add_argument("address", nargs="?", default=None,
                        help="the broker's control or ranks address, e.g. tcp://host:5557; several brokers' as a "
                             "comma-separated list (default: SPARKBUS_STATUS_ADDRESS)")
    status.add_argument("--json", action="store_true", help="print the raw figures as JSON")
    status.add_argument("--timeout", default="5s")
    commands.add_parser("demo", help="run the end-to-end demo (sparkbus demo --help)", add_help=False)
    commands.add_parser("bench", help="run the benchmark (sparkbus bench --help)", add_help=False)
    argv = sys.argv[1:] if argv is None else argv
    scripts = {"demo": "deploy/demo.py", "bench": "benchmarks/bench.py"}
    if argv[:1] and argv[0] in scripts:
        return run_script(scripts[argv[0]], argv[2:] if argv[1:2] == ["--"] else argv[1:])
    args = parser.parse_args(argv)
    if args.command == "broker":
        return run_broker(args)
    return run_status(args)


if __name__ == "__main__":
    sys.exit(main())
