"""Who may do what on the bus: roles, identities, subject permissions, credentials.

shoal authenticates every connection with NATS's own mechanism: each identity is an
**nkey** (an Ed25519 key pair; the server knows only the public key, the process
holds the seed in a file readable by its owner only), and the server enforces a
**subject permission** list per identity. Nothing in shoal's code decides whether a
publish is allowed: the server refuses it (a permissions violation) before anything
reaches the log. This module is pure: it computes the identities and their
permissions; :mod:`shoal.nats_server` writes them into the server's configuration,
and :class:`CredentialStore` keeps the seeds on disk.

Roles (``docs/security.md`` has the threat model)
=================================================

``admin``
    Everything: the operator (``shoal up``'s own connection, the local CLI, stream
    declaration, tickets, drains, repairs). Acts for any user (command token ``@admin``).
``client`` (one identity per user ``U``)
    Sends commands on ``<p>.cmd.<command>.U`` only, so admission knows the sender is
    ``U`` from the subject the server let through; reads the event log (every
    job's events) through JetStream consumers, and admission's view of it with
    queries on ``<p>.query.<what>.U`` (:mod:`shoal.queries`; any job, as the log).
    Never publishes an event, never purges or deletes a stream, KV bucket or consumer.
``admission``, ``allocator``, ``placer``, ``profiler``, ``trader``
    Each appends only the event types it owns (:data:`EVENT_OWNERS`): only the
    allocator appends ``SharesDecided``, only the placer ``PlacementDecided``. They may
    create (not update, purge or delete) streams, keep durable consumers, and write
    their own leader-lease key; only the allocator writes the cluster snapshot, and
    only the profiler its own (object store ``<TOKEN>_PROFILER_SNAPSHOTS``).
``node`` (one identity per node ``N``)
    Publishes only ``N``'s ``NodeRegistered`` and ``GpuHealth`` to the log and ``N``'s
    ``NodeHeartbeat`` to the bounded beats stream (``<p>.beat.N``; heartbeats never go
    to the log, :data:`OFF_LOG`); reads the log (its orders are the placements in it).
``sidecar`` (one identity per node ``N``, for the sidecars that node runs)
    Publishes what a trainer reports about a job (progress, completion, the
    reconfiguration phases) and talks to the sidecars of the same job on other
    nodes (``<p>.sidecar.>``), with its per-job leader lease. As a static identity
    (``callout_issuer=None``, e.g. ``shoal nats-config --no-callout``) it is not
    narrowed to one job. With the auth callout (the default of ``shoal up``, ``shoal
    nats-config`` and ``shoal creds k8s``) it is no user of the server at all: the
    node daemon signs with its seed a token per sidecar naming the job
    (:mod:`shoal.callout`), and each sidecar connects as an identity allowed that
    job's subjects only (:func:`sidecar_job_permissions`).
``authorizer`` (the callout service, ``shoal run authorizer``)
    Alone may subscribe to :data:`CALLOUT_SUBJECT` and answer its requests; reads the log
    (which job is placed where).
``revoker`` (the authorizer's second connection)
    The one user of the server's system account (``$SYS``, :data:`SYSTEM_ACCOUNT`), so
    it reaches none of shoal's subjects. It may only list connections
    (:data:`REVOKER_SUBJECTS`: the server's ``CONNZ``) and end one (``KICK``): the
    authorizer ends the connection of a sidecar whose job has left its node, which the
    callout alone judges only when it connects (:mod:`shoal.callout`).

Every identity reads replies only on its own inbox prefix (``_INBOX.<name>.``), so
no one can read, or answer, another identity's requests.

Prefix wildcards: :func:`permissions` takes the installation's prefix; the test
fixtures' shared server, where each test has a prefix of its own, uses ``*``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import msgspec

from shoal import events as ev

Role = Literal[
    "admin",
    "client",
    "admission",
    "allocator",
    "placer",
    "profiler",
    "trader",
    "node",
    "sidecar",
    "authorizer",
    "revoker",
]
SERVICE_ROLES: tuple[Role, ...] = ("admission", "allocator", "placer", "profiler", "trader")
ROLES: tuple[Role, ...] = ("admin", "client", *SERVICE_ROLES, "node", "sidecar", "authorizer", "revoker")
CALLOUT_ROLES: tuple[Role, ...] = ("authorizer", "revoker")
"""The identities of the auth callout's service (:meth:`CredentialStore.ensure_callout`)."""

