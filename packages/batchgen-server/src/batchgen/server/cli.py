"""``batchgen-server``: ``serve`` runs the REST API."""

from __future__ import annotations

import argparse
import sys

from .serve import add_serve_arguments, serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="batchgen-server", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    add_serve_arguments(commands.add_parser("serve", help="run the Files and Batches REST API"))
    args = parser.parse_args(argv)
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
