"""Subcommands of the ``shoal`` CLI, one module each.

Every module in this package that defines ``register(subparsers)`` is discovered by
:func:`shoal.cli.main`. ``register`` adds one (or a few) parsers and sets
``func=<callable(args) -> int>`` as the parser default; the int is the exit status.
Modules import their heavy dependencies inside ``func`` so ``shoal --help`` stays fast.
"""
