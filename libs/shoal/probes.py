"""``/healthz``, ``/readyz`` and ``/metrics`` of one service process.

:func:`shoal.runtime.run_service` starts :class:`ProbeServer` when
``settings.metrics_port`` is set (``SHOAL_METRICS_PORT``; 0: any free port) on
``settings.metrics_host`` (``SHOAL_METRICS_HOST``, default ``127.0.0.1``), and makes
its :class:`Health` current for the service (:func:`current`); the service's
``serve`` tells it what to report with :func:`watch` (its bus, its projection and,
for a leader-elected service, its role). Without a port nothing listens and
:func:`watch` does nothing.

* ``GET /healthz``: ``200 ok`` whenever the process's event loop answers. A stuck
  loop does not answer at all, and the probe's timeout is the verdict.
* ``GET /readyz``: ``200`` when :func:`shoal.health.judge_readiness` says ready,
  else ``503``; the body says why. The probe reads the stream's last sequence (at
  most :data:`PROBE_TIMEOUT_S`) and gives the projection as long again to fold up to
  it, so a service that keeps up with a busy log is ready and one that cannot reach
  its server, or lags, is not.
* ``GET /metrics``: the Prometheus text format, written by ``prometheus_client``
  (``generate_latest``): the process-wide default registry (process and Python
  collectors, the allocator's decision counter and latency histogram) and this
  process's own: the gauges of the folded state (:func:`shoal.health.state_gauges`;
  AFS §2.2's QL, CE and BI at the installation's clock, ``settings.time_scale`` and
  ``clock_origin``, with the allocator's fallback curves, ``settings.catalog``),
  bus lag, applied and tail sequence, the folded state's digest at that sequence
  (``shoal_state_digest``, so a harness can compare it with a fresh fold),
  dead-lettered messages, readiness, lease holder, and histograms of the reconfiguration phase durations and reconfiguration
  durations as the ``ReconfigurationPhase``/``ReconfigurationCompleted`` events folded
  by this process report them (every event folded, the replay included).

Why a small asyncio HTTP handler and not ``prometheus_client.start_http_server``: that
server answers from a thread of its own, so ``/healthz`` would say "alive" while the
service's event loop is stuck, which is the failure a liveness probe is for. Served
from the loop itself, a probe that gets an answer proves the loop runs, and
``/readyz`` and ``/metrics`` read the service's state on the thread that changes it.
The handler speaks just enough HTTP/1.1 for probes and scrapers: ``GET`` and ``HEAD``
of the three paths, one request per connection, headers at most 8 KiB read within
5 s; anything else gets 404, 405 or 400.

Security: the endpoints are read-only and change nothing; they expose the same
numbers any reader of the log can compute. They listen on 127.0.0.1 unless
``SHOAL_METRICS_HOST`` says otherwise (see docs/security.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import structlog
from prometheus_client import REGISTRY, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from shoal import events as ev
from shoal import state as st
from shoal.health import Readiness, bus_lag, judge_readiness, state_gauges
from shoal.models import Catalog, get_catalog

if TYPE_CHECKING:
    from shoal.bus import Bus
    from shoal.events import Envelope
    from shoal.projection import Projection
    from shoal.state import ClusterState

log = structlog.get_logger("shoal.probes")

PROBE_TIMEOUT_S = 0.5
"""How long a probe waits for the stream's last sequence, and then for the projection."""
HEADER_LIMIT = 8192
READ_TIMEOUT_S = 5.0

DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

_current: contextvars.ContextVar[Health | None] = contextvars.ContextVar("shoal_health", default=None)


def current() -> Health | None:
    """The :class:`Health` of the service running in this context (None: no probes)."""
    return _current.get()


def watch(*, bus: Bus, projection: Projection, role: Callable[[], str | None] | None = None) -> Health | None:
    """Report ``bus`` and ``projection`` (and ``role`` for a leader-elected service:
    ``"leader"``, ``"standby"`` or None while unknown) on this process's probes, if
    it has any. Call it before the projection starts (it adds a listener)."""
    health = current()
    if health is not None:
        health.watch(bus=bus, projection=projection, role=role)
    return health


