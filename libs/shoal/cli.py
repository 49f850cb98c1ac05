"""The ``shoal`` console script.

Subcommands live in :mod:`shoal.commands`, one module each, discovered at start-up
(see that package's docstring). A user error (bad flag, unreachable server, invalid
input) ends with a one-line message on stderr and a non-zero status, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence

import shoal.commands


class CommandError(Exception):
    """A user-facing error: printed as ``shoal: <message>`` with exit status ``code``."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shoal",
        description="Elastic, fair, heterogeneity-aware scheduling of deep-learning training.",
    )
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    for info in sorted(pkgutil.iter_modules(shoal.commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"shoal.commands.{info.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(sub)
    return parser


def _logs_to_stderr() -> None:
    """Send structlog's lines to stderr (its default is stdout, which would break
    ``--json`` output). A command that configures logging itself (``shoal up``,
    ``shoal run``) replaces this with :func:`shoal.log.configure_logging`, also stderr."""
    import structlog

    # Looked up at each logger's creation, so a replaced sys.stderr (tests) is followed.
    structlog.configure(logger_factory=lambda *_: structlog.WriteLogger(sys.stderr))


def main(argv: Sequence[str] | None = None) -> int:
    _logs_to_stderr()
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args) or 0)
    except CommandError as exc:
        print(f"shoal: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