SYSTEM_ACCOUNT = "$SYS"
"""nats-server's system account (its default name): where the ``revoker`` is a user."""

REVOKER_SUBJECTS = (
    "$SYS.REQ.SERVER.PING.CONNZ",
    "$SYS.REQ.SERVER.*.CONNZ",
    "$SYS.REQ.SERVER.*.KICK",
)
"""The system requests the ``revoker`` may make: list every server's connections, one
server's (a further page), end one connection (nats-server 2.10+)."""

CALLOUT_SUBJECT = "$SYS.REQ.USER.AUTH"
"""Where the server sends its authorization requests (auth callout, :mod:`shoal.callout`):
only the ``authorizer`` may subscribe; the server itself forbids publishing there."""

ISSUER = "callout-issuer"
"""File name (``<ISSUER>.nk``) of the account key that signs the callout's answers."""

ADMIN_TOKEN = "@admin"
"""Command-subject token of the admin: acts for any user (not a valid user name)."""

COMMANDS = ("submit_job", "cancel_job", "set_tickets", "set_user_limits")

QUERY_REPLY_PARTS = 64
"""Messages admission may send in answer to one request (:data:`shoal.queries.MAX_PARTS`)."""

#: Which role appends which event type. An event type nobody owns cannot be appended
#: by anyone but the admin (a test checks that every event type has an owner).
EVENT_OWNERS: dict[Role, tuple[type[ev.Event], ...]] = {
    "admission": (ev.JobSubmitted, ev.JobRejected, ev.JobCancelled, ev.TicketsSet, ev.UserRegistered),
    "allocator": (ev.SharesDecided, ev.NodeLost),
    "placer": (ev.PlacementDecided, ev.ReconfigurationRequested),
    "profiler": (ev.ThroughputModelUpdated, ev.ConvergenceEstimated),
    "trader": (ev.TradeExecuted, ev.TradeUndone),
    "node": (ev.NodeRegistered, ev.NodeHeartbeat, ev.GpuHealth),
    "sidecar": (
        ev.JobStarted,
        ev.ProgressReported,
        ev.JobCompleted,
        ev.JobFailed,
        ev.ReconfigurationStarted,
        ev.ReconfigurationPhase,
        ev.ReconfigurationCompleted,
        ev.ReconfigurationCancelled,
        ev.ReconfigurationFailed,
    ),
    "admin": (ev.NodeDrained,),
}

OFF_LOG: tuple[type[ev.Event], ...] = (ev.NodeHeartbeat,)
"""Event types their owner publishes outside the event log: a node's heartbeats go to
the bounded beats stream (:meth:`shoal.bus.Names.beat`), so nobody but the admin may
append one to the log."""

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}\Z")


class AuthError(ValueError):
    """An identity or credentials file that cannot be used; the message says why."""


class Identity(msgspec.Struct, frozen=True, kw_only=True):
    """One authenticated party: its role, what it stands for (the user of a client,
    the node of a node or sidecar) and its public nkey."""

    name: str
    role: Role
    subject: str = ""
    """The user (``client``) or node id (``node``, ``sidecar``); empty otherwise."""
    public_key: str = ""
    mqtt_password_hash: str = ""
    """bcrypt hash of a ``client``'s MQTT password (MQTT cannot use nkeys); empty: no MQTT."""


def identity_name(role: Role, subject: str = "") -> str:
    """The file and inbox name of an identity: ``admin``, ``allocator``, ``user-alice``,
    ``node-n1``, ``sidecar-n1``.

    Raises:
        AuthError: an unknown role, or a subject a role needs but lacks.
    """
    if role not in ROLES:
        raise AuthError(f"unknown role {role!r}; roles: {', '.join(ROLES)}")
    if role in ("client", "node", "sidecar"):
        if not _NAME.match(subject or ""):
            raise AuthError(
                f"a {role} identity needs a name of 1-64 letters, digits, '_' or '-', got {subject!r}"
            )
        return f"{'user' if role == 'client' else role}-{subject}"
    return role


