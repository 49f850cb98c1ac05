"""``shoal up``: a whole installation on this machine, in the foreground.

Starts an embedded nats-server with JetStream (store in ``<state dir>/jetstream``,
so the log survives a restart of ``shoal up``) unless ``NATS_URL``/``--nats-url``
points at an existing NATS cluster, then every control-plane service (admission,
profiler, allocator, placer, trader) and ``--nodes`` emulated node daemons as
supervised child processes (``shoal run <service>``; a child that crashes is
restarted with backoff, at most ``SHOAL_RESTART_BUDGET`` times within
``SHOAL_RESTART_WINDOW_S``; beyond that it is given up, which is printed on stderr,
logged at error and listed under ``gave_up`` in ``up.json``). An embedded server whose
process dies is started again on the same store, port and credentials, and its new
pid written to ``up.json`` (``server_pid``). It prints the NATS URL and runs until SIGINT/SIGTERM, then
stops the children (SIGTERM: each drains its in-flight work; SIGKILL after the drain
timeout), then the server, and exits 0. Children die with it even on ``kill -9``
(``PR_SET_PDEATHSIG``), so nothing is left behind.

Choices a production user would expect:

* one ``shoal up`` per state directory: a second one is refused while the first
  runs; clients and ``shoal run`` find the server through ``<state dir>/up.json``;
* a service whose module is not in this build is skipped with a notice rather than
  crash-looping (the scheduler runs without profiler and trader: throughput then
  comes from the model catalog, and there is no GPU trading);
* with ``--time-scale`` other than 1 every child gets the same
  ``SHOAL_CLOCK_ORIGIN`` (the start instant), so all share one virtual clock;
* ``--nodes 0`` starts no node daemon (run real ones with ``shoal run node-daemon``);
* every child serves ``/healthz``, ``/readyz`` and ``/metrics`` (:mod:`shoal.probes`) on a
  port of its own (:func:`probe_ports`), printed as one ``probes:`` line per child and
  recorded under ``metrics`` in ``up.json``;
* ``running`` is printed once every child answers ``/readyz`` with 200
  (:func:`wait_ready`: caught up with the log, its role known), so a command run after
  that line finds admission answering. A child still not ready after
  :data:`READY_TIMEOUT_S` is named on stderr (with its ``/readyz`` reason) and the
  installation runs on: the supervisor keeps restarting a crashing child either way.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from shoal.cli import CommandError
from shoal.commands.run import (
    CLI_ARGV,
    CONTROL_PLANE,
    add_settings_args,
    load_settings,
    service_available,
    settings_overrides,
)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "up",
        help="start the embedded NATS server and every service on this machine",
        description=(
            "Start an embedded nats-server (unless NATS_URL is set) and all shoal services as "
            "supervised processes, plus emulated node daemons; run until Ctrl-C/SIGTERM."
        ),
    )
    p.add_argument(
        "--nodes", type=int, default=2, metavar="N", help="emulated node daemons (default 2; 0: none)"
    )
    p.add_argument(
        "--gpus-per-node", type=int, default=4, metavar="G", help="emulated GPUs per node (default 4)"
    )
    p.add_argument(
        "--gpu-type",
        default="V100",
        metavar="T[,T...]",
        help="generation of the emulated GPUs (default V100); a list (V100,K80) gives the nodes "
        "its types in turn, a heterogeneous cluster (Gandiva_fair trades between generations)",
    )
    p.add_argument("--mqtt", action="store_true", help="also open the server's MQTT listener")
    p.add_argument(
        "--mqtt-port", type=int, default=None, metavar="P", help="MQTT port (default: any free port)"
    )
    add_settings_args(p)
    p.add_argument("--in-session", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=up)


def _gpu_types(text: str) -> list[str]:
    """``--gpu-type``'s generations, in the order the nodes take them."""
    types = [t.strip() for t in text.split(",")]
    if not all(types):
        raise CommandError(f"--gpu-type: an empty generation in {text!r}")
    return types


def _check(args: argparse.Namespace) -> None:
    _gpu_types(args.gpu_type)
    if args.nodes < 0:
        raise CommandError(f"--nodes must be >= 0, got {args.nodes}")
    if args.nodes and args.gpus_per_node < 1:
        raise CommandError(f"--gpus-per-node must be >= 1, got {args.gpus_per_node}")


