"""``shoal schemas export|check``: the JSON Schema of the event contract in ``schemas/``.

``export`` (re)writes the directory from the code; ``check`` exits 1 and lists the
stale files when the directory differs from what the code generates (CI runs the
equivalent drift test). The directory defaults to ``schemas/`` of the source
checkout this package runs from, else ``./schemas``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from shoal.cli import CommandError


def default_dir() -> Path:
    """``schemas/`` of the checkout (``libs/shoal`` -> repo root), else of the working directory."""
    repo = Path(__file__).resolve().parents[3]
    if (repo / "pyproject.toml").is_file() and (repo / "libs" / "shoal").is_dir():
        return repo / "schemas"
    return Path.cwd() / "schemas"


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "schemas",
        help="export or check the JSON Schema of every event and command",
        description="Export (or check for drift) the JSON Schema of every event, command and reply.",
    )
    sub = p.add_subparsers(dest="action", metavar="<action>", required=True)
    for name, helptext in (
        ("export", "write schemas/ from the code"),
        ("check", "exit 1 and list the files of schemas/ that are out of date"),
    ):
        q = sub.add_parser(name, help=helptext, description=helptext)
        q.add_argument(
            "--dir", type=Path, default=None, help="the schemas directory (default: the checkout's)"
        )
        q.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shoal.schema_export import export, stale_files

    directory = args.dir or default_dir()
    if args.action == "export":
        try:
            changed = export(directory)
        except OSError as exc:
            raise CommandError(f"cannot write {directory}: {exc}") from None
        print(f"{directory}: {len(changed)} file(s) updated" + (": " + ", ".join(changed) if changed else ""))
        return 0
    stale = stale_files(directory)
    if stale:
        print(
            f"{directory} is out of date with the code; run `shoal schemas export`. Stale files:",
            file=sys.stderr,
        )
        for name in stale:
            print(f"  {name}", file=sys.stderr)
        return 1
    print(f"{directory}: up to date")
    return 0
