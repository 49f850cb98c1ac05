"""``shoal backup DIR`` and ``shoal restore DIR``: the installation's JetStream streams
through the server's own snapshot API, while the servers run.

``shoal backup DIR`` snapshots every stream of the installation (the event log
``<TOKEN>_EVENTS``, the node commands, the dead letters, the heartbeats, and the KV
buckets and object store whose names carry the token: leases, training metadata,
snapshots) with ``$JS.API.STREAM.SNAPSHOT.<stream>``: the server sends the stream's
files as chunks, each acknowledged before the next. It writes ``DIR/<stream>.snap``
(the server's archive, as sent), ``DIR/<stream>.json`` (the stream's configuration
and state when the snapshot began) and ``DIR/backup.json`` (the list).

``shoal restore DIR`` sends each back with ``$JS.API.STREAM.RESTORE.<stream>`` into a
server that does not have that stream (restore before any service starts: services
create the streams they miss, empty). ``--replicas N`` restores with N replicas
instead of the backup's (e.g. a three-server backup into one server).

Both need the admin identity: every other role is denied these APIs
(:mod:`shoal.auth`). Tested by ``tests/test_backup.py`` against a real nats-server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from shoal.cli import CommandError

CHUNK_SIZE = 128 * 1024
"""Bytes per snapshot chunk the server sends, and per restore chunk sent back."""
MANIFEST = "backup.json"


def register(subparsers: Any) -> None:
    from shoal.commands._connect import add_connection_args

    b = subparsers.add_parser("backup", help="snapshot the installation's JetStream streams into a directory")
    b.add_argument("directory", help="where the snapshots are written (made if missing; must hold no backup)")
    add_connection_args(b)
    b.set_defaults(func=_backup)
    r = subparsers.add_parser("restore", help="restore the streams of a `shoal backup` directory")
    r.add_argument("directory", help="a directory `shoal backup` wrote")
    r.add_argument(
        "--replicas", type=int, default=None, help="replicas of the restored streams (default: the backup's)"
    )
    add_connection_args(r)
    r.set_defaults(func=_restore)


def installation_streams(names: list[str], token: str) -> list[str]:
    """The streams of the installation with stream token ``token`` among ``names``: its
    own (``<TOKEN>_…``) and those of its KV buckets (``KV_<TOKEN>_…``) and object stores
    (``OBJ_<TOKEN>_…``)."""
    pattern = re.compile(rf"^(KV_|OBJ_)?{re.escape(token)}_")
    return sorted(n for n in names if pattern.match(n))


async def _connect(args: argparse.Namespace) -> Any:
    from shoal.bus import AuthFailed, Bus, NoServerError
    from shoal.commands._connect import resolve_creds, resolve_prefix, resolve_url

    flag_url = getattr(args, "nats_url", None)
    creds = resolve_creds(getattr(args, "creds", None), url_given=bool(flag_url))
    # The CA of a TLS installation, as the clients read it (shoal.client.Client.connect).
    tls_ca = os.environ.get("NATS_CA") or os.environ.get("SHOAL_TLS_CA") or None
    try:
        return await Bus.connect(
            resolve_url(flag_url), resolve_prefix(args.prefix), creds=creds, declare=False, tls_ca=tls_ca
        )
    except AuthFailed as exc:
        raise CommandError(str(exc)) from None
    except NoServerError as exc:
        raise CommandError(f"{exc} (set NATS_URL or run `shoal up`)") from None


async def _api(nc: Any, subject: str, body: dict[str, Any] | None, timeout: float) -> dict[str, Any]:
    import nats.errors

    try:
        msg = await nc.request(
            subject, json.dumps(body).encode() if body is not None else b"", timeout=timeout
        )
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
        # The server drops a request its permissions refuse: no answer at all.
        raise CommandError(
            f"no answer to {subject} within {timeout:g} s: only the admin identity may snapshot or "
            "restore streams (are these the admin's credentials?)"
        ) from None
    reply: dict[str, Any] = json.loads(msg.data)
    if reply.get("error"):
        raise CommandError(f"{subject}: {reply['error'].get('description', reply['error'])}")
    return reply


async def snapshot_stream(nc: Any, stream: str, directory: Path, timeout: float) -> dict[str, Any]:
    """Write ``stream``'s snapshot to ``directory``; returns its configuration and state."""
    inbox = nc.new_inbox()
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    size = 0
    part = directory / f"{stream}.snap.part"
    with open(part, "wb") as out:

        async def on_chunk(msg: Any) -> None:
            nonlocal size
            if not msg.data:  # an empty message ends the snapshot
                if not done.done():
                    done.set_result(None)
                return
            out.write(msg.data)
            size += len(msg.data)
            if msg.reply:  # flow control: the server waits for this ack on some chunks only
                await msg.respond(b"")

        sub = await nc.subscribe(inbox, cb=on_chunk)
        try:
            reply = await _api(
                nc,
                f"$JS.API.STREAM.SNAPSHOT.{stream}",
                {"deliver_subject": inbox, "chunk_size": CHUNK_SIZE, "no_consumers": False},
                timeout,
            )
            # However long the stream, give up only when no chunk came for ``timeout`` seconds.
            seen = -1
            while not done.done() and size != seen:
                seen = size
                await asyncio.wait({done}, timeout=timeout)
            if not done.done():
                raise CommandError(f"snapshot of {stream}: no chunk for {timeout:g} s")
        except BaseException:
            out.close()
            part.unlink()
            raise
        finally:
            await sub.unsubscribe()
    part.rename(directory / f"{stream}.snap")
    meta = {"stream": stream, "config": reply["config"], "state": reply["state"], "bytes": size}
    (directory / f"{stream}.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return meta


async def restore_stream(nc: Any, directory: Path, stream: str, replicas: int | None, timeout: float) -> None:
    """Send ``stream``'s snapshot from ``directory`` back to the server."""
    meta = json.loads((directory / f"{stream}.json").read_text())
    config = dict(meta["config"])
    if replicas is not None:
        config["num_replicas"] = replicas
    reply = await _api(
        nc, f"$JS.API.STREAM.RESTORE.{stream}", {"config": config, "state": meta["state"]}, timeout
    )
    deliver = reply["deliver_subject"]
    with open(directory / f"{stream}.snap", "rb") as snap:
        while chunk := snap.read(CHUNK_SIZE):
            await _send_chunk(nc, deliver, chunk, timeout)
    final = await _send_chunk(nc, deliver, b"", timeout)
    answer = json.loads(final.data)
    if answer.get("error"):
        raise CommandError(f"restore of {stream}: {answer['error'].get('description', answer['error'])}")


async def _send_chunk(nc: Any, deliver: str, chunk: bytes, timeout: float) -> Any:
    """One restore chunk, sent again while nobody listens on ``deliver`` yet, for up to
    ``timeout`` seconds: on a cluster the server that takes the restore may subscribe to
    it on another server than this client's, and the interest reaches this one over the
    routes a moment after the API's answer (CI's R3 restore once got "no responders" so).
    Nothing received a chunk that had no responder, so sending it again duplicates nothing."""
    import nats.errors

    deadline = time.monotonic() + timeout
    while True:
        try:
            return await nc.request(deliver, chunk, timeout=timeout)
        except nats.errors.NoRespondersError:
            if time.monotonic() >= deadline:
                raise
            await asyncio.sleep(0.1)


def _backup(args: argparse.Namespace) -> int:
    directory = Path(args.directory)
    if (directory / MANIFEST).exists():
        raise CommandError(f"{directory} already holds a backup ({MANIFEST}); choose an empty directory")
    directory.mkdir(parents=True, exist_ok=True)

    async def main() -> int:
        bus = await _connect(args)
        try:
            token = bus.names.events_stream.removesuffix("_EVENTS")
            js = bus.nc.jetstream(timeout=args.timeout)
            names = [i.config.name for i in await js.streams_info()]
            streams = installation_streams(names, token)
            if not streams:
                raise CommandError(f"no stream of installation {bus.names.prefix!r} on this server")
            metas = []
            for stream in streams:
                meta = await snapshot_stream(bus.nc, stream, directory, args.timeout)
                print(f"{stream}: {meta['state']['messages']} messages, {meta['bytes']} bytes")
                metas.append({"stream": stream, "messages": meta["state"]["messages"]})
            manifest = {"prefix": bus.names.prefix, "time": time.time(), "streams": metas}
            (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        finally:
            await bus.close()
        return 0

    return _run(main, args.timeout)


def _run(main: Callable[[], Coroutine[Any, Any, int]], timeout: float, after: str = "") -> int:
    """``asyncio.run(main())``, with JetStream's silence a clear error (``after`` appended
    to it), not a traceback."""
    import nats.errors

    try:
        return asyncio.run(main())
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError, TimeoutError) as exc:
        raise CommandError(
            f"JetStream did not answer within {timeout:g} s ({type(exc).__name__}): on a cluster "
            "that is electing a new leader after losing a server, it answers again within "
            f"seconds; run the command again (--timeout sets the wait){after}",
            code=1,
        ) from None


def _restore(args: argparse.Namespace) -> int:
    directory = Path(args.directory)
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except FileNotFoundError:
        raise CommandError(f"{directory} holds no backup ({MANIFEST} missing)") from None

    async def main() -> int:
        bus = await _connect(args)
        try:
            js = bus.nc.jetstream(timeout=args.timeout)
            existing = {i.config.name for i in await js.streams_info()}
            clash = sorted(s["stream"] for s in manifest["streams"] if s["stream"] in existing)
            if clash:
                raise CommandError(
                    f"the server already has {', '.join(clash)}: restore into an installation without "
                    "them (before its services start), or delete them first as the admin"
                )
            for item in manifest["streams"]:
                await restore_stream(bus.nc, directory, item["stream"], args.replicas, args.timeout)
                info = await js.stream_info(item["stream"])
                print(f"{item['stream']}: {info.state.messages} messages restored")
        finally:
            await bus.close()
        return 0

    return _run(
        main,
        args.timeout,
        "; the streams restored before it stay: delete them as the admin first (the next run names them)",
    )
