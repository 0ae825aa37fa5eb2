"""The ``gpipe`` command: ``demo``, ``report``, ``plan``, ``simulate`` and ``bubble``.

Each subcommand is a module of this package exposing ``add_arguments(parser)`` and
``run(args) -> int``, with a one-line docstring that is its help. Building the parser
imports no PyTorch (a test keeps it so): ``gpipe --help`` answers at once, and
``simulate`` and ``bubble`` never load it.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from gpipe import __version__
from gpipe.cli.options import CommandError

__all__ = ["build_parser", "main"]

_COMMANDS = {
    "demo": "gpipe.cli.demo",
    "report": "gpipe.cli.report",
    "plan": "gpipe.cli.plan",
    "simulate": "gpipe.cli.simulate",
    "bubble": "gpipe.cli.bubble_table",
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``gpipe`` command line.

    Args:
        argv: the arguments after the program name; by default ``sys.argv[1:]``.

    Returns:
        The exit code: 0 on success.

    Raises:
        SystemExit: with code 2 on arguments of the wrong form (after printing what to fix),
            or 0 after ``--help``, as argparse does. Inputs found bad later (a model that
            cannot run on the sample shape, say) print one ``gpipe <cmd>: error:`` line and
            return 2.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args))
    except CommandError as error:
        print(f"gpipe {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (| head): not an error of ours
        # NOTE: point stdout at /dev/null, or flushing it at exit raises again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand registered.

    Returns:
        The parser; each subcommand sets ``args.run`` to the function that runs it.
    """
    parser = argparse.ArgumentParser(
        prog="gpipe",
        description="Pipeline-parallel training for PyTorch: schedules, simulator, timelines.",
    )
    parser.add_argument("--version", action="version", version=f"gpipe {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in _COMMANDS.items():
        module = importlib.import_module(module_name)
        summary = (module.__doc__ or name).strip().splitlines()[0]
        sub = commands.add_parser(name, help=summary, description=summary)
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    return parser


if __name__ == "__main__":
    sys.exit(main())
