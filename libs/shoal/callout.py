"""Per-job sidecar identities through NATS auth callout (pure: no I/O).

A sidecar runs one job on one node, so its identity should be allowed that job's
subjects only, and only while the job is placed on that node. The server's static
configuration cannot list an identity per job, so the embedded server delegates the
authentication of every connection that is not one of the static identities of
:mod:`shoal.auth` to a callout (nats-server 2.10+, ADR-26 "NATS Authorization
Callouts"):

1. The node daemon holds the ``sidecar-<node>`` seed and never gives it to a sidecar.
   For each sidecar it mints a **sidecar token** (:func:`mint_sidecar_token`): a JWT
   signed with that seed naming the job, the node and the log sequence of the placement
   the daemon acted on. The sidecar connects with it as its ``auth_token``.
2. The server sends an authorization request (a JWT signed by the server's own key,
   with the token in ``connect_opts.auth_token`` and a fresh user nkey in
   ``user_nkey``) to ``$SYS.REQ.USER.AUTH``. Only the ``authorizer`` identity
   (``services/authorizer``) may subscribe there (:func:`shoal.auth.permissions`).
3. The authorizer checks the token's signature against the public key of
   ``sidecar-<node>`` and, in its fold of the log, that the job is placed on that node
   (:func:`authorize`), and answers with an authorization response JWT carrying a
   user JWT whose permissions are :func:`shoal.auth.sidecar_job_permissions` of that
   job, both signed with the callout's issuer account key (:func:`response`).

The callout judges a sidecar only when it connects (and reconnects); a job that leaves
the node later does not end the connection. So the authorizer also **revokes**: as the
``revoker`` identity (a user of the server's system account, :mod:`shoal.auth`) it
lists the servers' connections (``CONNZ``), finds the sidecars among them by the name
its own user JWTs gave them (:func:`user_claims`: ``sidecar.<node>.<job>``, which the
server reports as the connection's ``authorized_user``) and ends (``KICK``) each whose
job has not been placed on its node for a grace period (:class:`Revocations`). The
sidecar then reconnects, and the callout refuses it.

JWTs here are the nats-io/jwt v2 format: ``base64url(header).base64url(claims).
base64url(ed25519 signature)``, header ``{"typ":"JWT","alg":"ed25519-nkey"}``, the
signer's public nkey in ``iss`` and the type and version under ``nats``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import time
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
import nkeys

from shoal.ids import is_subject_token

CALLOUT_SUBJECT = "$SYS.REQ.USER.AUTH"
"""Where the server sends authorization requests (nats-server ``AuthCalloutSubject``)."""

GLOBAL_ACCOUNT = "$G"
"""The account every user of a server without ``accounts`` is in (the user JWT's ``aud``)."""

TOKEN_TYPE = "shoal_sidecar"
"""``nats.type`` of a sidecar token: tells it from any JWT the server would accept."""

_HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}


