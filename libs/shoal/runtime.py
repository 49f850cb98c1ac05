"""Process lifetime of a shoal service: set-up, signals, draining, exit status.

:func:`run_service` is the ``main`` of every service process (``shoal run <service>``):

1. configure logging and tracing once (:mod:`shoal.log`, :mod:`shoal.telemetry`);
2. run ``serve(settings, stop)`` in a fresh event loop;
3. on the first SIGTERM or SIGINT set ``stop``: the service stops taking new work,
   finishes what is in flight (handlers, decisions, acks) and returns;
4. exit status 0 when ``serve`` returned cleanly, 1 when it raised, when a task it
   watches died (:func:`shoal.tasks.critical`: ``stop`` is set, the service drains) or
   it did not drain within ``settings.drain_timeout_s`` (it is then cancelled), 2 for a start-up
   error (:class:`StartupError`: no server, bad configuration) with a one-line
   message on stderr, and 128+signal when a *second* signal forces an immediate exit.

It also knows how a service finds its NATS server (:func:`resolve_nats_url`):
``settings.nats_url`` (``NATS_URL``/``SHOAL_NATS_URL``) if set, else the embedded
server that ``shoal up`` runs for ``settings.state_dir`` (``nats.url`` and
``up.json`` in that directory, written by ``shoal up`` and removed when it exits;
a file left by a ``shoal up`` that died is ignored), else a clear error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from shoal.settings import Settings

if TYPE_CHECKING:
    from shoal.bus import Bus
    from shoal.clock import ScaledClock, WallClock

log = structlog.get_logger("shoal.runtime")

Serve = Callable[[Settings, asyncio.Event], Coroutine[Any, Any, None]]

NO_SERVER = "no NATS server: set NATS_URL or run `shoal up`"
URL_FILE = "nats.url"
UP_FILE = "up.json"

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_STARTUP = 2


class StartupError(Exception):
    """A service cannot start (no server, bad configuration); the message says why."""


# ---------------------------------------------------------------------------
# Finding the server
# ---------------------------------------------------------------------------


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_up_info(state_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """What a live ``shoal up`` recorded in ``state_dir`` (url, pids …), or None."""
    path = Path(state_dir) / UP_FILE
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict):
        return None
    try:
        pid = int(info.get("pid") or 0)
    except (TypeError, ValueError):
        return None
    return info if pid_alive(pid) else None


def write_up_info(state_dir: str | os.PathLike[str], url: str, **more: Any) -> None:
    """Record the running installation's URL for services and clients (see module docstring)."""
    d = Path(state_dir)
    d.mkdir(parents=True, exist_ok=True)
    info = {"url": url, "pid": os.getpid(), "started_at": time.time(), **more}
    tmp = d / f".{UP_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(info, sort_keys=True, indent=2) + "\n")
    tmp.replace(d / UP_FILE)
    tmp = d / f".{URL_FILE}.{os.getpid()}"
    tmp.write_text(url + "\n")
    tmp.replace(d / URL_FILE)


def remove_up_info(state_dir: str | os.PathLike[str]) -> None:
    """Remove what :func:`write_up_info` wrote, if it is ours."""
    d = Path(state_dir)
    info = None
    with contextlib.suppress(OSError, ValueError):
        info = json.loads((d / UP_FILE).read_text())
    if isinstance(info, dict) and int(info.get("pid", 0)) != os.getpid():
        return
    for name in (UP_FILE, URL_FILE):
        with contextlib.suppress(FileNotFoundError):
            (d / name).unlink()


def resolve_nats_url(settings: Settings) -> str:
    """The NATS URL this process should use (see the module docstring).

    Raises:
        StartupError: none configured and no live ``shoal up`` for the state dir.
    """
    if settings.nats_url:
        return settings.nats_url
    info = read_up_info(settings.state_dir)
    if info and info.get("url"):
        return str(info["url"])
    raise StartupError(f"{NO_SERVER} (looked for a running `shoal up` in {settings.state_dir})")


