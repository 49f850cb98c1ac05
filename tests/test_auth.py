"""The pure side of authentication: who owns which event, each role's permissions,
command authorization, the entrypoint allowlist and the credential files."""

from __future__ import annotations

import asyncio
import stat
from pathlib import Path

import msgspec
import nats.errors
import nats.js.errors
import pytest
from shoal import admission, auth, codec
from shoal import events as ev
from shoal.bus import Bus, PermissionDenied
from shoal.client import Client
from shoal.nats_server import EmbeddedNats
from shoal.state import ClusterState


def event_types() -> list[type[ev.Event]]:
    out: list[type[ev.Event]] = []
    todo = list(ev.Event.__subclasses__())
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo += cls.__subclasses__()
    return out


def test_every_event_type_has_exactly_one_owner() -> None:
    owners: dict[type[ev.Event], list[str]] = {}
    for role, classes in auth.EVENT_OWNERS.items():
        for cls in classes:
            owners.setdefault(cls, []).append(role)
    assert {c for c in event_types() if isinstance(c.__struct_config__.tag, str)} == set(owners)
    assert all(len(roles) == 1 for roles in owners.values()), owners


def allowed(perms: dict[str, object], kind: str, subject: str) -> bool:
    """NATS's rule: an allow pattern matches and no deny pattern does."""

    def match(pattern: str, subj: str) -> bool:
        p, s = pattern.split("."), subj.split(".")
        for i, tok in enumerate(p):
            if tok == ">":
                return len(s) > i
            if i >= len(s) or (tok != "*" and tok != s[i]):
                return False
        return len(p) == len(s)

    block = perms[kind]
    assert isinstance(block, dict)
    return any(match(a, subject) for a in block.get("allow", [])) and not any(
        match(d, subject) for d in block.get("deny", [])
    )