class CalloutError(ValueError):
    """A token or request that cannot be used; the message says why."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError) as exc:
        raise CalloutError(f"not base64url: {exc}") from None


def _verify_key(public_key: str) -> Any:
    """The Ed25519 verify key of a public nkey (``U...``, ``N...``, ``A...``)."""
    import nacl.signing

    try:
        raw = base64.b32decode(public_key + "=" * (-len(public_key) % 8))
    except (binascii.Error, ValueError):
        raise CalloutError(f"not an nkey: {public_key!r}") from None
    if len(raw) != 35 or nkeys.crc16(bytearray(raw[:-2])) != int.from_bytes(raw[-2:], "little"):
        raise CalloutError(f"not an nkey: {public_key!r}")
    return nacl.signing.VerifyKey(raw[1:33])


def keypair(seed: bytes) -> nkeys.KeyPair:
    """The key pair of an nkey seed (a seed file's contents, whitespace stripped)."""
    try:
        return nkeys.from_seed(bytearray(seed.strip()))
    except Exception as exc:  # nkeys raises its own error types and binascii errors
        raise CalloutError(f"not an nkey seed: {exc}") from None


def public_key(kp: nkeys.KeyPair) -> str:
    return bytes(kp.public_key).decode()


def encode_jwt(claims: dict[str, Any], kp: nkeys.KeyPair, *, now: float | None = None) -> str:
    """``claims`` signed by ``kp`` (its public key becomes ``iss``; ``iat`` and ``jti``
    are set as nats-io/jwt v2 sets them)."""
    body = dict(claims)
    body["iss"] = public_key(kp)
    body["iat"] = int(time.time() if now is None else now)
    body.pop("jti", None)
    digest = hashlib.new("sha512_256", json.dumps(body, sort_keys=True).encode()).digest()
    body["jti"] = base64.b32encode(digest).decode().rstrip("=")
    head = _b64(json.dumps(_HEADER, separators=(",", ":")).encode())
    payload = _b64(json.dumps(body, separators=(",", ":")).encode())
    sig = kp.sign(f"{head}.{payload}".encode())
    return f"{head}.{payload}.{_b64(sig)}"


def decode_jwt(token: str, *, issuer: str | None = None, now: float | None = None) -> dict[str, Any]:
    """The claims of ``token`` after checking its signature against its ``iss`` (which
    must be ``issuer`` when given) and its ``exp``/``nbf``.

    Raises:
        CalloutError: malformed, wrongly signed, from another issuer, or expired.
    """
    import nacl.exceptions

    parts = token.split(".")
    if len(parts) != 3:
        raise CalloutError("a JWT has three parts")
    try:
        header = json.loads(_unb64(parts[0]))
        claims = json.loads(_unb64(parts[1]))
    except (ValueError, UnicodeDecodeError) as exc:
        raise CalloutError(f"not a JWT: {exc}") from None
    if not isinstance(header, dict) or header.get("alg") != _HEADER["alg"] or not isinstance(claims, dict):
        raise CalloutError("not an nkey-signed JWT")
    iss = claims.get("iss")
    if not isinstance(iss, str) or (issuer is not None and iss != issuer):
        raise CalloutError(f"JWT issued by {iss!r}, not by {issuer!r}")
    try:
        _verify_key(iss).verify(f"{parts[0]}.{parts[1]}".encode(), _unb64(parts[2]))
    except nacl.exceptions.BadSignatureError:
        raise CalloutError("bad JWT signature") from None
    except ValueError as exc:  # nacl's own: a signature that is not 64 bytes
        raise CalloutError(f"bad JWT signature: {exc}") from None
    t = time.time() if now is None else now
    exp, nbf = claims.get("exp"), claims.get("nbf")
    if isinstance(exp, int | float) and exp and t > exp:
        raise CalloutError("JWT expired")
    if isinstance(nbf, int | float) and nbf and t < nbf:
        raise CalloutError("JWT not valid yet")
    return claims


# ---------------------------------------------------------------------------
# Sidecar tokens
# ---------------------------------------------------------------------------


class SidecarGrant(msgspec.Struct, frozen=True):
    """What a sidecar token names: the job, the node, and the log sequence of the
    placement the node daemon acted on (the authorizer's fold waits for it)."""

    job_id: str
    node_id: str
    placement_seq: int = 0


def mint_sidecar_token(kp: nkeys.KeyPair, grant: SidecarGrant, *, now: float | None = None) -> str:
    """A token for the sidecar of ``grant.job_id`` on ``grant.node_id``, signed with
    that node's ``sidecar-<node>`` key ``kp``."""
    claims = {
        "sub": public_key(kp),
        "nats": {
            "type": TOKEN_TYPE,
            "version": 1,
            "job": grant.job_id,
            "node": grant.node_id,
            "seq": grant.placement_seq,
        },
    }
    return encode_jwt(claims, kp, now=now)


def token_grant(token: str) -> SidecarGrant:
    """What ``token`` names, without checking its signature (the sidecar's own view of
    the token it was given; the authorizer checks it, :func:`verify_sidecar_token`).

    Raises:
        CalloutError: not a sidecar token.
    """
    parts = token.split(".")
    if len(parts) != 3:
        raise CalloutError("not a sidecar token")
    try:
        unverified = json.loads(_unb64(parts[1]))
        nats = unverified["nats"]
        job, node, seq = nats["job"], nats["node"], nats.get("seq", 0)
    except (ValueError, UnicodeDecodeError, KeyError, TypeError):
        raise CalloutError("not a sidecar token") from None
    if not isinstance(nats, dict) or nats.get("type") != TOKEN_TYPE:
        raise CalloutError("not a sidecar token")
    if not (
        isinstance(job, str) and is_subject_token(job) and isinstance(node, str) and is_subject_token(node)
    ):
        raise CalloutError("a sidecar token names a job and a node (subject tokens)")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        raise CalloutError("a sidecar token's placement sequence is a non-negative integer")
    return SidecarGrant(job_id=job, node_id=node, placement_seq=seq)


def verify_sidecar_token(token: str, node_keys: Mapping[str, str]) -> SidecarGrant:
    """The grant of ``token`` if the ``sidecar-<node>`` key of the node it names signed it.

    ``node_keys``: node id -> public key of its ``sidecar-<node>`` identity.

    Raises:
        CalloutError: malformed, unknown node, or not signed by that node's key.
    """
    grant = token_grant(token)
    key = node_keys.get(grant.node_id)
    if key is None:
        raise CalloutError(f"no sidecar key for node {grant.node_id!r}")
    decode_jwt(token, issuer=key)
    return grant


# ---------------------------------------------------------------------------
# The callout's answer
# ---------------------------------------------------------------------------


class Request(msgspec.Struct, frozen=True):
    """What the authorizer uses of an authorization request."""

    server_id: str
    user_nkey: str
    token: str
    client_name: str = ""
    nkey: str = ""
    """The public nkey the client authenticated with (``connect_opts.nkey``), if any."""
    sig: str = ""
    """Its signature of ``nonce`` (``connect_opts.sig``, base64)."""
    nonce: str = ""
    """The nonce the server sent that client (``client_info.nonce``)."""
    user: str = ""
    """The user name the client connected with (``connect_opts.user``), if any."""
    password: str = ""
    """Its password (``connect_opts.pass``): an MQTT device's, the only clients that log
    in with one (the server also copies it into ``auth_token`` for MQTT)."""
    client_type: str = ""
    """The client's protocol (``client_info.type``): ``nats``, ``mqtt``, ``websocket`` …"""


def parse_request(jwt: str, *, now: float | None = None) -> Request:
    """The fields of a server's authorization request JWT, its signature checked
    against the server key it names in ``iss``. A server makes its key at start, so
    the signature proves only that the request is intact; the authorizer trusts it
    because it comes on ``$SYS.REQ.USER.AUTH``, where no client may publish (the server
    forbids it; ``tests/test_callout.py`` checks it for every kind of identity).

    Raises:
        CalloutError: not a well-formed, well-signed authorization request.
    """
    claims = decode_jwt(jwt, now=now)
    nats = claims.get("nats")
    if not isinstance(nats, dict) or nats.get("type") not in ("authorization_request", "authorization"):
        raise CalloutError("not an authorization request")
    server = nats.get("server_id") or {}
    opts = nats.get("connect_opts") or {}
    info = nats.get("client_info") or {}
    if not isinstance(server, dict) or not isinstance(opts, dict) or not isinstance(info, dict):
        raise CalloutError("malformed authorization request")
    server_id, user_nkey = server.get("id"), nats.get("user_nkey")
    if not isinstance(server_id, str) or not isinstance(user_nkey, str) or server_id != claims.get("iss"):
        raise CalloutError("malformed authorization request")
    token = opts.get("auth_token") or ""
    name = opts.get("name") or ""

    def text(value: Any) -> str:
        return value if isinstance(value, str) else ""

    return Request(
        server_id=server_id,
        user_nkey=user_nkey,
        token=text(token),
        client_name=text(name),
        nkey=text(opts.get("nkey")),
        sig=text(opts.get("sig")),
        nonce=text(info.get("nonce")),
        user=text(opts.get("user")),
        password=text(opts.get("pass")),
        client_type=text(info.get("type")),
    )


def verify_nkey(req: Request) -> str:
    """The public nkey of a client that authenticated with one, after checking its
    signature of the server's nonce (the server leaves that to the callout for a key
    its configuration does not list).

    Raises:
        CalloutError: no nkey, no nonce, or a signature the key did not make.
    """
    import nacl.exceptions

    if not req.nkey or not req.sig or not req.nonce:
        raise CalloutError("no nkey, signature or nonce in the request")
    raw = req.sig.encode()
    try:  # nats clients send URL-safe base64 without padding; some the standard alphabet
        sig = base64.urlsafe_b64decode(raw + b"=" * (-len(raw) % 4))
    except (binascii.Error, ValueError):
        try:
            sig = base64.b64decode(raw + b"=" * (-len(raw) % 4))
        except (binascii.Error, ValueError):
            raise CalloutError("the nkey signature is not base64") from None
    try:
        _verify_key(req.nkey).verify(req.nonce.encode(), sig)
    except (nacl.exceptions.BadSignatureError, ValueError):
        raise CalloutError(f"bad signature of the nonce by {req.nkey}") from None
    return req.nkey


def sidecar_inbox(grant: SidecarGrant) -> str:
    """The reply-subject prefix of a job's sidecar on one node (dot-separated tokens, so
    no two (node, job) pairs share one)."""
    return f"_INBOX.sidecar.{grant.node_id}.{grant.job_id}"


def user_claims(
    req: Request, name: str, permissions: dict[str, Any], *, expires_s: float | None
) -> dict[str, Any]:
    """The user JWT claims of a user called ``name`` (a sidecar's :func:`sidecar_user`,
    or a static identity's name): subject the request's user nkey, in the global
    account, with ``permissions`` (a :func:`shoal.auth.permissions`-style block)."""
    nats: dict[str, Any] = {
        "pub": permissions.get("publish", {}),
        "sub": permissions.get("subscribe", {}),
        "subs": -1,
        "data": -1,
        "payload": -1,
        "type": "user",
        "version": 2,
    }
    if "allow_responses" in permissions:  # ttl 0: the server's default (2 minutes)
        nats["resp"] = {"max": permissions["allow_responses"]["max"], "ttl": 0}
    claims: dict[str, Any] = {
        "sub": req.user_nkey,
        "aud": GLOBAL_ACCOUNT,
        "name": name,
        "nats": nats,
    }
    if expires_s is not None:
        claims["exp"] = int(time.time() + expires_s)
    return claims


def response(
    req: Request,
    issuer: nkeys.KeyPair,
    *,
    user: dict[str, Any] | None = None,
    error: str = "",
) -> bytes:
    """The authorization response JWT for ``req``: the user JWT (claims ``user``,
    signed by ``issuer``) or ``error``."""
    nats: dict[str, Any] = {"type": "authorization_response", "version": 2}
    if user is not None:
        nats["jwt"] = encode_jwt(user, issuer)
    else:
        nats["error"] = error or "not authorized"
    return encode_jwt({"sub": req.user_nkey, "aud": req.server_id, "nats": nats}, issuer).encode()


Placed = Callable[[str, str], bool]
"""``placed(job_id, node_id)``: whether the job runs (is placed, not finished) on the node."""


def authorize(req: Request, *, node_keys: Mapping[str, str], placed: Placed) -> SidecarGrant:
    """The grant of the request's sidecar token if its node signed it and the job is
    placed on that node now.

    Raises:
        CalloutError: no token, a bad token, or a job not placed on that node.
    """
    if not req.token:
        raise CalloutError("no sidecar token (static identities connect with their nkey)")
    grant = verify_sidecar_token(req.token, node_keys)
    if not placed(grant.job_id, grant.node_id):
        raise CalloutError(f"job {grant.job_id!r} is not placed on node {grant.node_id!r}")
    return grant


# ---------------------------------------------------------------------------
# Revocation: ending the connections of sidecars whose job left their node
# ---------------------------------------------------------------------------


def sidecar_user(node_id: str, job_id: str) -> str:
    """The name of the user JWT of ``job_id``'s sidecar on ``node_id``, which the server
    reports as the connection's ``authorized_user`` (ids are subject tokens: no dots)."""
    return f"sidecar.{node_id}.{job_id}"


class SidecarConnection(msgspec.Struct, frozen=True):
    """A connection the callout admitted as the sidecar of ``job_id`` on ``node_id``."""

    server_id: str
    cid: int
    """The connection's id on that server (what ``KICK`` takes)."""
    node_id: str
    job_id: str


def sidecar_connections(reply: Mapping[str, Any]) -> tuple[list[SidecarConnection], int]:
    """The sidecar connections in one server's ``CONNZ`` answer (asked with
    ``"auth": true``) and how many connections that server has in all (more pages when
    it exceeds what came back).

    Raises:
        CalloutError: an answer that is an error or not a ``CONNZ`` answer.
    """
    server, data, error = reply.get("server"), reply.get("data"), reply.get("error")
    if error or not isinstance(server, dict) or not isinstance(data, dict):
        raise CalloutError(f"not a connection list: {error or reply!r}"[:300])
    server_id, conns, total = server.get("id"), data.get("connections") or [], data.get("total")
    if not isinstance(server_id, str) or not isinstance(conns, list) or not isinstance(total, int):
        raise CalloutError("malformed connection list")
    out: list[SidecarConnection] = []
    for conn in conns:
        if not isinstance(conn, dict):
            continue
        user, cid = conn.get("authorized_user"), conn.get("cid")
        if not isinstance(user, str) or not isinstance(cid, int):
            continue
        kind, _, rest = user.partition(".")
        node_id, _, job_id = rest.partition(".")
        if kind == "sidecar" and is_subject_token(node_id) and is_subject_token(job_id):
            out.append(SidecarConnection(server_id=server_id, cid=cid, node_id=node_id, job_id=job_id))
    return out, total


class Revocations:
    """Which sidecar connections to end: those whose job has not been placed on their
    node (finished, moved, preempted) in any sweep for ``grace_s`` seconds.

    The grace lets a sidecar whose job just left hand the job's progress over and exit
    on its own: its node daemon closes its orders at once and kills it after 7 s
    (``services/node_daemon``); a connection still there after ``grace_s`` is not one
    a node daemon controls. Time is the caller's (``now``, monotonic seconds); a
    connection is judged again at each sweep, so a job placed back on the node before
    the grace ends keeps its sidecar. Several authorizers may each revoke: ending a
    connection twice is harmless (the second ``KICK`` finds none).
    """

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.unplaced_since: dict[tuple[str, int], float] = {}
        """(server id, connection id) -> when a sweep first found its job not placed."""

    def due(self, conns: list[SidecarConnection], placed: Placed, now: float) -> list[SidecarConnection]:
        """The connections of ``conns`` (every sidecar connection there is now) to end."""
        seen: set[tuple[str, int]] = set()
        out: list[SidecarConnection] = []
        for conn in conns:
            key = (conn.server_id, conn.cid)
            seen.add(key)
            if placed(conn.job_id, conn.node_id):
                self.unplaced_since.pop(key, None)
                continue
            since = self.unplaced_since.setdefault(key, now)
            if now - since >= self.grace_s:
                out.append(conn)
        for key in self.unplaced_since.keys() - seen:  # gone on their own
            del self.unplaced_since[key]
        return out
