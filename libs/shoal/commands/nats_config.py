"""``shoal nats-config DIR``: the configuration and credentials of a NATS cluster for
shoal on several hosts or containers (the compose stack's one-shot ``nats-config``
service runs it).

It writes three directories, each readable by its owner only:

``DIR/server``
    ``<server>.conf`` for each of ``--servers`` (:func:`shoal.nats_config.server_config`:
    JetStream, routes with a password of their own, MQTT, and every identity's
    permissions) and ``route.password``. Only the NATS servers need it.
``DIR/creds``
    The nkey seeds of the services (admission, allocator, placer, profiler, trader,
    authorizer) and of each node of ``--nodes`` (``node-<n>.nk`` for its daemon,
    ``sidecar-<n>.nk`` for its sidecars), the auth callout issuer's account seed
    (``callout-issuer.nk``) and the manifest of their public keys. The service and
    node-daemon containers need it.
``DIR/operator``
    The admin's seed and each user's of ``--users`` (``user-<u>.nk``, and with
    ``--mqtt`` an MQTT password in ``user-<u>.mqtt``). Hand these to the people; no
    service needs them.

``DIR/creds.d/<container>`` (with ``--split``)
    The same seeds again, one directory per container that needs them: each service's
    own (``admission/admission.nk``, ...) and, for each node, its daemon's and its
    sidecars' (``node-<n>/node-<n>.nk`` and ``sidecar-<n>.nk``) and the authorizer's
    (``authorizer/authorizer.nk``, ``revoker.nk``, ``callout-issuer.nk`` and ``identities.json``
    with every identity's public key and MQTT password hash, no seed: the ``sidecar-<n>``
    keys verify the sidecar tokens, and the others let the callout admit an identity the
    running servers do not list yet). The
    compose stack gives each container a volume with its directory only, so a service
    that is broken into holds its own identity and no other (``DIR/creds`` is then
    mounted by no service).

Per-job sidecar identities (the default; ``--no-callout`` turns them off): every
server's configuration enables the NATS auth callout (:mod:`shoal.callout`) with the
issuer's public key, and lists every static identity in ``auth_users``, the sidecars'
excepted: ``sidecar-<n>`` is no user of the cluster, its seed only signs the tokens the
node daemon (``SHOAL_SIDECAR_TOKENS=true``) gives its sidecars, and ``shoal run
authorizer`` answers each sidecar's connect with an identity of its one job. With
``--no-callout`` the sidecars connect as the static ``sidecar-<n>`` identity, which may
report for any job.

``--password-file PATH`` also makes a random password in ``PATH`` (e.g. the compose
stack's Grafana admin password).

``--sync-interval``, ``--tls-cert``/``--tls-key`` (``{server}`` in a path is the server's
name) and ``--tls-ca`` go into every server's configuration, so running the command again
(to add a node or a user) keeps them: give them again each time.

Running it again keeps every seed and password it made before and adds what is new.
With the callout (and ``--split``), a new user or node connects at once, without
touching the servers: it is not in their running configuration, so the server asks the
callout, and ``shoal run authorizer`` admits it by its nkey (or MQTT password) from the
``identities.json`` it reads at each request, with its role's permissions (as ``shoal
creds add`` under ``shoal up``). The servers list it statically from their next restart
(nats-server does not reload a changed ``auth_callout`` block, so a changed password
of an existing identity still needs the servers restarted one at a time). Without the
callout, have each server reload its regenerated configuration (SIGHUP).
"""

from __future__ import annotations

import argparse
import os
import secrets
from pathlib import Path
from typing import Any

