"""The ``kiln`` command: one module per subcommand, listed here once."""

from __future__ import annotations

import argparse
import sys

from kiln.cli import bench, build, demo, inspect, ops, run, serve

TOOLS = [build, run, inspect, bench, ops, demo, serve]


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kiln", description="Build, run and inspect kiln engines.")
    sub = p.add_subparsers(dest="tool", metavar="COMMAND", required=True)
    for tool in TOOLS:
        sp = sub.add_parser(tool.NAME, help=tool.HELP, description=tool.HELP)
        tool.add_arguments(sp)
        sp.set_defaults(func=tool.main)
    return p


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        print("kiln: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # one readable line unless --verbose
        if getattr(args, "verbose", False):
            raise
        from kiln.errors import KilnError

        kind = "error" if isinstance(e, KilnError) else f"internal error ({type(e).__name__})"
        first, *rest = str(e).splitlines() or [""]
        print(f"kiln: {kind}: {first}", file=sys.stderr)
        for line in rest:
            print(f"  {line}", file=sys.stderr)
        if not isinstance(e, KilnError):
            print("  (run again with --verbose for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
