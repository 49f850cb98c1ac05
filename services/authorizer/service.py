"""authorizer: answers the NATS server's auth callout for sidecars (:mod:`shoal.callout`).

Consumes: the event log through a :class:`~shoal.projection.Projection` (which job is
placed on which node) and the server's authorization requests on
``$SYS.REQ.USER.AUTH`` (only this identity may subscribe there, :mod:`shoal.auth`).

Decides: whether a connecting sidecar may be the sidecar of the job its token names:
the token must be signed by the ``sidecar-<node>`` key of the node it names, and the
job must be placed (and not finished) on that node. The fold is first brought up to the
placement sequence the token names (a node daemon acts on a placement this process may
not have folded yet), waiting at most ``wait_s``. With ``identities``, also whether a
client without a token is an identity of the installation the server's running
configuration does not list yet: its signature of the server's nonce must verify with
that identity's nkey (:func:`shoal.callout.verify_nkey`), and it gets that identity's
permissions (:func:`shoal.auth.permissions`); and whether an MQTT device
(``client_info.type`` ``mqtt``) gave the user name and password of such an identity
(:func:`shoal.auth.mqtt_identity`, bcrypt), with the same permissions.

Publishes: nothing on the log; each request gets one answer, the user JWT with the
job's permissions (:func:`shoal.auth.sidecar_job_permissions`) or an error, both signed
with the callout issuer's account key (a request that is not a well-formed server
request gets none). Every request is counted by outcome (``allowed``, ``refused``,
``malformed``: ``shoal_authorizer_decisions_total``).

Revokes (with a :class:`Revoker`, a second connection as the ``revoker`` identity in
the system account): every ``sweep_s`` it lists the servers' sidecar connections and
ends each whose job has not been placed on its node for ``grace_s``
(:class:`shoal.callout.Revocations`); the sidecar's reconnection is then refused by the
callout. Counted in ``shoal_authorizer_revocations_total``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import nkeys
import structlog
from nats.aio.msg import Msg
from prometheus_client import Counter
from shoal import callout as co
from shoal.auth import (
    AuthError,
    Identity,
    callout_admits,
    mqtt_identity,
    permissions,
    sidecar_job_permissions,
)
from shoal.bus import Bus
from shoal.projection import CLUSTER_SNAPSHOT, Projection
from shoal.state import FINISHED_STATUSES

log = structlog.get_logger("shoal.authorizer")

QUEUE = "authorizer"
"""The queue group of the authorizers' subscriptions to the callout subject."""

DECISIONS = Counter(
    "shoal_authorizer_decisions", "Auth callout answers of the authorizer, by outcome", ["outcome"]
)
REVOCATIONS = Counter(
    "shoal_authorizer_revocations", "Sidecar connections the authorizer ended (job no longer placed)"
)

CONNZ_ALL = "$SYS.REQ.SERVER.PING.CONNZ"
"""Every server of the cluster answers with its connections (system account only)."""

CONNZ_PAGE = 1024
"""Connections per ``CONNZ`` answer (the server's default limit); more come in pages."""