def inbox_prefix(name: str) -> str:
    """The reply-subject prefix an identity uses (and alone may subscribe under)."""
    return f"_INBOX.{name}"


def event_subject(cls: type[ev.Event], prefix: str, key: str = "*") -> str:
    """The subject (pattern) events of ``cls`` are published on, for one key or ``*``."""
    tag = cls.__struct_config__.tag
    assert isinstance(tag, str)
    if cls.key_field is None:
        return f"{prefix}.{tag}"
    head, _, tail = tag.partition(".")
    name = tail if head == cls.aggregate else tag
    return f"{prefix}.{cls.aggregate}.{key}.{name}"


# JetStream API subjects (https://docs.nats.io/reference/reference-protocols/nats_api_reference).
_JS_READ = [
    "$JS.API.INFO",
    "$JS.API.STREAM.INFO.*",
    "$JS.API.STREAM.NAMES",
    "$JS.API.STREAM.LIST",
    "$JS.API.STREAM.MSG.GET.*",
    "$JS.API.DIRECT.GET.*",
    "$JS.API.DIRECT.GET.*.>",
    "$JS.API.CONSUMER.CREATE.*",
    "$JS.API.CONSUMER.INFO.*.*",
    "$JS.API.CONSUMER.MSG.NEXT.*.*",
]
"""Read the log through ephemeral consumers and direct gets. Only the unnamed form of
``CONSUMER.CREATE`` (``$JS.API.CONSUMER.CREATE.<stream>``): the server refuses a durable
configuration there, while the named form (``...CREATE.<stream>.<name>[.<filter>]``)
would let any reader keep a durable consumer for ever. Nothing shipped names one."""

_JS_WORKER = ["$JS.API.CONSUMER.NAMES.*", "$JS.FC.>"]
"""What a sidecar needs besides reading: list consumers, answer the flow control of an
ordered (KV watch) consumer. No stream creation (the services create the buckets its
lease and rendezvous use, :meth:`shoal.bus.Bus.declare`), no consumer deletion."""


def _js_service(prefix: str) -> list[str]:
    """What a service needs besides reading: also create the installation's own streams
    and buckets when they are not there yet (never update, purge or delete one), each by
    its exact name (:func:`stream_names`). So a service identity cannot create a stream of
    another name, such as one capturing ``<prefix>.cmd.>`` (whose ack would answer every
    client's command, and which would keep the commands for it to read); the installation's
    own names exist from the first start on, and a create of an existing name with another
    configuration is refused by the server. With the ``*`` prefix (one server shared by
    many installations: the test suite's) no exact name can be written, so any stream
    name is allowed there.

    No service keeps a durable consumer or deletes one: its replay consumers are ephemeral
    and the server removes them after 30 s without a pull
    (:meth:`shoal.bus.Bus.replay_batches`), so neither durable creation nor
    ``CONSUMER.DELETE`` is granted (a service could otherwise delete another's consumer)."""
    if prefix == "*":
        return ["$JS.API.STREAM.CREATE.*", *_JS_WORKER]
    return [*(f"$JS.API.STREAM.CREATE.{name}" for name in stream_names(prefix)), *_JS_WORKER]


def stream_names(prefix: str) -> list[str]:
    """The JetStream stream names of every stream and bucket of the installation with
    subject ``prefix``: the event, control, beats and dead-letter streams, the leader
    leases' and the sidecars' rendezvous KV buckets (``KV_``), and the two snapshot object
    stores (``OBJ_``); see :class:`shoal.bus.Names`."""
    from shoal.bus import Names

    n = Names(prefix)
    return [
        n.events_stream,
        n.ctl_stream,
        n.beats_stream,
        n.dlq_stream,
        f"KV_{n.lease_bucket}",
        f"KV_{n.train_meta_bucket}",
        f"OBJ_{n.snapshot_bucket}",
        f"OBJ_{n.profiler_snapshot_bucket}",
    ]