@pytest.mark.parametrize(
    ("role", "who", "subject", "ok"),
    [
        ("allocator", "", "shoal.alloc.shares_decided", True),
        ("placer", "", "shoal.alloc.shares_decided", False),
        ("placer", "", "shoal.alloc.placement_decided", True),
        ("allocator", "", "shoal.alloc.placement_decided", False),
        ("admission", "", "shoal.job.j1.submitted", True),
        ("admission", "", "shoal.job.j1.completed", False),
        ("sidecar", "n1", "shoal.job.j1.completed", True),
        ("sidecar", "n1", "shoal.job.j1.submitted", False),
        # Heartbeats go to the bounded beats stream, never to the log (issue 21).
        ("node", "n1", "shoal.beat.n1", True),
        ("node", "n1", "shoal.beat.n2", False),
        ("node", "n1", "shoal.node.n1.heartbeat", False),
        ("node", "n1", "shoal.node.n1.registered", True),
        ("node", "n1", "shoal.node.n2.gpu_health", False),
        ("sidecar", "n1", "shoal.beat.n1", False),
        ("client", "alice", "shoal.beat.n1", False),
        ("allocator", "", "shoal.beat.n1", False),
        ("allocator", "", "$JS.API.DIRECT.GET.SHOAL_BEATS.shoal.beat.n1", True),
        ("node", "n1", "shoal.node.n1.lost", False),
        ("client", "alice", "shoal.cmd.submit_job.alice", True),
        ("client", "alice", "shoal.cmd.submit_job.bob", False),
        ("client", "alice", "shoal.cmd.set_tickets.@admin", False),
        ("client", "alice", "shoal.job.j1.completed", False),
        ("client", "alice", "$JS.API.STREAM.PURGE.SHOAL_EVENTS", False),
        ("client", "alice", "$JS.API.CONSUMER.DELETE.SHOAL_EVENTS.allocator", False),
        ("client", "alice", "$JS.API.CONSUMER.MSG.NEXT.SHOAL_EVENTS.x", True),
        ("allocator", "", "$JS.API.STREAM.PURGE.SHOAL_EVENTS", False),
        ("allocator", "", "$JS.API.STREAM.PURGE.OBJ_SHOAL_SNAPSHOTS", True),
        ("allocator", "", "$JS.API.STREAM.DELETE.SHOAL_EVENTS", False),
        ("allocator", "", "$KV.SHOAL_LEASES.allocator", True),
        # Services create the installation's own streams and buckets, by exact name only.
        ("allocator", "", "$JS.API.STREAM.CREATE.SHOAL_EVENTS", True),
        ("placer", "", "$JS.API.STREAM.CREATE.KV_SHOAL_LEASES", True),
        ("admission", "", "$JS.API.STREAM.CREATE.KV_SHOAL_LEASES_TRAIN_META", True),
        ("allocator", "", "$JS.API.STREAM.CREATE.OBJ_SHOAL_SNAPSHOTS", True),
        ("profiler", "", "$JS.API.STREAM.CREATE.OBJ_SHOAL_PROFILER_SNAPSHOTS", True),
        ("allocator", "", "$JS.API.STREAM.CREATE.AUDIT_CAPTURE", False),
        ("allocator", "", "$JS.API.STREAM.CREATE.KV_SHOAL_LEASES_60000MS", False),
        ("allocator", "", "$JS.API.STREAM.CREATE.OTHER_EVENTS", False),
        ("sidecar", "n1", "$JS.API.STREAM.CREATE.KV_SHOAL_LEASES", False),
        ("node", "n1", "$JS.API.STREAM.CREATE.SHOAL_EVENTS", False),
        ("allocator", "", "$KV.SHOAL_LEASES.placer", False),
        ("sidecar", "n1", "$KV.SHOAL_LEASES.train.j1", True),
        ("allocator", "", "$O.SHOAL_SNAPSHOTS.M.Y2x1c3Rlcg==", True),
        ("placer", "", "$O.SHOAL_SNAPSHOTS.M.Y2x1c3Rlcg==", False),
        ("placer", "", "$JS.API.STREAM.PURGE.OBJ_SHOAL_SNAPSHOTS", False),
        # The profiler's own snapshot, in a bucket apart (issue 21): its to write, no one else's.
        ("profiler", "", "$O.SHOAL_PROFILER_SNAPSHOTS.M.cHJvZmlsZXI=", True),
        ("profiler", "", "$O.SHOAL_PROFILER_SNAPSHOTS.C.abc", True),
        ("profiler", "", "$JS.API.STREAM.PURGE.OBJ_SHOAL_PROFILER_SNAPSHOTS", True),
        ("profiler", "", "$O.SHOAL_SNAPSHOTS.M.Y2x1c3Rlcg==", False),
        ("profiler", "", "$O.SHOAL_SNAPSHOTS.C.abc", False),
        ("profiler", "", "$JS.API.STREAM.PURGE.OBJ_SHOAL_SNAPSHOTS", False),
        ("profiler", "", "$JS.API.STREAM.PURGE.SHOAL_EVENTS", False),
        ("allocator", "", "$O.SHOAL_PROFILER_SNAPSHOTS.M.cHJvZmlsZXI=", False),
        ("allocator", "", "$JS.API.STREAM.PURGE.OBJ_SHOAL_PROFILER_SNAPSHOTS", False),
        ("placer", "", "$O.SHOAL_PROFILER_SNAPSHOTS.M.cHJvZmlsZXI=", False),
        ("sidecar", "n1", "$KV.SHOAL_LEASES_TRAIN_META.train.j1", True),
        ("sidecar", "n1", "$KV.SHOAL_LEASES.allocator", False),
        ("client", "alice", "shoal.query.jobs.alice", True),
        ("client", "alice", "shoal.query.state.alice", True),
        ("client", "alice", "shoal.query.jobs.bob", False),
        ("client", "alice", "shoal.query.jobs.@admin", False),
        ("node", "n1", "shoal.query.jobs.n1", False),
        ("allocator", "", "shoal.query.jobs.allocator", False),
    ],
)
def test_publish_permissions(role: auth.Role, who: str, subject: str, ok: bool) -> None:
    ident = auth.Identity(name=auth.identity_name(role, who), role=role, subject=who)
    assert allowed(auth.permissions(ident, "shoal"), "publish", subject) is ok


def test_subscriptions_are_limited_to_own_inbox() -> None:
    alice = auth.Identity(name="user-alice", role="client", subject="alice")
    perms = auth.permissions(alice)
    assert allowed(perms, "subscribe", "_INBOX.user-alice.x.y")
    assert not allowed(perms, "subscribe", "_INBOX.user-bob.x.y")
    assert not allowed(perms, "subscribe", "shoal.cmd.submit_job.bob")
    adm = auth.permissions(auth.Identity(name="admission", role="admission"))
    assert allowed(adm, "subscribe", "shoal.cmd.submit_job.bob")
    assert allowed(adm, "subscribe", "shoal.query.jobs.bob")
    # a reply to each request it received, in up to QUERY_REPLY_PARTS messages
    assert adm.get("allow_responses") == {"max": auth.QUERY_REPLY_PARTS}
    assert not allowed(perms, "subscribe", "shoal.query.jobs.bob")
    assert not allowed(perms, "subscribe", "shoal.query.>")
    for role in ("allocator", "placer", "node"):
        other = auth.permissions(auth.Identity(name=auth.identity_name(role, "n1"), role=role, subject="n1"))
        assert not allowed(other, "subscribe", "shoal.query.jobs.alice"), role