def up(args: argparse.Namespace) -> int:
    _check(args)
    settings = load_settings(
        **settings_overrides(args),
        gpu_type=_gpu_types(args.gpu_type)[0],
        mqtt_port=args.mqtt_port if args.mqtt_port is not None else (-1 if args.mqtt else None),
    )
    if not args.in_session:
        _preflight(settings)
        return _front(args, settings)
    from shoal.log import configure_logging

    configure_logging(settings)
    return asyncio.run(_up(args, settings))


def _preflight(settings: Any) -> None:
    """Fail now, not in a crash-looping child, on a policy, catalog or placer that cannot work.

    Raises:
        CommandError: with the reason.
    """
    from shoal_services.allocator.main import load_catalog, load_policy

    from shoal.allocation import PLACERS
    from shoal.runtime import StartupError

    try:
        load_policy(settings)
        load_catalog(settings)
    except StartupError as exc:
        raise CommandError(str(exc)) from None
    if settings.placer not in PLACERS:
        raise CommandError(f"unknown placer {settings.placer!r}; choose one of {', '.join(PLACERS)}")


def _front(args: argparse.Namespace, settings: Any) -> int:
    """Run the installation in a session of its own (see :func:`shoal.runtime.run_in_session`)."""
    from shoal.runtime import run_in_session

    argv = [
        *CLI_ARGV,
        "up",
        "--in-session",
        "--nodes",
        str(args.nodes),
        "--gpus-per-node",
        str(args.gpus_per_node),
        "--gpu-type",
        args.gpu_type,
    ]
    return run_in_session(argv, settings)


READY_TIMEOUT_S = 60.0
"""How long `shoal up` waits for every child's ``/readyz`` before it says ``running``."""


def _readyz(base: str) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(base + "/readyz", timeout=2.0) as r:
            return int(r.status), r.read().decode(errors="replace").strip()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode(errors="replace").strip()
    except OSError as exc:
        return 0, f"no answer ({exc})"


async def wait_ready(probes: dict[str, str], timeout_s: float, stop: asyncio.Event) -> dict[str, str]:
    """Poll every child's ``/readyz`` until all answer 200, ``timeout_s`` passes or
    ``stop`` is set. Returns the children not ready then, with the reason each gave."""
    pending = dict(probes)
    reasons: dict[str, str] = {}
    deadline = time.monotonic() + timeout_s
    while pending and not stop.is_set():
        names = list(pending)
        answers = await asyncio.gather(*(asyncio.to_thread(_readyz, pending[n]) for n in names))
        for name, (status, body) in zip(names, answers, strict=True):
            if status == 200:
                del pending[name]
                reasons.pop(name, None)
            else:
                reasons[name] = body or f"HTTP {status}"
        if not pending or time.monotonic() >= deadline:
            break
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.2)
    return {n: reasons.get(n, "not asked") for n in pending}


class UpVerdict:
    """``shoal up``'s own ``/readyz`` verdict: ready, or each reason it is not."""

    def __init__(self, reasons: list[str]) -> None:
        self.reasons = reasons
        self.ready = not reasons

    def body(self) -> str:
        return "ready\n" if self.ready else "not ready:\n" + "".join(f"- {r}\n" for r in self.reasons)


