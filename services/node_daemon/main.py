"""``shoal run node-daemon``: one per machine.

GPUs: ``--fake-gpus N --gpu-type T`` (``SHOAL_FAKE_GPUS``/``SHOAL_GPU_TYPE``)
presents N emulated GPUs; otherwise the GPUs NVML reports (``pip install
'shoal[nvml]'`` and an NVIDIA driver). A machine where NVML finds no GPU is a
start-up error rather than a node with zero GPUs: a daemon that registers an empty
node is almost always a misconfiguration.

The node id is ``SHOAL_NODE_ID``/``--node-id``, else the host name. Sidecars are
started as ``python -m shoal_services.trainer_sidecar.main`` (emulated trainers, the
default) and get this daemon's settings (URL, prefix, clock, cost model …) as
``SHOAL_*`` variables. With ``SHOAL_SIDECAR_MODE=real`` they are started as
``python -m shoal_services.trainer_sidecar --mode real`` and run the job's
``shoal.train`` entrypoint as real worker processes: on NVML GPUs one CUDA worker per
GPU index, on fake GPUs one CPU (gloo) worker slot per fake GPU (choice: a machine
without GPUs can still run real training end to end, which is how CI tests it).
The daemon keeps ``SHOAL_SIDECAR_SPARES`` (default 1) sidecars started ahead of need;
a job placed here takes one instead of waiting for a process start.
A job placed on several nodes has one sidecar on each; its workers run on the nodes
the placement names, and reach the leading sidecar at that node's
``SHOAL_SIDECAR_HOST`` (default ``127.0.0.1``: set it to the node's address when the
nodes are separate machines). On ``stop``
the daemon stops its sidecars (each finishes its current report) and exits; the allocator will notice the missing heartbeats and
declare the node lost if it does not come back.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec
import structlog
from shoal import events as ev
from shoal import probes
from shoal.gpus import discover_nvml, fake_gpus
from shoal.runtime import StartupError, connect_bus, make_clock, resolve_creds, resolve_nats_url
from shoal.settings import Settings
from shoal_services.node_daemon.service import NodeDaemon

log = structlog.get_logger("shoal.node_daemon")


def node_gpus(settings: Settings) -> tuple[tuple[ev.GpuInfo, ...], bool]:
    """(GPUs, emulated) for this node.

    Raises:
        StartupError: no fake GPUs asked for and NVML finds none.
    """
    if settings.fake_gpus > 0:
        return fake_gpus(settings.fake_gpus, settings.gpu_type), True
    gpus = discover_nvml()
    if not gpus:
        raise StartupError(
            "no GPUs found through NVML (install the NVIDIA driver and `pip install 'shoal[nvml]'`); "
            "use --fake-gpus N (SHOAL_FAKE_GPUS) to emulate GPUs"
        )
    return gpus, False


def sidecar_argv(
    node_id: str,
    settings: Settings | None = None,
    gpus: Sequence[ev.GpuInfo] = (),
    emulated: bool = True,
    nats_url: str = "",
) -> Callable[[str], Sequence[str]]:
    """The command line of the sidecar for one job on this node.

    Emulated sidecars get their settings from the environment (see :func:`sidecar_env`),
    and the generation of this node's GPUs as ``--gpu-type`` (their emulated speed).
    Real ones (``settings.sidecar_mode == "real"``) take theirs as flags: the server, the
    prefix, this node's devices (CUDA indices of ``gpus``, or one CPU slot per fake
    GPU), the GPU type, a work directory under the state dir for checkpoints, and the
    address workers on other nodes reach this node's sidecar at (``sidecar_host``).
    """
    if settings is None or settings.sidecar_mode == "emulated":
        # The emulated trainer runs at this generation's curve (shoal_services.trainer_sidecar.emulated).
        emulated_type = ["--gpu-type", gpus[0].gpu_type] if gpus else []

        def argv(job_id: str) -> list[str]:
            return [
                sys.executable,
                "-m",
                "shoal_services.trainer_sidecar.main",
                "--job",
                job_id,
                "--node",
                node_id,
                *emulated_type,
            ]

        return argv

    device = settings.train_device or ("cpu" if emulated else "cuda")
    if device == "cuda":
        indices = [str(g.index) for g in gpus]
        devices = ",".join(indices) + ("," if len(indices) == 1 else "")  # a list, not a count
    else:
        devices = str(len(gpus))  # CPU worker slots 0..n-1
    gpu_type = gpus[0].gpu_type if gpus else settings.gpu_type
    workdir = str(Path(settings.state_dir) / "train")

    def real_argv(job_id: str) -> list[str]:
        return [
            sys.executable, "-m", "shoal_services.trainer_sidecar", "--mode", "real",
            "--job", job_id, "--node", node_id, "--nats-url", nats_url, "--prefix", settings.prefix,
            "--devices", devices, "--device", device, "--gpu-type", gpu_type, "--workdir", workdir,
            "--lease-ttl", repr(settings.lease_ttl_s), "--report-every", repr(settings.report_every_s),
            "--report-max-every", repr(settings.report_max_every_s),
            "--measure-window", repr(settings.profiler_min_interval_s),
            "--advertise-host", settings.sidecar_host,
        ]  # fmt: skip

    return real_argv


def sidecar_env(settings: Settings, nats_url: str, sidecar_creds: str | None = None) -> dict[str, str]:
    """The ``SHOAL_*`` variables a sidecar needs to see this daemon's installation: its
    settings (flags included), the server it resolved (``NATS_URL`` too, which would
    otherwise win over ``SHOAL_NATS_URL``) and the sidecars' own credentials (never the
    daemon's: a sidecar is the narrower ``sidecar`` role of :mod:`shoal.auth`)."""
    env = settings.to_env()
    env["SHOAL_NATS_URL"] = env["NATS_URL"] = nats_url
    # daemon-only settings
    for name in (
        "SHOAL_NODE_ID",
        "SHOAL_FAKE_GPUS",
        "SHOAL_SIDECAR_SPARES",
        "SHOAL_SIDECAR_CREDS",
        "SHOAL_METRICS_PORT",  # the daemon's port; sidecars serve no probes
    ):
        env.pop(name, None)
    env.pop("SHOAL_NATS_CREDS", None)
    if sidecar_creds:
        env["SHOAL_NATS_CREDS"] = env["NATS_CREDS"] = sidecar_creds
    return env