_JS_DENY = [
    "$JS.API.STREAM.PURGE.*",
    "$JS.API.STREAM.DELETE.*",
    "$JS.API.STREAM.UPDATE.*",
    "$JS.API.STREAM.MSG.DELETE.*",
    "$JS.API.STREAM.SNAPSHOT.*",
    "$JS.API.STREAM.RESTORE.*",
    "$JS.API.ACCOUNT.PURGE.*",
    "$JS.API.SERVER.>",
    "$JS.API.META.>",
    "$JS.API.CONSUMER.DELETE.*.*",
    "$JS.API.CONSUMER.DURABLE.CREATE.*.*",
    "$JS.API.CONSUMER.CREATE.*.>",
]
"""Destructive JetStream API calls, and durable consumers (which outlive their
creator); never allowed to anyone but the admin."""


def _token(prefix: str) -> str:
    return prefix if prefix == "*" else re.sub(r"[^A-Za-z0-9]", "_", prefix).upper()


def permissions(identity: Identity, prefix: str = "shoal") -> dict[str, Any]:
    """The NATS permission block (``publish``/``subscribe`` allow and deny lists,
    ``allow_responses``) of ``identity`` in the installation with subject ``prefix``
    (``*``: any single-token prefix)."""
    role = identity.role
    if role == "admin":
        # Everything but the callout's requests (which carry the sidecars' tokens).
        return {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"], "deny": [CALLOUT_SUBJECT]}}
    p = prefix
    sub: list[str] = [f"{inbox_prefix(identity.name)}.>"]
    pub: list[str] = list(_JS_READ)
    deny_pub: list[str] = list(_JS_DENY)
    out: dict[str, Any] = {}
    if role == "client":
        user = identity.subject
        pub += [f"{p}.cmd.{c}.{user}" for c in COMMANDS]
        # MQTT devices of this user (NATS maps MQTT topic a/b/c to subject a.b.c).
        pub.append(f"{p}.mqtt.submit.{user}")
        sub.append(f"{p}.mqtt.result.{user}")
        # Reads from admission's materialised view (shoal.queries), as itself only.
        pub.append(f"{p}.query.*.{user}")
    elif role == "authorizer":
        sub.append(CALLOUT_SUBJECT)
        out["allow_responses"] = {"max": 1}
    elif role == "revoker":
        # A user of the system account: none of the JetStream API, only these requests.
        return {"publish": {"allow": list(REVOKER_SUBJECTS)}, "subscribe": {"allow": sub}}
    elif role == "node":
        node = identity.subject
        pub += [event_subject(cls, p, node) for cls in EVENT_OWNERS["node"] if cls not in OFF_LOG]
        pub.append(f"{p}.beat.{node}")  # its own heartbeats (beats stream, one kept per node)
        pub.append(f"{p}.dlq.>")  # a reader dead-letters what it cannot decode (shoal.bus)
    else:
        pub += _JS_WORKER if role == "sidecar" else _js_service(p)
        pub += [event_subject(cls, p) for cls in EVENT_OWNERS[role]]
        pub.append(f"{p}.dlq.>")
        # Leader leases (KV bucket <TOKEN>_LEASES), one key per role.
        lease_key = "train.>" if role == "sidecar" else role
        pub.append(f"$KV.*.{lease_key}")
        if role == "sidecar":
            # Cross-node worker starts; the job's lease and its rendezvous metadata are
            # both keys train.<job> (lease bucket and <TOKEN>_LEASES_TRAIN_META).
            pub.append(f"{p}.sidecar.>")
            sub.append(f"{p}.sidecar.>")
            # ... whose answers go to the asking sidecar's inbox: one reply per request
            # received (services/trainer_sidecar/remote.py), no other inbox.
            out["allow_responses"] = {"max": 1}
        elif role == "allocator":
            # The cluster snapshot every service starts from (object store) is the leading
            # allocator's to write; the others only read it. Chunks are replaced, so old
            # ones are purged: deny beats allow in NATS, so the blanket purge denial gives
            # way to an allow list that names only the snapshot bucket's stream.
            pub += [f"$O.{_token(p)}_SNAPSHOTS.>", f"$JS.API.STREAM.PURGE.OBJ_{_token(p)}_SNAPSHOTS"]
            deny_pub.remove("$JS.API.STREAM.PURGE.*")
        elif role == "profiler":
            # Its own snapshot (ProfileBook + the state it folds), in a bucket of its own:
            # it can neither write nor purge the cluster snapshot everyone else trusts.
            bucket = f"{_token(p)}_PROFILER_SNAPSHOTS"
            pub += [f"$O.{bucket}.>", f"$JS.API.STREAM.PURGE.OBJ_{bucket}"]
            deny_pub.remove("$JS.API.STREAM.PURGE.*")
        if role == "admission":
            sub += [f"{p}.cmd.>", f"{p}.mqtt.submit.*", f"{p}.query.>"]
            pub += [f"{p}.cmd.submit_job.*", f"{p}.mqtt.result.*"]
            # Replies only to a request it received: one per command, up to QUERY_REPLY_PARTS
            # messages for a query whose answer is larger than one message (shoal.queries).
            out["allow_responses"] = {"max": QUERY_REPLY_PARTS}
    out["publish"] = {"allow": pub, "deny": deny_pub}
    out["subscribe"] = {"allow": sub}
    return out


def callout_admits(identity: Identity) -> bool:
    """Whether the auth callout may admit ``identity`` by its nkey, when the server's
    running configuration does not list it yet (one ``shoal creds add`` made under
    ``shoal up``, :mod:`shoal.callout`): any identity of the global account but the
    ``sidecar`` keys (under the callout they only sign tokens) and the ``authorizer``
    (it answers the callout), and not the ``revoker`` (the system account's)."""
    return identity.role != "sidecar" and identity.role not in CALLOUT_ROLES and bool(identity.public_key)


_NO_HASH = "$2b$10$" + "." * 53
"""A well-formed bcrypt hash no password matches: checked when no identity has the user
name an MQTT device gave, so that an unknown name costs the same as a wrong password."""


def mqtt_identity(identities: Iterable[Identity], user: str, password: str) -> Identity | None:
    """The identity whose MQTT login is ``user`` (its subject) and ``password`` (checked
    against its bcrypt hash), or None. Costs one bcrypt check (tens of ms) either way:
    an unknown user is checked against a hash nothing matches."""
    import bcrypt

    ident = next((i for i in identities if i.mqtt_password_hash and i.subject == user), None)
    hashed = ident.mqtt_password_hash if ident is not None else _NO_HASH
    try:
        ok = bcrypt.checkpw(password.encode(), hashed.encode())
    except ValueError:  # a malformed stored hash: no login
        ok = False
    return ident if ok and ident is not None else None


def sidecar_job_permissions(job_id: str, node_id: str, prefix: str = "shoal") -> dict[str, Any]:
    """The permissions of the sidecar of job ``job_id`` on node ``node_id`` (the auth
    callout's identity, :mod:`shoal.callout`): the ``sidecar`` role narrowed to that one
    job's event subjects, its ``train.<job>`` lease and rendezvous keys and
    ``<p>.sidecar.<job>.>``, with replies on ``_INBOX.sidecar.<node>.<job>.``.

    Raises:
        AuthError: an id that is not a subject token.
    """
    from shoal.ids import is_subject_token

    if not (is_subject_token(job_id) and is_subject_token(node_id)):
        raise AuthError(f"job and node ids must be subject tokens: {job_id!r}, {node_id!r}")
    p = prefix
    pub = [*_JS_READ, *_JS_WORKER]
    pub += [event_subject(cls, p, job_id) for cls in EVENT_OWNERS["sidecar"]]
    pub += [f"{p}.dlq.>", f"$KV.*.train.{job_id}", f"{p}.sidecar.{job_id}.>"]
    sub = [f"_INBOX.sidecar.{node_id}.{job_id}.>", f"{p}.sidecar.{job_id}.>"]
    return {
        "publish": {"allow": pub, "deny": list(_JS_DENY)},
        "subscribe": {"allow": sub},
        # Answers to the job's other sidecars (spawn, adopt, status: a reply to a request
        # it received on sidecar.<job>.>, whose reply subject is the asker's inbox).
        "allow_responses": {"max": 1},
    }


def authorization_block(
    identities: Iterable[Identity],
    prefix: str = "shoal",
    *,
    callout_issuer: str | None = None,
    timeout_s: float = 5.0,
) -> str:
    """The ``authorization { users: [...] }`` section of a nats-server configuration
    (JSON, which the server's configuration format accepts), after an ``accounts``
    section with the system account's users when ``identities`` has a ``revoker``
    (every other identity is in the global account).

    With ``callout_issuer`` (the public account nkey that signs the callout's answers)
    the section also enables the auth callout: every connection that is not one of
    ``identities`` (all of which are ``auth_users``: the server asks the callout about
    any other user, even one it authenticated itself) is judged by the ``authorizer``
    (:mod:`shoal.callout`), and the static ``sidecar`` identities are left out of the
    users: their keys only sign sidecar tokens. ``timeout_s`` bounds a connection's
    authentication, the callout's answer included."""
    users: list[dict[str, Any]] = []
    system: list[dict[str, Any]] = []
    bypass: list[str] = []
    for ident in identities:
        if callout_issuer is not None and ident.role == "sidecar":
            continue
        perms = permissions(ident, prefix)
        if ident.public_key:
            (system if ident.role == "revoker" else users).append(
                {"nkey": ident.public_key, "permissions": perms}
            )
            bypass.append(ident.public_key)
        if ident.mqtt_password_hash:
            users.append({"user": ident.subject, "password": ident.mqtt_password_hash, "permissions": perms})
            bypass.append(ident.subject)
    block: dict[str, Any] = {"users": users}
    if callout_issuer is not None:
        block["timeout"] = timeout_s
        block["auth_callout"] = {"issuer": callout_issuer, "auth_users": bypass}
    accounts = ""
    if system:
        accounts = "accounts: " + json.dumps({SYSTEM_ACCOUNT: {"users": system}}, indent=2) + "\n"
    return accounts + "authorization: " + json.dumps(block, indent=2) + "\n"


# ---------------------------------------------------------------------------
# Credentials on disk
# ---------------------------------------------------------------------------

MANIFEST = "identities.json"


class CredentialStore:
    """A directory of nkey seeds (``<name>.nk``, mode 0600) and a manifest of the
    identities (public keys only), in a directory of mode 0700.

    ``shoal up`` keeps one in ``<state_dir>/creds``; processes find their seed there or
    through ``NATS_CREDS``/``SHOAL_NATS_CREDS``.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)

    def _manifest(self) -> dict[str, Identity]:
        path = self.directory / MANIFEST
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return {}
        items = msgspec.json.decode(raw, type=list[Identity])
        return {i.name: i for i in items}

    def identities(self) -> list[Identity]:
        """Every identity the store holds, by name."""
        return sorted(self._manifest().values(), key=lambda i: i.name)

    def path(self, name: str) -> Path:
        """The seed file of identity ``name``."""
        return self.directory / f"{name}.nk"

    def ensure(self, role: Role, subject: str = "", *, mqtt_password: str | None = None) -> Path:
        """The seed file of the identity for ``role``/``subject``, made if missing.

        Raises:
            AuthError: the role or subject is not valid.
        """
        import nkeys

        name = identity_name(role, subject)
        self.directory.mkdir(parents=True, exist_ok=True)
        os.chmod(self.directory, 0o700)
        manifest = self._manifest()
        seed_path = self.path(name)
        ident = manifest.get(name)
        if ident is None or not seed_path.exists():
            seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
            public = nkeys.from_seed(bytearray(seed)).public_key.decode()
            _write_private(seed_path, seed + b"\n")
            ident = Identity(name=name, role=role, subject=subject, public_key=public)
        if mqtt_password is not None:
            import bcrypt

            hashed = bcrypt.hashpw(mqtt_password.encode(), bcrypt.gensalt(rounds=10)).decode()
            ident = msgspec.structs.replace(ident, mqtt_password_hash=hashed)
        if manifest.get(name) != ident:
            manifest[name] = ident
            _write_private(
                self.directory / MANIFEST,
                msgspec.json.format(msgspec.json.encode(sorted(manifest.values(), key=lambda i: i.name))),
            )
        return seed_path

    def ensure_issuer(self) -> Path:
        """The seed file of the account key that signs the auth callout's answers
        (:data:`ISSUER`), made if missing. It is no identity: nobody connects with it."""
        import nkeys

        self.directory.mkdir(parents=True, exist_ok=True)
        os.chmod(self.directory, 0o700)
        path = self.path(ISSUER)
        if not path.exists():
            _write_private(path, nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_ACCOUNT) + b"\n")
        return path

    def ensure_callout(self) -> None:
        """Everything the auth callout's service needs, made if missing: the issuer's
        key (:meth:`ensure_issuer`) and the ``authorizer`` and ``revoker`` identities."""
        self.ensure_issuer()
        for role in CALLOUT_ROLES:
            self.ensure(role)

    def issuer_public_key(self) -> str | None:
        """The public key of :meth:`ensure_issuer`'s seed; None when there is none."""
        import nkeys

        try:
            seed = self.path(ISSUER).read_bytes().strip()
        except FileNotFoundError:
            return None
        return bytes(nkeys.from_seed(bytearray(seed)).public_key).decode()

    def sidecar_keys(self) -> dict[str, str]:
        """node id -> public key of its ``sidecar-<node>`` identity (the keys that sign
        sidecar tokens, :mod:`shoal.callout`)."""
        return {i.subject: i.public_key for i in self.identities() if i.role == "sidecar" and i.public_key}


def _write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically, readable by the owner only."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def name_of_creds(path: str | os.PathLike[str]) -> str:
    """The identity name a seed file stands for (its file name without ``.nk``)."""
    return Path(path).name.removesuffix(".nk")


def user_of_creds(path: str | os.PathLike[str] | None) -> str | None:
    """The user a client seed file authenticates as; ``None`` for the admin or no file."""
    if path is None:
        return None
    name = name_of_creds(path)
    return name.removeprefix("user-") if name.startswith("user-") else None


# ---------------------------------------------------------------------------
# Who may send which command
# ---------------------------------------------------------------------------


def command_subject(prefix: str, command: str, sender: str) -> str:
    """``<prefix>.cmd.<command>.<sender>``: the subject a command is sent on; the
    server lets a client publish only with its own user as ``sender``
    (:func:`permissions`), the admin with any, ``@admin`` included."""
    return f"{prefix}.cmd.{command}.{sender}"


def authorize_command(cmd: ev.Command, sender: str, job_owner: str | None = None) -> tuple[str, str] | None:
    """Whether ``sender`` (the command subject's last token) may send ``cmd``:
    None when it may, else ``(code, message)``.

    Rules: the admin (``@admin``) may send anything. A user submits only as itself
    (``user_mismatch``), cancels only its own jobs (``not_owner``; ``job_owner`` is the
    job's user, None for an unknown job, which admission reports itself), and may
    not set tickets or limits (``forbidden``)."""
    if sender == ADMIN_TOKEN:
        return None
    if isinstance(cmd, ev.SubmitJob):
        if cmd.spec.user != sender:
            return (
                "user_mismatch",
                f"authenticated as user {sender!r}, but the job spec names user {cmd.spec.user!r}",
            )
        return None
    if isinstance(cmd, ev.CancelJob):
        if job_owner is not None and job_owner != sender:
            return ("not_owner", f"job {cmd.job_id!r} belongs to another user; {sender!r} may not cancel it")
        return None
    return ("forbidden", f"{cmd.name} is an administrator's command; user {sender!r} may not send it")