class Revoker:
    """Ends the connections of sidecars whose job left their node (:mod:`shoal.callout`).

    Args:
        bus: a bus connected as the ``revoker`` identity (the system account); only its
            ``nc`` is used.
        placed: ``placed(job_id, node_id)`` from the authorizer's fold.
        grace_s: how long a sidecar may stay connected after its job left its node
            (:class:`shoal.callout.Revocations`).
        sweep_s: how often the connections are listed.
        wait_s: how long the answers of all servers to one listing are awaited (a
            cluster's servers answer independently; those later are judged next sweep).
    """

    def __init__(
        self,
        bus: Bus,
        *,
        placed: co.Placed,
        grace_s: float = 30.0,
        sweep_s: float = 5.0,
        wait_s: float = 0.5,
    ) -> None:
        self.bus = bus
        self.placed = placed
        self.sweep_s = sweep_s
        self.wait_s = wait_s
        self.revocations = co.Revocations(grace_s)
        self.revoked: list[co.SidecarConnection] = []
        """Every connection ended, in order."""

    async def _ask(self, subject: str, offset: int, inbox: str) -> None:
        body = {"auth": True, "offset": offset, "limit": CONNZ_PAGE}
        await self.bus.nc.publish(subject, json.dumps(body).encode(), reply=inbox)

    async def connections(self) -> list[co.SidecarConnection]:
        """Every sidecar connection on the servers that answered within ``wait_s``."""
        nc = self.bus.nc
        inbox = nc.new_inbox()
        replies: asyncio.Queue[bytes] = asyncio.Queue()

        async def on_reply(msg: Msg) -> None:
            replies.put_nowait(msg.data)

        sub = await nc.subscribe(inbox, cb=on_reply)
        out: list[co.SidecarConnection] = []
        try:
            await self._ask(CONNZ_ALL, 0, inbox)
            deadline = time.monotonic() + self.wait_s
            while (left := deadline - time.monotonic()) > 0:
                try:
                    data = await asyncio.wait_for(replies.get(), left)
                except TimeoutError:
                    break
                try:
                    reply: Any = json.loads(data)
                    conns, total = co.sidecar_connections(reply)
                except (ValueError, co.CalloutError) as exc:
                    log.warning("revoker_bad_connz", error=str(exc)[:300])
                    continue
                out += conns
                offset = int(reply["data"].get("offset") or 0) + len(reply["data"].get("connections") or [])
                if offset < total:  # that server has more: its next page, same inbox
                    await self._ask(f"$SYS.REQ.SERVER.{reply['server']['id']}.CONNZ", offset, inbox)
                    deadline = max(deadline, time.monotonic() + self.wait_s)
        finally:
            await sub.unsubscribe()
        return out

    async def kick(self, conn: co.SidecarConnection) -> bool:
        """End ``conn``; whether its server says it did."""
        msg = await self.bus.nc.request(
            f"$SYS.REQ.SERVER.{conn.server_id}.KICK", json.dumps({"cid": conn.cid}).encode(), timeout=2.0
        )
        reply = json.loads(msg.data)
        if reply.get("error"):
            log.info("revoke_missed", job_id=conn.job_id, node_id=conn.node_id, error=reply["error"])
            return False
        return True

    async def sweep(self) -> list[co.SidecarConnection]:
        """One listing and the connections it ended."""
        due = self.revocations.due(await self.connections(), self.placed, time.monotonic())
        done: list[co.SidecarConnection] = []
        for conn in due:
            if await self.kick(conn):
                done.append(conn)
                self.revoked.append(conn)
                REVOCATIONS.inc()
                log.warning(
                    "sidecar_revoked",
                    job_id=conn.job_id,
                    node_id=conn.node_id,
                    server_id=conn.server_id,
                    cid=conn.cid,
                    grace_s=self.revocations.grace_s,
                )
        return done

    async def run(self, stop: asyncio.Event) -> None:
        """Sweep every ``sweep_s`` until ``stop`` is set; a failed sweep (no server, a
        timeout) is logged and the next one tried."""
        while not stop.is_set():
            try:
                await self.sweep()
            except Exception as exc:  # the callout must go on answering
                log.warning("revoker_sweep_failed", error=str(exc) or type(exc).__name__)
            try:
                await asyncio.wait_for(stop.wait(), self.sweep_s)
            except TimeoutError:
                pass


