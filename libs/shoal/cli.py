"""The ``shoal`` console script.

Subcommands live in :mod:`shoal.commands`, one module each, discovered at start-up
(see that package's docstring). A user error (bad flag, unreachable server, invalid
input) ends with a one-line message on stderr and a non-zero status, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
from collections.abc import Sequence

import shoal.commands


class CommandError(Exception):
    """A user-facing error: printed as ``shoal: <message>`` with exit status ``code``."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser with every command, or only ``command``'s module when it has one of
    that name that registers it (importing every command module costs more CPU than a
    short simulation: NATS, asyncio, Rich)."""
    if command:
        module = command.replace("-", "_")
        if not module.startswith("_") and any(
            m.name == module for m in pkgutil.iter_modules(shoal.commands.__path__)
        ):
            parser, sub = _parser()
            _register(sub, module)
            if command in sub.choices:
                return parser
    parser, sub = _parser()
    for info in sorted(pkgutil.iter_modules(shoal.commands.__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            _register(sub, info.name)
    return parser


def _parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    parser = argparse.ArgumentParser(
        prog="shoal",
        description="Elastic, fair, heterogeneity-aware scheduling of deep-learning training.",
    )
    return parser, parser.add_subparsers(dest="command", metavar="<command>")


def _register(sub: argparse._SubParsersAction, module_name: str) -> None:
    module = importlib.import_module(f"shoal.commands.{module_name}")
    register = getattr(module, "register", None)
    if register is not None:
        register(sub)


def _logs_to_stderr() -> None:
    """Send structlog's lines to stderr (its default is stdout, which would break
    ``--json`` output). A command that configures logging itself (``shoal up``,
    ``shoal run``) replaces this with :func:`shoal.log.configure_logging`, also stderr."""
    import logging

    import structlog

    # Looked up at each logger's creation, so a replaced sys.stderr (tests) is followed.
    # Info and above: a client command's debug lines are noise to whoever runs it.
    structlog.configure(
        logger_factory=lambda *_: structlog.WriteLogger(sys.stderr),
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv[0] if argv and not argv[0].startswith("-") else None)
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    # A command that never logs (it sets ``logs=False``: nothing it imports uses
    # structlog) skips importing structlog, which pulls in Rich and asyncio.
    if getattr(args, "logs", True):
        _logs_to_stderr()
    try:
        code = int(func(args) or 0)
        sys.stdout.flush()  # a closed pipe surfaces here, not at the interpreter's exit
        return code
    except BrokenPipeError:
        # The reader went away (`shoal native status | head -1`): not an error. Point
        # stdout at /dev/null so that the interpreter's last flush does not fail too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except CommandError as exc:
        from shoal.explain import printable  # a rejection may quote what the sender sent

        print(f"shoal: {printable(str(exc))}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