class Health:
    """What one service process reports (see the module docstring)."""

    def __init__(
        self, service: str, *, clock: Callable[[], float] = time.time, catalog: str | None = None
    ) -> None:
        self.service = service
        self.clock = clock
        """The installation's clock (virtual seconds when scaled): the ``now`` of QL/CE/BI."""
        self.catalog_name = catalog
        """The allocator's fallback throughput curves (``settings.catalog``), read at the first scrape."""
        self._catalog: Catalog | None = None
        self._catalog_loaded = False
        self.bus: Bus | None = None
        self.projection: Projection | None = None
        self.role: Callable[[], str | None] | None = None
        self.registry = CollectorRegistry()
        self.phase_seconds = Histogram(
            "shoal_reconfiguration_phase_seconds",
            "Durations of reconfiguration phases, as ReconfigurationPhase events report them.",
            ["phase"],
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        self.reconfiguration_seconds = Histogram(
            "shoal_reconfiguration_seconds",
            "Durations of completed reconfigurations (ReconfigurationCompleted.duration_s).",
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        self.stop_seconds = Histogram(
            "shoal_reconfiguration_stop_seconds",
            "Time all workers were stopped by a completed reconfiguration (stop_time_s).",
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_StateCollector(self))
        self._last: Readiness | None = None

    def catalog(self) -> Catalog | None:
        """The catalog named by ``catalog_name`` (None: none, or an unknown name, logged once)."""
        if not self._catalog_loaded:
            self._catalog_loaded = True
            if self.catalog_name:
                try:
                    self._catalog = get_catalog(self.catalog_name)
                except ValueError as exc:
                    log.warning("metrics_catalog_unknown", error=str(exc))
        return self._catalog

    def watch(
        self, *, bus: Bus, projection: Projection, role: Callable[[], str | None] | None = None
    ) -> None:
        self.bus = bus
        self.projection = projection
        self.role = role
        projection.add_listener(self._on_event)

    def _on_event(self, seq: int, env: Envelope, state: ClusterState) -> None:
        e = env.event
        if isinstance(e, ev.ReconfigurationPhase):
            self.phase_seconds.labels(phase=e.phase).observe(e.duration_s)
        elif isinstance(e, ev.ReconfigurationCompleted):
            self.reconfiguration_seconds.observe(e.duration_s)
            self.stop_seconds.observe(e.stop_time_s)

    async def readiness(self) -> Readiness:
        """Judge readiness now (reads the stream's last sequence; see the module docstring)."""
        projection, bus = self.projection, self.bus
        if projection is None or bus is None:
            self._last = Readiness(ready=False, reasons=("starting: not connected to the log yet",))
            return self._last
        tail: int | None = None
        error: str | None = None
        try:
            tail = await asyncio.wait_for(bus.last_seq(), PROBE_TIMEOUT_S)
        except Exception as exc:  # any failure to read the tail means "not ready"
            error = type(exc).__name__ + (f": {exc}" if str(exc) else "")
        if tail is not None and projection.last_seq < tail:
            with contextlib.suppress(TimeoutError):
                await projection.wait_for(tail, timeout_s=PROBE_TIMEOUT_S)
        self._last = judge_readiness(
            replayed=projection.ready.is_set(),
            applied_seq=projection.last_seq,
            tail_seq=tail,
            tail_error=error,
            leader_elected=self.role is not None,
            role=self.role() if self.role is not None else None,
        )
        return self._last

    async def metrics(self) -> bytes:
        """The ``/metrics`` body (judges readiness first, for the lag and ready gauges)."""
        await self.readiness()
        return generate_latest(_Both(self.registry))  # type: ignore[arg-type]


class _Both:
    """The default registry and one of our own, as one ``collect()``."""

    def __init__(self, mine: CollectorRegistry) -> None:
        self.mine = mine

    def collect(self) -> Iterator[Metric]:
        yield from REGISTRY.collect()
        yield from self.mine.collect()


class _StateCollector:
    """Gauges computed at scrape time from the folded state, the bus and the last readiness."""

    def __init__(self, health: Health) -> None:
        self.health = health

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        h = self.health
        info = GaugeMetricFamily("shoal_service_info", "The service this process runs.", labels=["service"])
        info.add_metric([h.service], 1)
        yield info
        last = h._last
        if last is not None:
            yield GaugeMetricFamily("shoal_ready", "1 when /readyz answers 200.", value=int(last.ready))
        if h.projection is None or h.bus is None:
            return
        for g in state_gauges(h.projection.state, now=h.clock(), catalog=h.catalog()):
            yield GaugeMetricFamily("shoal_" + g.name, g.help, value=g.value)
        shares = GaugeMetricFamily(
            "shoal_job_share",
            "GPUs of each active job in the current shares (SharesDecided).",
            labels=["job_id"],
        )
        for job_id, gpus in sorted(h.projection.state.shares.items()):
            shares.add_metric([job_id], gpus)
        yield shares
        applied = h.projection.last_seq
        yield GaugeMetricFamily(
            "shoal_bus_applied_seq", "The last stream sequence this process has folded.", value=applied
        )
        folded = GaugeMetricFamily(
            "shoal_state_digest",
            "Always 1; labels: SHA-256 of the folded state (shoal.state.digest) and the sequence it is at.",
            labels=["digest", "seq"],
        )
        folded.add_metric([st.digest(h.projection.state), str(applied)], 1)
        yield folded
        tail = last.tail_seq if last is not None else None
        lag = bus_lag(tail, applied)
        if tail is not None and lag is not None:
            yield GaugeMetricFamily(
                "shoal_bus_tail_seq", "The stream's last sequence, read for this scrape.", value=tail
            )
            yield GaugeMetricFamily(
                "shoal_bus_lag", "Stream last sequence minus the sequence this process has folded.", value=lag
            )
        yield CounterMetricFamily(
            "shoal_dead_lettered",
            "Messages this process dead-lettered (they did not decode; see docs/clients.md).",
            value=h.bus.stats.dead_lettered,
        )
        if h.role is not None:
            role = h.role()
            leader = GaugeMetricFamily(
                "shoal_leader", "1 when this process holds its service's lease.", labels=["lease"]
            )
            leader.add_metric([h.service], 1 if role == "leader" else 0)
            yield leader


class Verdict(Protocol):
    """What ``/readyz`` answers from: :class:`~shoal.health.Readiness` or another."""

    @property
    def ready(self) -> bool: ...

    def body(self) -> str: ...


class Probed(Protocol):
    """What a :class:`ProbeServer` serves: :class:`Health` for a service, or
    ``shoal up``'s own (:class:`shoal.commands.up.UpHealth`)."""

    async def readiness(self) -> Verdict: ...

    async def metrics(self) -> bytes: ...


class ProbeServer:
    """The HTTP listener of :class:`Health` or any other :class:`Probed` (see the module
    docstring)."""

    def __init__(self, health: Probed, host: str, port: int) -> None:
        self.health = health
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        """Listen; ``self.port`` is then the bound port (also when 0 was asked for).

        Raises:
            OSError: the address cannot be bound.
        """
        self._server = await asyncio.start_server(
            self._handle, self.host, self.port, limit=HEADER_LIMIT, reuse_address=True
        )
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)

    @property
    def url(self) -> str:
        return probe_url(self.host, self.port)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            status, body, ctype, head_only = await self._respond(reader)
            reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}.get(
                status, "Service Unavailable"
            )
            headers = (
                f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n"
            )
            if status == 405:
                headers += "Allow: GET, HEAD\r\n"
            writer.write(headers.encode("ascii") + b"\r\n" + (b"" if head_only else body))
            await writer.drain()
        except (ConnectionError, TimeoutError, asyncio.IncompleteReadError):
            pass
        except Exception:
            log.exception("probe_failed")
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _respond(self, reader: asyncio.StreamReader) -> tuple[int, bytes, str, bool]:
        text = "text/plain; charset=utf-8"
        try:
            request = await _read_head(reader)
        except (ValueError, asyncio.LimitOverrunError):
            return 400, b"bad request\n", text, False
        parts = request.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return 400, b"bad request\n", text, False
        method, target = parts[0], parts[1].split("?", 1)[0]
        if target not in ("/healthz", "/readyz", "/metrics"):
            return 404, b"not found\n", text, False
        if method not in ("GET", "HEAD"):
            return 405, b"read-only: GET or HEAD\n", text, False
        head_only = method == "HEAD"
        if target == "/healthz":
            return 200, b"ok\n", text, head_only
        if target == "/readyz":
            verdict = await self.health.readiness()
            return (200 if verdict.ready else 503), verdict.body().encode(), text, head_only
        return 200, await self.health.metrics(), CONTENT_TYPE_LATEST, head_only


