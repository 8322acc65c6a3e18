"""The sparkbus command line: broker (the daemon), status (live figures), keys (CURVE pairs), demo (the end-to-end
demo, from the installed package) and bench (the benchmark: the hop, end to end, the user's own data)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from typing import cast

from sparkbus.broker.config import (
    BROKER_SETTINGS,
    broker_config,
    is_loopback_endpoint,
    parse_duration,
    resolve_settings,
)
from sparkbus.cli_help import HelpFormatter
from sparkbus.wire.errors import AuthError

log = logging.getLogger("sparkbus.broker")


def _argument_type(parse):
    """An argparse ``type`` whose error message is ``parse``'s own (argparse would say "invalid value")."""
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    convert.__name__ = parse.__name__
    return convert


def add_broker_arguments(parser: argparse.ArgumentParser) -> None:
    """The daemon's flags, shared by ``sparkbus broker`` and ``python -m sparkbus.broker``.

    Every flag defaults to None here: :func:`broker.config.resolve_settings` then takes the variable, the config
    file or the default, in that order (so a flag given on the command line always wins).
    """
    parser.add_argument("--config", metavar="FILE",
                        help="TOML file with any of these settings (keys as the flags: max_buffer = \"4GiB\"); "
                             "flags, then SPARKBUS_* variables, take precedence over it (default: SPARKBUS_CONFIG)")
    for setting in BROKER_SETTINGS:
        help_text = f"{setting.help} (default {setting.shown or setting.default}; {setting.variable})"
        help_text = help_text.replace("``", "")           # the settings' help is also docs text
        if setting.flag:
            parser.add_argument(setting.option, dest=setting.name, type=_argument_type(setting.parse),
                                default=None, help=help_text, metavar=setting.metavar)
        else:
            parser.add_argument(setting.option, dest=setting.name, action="store_const", const=True,
                                default=None, help=help_text)
    parser.set_defaults(prog=parser.prog)


