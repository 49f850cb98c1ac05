"""``shoal native``: build, inspect or remove the compiled build of the hot modules.

Example::

    shoal native build     # mypyc, about 3 minutes on 2 cores; needs a C compiler
    shoal native status    # whether ``import shoal`` uses it, and which modules
    shoal native clean

See :mod:`shoal.native`: the build is of the same sources, applies only while they are
unchanged, and ``SHOAL_NATIVE=0`` turns it off.
"""

from __future__ import annotations

import argparse
import shutil

from shoal.cli import CommandError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "native",
        help="compile the simulator's hot modules with mypyc (optional, same sources)",
        description="Build, show or remove the compiled build of shoal's hot modules (shoal.native).",
    )
    p.add_argument("action", choices=("build", "status", "clean"))
    p.set_defaults(func=run, logs=False)


def run(args: argparse.Namespace) -> int:
    from shoal import native

    where = native.native_dir()
    if args.action == "build":
        try:
            import mypyc  # noqa: F401  # installed with mypy
        except ImportError as exc:
            raise CommandError("building needs mypy (which ships mypyc): pip install mypy") from exc
        print(f"compiling {len(native.NATIVE_MODULES)} modules into {where} ...", flush=True)
        try:
            native.build(where)
        except native.NativeBuildError as exc:
            raise CommandError(str(exc), code=1) from exc
        except OSError as exc:
            raise CommandError(f"cannot write {where}: {exc}", code=1) from exc
        print("built; `import shoal` uses it from the next process on")
        return 0
    if args.action == "clean":
        shutil.rmtree(where, ignore_errors=True)
        print(f"removed {where}")
        return 0
    state, modules = native.status(where)
    print(f"{where}: {state}")
    for name in modules:
        print(f"  {name}")
    return 0 if state in ("active", "none") or state.startswith("off") else 1
