"""authorizer: answers the NATS server's auth callout for sidecars (:mod:`shoal.callout`).

Consumes: the event log through a :class:`~shoal.projection.Projection` (which job is
placed on which node) and the server's authorization requests on
``$SYS.REQ.USER.AUTH`` (only this identity may subscribe there, :mod:`shoal.auth`).

Decides: whether a connecting sidecar may be the sidecar of the job its token names:
the token must be signed by the ``sidecar-<node>`` key of the node it names, and the
job must be placed (and not finished) on that node. The fold is first brought up to the
placement sequence the token names (a node daemon acts on a placement this process may
not have folded yet), waiting at most ``wait_s``.

Publishes: nothing on the log; each request gets one answer, the user JWT with the
job's permissions (:func:`shoal.auth.sidecar_job_permissions`) or an error, both signed
with the callout issuer's account key (a request that is not a well-formed server
request gets none). Every request is counted by outcome (``allowed``, ``refused``,
``malformed``: ``shoal_authorizer_decisions_total``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import nkeys
import structlog
from nats.aio.msg import Msg
from prometheus_client import Counter
from shoal import callout as co
from shoal.auth import AuthError, sidecar_job_permissions
from shoal.bus import Bus
from shoal.projection import CLUSTER_SNAPSHOT, Projection
from shoal.state import FINISHED_STATUSES

log = structlog.get_logger("shoal.authorizer")

QUEUE = "authorizer"
"""The queue group of the authorizers' subscriptions to the callout subject."""

DECISIONS = Counter(
    "shoal_authorizer_decisions", "Auth callout answers of the authorizer, by outcome", ["outcome"]
)


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
            ``tests/test_callout.py::test_an_expired_sidecar_identity_is_disconnected_for_good``).
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
    ) -> None:
        self.bus = bus
        self.issuer = issuer
        self._node_keys = node_keys
        self.wait_s = wait_s
        self.expires_s = expires_s
        self.projection = projection or Projection(bus, snapshot_name=CLUSTER_SNAPSHOT)
        self.decisions: dict[str, int] = {}
        """Answers given, by outcome (``allowed``, ``refused``, ``malformed``)."""
        self.serving = asyncio.Event()
        """Set once the fold has caught up and the callout subject is subscribed."""

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
            grant = co.verify_sidecar_token(req.token, self.node_keys()) if req.token else None
            if grant is None:
                raise co.CalloutError("no sidecar token")
            if grant.placement_seq > self.projection.last_seq:
                try:
                    await self.projection.wait_for(grant.placement_seq, self.wait_s)
                except TimeoutError:
                    pass  # judged on what is folded: not placed, most likely
            grant = co.authorize(req, node_keys=self.node_keys(), placed=self.placed)
            perms = sidecar_job_permissions(grant.job_id, grant.node_id, self.bus.names.prefix)
        except (co.CalloutError, AuthError) as exc:
            return co.response(req, self.issuer, error=str(exc)), f"refused: {exc}"
        user = co.user_claims(req, grant, perms, expires_s=self.expires_s)
        return co.response(req, self.issuer, user=user), f"allowed {grant.job_id}@{grant.node_id}"

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
            log.info("authorizer_ready", last_seq=self.projection.last_seq)
            try:
                await stop.wait()
            finally:
                await sub.unsubscribe()
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            await self.projection.stop()