class AuthorizerService:
    """Answers auth callout requests from its fold of the log.

    Args:
        bus: a bus connected as the ``authorizer`` identity.
        issuer: the callout issuer's account key pair (signs every answer).
        node_keys: node id -> public key of its ``sidecar-<node>`` identity; a callable
            is asked again at each request (identities added later, ``shoal creds add``).
        wait_s: how long a request waits for the fold to reach its placement sequence
            (under the 2 s a shoal client waits for the server's answer to its connect).
        expires_s: lifetime of the user JWTs it issues (None: no expiry; the server ends
            a connection whose JWT expires, and nats-py 2.16 then closes the client for
            good instead of reconnecting, so the shipped authorizer leaves it None:
            ``tests/test_callout.py::test_an_expired_sidecar_identity_is_disconnected_for_good``);
            revocation (``revoker``) ends a sidecar that outlives its placement instead.
        revoker: a bus connected as the ``revoker`` identity: with it, sidecars whose
            job left their node ``grace_s`` ago are disconnected (:class:`Revoker`,
            every ``sweep_s``); without it, a sidecar is judged only when it connects.
        identities: the installation's identities, asked again at each request: a
            client that authenticates with the nkey of one of them that the server's
            running configuration does not list yet (``shoal creds add`` under ``shoal
            up``, which then need not restart its server) is admitted with that
            identity's permissions (:func:`shoal.auth.callout_admits`), and so is an MQTT
            device that logs in with the user name and password of one. None: only
            sidecars are admitted.
    """

    def __init__(
        self,
        bus: Bus,
        *,
        issuer: nkeys.KeyPair,
        node_keys: Mapping[str, str] | Callable[[], Mapping[str, str]],
        wait_s: float = 1.5,
        expires_s: float | None = None,
        projection: Projection | None = None,
        revoker: Bus | None = None,
        grace_s: float = 30.0,
        sweep_s: float = 5.0,
        identities: Callable[[], Iterable[Identity]] | None = None,
    ) -> None:
        self.bus = bus
        self.issuer = issuer
        self._node_keys = node_keys
        self._identities = identities
        self.wait_s = wait_s
        self.expires_s = expires_s
        self.projection = projection or Projection(bus, snapshot_name=CLUSTER_SNAPSHOT)
        self.decisions: dict[str, int] = {}
        """Answers given, by outcome (``allowed``, ``refused``, ``malformed``)."""
        self.serving = asyncio.Event()
        """Set once the fold has caught up and the callout subject is subscribed."""
        self.revoker = (
            Revoker(revoker, placed=self.placed, grace_s=grace_s, sweep_s=sweep_s) if revoker else None
        )

    def node_keys(self) -> Mapping[str, str]:
        keys = self._node_keys
        return keys() if callable(keys) else keys

    def placed(self, job_id: str, node_id: str) -> bool:
        """Whether ``job_id`` is placed on ``node_id`` and not finished, in the fold."""
        job = self.projection.state.jobs.get(job_id)
        if job is None or job.status in FINISHED_STATUSES:
            return False
        return any(g.node_id == node_id for g in job.placement)

    async def answer(self, data: bytes) -> tuple[bytes | None, str]:
        """(the signed answer, outcome) for one request; no answer for a request that is
        not a well-formed server request (nothing to address an answer to)."""
        try:
            req = co.parse_request(data.decode(errors="replace"))
        except co.CalloutError as exc:
            return None, f"malformed: {exc}"
        try:
            # nats-server copies an MQTT password into auth_token too: never a sidecar.
            mqtt = req.client_type == "mqtt"
            if mqtt or not req.token:
                ident = await self._mqtt_identity(req) if mqtt else self._static_identity(req)
                perms = permissions(ident, self.bus.names.prefix)
                user = co.user_claims(req, ident.name, perms, expires_s=None)
                how = " (mqtt)" if mqtt else ""
                return co.response(req, self.issuer, user=user), f"allowed {ident.name}{how}"
            grant = co.verify_sidecar_token(req.token, self.node_keys())
            if grant.placement_seq > self.projection.last_seq:
                try:
                    await self.projection.wait_for(grant.placement_seq, self.wait_s)
                except TimeoutError:
                    pass  # judged on what is folded: not placed, most likely
            grant = co.authorize(req, node_keys=self.node_keys(), placed=self.placed)
            perms = sidecar_job_permissions(grant.job_id, grant.node_id, self.bus.names.prefix)
        except (co.CalloutError, AuthError) as exc:
            return co.response(req, self.issuer, error=str(exc)), f"refused: {exc}"
        user = co.user_claims(
            req, co.sidecar_user(grant.node_id, grant.job_id), perms, expires_s=self.expires_s
        )
        return co.response(req, self.issuer, user=user), f"allowed {grant.job_id}@{grant.node_id}"

    def _static_identity(self, req: co.Request) -> Identity:
        """The identity whose nkey the request's client proved it holds.

        Raises:
            CalloutError: no nkey (and no sidecar token), a bad signature, or a key
                that is no identity the callout may admit.
        """
        if not req.nkey:
            raise co.CalloutError("no sidecar token (static identities connect with their nkey)")
        if self._identities is None:
            raise co.CalloutError(f"{req.nkey} is not a user of this server")
        key = co.verify_nkey(req)
        ident = next((i for i in self._identities() if i.public_key == key), None)
        if ident is None or not callout_admits(ident):
            raise co.CalloutError(f"{key} is no identity of this installation the callout admits")
        return ident

    async def _mqtt_identity(self, req: co.Request) -> Identity:
        """The identity whose MQTT user name and password an MQTT device gave (one that
        ``shoal creds add ... --mqtt-password`` made after the server's configuration was
        written; the bcrypt check runs off the event loop).

        Raises:
            CalloutError: no identities to check against, no user name or password, or
                no identity the callout may admit with that login.
        """
        if self._identities is None:
            raise co.CalloutError("MQTT devices log in as users of the server's configuration")
        if not req.user or not req.password:
            raise co.CalloutError("an MQTT device logs in with a user name and a password")
        ident = await asyncio.to_thread(mqtt_identity, list(self._identities()), req.user, req.password)
        if ident is None or not callout_admits(ident):
            raise co.CalloutError(f"MQTT user {req.user!r}: no such device login, or a wrong password")
        return ident

    async def _handle(self, msg: Msg) -> None:
        reply, outcome = await self.answer(msg.data)
        kind = outcome.split(" ", 1)[0].rstrip(":")
        self.decisions[kind] = self.decisions.get(kind, 0) + 1
        DECISIONS.labels(kind).inc()
        log.info("auth_callout", outcome=outcome)
        if reply is not None and msg.reply:
            await msg.respond(reply)

    async def run(self, stop: asyncio.Event) -> None:
        """Fold the log and answer requests until ``stop`` is set."""
        await self.projection.start()
        try:
            await self.projection.wait_ready()
            tasks: set[asyncio.Task[None]] = set()

            async def on_request(msg: Msg) -> None:
                # Each request waits on its own (a placement the fold has not reached).
                task = asyncio.create_task(self._handle(msg))
                tasks.add(task)
                task.add_done_callback(tasks.discard)

            # A queue group: several authorizers (they fold the same log) share the
            # requests, one answer each.
            sub = await self.bus.nc.subscribe(co.CALLOUT_SUBJECT, queue=QUEUE, cb=on_request)
            await self.bus.nc.flush()
            self.serving.set()
            log.info("authorizer_ready", last_seq=self.projection.last_seq, revokes=self.revoker is not None)
            sweeping = asyncio.create_task(self.revoker.run(stop)) if self.revoker else None
            try:
                await stop.wait()
            finally:
                await sub.unsubscribe()
                await asyncio.gather(*tasks, return_exceptions=True)
                if sweeping is not None:
                    await asyncio.gather(sweeping, return_exceptions=True)
        finally:
            await self.projection.stop()
