"""How CLI commands (and ``Client.connect()`` without a URL) find the server.

Resolution order for the NATS URL, first found wins:

1. ``--nats-url`` on the command line;
2. the environment: ``NATS_URL``, then ``SHOAL_NATS_URL``;
3. the installation ``shoal up`` runs, from the shoal state directory
   (``SHOAL_STATE_DIR``, else the platform's user state dir, e.g.
   ``~/.local/state/shoal``): ``up.json`` (``{"url": ..., "pid": ...}``) when its
   pid is alive (a file left by a ``shoal up`` that died is ignored, and so is the
   ``nats.url`` beside it); without ``up.json``, a ``nats.url`` file holding one URL;
   else an embedded server's own ports file, ``nats-server_<pid>.ports`` (JSON
   ``{"nats": ["nats://host:port"], ...}``) directly in the state dir or one level
   below, the newest whose pid is alive;
4. otherwise a clear error: ``no NATS server: set NATS_URL or run `shoal up```.

The subject prefix comes from ``--prefix``, else ``SHOAL_PREFIX``, else ``shoal``.

Credentials (:func:`resolve_creds`): ``--creds``, ``NATS_CREDS``, ``SHOAL_NATS_CREDS``,
else the admin seed of the ``shoal up`` found in step 3.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shoal.cli import CommandError
from shoal.runtime import UP_FILE, URL_FILE, pid_alive, read_up_info

if TYPE_CHECKING:
    from shoal.client import Client

DEFAULT_PREFIX = "shoal"
NO_SERVER = "no NATS server: set NATS_URL or run `shoal up`"


def add_connection_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--nats-url`` and ``--prefix`` to a subcommand's parser."""
    group = parser.add_argument_group("connection")
    group.add_argument(
        "--nats-url",
        metavar="URL",
        default=None,
        help="NATS server (default: $NATS_URL, $SHOAL_NATS_URL, else the server `shoal up` started)",
    )
    group.add_argument(
        "--creds",
        metavar="FILE",
        default=None,
        help="nkey seed file to authenticate with (default: $NATS_CREDS, $SHOAL_NATS_CREDS, else the "
        "admin credentials of the `shoal up` running for the state directory)",
    )
    group.add_argument(
        "--prefix",
        default=None,
        help=f"subject prefix of the installation (default: $SHOAL_PREFIX or {DEFAULT_PREFIX!r})",
    )
    group.add_argument(
        "--timeout", type=float, default=10.0, metavar="S", help="seconds to wait for a reply (default 10)"
    )


def state_dir(env: Mapping[str, str] | None = None) -> Path:
    """The shoal state directory (``SHOAL_STATE_DIR`` or the platform's user state dir)."""
    env = os.environ if env is None else env
    explicit = env.get("SHOAL_STATE_DIR")
    if explicit:
        return Path(explicit)
    import platformdirs

    return Path(platformdirs.user_state_dir("shoal"))


def url_from_state_dir(directory: Path) -> str | None:
    """The client URL of the live ``shoal up`` (or embedded server) recorded in ``directory``."""
    if not directory.is_dir():
        return None
    if (directory / UP_FILE).exists():
        # Written by `shoal up` with its pid, next to nats.url; both are stale once it died.
        info = read_up_info(directory)
        if info and info.get("url"):
            return str(info["url"])
    else:
        try:
            text = (directory / URL_FILE).read_text().strip()
        except OSError:
            text = ""
        if text:
            return text.split()[0]
    candidates: list[tuple[float, str]] = []
    for path in [*directory.glob("*.ports"), *directory.glob("*/*.ports")]:
        pid_text = path.stem.rsplit("_", 1)[-1]
        if not pid_text.isdigit() or not pid_alive(int(pid_text)):
            continue
        try:
            urls = json.loads(path.read_text()).get("nats") or []
            mtime = path.stat().st_mtime
        except (OSError, ValueError, AttributeError):
            continue
        if urls and isinstance(urls[0], str):
            candidates.append((mtime, urls[0]))
    return max(candidates)[1] if candidates else None


def resolve_url(flag: str | None = None, env: Mapping[str, str] | None = None) -> str:
    """The NATS URL to use (see the module docstring for the order).

    Raises:
        CommandError: no server is configured or running.
    """
    env = os.environ if env is None else env
    for value in (flag, env.get("NATS_URL"), env.get("SHOAL_NATS_URL")):
        if value:
            return value
    found = url_from_state_dir(state_dir(env))
    if found:
        return found
    raise CommandError(NO_SERVER)


def warn_gave_up(url: str, env: Mapping[str, str] | None = None) -> None:
    """One line on stderr per service that the local ``shoal up`` (whose server ``url``
    is) gave up restarting: it stays down until ``shoal up`` is restarted, and every
    command of the CLI says so rather than only ``shoal up``'s own stderr."""
    info = read_up_info(state_dir(os.environ if env is None else env))
    if not info or info.get("url") != url:
        return
    for name in info.get("gave_up") or []:
        print(
            f"shoal: warning: shoal up gave up restarting {name}; it stays down until shoal up is restarted",
            file=sys.stderr,
        )


