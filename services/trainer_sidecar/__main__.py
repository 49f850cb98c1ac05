"""``python -m shoal_services.trainer_sidecar``: one sidecar process for one job on one node.

The node daemon starts it and writes ``Reconfigure`` orders to its stdin, one JSON
object per line. ``--mode emulated`` (the default) runs the emulated trainer;
``--mode real`` runs the job's ``shoal.train`` workers (see ``real.py``).
End of stdin means the node daemon is gone: the sidecar stops.
A malformed order is reported on stderr and skipped; it never kills the job.
An order line may carry the W3C ``traceparent``/``tracestate`` of the node daemon's
span as extra fields: the sidecar's span for that order continues the trace.

Spare sidecars: ``--job -`` starts a sidecar for no job yet. It does the slow part
of starting (the interpreter, imports, catalog, the NATS connection; in real mode also
``torch.distributed``, which the controller's rendezvous store needs) and then waits
for its job on the first stdin line, ``{"job_id": "<id>"}`` (:data:`SPARE_JOB`,
:func:`adopt_job`). The node daemon keeps one spare ready so that a job placed on
its node starts at once instead of half a second later (a process start that, at
the time scales of emulation, is hundreds of virtual seconds). End of stdin before
that line: the spare exits 0 without having done anything.

Sidecar tokens (``SHOAL_SIDECAR_TOKENS``, :mod:`shoal.callout`): the sidecar connects
with a token for its job only, from ``SHOAL_SIDECAR_TOKEN`` (a sidecar started for its
job; removed from the environment so that workers do not inherit it) or from its
adoption line ``{"job_id": ..., "token": ...}`` (a spare, which then connects only once
adopted: before, it has no identity to connect as).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from typing import TYPE_CHECKING

import msgspec
import structlog
from shoal.bus import AuthFailed, Bus
from shoal.clock import SharedClock, make_clock
from shoal.models import get_catalog
from shoal.sim.costs import get_costs
from shoal_services.trainer_sidecar import SIDECAR_TOKEN, SPARE_JOB, Adoption
from shoal_services.trainer_sidecar.emulated import EmulatedTrainer, parse_traced_order

if TYPE_CHECKING:
    from shoal_services.trainer_sidecar.real import RealSidecar

log = structlog.get_logger("shoal.sidecar")


async def open_stdin() -> asyncio.StreamReader:
    """An asyncio reader over this process's stdin (the node daemon's pipe)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    return reader


def signal_ready(fd: int | None) -> None:
    """Tell the node daemon this (spare) sidecar is started: one byte on ``fd``."""
    if fd is None:
        return
    with contextlib.suppress(OSError):
        os.write(fd, b"1")
    with contextlib.suppress(OSError):
        os.close(fd)


async def adopt_job(reader: asyncio.StreamReader) -> str | None:
    """Wait for a spare's job (see the module docstring); ``None`` at end of stdin.

    Raises:
        ValueError: the first line is not ``{"job_id": "<non-empty id>"}``.
    """
    adoption = await adopt(reader)
    return adoption.job_id if adoption is not None else None


def take_token() -> str:
    """The sidecar token the node daemon put in this process's environment (removed
    from it, so no child inherits it); empty when there is none."""
    return os.environ.pop(SIDECAR_TOKEN, "")


def tokens_expected() -> bool:
    """Whether this sidecar authenticates with a token (``SHOAL_SIDECAR_TOKENS``)."""
    return os.environ.get("SHOAL_SIDECAR_TOKENS", "").strip().lower() in ("1", "true", "yes", "on")


async def adopt(reader: asyncio.StreamReader) -> Adoption | None:
    """Wait for a spare's adoption line (job and token); ``None`` at end of stdin.

    Raises:
        ValueError: the first line is not ``{"job_id": "<non-empty id>", ...}``.
    """
    while True:
        line = await reader.readline()
        if not line:
            return None
        if line.strip():
            break
    try:
        adoption = msgspec.json.decode(line, type=Adoption)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ValueError(f'a spare sidecar\'s first line must be {{"job_id": ...}}: {exc}') from None
    if not adoption.job_id or adoption.job_id == SPARE_JOB:
        raise ValueError(f"a spare sidecar cannot adopt job id {adoption.job_id!r}")
    return adoption