CREDS_DIR = "creds"
NATS_VARIABLES = ("NATS_URL", "NATS_CREDS")
"""NATS tooling's own variables, which shoal's settings honour (and which win over the
``SHOAL_*`` ones): a parent that hands its children settings removes them first."""


def resolve_creds(settings: Settings, identity: str) -> str | None:
    """The nkey seed file this process authenticates with: ``settings.nats_creds``
    (``NATS_CREDS``/``SHOAL_NATS_CREDS``) if set, else ``identity``'s file in the
    credentials of a live ``shoal up`` for ``settings.state_dir``, else None (no
    authentication: a server that requires it then refuses with a clear error)."""
    if settings.nats_creds:
        return settings.nats_creds
    if settings.nats_url is None and read_up_info(settings.state_dir) is not None:
        path = Path(settings.state_dir) / CREDS_DIR / f"{identity}.nk"
        if path.exists():
            return str(path)
    return None


async def connect_bus(
    settings: Settings,
    name: str,
    *,
    declare: bool = True,
    identity: str | None = None,
    token: str | None = None,
) -> Bus:
    """A connected bus for ``settings`` (streams declared unless ``declare=False``),
    authenticated as :func:`resolve_creds` finds (``identity`` defaults to ``name``),
    or with a sidecar ``token`` (:mod:`shoal.callout`) instead.

    Raises:
        StartupError: no server configured, none reachable, or credentials refused.
    """
    import nats.errors
    import nats.js.errors

    from shoal.bus import AuthFailed, Bus, NoServerError

    url = resolve_nats_url(settings)
    creds = None if token else resolve_creds(settings, identity or name)
    deadline = time.monotonic() + settings.connect_wait_s
    delay = 0.5
    while True:
        try:
            return await Bus.connect(
                url,
                prefix=settings.prefix,
                name=name,
                declare=declare,
                creds=creds,
                tls_ca=settings.tls_ca,
                replicas=settings.replicas,
                token=token,
            )
        except AuthFailed as exc:
            raise StartupError(str(exc)) from None  # retrying cannot fix credentials
        except (
            NoServerError,
            nats.errors.TimeoutError,
            nats.errors.NoRespondersError,
            nats.js.errors.ServiceUnavailableError,
        ) as exc:
            # Not there yet, or its JetStream has no quorum yet: wait while allowed.
            reason = str(exc) or type(exc).__name__
            if time.monotonic() + delay > deadline:
                if isinstance(exc, NoServerError):
                    raise StartupError(f"{exc} (set NATS_URL or run `shoal up`)") from None
                raise StartupError(f"NATS at {url} answers but its JetStream does not: {reason}") from None
            log.warning("waiting_for_nats", url=url, error=reason, retry_in_s=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)


def make_clock(settings: Settings) -> WallClock | ScaledClock:
    """The installation's clock. A scaled clock needs the shared ``clock_origin``.

    Raises:
        StartupError: ``time_scale`` is not 1 and no ``clock_origin`` is set (each
            process would otherwise keep its own virtual time).
    """
    from shoal.clock import make_clock as _make

    if settings.time_scale != 1.0 and settings.clock_origin is None:
        raise StartupError(
            "SHOAL_TIME_SCALE is not 1 but SHOAL_CLOCK_ORIGIN is unset: every process of an "
            "emulated installation must share one clock origin (`shoal up` sets it)"
        )
    return _make(settings.time_scale, settings.clock_origin)


def holder_id(service: str) -> str:
    """A unique lease-holder name for this process: ``<service>-<host>-<pid>``."""
    from shoal.settings import default_node_id

    return f"{service}-{default_node_id()}-{os.getpid()}"


# ---------------------------------------------------------------------------
# Running a service
# ---------------------------------------------------------------------------