class UpHealth:
    """``shoal up``'s own probes (:class:`shoal.probes.ProbeServer`), for whoever
    supervises ``shoal up`` itself (systemd, a container runtime, a monitoring check):

    * ``/healthz``: 200 while the supervising process's event loop answers;
    * ``/readyz``: 200 when the embedded server runs (when there is one), no child was
      given up, and every child answers its own ``/readyz`` with 200 (asked
      concurrently, 2 s each); else 503 with one line per reason;
    * ``/metrics``: the process's default collectors, and per child
      ``shoal_up_child_running``, ``shoal_up_child_given_up`` and
      ``shoal_up_child_restarts_total``, and ``shoal_up_server_running`` (1 or 0; absent
      without an embedded server).
    """

    def __init__(self, supervisor: Any, probes: dict[str, str], server: Any, gave_up: list[str]) -> None:
        self.supervisor = supervisor
        self.probes = probes
        self.server = server
        self.gave_up = gave_up

    async def readiness(self) -> UpVerdict:
        reasons = []
        if self.server is not None and not self.server.alive():
            reasons.append("the embedded nats-server is not running")
        reasons += [f"{name}: given up (restart shoal up)" for name in self.gave_up]
        asked = [n for n in self.probes if n not in self.gave_up]
        answers = await asyncio.gather(*(asyncio.to_thread(_readyz, self.probes[n]) for n in asked))
        for name, (status, body) in zip(asked, answers, strict=True):
            if status != 200:
                first = body.splitlines()[0] if body else f"HTTP {status}"
                reasons.append(f"{name}: {first}")
        return UpVerdict(reasons)

    async def metrics(self) -> bytes:
        from prometheus_client import REGISTRY, generate_latest
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        running = GaugeMetricFamily(
            "shoal_up_child_running", "1 while the child process runs.", labels=["child"]
        )
        given_up = GaugeMetricFamily(
            "shoal_up_child_given_up", "1 once shoal up gave up restarting the child.", labels=["child"]
        )
        restarts = CounterMetricFamily(
            "shoal_up_child_restarts", "Restarts of the child since shoal up started.", labels=["child"]
        )
        for name, child in self.supervisor.children.items():
            alive = child.proc is not None and child.proc.returncode is None
            running.add_metric([name], 1 if alive else 0)
            given_up.add_metric([name], 1 if child.gave_up else 0)
            restarts.add_metric([name], child.restarts)
        families = [running, given_up, restarts]
        if self.server is not None:
            server = GaugeMetricFamily("shoal_up_server_running", "1 while the embedded nats-server runs.")
            server.add_metric([], 1 if self.server.alive() else 0)
            families.append(server)

        class _Collect:
            def collect(self) -> Any:
                yield from REGISTRY.collect()
                yield from families

        return generate_latest(_Collect())  # type: ignore[arg-type]


class Installation:
    """A running installation (see :func:`installation`)."""

    def __init__(
        self,
        settings: Any,
        url: str,
        server: Any,
        supervisor: Any,
        specs: list[Any],
        skipped: list[str],
    ) -> None:
        self.settings = settings
        """The settings the children got (``clock_origin`` set when time is scaled)."""
        self.url = url
        self.server = server
        """The embedded ``EmbeddedNats``, or None when ``settings.nats_url`` was used."""
        self.supervisor = supervisor
        self.specs = specs
        self.skipped = skipped
        """Control-plane services not in this build (not started)."""
        self.admin_creds: str | None = None
        """The admin's seed file (the embedded server's; ``settings.nats_creds`` otherwise)."""
        self.metrics: dict[str, str] = {}
        """Child name -> base URL of its probes (``/healthz``, ``/readyz``, ``/metrics``)."""
        self.gave_up: list[str] = []
        """Children the supervisor gave up restarting (also ``gave_up`` in ``up.json``)."""
        self.own_probes: str | None = None
        """Base URL of ``shoal up``'s own probes (:class:`UpHealth`; ``probes`` in
        ``up.json``); None when they could not be served."""

    def unclean_exits(self) -> dict[str, int]:
        """Children whose last exit status was neither 0 nor still running."""
        codes = {n: c.proc.returncode for n, c in self.supervisor.children.items() if c.proc is not None}
        return {n: c for n, c in codes.items() if c not in (0, None)}


def ensure_credentials(creds_dir: Path, *, nodes: int, callout: bool = False) -> None:
    """Make (if missing) the identities of a local installation (:mod:`shoal.auth`):
    the admin, every control-plane service, and a node and a sidecar identity for each
    of the ``nodes`` emulated nodes ``node0`` …; with ``callout`` also the authorizer's
    identities and the callout issuer's key (:meth:`shoal.auth.CredentialStore.ensure_callout`)."""
    from shoal.auth import SERVICE_ROLES, CredentialStore

    store = CredentialStore(creds_dir)
    store.ensure("admin")
    if callout:
        store.ensure_callout()
    for role in SERVICE_ROLES:
        store.ensure(role)
    for i in range(nodes):
        store.ensure("node", f"node{i}")
        store.ensure("sidecar", f"node{i}")