def test_authorize_command() -> None:
    spec = ev.JobSpec(user="alice", total_iterations=5)
    submit = ev.SubmitJob(spec=spec)
    assert auth.authorize_command(submit, "alice") is None
    assert auth.authorize_command(submit, auth.ADMIN_TOKEN) is None
    assert auth.authorize_command(submit, "bob")[0] == "user_mismatch"  # type: ignore[index]
    cancel = ev.CancelJob(job_id="j1")
    assert auth.authorize_command(cancel, "alice", job_owner="alice") is None
    assert auth.authorize_command(cancel, "bob", job_owner="alice")[0] == "not_owner"  # type: ignore[index]
    tickets = ev.SetTickets(user="alice", tickets=5)
    assert auth.authorize_command(tickets, "alice")[0] == "forbidden"  # type: ignore[index]
    assert auth.authorize_command(tickets, auth.ADMIN_TOKEN) is None


def test_entrypoints_come_from_the_operator() -> None:
    state = ClusterState()
    job = {"user": "alice", "total_iterations": 5}
    run = ev.SubmitJob(
        spec=msgspec.convert({**job, "entrypoint": ["python", "/opt/train.py", "--lr", "1"]}, ev.JobSpec)
    )
    closed = admission.decide_submit(state, run, "j1", admission.Limits())
    assert isinstance(closed, admission.Rejected) and closed.code == "entrypoint_not_allowed"
    limits = admission.Limits(entrypoints=(("python", "/opt/train.py"),), job_env=("NCCL_DEBUG",))
    assert isinstance(admission.decide_submit(state, run, "j1", limits), admission.Accepted)
    other = ev.SubmitJob(spec=msgspec.convert({**job, "entrypoint": ["python", "-c", "x"]}, ev.JobSpec))
    assert admission.decide_submit(state, other, "j2", limits).code == "entrypoint_not_allowed"  # type: ignore[union-attr]
    env = {"SHOAL_TRAIN_RECOVERY": "approximate", "NCCL_DEBUG": "INFO"}
    fine = ev.SubmitJob(spec=msgspec.convert({**job, "env": env}, ev.JobSpec))
    assert isinstance(admission.decide_submit(state, fine, "j3", limits), admission.Accepted)
    bad = ev.SubmitJob(spec=msgspec.convert({**job, "env": {"LD_PRELOAD": "/x.so"}}, ev.JobSpec))
    assert admission.decide_submit(state, bad, "j4", limits).code == "env_not_allowed"  # type: ignore[union-attr]


def test_credential_store(tmp_path: Path) -> None:
    store = auth.CredentialStore(tmp_path / "creds")
    seed = store.ensure("client", "alice", mqtt_password="pw")
    assert seed.read_bytes().startswith(b"SU")
    assert stat.S_IMODE(seed.stat().st_mode) == 0o600
    assert stat.S_IMODE(store.directory.stat().st_mode) == 0o700
    assert store.ensure("client", "alice") == seed  # kept, not remade
    [alice] = store.identities()
    assert (alice.role, alice.subject, alice.public_key[:1]) == ("client", "alice", "U")
    assert alice.mqtt_password_hash.startswith("$2")
    block = auth.authorization_block(store.identities())
    assert alice.public_key in block and "pw" not in block.replace(alice.mqtt_password_hash, "")
    with pytest.raises(auth.AuthError):
        store.ensure("client", "bad.name")
    assert auth.user_of_creds(seed) == "alice"