def run_in_session(argv: list[str], settings: Settings) -> int:
    """Run ``argv`` (a shoal command) in a session of its own, with ``settings`` as
    ``SHOAL_*`` variables, forwarding our SIGINT/SIGTERM to it as SIGTERM; return its
    exit status.

    Why: Ctrl-C in a terminal signals the whole foreground process group. Were an
    embedded nats-server and the services in it, the server would shut down at once
    and each service would get SIGINT and then its supervisor's SIGTERM, a second
    signal, which means "skip the drain". In their own session they only hear what we
    forward: the first signal drains, a second one forces the exit. The child (and so
    everything it starts) dies with us (``PR_SET_PDEATHSIG``).
    """
    import subprocess

    from shoal.supervisor import _die_with_parent

    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_") and k not in NATS_VARIABLES}
    env.update(settings.to_env())
    if settings.nats_url:
        env["NATS_URL"] = settings.nats_url
    proc = subprocess.Popen(
        argv,
        env=env,
        start_new_session=True,
        preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
    )

    def forward(signum: int, _frame: Any) -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def run_service(serve: Serve, settings: Settings, *, service_name: str = "shoal") -> int:
    """Run ``serve`` until it returns; handle signals; return the exit status.

    Args:
        serve: ``async serve(settings, stop)``; must return soon after ``stop`` is set,
            having finished its in-flight work.
        settings: the process's settings.
        service_name: for logs and traces.

    Returns:
        The process exit status (see the module docstring).
    """
    from shoal.log import configure_logging
    from shoal.settings import unknown_variables
    from shoal.telemetry import setup_tracing

    configure_logging(settings)
    structlog.contextvars.bind_contextvars(service=service_name)
    for variable in unknown_variables():
        log.warning("unknown_setting_ignored", variable=variable)
    node = settings.resolved_node_id() if service_name in ("node-daemon", "trainer-sidecar") else None
    tracing = setup_tracing(service_name, trace_jsonl=settings.trace_jsonl, node_id=node)
    if settings.metrics_port is not None:
        from shoal.probes import probed

        serve = probed(serve, service_name)  # /healthz, /readyz, /metrics (shoal.probes)
    try:
        return asyncio.run(_main(serve, settings, service_name))
    finally:
        tracing.shutdown()


async def _main(serve: Serve, settings: Settings, service_name: str) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals_seen: list[int] = []

    def on_signal(signum: int) -> None:
        signals_seen.append(signum)
        if len(signals_seen) == 1:
            log.info("stopping", signal=signal.Signals(signum).name, drain_timeout_s=settings.drain_timeout_s)
            stop.set()
            return
        # A second signal: the operator does not want to wait for the drain.
        log.warning("forced_exit", signal=signal.Signals(signum).name)
        with contextlib.suppress(Exception):
            sys.stderr.flush()
            sys.stdout.flush()
        os._exit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    from shoal import tasks

    task_deaths: list[str] = []

    def on_task_death(name: str, _exc: BaseException) -> None:
        # A watched task died (shoal.tasks.critical): drain and exit 1, so the supervisor acts.
        task_deaths.append(name)
        stop.set()

    remove_hook = tasks.add_fail_hook(on_task_death)
    task = asyncio.create_task(serve(settings, stop), name=f"serve-{service_name}")
    stopper = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            done, _ = await asyncio.wait({task}, timeout=settings.drain_timeout_s)
            if not done:
                log.error("drain_timeout", timeout_s=settings.drain_timeout_s)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                return EXIT_FAILED
        try:
            task.result()
        except StartupError as exc:
            print(f"shoal: {service_name}: {exc}", file=sys.stderr, flush=True)
            log.error("startup_failed", error=str(exc))
            return EXIT_STARTUP
        except asyncio.CancelledError:
            log.error("service_cancelled")
            return EXIT_FAILED
        except Exception:
            log.exception("service_failed")
            return EXIT_FAILED
        if task_deaths:
            log.error("stopped_after_task_died", tasks=task_deaths)
            return EXIT_FAILED
        log.info("stopped", clean=True)
        return EXIT_OK
    finally:
        remove_hook()
        stopper.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