async def _read_orders(
    trainer: EmulatedTrainer | RealSidecar, stop: asyncio.Event, reader: asyncio.StreamReader | None = None
) -> None:
    if reader is None:
        reader = await open_stdin()
    while True:
        line = await reader.readline()
        if not line:
            stop.set()
            return
        if not line.strip():
            continue
        try:
            order, context = parse_traced_order(line)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            log.error("malformed_order", error=str(exc))
            continue
        if order.job_id != trainer.job_id:
            log.error("order_for_another_job", job_id=order.job_id)
            continue
        if context:
            # The trace the node daemon sent with the order; the trainer's span for it continues it.
            trainer.order_context[order.epoch] = context
        await trainer.commands.put(order)


async def main_async(args: argparse.Namespace) -> int:
    label = "spare" if args.job == SPARE_JOB else args.job
    # Credentials of the sidecar role (shoal.auth), exported by the node daemon; or,
    # with SHOAL_SIDECAR_TOKENS, a token for this job only (shoal.callout), which a
    # spare gets with its job: it connects once it has one.
    creds = args.creds or os.environ.get("SHOAL_NATS_CREDS") or os.environ.get("NATS_CREDS") or None
    token = take_token()
    with_token = tokens_expected()

    async def connect(label: str) -> Bus:
        return await Bus.connect(
            args.nats_url,
            prefix=args.prefix,
            name=f"sidecar-{label}-{args.node}",
            declare=False,
            creds=None if with_token else creds,
            token=token if with_token else None,
            tls_ca=os.environ.get("SHOAL_TLS_CA") or os.environ.get("NATS_CA") or None,
        )

    bus: Bus | None = None if with_token else await connect(label)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    catalog = get_catalog(args.catalog) if args.catalog and args.mode == "emulated" else None
    if args.mode == "real":
        import shoal_services.trainer_sidecar.real  # noqa: F401  (loaded before "ready")

        # The controller's rendezvous store needs torch.distributed, about 2 s of imports:
        # a spare takes them before "ready", not after its job was placed. Without torch,
        # the job's start reports the ImportError, as it would without a spare.
        with contextlib.suppress(ImportError):
            import torch.distributed  # noqa: F401
    stdin = await open_stdin()
    signal_ready(args.ready_fd)
    if args.job == SPARE_JOB:
        try:
            adoption = await adopt(stdin)
        except ValueError as exc:
            print(f"shoal-sidecar: {exc}", file=sys.stderr, flush=True)
            if bus is not None:
                await bus.close()
            return 2
        if adoption is None:
            if bus is not None:
                await bus.close()
            return 0
        args.job = adoption.job_id
        token = adoption.token
    if bus is None:
        try:
            bus = await connect(args.job)
        except AuthFailed as exc:
            # Not (or no longer) placed here: the node daemon starts it again if needed.
            log.warning("sidecar_not_admitted", job_id=args.job, node_id=args.node, error=str(exc))
            return 0
    if args.mode == "real":
        return await _run_real(args, bus, stop, stdin)
    trainer = EmulatedTrainer(
        bus,
        args.job,
        args.node,
        clock=SharedClock(args.clock_file)
        if args.clock_file
        else make_clock(args.time_scale, args.clock_origin),
        costs=get_costs(args.costs),
        catalog=catalog,
        report_every_s=args.report_every,
        report_max_every_s=args.report_max_every,
        measure_window_s=args.measure_window,
    )
    reader = asyncio.create_task(_read_orders(trainer, stop, stdin))
    runner = asyncio.create_task(trainer.run(stop))
    stopper = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({runner, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if runner.done() and runner.exception():
            raise runner.exception()  # type: ignore[misc]
        # After completion keep holding the GPUs until the node daemon stops us.
        await stop.wait()
        if not runner.done():
            # Let the trainer apply the orders that came with the end of stdin.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(runner), 5.0)
    finally:
        for t in (reader, runner, stopper):
            t.cancel()
        await asyncio.gather(reader, runner, stopper, return_exceptions=True)
        await bus.close()
    return 0


async def _run_real(
    args: argparse.Namespace, bus: Bus, stop: asyncio.Event, stdin: asyncio.StreamReader
) -> int:
    """``--mode real``: see :mod:`shoal_services.trainer_sidecar.real`."""
    import tempfile
    from pathlib import Path

    from shoal.train.config import TrainConfig
    from shoal_services.trainer_sidecar.real import RealSidecar, parse_devices, run_with_stdin_orders

    sidecar = RealSidecar(
        bus,
        args.job,
        args.node,
        devices=parse_devices(args.devices),
        device=args.device,
        gpu_type=args.gpu_type,
        workdir=Path(args.workdir or Path(tempfile.gettempdir()) / "shoal-train"),
        train=TrainConfig(
            device=args.device,
            collective_timeout_s=args.collective_timeout,
            rendezvous_timeout_s=args.rendezvous_timeout,
            checkpoint_every=args.checkpoint_every,
        ),
        lease_ttl_s=args.lease_ttl,
        report_every_s=args.report_every,
        report_max_every_s=args.report_max_every,
        measure_window_s=args.measure_window,
        advertise_host=args.advertise_host,
    )
    try:
        await run_with_stdin_orders(sidecar, stop, stdin)
    finally:
        await bus.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="shoal-sidecar")
    p.add_argument("--job", required=True, help=f"job id, or {SPARE_JOB} for a spare (job on stdin)")
    p.add_argument("--node", required=True)
    p.add_argument("--ready-fd", type=int, default=None, help="write one byte to this fd once started")
    p.add_argument("--nats-url", required=True)
    p.add_argument("--prefix", default="shoal")
    p.add_argument(
        "--creds", default=None, help="nkey seed file (default: $SHOAL_NATS_CREDS, $NATS_CREDS; shoal.auth)"
    )
    p.add_argument("--emulate", action="store_true", default=True)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--clock-origin", type=float, default=None)
    p.add_argument(
        "--clock-file",
        default="",
        help="a synchronized clock's file (shoal.clock.SharedClock); overrides --time-scale/--clock-origin",
    )
    p.add_argument("--costs", default="coddl")
    p.add_argument("--catalog", default="afs")
    p.add_argument("--report-every", type=float, default=0.25, help="first progress-report interval, s")
    p.add_argument(
        "--report-max-every",
        type=float,
        default=None,
        help="largest progress-report interval, s (doubling from --report-every; default: fixed)",
    )
    p.add_argument(
        "--measure-window",
        type=float,
        default=None,
        help="the profiler's measurement window, s: a report is due at its end after each change",
    )
    p.add_argument("--mode", choices=("emulated", "real"), default="emulated")
    real = p.add_argument_group("real mode (shoal.train workers)")
    real.add_argument("--devices", default="1", help="local device indices (0,1,3) or a count of CPU slots")
    real.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    real.add_argument("--gpu-type", default="cpu")
    real.add_argument("--workdir", default="")
    real.add_argument("--lease-ttl", type=float, default=3.0)
    real.add_argument("--collective-timeout", type=float, default=30.0)
    real.add_argument("--rendezvous-timeout", type=float, default=120.0)
    real.add_argument("--checkpoint-every", type=int, default=200)
    real.add_argument(
        "--advertise-host",
        default="127.0.0.1",
        help="address of this node that workers on other nodes reach (leader's control server and store)",
    )
    args = p.parse_args(argv)
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    raise SystemExit(main())