def resolve_creds(
    flag: str | None = None, env: Mapping[str, str] | None = None, *, url_given: bool = False
) -> str | None:
    """The nkey seed file to authenticate with: ``--creds``, else ``NATS_CREDS``, else
    ``SHOAL_NATS_CREDS``, else (when the server is the one ``shoal up`` runs for the
    state directory, i.e. no URL was given) that installation's admin seed,
    ``<state dir>/creds/admin.nk``, readable by its owner only; else None.

    Raises:
        CommandError: a named file that cannot be read.
    """
    env = os.environ if env is None else env
    for value in (flag, env.get("NATS_CREDS"), env.get("SHOAL_NATS_CREDS")):
        if value:
            if not os.access(value, os.R_OK):
                raise CommandError(f"cannot read the credentials file {value}")
            return value
    if url_given or env.get("NATS_URL") or env.get("SHOAL_NATS_URL"):
        return None
    directory = state_dir(env)
    info = read_up_info(directory)
    admin = Path(str(info.get("creds_dir") or directory / "creds")) / "admin.nk" if info else None
    if admin is not None and os.access(admin, os.R_OK):
        return str(admin)
    return None


def resolve_prefix(flag: str | None = None, env: Mapping[str, str] | None = None) -> str:
    """The subject prefix to use; checked, so a typo is an error, not an empty log.

    Raises:
        CommandError: the prefix is not a valid subject prefix.
    """
    env = os.environ if env is None else env
    prefix = flag or env.get("SHOAL_PREFIX") or DEFAULT_PREFIX
    from shoal.bus import Names

    try:
        Names(prefix)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    return prefix


async def connect(args: argparse.Namespace) -> Client:
    """A connected :class:`shoal.client.Client` for a parsed command line.

    Raises:
        CommandError: no server configured, or none reachable at the URL.
    """
    from shoal.bus import AuthFailed, NoServerError
    from shoal.client import Client

    flag_url = getattr(args, "nats_url", None)
    creds = resolve_creds(getattr(args, "creds", None), url_given=bool(flag_url))
    url = resolve_url(flag_url)
    warn_gave_up(url)
    prefix = resolve_prefix(getattr(args, "prefix", None))
    try:
        return await Client.connect(url, prefix, timeout_s=getattr(args, "timeout", 10.0), creds=creds)
    except AuthFailed as exc:
        raise CommandError(str(exc)) from None
    except NoServerError as exc:
        raise CommandError(f"{exc} (set NATS_URL or run `shoal up`)") from None


def run(args: argparse.Namespace, body: Callable[[Client], Awaitable[int]]) -> int:
    """Connect, run ``body(client)`` in a fresh event loop, close; map client errors to
    one-line :class:`~shoal.cli.CommandError`s (rejections exit 1, no answer exits 3).
    With ``--json`` a rejection's reply (``reply.rejected``: code, message, errors) is
    also printed on stdout, as an acceptance's is.
    """
    from shoal import client as sdk

    async def main() -> int:
        client = await connect(args)
        try:
            return await body(client)
        finally:
            await client.close()

    # The trace of a command begins in this process when the user exports spans as the
    # services do (OTEL_EXPORTER_OTLP_ENDPOINT, SHOAL_TRACE_JSONL): admission, the
    # decision and the reconfiguration then continue the CLI's trace.
    tracing = None
    jsonl = os.environ.get("SHOAL_TRACE_JSONL", "").strip()
    if jsonl or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip():
        from shoal.telemetry import setup_tracing

        tracing = setup_tracing("shoal-cli", trace_jsonl=jsonl or None)
    try:
        return asyncio.run(main())
    except BrokenPipeError:
        # The reader went away (`shoal jobs | head`): not an error.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except sdk.CommandError as exc:
        if getattr(args, "json", False):
            print_json(exc.reply)  # a script reads the code and errors from stdout too
        raise CommandError(rejection_text(exc), code=1) from None
    except sdk.UnknownJobError as exc:
        raise CommandError(str(exc), code=1) from None
    except sdk.ClientError as exc:
        raise CommandError(str(exc), code=3) from None
    finally:
        if tracing is not None:
            tracing.shutdown()


def rejection_text(exc: Exception) -> str:
    """``rejected (<code>): <message>`` for an SDK :class:`~shoal.client.CommandError`."""
    code = getattr(exc, "code", "error")
    message = getattr(exc, "message", str(exc))
    return f"rejected ({code}): {message}"


def print_json(obj: Any) -> None:
    """Print any contract object or plain data as indented JSON on stdout."""
    import msgspec

    sys.stdout.write(msgspec.json.format(msgspec.json.encode(obj), indent=2).decode() + "\n")
