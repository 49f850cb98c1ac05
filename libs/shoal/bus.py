"""The bus: a thin layer over nats-py for shoal's event log on JetStream.

What it adds to the client, and why:

* **Pipelined, acked publishing.** ``js.publish`` waits one round trip per event
  (~10k/s here). :meth:`Bus.publish_many` writes a window of core publishes, each
  with its own reply subject on one long-lived ack inbox, then collects and checks
  every JetStream ack. Every event carries its id as ``Nats-Msg-Id`` so a
  re-publish inside the stream's duplicate window is dropped by the server.
* **Optimistic concurrency.** ``expected_last_subject_seq`` becomes
  ``Nats-Expected-Last-Subject-Sequence``; a conflict raises
  :class:`ConcurrencyConflict`.
* **Replay then follow, without gap or duplicate.** :meth:`Bus.replay_batches`
  uses one ephemeral pull consumer for both the history and the live tail, pulling
  large batches straight from ``$JS.API.CONSUMER.MSG.NEXT`` (several times faster
  than ``fetch``), and knows it has caught up from the pending count the server
  puts in each reply subject.
* **Work consumers with a dead-letter subject.** :meth:`Bus.consume` runs a
  durable pull consumer with explicit acks, keeps slow handlers alive with
  ``in_progress``, bounds redelivery with ``max_deliver`` and moves any message
  that can never succeed (garbage, invalid payload, oversized, a handler's
  :class:`PermanentError`, redeliveries exhausted) to ``<prefix>.dlq.<code>``
  with the reason in headers, then ``term``s it. Unknown event types (and a known
  type at a newer schema version) are acked, skipped and counted: an older reader
  survives a newer writer.
* **No message stops a reader** (see *Poison messages* below).
* **A leader lease** in a KV bucket whose TTL is the lease (:class:`LeaderLease`)
  and **snapshots** (state + last applied sequence) in an object store.
* **Trace context**: W3C ``traceparent`` is injected on publish and extracted on
  consume.

Subjects and streams, for prefix ``p`` (default ``shoal``; tests use a unique one):

=================  ===================================================  ======================
stream             subjects                                             use
=================  ===================================================  ======================
``P_EVENTS``       ``p.job.>``, ``p.node.>``, ``p.user.>``,             the event log (facts)
                   ``p.alloc.>``, ``p.trade.>``
``P_CTL``          ``p.ctl.>``                                          durable commands to
                                                                         node daemons/sidecars
``P_DLQ``          ``p.dlq.>``                                          dead letters
``P_BEATS``        ``p.beat.<node>``                                    each node's newest
                                                                         heartbeats (eight,
                                                                         rate-limited)
(no stream)        ``p.cmd.<name>.<sender>``                            request/reply commands
=================  ===================================================  ======================

Request/reply commands are kept out of every stream on purpose: a stream that
captured them would answer the requester with its own publish ack.

Poison messages. Anything can be published on a subject the event stream captures:
garbage bytes, a valid envelope around an invalid payload, an unknown type, a known
type at a schema version above the reader's, a valid event on a subject that is not its
own (a buggy or old writer, or an identity allowed to write there: the server checks
the subject, not what the message says, :class:`shoal.codec.WrongSubject`). No such message may stop a service, live or while it
replays the log at start:

* :meth:`Bus.replay_batches` leaves it out of the batch (so the fold skips it),
  counts it in :class:`BusStats`, lists it in ``Batch.skipped`` with its subject and
  reason, and, with ``dead_letter=True`` (every service's projection), stores it in
  the dead-letter stream once: on ``<prefix>.dlq.<code>.events.<stream seq>`` with
  ``Nats-Expected-Last-Subject-Sequence: 0``, so however many processes replay it,
  however often, the DLQ holds one copy (:meth:`Bus.dead_letter_skipped`).
* A writer's ``expected_last_subject_seq`` cursor is the stream sequence of the
  newest message on its subject *whatever it holds*: the bad message counts, or the
  next append conflicts forever. Services move their cursors on skipped messages
  too (``Projection`` skip listeners), and a restore reads the raw sequence and the
  newest message that decodes separately (:meth:`Bus.last_valid_on_subject`).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import datetime as dt
import hashlib
import itertools
import math
import os
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from enum import StrEnum
from typing import Any

import msgspec
import nats
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from opentelemetry import propagate

from shoal import codec, tasks
from shoal.events import MAX_MESSAGE_BYTES, Envelope, Event, NodeHeartbeat, subject_for

log = structlog.get_logger("shoal.bus")


class Header(StrEnum):
    """Header names on the wire."""

    MSG_ID = "Nats-Msg-Id"
    EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
    TRACEPARENT = "traceparent"
    CONTENT_TYPE = "Content-Type"
    STATUS = "Status"
    DLQ_CODE = "Shoal-Dlq-Code"
    DLQ_REASON = "Shoal-Dlq-Reason"
    DLQ_SUBJECT = "Shoal-Dlq-Subject"
    DLQ_STREAM_SEQ = "Shoal-Dlq-Stream-Seq"
    DLQ_CONSUMER = "Shoal-Dlq-Consumer"


# JetStream API error codes we turn into specific exceptions.
ERR_WRONG_LAST_SEQUENCE = 10071
ERR_MESSAGE_TOO_LARGE = 10054
ERR_STREAM_NAME_IN_USE = 10058
ERR_LIMITS_VIOLATE_CONSUMERS = 10069
"""JetStream's refusal of a stream update whose limits an existing consumer exceeds."""

READER_MAX_INACTIVE_S = 300.0
"""The longest inactivity threshold a consumer of the event, control, beats or
dead-letter stream may ask for, and the one a consumer that asks for none gets (the
streams' ``consumer_limits``). Every identity may create ephemeral consumers (that is how
it reads, :mod:`shoal.auth`); without this bound one could keep any number of them on
the server for as long as it asked. shoal's own readers ask for 30 s."""

_DLQ_PAUSE_S = 30.0
"""After a failed dead letter of a skipped message, seconds before the next try."""

BEATS_PER_NODE = 8
"""Heartbeats the beats stream holds per node. It refuses a node's next one while it
holds this many (``discard_new_per_subject``): this is the per-node rate limit, at most
eight stored a second (a TTL is at least 1 s). Eight, so that a node beating every
0.2 s or slower has every heartbeat stored, with room for the server expiring them up
to a few tenths of a second late (at 0.15 s one of about 40 was refused, on a loaded
machine: ``tests/test_beats.py``). With two, a node beating every 0.2 s had
three of five refused, its newest stored heartbeat up to 0.8 s older than its last
one, and the allocator declared it lost that much early (measured by
``tests/services/test_faults.py``: 1.47 s after its daemon was killed, timeout 2 s)."""
BEATS_MAX_AGE_S = 5.0
"""Seconds a heartbeat stays in the beats stream at most: the lifetime of one sent
without a ``Nats-TTL`` (a node daemon from before the rate limit, or a flood), and the
longest TTL a node may ask for (JetStream does not keep a message past the stream's
``max_age``, whatever its TTL). Short enough that a node whose heartbeats carry no TTL,
sending every second, has one stored that is at most about 2 s old."""
ERR_MAX_MSGS_PER_SUBJECT = 10077
"""JetStream's refusal of a message on a subject that holds its limit (``discard_new_per_subject``)."""
ERR_MSG_TTL_DISABLED = 10166
"""JetStream's refusal of a ``Nats-TTL`` header by a stream that does not allow them."""


def beat_ttl_s(heartbeat_s: float) -> int:
    """The ``Nats-TTL`` of a node's heartbeats: twice the interval in whole seconds, at
    least 1 s and at most :data:`BEATS_MAX_AGE_S`. (JetStream refuses a TTL under 1 s and,
    measured on nats-server 2.15, drops a fraction of a second: "1500ms" lives 1 s.)

    A node beating every ``heartbeat_s`` then has about ``TTL / heartbeat_s`` heartbeats
    stored when it sends the next one (a few more while the server is late expiring
    them): under :data:`BEATS_PER_NODE` for every interval of 0.2 s or more, so each is
    stored. One sent more than ``heartbeat_s`` late may find
    none stored; that does not make the node look lost, because the allocator remembers
    the newest stamp it read (:func:`shoal.cluster.remember_beats`). A node whose interval
    is over half of :data:`BEATS_MAX_AGE_S` has such gaps at every heartbeat.
    """
    return int(min(BEATS_MAX_AGE_S, max(1, math.ceil(2 * heartbeat_s))))


DLQ_MAX_AGE_S = 30 * 24 * 3600.0
DLQ_MAX_MSGS = 10_000
"""Dead letters are kept 30 days, and at most the newest 10,000 (about 10 GiB at the
largest dead letter, a few MiB at a typical one): every role but a client may write
``dlq.>`` (a reader dead-letters what it cannot decode), so without a bound one such
identity could fill the servers' disks. A count, not ``max_bytes``: JetStream reserves
a stream's ``max_bytes`` up front against the server's storage, per installation."""
BEAT_MAX_BYTES = 4096
"""Largest message the beats stream takes (a heartbeat envelope is ~200 bytes)."""


class BusError(Exception):
    """Base of the bus's errors."""


class NoServerError(BusError):
    """No NATS server reachable at the given URL."""


def server_list(url: str) -> list[str]:
    """The servers of a ``NATS_URL``: one URL or a comma-separated seed list
    (``nats://a:4222,nats://b:4222``); a server without a scheme gets ``nats://``."""
    servers = [u.strip() for u in url.split(",") if u.strip()]
    return [u if "://" in u else f"nats://{u}" for u in servers]


def cluster_replicas(server_info: dict[str, Any]) -> int:
    """The replica count the server's cluster supports by default: 3 when the server
    reports a cluster of three or more servers (``connect_urls`` of its INFO), else 1.

    A cluster that does not advertise its servers to clients looks like one server:
    set ``SHOAL_REPLICAS`` there."""
    if not server_info.get("cluster"):
        return 1
    return 3 if len(server_info.get("connect_urls") or []) >= 3 else 1


