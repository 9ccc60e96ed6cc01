"""Command line: ``python -m ignite_ext demo`` (the end-to-end demo) and ``python -m ignite_ext download``.

Only :mod:`argparse` and the download command's argument list are imported to answer ``--help`` and
``--version``; torch and ignite are imported by the demo alone, and the download machinery when a download runs.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]

# What --help prints: plain text, not the reST of the module docstring.
_DESCRIPTION = """\
ignite_ext: rank scheduling, race-free downloads and cached DDP data loading for PyTorch-Ignite.

commands:
  demo      the end-to-end demo: a generated dataset served on 127.0.0.1, fetched once per
            node directory, trained on 4 gloo ranks with a sharded sampler and a shared cache
  download  fetch a file once per filesystem, verified and atomically (safe to run from
            every rank or job prologue at once)

Run "python -m ignite_ext COMMAND --help" for a command's options."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``ignite_ext`` command line.

    Args:
        argv: arguments without the program name; ``sys.argv[1:]`` when None.

    Returns:
        The process exit status.

    Examples:
        >>> from ignite_ext.__main__ import main
        >>> main(["--version"])  # doctest: +ELLIPSIS
        ignite_ext ...
        0

    .. versionadded:: 0.1.0
    """
    from ignite_ext import __version__
    from ignite_ext.data.download.cli import add_cli_arguments

    parser = argparse.ArgumentParser(
        prog="python -m ignite_ext", description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("demo", help="run the end-to-end demo", add_help=False)
    add_cli_arguments(
        sub.add_parser(
            "download",
            help="fetch a file once per filesystem, verified and atomically",
            description="Fetch URL into ROOT once per filesystem, verified and atomically; print the path.",
        )
    )
    args, rest = parser.parse_known_args(argv)
    if args.version:
        print(f"ignite_ext {__version__}")
        return 0
    if args.command == "demo":
        from ignite_ext.demo import main as demo_main

        return demo_main(rest)
    if args.command == "download":
        from ignite_ext.data.download.cli import cli

        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        return cli(args)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