def self_signed(tmp_path: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 that is its own CA, made here (cert, key)."""
    import datetime as dt
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "shoal-test")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "server.pem", tmp_path / "server.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_path, key_path


@pytest.mark.integration
async def test_tls_with_a_certificate_made_here(tmp_path: Path) -> None:
    """With a certificate the server speaks only TLS: a client that verifies it with the
    CA connects (and is still authenticated by its nkey); a plain-TCP client does not."""
    from shoal.bus import Bus, NoServerError
    from shoal.nats_server import EmbeddedNats

    cert, key = self_signed(tmp_path)
    store = auth.CredentialStore(tmp_path / "creds")
    admin = str(store.ensure("admin"))
    with EmbeddedNats(
        store_dir=tmp_path / "js", creds_dir=store.directory, tls_cert=cert, tls_key=key
    ) as srv:
        assert srv.url.startswith("tls://")
        bus = await Bus.connect(srv.url, prefix="tlstest", creds=admin, tls_ca=str(cert))
        try:
            await bus.publish(ev.UserRegistered(user="alice"))
            assert await bus.last_seq() == 1
        finally:
            await bus.close()
        plain = srv.url.replace("tls://", "nats://")
        with pytest.raises(NoServerError):
            await Bus.connect(plain, prefix="tlstest", creds=admin, initial_connect_timeout_s=2.0)


@pytest.mark.integration
async def test_a_node_stores_only_its_own_heartbeat_and_none_in_the_log(
    nats_server: EmbeddedNats, bus: Bus, prefix: str, admin_creds: str
) -> None:
    """Issue 21: a node's heartbeats go to the bounded beats stream, on its own subject
    only; another node's subject, the log's heartbeat subject and a client are refused
    by the server (a real one, with the identities' permissions)."""
    from tests.conftest import add_identity

    node = await Bus.connect(nats_server.url, prefix=prefix, creds=add_identity(nats_server, "node", "hb1"))
    client = await Bus.connect(
        nats_server.url, prefix=prefix, creds=add_identity(nats_server, "client", "hbuser")
    )
    try:
        own = codec.wrap(ev.NodeHeartbeat(node_id="hb1", seq=1))
        await node.publish_beat(own)
        assert await bus.latest_beats(["hb1", "hb2"]) == {"hb1": own.at}
        with pytest.raises(PermissionDenied):
            await node.publish_beat(codec.wrap(ev.NodeHeartbeat(node_id="hb2")), timeout_s=2.0)
        with pytest.raises(PermissionDenied):
            await node.publish(ev.NodeHeartbeat(node_id="hb1"), timeout_s=2.0)
        with pytest.raises(PermissionDenied):
            await client.publish_beat(codec.wrap(ev.NodeHeartbeat(node_id="hb1", seq=2)), timeout_s=2.0)
        newer = codec.wrap(ev.NodeHeartbeat(node_id="hb1", seq=3))
        await node.publish_beat(newer)
        assert await bus.latest_beats(["hb1", "hb2"]) == {"hb1": newer.at}
        info = await bus.js.stream_info(bus.names.beats_stream)
        assert info.state.messages == 2, "both heartbeats kept (at most eight per node: tests/test_beats.py)"
        assert await bus.last_seq() == 0, "nothing reached the event log"
        # The SDK's nodes (`shoal nodes`) take the newest heartbeat from the beats stream
        # (no admission here: the view is a replay of the log, which has the registration).
        await node.publish(codec.wrap(ev.NodeRegistered(node_id="hb1", gpus=()), at=newer.at - 50))
        async with await Client.connect(nats_server.url, prefix, creds=admin_creds) as sdk:
            assert (await sdk.nodes())["hb1"].last_heartbeat_at == newer.at
    finally:
        await node.close()
        await client.close()


@pytest.mark.integration
async def test_a_sidecar_answers_the_requests_of_another_nodes_sidecar(
    nats_server: EmbeddedNats, prefix: str
) -> None:
    """A job's leading sidecar starts the workers of another node through that node's
    sidecar of the job (a request on ``<p>.sidecar.<job>.<node>.spawn``): the answer goes
    to the leader's inbox, which only a response permission lets the other identity
    publish to. Without it a job spanning two nodes never started under ``shoal up``
    (found by the real-mode fault suite). A sidecar still cannot publish into another
    identity's inbox unasked."""
    from tests.conftest import add_identity

    # Both identities first: each one added reloads the server, which must not happen
    # between the follower's subscription and the leader's request.
    leader_creds = add_identity(nats_server, "sidecar", "rq0")
    follower_creds = add_identity(nats_server, "sidecar", "rq1")
    leader = await Bus.connect(nats_server.url, prefix=prefix, creds=leader_creds, declare=False)
    follower = await Bus.connect(nats_server.url, prefix=prefix, creds=follower_creds, declare=False)
    try:

        async def answer(msg: object) -> None:
            await msg.respond(b"pid 42")  # type: ignore[attr-defined]

        await follower.nc.subscribe(f"{prefix}.sidecar.j1.rq1.spawn", cb=answer)
        await follower.nc.flush()
        # As the shipped leader does (services/trainer_sidecar/remote.py), a request that
        # meets no responders is asked again: twice in the full run (CI, load ~2 on 2
        # cores) the first one did, right after the reloads that admitted the two
        # identities, and never when the module ran alone; the server's log then says why.
        reply = None
        for _ in range(25):
            try:
                reply = await leader.nc.request(
                    f"{prefix}.sidecar.j1.rq1.spawn", b"start worker 1", timeout=5
                )
                break
            except nats.errors.NoRespondersError:
                await asyncio.sleep(0.2)
        assert reply is not None, f"no responders for 5 s; server log: {nats_server.log_tail()}"
        assert reply.data == b"pid 42"
        # Unasked: refused by the server, so nothing reaches the leader's inbox.
        got: list[bytes] = []
        inbox = leader.nc.new_inbox()

        async def keep(msg: object) -> None:
            got.append(msg.data)  # type: ignore[attr-defined]

        await leader.nc.subscribe(inbox, cb=keep)
        await leader.nc.flush()
        await follower.nc.publish(inbox, b"forged")
        await follower.nc.flush()
        await leader.nc.flush()
        assert got == []
    finally:
        await leader.close()
        await follower.close()


@pytest.mark.integration
async def test_a_reader_may_not_keep_a_consumer_past_the_streams_inactivity_bound(
    nats_server: EmbeddedNats, bus: Bus, prefix: str
) -> None:
    """Every identity may create ephemeral consumers (it reads that way); the event,
    control, beats and dead-letter streams bound how long one may outlive its last pull
    (``READER_MAX_INACTIVE_S``): a day is refused by the server, shoal's own 30 s is
    accepted, and a consumer that asks for nothing gets the bound."""
    from nats.js import api
    from shoal.bus import READER_MAX_INACTIVE_S

    from tests.conftest import add_identity

    client = await Bus.connect(
        nats_server.url, prefix=prefix, creds=add_identity(nats_server, "client", "lazyreader")
    )
    n = bus.names
    try:
        for stream in (n.events_stream, n.ctl_stream, n.beats_stream, n.dlq_stream):
            with pytest.raises(nats.js.errors.BadRequestError, match="inactive threshold exceeds"):
                await client.js.add_consumer(
                    stream, api.ConsumerConfig(ack_policy=api.AckPolicy.NONE, inactive_threshold=86400.0)
                )
            ok = await client.js.add_consumer(
                stream, api.ConsumerConfig(ack_policy=api.AckPolicy.NONE, inactive_threshold=30.0)
            )
            assert ok.config.inactive_threshold == 30.0
            unset = await client.js.add_consumer(stream, api.ConsumerConfig(ack_policy=api.AckPolicy.NONE))
            assert unset.config.inactive_threshold == READER_MAX_INACTIVE_S
            for name in (ok.name, unset.name):
                await bus.js.delete_consumer(stream, name)
    finally:
        await client.close()


@pytest.mark.integration
async def test_a_stream_whose_consumer_exceeds_the_bound_is_still_updated(
    nats_server: EmbeddedNats, prefix: str, admin_creds: str
) -> None:
    """A stream declared before the inactivity bound, with a consumer asking for longer:
    the declare does not fail (it would stop `shoal up` at the upgrade); it updates the
    rest and leaves the bound to a later declare, once that consumer is gone."""
    from nats.js import api
    from shoal.bus import READER_MAX_INACTIVE_S

    old = f"{prefix}x"
    bus = await Bus.connect(nats_server.url, prefix=old, creds=admin_creds)
    try:
        events = bus.names.events_stream
        info = await bus.js.stream_info(events)
        info.config.consumer_limits = None
        await bus.js.update_stream(info.config)  # as an older shoal declared it
        lazy = await bus.js.add_consumer(
            events, api.ConsumerConfig(ack_policy=api.AckPolicy.NONE, inactive_threshold=86400.0)
        )
        await bus.declare()
        deferred = (await bus.js.stream_info(events)).config.consumer_limits
        assert deferred is None or deferred.inactive_threshold is None
        await bus.js.delete_consumer(events, lazy.name)
        await bus.declare()
        limits = (await bus.js.stream_info(events)).config.consumer_limits
        assert limits is not None and limits.inactive_threshold == READER_MAX_INACTIVE_S
    finally:
        await bus.close()