class AuthFailed(NoServerError):
    """The server refused the connection's credentials (or requires some)."""


def _auth_hint(url: str, creds: str | None) -> str:
    if creds:
        return f"the NATS server at {url} refused the credentials in {creds}"
    return (
        f"the NATS server at {url} requires credentials: set NATS_CREDS to an nkey seed file "
        "(`shoal up` keeps them in <state dir>/creds)"
    )


class PublishRejected(BusError):
    """JetStream refused a publish."""

    def __init__(self, description: str, *, err_code: int = 0, subject: str = "", event_id: str = "") -> None:
        super().__init__(f"publish of {event_id or '?'} to {subject or '?'} rejected: {description}")
        self.description = description
        self.err_code = err_code
        self.subject = subject
        self.event_id = event_id


class StreamUnavailable(PublishRejected):
    """No stream answered the publish (its ack was a "no responders" status): on a
    cluster, the stream is electing a new leader; nothing was stored."""


class AckTimeout(PublishRejected):
    """No ack came within the timeout: the events were sent, and the stream may or may
    not have stored them (their ``Nats-Msg-Id`` makes a re-publish within the duplicate
    window safe)."""


class PermissionDenied(PublishRejected):
    """The server refused the publish: this identity may not publish on the subject."""


class ConcurrencyConflict(PublishRejected):
    """``Nats-Expected-Last-Subject-Sequence`` did not match: someone appended first."""


class RateLimited(PublishRejected):
    """The beats stream holds its limit of this node's heartbeats (:data:`BEATS_PER_NODE`,
    each kept for its TTL) and refused this one: the node sent them too fast.
    Nothing was written; the node's newest stored heartbeat is at most one TTL old."""


class PermanentError(Exception):
    """Raised by a handler for a message that can never succeed: dead-letter it."""

    code = "permanent"


class PublishResult(msgspec.Struct, frozen=True):
    stream: str
    seq: int
    duplicate: bool = False


class _ApiError(msgspec.Struct):
    code: int = 0
    err_code: int = 0
    description: str = ""


class _PubAckMsg(msgspec.Struct):
    stream: str = ""
    seq: int = 0
    duplicate: bool = False
    error: _ApiError | None = None


_ACK_DEC = msgspec.json.Decoder(_PubAckMsg)


def _ack_reply_positions(reply: str) -> tuple[int, int]:
    """(stream sequence, pending count) from a JetStream ack reply subject.

    v1: ``$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>``;
    v2 adds ``<domain>.<account hash>`` after ``ACK`` and a random token at the end.
    """
    tokens = reply.split(".")
    if len(tokens) == 9:
        return int(tokens[5]), int(tokens[8])
    return int(tokens[7]), int(tokens[10])


def _stream_token(prefix: str) -> str:
    return re.sub(r"[^A-Za-z0-9]", "_", prefix).upper()