async def _read_head(reader: asyncio.StreamReader) -> str:
    """The request line; reads and drops the headers (at most :data:`HEADER_LIMIT` bytes).

    Raises:
        ValueError: too long, not ASCII, or the client stopped sending.
    """
    total = 0
    first = b""
    while True:
        line = await asyncio.wait_for(reader.readline(), READ_TIMEOUT_S)
        if not line:
            raise ValueError("connection closed in the request head")
        total += len(line)
        if total > HEADER_LIMIT:
            raise ValueError("request head too long")
        if not first:
            first = line
            continue
        if line in (b"\r\n", b"\n"):
            break
    return first.decode("ascii").strip()


def probe_url(host: str, port: int) -> str:
    """``http://host:port`` (an unspecified address is shown as the loopback one)."""
    shown = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    if ":" in shown:
        shown = f"[{shown}]"
    return f"http://{shown}:{port}"


def probed(serve: Any, service: str) -> Any:
    """``serve`` (``async serve(settings, stop)``) with this process's probes served
    around it on ``settings.metrics_host``/``metrics_port``, its :class:`Health`
    current (:func:`current`) while it runs.

    The returned coroutine function raises :class:`shoal.runtime.StartupError` when the
    address cannot be bound (a port asked for is a port a probe will look at)."""
    from shoal.runtime import StartupError, make_clock

    async def serve_with_probes(settings: Any, stop: asyncio.Event) -> None:
        health = Health(service, clock=make_clock(settings).now, catalog=settings.catalog)
        server = ProbeServer(health, settings.metrics_host, settings.metrics_port)
        try:
            await server.start()
        except OSError as exc:
            raise StartupError(
                f"cannot serve /healthz, /readyz and /metrics on "
                f"{settings.metrics_host}:{settings.metrics_port}: {exc.strerror or exc}"
            ) from None
        token = _current.set(health)
        log.info("probes_listening", url=server.url)
        try:
            await serve(settings, stop)
        finally:
            _current.reset(token)
            await server.stop()

    return serve_with_probes
