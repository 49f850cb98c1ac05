"""``shoal run <service>``: run one service in the foreground.

Every service is a module ``shoal_services.<name>.main`` with
``async def serve(settings, stop)`` (or ``configure(argv) -> serve`` when it takes
arguments of its own, as the trainer sidecar does). Settings come from ``SHOAL_*``
variables, overridden by the flags below; the process runs under
:func:`shoal.runtime.run_service` (logging, tracing, SIGTERM/SIGINT draining).
A service whose module does not exist yet is an honest error, not a silent no-op.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from types import MappingProxyType
from typing import Any

from shoal.cli import CommandError

SERVICES: MappingProxyType[str, tuple[str, str]] = MappingProxyType(
    {
        "admission": ("shoal_services.admission.main", "validates commands and appends jobs to the log"),
        "profiler": ("shoal_services.profiler.main", "fits throughput and convergence models from progress"),
        "allocator": ("shoal_services.allocator.main", "decides every job's share of GPUs (leader-elected)"),
        "placer": ("shoal_services.placer.main", "turns shares into concrete GPUs (leader-elected)"),
        "trader": ("shoal_services.trader.main", "trades GPU generations between users"),
        "authorizer": (
            "shoal_services.authorizer.main",
            "answers the auth callout: per-job sidecar identities",
        ),
        "node-daemon": ("shoal_services.node_daemon.main", "one per machine: GPUs and sidecars"),
        "trainer-sidecar": ("shoal_services.trainer_sidecar.main", "one job's trainer on one node"),
    }
)
"""Service name -> (module, one-line description)."""

#: How to start the CLI in a child process. Not ``python -m shoal.cli``: that runs the
#: module as ``__main__`` next to ``shoal.cli``, and the commands' ``CommandError``
#: would then not be the class ``main`` catches.
CLI_ARGV: tuple[str, ...] = (sys.executable, "-c", "import sys; from shoal.cli import main; sys.exit(main())")

#: The services `shoal up` starts once each (node daemons are started per node).
CONTROL_PLANE: tuple[str, ...] = ("admission", "profiler", "allocator", "placer", "trader")


def service_available(name: str) -> bool:
    """Whether the module of service ``name`` exists (without importing it)."""
    module = SERVICES[name][0]
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def add_settings_args(parser: argparse.ArgumentParser) -> None:
    """The flags that override ``SHOAL_*`` settings (shared by run, up and demo)."""
    g = parser.add_argument_group("settings (override SHOAL_* variables)")
    g.add_argument(
        "--nats-url", metavar="URL", help="NATS server (default $NATS_URL, else the `shoal up` server)"
    )
    g.add_argument("--prefix", help="subject/stream prefix of the installation (default shoal)")
    g.add_argument("--state-dir", metavar="DIR", help="state directory (default: per-user state dir)")
    g.add_argument("--policy", help="allocation policy (default afs-p)")
    g.add_argument(
        "--policy-param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="policy constructor argument; VALUE is JSON if it parses, else a string (repeatable)",
    )
    g.add_argument("--time-scale", type=float, metavar="X", help="virtual seconds per wall second")
    g.add_argument("--log-level", help="debug, info, warning, error")
    g.add_argument("--log-format", help="auto, json or pretty")


def parse_policy_params(items: list[str]) -> dict[str, Any] | None:
    """``["k=v", ...]`` -> dict, values parsed as JSON when they parse.

    Raises:
        CommandError: an item without ``=``.
    """
    if not items:
        return None
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise CommandError(f"--policy-param expects KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(text)
        except json.JSONDecodeError:
            out[key] = text
    return out


def settings_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the common flags override (None = not given)."""
    return {
        "nats_url": args.nats_url,
        "prefix": args.prefix,
        "state_dir": args.state_dir,
        "policy": args.policy,
        "policy_params": parse_policy_params(args.policy_param),
        "time_scale": args.time_scale,
        "log_level": args.log_level,
        "log_format": args.log_format,
    }


def load_settings(**overrides: Any) -> Any:
    """``Settings.load`` with a settings error turned into a CLI error."""
    from shoal.settings import Settings, SettingsError, unknown_variables

    try:
        settings = Settings.load(**overrides)
    except SettingsError as exc:
        raise CommandError(str(exc)) from None
    for variable in unknown_variables():
        print(f"shoal: warning: unknown setting {variable} is ignored", file=sys.stderr, flush=True)
    return settings


def _epilog() -> str:
    width = max(len(n) for n in SERVICES)
    lines = ["services:"]
    lines += [f"  {name:<{width}}  {desc}" for name, (_, desc) in SERVICES.items()]
    return "\n".join(lines)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "run",
        help="run one service in the foreground",
        description="Run one shoal service in the foreground until SIGTERM/SIGINT (drains in-flight work).",
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("service", metavar="SERVICE", help="one of: " + ", ".join(SERVICES))
    add_settings_args(p)
    g = p.add_argument_group("node-daemon")
    g.add_argument("--node-id", help="node id (default: host name)")
    g.add_argument("--fake-gpus", type=int, metavar="N", help="present N emulated GPUs instead of NVML's")
    g.add_argument("--gpu-type", help="generation of the emulated GPUs (default V100)")
    g.add_argument("--clock-origin", type=float, metavar="T", help="shared origin of the scaled clock")
    g = p.add_argument_group("trainer-sidecar")
    g.add_argument("--job", help="job id")
    g.add_argument("--node", help="node id")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    name = args.service
    if name not in SERVICES:
        raise CommandError(f"unknown service {name!r}; services: {', '.join(SERVICES)}")
    module_name = SERVICES[name][0]
    if not service_available(name):
        raise CommandError(f"service {name} is not implemented yet (no module {module_name})", code=3)
    settings = load_settings(
        **settings_overrides(args),
        node_id=args.node_id,
        fake_gpus=args.fake_gpus,
        gpu_type=args.gpu_type,
        clock_origin=args.clock_origin,
    )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise CommandError(f"service {name}: cannot import {module_name}: {exc!r}", code=3) from None
    from shoal.runtime import StartupError, run_service

    configure = getattr(module, "configure", None)
    if configure is not None:
        extra: list[str] = []
        if args.job is not None:
            extra += ["--job", args.job]
        if args.node is not None:
            extra += ["--node", args.node]
        try:
            serve = configure(extra)
        except StartupError as exc:
            raise CommandError(str(exc)) from None
    else:
        if args.job is not None or args.node is not None:
            raise CommandError(f"--job/--node are options of trainer-sidecar, not of {name}")
        serve = getattr(module, "serve", None)
        if serve is None:
            raise CommandError(f"service {name}: {module_name} has no serve(settings, stop)", code=3)
    return run_service(serve, settings, service_name=name)