def service_specs(
    settings: Any,
    url: str,
    *,
    nodes: int,
    gpus_per_node: int,
    gpu_type: str,
    creds_dir: Path | None = None,
    callout: bool = False,
) -> tuple[list[Any], list[str]]:
    """(process specs, skipped services): every available control-plane service
    (``shoal run <service>``) and ``nodes`` emulated node daemons (node ``i`` of the
    ``i % n``-th of the ``n`` comma-separated ``gpu_type``), all with ``settings``
    as ``SHOAL_*`` variables and ``url`` as their server. With ``creds_dir`` each
    process gets the seed file of its own identity (``SHOAL_NATS_CREDS``, and a node
    daemon ``SHOAL_SIDECAR_CREDS`` for its sidecars); without, they all use
    ``settings.nats_creds`` (an operator's NATS cluster). With ``callout`` (the
    embedded server judges sidecars by the auth callout) the authorizer runs first and
    the node daemons sign a token per sidecar with ``SHOAL_SIDECAR_CREDS`` instead of
    handing it over (``SHOAL_SIDECAR_TOKENS``)."""
    from shoal.supervisor import ProcessSpec

    child_env = {**settings.to_env(), "SHOAL_NATS_URL": url}

    def env_of(identity: str, **more: str) -> dict[str, str]:
        if creds_dir is None:
            return child_env
        return {**child_env, "SHOAL_NATS_CREDS": str(creds_dir / f"{identity}.nk"), **more}

    cli = [*CLI_ARGV, "run"]
    specs: list[ProcessSpec] = []
    skipped: list[str] = []
    if callout and creds_dir is not None:
        specs.append(ProcessSpec(name="authorizer", argv=(*cli, "authorizer"), env=env_of("authorizer")))
    for name in CONTROL_PLANE:
        if service_available(name):
            specs.append(ProcessSpec(name=name, argv=(*cli, name), env=env_of(name)))
        else:
            skipped.append(name)
    types = _gpu_types(gpu_type)
    for i in range(nodes):
        node_id = f"node{i}"
        node_env = env_of(
            f"node-{node_id}",
            **({"SHOAL_SIDECAR_CREDS": str(creds_dir / f"sidecar-{node_id}.nk")} if creds_dir else {}),
            **({"SHOAL_SIDECAR_TOKENS": "true"} if callout and creds_dir else {}),
        )
        specs.append(
            ProcessSpec(
                name=f"node-daemon-{node_id}",
                argv=(
                    *cli,
                    "node-daemon",
                    "--node-id",
                    node_id,
                    "--fake-gpus",
                    str(gpus_per_node),
                    "--gpu-type",
                    types[i % len(types)],
                ),
                env=node_env,
            )
        )
    return specs, skipped


def probe_ports(settings: Any, specs: list[Any]) -> tuple[list[Any], dict[str, str]]:
    """(specs, child name -> probe URL): each child gets ``SHOAL_METRICS_PORT`` of its
    own, consecutive ports from ``settings.metrics_port`` when that is set and not 0,
    else free ports of ``settings.metrics_host`` picked now. A port stays the child's
    across its restarts, so a scraper's targets stay valid. Free ports are found by
    binding them all at once and closing them: another program could take one before
    the child binds it, and the child then exits with a start-up error saying so.

    Raises:
        CommandError: ``settings.metrics_port`` leaves too few ports below 65536.
    """
    import socket

    import msgspec

    from shoal.probes import probe_url

    host, base = settings.metrics_host, settings.metrics_port or 0
    if base:
        if base + len(specs) - 1 > 65535:
            raise CommandError(f"SHOAL_METRICS_PORT={base} leaves no room for {len(specs)} ports")
        ports = [base + i for i in range(len(specs))]
    else:
        with contextlib.ExitStack() as held:
            socks = []
            for _ in specs:
                sock = held.enter_context(socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET))
                sock.bind((host, 0))
                socks.append(sock)
            ports = [int(sock.getsockname()[1]) for sock in socks]
    out = [
        msgspec.structs.replace(spec, env={**spec.env, "SHOAL_METRICS_PORT": str(port)})
        for spec, port in zip(specs, ports, strict=True)
    ]
    return out, {spec.name: probe_url(host, port) for spec, port in zip(specs, ports, strict=True)}