from shoal.cli import CommandError


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "nats-config",
        help="write a NATS cluster's server configurations and every identity's credentials",
    )
    p.add_argument("directory", help="where to write server/, creds/ and operator/")
    p.add_argument("--servers", default="nats-1,nats-2,nats-3", help="server host names, comma-separated")
    p.add_argument("--cluster", default="shoal", help="the cluster's name")
    p.add_argument("--prefix", default="shoal", help="the installation's subject prefix")
    p.add_argument(
        "--nodes", default="", help="node ids, comma-separated (a daemon and sidecar identity each)"
    )
    p.add_argument("--users", default="", help="user names, comma-separated (a client identity each)")
    p.add_argument("--mqtt", action="store_true", help="enable MQTT and give each user an MQTT password")
    p.add_argument("--store-dir", default="/var/lib/shoal/data", help="JetStream store of each server")
    p.add_argument(
        "--split",
        action="store_true",
        help="also write each container's seeds into a directory of its own (DIR/creds.d/<container>)",
    )
    p.add_argument(
        "--no-callout",
        dest="callout",
        action="store_false",
        help="no per-job sidecar identities: sidecars connect as their node's static sidecar identity",
    )
    p.add_argument(
        "--sync-interval",
        metavar="DURATION",
        help="JetStream's fsync interval on every server (10s, 1s, always; nats-server's default: 2m)",
    )
    p.add_argument(
        "--tls-cert",
        metavar="PATH",
        help="each server's certificate, as the server sees it ({server} is its name): "
        "clients must then use tls:// (needs --tls-key)",
    )
    p.add_argument("--tls-key", metavar="PATH", help="each server's private key, as for --tls-cert")
    p.add_argument(
        "--tls-ca",
        metavar="PATH",
        help="the CA that signed the servers' certificates, as the servers see it: the routes are TLS too",
    )
    p.add_argument(
        "--password-file",
        action="append",
        default=[],
        metavar="PATH",
        help="also make a random password in PATH if it has none (e.g. a dashboard's admin password)",
    )
    p.set_defaults(func=_run)


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def _secret(path: Path) -> str:
    """The secret kept in ``path``, made (letters and digits, 32 of them) if missing."""
    from shoal.auth import _write_private

    if path.exists():
        return path.read_text().strip()
    value = secrets.token_hex(16)
    _write_private(path, value.encode() + b"\n")
    return value


def _run(args: argparse.Namespace) -> int:
    import msgspec

    from shoal.auth import ISSUER, MANIFEST, SERVICE_ROLES, AuthError, CredentialStore, _write_private
    from shoal.nats_config import server_config

    out = Path(args.directory)
    servers = _names(args.servers)
    if not servers:
        raise CommandError("--servers names no server")
    dirs = {name: out / name for name in ("server", "creds", "operator")}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o700)
    services = CredentialStore(dirs["creds"])
    operator = CredentialStore(dirs["operator"])
    try:
        for role in SERVICE_ROLES:
            services.ensure(role)
        if args.callout:
            services.ensure_callout()
        for node in _names(args.nodes):
            services.ensure("node", node)
            services.ensure("sidecar", node)
        operator.ensure("admin")
        for user in _names(args.users):
            password_file = dirs["operator"] / f"user-{user}.mqtt"
            fresh = args.mqtt and not password_file.exists()
            password = _secret(password_file) if args.mqtt else None
            operator.ensure("client", user, mqtt_password=password if fresh else None)
    except (AuthError, PermissionError) as exc:
        raise CommandError(str(exc)) from None
    if args.split:
        groups: dict[str, list[str]] = {role: [role] for role in SERVICE_ROLES}
        for node in _names(args.nodes):
            groups[f"node-{node}"] = [f"node-{node}", f"sidecar-{node}"]
        if args.callout:
            groups["authorizer"] = ["authorizer", "revoker", ISSUER]
        for group, names in groups.items():
            target = out / "creds.d" / group
            target.mkdir(parents=True, exist_ok=True)
            if target.parent.stat().st_uid == os.getuid():  # not a runtime-made mount parent
                os.chmod(target.parent, 0o700)
            # Each is usually a volume of its own, whose root this user owns (podman gives
            # a new volume the container's user; the image makes the compose stack's).
            os.chmod(target, 0o700)
            for name in names:
                _write_private(target / f"{name}.nk", services.path(name).read_bytes())
            if group == "authorizer":
                # Every identity's public key (and MQTT password hash), no seed: the
                # sidecar keys verify sidecar tokens (CredentialStore.sidecar_keys), and an
                # identity added by running this again is admitted by the callout until the
                # servers next start with it listed (auth.callout_admits): no restart.
                keys = [*services.identities(), *operator.identities()]
                _write_private(target / MANIFEST, msgspec.json.format(msgspec.json.encode(keys)))
    route_password = _secret(dirs["server"] / "route.password")
    for path in args.password_file:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        _secret(Path(path))
    identities = [*services.identities(), *operator.identities()]
    issuer = services.issuer_public_key() if args.callout else None
    if bool(args.tls_cert) != bool(args.tls_key):
        raise CommandError("--tls-cert and --tls-key go together")
    for server in servers:
        tls = None
        if args.tls_cert:
            tls = (args.tls_cert.replace("{server}", server), args.tls_key.replace("{server}", server))
        try:
            text = server_config(
                server,
                servers=servers,
                identities=identities,
                route_password=route_password,
                cluster_name=args.cluster,
                prefix=args.prefix,
                store_dir=args.store_dir,
                mqtt=args.mqtt,
                callout_issuer=issuer,
                sync_interval=args.sync_interval,
                tls=tls,
                tls_ca=args.tls_ca,
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        _write_private(dirs["server"] / f"{server}.conf", text.encode())
    print(f"wrote {len(servers)} server configurations and {len(identities)} identities under {out}")
    return 0
