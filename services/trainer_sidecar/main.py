"""The trainer sidecar as a shoal process: ``shoal run trainer-sidecar --job J --node N``
or ``python -m shoal_services.trainer_sidecar.main --job J --node N`` (how the node
daemon of ``shoal run node-daemon`` starts it: no CLI import, same start-up cost).

It runs the emulated trainer of ``shoal_services.trainer_sidecar`` under
:func:`shoal.runtime.run_service`: settings from ``SHOAL_*`` (the node daemon exports
its own), structured logs on stderr, tracing, SIGTERM draining. Orders
(``Reconfigure``, one JSON object per line) are read from stdin; end of stdin (the
node daemon is gone or closed it) stops the sidecar. ``--job -`` starts a spare that
takes its job from its first stdin line (see ``shoal_services.trainer_sidecar.__main__``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import structlog
from shoal.runtime import StartupError, connect_bus, make_clock
from shoal.settings import Settings

if TYPE_CHECKING:
    from shoal.bus import Bus

Serve = Callable[[Settings, asyncio.Event], Coroutine[Any, Any, None]]


def configure(argv: Sequence[str]) -> Serve:
    """Parse the sidecar's own arguments and return its ``serve``.

    Raises:
        StartupError: missing or invalid arguments.
    """
    parser = argparse.ArgumentParser(prog="shoal run trainer-sidecar", add_help=False, exit_on_error=False)
    parser.add_argument("--job", required=True)  # "-": a spare, its job comes on stdin
    parser.add_argument("--node", required=True)
    parser.add_argument("--ready-fd", type=int, default=None)  # spares: one byte here once started
    parser.add_argument("--gpu-type", default="")  # this node's GPU generation (the emulated speed)
    try:
        args = parser.parse_args(list(argv))
    except (argparse.ArgumentError, SystemExit) as exc:
        raise StartupError(f"trainer-sidecar needs --job JOB_ID --node NODE_ID ({exc})") from None

    async def serve(settings: Settings, stop: asyncio.Event) -> None:
        from shoal.models import get_catalog
        from shoal.sim.costs import get_costs
        from shoal.tasks import critical
        from shoal_services.trainer_sidecar import SPARE_JOB
        from shoal_services.trainer_sidecar.__main__ import (
            _read_orders,
            adopt,
            open_stdin,
            signal_ready,
            take_token,
        )
        from shoal_services.trainer_sidecar.emulated import EmulatedTrainer

        try:
            costs = get_costs(settings.costs)
            catalog = get_catalog(settings.catalog) if settings.catalog else None
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        clock = make_clock(settings)
        async with contextlib.AsyncExitStack() as resources:
            spare = args.job == SPARE_JOB
            label = "spare" if spare else args.job
            # With sidecar tokens (shoal.callout) the identity is the job's: a spare
            # connects once its adoption line names the job and brings the token.
            token = take_token() if settings.sidecar_tokens else None

            async def connect(label: str) -> Bus | None:
                """The bus; None when the server refused this sidecar's token (its job
                is not, or no longer, placed on this node: a placement that moved the
                job away may come between the daemon's decision and this connection).
                The node daemon starts the sidecar again if the job still needs one."""
                if token:
                    try:
                        bus = await connect_bus(
                            settings,
                            f"sidecar-{label}-{args.node}",
                            declare=False,
                            token=token,
                        )
                    except StartupError as exc:
                        structlog.get_logger("shoal.trainer_sidecar").warning(
                            "sidecar_not_admitted", job_id=label, node_id=args.node, error=str(exc)
                        )
                        return None
                    resources.push_async_callback(bus.close)
                    return bus
                bus = await connect_bus(
                    settings,
                    f"sidecar-{label}-{args.node}",
                    declare=False,
                    identity=f"sidecar-{args.node}",
                )
                resources.push_async_callback(bus.close)
                return bus

            early = None if settings.sidecar_tokens and spare else await connect(label)
            if early is None and not (settings.sidecar_tokens and spare):
                return
            stdin = await open_stdin()
            signal_ready(args.ready_fd)
            job_id: str | None = args.job
            if spare:
                try:
                    adoption = await adopt(stdin)
                except ValueError as exc:
                    raise StartupError(str(exc)) from None
                if adoption is None:
                    return  # a spare the node daemon never needed
                job_id = adoption.job_id
                if settings.sidecar_tokens:
                    token = adoption.token
            assert job_id is not None
            bus = early if early is not None else await connect(job_id)
            if bus is None:
                return
            trainer = EmulatedTrainer(
                bus,
                job_id,
                args.node,
                clock=clock,
                costs=costs,
                catalog=catalog,
                report_every_s=settings.report_every_s,
                report_max_every_s=settings.report_max_every_s,
                measure_window_s=settings.profiler_min_interval_s,
                gpu_type=args.gpu_type,
            )
            reader = critical(asyncio.create_task(_read_orders(trainer, stop, stdin)))
            runner = asyncio.create_task(trainer.run(stop))
            stopper = asyncio.create_task(stop.wait())
            try:
                await asyncio.wait({runner, stopper}, return_when=asyncio.FIRST_COMPLETED)
                if runner.done() and runner.exception() is not None:
                    raise runner.exception()  # type: ignore[misc]
                # A completed job keeps its sidecar until the node daemon stops it.
                await stop.wait()
                # Let the trainer finish the report or reconfiguration step in flight.
                await asyncio.wait({runner}, timeout=settings.report_every_s + 2.0)
            finally:
                for t in (reader, runner, stopper):
                    t.cancel()
                await asyncio.gather(reader, runner, stopper, return_exceptions=True)

    return serve


def main(argv: Sequence[str] | None = None) -> int:
    """Process entry point; returns the exit status (see :func:`shoal.runtime.run_service`)."""
    from shoal.runtime import run_service
    from shoal.settings import SettingsError

    args = list(sys.argv[1:] if argv is None else argv)
    try:
        settings = Settings.load()
        serve = configure(args)
    except (SettingsError, StartupError) as exc:
        print(f"shoal: trainer-sidecar: {exc}", file=sys.stderr, flush=True)
        return 2
    if "--node" in args[:-1]:  # the sidecar's node names it in traces (configure checked it)
        settings = msgspec.structs.replace(settings, node_id=args[args.index("--node") + 1])
    return run_service(serve, settings, service_name="trainer-sidecar")


if __name__ == "__main__":
    raise SystemExit(main())