@contextlib.asynccontextmanager
async def installation(
    settings: Any,
    *,
    nodes: int,
    gpus_per_node: int,
    gpu_type: str,
    store_dir: Path | None,
    stdout: int | None = None,
    stderr: int | None = None,
) -> AsyncIterator[Installation]:
    """Start a whole installation for ``settings.state_dir``; stop it on exit.

    Starts an embedded nats-server (JetStream store in ``store_dir``; a temporary one,
    removed when the server stops, when None) unless ``settings.nats_url`` is set,
    declares the streams, starts every service (:func:`service_specs`) under a
    :class:`~shoal.supervisor.Supervisor` (children's output to ``stdout``/``stderr``,
    inherited when None) and records the server in ``<state dir>/up.json``. On exit
    it stops the children (SIGTERM, each drains; SIGKILL after the drain timeout),
    removes ``up.json`` and stops the server. Used by ``shoal up`` and ``shoal demo``.

    Raises:
        CommandError: another installation runs for the state dir, or the server
            cannot be started or reached.
    """
    import msgspec

    from shoal.nats_server import EmbeddedNats, NatsServerError
    from shoal.runtime import CREDS_DIR, NATS_VARIABLES, read_up_info, remove_up_info, write_up_info
    from shoal.supervisor import Supervisor

    state_dir = Path(settings.state_dir)
    running = read_up_info(state_dir)
    if running is not None:
        raise CommandError(
            f"shoal up is already running for {state_dir} (pid {running.get('pid')}, {running.get('url')})"
        )
    if settings.time_scale != 1.0 and settings.clock_origin is None:
        settings = msgspec.structs.replace(settings, clock_origin=time.time())

    server: EmbeddedNats | None = None
    creds_dir: Path | None = None
    if settings.nats_url:
        url = settings.nats_url
        admin_creds = settings.nats_creds
    else:
        creds_dir = state_dir / CREDS_DIR
        ensure_credentials(creds_dir, nodes=nodes, callout=settings.auth_callout)
        admin_creds = str(creds_dir / "admin.nk")
        if bool(settings.tls_cert) != bool(settings.tls_key) or (settings.tls_cert and not settings.tls_ca):
            raise CommandError(
                "TLS needs SHOAL_TLS_CERT, SHOAL_TLS_KEY and SHOAL_TLS_CA (the CA the services verify it with)"
            )
        server = EmbeddedNats(
            store_dir=store_dir,
            mqtt_port=settings.mqtt_port,
            creds_dir=creds_dir,
            prefix=settings.prefix,
            tls_cert=settings.tls_cert,
            tls_key=settings.tls_key,
            sync_interval=settings.sync_interval,
            callout=settings.auth_callout,
        )
        try:
            server.start()
        except NatsServerError as exc:
            raise CommandError(str(exc)) from None
        url = server.url
    if settings.nats_url and settings.mqtt_port is not None:
        print(
            "note: --mqtt applies to the embedded server only; NATS_URL is set, so it is ignored", flush=True
        )
    try:
        await _declare(url, settings.prefix, admin_creds, settings.tls_ca, settings.replicas)
        specs, skipped = service_specs(
            settings,
            url,
            nodes=nodes,
            gpus_per_node=gpus_per_node,
            gpu_type=gpu_type,
            creds_dir=creds_dir,
            callout=settings.auth_callout and server is not None,
        )
        specs, metrics = probe_ports(settings, specs)
        base_env = {
            k: v for k, v in os.environ.items() if not k.startswith("SHOAL_") and k not in NATS_VARIABLES
        }
        gave_up: list[str] = []

        own_probes: list[str] = []

        def record() -> None:
            write_up_info(
                state_dir,
                url,
                prefix=settings.prefix,
                server_pid=server.proc.pid if server is not None and server.proc is not None else None,
                mqtt_port=server.mqtt_listen_port if server is not None else None,
                creds_dir=str(creds_dir) if creds_dir is not None else None,
                metrics=metrics,
                probes=own_probes[0] if own_probes else None,
                gave_up=gave_up,
            )

        def on_give_up(name: str, code: int) -> None:
            gave_up.append(name)
            print(
                f"shoal up: gave up restarting {name}: it exited ({code}) again after "
                f"{settings.restart_budget} restarts within {settings.restart_window_s:g} s; "
                "it stays down until shoal up is restarted",
                file=sys.stderr,
                flush=True,
            )
            record()

        supervisor = Supervisor(
            specs,
            base_env=base_env,
            max_restarts=settings.restart_budget,
            window_s=settings.restart_window_s,
            on_give_up=on_give_up,
            stdout=stdout,
            stderr=stderr,
        )
        record()
        watcher = asyncio.create_task(_watch_server(server, record)) if server is not None else None
        compactor = (
            asyncio.create_task(
                _compact_periodically(
                    settings.compact_every_s,
                    settings.compact_after_s,
                    {
                        **base_env,
                        "NATS_URL": url,
                        "SHOAL_PREFIX": settings.prefix,
                        **({"NATS_CREDS": admin_creds} if admin_creds else {}),
                        **({"NATS_CA": settings.tls_ca} if settings.tls_ca else {}),
                    },
                )
            )
            if settings.compact_every_s > 0
            else None
        )
        own = None
        try:
            await supervisor.start()
            inst = Installation(settings, url, server, supervisor, specs, skipped)
            inst.admin_creds = admin_creds
            inst.metrics = metrics
            inst.gave_up = gave_up
            own = await _serve_own_probes(settings, inst)
            if own is not None:
                inst.own_probes = own.url
                own_probes.append(own.url)
                record()
            yield inst
        finally:
            if own is not None:
                await own.stop()
            await supervisor.stop(timeout_s=settings.drain_timeout_s + 5.0)
            for task in (watcher, compactor):
                if task is not None:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
    finally:
        remove_up_info(state_dir)
        if server is not None:
            server.stop()