def run_broker(args: argparse.Namespace) -> int:
    """Run the daemon in the foreground until SIGTERM or SIGINT; exit 0 on either, 2 on a usage error."""
    prog = getattr(args, "prog", "sparkbus broker")
    try:
        settings = resolve_settings({s.name: getattr(args, s.name, None) for s in BROKER_SETTINGS},
                                    config_file=args.config)
        config = broker_config(settings)
        if config.auth:
            from sparkbus.broker.auth import KeyAuthority
            KeyAuthority(config.auth)          # a bad key directory is a usage error now, not a failed start
        if config.metrics_port is not None:
            from sparkbus.broker import metrics  # noqa: F401  (prometheus-client, sparkbus[broker]: missing is a usage error)
    except (ValueError, AuthError, ImportError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2

    from sparkbus.broker.daemon import Broker

    # Until the daemon applies the keys (Broker.serves_curve), --auth must not start a broker that is open while its
    # operator believes it is closed.
    if config.auth and not getattr(Broker, "serves_curve", False):
        print(f"{prog}: error: this broker cannot apply --auth yet (CURVE is not wired into its loop)",
              file=sys.stderr)
        return 2
    logging.basicConfig(level=settings["log_level"], format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not config.auth:
        exposed = [e for e in (config.feed, config.ranks, config.control) if e and not is_loopback_endpoint(e)]
        log.warning("no --auth: connections are neither authenticated nor encrypted; %s",
                    f"--insecure: anyone who reaches {', '.join(exposed)} can feed and take data" if exposed
                    else "listening on this host only")
    broker = Broker(config)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: broker.stop())
    # SIGHUP (systemctl reload) re-reads the key directory; never the default action, which would end the broker
    signal.signal(signal.SIGHUP, lambda *_: broker.reload() if hasattr(broker, "reload") else
                  log.info("SIGHUP: nothing to reload"))
    try:
        broker.run()
    except OSError as exc:
        log.error("%s", exc)
        return 2
    return 0


def run_status(args: argparse.Namespace) -> int:
    from sparkbus.broker.auth import BROKER_KEY_ENV, KEY_ENV, load_key_pair, load_public_key
    from sparkbus.broker.client import fetch_stats
    from sparkbus.broker.figures import Figures
    from sparkbus.broker.status import render_stats, render_totals, totals, with_verdicts
    from sparkbus.wire.address import broker_addresses
    from sparkbus.wire.errors import BrokerError

    def fetch(address: str) -> Figures:
        return cast("Figures", fetch_stats(address, args.timeout))

    try:
        addresses = broker_addresses(args.address or os.environ.get("SPARKBUS_STATUS_ADDRESS") or default_control(),
                                     "SPARKBUS_STATUS_ADDRESS")
        # the client reads SPARKBUS_KEY / SPARKBUS_BROKER_KEY (broker/auth.py make_curve_client): flags become those
        for value, variable, check in ((args.key, KEY_ENV, load_key_pair),
                                       (args.broker_key, BROKER_KEY_ENV, load_public_key)):
            if value:
                os.environ[variable] = value
            if os.environ.get(variable):
                check(os.environ[variable])
    except (ValueError, AuthError) as exc:
        print(f"sparkbus status: error: {exc}", file=sys.stderr)
        return 2
    if args.watch:
        try:
            import rich  # noqa: F401  (the live table; the plain figures need nothing more)
        except ImportError:
            print("sparkbus status: error: --watch needs rich: pip install 'sparkbus[broker]'", file=sys.stderr)
            return 2
        from sparkbus.broker.status import watch
        try:
            watch(lambda: {address: fetch(address) for address in addresses}, args.interval)
        except BrokerError as exc:
            print(f"sparkbus status: {exc}", file=sys.stderr)
            return 1
        return 0
    try:
        stats = {address: fetch(address) for address in addresses}
    except BrokerError as exc:
        print(f"sparkbus status: {exc}", file=sys.stderr)
        return 1
    if len(stats) == 1:
        (one,) = stats.values()
        print(json.dumps(with_verdicts(one), indent=2, sort_keys=True) if args.json else render_stats(one))
    elif args.json:
        print(json.dumps({"brokers": stats, "totals": totals(stats)}, indent=2, sort_keys=True))
    else:
        print("\n\n".join([*(f"{address}\n{render_stats(one)}" for address, one in stats.items()),
                            render_totals(totals(stats))]))
    return 0


KEYS_HELP = """\
wrote {public} (public) and {secret} (secret, mode 0600: it stays on the machines of whoever it identifies)

Where the files go (DIR is the broker's --auth directory):
  as the broker's own pair   {secret} -> DIR/broker.key_secret
                             and {public} to every client: SPARKBUS_BROKER_KEY={public}
  as a feeder's pair         {public} -> DIR/feeders/   (Spark tasks, the driver, sparkbus status)
  as a rank's pair           {public} -> DIR/ranks/     (BatchStream)
  then reload the broker's keys: systemctl reload sparkbus-broker, or kill -HUP <broker pid>

A client uses its own secret file and the broker's public one, by argument (key=, broker_key=) or variable:
  Spark     --conf spark.executorEnv.SPARKBUS_KEY={secret}
            --conf spark.executorEnv.SPARKBUS_BROKER_KEY=/path/to/broker.key   (and both in the driver's environment;
            the files must exist at those paths on every executor)
  mpiexec   -genv SPARKBUS_KEY {secret} -genv SPARKBUS_BROKER_KEY /path/to/broker.key   (Open MPI: -x NAME=value)
  status    sparkbus status --key {secret} --broker-key /path/to/broker.key tcp://broker-host:5557
A key in feeders/ may feed but not consume, one in ranks/ may consume but not feed."""


def run_keys(args: argparse.Namespace) -> int:
    from sparkbus.broker.auth import create_keypair

    try:
        public, secret = create_keypair(args.path)
    except AuthError as exc:
        print(f"sparkbus keys create: error: {exc}", file=sys.stderr)
        return 2
    print(KEYS_HELP.format(public=public.absolute(), secret=secret.absolute()))
    return 0


def default_control() -> str:
    """The control address of a broker with the default settings (its feed port + 2: tcp://127.0.0.1:5557)."""
    from sparkbus.wire.address import control_address

    (feed,) = [s.default for s in BROKER_SETTINGS if s.name == "feed"]
    return control_address(feed)


def run_bench(args: list[str]) -> int:
    """``sparkbus bench``: sparkbus.bench.run in this process (the hop, end to end, the user's own data)."""
    from sparkbus.bench.run import main as bench

    return bench(args)


def run_demo(args: list[str]) -> int:
    """``sparkbus demo``: sparkbus.demo.run in this process (Ctrl-C and SIGTERM reach it; it stops its children)."""
    from sparkbus.demo.run import main as demo

    return demo(args)


def main(argv: list[str] | None = None) -> int:
    from sparkbus import __version__

    parser = argparse.ArgumentParser(prog="sparkbus", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"sparkbus {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_broker_arguments(commands.add_parser("broker", help="run the broker daemon",
                                             description="Run the broker daemon in the foreground until SIGTERM or "
                                                         "SIGINT. Each setting: the flag, else its SPARKBUS_* "
                                                         "variable, else --config, else the default shown."))
    status = commands.add_parser("status", help="print a broker's live figures", formatter_class=HelpFormatter,
                                 description="Print the live figures of one broker, or of several and their totals.")
    status.add_argument("address", nargs="?", default=None,
                        help="the broker's control or ranks address, e.g. tcp://host:5557; several brokers' as a "
                             "comma-separated list (default: SPARKBUS_STATUS_ADDRESS, else the control address of a "
                             f"broker with default settings, {default_control()})")
    status.add_argument("--json", action="store_true", help="print the raw figures as JSON")
    status.add_argument("--watch", action="store_true",
                        help="redraw the live figures, with each rank's share of time waiting for data, until Ctrl-C")
    status.add_argument("--interval", type=_argument_type(parse_duration), default="1s",
                        help="time between redraws with --watch")
    status.add_argument("--timeout", type=_argument_type(parse_duration), default="5s",
                        help="how long to wait for each broker")
    status.add_argument("--key", help="this client's .key_secret file, for a broker with --auth: a feeder's key "
                                      "at the control address, a rank's at the ranks address (default: SPARKBUS_KEY)")
    status.add_argument("--broker-key", help="the broker's public .key file (default: SPARKBUS_BROKER_KEY)")
    keys = commands.add_parser("keys", help="CURVE key pairs for --auth (sparkbus keys create PATH)")
    key_commands = keys.add_subparsers(dest="keys_command", required=True, metavar="COMMAND")
    create = key_commands.add_parser("create", help="write PATH.key and PATH.key_secret and say where they go")
    create.add_argument("path", help="the files' name without suffix, e.g. keys/spark-prod")
    commands.add_parser("demo", help="run the end-to-end demo: a broker, Spark and MPI ranks on this machine "
                                     "(sparkbus demo --help)", add_help=False)
    commands.add_parser("bench", help="measure the broker hop, Spark end to end and your own data on this machine "
                                      "(sparkbus bench --help)",
                        add_help=False)
    argv = sys.argv[1:] if argv is None else argv
    passed = {"demo": run_demo, "bench": run_bench}       # their own parsers read the rest of the line
    if argv[:1] and argv[0] in passed:
        return passed[argv[0]](argv[2:] if argv[1:2] == ["--"] else argv[1:])
    args = parser.parse_args(argv)
    if args.command == "broker":
        return run_broker(args)
    if args.command == "keys":
        return run_keys(args)
    return run_status(args)


if __name__ == "__main__":
    sys.exit(main())