class Names:
    """Every name the bus uses for one prefix (stream, subject, bucket)."""

    def __init__(self, prefix: str = "shoal") -> None:
        if not re.fullmatch(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*", prefix):
            raise ValueError(f"invalid subject prefix {prefix!r}")
        self.prefix = prefix
        token = _stream_token(prefix)
        self.events_stream = f"{token}_EVENTS"
        self.ctl_stream = f"{token}_CTL"
        self.dlq_stream = f"{token}_DLQ"
        self.lease_bucket = f"{token}_LEASES"
        self.train_meta_bucket = f"{token}_LEASES_TRAIN_META"
        """The real sidecars' rendezvous metadata (key ``train.<job>``): made by
        :meth:`Bus.declare`, since a sidecar may not create a bucket."""
        self.snapshot_bucket = f"{token}_SNAPSHOTS"
        self.profiler_snapshot_bucket = f"{token}_PROFILER_SNAPSHOTS"
        """The profiler's own snapshots: a bucket apart, so that the profiler's identity may
        write its snapshot without being able to touch the cluster snapshot."""
        self.beats_stream = f"{token}_BEATS"
        self.event_subjects = [f"{prefix}.{agg}.>" for agg in ("job", "node", "user", "alloc", "trade")]
        self.ctl_subjects = [f"{prefix}.ctl.>"]
        self.dlq_subjects = [f"{prefix}.dlq.>"]
        self.beat_subjects = [f"{prefix}.beat.*"]

    def cmd(self, name: str, sender: str = "@admin") -> str:
        """Request/reply subject of a command sent as ``sender``, e.g.
        ``shoal.cmd.submit_job.alice``; the default is the admin's token
        (:data:`shoal.auth.ADMIN_TOKEN`), which only the admin identity may use."""
        return f"{self.prefix}.cmd.{name}.{sender}"

    def ctl(self, *tokens: str) -> str:
        return ".".join((self.prefix, "ctl", *tokens))

    def dlq(self, code: str) -> str:
        return f"{self.prefix}.dlq.{code}"

    def beat(self, node_id: str) -> str:
        """Subject of ``node_id``'s heartbeats in the bounded beats stream."""
        return f"{self.prefix}.beat.{node_id}"

    def subject(self, event: Event) -> str:
        return subject_for(event, self.prefix)


class BusStats:
    """Counters a reader exposes; not part of the folded state."""

    def __init__(self) -> None:
        self.unknown_skipped = 0
        self.malformed_skipped = 0
        self.dead_lettered = 0
        self.handled = 0


class SkippedMessage(msgspec.Struct, frozen=True):
    """A message of the log that a replay skipped because it cannot be decoded here."""

    seq: int
    subject: str
    code: str
    """``malformed``, ``unknown_type``, ``future_version`` or ``too_large`` (see :mod:`shoal.codec`)."""
    reason: str


class Batch(list[tuple[int, Envelope]]):
    """A replayed batch of ``(stream_seq, envelope)``.

    ``last_seq`` also counts skipped messages, and ``skipped`` lists them in order:
    a writer's expected-sequence cursor must move past a message on its subject that
    it could not decode, or its next append conflicts forever.
    """

    last_seq: int = 0

    def __init__(self) -> None:
        super().__init__()
        self.skipped: list[SkippedMessage] = []


class Bus:
    """A connection to NATS plus the JetStream names of one shoal installation."""

    def __init__(
        self,
        nc: NatsClient,
        prefix: str = "shoal",
        *,
        duplicate_window_s: float = 120.0,
        replicas: int | None = None,
    ) -> None:
        self.nc = nc
        self.replicas = replicas or cluster_replicas(getattr(nc, "_server_info", None) or {})
        """Replicas of every stream, bucket and object store this bus creates."""
        self.js: JetStreamContext = nc.jetstream()
        self.names = Names(prefix)
        self.stats = BusStats()
        self.duplicate_window_s = duplicate_window_s
        self._ack_prefix: str | None = None
        self._ack_sub: Any = None
        self._pending: dict[int, asyncio.Future[bytes]] = {}
        self._pending_subject: dict[int, str] = {}
        self._closing = False
        """Set by :meth:`close`: the connection is ending on purpose."""
        self._tokens = itertools.count(1)
        self._dlq_paused_until = -math.inf
        self.identity: str | None = None
        """The name of the identity this connection authenticated as (:mod:`shoal.auth`)."""
        self.permission_errors: collections.deque[str] = collections.deque(maxlen=64)
        """The subjects of the latest permissions violations the server reported."""
        self._beat_ttl_retry_at = -math.inf
        """Monotonic instant before which heartbeats go without a ``Nats-TTL`` (the beats
        stream refused one: an installation not upgraded yet)."""

    def on_permission_violation(self, subject: str) -> None:
        """Fail at once every pending publish to ``subject`` (the server dropped it).

        The client library reports the subject lower-cased, so subjects compare so."""
        subject = subject.lower()
        self.permission_errors.append(subject)
        for token, pending_subject in list(self._pending_subject.items()):
            if pending_subject.lower() == subject:
                fut = self._pending.pop(token, None)
                self._pending_subject.pop(token, None)
                if fut is not None and not fut.done():
                    fut.set_exception(
                        PermissionDenied(f"permissions violation for publish to {subject!r}", subject=subject)
                    )

    def decode_event(self, subject: str, data: bytes) -> Envelope:
        """Decode a message of the event log read from ``subject``.

        Raises:
            codec.DecodeFailure: it does not decode (:func:`shoal.codec.decode`), or it
                is an event whose own subject (:func:`shoal.events.subject_for`) is not
                ``subject`` (:class:`shoal.codec.WrongSubject`).
        """
        env = codec.decode(data)
        own = subject_for(env.event, self.names.prefix)
        if own != subject:
            raise codec.WrongSubject(f"a {env.type} event, whose subject is {own!r}, on {subject!r}")
        return env

    # -- connection --------------------------------------------------------------

    @classmethod
    async def connect(
        cls,
        url: str,
        prefix: str = "shoal",
        *,
        name: str = "shoal",
        connect_timeout_s: float = 2.0,
        max_reconnect_attempts: int = -1,
        initial_connect_timeout_s: float = 5.0,
        declare: bool = True,
        creds: str | None = None,
        tls_ca: str | None = None,
        replicas: int | None = None,
        token: str | None = None,
    ) -> Bus:
        """Connect (with reconnects) and, by default, declare the streams.

        Args:
            url: a server URL or a comma-separated seed list of a cluster's servers.
            replicas: replicas of the streams and buckets this bus creates; None: what
                the server reports (:func:`cluster_replicas`).
            creds: an nkey seed file (:mod:`shoal.auth`) to authenticate with; its
                identity's inbox prefix is used for replies. None: no authentication.
            tls_ca: a PEM CA file: connect over TLS and verify the server against it.
            token: instead of ``creds``, a sidecar token (:mod:`shoal.callout`): the
                server's auth callout makes it the identity of one job's sidecar, whose
                replies come on ``_INBOX.sidecar.<node>.<job>``.

        Raises:
            NoServerError: nothing answers at ``url``.
            AuthFailed: the server refused the credentials (or wants some).
        """
        holder: list[Bus] = []
        refused = asyncio.Event()

        async def _error_cb(exc: Exception) -> None:
            text = str(exc)
            if isinstance(exc, nats.errors.AuthorizationError) or "authorization violation" in text.lower():
                refused.set()
            if "permissions violation" in text.lower():
                match = re.search(r'publish to "([^"]+)"', text, re.IGNORECASE)
                if match and holder:
                    holder[0].on_permission_violation(match.group(1))
            # Before the first connection an error ends in the exception connect raises
            # (AuthFailed, NoServerError), which says it once and better: not a warning too.
            (log.warning if holder else log.debug)("nats_error", error=text)

        async def _closed_cb() -> None:
            # nats-py ends a connection for good on most of the server's -ERR messages
            # (without calling error_cb) and when it gives up reconnecting: say so, and why,
            # and fail the process (shoal.tasks.fail: a service drains and exits 1, so its
            # supervisor starts it again with a new connection; elsewhere nothing).
            if holder and not holder[0]._closing:
                err = holder[0].nc.last_error
                reason = str(err or "") or type(err).__name__
                log.warning("nats_connection_closed", error=reason)
                tasks.fail(
                    f"nats-connection-{holder[0].identity or name}", BusError(f"connection closed: {reason}")
                )

        from shoal.auth import inbox_prefix, name_of_creds

        auth: dict[str, Any] = {}
        if creds:
            if not os.access(creds, os.R_OK):
                raise AuthFailed(f"cannot read the credentials file {creds}")
            auth = {"nkeys_seed": str(creds), "inbox_prefix": inbox_prefix(name_of_creds(creds))}
        identity = name_of_creds(creds) if creds else None
        if token:
            from shoal.callout import CalloutError, sidecar_inbox, token_grant

            try:
                grant = token_grant(token)
            except CalloutError as exc:
                raise AuthFailed(f"unusable sidecar token: {exc}") from None
            auth = {"token": token, "inbox_prefix": sidecar_inbox(grant)}
            identity = sidecar_inbox(grant).removeprefix("_INBOX.")
            creds = "a sidecar token"
        if tls_ca:
            import ssl

            try:
                auth["tls"] = ssl.create_default_context(cafile=tls_ca)
            except (OSError, ssl.SSLError) as exc:
                raise NoServerError(f"cannot use the CA file {tls_ca}: {exc}") from None
        try:
            # nats-py keeps retrying a first connect for as long as reconnects are
            # allowed; bound the first connect so a missing server is a clear error,
            # and stop at the first refusal of the credentials.
            connecting = asyncio.ensure_future(
                nats.connect(
                    servers=server_list(url),
                    name=name,
                    connect_timeout=connect_timeout_s,
                    allow_reconnect=True,
                    max_reconnect_attempts=max_reconnect_attempts,
                    reconnect_time_wait=0.5,
                    error_cb=_error_cb,
                    closed_cb=_closed_cb,
                    **auth,
                )
            )
            refusal = asyncio.ensure_future(refused.wait())
            done, _ = await asyncio.wait(
                {connecting, refusal}, timeout=initial_connect_timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
            refusal.cancel()
            if connecting not in done:
                connecting.cancel()
                with contextlib.suppress(BaseException):
                    await connecting
                if refused.is_set():
                    raise AuthFailed(_auth_hint(url, creds))
                raise TimeoutError
            nc = connecting.result()
        except nats.errors.Error as exc:
            if "authorization" in str(exc).lower() or isinstance(exc, nats.errors.AuthorizationError):
                raise AuthFailed(_auth_hint(url, creds)) from None
            raise NoServerError(f"no NATS server reachable at {url}: {exc or type(exc).__name__}") from None
        except (OSError, TimeoutError) as exc:
            raise NoServerError(f"no NATS server reachable at {url}: {exc or type(exc).__name__}") from None
        bus = cls(nc, prefix, replicas=replicas)
        bus.identity = identity
        holder.append(bus)
        if declare:
            try:
                await bus.declare()
            except BaseException:
                # Not half-connected: a caller that retries must not leak a connection.
                bus._closing = True
                with contextlib.suppress(Exception):
                    await nc.close()
                raise
        return bus

    async def close(self) -> None:
        """Drain subscriptions and close the connection."""
        self._closing = True
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(BusError("bus closed"))
        self._pending.clear()
        if not self.nc.is_closed:
            with contextlib.suppress(Exception):
                await self.nc.drain()

    @property
    def may_delete_consumers(self) -> bool:
        """Whether this identity may delete consumers: the admin's, or a connection
        without authentication. No other role may (:mod:`shoal.auth`); the server
        removes their ephemeral consumers after their inactivity threshold."""
        return self.identity in (None, "admin")

    @property
    def may_create_streams(self) -> bool:
        """Whether this identity may create streams and buckets: the admin, a service
        (admission, allocator, placer, profiler, trader) or a connection without
        authentication; not a client, a node, a sidecar or the auth callout's
        (:mod:`shoal.auth`)."""
        from shoal.auth import SERVICE_ROLES

        return self.identity in (None, "admin", *SERVICE_ROLES)

    async def __aenter__(self) -> Bus:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- declaration -------------------------------------------------------------

    async def _ensure_stream(self, config: api.StreamConfig) -> None:
        config.num_replicas = self.replicas
        try:
            await self.js.add_stream(config)
        except nats.js.errors.BadRequestError as exc:
            if exc.err_code != ERR_STREAM_NAME_IN_USE:
                raise
            # Never scale a stream down (an operator may have raised its replicas).
            assert config.name is not None
            existing = (await self.js.stream_info(config.name)).config.num_replicas or 1
            config.num_replicas = max(self.replicas, existing)
            try:
                await self.js.update_stream(config)
            except (TimeoutError, nats.errors.TimeoutError):
                # Only the admin may update a stream (shoal.auth): the server dropped the
                # request. The stream exists, which is what a service needs.
                log.warning("stream_update_not_permitted", stream=config.name)
            except nats.js.errors.APIError as refused:
                if refused.err_code != ERR_LIMITS_VIOLATE_CONSUMERS or config.consumer_limits is None:
                    raise
                # A consumer made before the bound asks for a longer inactivity (a
                # stream declared by an older shoal): update the rest now; the bound
                # applies at a later declare, once that consumer is gone.
                log.warning("stream_consumer_limits_deferred", stream=config.name, error=str(refused))
                config.consumer_limits = None
                await self.js.update_stream(config)

    async def declare(self) -> None:
        """Create (or update to the current config) the streams and buckets. Idempotent.

        A node, sidecar or client identity may not create streams (:mod:`shoal.auth`):
        for them this does nothing; the admin (``shoal up``) or a service creates them,
        the sidecars' rendezvous bucket (:attr:`Names.train_meta_bucket`) among them.
        (The leases' bucket is made by the first service that campaigns, with its
        ``SHOAL_LEASE_TTL_S``, before any job runs: :meth:`lease`.)"""
        if not self.may_create_streams:
            return
        n = self.names
        await self._ensure_stream(
            api.StreamConfig(
                name=n.events_stream,
                consumer_limits=api.StreamConsumerLimits(inactive_threshold=READER_MAX_INACTIVE_S),
                subjects=n.event_subjects,
                storage=api.StorageType.FILE,
                retention=api.RetentionPolicy.LIMITS,
                max_msg_size=MAX_MESSAGE_BYTES,
                duplicate_window=self.duplicate_window_s,
                allow_direct=True,
            )
        )
        await self._ensure_stream(
            api.StreamConfig(
                name=n.ctl_stream,
                consumer_limits=api.StreamConsumerLimits(inactive_threshold=READER_MAX_INACTIVE_S),
                subjects=n.ctl_subjects,
                storage=api.StorageType.FILE,
                retention=api.RetentionPolicy.LIMITS,
                max_msg_size=MAX_MESSAGE_BYTES,
                max_age=24 * 3600.0,
                duplicate_window=self.duplicate_window_s,
            )
        )
        await self._ensure_stream(
            api.StreamConfig(
                name=n.dlq_stream,
                consumer_limits=api.StreamConsumerLimits(inactive_threshold=READER_MAX_INACTIVE_S),
                subjects=n.dlq_subjects,
                storage=api.StorageType.FILE,
                # A dead letter carries the original message plus headers; allow a margin.
                max_msg_size=MAX_MESSAGE_BYTES * 4 + 64 * 1024,
                max_age=DLQ_MAX_AGE_S,
                max_msgs=DLQ_MAX_MSGS,
                discard=api.DiscardPolicy.OLD,
            )
        )
        await self._ensure_stream(
            api.StreamConfig(
                name=n.beats_stream,
                consumer_limits=api.StreamConsumerLimits(inactive_threshold=READER_MAX_INACTIVE_S),
                subjects=n.beat_subjects,
                storage=api.StorageType.FILE,
                retention=api.RetentionPolicy.LIMITS,
                # Rate-limited per node: at most BEATS_PER_NODE heartbeats per node, each
                # kept for its own TTL (twice its node's interval, beat_ttl_s) or max_age;
                # while a node has that many stored, its next one is refused without a
                # write. So a node that floods gets at most eight a second stored.
                max_msgs_per_subject=BEATS_PER_NODE,
                discard=api.DiscardPolicy.NEW,
                discard_new_per_subject=True,
                allow_msg_ttl=True,
                max_age=BEATS_MAX_AGE_S,
                max_msg_size=BEAT_MAX_BYTES,
                allow_direct=True,
            )
        )
        await self.key_value(
            api.KeyValueConfig(bucket=n.train_meta_bucket, history=1, storage=api.StorageType.FILE)
        )
        # Buckets made earlier with fewer replicas (a first start with a cluster node down):
        # the admin's start raises them, the services' ones included, which may not.
        for existing in (
            f"KV_{n.train_meta_bucket}",
            f"KV_{n.lease_bucket}",
            f"OBJ_{n.snapshot_bucket}",
            f"OBJ_{n.profiler_snapshot_bucket}",
        ):
            await self._raise_replicas(existing)

    # -- publishing --------------------------------------------------------------

    async def _ensure_ack_inbox(self) -> str:
        if self._ack_prefix is None:
            self._ack_prefix = self.nc.new_inbox()
            self._ack_sub = await self.nc.subscribe(self._ack_prefix + ".*", cb=self._on_ack)
        return self._ack_prefix

    async def _on_ack(self, msg: Msg) -> None:
        token = int(msg.subject.rsplit(".", 1)[1])
        self._pending_subject.pop(token, None)
        fut = self._pending.pop(token, None)
        if fut is not None and not fut.done():
            fut.set_result(msg.data)

    @staticmethod
    def _trace_headers() -> dict[str, str]:
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        return carrier

    async def publish(
        self,
        item: Envelope | Event,
        *,
        expected_last_subject_seq: int | None = None,
        timeout_s: float = 5.0,
    ) -> PublishResult:
        """Append one event to the log and wait for its ack. While no stream answers (a
        cluster electing the stream's leader) the publish is retried for ``timeout_s``.

        Raises:
            StreamUnavailable: no stream answered within ``timeout_s``.
            MessageTooLarge: the encoded event is over the size limit (nothing sent).
            ConcurrencyConflict: ``expected_last_subject_seq`` did not match.
            AckTimeout: no ack within ``timeout_s``; the event may or may not be stored.
            PublishRejected: any other refusal by JetStream.
        """
        env = item if isinstance(item, Envelope) else codec.wrap(item)
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            try:
                results = await self.publish_many(
                    [env], expected_last_subject_seq=expected_last_subject_seq, timeout_s=timeout_s
                )
                return results[0]
            except StreamUnavailable:
                # Nothing was stored; the same Nats-Msg-Id makes a retry safe anyway.
                if asyncio.get_running_loop().time() + 0.1 > deadline:
                    raise
                await asyncio.sleep(0.1)

    async def publish_first(self, item: Envelope | Event, *, timeout_s: float = 5.0) -> PublishResult:
        """Append one event as the first fact on its subject (a job's submission or
        completion): with ``Nats-Expected-Last-Subject-Sequence: 0``, or, when the
        subject holds only messages no reader can decode (see *Poison messages*
        above), after the newest of them.

        Nothing is sent after ``timeout_s`` from the call.

        Raises:
            ConcurrencyConflict: a message that decodes is on the subject already (or
                one was appended meanwhile).
            MessageTooLarge / PublishRejected: as :meth:`publish`.
        """
        env = item if isinstance(item, Envelope) else codec.wrap(item)
        deadline = asyncio.get_running_loop().time() + timeout_s
        try:
            return await self.publish(env, expected_last_subject_seq=0, timeout_s=timeout_s)
        except ConcurrencyConflict:
            last, valid = await self.last_valid_on_subject(self.names.subject(env.event))
            if valid is not None or not last:
                raise
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:  # no second send after the caller's time is up: nothing was stored
            raise StreamUnavailable("no time left to append after undecodable messages", event_id=env.id)
        log.warning("append_after_undecodable", event_id=env.id, type=env.type, stream_seq=last)
        return await self.publish(env, expected_last_subject_seq=last, timeout_s=left)

    async def publish_many(
        self,
        items: Sequence[Envelope | Event],
        *,
        window: int = 4096,
        expected_last_subject_seq: int | None = None,
        timeout_s: float = 10.0,
    ) -> list[PublishResult]:
        """Append a burst of events, pipelined, and check every ack.

        Events are written ``window`` at a time without waiting, then their acks are
        collected. All acks are awaited before any error is raised, so on return or
        raise the caller knows the fate of every event (acked ones are stored by the
        stream's replicas; what a power loss can still take is in docs/operations.md).

        Raises:
            MessageTooLarge: an event is over the size limit (nothing of the burst sent).
            ConcurrencyConflict / PublishRejected: the first refusal; its ``results``
                attribute holds the per-event outcome (a result or an exception).
        """
        envs = [i if isinstance(i, Envelope) else codec.wrap(i) for i in items]
        encoded = []
        for env in envs:
            data = codec.encode(env)
            if len(data) > MAX_MESSAGE_BYTES:
                raise codec.MessageTooLarge(
                    f"event {env.id} ({env.type}) is {len(data)} bytes; the limit is {MAX_MESSAGE_BYTES}"
                )
            encoded.append((self.names.subject(env.event), data, env.id))
        inbox = await self._ensure_ack_inbox()
        trace = self._trace_headers()
        loop = asyncio.get_running_loop()
        publish = self.nc.publish
        out: list[PublishResult | BusError] = []
        for start in range(0, len(encoded), window):
            chunk = encoded[start : start + window]
            futs: list[asyncio.Future[bytes]] = []
            for subject, data, event_id in chunk:
                token = next(self._tokens)
                fut: asyncio.Future[bytes] = loop.create_future()
                self._pending[token] = fut
                self._pending_subject[token] = subject
                futs.append(fut)
                headers = {Header.MSG_ID.value: event_id, **trace}
                if expected_last_subject_seq is not None:
                    headers[Header.EXPECTED_LAST_SUBJECT_SEQ.value] = str(expected_last_subject_seq)
                await publish(subject, data, reply=f"{inbox}.{token}", headers=headers)
            try:
                replies = await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), timeout_s)
            except TimeoutError:
                for f in futs:
                    f.cancel()
                denied = [s for s, _d, _i in chunk if s.lower() in self.permission_errors]
                if denied:
                    raise PermissionDenied(
                        f"permissions violation for publish to {denied[0]!r}", subject=denied[0]
                    ) from None
                raise AckTimeout(f"no ack within {timeout_s}s for a burst of {len(chunk)}") from None
            for (subject, _data, event_id), reply in zip(chunk, replies, strict=True):
                out.append(self._check_ack(reply, subject, event_id))
        errors = [r for r in out if isinstance(r, BusError)]
        if errors:
            first = errors[0]
            first.results = out  # type: ignore[attr-defined]
            raise first
        return out  # type: ignore[return-value]

    @staticmethod
    def _check_ack(reply: bytes | BaseException, subject: str, event_id: str) -> PublishResult | BusError:
        if isinstance(reply, BusError):
            return reply
        if isinstance(reply, BaseException):
            return PublishRejected(str(reply), subject=subject, event_id=event_id)
        if not reply:
            return StreamUnavailable(
                "no stream answered (no responders: a cluster electing the stream's leader?)",
                subject=subject,
                event_id=event_id,
            )
        try:
            ack = _ACK_DEC.decode(reply)
        except msgspec.DecodeError:
            return PublishRejected(f"unreadable ack {reply[:80]!r}", subject=subject, event_id=event_id)
        if ack.error is not None:
            cls = ConcurrencyConflict if ack.error.err_code == ERR_WRONG_LAST_SEQUENCE else PublishRejected
            return cls(ack.error.description, err_code=ack.error.err_code, subject=subject, event_id=event_id)
        if not ack.stream:
            return PublishRejected("no stream captured the subject", subject=subject, event_id=event_id)
        return PublishResult(ack.stream, ack.seq, ack.duplicate)

    async def publish_raw(
        self, subject: str, data: bytes, headers: dict[str, str] | None = None
    ) -> PublishResult:
        """Publish bytes as they are (tests and fault injection; no envelope checks)."""
        try:
            ack = await self.js.publish(subject, data, headers=headers)
        except nats.js.errors.APIError as exc:
            cls = ConcurrencyConflict if exc.err_code == ERR_WRONG_LAST_SEQUENCE else PublishRejected
            raise cls(exc.description or str(exc), err_code=exc.err_code or 0, subject=subject) from None
        return PublishResult(ack.stream, ack.seq, bool(ack.duplicate))

    async def publish_beat(
        self, env: Envelope, *, ttl_s: int | None = None, timeout_s: float = 5.0
    ) -> PublishResult:
        """Store a node's heartbeat (``env``, a :class:`~shoal.events.NodeHeartbeat`) in the
        beats stream, on :meth:`Names.beat` of its node, and wait for the ack. Heartbeats
        never reach the event log.

        ``ttl_s`` (whole seconds, :func:`beat_ttl_s`) goes in the ``Nats-TTL`` header:
        the stream drops the heartbeat that long after storing it. A stream declared
        before the rate limit refuses the header; the heartbeat is then sent without it,
        and so are this bus's next ones for 60 s.

        Raises:
            RateLimited: the stream holds its limit of this node's heartbeats.
            StreamUnavailable: no beats stream answered (not declared yet, or no leader).
            PublishRejected: any other refusal by JetStream.
        """
        node_id = getattr(env.event, "node_id", "")
        subject = self.names.beat(node_id)
        data = codec.encode(env)
        headers = None
        if ttl_s is not None and time.monotonic() >= self._beat_ttl_retry_at:
            headers = {"Nats-TTL": f"{int(ttl_s)}s"}
        try:
            try:
                ack = await self.js.publish(subject, data, timeout=timeout_s, headers=headers)
            except nats.js.errors.APIError as exc:
                if headers is None or exc.err_code != ERR_MSG_TTL_DISABLED:
                    raise
                self._beat_ttl_retry_at = time.monotonic() + 60.0
                ack = await self.js.publish(subject, data, timeout=timeout_s)
        except nats.errors.NoRespondersError:
            raise StreamUnavailable("no beats stream answered", subject=subject, event_id=env.id) from None
        except (TimeoutError, nats.errors.TimeoutError):
            if subject.lower() in self.permission_errors:  # the server dropped it
                raise PermissionDenied(
                    f"permissions violation for publish to {subject!r}", subject=subject, event_id=env.id
                ) from None
            raise AckTimeout(f"no ack within {timeout_s}s", subject=subject, event_id=env.id) from None
        except nats.js.errors.APIError as exc:
            cls = RateLimited if exc.err_code == ERR_MAX_MSGS_PER_SUBJECT else PublishRejected
            raise cls(
                exc.description or str(exc), err_code=exc.err_code or 0, subject=subject, event_id=env.id
            ) from None
        return PublishResult(ack.stream, ack.seq, bool(ack.duplicate))

    async def latest_beats(self, node_ids: Iterable[str], *, dead_letter: bool = False) -> dict[str, float]:
        """The occurred-at stamp of the newest heartbeat of each of ``node_ids`` that has
        one in the beats stream: one direct get per node, all at once (O(nodes) reads,
        whatever rate the nodes, or a flood, heartbeat at).

        A newest message that does not decode, is not a ``NodeHeartbeat`` or names
        another node is left out, as a poison message of the log is: counted in
        :attr:`stats`, and with ``dead_letter`` (the allocator's reads) stored in the
        dead-letter stream once (:meth:`dead_letter_skipped`, ``source="beats"``,
        code ``malformed``/``unknown_type``/``future_version``/``wrong_subject``)."""
        ids = list(node_ids)

        async def skip(msg: Any, code: str, reason: str) -> None:
            if code in ("unknown_type", "future_version"):
                self.stats.unknown_skipped += 1
            else:
                self.stats.malformed_skipped += 1
            if dead_letter:
                skipped = SkippedMessage(int(msg.seq or 0), msg.subject or "", code, reason)
                await self.dead_letter_skipped(skipped, msg.data or b"", source="beats")

        async def one(node_id: str) -> float | None:
            subject = self.names.beat(node_id)
            try:
                msg = await self.js.get_last_msg(self.names.beats_stream, subject, direct=True)
            except nats.js.errors.NotFoundError:
                return None
            try:
                env = codec.decode(msg.data or b"")
            except codec.DecodeFailure as exc:
                await skip(msg, exc.code, str(exc))
                return None
            event = env.event
            if not isinstance(event, NodeHeartbeat) or event.node_id != node_id:
                await skip(msg, codec.WrongSubject.code, f"a {env.type} event on {subject!r}")
                return None
            return env.at

        stamps = await asyncio.gather(*(one(n) for n in ids))
        return {n: at for n, at in zip(ids, stamps, strict=True) if at is not None}

    # -- reading -----------------------------------------------------------------

    async def last_seq(self, stream: str | None = None) -> int:
        info = await self.js.stream_info(stream or self.names.events_stream)
        return int(info.state.last_seq)

    async def wait_for_stream(self, stream: str | None = None) -> int:
        """The last sequence of ``stream`` (the event stream by default), waiting for as
        long as it takes while the stream does not exist yet or has no leader yet.

        Identities that may not create streams (the authorizer, node daemons) can start
        before whoever declares them (a service, ``shoal nats-config``), and a cluster
        whose JetStream quorum is still forming answers a stream's info with no
        responders, a timeout or "temporarily unavailable". Each of those means "not
        yet" here: a warning at once and every minute after, and the caller stays not
        ready (``/readyz``) instead of exiting. Exiting is no answer: a runtime that does
        not restart the process would leave it down for good (podman-compose: its
        containers require the one-shot ``nats-config``, which has exited, and podman
        4.3 does not restart a container whose requirement is not running).
        """
        name = stream or self.names.events_stream
        delay = 0.2
        started = time.monotonic()
        warn_at = started
        while True:
            try:
                return await self.last_seq(name)
            except (
                nats.js.errors.NotFoundError,
                nats.js.errors.ServiceUnavailableError,
                nats.errors.NoRespondersError,
                nats.errors.TimeoutError,
            ) as exc:
                now = time.monotonic()
                if now >= warn_at:
                    log.warning(
                        "waiting_for_stream",
                        stream=name,
                        error=str(exc) or type(exc).__name__,
                        waited_s=round(now - started, 1),
                    )
                    warn_at = now + 60.0
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def last_subject_seq(self, subject: str) -> int:
        """Stream sequence of the newest message on ``subject`` (0 when none)."""
        try:
            msg = await self.js.get_last_msg(self.names.events_stream, subject)
        except nats.js.errors.NotFoundError:
            return 0
        return int(msg.seq or 0)

    async def last_valid_on_subject(self, subject: str) -> tuple[int, tuple[int, Envelope] | None]:
        """The stream sequence of the newest message on ``subject`` whatever it
        contains (0 when none), and the newest ``(seq, envelope)`` there that decodes
        (None when none does).

        The first is what ``Nats-Expected-Last-Subject-Sequence`` compares with; the
        second is the newest fact a reader can use. When the newest message does not
        decode, the subject is walked back in growing windows of stream sequences,
        each read forward with ``next_by_subj`` (one request per message on the
        subject), until one decodes.
        """
        stream = self.names.events_stream
        try:
            raw = await self.js.get_last_msg(stream, subject)
        except nats.js.errors.NotFoundError:
            return 0, None
        last = int(raw.seq or 0)
        with contextlib.suppress(codec.DecodeFailure):
            return last, (last, self.decode_event(subject, raw.data or b""))
        high, window = last, 256
        while high > 1:
            low = max(1, high - window)
            found: tuple[int, Envelope] | None = None
            seq = low
            while seq < high:
                try:
                    msg = await self.js.get_msg(stream, seq, subject=subject, next=True)
                except nats.js.errors.NotFoundError:
                    break
                if int(msg.seq or 0) >= high:
                    break
                with contextlib.suppress(codec.DecodeFailure):
                    found = (int(msg.seq or 0), self.decode_event(subject, msg.data or b""))
                seq = int(msg.seq or 0) + 1
            if found is not None:
                return last, found
            high, window = low, window * 4
        return last, None

    async def _nothing_pending(self, stream: str, consumer: str) -> bool:
        """Whether a replay consumer has nothing left to deliver (False when it cannot tell:
        the caller then asks again)."""
        try:
            info = await self.js.consumer_info(stream, consumer, timeout=5.0)
        except Exception as exc:
            log.debug("replay_consumer_info_failed", error=repr(exc))
            return False
        return not info.num_pending

    async def replay_batches(
        self,
        *,
        start_seq: int | None = None,
        start_time: dt.datetime | None = None,
        follow: bool = False,
        batch: int = 8192,
        filter_subjects: list[str] | None = None,
        stop: asyncio.Event | None = None,
        idle_expires_s: float = 1.0,
        dead_letter: bool = False,
        inactive_threshold_s: float = 30.0,
        create_timeout_s: float = 30.0,
    ) -> AsyncIterator[Batch]:
        """Yield the log in order as batches of ``(stream_seq, envelope)``.

        Replays from ``start_seq`` (default 1) or ``start_time``; with ``follow``
        keeps yielding live events on the same consumer (no gap, no duplicate) until
        ``stop`` is set. Without ``follow`` it ends once caught up with the log as it
        was when the replay reached its end.

        A message that does not decode (malformed, unknown type, future version,
        too large, or an event on a subject not its own: :meth:`decode_event`) is left
        out of the batch, counted in :attr:`stats`, and listed in
        the batch's ``skipped`` with its subject and reason; with ``dead_letter`` it
        is also stored in the dead-letter stream (once, whoever else replays it:
        :meth:`dead_letter_skipped`). A batch with only skipped messages is still
        yielded, so that ``last_seq`` and the writers' cursors move on.

        The consumer is ephemeral: the server removes it after ``inactive_threshold_s``
        (30 s by default) without a pull request, or when the server restarts. A lost
        consumer (its deletion reported, no responder for a pull, or a stalled pull whose
        consumer the server no longer knows) is created again from the sequence after the
        last one handed out, so the replay goes on without gap or duplicate; while that
        fails it is retried with a backoff (0.25 s doubling to 5 s), and each episode logs
        one ``replay_consumer_lost`` warning and one ``replay_consumer_recreated`` line.
        The recreated consumer gets a fresh reply inbox: answers still due to the lost
        one's requests (a paused server's backlog) must not be read as its own.

        Creating the first consumer is retried the same way for up to
        ``create_timeout_s`` while the failure is one a cluster gives during a leader
        election (see :meth:`_add_replay_consumer`).

        Raises:
            BusError: the bus was closed before the replay ended.
            nats.errors.TimeoutError, nats.errors.NoRespondersError,
            nats.js.errors.ServiceUnavailableError: no consumer could be created
                within ``create_timeout_s``.
            nats.js.errors.APIError: any other refusal (no such stream, not permitted).
        """
        stream = self.names.events_stream

        def config(next_seq: int | None) -> api.ConsumerConfig:
            if next_seq is None and start_time is not None:
                cfg = api.ConsumerConfig(
                    deliver_policy=api.DeliverPolicy.BY_START_TIME,
                    opt_start_time=start_time.astimezone(dt.UTC).isoformat().replace("+00:00", "Z"),  # type: ignore[arg-type]
                )
            else:
                first = next_seq if next_seq is not None else max(1, start_seq or 1)
                cfg = api.ConsumerConfig(
                    deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=first
                )
            cfg.ack_policy = api.AckPolicy.NONE
            cfg.inactive_threshold = inactive_threshold_s
            cfg.mem_storage = True
            cfg.max_waiting = 16
            if filter_subjects:
                cfg.filter_subjects = filter_subjects
            return cfg

        info = await self._add_replay_consumer(stream, config(None), create_timeout_s)
        consumer = info.name
        inbox = self.nc.new_inbox()
        buf: collections.deque[Msg] = collections.deque()
        wake = asyncio.Event()

        async def on_msg(msg: Msg) -> None:
            # A callback subscription costs far less per message than next_msg(),
            # which spawns a task for every call.
            buf.append(msg)
            wake.set()

        sub = await self.nc.subscribe(inbox, cb=on_msg, pending_msgs_limit=4 * batch + 1024)
        next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        decode = self.decode_event
        stats = self.stats
        # The first stream sequence not handed out yet (None: nothing received, the
        # consumer starts where the caller asked); a recreated consumer starts there.
        next_seq: int | None = None
        lost_since: float | None = None
        backoff = 0.25
        loop = asyncio.get_running_loop()
        try:
            caught_up = False
            while True:
                if (stop is not None and stop.is_set()) or (caught_up and not follow):
                    return
                if self._closing or self.nc.is_closed or self.nc.is_draining:
                    # Closed on purpose, or for good (which fails the process): no pull can
                    # be answered any more, so say so rather than retry for ever.
                    raise BusError("bus closed during a replay")
                if lost_since is not None:
                    try:
                        info = await self.js.add_consumer(stream, config(next_seq))
                    except Exception as exc:
                        log.debug("replay_consumer_recreate_failed", error=repr(exc), retry_in_s=backoff)
                        if stop is not None:
                            with contextlib.suppress(TimeoutError):
                                await asyncio.wait_for(stop.wait(), backoff)
                        else:
                            await asyncio.sleep(backoff)
                        backoff = min(5.0, backoff * 2)
                        continue
                    consumer = info.name
                    next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"
                    # A fresh inbox: the answers still due to the lost consumer's requests
                    # (a paused server answers its backlog of them on resuming) must not
                    # read as this consumer's, or each stale "deleted" status loses it again.
                    with contextlib.suppress(Exception):
                        await sub.unsubscribe()
                    buf.clear()
                    inbox = self.nc.new_inbox()
                    sub = await self.nc.subscribe(inbox, cb=on_msg, pending_msgs_limit=4 * batch + 1024)
                    log.info(
                        "replay_consumer_recreated",
                        stream=stream,
                        consumer=consumer,
                        from_seq=next_seq,
                        after_s=round(loop.time() - lost_since, 3),
                    )
                    lost_since, backoff, caught_up = None, 0.25, False
                if caught_up:
                    req = b'{"batch":%d,"expires":%d}' % (batch, int(idle_expires_s * 1e9))
                else:
                    req = b'{"batch":%d,"no_wait":true}' % batch
                lost = stalled = False
                try:
                    await self.nc.publish(next_subject, req, reply=inbox)
                except Exception as exc:  # disconnected with a full reconnect buffer, …
                    log.debug("replay_pull_failed", error=repr(exc))
                    stalled = True
                received = 0
                out = Batch()
                request_done = stalled
                while not request_done and received < batch:
                    if not buf:
                        wake.clear()
                        try:
                            await asyncio.wait_for(wake.wait(), idle_expires_s + 5)
                        except TimeoutError:
                            stalled = True
                            break
                    while buf:
                        msg = buf.popleft()
                        reply = msg.reply
                        if not reply:  # a status message ends this request
                            headers = msg.headers or {}
                            status = headers.get(Header.STATUS.value, "")
                            if status in ("404", "408"):
                                # "No messages" can also be the late answer to an earlier
                                # request this loop gave up on as stalled (a loaded server):
                                # before ending a replay on it, ask the consumer itself.
                                caught_up = caught_up or await self._nothing_pending(stream, consumer)
                            elif status == "503" or (
                                status == "409" and "deleted" in headers.get("Description", "").lower()
                            ):
                                lost = True  # no such consumer (any more)
                            elif status:
                                log.warning("replay_status", status=status, headers=msg.headers)
                            request_done = True
                            break
                        seq, pending = _ack_reply_positions(reply)
                        if next_seq is not None and seq < next_seq:
                            continue  # a lost consumer's delivery, already handed out
                        received += 1
                        next_seq = seq + 1
                        out.last_seq = seq
                        try:
                            out.append((seq, decode(msg.subject, msg.data)))
                        except codec.DecodeFailure as exc:
                            if isinstance(exc, codec.UnknownEventType):
                                stats.unknown_skipped += 1
                            else:
                                stats.malformed_skipped += 1
                            out.skipped.append(SkippedMessage(seq, msg.subject, exc.code, str(exc)))
                            log.debug("replay_skipped", seq=seq, code=exc.code, error=str(exc))
                            if dead_letter:
                                await self.dead_letter_skipped(out.skipped[-1], msg.data)
                        if pending == 0:
                            caught_up = True
                        if received >= batch:
                            request_done = True
                            break
                    if caught_up and (out or out.skipped) and not buf:
                        # Live tail: hand events over as soon as they arrive, not at the
                        # end of the (long-poll) request.
                        yield out
                        out = Batch()
                if out or (received and out.last_seq):
                    yield out
                if stalled and not lost:
                    # No answer at all: the server may have restarted (and forgotten the
                    # consumer) or be unreachable; ask whether the consumer still exists.
                    try:
                        await self.js.consumer_info(stream, consumer, timeout=2.0)
                    except nats.js.errors.NotFoundError:
                        lost = True
                    except Exception as exc:
                        log.debug("replay_consumer_info_failed", error=repr(exc))
                        await asyncio.sleep(min(backoff, 1.0))  # unreachable: do not spin
                if lost:
                    lost_since = loop.time()
                    log.warning("replay_consumer_lost", stream=stream, consumer=consumer, resume_seq=next_seq)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            if self.may_delete_consumers:
                with contextlib.suppress(Exception):
                    await self.js.delete_consumer(stream, consumer)
            # else the server removes the consumer after its inactive_threshold

    async def _add_replay_consumer(
        self, stream: str, cfg: api.ConsumerConfig, timeout_s: float
    ) -> api.ConsumerInfo:
        """Create a replay's first (ephemeral) consumer, retrying for up to ``timeout_s``
        with a backoff (0.25 s doubling to 5 s) while the JetStream API does not answer
        in time, has no responders, or answers 503: what a cluster gives while the
        meta or stream leader is being elected (a server killed or restarted). Any other
        refusal is raised at once. A create whose answer was lost may still have made a
        consumer; nobody pulls from it, so the server removes it after its
        ``inactive_threshold``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        backoff = 0.25
        while True:
            try:
                return await self.js.add_consumer(stream, cfg)
            except (
                nats.errors.TimeoutError,
                nats.errors.NoRespondersError,
                nats.js.errors.ServiceUnavailableError,
            ) as exc:
                if self._closing or self.nc.is_closed or loop.time() + backoff > deadline:
                    raise
                log.info("replay_consumer_create_retry", stream=stream, error=repr(exc), retry_in_s=backoff)
                await asyncio.sleep(backoff)
                backoff = min(5.0, backoff * 2)

    async def replay(self, **kwargs: Any) -> AsyncIterator[tuple[int, Envelope]]:
        """Like :meth:`replay_batches`, one ``(seq, envelope)`` at a time."""
        async for batch in self.replay_batches(**kwargs):
            for item in batch:
                yield item

    # -- work consumers ----------------------------------------------------------

    async def ensure_consumer(
        self,
        durable: str,
        *,
        filter_subjects: list[str] | None = None,
        stream: str | None = None,
        max_deliver: int = 5,
        ack_wait_s: float = 30.0,
        deliver_from_seq: int | None = None,
    ) -> None:
        """Declare a durable pull consumer with explicit ack (idempotent)."""
        cfg = api.ConsumerConfig(
            durable_name=durable,
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=ack_wait_s,
            max_deliver=max_deliver,
            max_ack_pending=10_000,
        )
        if deliver_from_seq:
            cfg.deliver_policy = api.DeliverPolicy.BY_START_SEQUENCE
            cfg.opt_start_seq = deliver_from_seq
        if filter_subjects:
            cfg.filter_subjects = filter_subjects
        await self.js.add_consumer(stream or self.names.events_stream, cfg)

    async def dead_letter(self, msg: Msg, code: str, reason: str, consumer: str = "") -> None:
        """Copy ``msg`` to ``<prefix>.dlq.<code>`` with its reason in headers."""
        headers = {
            Header.DLQ_CODE.value: code,
            Header.DLQ_REASON.value: reason[:1024].replace("\r", " ").replace("\n", " "),
            Header.DLQ_SUBJECT.value: msg.subject,
            Header.DLQ_CONSUMER.value: consumer,
        }
        with contextlib.suppress(Exception):
            headers[Header.DLQ_STREAM_SEQ.value] = str(msg.metadata.sequence.stream)
        await self.js.publish(self.names.dlq(code), msg.data, headers=headers)
        self.stats.dead_lettered += 1
        log.warning("dead_lettered", code=code, reason=reason, subject=msg.subject, consumer=consumer)

    def dlq_subject_of_skipped(self, code: str, seq: int, source: str = "events") -> str:
        """DLQ subject of the message ``seq`` of the event log (``source`` ``events``) or of
        the beats stream (``beats``) that a reader skipped: one subject per message, so
        that a store conditional on the subject being empty happens once."""
        return f"{self.names.dlq(code)}.{source}.{seq}"

    async def dead_letter_skipped(
        self, skipped: SkippedMessage, data: bytes, *, source: str = "events", timeout_s: float = 2.0
    ) -> bool:
        """Store a message of the event log (or, ``source="beats"``, of the beats stream)
        that a reader skipped in the DLQ, once.

        Every process that replays the log meets the same bad message, on every
        start. The copy goes to :meth:`dlq_subject_of_skipped` with
        ``Nats-Expected-Last-Subject-Sequence: 0`` (refused once the message is
        there, however long ago) and ``Nats-Msg-Id: dlq-<stream>-<seq>`` (a copy
        under another code within the duplicate window is dropped too), with the
        reason in the ``Shoal-Dlq-*`` headers (consumer ``replay``).

        Never raises: a refusal or a failure (no permission, no ack in ``timeout_s``)
        is logged and the replay goes on; after one, this bus tries no dead letter of a
        skipped message for ``_DLQ_PAUSE_S`` (a flood of bad messages must not stall a
        reader ``timeout_s`` each). Returns whether this call stored the copy.
        """
        loop = asyncio.get_running_loop()
        if loop.time() < self._dlq_paused_until:
            return False
        stream = self.names.beats_stream if source == "beats" else self.names.events_stream
        headers = {
            Header.MSG_ID.value: f"dlq-{stream}-{skipped.seq}",
            Header.EXPECTED_LAST_SUBJECT_SEQ.value: "0",
            Header.DLQ_CODE.value: skipped.code,
            Header.DLQ_REASON.value: skipped.reason[:1024].replace("\r", " ").replace("\n", " "),
            Header.DLQ_SUBJECT.value: skipped.subject,
            Header.DLQ_STREAM_SEQ.value: str(skipped.seq),
            Header.DLQ_CONSUMER.value: "replay",
        }
        subject = self.dlq_subject_of_skipped(skipped.code, skipped.seq, source)
        try:
            ack = await self.js.publish(subject, data, headers=headers, timeout=timeout_s)
        except nats.js.errors.APIError as exc:
            if exc.err_code == ERR_WRONG_LAST_SEQUENCE:
                return False  # another reader (or an earlier run) stored it
            error = str(exc)
        except Exception as exc:
            error = repr(exc)
        else:
            error = ""
        if error:
            self._dlq_paused_until = loop.time() + _DLQ_PAUSE_S
            log.warning("dead_letter_failed", subject=skipped.subject, seq=skipped.seq, error=error)
            return False
        if ack.duplicate:
            return False
        self.stats.dead_lettered += 1
        log.warning(
            "dead_lettered",
            code=skipped.code,
            reason=skipped.reason,
            subject=skipped.subject,
            stream_seq=skipped.seq,
            consumer="replay",
        )
        return True

    async def consume(
        self,
        durable: str,
        handler: Callable[[Envelope, Msg], Awaitable[None]],
        *,
        stop: asyncio.Event,
        stream: str | None = None,
        batch: int = 64,
        fetch_timeout_s: float = 0.5,
        max_deliver: int = 5,
        ack_wait_s: float = 30.0,
        retry_delay_s: float = 0.5,
    ) -> None:
        """Run ``handler`` on every message of a durable consumer until ``stop`` is set.

        The consumer must have been declared with :meth:`ensure_consumer` (same
        ``max_deliver``). A message is acked after its handler returns. Messages that
        can never succeed are dead-lettered and ``term``ed; transient handler errors
        are ``nak``ed with a delay until ``max_deliver`` is reached.
        """
        stream_name = stream or self.names.events_stream
        psub = await self.js.pull_subscribe_bind(durable, stream=stream_name)
        try:
            while not stop.is_set():
                try:
                    msgs = await psub.fetch(batch, timeout=fetch_timeout_s)
                except (TimeoutError, nats.errors.TimeoutError):
                    continue
                for msg in msgs:
                    await self._handle(
                        msg,
                        handler,
                        durable,
                        max_deliver,
                        ack_wait_s,
                        retry_delay_s,
                        events=stream_name == self.names.events_stream,
                    )
        finally:
            with contextlib.suppress(Exception):
                await psub.unsubscribe()

    async def _handle(
        self,
        msg: Msg,
        handler: Callable[[Envelope, Msg], Awaitable[None]],
        durable: str,
        max_deliver: int,
        ack_wait_s: float,
        retry_delay_s: float,
        *,
        events: bool = True,
    ) -> None:
        try:
            env = self.decode_event(msg.subject, msg.data) if events else codec.decode(msg.data)
        except codec.UnknownEventType as exc:
            self.stats.unknown_skipped += 1
            log.info("unknown_event_skipped", type=exc.type, subject=msg.subject)
            await msg.ack()
            return
        except codec.DecodeFailure as exc:
            await self.dead_letter(msg, exc.code, str(exc), durable)
            await msg.term()
            return
        ctx = propagate.extract(msg.headers or {})
        keepalive = asyncio.create_task(self._keep_alive(msg, ack_wait_s))
        try:
            from opentelemetry import context as otel_context

            token = otel_context.attach(ctx)
            try:
                await handler(env, msg)
            finally:
                otel_context.detach(token)
        except PermanentError as exc:
            await self.dead_letter(msg, exc.code, str(exc), durable)
            await msg.term()
            return
        except Exception as exc:  # a transient failure: retry until max_deliver
            delivered = msg.metadata.num_delivered or 1
            if delivered >= max_deliver:
                await self.dead_letter(
                    msg, "max_deliver", f"failed {delivered} times; last error: {exc!r}", durable
                )
                await msg.term()
            else:
                log.warning("handler_failed_will_retry", error=repr(exc), delivered=delivered)
                await msg.nak(delay=retry_delay_s)
            return
        finally:
            keepalive.cancel()
        self.stats.handled += 1
        await msg.ack()

    @staticmethod
    async def _keep_alive(msg: Msg, ack_wait_s: float) -> None:
        # A slow handler tells the server it is still working, so the message is not redelivered.
        with contextlib.suppress(asyncio.CancelledError, Exception):
            while True:
                await asyncio.sleep(max(0.05, ack_wait_s / 3))
                await msg.in_progress()

    async def dead_letters(self, limit: int = 1000) -> list[tuple[dict[str, str], bytes]]:
        """Read the dead-letter stream (headers, data), oldest first (for tools and tests)."""
        out: list[tuple[dict[str, str], bytes]] = []
        info = await self.js.stream_info(self.names.dlq_stream)
        for seq in range(int(info.state.first_seq or 1), int(info.state.last_seq) + 1):
            if len(out) >= limit:
                break
            try:
                raw = await self.js.get_msg(self.names.dlq_stream, seq)
            except nats.js.errors.NotFoundError:
                continue
            out.append((dict(raw.headers or {}), raw.data or b""))
        return out

    # -- leases and snapshots ----------------------------------------------------

    async def lease(self, name: str, holder: str, ttl_s: float = 5.0) -> LeaderLease:
        """A leader lease ``name`` for ``holder`` in the lease bucket
        (:attr:`Names.lease_bucket`, made with TTL ``ttl_s`` by the first who asks).

        One bucket per installation, its name without the TTL, so that the NATS
        permissions can name it exactly (:func:`shoal.auth.stream_names`). Every party of
        an installation must then use one TTL (``SHOAL_LEASE_TTL_S``): a lease renewed
        every ``ttl_s / 3`` in a bucket that keeps entries for less would lapse between
        renewals, so a bucket of another TTL is refused here, never used.

        Raises:
            BusError: the bucket keeps its entries for another TTL (or is missing, for an
                identity that may not create it).
        """
        bucket = self.names.lease_bucket
        kv = await self.key_value(
            api.KeyValueConfig(bucket=bucket, ttl=ttl_s, history=1, storage=api.StorageType.FILE)
        )
        kept = (await kv.status()).ttl
        if kept is None or abs(kept - ttl_s) > 1e-3:
            raise BusError(
                f"the lease bucket {bucket} keeps leases {kept} s, but this process was given a "
                f"{ttl_s} s lease: every service and node of an installation must use the same "
                "SHOAL_LEASE_TTL_S (to change it, stop the installation and have the admin delete "
                "the bucket)"
            )
        return LeaderLease(kv, name, holder, ttl_s)

    async def leases(self) -> dict[str, str]:
        """Lease name -> holder, for every lease held now in the lease bucket (empty when
        the bucket does not exist yet). Read with a stream info and one get per key, both
        open to every identity; a released lease (a delete marker) is left out, and an
        expired one is gone from the bucket."""
        bucket = self.names.lease_bucket
        stream = f"KV_{bucket}"
        head = f"$KV.{bucket}."
        try:
            info = await self.js.stream_info(stream, subjects_filter=f"{head}>")
        except nats.js.errors.NotFoundError:
            return {}
        out: dict[str, str] = {}
        for subject in sorted(info.state.subjects or {}):
            try:
                msg = await self.js.get_last_msg(stream, subject)
            except nats.js.errors.NotFoundError:
                continue  # expired between the two reads
            if (msg.headers or {}).get("KV-Operation") in ("DEL", "PURGE") or not msg.data:
                continue
            out[subject.removeprefix(head)] = msg.data.decode(errors="replace")
        return out

    async def _raise_replicas(self, stream: str) -> None:
        """Raise an existing bucket's or object store's stream to :attr:`replicas`, never
        lower it (as :meth:`_ensure_stream` does for streams): a bucket first made while
        a cluster node was down, so with fewer replicas, gets them at a later start (the
        admin's :meth:`declare`: ``shoal up``, ``shoal admin``). Only the admin may update a
        stream; for others this does nothing."""
        if not self.may_delete_consumers:  # the admin's (or an unauthenticated) connection
            return
        try:
            try:
                info = await self.js.stream_info(stream)
            except nats.js.errors.NotFoundError:
                return  # not made yet: it is made with the replicas of whoever makes it
            if (info.config.num_replicas or 1) >= self.replicas:
                return
            info.config.num_replicas = self.replicas
            await self.js.update_stream(info.config)
            log.info("replicas_raised", stream=stream, replicas=self.replicas)
        except Exception as exc:  # a node still down: the next start tries again
            log.warning("replicas_not_raised", stream=stream, replicas=self.replicas, error=repr(exc))

    async def key_value(self, config: api.KeyValueConfig) -> Any:
        """The KV bucket of ``config``, created with :attr:`replicas` when missing; an
        existing bucket is used as it is (the admin's :meth:`declare` raises the replicas of
        shoal's buckets: :meth:`_raise_replicas`).

        An identity that may not create buckets (:attr:`may_create_streams`: a sidecar)
        only binds to it.

        Raises:
            BusError: it may not create the bucket, and no service has made it.
        """
        config.replicas = self.replicas
        if not self.may_create_streams:
            try:
                return await self.js.key_value(config.bucket)
            except nats.js.errors.BucketNotFoundError as exc:
                raise BusError(
                    f"KV bucket {config.bucket} does not exist, and {self.identity} may not create it: "
                    "a service makes it (the leases' with its SHOAL_LEASE_TTL_S, which the nodes "
                    "must share)"
                ) from exc
        try:
            return await self.js.create_key_value(config)
        except nats.js.errors.BadRequestError as exc:
            if exc.err_code != ERR_STREAM_NAME_IN_USE:
                raise
            return await self.js.key_value(config.bucket)

    async def _snapshot_store(self, bucket: str | None = None) -> Any:
        name = bucket or self.names.snapshot_bucket
        try:
            return await self.js.create_object_store(name, api.ObjectStoreConfig(replicas=self.replicas))
        except nats.js.errors.BadRequestError as exc:
            if exc.err_code != ERR_STREAM_NAME_IN_USE:
                raise
            return await self.js.object_store(name)

    async def save_snapshot(
        self,
        name: str,
        seq: int,
        state: bytes,
        *,
        digest: str = "",
        schema: int = 0,
        bucket: str | None = None,
    ) -> None:
        """Store ``state`` (encoded, of schema version ``schema``) as of stream sequence
        ``seq`` under ``name`` in object store ``bucket`` (default: the cluster snapshots')."""
        store = await self._snapshot_store(bucket)
        blob = msgspec.msgpack.encode(Snapshot(name=name, seq=seq, digest=digest, state=state, schema=schema))
        await store.put(name, blob)

    async def load_snapshot(
        self, name: str, *, timeout_s: float = 10.0, attempts: int = 3, bucket: str | None = None
    ) -> Snapshot | None:
        """The newest snapshot stored under ``name`` (in object store ``bucket``, default the
        cluster snapshots'), or None.

        A read races with a writer replacing the object: the writer purges the old
        version's chunks, and a read of them then waits for ever. Each read is
        therefore bounded by ``timeout_s`` and tried again (the metadata, read again,
        names the new version) up to ``attempts`` times. The chunks are read with
        :meth:`_read_object`.

        Raises:
            msgspec.DecodeError: the stored object is not a snapshot (corrupt).
            TimeoutError / nats.js.errors.DigestMismatchError: no read finished whole
                in ``attempts`` tries (the caller replays the log instead).
        """
        try:
            # Read-only (a node daemon may read snapshots, not create the bucket).
            bucket = bucket or self.names.snapshot_bucket
            store = await self.js.object_store(bucket)
            for attempt in range(1, attempts + 1):
                try:
                    data = await asyncio.wait_for(self._read_object(store, bucket, name), timeout_s)
                    break
                except (TimeoutError, nats.js.errors.DigestMismatchError):
                    log.warning(
                        "snapshot_read_timed_out", snapshot=name, attempt=attempt, timeout_s=timeout_s
                    )
                    if attempt == attempts:
                        raise
        except nats.js.errors.BucketNotFoundError:
            return None
        except nats.js.errors.ObjectNotFoundError:
            return None
        if not data:
            return None
        return msgspec.msgpack.decode(data, type=Snapshot)

    async def _read_object(self, store: Any, bucket: str, name: str) -> bytes:
        """The bytes of object ``name`` of object store ``store`` (named ``bucket``), read through one
        ephemeral pull consumer in batches and checked against the object's SHA-256.

        nats-py's ``ObjectStore.get`` reads through an ordered push consumer and joins
        the chunks one by one: 0.5 s for 6.5 MB on a 2-core machine, against 0.1 s this
        way (the profiler's snapshot at 10^6 events is that size).

        Raises:
            nats.js.errors.ObjectNotFoundError: no such object.
            nats.js.errors.DigestMismatchError: the chunks are not the object's.
            TimeoutError: the chunks did not all arrive (purged by a writer meanwhile).
        """
        info = await store.get_info(name)
        if not info.nuid:
            raise nats.js.errors.BadObjectMetaError
        if not info.size:
            return b""
        # Created unnamed ($JS.API.CONSUMER.CREATE.<stream>, the only form a reader may
        # use, shoal.auth), then bound; the server removes it 5 s after the last pull.
        consumer = await self.js.add_consumer(
            f"OBJ_{bucket}",
            api.ConsumerConfig(
                ack_policy=api.AckPolicy.NONE,
                inactive_threshold=5.0,
                deliver_policy=api.DeliverPolicy.ALL,
                filter_subject=f"$O.{bucket}.C.{info.nuid}",
            ),
        )
        sub = await self.js.pull_subscribe_bind(consumer=consumer.name, stream=f"OBJ_{bucket}")
        parts: list[bytes] = []
        sha = hashlib.sha256()
        try:
            while len(parts) < info.chunks:
                for msg in await sub.fetch(batch=info.chunks - len(parts), timeout=5.0):
                    parts.append(msg.data)
                    sha.update(msg.data)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        stored = (info.digest or "").split("=", 1)[-1]
        if base64.urlsafe_b64encode(sha.digest()).decode() != stored:
            raise nats.js.errors.DigestMismatchError
        return b"".join(parts)


class Snapshot(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    seq: int
    """Last stream sequence folded into ``state``."""
    digest: str = ""
    state: bytes
    schema: int = 0
    """Version of the encoding of ``state`` (see ``shoal.projection.SNAPSHOT_SCHEMA``)."""


_UNANSWERED = (nats.js.errors.NoStreamResponseError, nats.errors.TimeoutError)
"""A lease write nobody answered (see :class:`LeaderLease`)."""


class LeaderLease:
    """A lease in a KV bucket whose entries expire after ``ttl_s``.

    ``try_acquire`` creates the key only if it is absent (or expired or deleted);
    ``renew`` updates it only at the revision we wrote (compare-and-set), so two
    holders can never both believe they lead. Renew well inside the TTL (every
    ``ttl_s / 3``); a holder that cannot renew must stop acting as leader.

    A write the bucket does not answer (no responders while a cluster elects the
    bucket's stream leader, or a timeout) counts as not acquired / not renewed, and the
    next poll tries again: the caller never leads on a write it has no answer for, and
    does not die of a cluster that is still forming (a profiler did, at the compose
    stack's start). A create or update that was stored although its answer was lost
    leaves the key naming this holder at a revision it does not know: it cannot renew
    it, nobody else can create it, and the key expires after ``ttl_s``.
    """

    def __init__(self, kv: Any, name: str, holder: str, ttl_s: float) -> None:
        self.kv = kv
        self.name = name
        self.holder = holder
        self.ttl_s = ttl_s
        self.revision: int | None = None

    @property
    def is_leader(self) -> bool:
        return self.revision is not None

    async def try_acquire(self) -> bool:
        if self.revision is not None:
            return await self.renew()
        try:
            self.revision = await self.kv.create(self.name, self.holder.encode())
            return True
        except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.APIError):
            return False
        except _UNANSWERED as exc:
            log.warning("lease_unanswered", lease=self.name, error=type(exc).__name__)
            return False

    async def renew(self) -> bool:
        if self.revision is None:
            return False
        try:
            self.revision = await self.kv.update(self.name, self.holder.encode(), last=self.revision)
            return True
        except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.APIError):
            self.revision = None
            return False
        except _UNANSWERED as exc:
            log.warning("lease_unanswered", lease=self.name, error=type(exc).__name__)
            self.revision = None
            return False

    async def release(self) -> None:
        if self.revision is None:
            return
        with contextlib.suppress(Exception):
            await self.kv.delete(self.name, last=self.revision)
        self.revision = None

    async def holder_now(self) -> str | None:
        try:
            entry = await self.kv.get(self.name)
        except nats.js.errors.KeyNotFoundError:
            return None
        return entry.value.decode() if entry.value else None


class Campaign:
    """A service's side of a :class:`LeaderLease`: try to acquire or renew it every
    ``ttl_s / 3`` of event-loop time, and say when leadership flipped.

    The leader-elected services (allocator, placer, profiler, trader) share this loop::

        campaign = Campaign(await bus.lease(name, holder, ttl_s=ttl))
        while not stop.is_set():
            flip = await campaign.poll()   # renews when due; None, "elected" or "lost"
            ...                            # service-specific take-over work on "elected"
            wait = campaign.until_due()    # sleep no longer than this
    """

    def __init__(self, lease: LeaderLease) -> None:
        self.lease = lease
        self.renew_every_s = lease.ttl_s / 3
        self.next_due = 0.0
        """Event-loop time at which the lease is due for renewal."""
        self._leader = False
        self._valid_until = 0.0
        """Event-loop time until which the last successful acquire/renew holds the lease:
        its start plus the TTL (the server counts the TTL from later than that)."""

    @property
    def is_leader(self) -> bool:
        """Whether this holder leads now: it won the last poll and its TTL since then has
        not run out. A process paused (SIGSTOP) past the TTL is not a leader the moment it
        runs again, before its next renewal answers (another holder may lead by then)."""
        return self._leader and self._now() < self._valid_until

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def due(self) -> bool:
        """Renewal is due (a long run of work must yield to it)."""
        return self._now() >= self.next_due

    def until_due(self) -> float:
        """Seconds until the next renewal is due (0 when it is)."""
        return max(0.0, self.next_due - self._now())

    async def poll(self) -> str | None:
        """Renew or try to acquire when due; ``"elected"``/``"lost"`` on a flip, else None."""
        if not self.due():
            return None
        was = self._leader
        started = self._now()
        self._leader = await self.lease.try_acquire()
        if self._leader:
            self._valid_until = started + self.lease.ttl_s
        self.next_due = self._now() + self.renew_every_s
        if self._leader and not was:
            log.info("leader_elected", lease=self.lease.name, holder=self.lease.holder)
            return "elected"
        if was and not self._leader:
            log.warning("leadership_lost", lease=self.lease.name, holder=self.lease.holder)
            return "lost"
        return None

    async def release(self) -> None:
        self._leader = False
        await self.lease.release()


async def fold_log(
    bus: Bus,
    state: Any,
    apply: Callable[[Any, Envelope], Any],
    *,
    start_seq: int = 1,
    batch: int = 8192,
) -> tuple[Any, int]:
    """Fold the whole log from ``start_seq`` into ``state``; return (state, last seq)."""
    last = start_seq - 1
    async for items in bus.replay_batches(start_seq=start_seq, batch=batch):
        for _seq, env in items:
            state = apply(state, env)
        last = items.last_seq
    return state, last


def events_of(items: Iterable[tuple[int, Envelope]]) -> list[Envelope]:
    return [env for _, env in items]
