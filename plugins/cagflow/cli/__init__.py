"""The ``cagflow`` command: precompute snapshots, serve and ask the API, manage API keys and releases, run the demo."""

from __future__ import annotations

import argparse
import sys

from ..config import load_config
from ..errors import CagflowError
from . import ask, bench, keys, local, snapshots
from .common import StrictParser

# In the order `cagflow --help` lists the commands.
COMMANDS = (snapshots.add_precompute, ask.add_ask, ask.add_serve, keys.add_keys, snapshots.add_releases,
            snapshots.add_capacity, snapshots.add_model, local.add_doctor, local.add_config, bench.add_bench,
            local.add_services, local.add_trace, ask.add_demo)


def build_parser() -> argparse.ArgumentParser:
    parser = StrictParser(prog="cagflow", description=__doc__.replace("``", ""))
    parser.add_argument("--config", help="YAML config file (default: $CAGFLOW_CONFIG, then built-in defaults)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; a mistake of the user's (configuration, input, a server that does not answer) is one
    line on stderr and exit 2, never a traceback."""
    argv = sys.argv[1:] if argv is None else argv
    delegated = local.run_delegated(argv)
    if delegated is not None:
        return delegated
    args = build_parser().parse_args(argv)
    try:
        config = load_config(args.config)
        return args.run(args, config)
    except (CagflowError, ValueError, OSError) as exc:
        print(f"cagflow {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"cagflow {args.command}: interrupted", file=sys.stderr)
        return 130