async def _compact_periodically(every_s: float, older_than_s: float, env: dict[str, str]) -> None:
    """Every ``every_s`` wall seconds, run ``shoal compact --older-than older_than_s``
    (:mod:`shoal.commands.compact`) as a child process with ``env`` (the admin's
    credentials), so that its two folds of the log never hold up this process's event
    loop. Its summary, or its failure, is logged; a run still going after ``every_s`` (at
    least 10 minutes) is killed and logged; a failure waits for the next period."""
    import structlog

    from shoal.commands.run import CLI_ARGV

    log = structlog.get_logger("shoal.up")
    limit_s = max(every_s, 600.0)
    while True:
        await asyncio.sleep(every_s)
        started = time.monotonic()
        proc = None
        try:
            proc = await asyncio.create_subprocess_exec(
                *CLI_ARGV,
                "compact",
                "--older-than",
                repr(older_than_s),
                env=env,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            out, err = await asyncio.wait_for(proc.communicate(), limit_s)
        except Exception as exc:  # a timeout, or no process at all: try again next period
            log.warning("log_compaction_failed", error=repr(exc), took_s=round(time.monotonic() - started, 2))
            continue
        finally:  # timed out, failed or cancelled (shoal up stopping): no child left behind
            if proc is not None and proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        took = round(time.monotonic() - started, 2)
        if proc.returncode == 0:
            log.info("log_compacted", summary=out.decode(errors="replace").strip(), took_s=took)
        else:
            log.warning(
                "log_compaction_failed",
                returncode=proc.returncode,
                error=err.decode(errors="replace").strip()[-2000:],
                took_s=took,
            )


async def _watch_server(server: Any, record: Any, poll_s: float = 0.5) -> None:
    """Restart the embedded server whenever its process dies (same store, port and
    configuration: :meth:`~shoal.nats_server.EmbeddedNats.restart`), with a backoff
    while it fails to come up; each death and restart is logged and printed on stderr,
    and ``record()`` rewrites ``up.json`` (the new ``server_pid``)."""
    import structlog

    from shoal.nats_server import NatsServerError

    log = structlog.get_logger("shoal.up")
    restarts = 0
    pid = server.proc.pid if server.proc is not None else None
    while True:
        await asyncio.sleep(poll_s)  # the server is a subprocess.Popen: poll its exit
        if server.alive():
            if server.proc.pid != pid:  # restarted by a reload (auth callout: EmbeddedNats.reload)
                pid = server.proc.pid
                record()
            continue
        code = server.proc.returncode if server.proc is not None else None
        log.error("nats_server_died", returncode=code)
        print(f"shoal up: the NATS server exited ({code}); restarting it", file=sys.stderr, flush=True)
        delay = 0.5
        while True:
            try:
                await asyncio.to_thread(server.restart)
                break
            except NatsServerError as exc:
                log.error("nats_server_restart_failed", error=str(exc), retry_in_s=delay)
                await asyncio.sleep(delay)
                delay = min(10.0, delay * 2)
        restarts += 1
        pid = server.proc.pid
        log.warning("nats_server_restarted", pid=server.proc.pid, url=server.url, restarts=restarts)
        print(f"shoal up: NATS server restarted (pid {server.proc.pid}, {server.url})", file=sys.stderr)
        record()


async def _up(args: argparse.Namespace, settings: Any) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals: list[int] = []

    def on_signal(signum: int) -> None:
        signals.append(signum)
        if len(signals) > 1:  # a second signal: do not wait for the drain
            os._exit(128 + signum)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    state_dir = Path(settings.state_dir)
    reload_server: list[Any] = []

    def on_hangup() -> None:
        # `shoal creds add` added an identity: admit it without a restart.
        from shoal.nats_server import NatsServerError

        for server in reload_server:
            try:
                server.reload()
            except NatsServerError as exc:
                print(f"shoal up: credentials not reloaded: {exc}", file=sys.stderr, flush=True)
            else:
                print("credentials reloaded", flush=True)

    loop.add_signal_handler(signal.SIGHUP, on_hangup)
    try:
        async with installation(
            settings,
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            gpu_type=args.gpu_type,
            store_dir=state_dir / "jetstream",
        ) as inst:
            server = inst.server
            if server is not None:
                reload_server.append(server)
            print(f"NATS: {inst.url}", flush=True)
            if server is not None and server.mqtt_listen_port is not None:
                print(f"MQTT: mqtt://127.0.0.1:{server.mqtt_listen_port}", flush=True)
            print(
                f"prefix: {settings.prefix}  policy: {settings.policy}  time scale: {settings.time_scale:g}"
            )
            print(f"services: {', '.join(s.name for s in inst.specs)}")
            for name, probe in inst.metrics.items():
                print(f"probes: {name} {probe} (/healthz /readyz /metrics)")
            if inst.skipped:
                print(f"not in this build, skipped: {', '.join(inst.skipped)}")
            print(f"state dir: {state_dir}")
            if inst.admin_creds:
                print(f"credentials: {Path(inst.admin_creds).parent} (admin: {inst.admin_creds})")
            if inst.own_probes:
                print(f"supervisor probes: {inst.own_probes} (/healthz /readyz /metrics)", flush=True)
            late = await wait_ready(inst.metrics, READY_TIMEOUT_S, stop)
            for name, reason in sorted(late.items() if not stop.is_set() else ()):
                print(
                    f"shoal up: {name} not ready after {READY_TIMEOUT_S:g} s: {reason}",
                    file=sys.stderr,
                    flush=True,
                )
            print("running; Ctrl-C to stop", flush=True)
            await stop.wait()
            print("stopping …", flush=True)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
    unclean = inst.unclean_exits()
    if unclean:
        print(f"children that did not exit cleanly: {unclean}", file=sys.stderr, flush=True)
    print("stopped", flush=True)
    return 0


async def _serve_own_probes(settings: Any, inst: Installation) -> Any:
    """Serve ``shoal up``'s own probes (:class:`UpHealth`) on ``settings.metrics_host``,
    port ``settings.metrics_port`` + the number of children when that is set (the port
    after the children's), else a free one. None, with a note on stderr, when the
    address cannot be bound: the installation runs on without them."""
    from shoal.probes import ProbeServer

    port = settings.metrics_port + len(inst.specs) if settings.metrics_port else 0
    health = UpHealth(inst.supervisor, inst.metrics, inst.server, inst.gave_up)
    server = ProbeServer(health, settings.metrics_host, port)
    try:
        await server.start()
    except OSError as exc:
        print(
            f"shoal up: its own probes not served on {settings.metrics_host}:{port}: {exc.strerror or exc}",
            file=sys.stderr,
            flush=True,
        )
        return None
    return server


async def _declare(
    url: str, prefix: str, creds: str | None, tls_ca: str | None = None, replicas: int | None = None
) -> None:
    """Create the streams once, as the admin, before the services start (each would race to)."""
    from shoal.bus import Bus, NoServerError

    try:
        bus = await Bus.connect(
            url, prefix=prefix, name="shoal-up", creds=creds, tls_ca=tls_ca, replicas=replicas
        )
    except NoServerError as exc:
        raise CommandError(f"{exc} (check NATS_URL)") from None
    await bus.close()
