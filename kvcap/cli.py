"""`kvcap <command>`: a thin dispatcher; each command lives in kvcap/commands/<name>.py."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMANDS = [
    "demo", "generate", "calibrate", "envelope", "overlay", "materialize", "verify",
    "compare", "capacity", "serve", "bench",
]


def _load(name: str):
    return importlib.import_module(f"kvcap.commands.{name}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvcap", description="Calibrated FP8 E4M3 KV-cache inference engine.")
    # one or the other (`kvcap [-v | -q]`): both were taken and -q silently ignored
    level = parser.add_mutually_exclusive_group()
    level.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    level.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            mod = _load(name)
        except ModuleNotFoundError as e:
            if e.name != f"kvcap.commands.{name}":
                raise
            continue  # command not shipped in this build
        p = sub.add_parser(name, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


# What to do about missing scales, appended to the gate's own message on the CLI.
GATE_HINT = ("an E4M3 KV cache needs calibrated scales: kvcap calibrate -> kvcap overlay -> "
             "kvcap materialize (or --kv-scales PACK); `kvcap demo` runs the whole chain; "
             "--kv-cache-dtype auto runs without E4M3")


def main(argv: list[str] | None = None) -> int:
    from kvcap.errors import KvcapError, ScaleGateError

    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except KvcapError as e:
        hint = f"; {GATE_HINT}" if isinstance(e, ScaleGateError) and " Missing: " in str(e) else ""
        print(f"error: {e}{hint}", file=sys.stderr)  # one line, whatever went wrong
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except OSError as e:
        # a path the system refuses (no such directory, permission, read-only or full disk):
        # one line naming it, not a traceback from inside a write; -v logs the traceback
        logging.getLogger("kvcap").debug("traceback", exc_info=True)
        where = " -> ".join(str(f) for f in (e.filename, e.filename2) if f is not None)
        print(f"error: {where + ': ' if where else ''}{e.strerror or e} (check that the path "
              "exists and is readable / writable)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
