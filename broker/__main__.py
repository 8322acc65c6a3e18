"""``python -m sparkbus.broker``: the broker daemon, with the same flags as ``sparkbus broker``."""

import argparse
import sys

from sparkbus.broker.cli import add_broker_arguments, run_broker

parser = argparse.ArgumentParser(prog="python -m sparkbus.broker", description="the sparkbus broker daemon")
add_broker_arguments(parser)
sys.exit(run_broker(parser.parse_args()))