def token_minter(node_id: str, seed: bytes) -> Callable[[str, int], str]:
    """``(job_id, log sequence) -> token`` for the sidecars of this node, signed with
    the ``sidecar-<node_id>`` seed (:func:`shoal.callout.mint_sidecar_token`).

    Raises:
        StartupError: ``seed`` is not an nkey seed.
    """
    from shoal import callout as co

    try:
        kp = co.keypair(seed)
    except co.CalloutError as exc:
        raise StartupError(f"the sidecar seed of node {node_id!r}: {exc}") from None

    def mint(job_id: str, seq: int) -> str:
        return co.mint_sidecar_token(kp, co.SidecarGrant(job_id=job_id, node_id=node_id, placement_seq=seq))

    return mint


async def serve(settings: Settings, stop: asyncio.Event) -> None:
    """Run the node daemon until ``stop`` is set."""
    gpus, emulated = node_gpus(settings)
    clock = make_clock(settings)
    node_id = settings.resolved_node_id()
    url = resolve_nats_url(settings)
    creds = resolve_creds(settings, f"node-{node_id}")
    # Sidecars are children of this process (started by NodeDaemon, which passes no
    # environment of its own), so they inherit ours: export this daemon's settings.
    sidecar_creds = settings.sidecar_creds or resolve_creds(
        msgspec.structs.replace(settings, nats_creds=None), f"sidecar-{node_id}"
    )
    mint_token = None
    if settings.sidecar_tokens:
        # The sidecars get a token per job (shoal.callout), never the seed that signs it.
        if sidecar_creds is None:
            raise StartupError(
                f"SHOAL_SIDECAR_TOKENS needs the sidecar-{node_id} seed to sign tokens (SHOAL_SIDECAR_CREDS)"
            )
        mint_token = token_minter(node_id, Path(sidecar_creds).read_bytes())
        sidecar_creds = None
    elif sidecar_creds is None and creds is not None:
        # No sidecar identity configured: the sidecars share the daemon's. That works
        # only for an identity allowed to publish job events (the admin's); with a node's
        # own identity their reports are refused (shoal.auth), so say so once.
        log.warning("sidecars_use_the_daemon_credentials", creds=creds)
        sidecar_creds = creds
    os.environ.pop("NATS_CREDS", None)
    os.environ.pop("SHOAL_SIDECAR_CREDS", None)  # the seed's path is the daemon's alone
    os.environ.pop("SHOAL_METRICS_PORT", None)  # sidecars serve no probes (and not on our port)
    os.environ.update(sidecar_env(settings, url, sidecar_creds))
    if mint_token is not None:
        for name in ("SHOAL_NATS_CREDS", "NATS_CREDS"):
            os.environ.pop(name, None)
    settings = msgspec.structs.replace(settings, nats_creds=creds)
    async with contextlib.AsyncExitStack() as resources:
        bus = await connect_bus(settings, f"node-daemon-{node_id}", identity=f"node-{node_id}")
        resources.push_async_callback(bus.close)
        daemon = NodeDaemon(
            bus,
            node_id,
            gpus,
            clock=clock,
            sidecar_argv=sidecar_argv(node_id, settings, gpus, emulated, url),
            emulated=emulated,
            heartbeat_s=settings.heartbeat_s,
            hostname=node_id,
            spares=settings.sidecar_spares,
            mint_token=mint_token,
        )
        probes.watch(bus=bus, projection=daemon.projection)
        await daemon.run(stop)
